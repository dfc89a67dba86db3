"""`scrubgate agent` as an operator runs it: its own process, a kubeconfig, a key file, SIGTERM to stop."""

from __future__ import annotations

import signal
import subprocess
import sys

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


def test_agent_process_fences_scrubs_attests_and_stops_on_sigterm(tmp_path):
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

        argv = [
            "--node", NODE, "--gpu-backend", "simulated", "--simulated-root", str(node.root),
            "--checkpoint", str(node.checkpoint), "--signing-key", str(key), "--key-id", node.signer.kid,
            "--nvidia-checkpoint", "", "--metrics-port", "0", "--kubeconfig", str(kubeconfig),
        ]  # fmt: skip
        agent = subprocess.Popen(
            [sys.executable, "-c", RUN, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            rules = "/apis/resource.k8s.io/v1/devicetaintrules"

            def alive() -> bool:
                return agent.poll() is None

            eventually(lambda: cluster._call("GET", rules)["items"], "the fence", alive=alive)
            assert node.canary_present(0)
            core.patch_namespaced_pod_status("train-0", "team-a", {"status": {"phase": "Succeeded"}})
            done = eventually(finalizer_removed(cluster), "the finalizer's removal", alive=alive)
            assert node.clean(0) and cluster._call("GET", rules)["items"] == []
            token = done["metadata"]["annotations"][names.ANNOTATION_ATTESTATION]
            check_claim_attestation(token, done, node.signer.public_keys)
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                output = agent.communicate(timeout=20)[0]
            except subprocess.TimeoutExpired:
                agent.kill()
                raise
        assert agent.returncode == 0, output
        assert "verified clean; fence lifted" in output


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
