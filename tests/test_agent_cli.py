"""`scrubgate agent` as an operator runs it: its own process, a kubeconfig, a key file, SIGTERM to stop."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from agent_support import CANARY, NODE, eventually, finalizer_removed, make_node, seed_api
from cryptography.hazmat.primitives import serialization
from k8s_support import api_server
from kubernetes import client
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.kube import KubernetesClusterClient

pytestmark = pytest.mark.timeout(90)

RUN = "import sys; from scrubgate.sanitizer_agent import cli; import argparse; p = argparse.ArgumentParser(); " \
      "cli.add_arguments(p); sys.exit(cli.run(p.parse_args(sys.argv[1:])))"  # fmt: skip


def test_agent_process_hands_over_on_sigterm_and_tears_down_after_a_restart(tmp_path):
    """Running, the agent records the allocation and fences nothing (the claim's allocation keeps the device).
    SIGTERM (an upgrade, an uninstall): it fences what it still owes before it exits, since the webhook that
    keeps that allocation may go next. Restarted, it scrubs on release and lifts that fence."""
    node = make_node(tmp_path)
    key = tmp_path / "key.pem"
    key.write_bytes(
        node.signer.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with api_server(tmp_path) as plane:
        kubeconfig = plane.credentials["admin"].kubeconfig
        api = plane.admin_client()
        cluster = KubernetesClusterClient(api)
        core = client.CoreV1Api(api)
        seed_api(node, cluster, core)
        simulated.fill(node.root, node.gpus[0].uuid, CANARY)
        rules = f"/apis/resource.k8s.io/{cluster.device_taint_rule_version()}/devicetaintrules"
        argv = [
            "--node", NODE, "--gpu-backend", "simulated", "--simulated-root", str(node.root),
            "--checkpoint", str(node.checkpoint), "--signing-key", str(key), "--key-id", node.signer.kid,
            "--nvidia-checkpoint", "", "--metrics-port", "0", "--kubeconfig", str(kubeconfig),
        ]  # fmt: skip

        def recorded() -> bool:
            claim = cluster.get_claim("team-a", "train") or {}
            return names.ANNOTATION_DEVICES in (claim["metadata"].get("annotations") or {})

        with agent_process(argv) as (agent, output):
            eventually(recorded, "the record of the allocation", alive=lambda: agent.poll() is None)
            assert cluster._call("GET", rules)["items"] == [], "no fence while the allocation holds the device"
        assert "fencing gpu.nvidia.com/gpu-node-1/gpu-0 (the agent is stopping with the teardown owed)" in output()
        (fence,) = cluster._call("GET", rules)["items"]
        assert fence["spec"]["taint"]["key"] == names.TAINT_UNSANITIZED

        with agent_process(argv) as (agent, output):
            core.patch_namespaced_pod_status("train-0", "team-a", {"status": {"phase": "Succeeded"}})
            done = eventually(finalizer_removed(cluster), "the finalizer's removal", alive=lambda: agent.poll() is None)
            assert node.clean(0)
            # The fence goes right after the attestation is on the claim.
            eventually(lambda: cluster._call("GET", rules)["items"] == [], "the fence lifted")
            token = done["metadata"]["annotations"][names.ANNOTATION_ATTESTATION]
            check_claim_attestation(token, done, node.signer.public_keys)
        assert "fences of gpu.nvidia.com/gpu-node-1/gpu-0 lifted" in output()
        assert cluster._call("GET", rules)["items"] == [], "nothing owed, nothing fenced on the way out"


@contextlib.contextmanager
def agent_process(argv: list[str]) -> Iterator[tuple[subprocess.Popen[str], Callable[[], str]]]:
    """`scrubgate agent` as its own process for the block, then SIGTERM; it must exit 0. Yields the process and
    its output (complete once the block is over)."""
    agent = subprocess.Popen(
        [sys.executable, "-c", RUN, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    captured: list[str] = []
    try:
        yield agent, lambda: "".join(captured)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            captured.append(agent.communicate(timeout=20)[0])
        except subprocess.TimeoutExpired:
            agent.kill()
            raise
    assert agent.returncode == 0, captured[0]


def test_agent_refuses_to_start_without_a_node_or_a_key(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", RUN, "--signing-key", str(tmp_path / "absent.pem")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2 and "scrubgate agent: --node is required" in result.stderr
    result = subprocess.run(
        [sys.executable, "-c", RUN, "--node", "n1", "--signing-key", str(tmp_path / "absent.pem")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "cannot read the attestation signing key" in result.stderr
