"""Changes on disk under a running webhook: certificate rotation (cert-manager style file replacement),
refused half-written or mismatched pairs, policy reload and refusal, client-certificate checking."""

from __future__ import annotations

import datetime as dt
import re
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from scrubgate.certs.files import write_atomic
from scrubgate.certs.generate import KeyPair, generate_ca, issue_serving_cert, load_ca, rotate_serving_cert
from scrubgate.policies import names
from scrubgate.webhook.server import Settings
from webhook_support import SANS, gpu_claim, make_tls_dir, review, running_webhook

RETAIN = {names.ANNOTATION_DEALLOCATION_POLICY: "Retain"}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reload")
    tls = make_tls_dir(directory / "tls")
    policy = directory / "policy.yaml"
    policy.write_text("apiVersion: scrubgate.dev/v1\nkind: PolicyConfig\n")
    settings = Settings(tls_cert=tls.tls_cert, tls_key=tls.tls_key, policy=policy, watch_interval=0.05)
    with running_webhook(settings, tls.ca_cert) as running:
        running.tls_dir = directory / "tls"
        running.policy_file = policy
        yield running


def served_serial(webhook) -> int:
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    with (
        socket.create_connection(("127.0.0.1", webhook.port), timeout=10) as sock,
        context.wrap_socket(sock, server_hostname="scrubgate-webhook.scrubgate-system.svc") as tls,
    ):
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def metric(webhook, name: str) -> float:
    text = webhook.metrics()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_serving_tls_is_at_least_1_2(webhook):
    context = webhook.state.tls.context
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    client = ssl.create_default_context(cafile=str(webhook.ca_file))
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    with (
        socket.create_connection(("127.0.0.1", webhook.port), timeout=10) as sock,
        client.wrap_socket(sock, server_hostname="localhost") as tls,
    ):
        assert tls.version() == "TLSv1.2"


def test_a_rotated_certificate_serves_new_handshakes_without_a_restart(webhook):
    before = served_serial(webhook)
    with webhook.client() as open_connection:
        assert open_connection.get("/healthz").status_code == 200
        rotated = rotate_serving_cert(webhook.tls_dir, SANS)
        wait_for(lambda: served_serial(webhook) == rotated.certificate.serial_number, "the rotated certificate")
        assert before != rotated.certificate.serial_number
        # A keep-alive connection opened before the rotation keeps working.
        assert open_connection.post("/validate", json=review(gpu_claim())).json()["response"]["allowed"]
    assert metric(webhook, "scrubgate_tls_certificate_reloads_total") >= 1
    assert webhook.client().get("/readyz").status_code == 200


def test_half_written_and_mismatched_pairs_are_refused_and_the_old_pair_keeps_serving(webhook):
    current = served_serial(webhook)
    errors = metric(webhook, "scrubgate_tls_certificate_reload_errors_total")
    fresh = issue_serving_cert(load_ca(webhook.tls_dir), SANS)
    cert_file = webhook.tls_dir / "tls.crt"

    # A writer that is half-way through the certificate (no atomic rename).
    cert_file.write_bytes(fresh.cert_pem[: len(fresh.cert_pem) // 2])
    wait_for(lambda: metric(webhook, "scrubgate_tls_certificate_reload_errors_total") > errors, "a refused reload")
    assert served_serial(webhook) == current

    # The new certificate next to the old key.
    write_atomic(cert_file, fresh.cert_pem, 0o644)
    wait_for(lambda: metric(webhook, "scrubgate_tls_certificate_reload_errors_total") > errors + 1, "a refused pair")
    assert served_serial(webhook) == current

    # The key arrives: the pair is whole and takes over.
    write_atomic(webhook.tls_dir / "tls.key", fresh.key_pem, 0o600)
    wait_for(lambda: served_serial(webhook) == fresh.certificate.serial_number, "the completed pair")


def test_a_changed_policy_is_reloaded_and_a_bad_one_refused(webhook):
    def retain_allowed() -> bool:
        with webhook.client() as client:
            return client.post("/validate", json=review(gpu_claim(annotations=RETAIN))).json()["response"]["allowed"]

    assert not retain_allowed()
    write_atomic(
        webhook.policy_file,
        b'apiVersion: scrubgate.dev/v1\nkind: PolicyConfig\nrules:\n  SG001: {action: "off"}\n',
        0o644,
    )
    wait_for(retain_allowed, "the reloaded policy")
    digest = webhook.state.policy.policy.digest

    write_atomic(webhook.policy_file, b"rules:\n  SG999: {action: deny}\n", 0o644)
    wait_for(lambda: metric(webhook, "scrubgate_policy_reload_errors_total") >= 1, "a refused policy")
    assert webhook.state.policy.policy.digest == digest
    assert retain_allowed()
    assert webhook.client().get("/readyz").status_code == 200


# -- client certificates ------------------------------------------------------------------------------


def _client_cert(ca: KeyPair) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca.private_key, hashes.SHA256())
    )
    return KeyPair(cert, key)


def test_admission_paths_require_a_client_certificate_when_a_client_ca_is_set(tmp_path):
    tls = make_tls_dir(tmp_path / "tls")
    client_ca = generate_ca("api-server-client-ca")
    (tmp_path / "client-ca.crt").write_bytes(client_ca.cert_pem)
    pair = _client_cert(client_ca)
    Path(tmp_path / "client.crt").write_bytes(pair.cert_pem)
    Path(tmp_path / "client.key").write_bytes(pair.key_pem)
    settings = Settings(tls_cert=tls.tls_cert, tls_key=tls.tls_key, client_ca=tmp_path / "client-ca.crt")
    with running_webhook(settings, tls.ca_cert) as webhook:
        with webhook.client() as anonymous:
            assert anonymous.get("/readyz").status_code == 200  # kubelet probes carry no client certificate
            refused = anonymous.post("/validate", json=review(gpu_claim()))
            assert refused.status_code == 403
            assert refused.json()["response"]["allowed"] is False
        context = ssl.create_default_context(cafile=str(tls.ca_cert))
        context.load_cert_chain(tmp_path / "client.crt", tmp_path / "client.key")
        with httpx.Client(base_url=webhook.url, verify=context, timeout=10) as api_server:
            response = api_server.post("/validate", json=review(gpu_claim()))
            assert response.status_code == 200 and response.json()["response"]["allowed"] is True
        stranger_ca = generate_ca("someone-else")
        stranger = _client_cert(stranger_ca)
        (tmp_path / "stranger.crt").write_bytes(stranger.cert_pem)
        (tmp_path / "stranger.key").write_bytes(stranger.key_pem)
        context = ssl.create_default_context(cafile=str(tls.ca_cert))
        context.load_cert_chain(tmp_path / "stranger.crt", tmp_path / "stranger.key")
        with httpx.Client(base_url=webhook.url, verify=context, timeout=10) as impostor, pytest.raises(httpx.HTTPError):
            impostor.post("/validate", json=review(gpu_claim()))
