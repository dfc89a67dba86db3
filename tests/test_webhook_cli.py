"""`scrubgate webhook` as a process: starts from its arguments, serves, logs JSON, stops cleanly on
SIGTERM; refuses to start without a usable policy."""

from __future__ import annotations

import argparse
import json
import signal
import ssl
import subprocess
import sys
import time

import httpx
from scrubgate.webhook.cli import add_arguments
from webhook_support import gpu_claim, make_tls_dir, review

from devcluster.processes import free_port

# What the lead's `scrubgate webhook` does: parse with add_arguments, call run.
ENTRY = (
    "import argparse, sys\n"
    "from scrubgate.webhook.cli import add_arguments, run\n"
    "parser = argparse.ArgumentParser()\n"
    "add_arguments(parser)\n"
    "sys.exit(run(parser.parse_args(sys.argv[1:])))\n"
)


def _command(tls, *extra: str) -> list[str]:
    return [sys.executable, "-c", ENTRY, "--tls-cert", str(tls.tls_cert), "--tls-key", str(tls.tls_key), *extra]


def test_arguments_and_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tls-cert", "c", "--tls-key", "k"])
    assert (args.port, args.host, args.policy, args.audit_log, args.client_ca) == (8443, "0.0.0.0", None, None, None)
    assert (args.metrics_port, args.client_names) == (9401, None)  # None: kube-apiserver, with --client-ca
    named = parser.parse_args(["--tls-cert", "c", "--tls-key", "k", "--client-name", "a", "--client-name", "b"])
    assert named.client_names == ["a", "b"]


def test_the_webhook_process_serves_and_stops_cleanly(tmp_path):
    tls = make_tls_dir(tmp_path / "tls")
    port, metrics_port = free_port(), free_port()
    audit = tmp_path / "audit.jsonl"
    process = subprocess.Popen(
        _command(
            tls,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--audit-log",
            str(audit),
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # as the kubelet probes it: plain HTTP on the metrics port
            try:
                if httpx.get(f"http://127.0.0.1:{metrics_port}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the webhook did not become ready"
            time.sleep(0.1)
        context = ssl.create_default_context(cafile=str(tls.ca_cert))
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=context, timeout=5) as client:
            body = review(gpu_claim(annotations={"scrubgate.dev/deallocation-policy": "Retain"}))
            assert client.post("/validate", json=body).json()["response"]["allowed"] is False
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    logs = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert any(entry["message"].startswith("serving admission on https://127.0.0.1") for entry in logs)
    assert any(entry["logger"] == "scrubgate.webhook.app" and entry["message"].startswith("deny") for entry in logs)
    assert json.loads(audit.read_text().splitlines()[-1])["uid"] == body["request"]["uid"]


def test_client_name_without_client_ca_is_refused(tmp_path):
    tls = make_tls_dir(tmp_path / "tls")
    result = subprocess.run(
        _command(tls, "--port", str(free_port()), "--client-name", "kube-apiserver"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--client-name names the API server's client certificate of --client-ca" in result.stderr


def test_the_webhook_refuses_to_start_with_a_bad_policy(tmp_path):
    tls = make_tls_dir(tmp_path / "tls")
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  SG001: {action: maybe}\n")
    result = subprocess.run(
        _command(tls, "--host", "127.0.0.1", "--port", str(free_port()), "--policy", str(policy)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    message = json.loads(result.stderr.splitlines()[-1])["message"]
    assert message.startswith("cannot start the webhook:") and "rules.SG001.action" in message
