"""Test doubles for the stand-in: a throwaway CA, and a tiny HTTPS admission webhook that records
every AdmissionReview it gets and answers with whatever the test says."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Responder = Callable[[dict], dict]


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str = "devcluster test CA") -> tuple[Pem, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key), key, cert


def issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, sans: list[str]) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    names: list[x509.GeneralName] = []
    for san in sans:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(sans[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _pem(cert, key)


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    return Pem(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def allow(review: dict, patch: list | None = None, warnings: list[str] | None = None) -> dict:
    response: dict = {"uid": review["request"]["uid"], "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    if warnings:
        response["warnings"] = warnings
    return response


def deny(review: dict, message: str, code: int | None = None, reason: str = "") -> dict:
    status: dict = {"message": message}
    if code is not None:
        status["code"] = code
    if reason:
        status["reason"] = reason
    return {"uid": review["request"]["uid"], "allowed": False, "status": status}


class FakeWebhook:
    """An HTTPS admission webhook on 127.0.0.1; ``respond[path]`` answers, ``reviews`` records.

    Its certificate names ``<service>.<namespace>.svc`` and 127.0.0.1, so both ``service`` and
    ``url`` client configs verify against ``ca_bundle``.
    """

    def __init__(self, service: tuple[str, str] = ("webhook-test", "fake-webhook")) -> None:
        self.service = service
        ca, ca_key, ca_cert = make_ca()
        self.ca_bundle = base64.b64encode(ca.cert).decode()
        self._serving = issue(ca_key, ca_cert, [f"{service[1]}.{service[0]}.svc", "127.0.0.1"])
        self.respond: dict[str, Responder] = {}
        self.reviews: list[tuple[str, dict]] = []
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    def start(self) -> FakeWebhook:
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                path = self.path.split("?")[0]
                with webhook._lock:
                    webhook.reviews.append((path, review))
                time.sleep(webhook.delay_s)
                answer = webhook.respond.get(path, allow)(review)
                data = json.dumps(
                    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": answer}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
            cert.write_bytes(self._serving.cert)
            key.write_bytes(self._serving.key)
            context.load_cert_chain(cert, key)
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return self._httpd.server_address[1]

    def client_config(self, path: str = "/", url: bool = False) -> dict:
        if url:
            return {"url": f"https://127.0.0.1:{self.port}{path}", "caBundle": self.ca_bundle}
        return {
            "service": {"namespace": self.service[0], "name": self.service[1], "path": path, "port": 443},
            "caBundle": self.ca_bundle,
        }

    def calls(self, path: str) -> list[dict]:
        with self._lock:
            return [review["request"] for p, review in self.reviews if p == path]
