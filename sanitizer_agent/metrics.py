"""The agent's Prometheus metrics and its small HTTP server for `/metrics` and `/healthz`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .checkpoint import FenceReason

# Scrub-failure reasons, a fixed set so the metric's label stays bounded.
FAILURE_REASONS = ("drain-timeout", "gpu-error", "scrub-failed", "scrub-timeout", "unhealthy", "no-uuid")


class AgentMetrics:
    """One registry per agent (tests run several agents in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.scrub_duration = Histogram(
            "scrubgate_agent_scrub_duration_seconds",
            "Duration of one device's scrub and verification.",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.scrubbed_bytes = Counter(
            "scrubgate_agent_scrubbed_bytes", "Bytes of device memory zeroed and verified.", registry=r
        )
        self.failures = Counter(
            "scrubgate_agent_scrub_failures", "Teardowns that failed, by reason.", ["reason"], registry=r
        )
        for reason in FAILURE_REASONS:
            self.failures.labels(reason=reason)
        self.fenced_devices = Gauge(
            "scrubgate_agent_fenced_devices",
            "Devices under a fence of this agent (a DeviceTaintRule or the node taint): where a claim's allocation "
            "could not keep them from other claims until their scrub.",
            registry=r,
        )
        self.failed_devices = Gauge(
            "scrubgate_agent_failed_devices",
            "Devices fenced after a failed teardown, waiting for retry or an operator.",
            registry=r,
        )
        self.weak_fence = Gauge(
            "scrubgate_agent_weak_fence",
            "1 while no DeviceTaintRule API is served and the agent falls back to the weaker node taint.",
            registry=r,
        )
        self.node_taint_fences = Counter(
            "scrubgate_agent_node_taint_fences", "Times the agent fenced with a node taint (weaker fence).", registry=r
        )
        self.fences = Counter(
            "scrubgate_agent_fences",
            "Teardowns fenced with DeviceTaintRules (or the node taint) because their claim's allocation could not "
            "keep the devices from other claims, by reason.",
            ["reason"],
            registry=r,
        )
        for reason in FenceReason:
            self.fences.labels(reason=reason.value)
        self.unattested_deallocations = Counter(
            "scrubgate_agent_unattested_deallocations",
            "Allocations found gone (cleared, or the claim deleted) before the scrub of their devices was attested: "
            "scrubgate's admission guard was bypassed or removed.",
            registry=r,
        )
        self.oldest_release = Gauge(
            "scrubgate_agent_oldest_release_seconds",
            "Seconds since the release of the oldest teardown on this node still under way (failed ones apart): "
            "a claim kept allocated, its devices out of the pool, until the agent's attestation lands.",
            registry=r,
        )
        self.teardown_overhead = Histogram(
            "scrubgate_agent_teardown_overhead_seconds",
            "The agent's own time from release seen to the attestation written, not counting drain waits and the scrub.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


# A scrape or probe connection that sends nothing is closed after this long, and at most this many are served
# at once (each holds a thread): idle connections to /metrics cannot pile up threads.
IDLE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, as ThreadingHTTPServer, but at most `max_connections` of them: one more is
    closed at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class Rendered(Protocol):
    def render(self) -> bytes: ...


def serve(
    metrics: Rendered,
    healthy: Callable[[], tuple[bool, str]],
    address: str,
    port: int,
    *,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> ThreadingHTTPServer:
    """Serves `/metrics` and `/healthz` from a daemon thread; `server.server_address` has the bound port."""

    class Handler(BaseHTTPRequestHandler):
        timeout = idle_timeout_s  # the socket's: a connection that sends nothing ends

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._reply(200, metrics.render(), CONTENT_TYPE_LATEST)
            elif self.path in ("/healthz", "/readyz"):
                ok, detail = healthy()
                self._reply(200 if ok else 503, (detail + "\n").encode(), "text/plain; charset=utf-8")
            else:
                self._reply(404, b"not found\n", "text/plain; charset=utf-8")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scrapes every few seconds: no access log
            pass

    server = BoundedThreadingHTTPServer((address, port), Handler, max_connections)
    threading.Thread(target=server.serve_forever, name="agent-metrics", daemon=True).start()
    return server
