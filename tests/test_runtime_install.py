"""What a platform team installs is what runs (issue 31 item 1). The image's install steps (tools/install-image.sh
over the files the Dockerfile copies) make an environment of the runtime dependencies only, none of the test
extra's; each command runs from it as the image runs it, in an environment of its own (no PYTHONPATH, not from the
checkout): the webhook answers an AdmissionReview over TLS, the agent starts and records an allocation, `check`
reads DeviceClasses, and `check --cluster` and `reports --once` read a real kube-apiserver (etcd and kube-apiserver
only, tests/k8s_support.py)."""

from __future__ import annotations

import contextlib
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from agent_support import NODE, eventually, make_node, seed_api
from cryptography.hazmat.primitives import serialization
from k8s_support import api_server
from kubernetes import client
from scrubgate.certs.generate import generate_ca
from scrubgate.policies import names
from scrubgate.sanitizer_agent.kube import KubernetesClusterClient
from test_image import REPO, build_context
from webhook_support import client_cert, gpu_claim, make_tls_dir, review

from devcluster.controlplane import ControlPlane
from devcluster.processes import free_port

pytestmark = pytest.mark.timeout(600)

NIC_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "nic.example.com"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "nic.example.com"'}}]},
}
GPU_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    # A GPU class under a name the policy leaves out: SG009.
    "metadata": {"name": "imex.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]},
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's /opt/scrubgate: the runtime dependencies of scrubgate and its `gpu` extra, as the image has them."""
    root = tmp_path_factory.mktemp("runtime")
    source = build_context(root / "src")
    prefix = root / "opt" / "scrubgate"
    result = subprocess.run(
        ["sh", str(source / "tools" / "install-image.sh"), str(source), str(prefix)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(root)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    leaked = [
        name for name in ("pytest", "httpx", "hypothesis") if list(prefix.glob(f"lib/python*/site-packages/{name}"))
    ]
    assert not leaked, f"test packages in the runtime environment: {leaked}"
    return prefix


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with api_server(tmp_path_factory.mktemp("plane")) as running:
        yield running


def run_env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}


def scrubgate(installed: Path, tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(installed / "bin" / "scrubgate"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=run_env(tmp_path),
    )


@contextlib.contextmanager
def started(installed: Path, tmp_path: Path, *args: str | Path) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """`scrubgate ARGS` running; stopped with SIGTERM, and its exit status must then be 0. Yields the process
    and, once it has stopped, its stderr (one item)."""
    process = subprocess.Popen(
        [str(installed / "bin" / "scrubgate"), *map(str, args)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env=run_env(tmp_path),
    )
    output: list[str] = []
    try:
        yield process, output
    finally:
        process.send_signal(signal.SIGTERM)
        output.append(process.communicate(timeout=60)[1])
    assert process.returncode == 0, output[0]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_the_webhook_answers_an_admission_review_over_tls(installed: Path, tmp_path: Path):
    import httpx  # the test's client, not the webhook's environment

    tls = make_tls_dir(tmp_path / "tls")
    client_ca = generate_ca("scrubgate-apiserver-client-ca")
    (tmp_path / "client-ca.crt").write_bytes(client_ca.cert_pem)
    cert = client_cert(client_ca, tmp_path / "clients", "kube-apiserver")
    port, metrics_port = free_port(), free_port()
    args = ["webhook", "--host", "127.0.0.1", "--port", port, "--metrics-port", metrics_port]
    args += ["--tls-cert", tls.tls_cert, "--tls-key", tls.tls_key, "--client-ca", tmp_path / "client-ca.crt"]
    with started(installed, tmp_path, *args, "--audit-log", tmp_path / "audit.jsonl") as (webhook, _):
        eventually(
            lambda: answers(f"http://127.0.0.1:{metrics_port}/readyz"),
            "the webhook's /readyz",
            alive=lambda: webhook.poll() is None,
        )
        context = ssl.create_default_context(cafile=str(tls.ca_cert))
        context.load_cert_chain(*cert)
        retain = gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN})
        response = httpx.post(f"https://127.0.0.1:{port}/validate", json=review(retain), verify=context, timeout=10)
    assert response.status_code == 200, response.text
    answer = response.json()["response"]
    assert answer["allowed"] is False and "SG001" in answer["status"]["message"]


def test_the_agent_starts_and_records_an_allocation(installed: Path, plane: ControlPlane, tmp_path: Path):
    assert scrubgate(installed, tmp_path, "agent", "--help").returncode == 0
    node = make_node(tmp_path)
    key = tmp_path / "key.pem"
    key.write_bytes(
        node.signer.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    api = plane.admin_client()
    cluster = KubernetesClusterClient(api)
    seed_api(node, cluster, client.CoreV1Api(api))
    args = ["agent", "--node", NODE, "--gpu-backend", "simulated", "--simulated-root", node.root]
    args += ["--checkpoint", node.checkpoint, "--signing-key", key, "--key-id", node.signer.kid]
    args += ["--nvidia-checkpoint", "", "--metrics-port", "0", "--kubeconfig", plane.credentials["admin"].kubeconfig]

    def recorded() -> bool:
        claim = cluster.get_claim("team-a", "train") or {}
        return names.ANNOTATION_DEVICES in (claim["metadata"].get("annotations") or {})

    with started(installed, tmp_path, *args) as (agent, _):
        eventually(recorded, "the agent's record of the allocation", timeout=60, alive=lambda: agent.poll() is None)


def test_check_reads_device_classes(installed: Path, tmp_path: Path):
    """A DeviceClass's CEL selectors are parsed at run time, in the environment the image installs."""
    (tmp_path / "nic.yaml").write_text(yaml.safe_dump(NIC_CLASS))
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(GPU_CLASS))
    nic = scrubgate(installed, tmp_path, "check", "nic.yaml")
    assert nic.returncode == 0, nic.stdout + nic.stderr
    gpu = scrubgate(installed, tmp_path, "check", "gpu.yaml")
    assert gpu.returncode == 1 and "SG009" in gpu.stdout, gpu.stdout + gpu.stderr


def test_check_cluster_and_reports_once_read_the_api_server(installed: Path, plane: ControlPlane, tmp_path: Path):
    api = plane.admin_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    extensions = client.ApiextensionsV1Api(api)
    for crd in yaml.safe_load_all((REPO / "manifests" / "components" / "reports" / "crds.yaml").read_text()):
        if crd and crd["metadata"]["name"].endswith(".wgpolicyk8s.io"):
            with contextlib.suppress(client.ApiException):  # another test of this module's API server made it
                extensions.create_custom_resource_definition(crd)
    core.create_namespace({"metadata": {"name": "team-b"}})
    custom.create_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", NIC_CLASS)
    retain = gpu_claim("sticky", "team-b", annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"})
    retain["metadata"].pop("uid")
    custom.create_namespaced_custom_object("resource.k8s.io", "v1", "team-b", "resourceclaims", retain)
    kubeconfig = plane.credentials["admin"].kubeconfig

    checked = scrubgate(installed, tmp_path, "check", "--cluster", "--kubeconfig", kubeconfig)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "team-b" in checked.stdout and "sticky" in checked.stdout and "SG001" in checked.stdout, checked.stdout

    def reported() -> list[dict]:
        # The CRDs serve once established; a round before that fails (exit 2) and says so.
        result = scrubgate(installed, tmp_path, "reports", "--once", "--kubeconfig", kubeconfig)
        assert result.returncode in (0, 2) and "Traceback" not in result.stderr, result.stderr
        if result.returncode != 0:
            return []
        return custom.list_namespaced_custom_object("wgpolicyk8s.io", "v1alpha2", "team-b", "policyreports")["items"]

    (report,) = eventually(reported, "a PolicyReport of team-b", timeout=60)
    assert any(result["policy"] == "SG001" or "SG001" in str(result) for result in report["results"]), report
