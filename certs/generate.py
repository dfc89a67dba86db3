"""A private CA and the webhook's serving certificate, written as the files of a Kubernetes TLS Secret.

The API server trusts exactly the CA put into each webhook's ``clientConfig.caBundle``, so a private CA per
installation is enough. The serving certificate can be reissued from the same CA at any time (rotation)
without touching the webhook configurations.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from scrubgate.policies import names
from scrubgate.policies.attestation import load_private_key, public_key_pem

from .files import write_atomic
from .layout import (
    AUDIT_KEY_FILE,
    AUDIT_KEY_SECRET_NAME,
    AUDIT_PUBLIC_KEY_FILE,
    AUDIT_SECRET_MANIFEST_FILE,
    CA_CERT_FILE,
    CA_COMMON_NAME,
    CA_KEY_FILE,
    DEFAULT_CA_DAYS,
    DEFAULT_SERVING_DAYS,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    TLS_SECRET_NAME,
)

KeyType = Literal["ec", "rsa"]
PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey

# Backdate notBefore so that a node whose clock runs a little behind still accepts a fresh certificate.
_CLOCK_SKEW = dt.timedelta(minutes=5)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key."""

    certificate: x509.Certificate
    private_key: PrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


@dataclass(frozen=True)
class TlsFiles:
    """Where `write_tls_dir` put each file; ``ca_key`` is None when the CA key was not written."""

    ca_cert: Path
    ca_key: Path | None
    tls_cert: Path
    tls_key: Path


def new_private_key(key_type: KeyType = "ec") -> PrivateKey:
    """EC P-256 (default: small, fast handshakes) or RSA-2048 (for clients that lack ECDSA)."""
    if key_type == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"unknown key type {key_type!r}; use 'ec' or 'rsa'")


def service_sans(service: str = names.WEBHOOK_SERVICE, namespace: str = names.SYSTEM_NAMESPACE) -> list[str]:
    """The names the API server uses to reach a webhook Service: ``<service>.<namespace>.svc`` (and the FQDN)."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def generate_ca(common_name: str = CA_COMMON_NAME, *, days: int = DEFAULT_CA_DAYS, key_type: KeyType = "ec") -> KeyPair:
    """A self-signed CA that may sign leaf certificates only (pathLen 0)."""
    _check_days(days)
    key = new_private_key(key_type)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True, digital_signature=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert, key)


def issue_serving_cert(
    ca: KeyPair, sans: Sequence[str], *, days: int = DEFAULT_SERVING_DAYS, key_type: KeyType = "ec"
) -> KeyPair:
    """A TLS server certificate for ``sans`` (DNS names or IP addresses), signed by ``ca``.

    Its validity ends no later than the CA's, so that a chain never outlives its root.
    """
    _check_days(days)
    if not sans:
        raise ValueError("a serving certificate needs at least one subject alternative name")
    general_names = [_general_name(san) for san in sans]
    now = dt.datetime.now(dt.UTC)
    ca_not_after = ca.certificate.not_valid_after_utc
    if ca_not_after <= now:
        raise ValueError(
            f"the CA {ca.certificate.subject.rfc4514_string()} expired at {ca_not_after.isoformat()}; "
            "generate a new CA (and inject its caBundle) before issuing serving certificates"
        )
    key = new_private_key(key_type)
    usage = _key_usage(digital_signature=True, key_encipherment=isinstance(key, rsa.RSAPrivateKey))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sans[0])]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(min(now + dt.timedelta(days=days), ca_not_after))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(general_names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.private_key.public_key()), critical=False)
        .sign(ca.private_key, hashes.SHA256())
    )
    return KeyPair(cert, key)


def write_tls_dir(out: Path, ca: KeyPair, serving: KeyPair, *, include_ca_key: bool = True) -> TlsFiles:
    """Write ``ca.crt``, ``ca.key`` (unless ``include_ca_key`` is False), ``tls.key`` and ``tls.crt`` into ``out``.

    Keys are created with mode 0600. Every file is replaced atomically, the key before the certificate,
    so a reader that loads the certificate first (as ``ssl.SSLContext.load_cert_chain`` does) and sees the
    new one also reads the new key.
    """
    out.mkdir(parents=True, exist_ok=True)
    ca_cert = write_atomic(out / CA_CERT_FILE, ca.cert_pem, 0o644)
    ca_key = write_atomic(out / CA_KEY_FILE, ca.key_pem, 0o600) if include_ca_key else None
    tls_key = write_atomic(out / TLS_KEY_FILE, serving.key_pem, 0o600)
    tls_cert = write_atomic(out / TLS_CERT_FILE, serving.cert_pem, 0o644)
    return TlsFiles(ca_cert=ca_cert, ca_key=ca_key, tls_cert=tls_cert, tls_key=tls_key)


def load_ca(directory: Path) -> KeyPair:
    """Read ``ca.crt`` and ``ca.key`` from ``directory``; refuse a pair that does not belong together."""
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ValueError(f"{key_path}: unsupported key type {type(key).__name__}; use an EC or RSA key")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise ValueError(f"{key_path} is not the private key of {cert_path}; restore the matching pair")
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ValueError(f"{cert_path} is not a CA certificate (no basicConstraints CA:TRUE)")
    return KeyPair(cert, key)


def rotate_serving_cert(
    directory: Path,
    sans: Sequence[str],
    *,
    days: int = DEFAULT_SERVING_DAYS,
    key_type: KeyType = "ec",
) -> KeyPair:
    """Issue a new serving certificate from the CA in ``directory`` and replace ``tls.crt``/``tls.key`` there.

    The CA stays, so the caBundle in the webhook configurations stays valid.
    """
    serving = issue_serving_cert(load_ca(directory), sans, days=days, key_type=key_type)
    write_atomic(directory / TLS_KEY_FILE, serving.key_pem, 0o600)
    write_atomic(directory / TLS_CERT_FILE, serving.cert_pem, 0o644)
    return serving


def secret_manifest(
    ca: KeyPair | bytes,
    serving: KeyPair,
    *,
    name: str = TLS_SECRET_NAME,
    namespace: str = names.SYSTEM_NAMESPACE,
) -> dict[str, Any]:
    """The ``kubernetes.io/tls`` Secret the webhook Deployment mounts: tls.crt, tls.key and ca.crt."""
    ca_pem = ca.cert_pem if isinstance(ca, KeyPair) else ca
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "scrubgate", "app.kubernetes.io/component": "webhook"},
        },
        "type": "kubernetes.io/tls",
        "data": {
            TLS_CERT_FILE: _b64(serving.cert_pem),
            TLS_KEY_FILE: _b64(serving.key_pem),
            CA_CERT_FILE: _b64(ca_pem),
        },
    }


def write_secret_manifest(path: Path, manifest: dict[str, Any]) -> Path:
    """Write a Secret manifest with mode 0600: it holds a private key."""
    return write_atomic(path, yaml.safe_dump(manifest, sort_keys=False).encode(), 0o600)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _key_usage(
    *,
    digital_signature: bool = False,
    key_encipherment: bool = False,
    key_cert_sign: bool = False,
    crl_sign: bool = False,
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(san: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(san))
    except ValueError:
        pass
    labels = san.split(".")
    if len(san) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise ValueError(
            f"subject alternative name {san!r} is neither an IP address nor a lowercase DNS name "
            "(RFC 1123 labels separated by dots)"
        )
    return x509.DNSName(san)


def _check_days(days: int) -> None:
    if days < 1:
        raise ValueError(f"validity must be at least 1 day, got {days}")


@dataclass(frozen=True)
class AuditKeyFiles:
    key: Path  # the private key, reused by the next run
    public: Path  # for `scrubgate audit verify --public-key`
    secret: Path  # the Secret manifest the webhook Deployment mounts
    new: bool


def new_audit_key_pem() -> bytes:
    """A new Ed25519 private key for signed audit checkpoints (PKCS#8 PEM, as the webhook loads it)."""
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def audit_key_secret(
    pem: bytes, *, name: str = AUDIT_KEY_SECRET_NAME, namespace: str = names.SYSTEM_NAMESPACE
) -> dict[str, Any]:
    """The Secret the webhook Deployment mounts its audit checkpoint key from (key ``ed25519.pem``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "scrubgate", "app.kubernetes.io/component": "webhook"},
        },
        "type": "Opaque",
        "data": {"ed25519.pem": _b64(pem)},
    }


def write_audit_key(directory: Path, *, namespace: str = names.SYSTEM_NAMESPACE) -> AuditKeyFiles:
    """The webhook's Ed25519 key for signed audit checkpoints in `directory` (PKCS#8 PEM), made there if absent,
    with its public key and Secret manifest. Reused, like the CA: checkpoints signed so far keep verifying."""
    path = directory / AUDIT_KEY_FILE
    new = not path.exists()
    if new:
        pem = new_audit_key_pem()
        write_atomic(path, pem, 0o600)
    else:
        pem = path.read_bytes()
    public = write_atomic(directory / AUDIT_PUBLIC_KEY_FILE, public_key_pem(load_private_key(pem)).encode(), 0o644)
    secret = audit_key_secret(pem, namespace=namespace)
    return AuditKeyFiles(path, public, write_secret_manifest(directory / AUDIT_SECRET_MANIFEST_FILE, secret), new)
