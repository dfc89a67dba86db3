"""The serving TLS context: TLS 1.2 or newer, certificate and key reloaded from disk when they change.

cert-manager (or a Secret volume update) replaces the files; the watcher loads the new pair onto the
same SSLContext, so every handshake after that uses it and open connections are not disturbed. A pair
that does not load (half-written, key and certificate not matching) is refused and the old pair keeps
serving; the watcher retries on the next change. The pair is read once and loaded from a private
copy, so the files changing between the check and the load cannot mix two pairs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from . import defaults
from .metrics import Metrics
from .policy_reload import file_stamp

log = logging.getLogger(__name__)


class TLSConfigError(ValueError):
    """A certificate/key pair or client CA that cannot serve; the message names the files."""


# The ASGI scope's `state` key under which the server puts each connection's ClientVerdict.
CLIENT_VERDICT = "scrubgate_client"


@dataclass(frozen=True)
class ClientVerdict:
    """Whether a connection's caller may ask for admission decisions; `refusal` says why not (for its 403 and
    the log), `subject` names the certificate presented, if any."""

    allowed: bool
    refusal: str = ""
    subject: str = ""


def certificate_names(peercert: Mapping[str, Any]) -> list[str]:
    """The subject's common names and the DNS names of a certificate, as ssl's getpeercert() returns it."""
    names = [value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"]
    names += [value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS"]
    return names


def _check_pair(cert_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path) -> x509.Certificate:
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as exc:
        raise TLSConfigError(f"{cert_path}: not a PEM certificate chain ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TLSConfigError(f"{key_path}: not an unencrypted PEM private key ({exc})") from None
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if chain[0].public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise TLSConfigError(f"{key_path} is not the private key of the certificate in {cert_path}")
    return chain[0]


class ServingTLS:
    def __init__(
        self,
        cert_path: str | Path,
        key_path: str | Path,
        *,
        client_ca: str | Path | None = None,
        client_names: Sequence[str] = defaults.CLIENT_NAMES,
        metrics: Metrics | None = None,
    ) -> None:
        """Loads the pair; raises TLSConfigError when it cannot, so the webhook never starts without one."""
        self.cert_path, self.key_path = Path(cert_path), Path(key_path)
        self.metrics = metrics
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.client_ca = Path(client_ca) if client_ca is not None else None
        self.client_names = frozenset(client_names)
        if not self.client_names:
            raise TLSConfigError("no client name given: the API server's client certificate could never be accepted")
        if self.client_ca is not None:
            # Optional at the TLS layer so that kubelet probes (no client certificate) reach /healthz and
            # /readyz, and a certificate of the right CA but another name gets a 403 saying so; a presented
            # certificate must verify (OpenSSL also requires it be for client authentication).
            self.context.verify_mode = ssl.CERT_OPTIONAL
            try:
                self.context.load_verify_locations(cafile=str(self.client_ca))
            except (OSError, ssl.SSLError) as exc:
                raise TLSConfigError(f"{self.client_ca}: cannot load the client CA: {exc}") from None
        self._stamp: tuple[object, object] | None = None
        self._pair: tuple[bytes, bytes] | None = None
        self.not_after: float | None = None
        stamp, pair = self._read()
        if pair is None:
            raise TLSConfigError(f"cannot read {self.cert_path} and {self.key_path}")
        self._install(pair)
        self._stamp = stamp

    def client_verdict(self, peercert: Mapping[str, Any] | None) -> ClientVerdict:
        """Whether the caller of a connection whose handshake gave `peercert` (verified against --client-ca by
        then) is the API server: every caller is, without --client-ca; else its certificate must carry an
        allowed name (--client-name), as a certificate of a shared CA may belong to someone else."""
        if self.client_ca is None:
            return ClientVerdict(True)
        if not peercert:
            return ClientVerdict(False, f"a client certificate signed by the CA in {self.client_ca} is required")
        names = certificate_names(peercert)
        subject = ", ".join(names) or "(no name)"
        if self.client_names.intersection(names):
            return ClientVerdict(True, subject=subject)
        allowed = ", ".join(sorted(self.client_names))
        return ClientVerdict(
            False,
            f"the client certificate names {subject}, not one of the names allowed to ask for admission decisions "
            f"({allowed}; --client-name)",
            subject,
        )

    @property
    def loaded(self) -> bool:
        return self._pair is not None

    def _stamps(self) -> tuple[object, object]:
        return file_stamp(self.cert_path), file_stamp(self.key_path)

    def _read(self) -> tuple[tuple[object, object], tuple[bytes, bytes] | None]:
        """Both files, read between two identical stamps (else None: a writer was busy)."""
        before = self._stamps()
        try:
            pair = self.cert_path.read_bytes(), self.key_path.read_bytes()
        except OSError as exc:
            log.warning("cannot read the serving certificate pair: %s", exc)
            return before, None
        return before, (pair if self._stamps() == before else None)

    def _install(self, pair: tuple[bytes, bytes]) -> None:
        cert = _check_pair(*pair, self.cert_path, self.key_path)
        with tempfile.TemporaryDirectory(prefix="scrubgate-tls-") as private:
            cert_file, key_file = Path(private, "tls.crt"), Path(private, "tls.key")
            cert_file.write_bytes(pair[0])
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(pair[1])
            try:
                self.context.load_cert_chain(cert_file, key_file)
            except ssl.SSLError as exc:
                if self._pair is not None:
                    # OpenSSL may have replaced the certificate before refusing the key: put the old pair back.
                    cert_file.write_bytes(self._pair[0])
                    key_file.write_bytes(self._pair[1])
                    self.context.load_cert_chain(cert_file, key_file)
                raise TLSConfigError(f"{self.cert_path}, {self.key_path}: OpenSSL refused the pair: {exc}") from None
        self._pair = pair
        self.not_after = cert.not_valid_after_utc.timestamp()
        if self.metrics is not None:
            self.metrics.cert_not_after.set(self.not_after)

    def reload_if_changed(self) -> bool:
        """True when a changed pair was loaded and serves new handshakes."""
        if self._stamps() == self._stamp:
            return False
        stamp, pair = self._read()
        if pair is None:
            return False  # mid-write or missing: look again on the next poll
        if pair == self._pair:
            self._stamp = stamp
            return False
        try:
            self._install(pair)
        except TLSConfigError as exc:
            self._stamp = stamp  # retried when either file changes again
            if self.metrics is not None:
                self.metrics.cert_reload_errors.inc()
            log.error(
                "refused the changed serving certificate, the previous one keeps serving: %s",
                exc,
                extra={"tls_cert": str(self.cert_path), "tls_key": str(self.key_path)},
            )
            return False
        self._stamp = stamp
        if self.metrics is not None:
            self.metrics.cert_reloads.inc()
        log.info("serving certificate reloaded from %s", self.cert_path, extra={"not_after": self.not_after})
        return True

    async def watch(self, interval: float) -> None:
        # Runs on the event loop thread, the thread that does the handshakes: no lock is needed around
        # the context, and each handshake sees one pair or the other.
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()
