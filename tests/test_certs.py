"""The webhook's CA and serving certificate: chain, names, usages, files, rotation, Secret, caBundle."""

from __future__ import annotations

import base64
import ipaddress
import ssl
import stat
from pathlib import Path

import kubernetes_validate
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import DNSName, IPAddress, PolicyBuilder, Store, VerificationError
from scrubgate.certs import generate as gen
from scrubgate.certs import layout
from scrubgate.policies import names

SANS = gen.service_sans()


@pytest.fixture(scope="module")
def ca() -> gen.KeyPair:
    return gen.generate_ca()


@pytest.fixture(scope="module")
def serving(ca: gen.KeyPair) -> gen.KeyPair:
    return gen.issue_serving_cert(ca, [*SANS, "localhost", "127.0.0.1"])


def _verify(ca: gen.KeyPair, leaf: x509.Certificate, name: DNSName | IPAddress) -> None:
    """Verify like a TLS client of the API server would: chain to the CA, name in the SANs, serverAuth."""
    verifier = PolicyBuilder().store(Store([ca.certificate])).build_server_verifier(name)
    verifier.verify(leaf, [])


def test_service_sans_are_the_names_the_api_server_dials():
    service = f"{names.WEBHOOK_SERVICE}.{names.SYSTEM_NAMESPACE}"
    assert gen.service_sans() == [f"{service}.svc", f"{service}.svc.cluster.local"]


def test_ca_is_a_self_signed_ca_that_signs_leaves_only(ca: gen.KeyPair):
    cert = ca.certificate
    cert.verify_directly_issued_by(cert)
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert isinstance(ca.private_key, ec.EllipticCurvePrivateKey)
    assert ca.private_key.curve.name == "secp256r1"


def test_serving_cert_chains_to_the_ca_for_every_requested_name(ca: gen.KeyPair, serving: gen.KeyPair):
    for san in [*SANS, "localhost"]:
        _verify(ca, serving.certificate, DNSName(san))
    _verify(ca, serving.certificate, IPAddress(ipaddress.ip_address("127.0.0.1")))


def test_serving_cert_is_not_valid_for_other_names_or_other_cas(ca: gen.KeyPair, serving: gen.KeyPair):
    with pytest.raises(VerificationError):
        _verify(ca, serving.certificate, DNSName("scrubgate-webhook.default.svc"))
    with pytest.raises(VerificationError):
        _verify(gen.generate_ca(), serving.certificate, DNSName(SANS[0]))


def test_serving_cert_extensions(serving: gen.KeyPair):
    ext = serving.certificate.extensions
    sans = ext.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [*SANS, "localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert list(ext.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    usage = ext.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature and not usage.value.key_cert_sign
    assert ext.get_extension_for_class(x509.BasicConstraints).value.ca is False


def test_loopback_names_only_when_asked(ca: gen.KeyPair):
    leaf = gen.issue_serving_cert(ca, SANS).certificate
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == SANS
    assert sans.get_values_for_type(x509.IPAddress) == []


def test_rsa_keys_are_2048_bit_and_allow_key_encipherment():
    ca = gen.generate_ca(key_type="rsa")
    leaf = gen.issue_serving_cert(ca, SANS, key_type="rsa")
    assert isinstance(leaf.private_key, rsa.RSAPrivateKey) and leaf.private_key.key_size == 2048
    assert leaf.certificate.extensions.get_extension_for_class(x509.KeyUsage).value.key_encipherment
    _verify(ca, leaf.certificate, DNSName(SANS[0]))


def test_serving_cert_never_outlives_its_ca():
    short_ca = gen.generate_ca(days=2)
    leaf = gen.issue_serving_cert(short_ca, SANS, days=365)
    assert leaf.certificate.not_valid_after_utc == short_ca.certificate.not_valid_after_utc


@pytest.mark.parametrize("sans", [[], ["Scrubgate.svc"], ["bad_name.svc"], ["-x.svc"], ["a..b"]], ids=repr)
def test_bad_subject_alternative_names_are_refused(ca: gen.KeyPair, sans: list[str]):
    with pytest.raises(ValueError):
        gen.issue_serving_cert(ca, sans)


def test_zero_days_is_refused(ca: gen.KeyPair):
    with pytest.raises(ValueError, match="at least 1 day"):
        gen.issue_serving_cert(ca, SANS, days=0)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _tls_handshake(ca_file: Path, cert_file: Path, key_file: Path, server_name: str) -> None:
    """A real TLS handshake in memory: OpenSSL loads the files as the webhook and a client would."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_file, key_file)
    client = ssl.create_default_context(cafile=str(ca_file))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname=server_name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done: set[str] = set()
    for _ in range(10):
        for name, end in (("client", c), ("server", s)):
            if name in done:
                continue
            try:
                end.do_handshake()
                done.add(name)
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == {"client", "server"}:
            return
    raise AssertionError("TLS handshake did not complete")


def test_write_tls_dir_writes_secret_key_names_with_private_keys_0600(
    tmp_path: Path, ca: gen.KeyPair, serving: gen.KeyPair
):
    files = gen.write_tls_dir(tmp_path, ca, serving)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert _mode(files.tls_key) == 0o600 and files.ca_key is not None and _mode(files.ca_key) == 0o600
    assert _mode(files.tls_cert) == 0o644 and _mode(files.ca_cert) == 0o644
    _tls_handshake(files.ca_cert, files.tls_cert, files.tls_key, SANS[0])
    _tls_handshake(files.ca_cert, files.tls_cert, files.tls_key, "127.0.0.1")


def test_ca_key_can_be_left_out(tmp_path: Path, ca: gen.KeyPair, serving: gen.KeyPair):
    files = gen.write_tls_dir(tmp_path, ca, serving, include_ca_key=False)
    assert files.ca_key is None and not (tmp_path / "ca.key").exists()


def test_rotation_replaces_the_serving_pair_and_keeps_the_ca(tmp_path: Path, ca: gen.KeyPair):
    gen.write_tls_dir(tmp_path, ca, gen.issue_serving_cert(ca, SANS))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rotated = gen.rotate_serving_cert(tmp_path, SANS)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after.keys() == before.keys()  # no temporary file left behind
    assert after["ca.crt"] == before["ca.crt"] and after["ca.key"] == before["ca.key"]
    assert after["tls.crt"] != before["tls.crt"] and after["tls.key"] != before["tls.key"]
    assert after["tls.crt"] == rotated.cert_pem
    assert _mode(tmp_path / "tls.key") == 0o600
    _tls_handshake(tmp_path / "ca.crt", tmp_path / "tls.crt", tmp_path / "tls.key", SANS[1])


def test_load_ca_refuses_a_key_of_another_ca(tmp_path: Path, ca: gen.KeyPair, serving: gen.KeyPair):
    gen.write_tls_dir(tmp_path, ca, serving)
    (tmp_path / "ca.key").write_bytes(gen.generate_ca().key_pem)
    with pytest.raises(ValueError, match="not the private key"):
        gen.load_ca(tmp_path)


def test_load_ca_refuses_a_leaf_certificate(tmp_path: Path, serving: gen.KeyPair):
    (tmp_path / "ca.crt").write_bytes(serving.cert_pem)
    (tmp_path / "ca.key").write_bytes(serving.key_pem)
    with pytest.raises(ValueError, match="not a CA certificate"):
        gen.load_ca(tmp_path)


def test_secret_manifest_is_a_valid_tls_secret_with_the_ca(tmp_path: Path, ca: gen.KeyPair, serving: gen.KeyPair):
    secret = gen.secret_manifest(ca, serving)
    kubernetes_validate.validate(secret, "1.34", strict=True)
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["name"] == layout.TLS_SECRET_NAME == "scrubgate-webhook-tls"
    assert secret["metadata"]["namespace"] == names.SYSTEM_NAMESPACE
    decoded = {key: base64.b64decode(value) for key, value in secret["data"].items()}
    assert decoded == {"tls.crt": serving.cert_pem, "tls.key": serving.key_pem, "ca.crt": ca.cert_pem}
    path = gen.write_secret_manifest(tmp_path / "secret.yaml", secret)
    assert _mode(path) == 0o600
