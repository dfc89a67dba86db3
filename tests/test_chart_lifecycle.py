"""The chart as `helm install`, `upgrade`, `rollback` and `uninstall` meet it on a real kube-apiserver (v1.37.2,
with etcd and no controllers: objects are stored, no pod or Job ever runs): one release per cluster, refused at
render time; and a failed pre-delete hook recovered by what its texts (the NOTES, `scrubgate uninstall`'s
message) say. helm is built from its Go module by tools/build-go-tool.sh, as in test_chart.py."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from k8s_support import api_server
from scrubgate.certs import generate as gen
from scrubgate.policies.attestation import load_private_key

from devcluster.controlplane import ControlPlane, binaries
from devcluster.pki import write_kubeconfig

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "scrubgate"
NAMESPACE = "gpu-guard"

pytestmark = pytest.mark.timeout(600)

Helm = Callable[..., subprocess.CompletedProcess[str]]
# No Job runs here: certificates made at render time, not by the certificates' hook, whose Job would never end.
RENDERED_CERTS = ("--set", "certs.source=self-generated")


@pytest.fixture(scope="module")
def helm_binary() -> str:
    result = subprocess.run(
        [str(REPO / "tools" / "build-go-tool.sh"), "helm"], capture_output=True, text=True, timeout=1700, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """A bare kube-apiserver."""
    with api_server(tmp_path) as plane:
        yield plane


@pytest.fixture
def cluster(plane: ControlPlane) -> Path:
    """Its admin kubeconfig."""
    return plane.credentials["admin"].kubeconfig


@pytest.fixture
def helm(helm_binary: str, cluster: Path) -> Helm:
    """helm as the cluster's admin, in NAMESPACE unless `namespace` says otherwise."""

    def run(*args: str, namespace: str = NAMESPACE) -> subprocess.CompletedProcess[str]:
        argv = [helm_binary, *args, "--kubeconfig", str(cluster), "--namespace", namespace]
        return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)

    return run


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [binaries()["kubectl"], "--kubeconfig", str(kubeconfig), *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, check=False)


def scrubgate(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The scrubgate CLI, as a hook's container runs it, with `kubeconfig`'s identity."""
    argv = [sys.executable, "-m", "scrubgate.cli", *args, "--kubeconfig", str(kubeconfig)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, cwd=REPO)


def status(helm: Helm, release: str) -> str:
    result = helm("status", release, "-o", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["info"]["status"]


def test_one_release_per_cluster(helm: Helm, cluster: Path):
    """The webhooks and agents act on every namespace and node, and the objects carry the base's fixed names: a
    second release, under another name or in another namespace, is refused at render time with what to do, not
    with Helm's ownership error; the release itself upgrades. So is a release beside a kustomize install."""
    installed = helm("install", "sg", str(CHART), "--create-namespace", *RENDERED_CERTS)
    assert installed.returncode == 0, installed.stderr
    for release, namespace in (("other", "team-x"), ("sg", "team-x"), ("other", NAMESPACE)):
        second = helm("install", release, str(CHART), "--create-namespace", "--dry-run=server", namespace=namespace)
        assert second.returncode != 0
        assert 'already installed in this cluster by the release "sg" in the namespace "gpu-guard"' in second.stderr
        assert f"helm upgrade sg charts/scrubgate -n {NAMESPACE}" in second.stderr
    upgraded = helm("upgrade", "sg", str(CHART), "--dry-run=server")
    assert upgraded.returncode == 0, upgraded.stderr

    # kubectl apply -k manifests/ leaves no Helm release on the objects.
    assert helm("uninstall", "sg", "--no-hooks").returncode == 0
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "scrubgate-validating"},
    }
    created = kubectl(cluster, "create", "-f", "-", stdin=json.dumps(configuration))
    assert created.returncode == 0, created.stderr
    beside = helm("install", "sg", str(CHART), "--dry-run=server")
    assert beside.returncode != 0 and "already installed in this cluster, not by Helm" in beside.stderr


def test_a_failed_uninstall_hook_is_recovered_as_its_text_says(helm: Helm, cluster: Path):
    """A pre-delete hook that does not succeed (here it never runs: no Job controller; on a cluster, a teardown
    still pending) fails `helm uninstall` and leaves the release `uninstalling`, where `helm upgrade` fails: the
    NOTES and `scrubgate uninstall` say `helm rollback` to that revision, which deploys it again with its values;
    and `--no-hooks` once `scrubgate uninstall` has removed the guard."""
    installed = helm("install", "sg", str(CHART), "--create-namespace", *RENDERED_CERTS, "--set", "webhook.replicas=3")
    assert installed.returncode == 0, installed.stderr
    upgraded = helm("upgrade", "sg", str(CHART), "--reuse-values", "--set", "webhook.replicas=4")
    assert upgraded.returncode == 0, upgraded.stderr
    notes = upgraded.stdout

    failed = helm("uninstall", "sg", "--timeout", "5s")
    assert failed.returncode != 0 and "sg-uninstall" in failed.stderr, failed.stderr
    assert status(helm, "sg") == "uninstalling"
    stuck = helm("upgrade", "sg", str(CHART), "--reuse-values")
    assert stuck.returncode != 0 and '"sg" has no deployed releases' in stuck.stderr, stuck.stderr

    # What the NOTES say to do.
    assert 'where\n`helm upgrade` fails ("has no deployed releases")' in notes
    assert (
        f"helm -n {NAMESPACE} rollback sg REVISION   # REVISION: the one `helm -n {NAMESPACE} history sg` shows"
        in notes
    )
    history = json.loads(helm("history", "sg", "-o", "json").stdout)
    (revision,) = [entry["revision"] for entry in history if entry["status"] == "uninstalling"]
    rolled_back = helm("rollback", "sg", str(revision))
    assert rolled_back.returncode == 0, rolled_back.stderr
    assert status(helm, "sg") == "deployed"
    values = json.loads(helm("get", "values", "sg", "-o", "json").stdout)
    assert values["webhook"] == {"replicas": 4}, "the values of the revision that was being uninstalled"
    assert helm("upgrade", "sg", str(CHART), "--reuse-values").returncode == 0, "upgradable again"

    # --no-hooks once the guard is gone: `scrubgate uninstall` by hand (no agent pod here to wait for).
    assert "`--no-hooks` skips the wait: use it only once\n`scrubgate uninstall -n gpu-guard` has succeeded" in notes
    by_hand = scrubgate(cluster, "uninstall", "--namespace", NAMESPACE)
    assert by_hand.returncode == 0, by_hand.stdout + by_hand.stderr
    assert "deleted validatingwebhookconfigurations scrubgate-validating" in by_hand.stdout
    removed = helm("uninstall", "sg", "--no-hooks")
    assert removed.returncode == 0, removed.stderr
    assert helm("status", "sg").returncode != 0


def test_the_certificates_hook_makes_them_in_the_cluster_with_its_own_rights(
    helm: Helm, helm_binary: str, plane: ControlPlane, cluster: Path, tmp_path: Path
):
    """certs.source in-cluster (the default): the hook's Job runs `scrubgate certs ensure` before the install (the
    Secrets the webhook mounts) and after it (every caBundle), with the identity the chart gives it, and nothing
    more. Run here as that Job's command and identity (a TokenRequest token of its ServiceAccount), since no Job
    runs on a bare API server. An upgrade keeps the caBundle it never set; the next run changes nothing."""
    rendered = subprocess.run(
        [helm_binary, "template", "sg", str(CHART), "-n", NAMESPACE, "--show-only", "templates/certs-hook.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert kubectl(cluster, "create", "namespace", NAMESPACE).returncode == 0
    identity = yaml.safe_dump_all([d for d in docs if d["kind"] != "Job"])
    assert kubectl(cluster, "create", "-f", "-", stdin=identity).returncode == 0
    token = kubectl(cluster, "create", "token", "sg-certs", "-n", NAMESPACE)
    assert token.returncode == 0, token.stderr
    hook = write_kubeconfig(
        tmp_path / "hook.kubeconfig", plane.url, plane.pki.ca_cert, "hook", {"token": token.stdout.strip()}
    )

    before = scrubgate(hook, *args)  # pre-install
    assert before.returncode == 0, before.stdout + before.stderr
    assert f"Secret {NAMESPACE}/scrubgate-webhook-tls: made (a new CA)" in before.stdout
    assert f"Secret {NAMESPACE}/scrubgate-audit-signing-key: made (a new audit key)" in before.stdout
    assert before.stdout.count("not there yet") == 3
    installed = helm("install", "sg", str(CHART), "--no-hooks")
    assert installed.returncode == 0, installed.stderr
    after = scrubgate(hook, *args)  # post-install
    assert after.returncode == 0, after.stdout + after.stderr
    assert "kept" in after.stdout and "made" not in after.stdout
    assert "validatingwebhookconfigurations/scrubgate-validating: caBundle set in 2 webhook(s)" in after.stdout

    def installed_state() -> tuple[dict, list[str]]:
        secret = json.loads(
            kubectl(cluster, "get", "secret", "scrubgate-webhook-tls", "-n", NAMESPACE, "-o", "json").stdout
        )
        bundles = []
        for resource in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
            for item in json.loads(kubectl(cluster, "get", resource, "-o", "json").stdout)["items"]:
                bundles += [w["clientConfig"].get("caBundle", "") for w in item["webhooks"]]
        return secret, bundles

    secret, bundles = installed_state()
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    serving = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    serving.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"scrubgate-webhook.{NAMESPACE}.svc" in sans.get_values_for_type(x509.DNSName)
    assert len(bundles) == 4 and set(bundles) == {secret["data"]["ca.crt"]}
    audit = json.loads(
        kubectl(cluster, "get", "secret", "scrubgate-audit-signing-key", "-n", NAMESPACE, "-o", "json").stdout
    )
    load_private_key(base64.b64decode(audit["data"]["ed25519.pem"]))

    # helm upgrade (server-side apply) leaves the caBundle it never set; the hook's next run changes nothing.
    upgraded = helm("upgrade", "sg", str(CHART), "--no-hooks", "--reuse-values", "--set", "webhook.replicas=3")
    assert upgraded.returncode == 0, upgraded.stderr
    assert installed_state()[1] == bundles
    again = scrubgate(hook, *args)
    assert again.returncode == 0 and again.stdout.count("caBundle already set") == 3, again.stdout + again.stderr
    assert installed_state()[0]["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]

    # Its rights: its own two Secrets and the chart's webhook configurations, nothing else.
    assert kubectl(cluster, "create", "secret", "generic", "other", "-n", NAMESPACE).returncode == 0
    denied = kubectl(hook, "get", "secret", "other", "-n", NAMESPACE)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr
    foreign = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "other"},
    }
    assert kubectl(cluster, "create", "-f", "-", stdin=json.dumps(foreign)).returncode == 0
    denied = kubectl(hook, "get", "mutatingwebhookconfigurations", "other")
    assert denied.returncode != 0 and "Forbidden" in denied.stderr

    # A TLS Secret it did not make (no ca.crt) is named and left alone, not replaced.
    assert kubectl(cluster, "delete", "secret", "scrubgate-webhook-tls", "-n", NAMESPACE).returncode == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    ca_pair = gen.generate_ca()
    gen.write_tls_dir(mine, ca_pair, gen.issue_serving_cert(ca_pair, gen.service_sans(namespace=NAMESPACE)))
    created = kubectl(
        cluster,
        "create",
        "secret",
        "tls",
        "scrubgate-webhook-tls",
        "-n",
        NAMESPACE,
        f"--cert={mine / 'tls.crt'}",
        f"--key={mine / 'tls.key'}",
    )
    assert created.returncode == 0, created.stderr
    refused = scrubgate(hook, *args)
    assert refused.returncode == 1
    assert f"Secret {NAMESPACE}/scrubgate-webhook-tls has no ca.crt" in refused.stderr
    assert "certs.source=provided" in refused.stderr
