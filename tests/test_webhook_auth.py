"""Only the API server gets admission decisions: with --client-ca (the shipped Deployment sets it) a caller
without a client certificate of that CA is refused before its body is read, so it writes nothing into the
audit log's hash chain, whatever `userInfo` it claims."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest
from scrubgate.certs.generate import generate_ca
from scrubgate.policies import names
from scrubgate.webhook.server import Settings
from test_webhook_reload import _client_cert
from webhook_support import AGENT, gpu_claim, make_tls_dir, review, running_webhook, with_changes


@pytest.fixture
def webhook(tmp_path):
    tls = make_tls_dir(tmp_path / "tls")
    client_ca = generate_ca("scrubgate-apiserver-client-ca")
    (tmp_path / "client-ca.crt").write_bytes(client_ca.cert_pem)
    pair = _client_cert(client_ca)
    (tmp_path / "apiserver.crt").write_bytes(pair.cert_pem)
    (tmp_path / "apiserver.key").write_bytes(pair.key_pem)
    audit_log = tmp_path / "audit" / "audit.jsonl"
    settings = Settings(
        tls_cert=tls.tls_cert, tls_key=tls.tls_key, client_ca=tmp_path / "client-ca.crt", audit_log=audit_log
    )
    with running_webhook(settings, tls.ca_cert) as running:
        running.audit_path = audit_log
        running.api_server_cert = (tmp_path / "apiserver.crt", tmp_path / "apiserver.key")
        yield running


def records(webhook) -> list[str]:
    path = Path(webhook.audit_path)
    return path.read_text().splitlines() if path.exists() else []


def forged_requests() -> list[tuple[str, dict]]:
    """What a pod in the cluster might post: a Retain claim (a deny, audited), and the agent's identity removing
    the finalizer of a claim (an allow it would like to see, and a record naming the agent)."""
    retain = gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN})
    held = gpu_claim(finalizers=[names.FINALIZER])
    released = with_changes(held, finalizers=[])
    agent = {"username": AGENT, "groups": ["system:serviceaccounts"]}
    return [
        ("/validate", review(retain)),
        ("/validate/trusted", review(released, operation="UPDATE", old=held, user=agent)),
        ("/mutate", review(gpu_claim())),
    ]


def test_a_caller_without_the_api_servers_certificate_gets_no_decision_and_writes_nothing(webhook):
    with webhook.client() as anonymous:
        for path, body in forged_requests():
            response = anonymous.post(path, json=body)
            assert response.status_code == 403, (path, response.text)
            answer = response.json()["response"]
            assert answer["allowed"] is False and answer["uid"] == "", "no decision about the forged request"
            assert "patch" not in answer
    assert records(webhook) == []


def test_the_api_server_with_its_client_certificate_gets_decisions_and_records(webhook):
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    context.load_cert_chain(*webhook.api_server_cert)
    with httpx.Client(base_url=webhook.url, verify=context, timeout=10) as api_server:
        path, body = forged_requests()[0]
        response = api_server.post(path, json=body)
    assert response.status_code == 200
    assert response.json()["response"]["allowed"] is False
    assert len(records(webhook)) == 1
