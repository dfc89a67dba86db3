"""The control plane's certificates, laid out as kubeadm lays them out: one cluster CA that signs the API
server's serving certificate and every client certificate, a client certificate and kubeconfig per component
(the subject's CN is the user, its O the groups), and the service-account signing key.

Part of the test and demo harness (see devcluster/README.md), not of scrubgate.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from scrubgate.certs.generate import KeyPair, generate_ca, issue_serving_cert, new_private_key

API_SERVER_SANS = [
    "127.0.0.1",
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
    "10.96.0.1",
]


@dataclass(frozen=True)
class Credential:
    """Where one identity's client certificate, key and kubeconfig are."""

    user: str
    groups: tuple[str, ...]
    cert: Path
    key: Path
    kubeconfig: Path


def issue_client_cert(ca: KeyPair, user: str, groups: tuple[str, ...] = (), days: int = 30) -> KeyPair:
    """A TLS client certificate for ``user`` in ``groups``, as the API server's x509 authenticator reads it."""
    key = new_private_key("ec")
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, user)]
    subject += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups]
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca.private_key, hashes.SHA256())
    )
    return KeyPair(cert, key)


class Pki:
    """Creates the files under ``root`` once; every later call reuses them (a restarted component keeps its
    identity, as on a real control plane)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca_cert = root / "ca.crt"
        self.ca_key = root / "ca.key"
        self.serving_cert = root / "apiserver.crt"
        self.serving_key = root / "apiserver.key"
        self.sa_key = root / "sa.key"
        self.sa_pub = root / "sa.pub"
        self._ca: KeyPair | None = None

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        ca = generate_ca("devcluster-ca")
        self._ca = ca
        _write(self.ca_cert, ca.cert_pem)
        _write(self.ca_key, ca.key_pem, 0o600)
        serving = issue_serving_cert(ca, API_SERVER_SANS)
        _write(self.serving_cert, serving.cert_pem)
        _write(self.serving_key, serving.key_pem, 0o600)
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write(
            self.sa_key,
            sa.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            0o600,
        )
        _write(
            self.sa_pub,
            sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        )

    def client(self, name: str, user: str, groups: tuple[str, ...], server: str) -> Credential:
        """The client certificate of ``user`` and a kubeconfig for ``server`` that presents it."""
        if self._ca is None:
            raise RuntimeError("Pki.create() first")
        pair = issue_client_cert(self._ca, user, groups)
        credential = Credential(
            user, groups, self.root / f"{name}.crt", self.root / f"{name}.key", self.root / f"{name}.kubeconfig"
        )
        _write(credential.cert, pair.cert_pem)
        _write(credential.key, pair.key_pem, 0o600)
        write_kubeconfig(
            credential.kubeconfig,
            server,
            self.ca_cert,
            name,
            {"client-certificate": str(credential.cert), "client-key": str(credential.key)},
        )
        return credential


def write_kubeconfig(path: Path, server: str, ca: Path, user_name: str, user: dict[str, str]) -> Path:
    """A one-context kubeconfig: ``user`` holds ``token`` or ``client-certificate``/``client-key``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "devcluster", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user_name, "user": user}],
        "contexts": [{"name": user_name, "context": {"cluster": "devcluster", "user": user_name}}],
        "current-context": user_name,
    }
    _write(path, yaml.safe_dump(config).encode(), 0o600)
    return path


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)
