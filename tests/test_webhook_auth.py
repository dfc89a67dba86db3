"""Only the API server gets admission decisions: with --client-ca (the shipped Deployment sets it) a caller
without a client certificate of that CA, or with one of another name than --client-name's (kube-apiserver by
default: a CA may sign certificates for others too), is refused before its body is read, so it writes nothing
into the audit log's hash chain, whatever `userInfo` it claims. /metrics is not on the admission port."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from scrubgate.policies import names
from scrubgate.webhook.tls import ServingTLS
from webhook_support import (
    AGENT,
    client_cert,
    gpu_claim,
    make_tls_dir,
    review,
    serving_api_server_only,
    with_changes,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def webhook(tmp_path):
    with serving_api_server_only(tmp_path) as running:
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


def refused_without_a_decision(client: httpx.Client) -> list[str]:
    """Posts every forged request; each must be a 403 that decides nothing. Returns the messages."""
    messages = []
    for path, body in forged_requests():
        response = client.post(path, json=body)
        assert response.status_code == 403, (path, response.text)
        answer = response.json()["response"]
        assert answer["allowed"] is False and answer["uid"] == "", "no decision about the forged request"
        assert "patch" not in answer
        messages.append(answer["status"]["message"])
    return messages


def test_a_caller_without_the_api_servers_certificate_gets_no_decision_and_writes_nothing(webhook):
    with webhook.client() as anonymous:
        messages = refused_without_a_decision(anonymous)
        assert anonymous.get("/readyz").status_code == 200, "probes and `helm test` need no certificate"
    assert all("client certificate signed by the CA in" in message for message in messages), messages
    assert records(webhook) == []


def test_a_certificate_of_the_client_ca_with_another_name_gets_no_decision(webhook, tmp_path):
    """Issue 28 item 5: the CA alone is not the API server's identity (a CA of the cluster's may sign
    certificates for nodes or users as well)."""
    tenant = client_cert(webhook.client_ca, tmp_path / "tenant", "system:node:node-1")
    with webhook.client(cert=tenant) as impostor:
        messages = refused_without_a_decision(impostor)
    assert all("names system:node:node-1, not one of" in m and "kube-apiserver" in m for m in messages), messages
    assert records(webhook) == []


def test_the_api_server_with_its_client_certificate_gets_decisions_and_records(webhook):
    with webhook.client(cert=webhook.api_server_cert) as api_server:
        path, body = forged_requests()[0]
        response = api_server.post(path, json=body)
    assert response.status_code == 200
    assert response.json()["response"]["allowed"] is False
    assert len(records(webhook)) == 1


def test_client_name_names_the_api_servers_certificate(tmp_path):
    with serving_api_server_only(tmp_path, client_names=("apiserver-webhook-client",)) as webhook:
        renamed = client_cert(webhook.client_ca, tmp_path / "renamed", "apiserver-webhook-client")
        with webhook.client(cert=renamed) as api_server:
            assert api_server.post("/mutate", json=review(gpu_claim())).status_code == 200
        with webhook.client(cert=webhook.api_server_cert) as default_name:
            (message, *_) = refused_without_a_decision(default_name)
        assert "names kube-apiserver, not one of the names allowed" in message and "apiserver-webhook-client" in message


def test_a_dns_name_of_the_certificate_counts_as_its_name(tmp_path):
    tls = make_tls_dir(tmp_path / "tls")
    serving = ServingTLS(tls.tls_cert, tls.tls_key, client_ca=tls.ca_cert, client_names=("kube-apiserver",))
    # As ssl.SSLSocket.getpeercert() shapes a verified certificate.
    by_dns = {"subject": ((("commonName", "apiserver-7f9c"),),), "subjectAltName": (("DNS", "kube-apiserver"),)}
    by_uri = {"subject": ((("commonName", "x"),),), "subjectAltName": (("URI", "spiffe://kube-apiserver"),)}
    assert serving.client_verdict(by_dns).allowed
    assert not serving.client_verdict(by_uri).allowed
    assert not serving.client_verdict(None).allowed
    assert ServingTLS(tls.tls_cert, tls.tls_key).client_verdict(None).allowed, "without --client-ca: every caller"


def test_metrics_are_not_served_on_the_admission_port(webhook):
    """Issue 28 item 5: the admission port's connections are the API server's; /metrics is the metrics port's."""
    with webhook.client(cert=webhook.api_server_cert) as api_server, webhook.client() as anonymous:
        assert api_server.get("/metrics").status_code == 404
        assert anonymous.get("/metrics").status_code == 404
    assert "scrubgate_webhook_connections{" in webhook.metrics()


def test_prometheus_and_the_probes_use_the_metrics_port_the_webhook_serves():
    deployment = yaml.safe_load((REPO / "manifests" / "webhook-deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["metrics"] == int(args[args.index("--metrics-port") + 1]) != ports["https"]
    monitors = list(yaml.safe_load_all((REPO / "dashboards" / "podmonitors.yaml").read_text()))
    (webhook_monitor,) = [m for m in monitors if m["metadata"]["name"] == "scrubgate-webhook"]
    (endpoint,) = webhook_monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint.get("scheme", "http")) == ("metrics", "/metrics", "http")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
