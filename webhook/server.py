"""Runs the webhook: uvicorn, one worker, TLS from ServingTLS, structured JSON logs."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import ssl
import sys
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import h11
import uvicorn
from scrubgate.policies.attestation import rfc3339
from scrubgate.policies.config import PolicyError
from uvicorn.protocols.http.h11_impl import H11Protocol

from scrubgate.kubeapi import KubeApi

from . import defaults
from .app import CLIENT_VERIFIED, LogAuditSink, WebhookState, create_app
from .audit import AuditLog, AuditLogError
from .audit_checkpoints import Checkpointer
from .device_classes import DeviceClassWatch
from .metrics import Metrics
from .policy_reload import PolicySource
from .tls import ServingTLS, TLSConfigError

log = logging.getLogger("scrubgate.webhook")

_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured duplicate of the message
}


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's `extra` fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": rfc3339(datetime.fromtimestamp(record.created, UTC)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((key, value) for key, value in vars(record).items() if key not in _STANDARD_ATTRS)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class VerifiedClientH11Protocol(H11Protocol):
    """Marks each request of a connection whose client certificate verified against --client-ca (the
    TLS layer asks for one but lets probes through without); the app requires the mark on admission paths.
    A request must arrive in full within `read_timeout_s` of the connection's opening or of the last answer,
    or the connection is closed (slow bodies, connections that send nothing)."""

    read_timeout_s = defaults.REQUEST_READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if transport.get_extra_info("peercert"):
            self.app_state = {**self.app_state, CLIENT_VERIFIED: True}
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _too_slow(self) -> None:
        if not self.transport.is_closing():
            log.warning(
                "closing a connection from %s: no complete request within %.0fs",
                (self.client or ("?",))[0],
                self.read_timeout_s,
            )
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()  # the request is in: what follows is the answer's, then keep-alive's, time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def build_server(app: Any, context: ssl.SSLContext, host: str, port: int) -> uvicorn.Server:
    """uvicorn on one worker with `context`; the benchmark's no-op endpoint uses this same stack."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ssl_context_factory=lambda _config, _default: context,
        http=VerifiedClientH11Protocol,
        limit_concurrency=defaults.MAX_CONNECTIONS,
        workers=1,
        log_config=None,
        access_log=False,
        server_header=False,
        lifespan="on",
    )
    # Everything alive now (modules, policy, app) is permanent: keep the collector from rescanning it
    # under load, which shows in the latency tail.
    gc.freeze()
    return uvicorn.Server(config)


@dataclass(frozen=True)
class Settings:
    tls_cert: Path
    tls_key: Path
    host: str = defaults.HOST
    port: int = defaults.PORT
    policy: Path | None = None
    audit_log: Path | None = None
    audit_max_bytes: int = defaults.AUDIT_MAX_BYTES
    audit_backups: int = defaults.AUDIT_BACKUPS
    audit_signing_key: Path | None = None
    audit_checkpoint_interval: float = defaults.AUDIT_CHECKPOINT_INTERVAL
    client_ca: Path | None = None
    watch_interval: float = 2.0
    # Where the DeviceClass watch reaches the API server: a kubeconfig, else (in a pod) the ServiceAccount; None
    # outside a pod without one: no watch, every claim guarded.
    kubeconfig: Path | None = None


def build(settings: Settings) -> tuple[WebhookState, AuditLog | None]:
    """Loads policy and certificate and opens the audit log; raises PolicyError, TLSConfigError,
    AuditLogError or ValueError with a message for the operator."""
    metrics = Metrics()
    policy = PolicySource(settings.policy, metrics)
    tls = ServingTLS(settings.tls_cert, settings.tls_key, client_ca=settings.client_ca, metrics=metrics)
    audit = None
    if settings.audit_signing_key is not None and settings.audit_log is None:
        raise ValueError("--audit-signing-key signs the chain of --audit-log; give --audit-log as well")
    if settings.audit_log is not None:
        checkpointer = None
        if settings.audit_signing_key is not None:
            checkpointer = Checkpointer.from_file(
                settings.audit_signing_key, interval=settings.audit_checkpoint_interval
            )
        audit = AuditLog(
            settings.audit_log,
            max_bytes=settings.audit_max_bytes,
            backups=settings.audit_backups,
            stream=sys.stdout,
            checkpointer=checkpointer,
        )
        audit.open()
    state = WebhookState(
        policy=policy,
        metrics=metrics,
        tls=tls,
        audit=audit if audit is not None else LogAuditSink(),
        require_client_cert=settings.client_ca is not None,
        watch_interval=settings.watch_interval,
    )
    metrics.heavy_queued.set_function(state.heavy_lane.queued)
    return state, audit


def _watch_device_classes(settings: Settings, state: WebhookState) -> threading.Event | None:
    """Starts the DeviceClass watch (device_classes.py); returns what stops it, or None without API access."""
    if settings.kubeconfig is None and "KUBERNETES_SERVICE_HOST" not in os.environ:
        log.warning(
            "no --kubeconfig and not in a pod: the webhook cannot read the cluster's DeviceClasses, so it guards "
            "every claim as one that may hold a GPU"
        )
        return None
    kubeconfig = str(settings.kubeconfig) if settings.kubeconfig else None
    watch = DeviceClassWatch(
        lambda: KubeApi.connect(kubeconfig), on_unproven=lambda names: state.metrics.unproven_excluded.set(len(names))
    )
    state.classes = watch.classes
    state.classes_synced = watch.synced.is_set
    state.metrics.device_classes_synced.set_function(lambda: 1.0 if watch.synced.is_set() else 0.0)
    stop = threading.Event()
    policy = lambda: state.policy.policy  # noqa: E731 - read at each event: the policy reloads
    threading.Thread(target=watch.run, args=(stop, policy), name="deviceclass-watch", daemon=True).start()
    return stop


def serve(settings: Settings) -> int:
    configure_logging()
    try:
        state, audit = build(settings)
    except (PolicyError, TLSConfigError, AuditLogError, ValueError) as exc:
        log.error("cannot start the webhook: %s", exc)
        return 2
    if audit is None:
        log.warning("no --audit-log given: audit records go to this log only, without the hash chain")
    stop_watch = _watch_device_classes(settings, state)
    server = build_server(create_app(state), state.tls.context, settings.host, settings.port)
    log.info(
        "serving admission on https://%s:%d (policy %s)",
        settings.host,
        settings.port,
        state.policy.policy.digest,
        extra={"audit_log": str(settings.audit_log) if settings.audit_log else None},
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again: turn that into a
    # normal exit so the audit log is closed (its records are already on disk either way).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if stop_watch is not None:
            stop_watch.set()
        if audit is not None:
            audit.close()
    return 0 if server.started else 1


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)
