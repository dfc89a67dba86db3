"""Runs the webhook: its two ports on one uvloop event loop (listeners.py, http11.py), structured JSON logs."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvloop
from scrubgate.policies.attestation import rfc3339
from scrubgate.policies.config import PolicyError

from scrubgate.kubeapi import KubeApi

from . import defaults
from .app import LogAuditSink, WebhookState, create_app, create_metrics_app
from .audit import AuditLog, AuditLogError
from .audit_checkpoints import Checkpointer
from .device_classes import DeviceClassWatch
from .http11 import ASGIApp, HTTPConnection, Limits
from .listeners import PlainListener, TLSListener, enforce_read_deadline
from .metrics import Metrics
from .policy_reload import PolicySource
from .tls import ServingTLS, TLSConfigError

_BACKLOG = 2048

log = logging.getLogger("scrubgate.webhook")

_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
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


class WebhookServer:
    """The admission port (TLS, listeners.TLSListener) and the metrics port (plain HTTP) on one event loop, with
    the read deadline, the policy's and the certificate's watchers. `run` serves until `stop`; a stop lets the
    answers under way go out (for up to GRACEFUL_SHUTDOWN_S), as the API server may be waiting for them."""

    def __init__(
        self,
        state: WebhookState,
        app: ASGIApp,
        metrics_app: ASGIApp,
        address: tuple[str, int, int],
        *,
        read_timeout_s: float = defaults.REQUEST_READ_TIMEOUT_S,
        handshake_timeout_s: float = defaults.TLS_HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.state, self.app, self.metrics_app = state, app, metrics_app
        self.host, self.port, self.metrics_port = address
        self.read_timeout_s, self.handshake_timeout_s = read_timeout_s, handshake_timeout_s
        self.started = threading.Event()
        self.ports: tuple[int, int] = (0, 0)  # the admission and the metrics port, once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    def run(self, *, signals: bool = False) -> None:
        """Serves on a uvloop event loop until `stop` (or, with `signals`, SIGTERM or SIGINT)."""
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self.serve(signals=signals))

    def stop(self) -> None:
        """From any thread; nothing once stopped."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: stopped
                loop.call_soon_threadsafe(stopping.set)

    async def serve(self, *, signals: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._loop, self._stopping = loop, asyncio.Event()
        if signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._stopping.set)
        state = self.state
        limits = Limits(self.read_timeout_s, defaults.MAX_BODY_BYTES, defaults.MAX_HEADER_BYTES)
        admission = TLSListener(
            self.app, state.tls, limits, state.metrics, handshake_timeout_s=self.handshake_timeout_s
        )
        plain = PlainListener(self.metrics_app, limits, state.metrics)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listening = socket.create_server((self.host, self.port), family=family, backlog=_BACKLOG)
        listening.setblocking(False)
        try:
            metrics_server = await loop.create_server(plain.protocol, self.host, self.metrics_port, backlog=_BACKLOG)
        except OSError:
            listening.close()
            raise
        budgets = (*admission.budgets, *plain.budgets)
        background = [
            loop.create_task(admission.accept(listening)),
            loop.create_task(enforce_read_deadline(budgets, self.read_timeout_s)),
            loop.create_task(state.policy.watch(state.watch_interval)),
            loop.create_task(state.tls.watch(state.watch_interval)),
        ]
        self.ports = (listening.getsockname()[1], metrics_server.sockets[0].getsockname()[1])
        self.started.set()
        try:
            await self._stopping.wait()
        finally:
            background[0].cancel()
            listening.close()
            metrics_server.close()
            admission.abort_handshakes()
            await _drain([c for b in budgets for c in b.members if isinstance(c, HTTPConnection)])
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self._loop = self._stopping = None


async def _drain(connections: list[HTTPConnection]) -> None:
    """Closes the connections without a whole request in; the others close after their answer, awaited for at
    most GRACEFUL_SHUTDOWN_S."""
    for connection in connections:
        connection.draining = True
        if not connection.busy:
            connection.abort()
    busy = [connection.disconnected() for connection in connections if connection.busy]
    if busy:
        _, late = await asyncio.wait(busy, timeout=defaults.GRACEFUL_SHUTDOWN_S)
        if late:
            log.warning("stopping with %d answers still under way", len(late))


def build_server(
    state: WebhookState,
    app: ASGIApp,
    metrics_app: ASGIApp,
    address: tuple[str, int, int],
    **timeouts: float,
) -> WebhookServer:
    """The server of `app` (the admission port) and `metrics_app` (the metrics port) at (host, port,
    metrics_port); the benchmark's no-op endpoint uses this same stack."""
    # Everything alive now (modules, policy, app) is permanent: keep the collector from rescanning it
    # under load, which shows in the latency tail.
    gc.freeze()
    return WebhookServer(state, app, metrics_app, address, **timeouts)


@dataclass(frozen=True)
class Settings:
    tls_cert: Path
    tls_key: Path
    host: str = defaults.HOST
    port: int = defaults.PORT
    metrics_port: int = defaults.METRICS_PORT
    policy: Path | None = None
    audit_log: Path | None = None
    audit_max_bytes: int = defaults.AUDIT_MAX_BYTES
    audit_backups: int = defaults.AUDIT_BACKUPS
    audit_signing_key: Path | None = None
    audit_checkpoint_interval: float = defaults.AUDIT_CHECKPOINT_INTERVAL
    client_ca: Path | None = None
    client_names: tuple[str, ...] | None = None  # None: defaults.CLIENT_NAMES
    watch_interval: float = 2.0
    # Where the DeviceClass watch reaches the API server: a kubeconfig, else (in a pod) the ServiceAccount; None
    # outside a pod without one: no watch, every claim guarded.
    kubeconfig: Path | None = None


def build(settings: Settings) -> tuple[WebhookState, AuditLog | None]:
    """Loads policy and certificate and opens the audit log; raises PolicyError, TLSConfigError,
    AuditLogError or ValueError with a message for the operator."""
    metrics = Metrics()
    policy = PolicySource(settings.policy, metrics)
    if settings.client_names is not None and settings.client_ca is None:
        raise ValueError("--client-name names the API server's client certificate of --client-ca; give --client-ca")
    tls = ServingTLS(
        settings.tls_cert,
        settings.tls_key,
        client_ca=settings.client_ca,
        client_names=settings.client_names or defaults.CLIENT_NAMES,
        metrics=metrics,
    )
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
    address = (settings.host, settings.port, settings.metrics_port)
    server = build_server(state, create_app(state), create_metrics_app(state), address)
    log.info(
        "serving admission on https://%s:%d, metrics and probes on http://%s:%d (policy %s)",
        settings.host,
        settings.port,
        settings.host,
        settings.metrics_port,
        state.policy.policy.digest,
        extra={
            "audit_log": str(settings.audit_log) if settings.audit_log else None,
            "client_ca": str(settings.client_ca) if settings.client_ca else None,
            "client_names": sorted(state.tls.client_names) if settings.client_ca else None,
        },
    )
    if settings.client_ca is None:
        log.warning(
            "no --client-ca given: any caller that reaches the admission port gets decisions and shares the API "
            "server's connections; give the API server a client certificate and the webhook --client-ca"
        )
    try:
        server.run(signals=True)
    except OSError as exc:  # a port taken, an address not ours
        log.error("cannot serve on %s: %s", settings.host, exc)
        return 1
    finally:
        if stop_watch is not None:
            stop_watch.set()
        if audit is not None:
            audit.close()
    return 0
