"""Prometheus metrics of the webhook, on a registry of its own (one per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The API server's timeout for us is at most 5 s (manifests): buckets resolve the sub-millisecond
# hot path and the tail up to that timeout.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "scrubgate_admission_requests",
            "Admission requests by webhook, operation, kind and decision "
            "(allow, deny, warn, audit, patch, error, invalid).",
            ["webhook", "operation", "kind", "decision"],
            registry=r,
        )
        self.latency = Histogram(
            "scrubgate_admission_duration_seconds",
            "Time from the request's arrival to the answer, audit write included.",
            ["webhook"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rule_hits = Counter(
            "scrubgate_rule_hits", "Findings by rule id and action.", ["rule", "action"], registry=r
        )
        self.policy_reloads = Counter(
            "scrubgate_policy_reloads", "Policy files loaded after a change on disk.", registry=r
        )
        self.policy_reload_errors = Counter(
            "scrubgate_policy_reload_errors",
            "Changed policy files refused (the previous policy stays in force).",
            registry=r,
        )
        self.policy_info = Gauge(
            "scrubgate_policy_info", "The policy in force (value 1), by digest.", ["digest"], registry=r
        )
        self.audit_records = Counter("scrubgate_audit_records", "Audit records written.", registry=r)
        self.audit_write_errors = Counter(
            "scrubgate_audit_write_errors", "Audit records that could not be written.", registry=r
        )
        self.cert_reloads = Counter(
            "scrubgate_tls_certificate_reloads", "Serving certificate pairs loaded after a change.", registry=r
        )
        self.cert_reload_errors = Counter(
            "scrubgate_tls_certificate_reload_errors",
            "Changed certificate/key pairs refused (the previous pair keeps serving).",
            registry=r,
        )
        self.cert_not_after = Gauge(
            "scrubgate_tls_certificate_not_after_seconds",
            "Expiry of the serving certificate in force, as a Unix time.",
            registry=r,
        )

        # Label children cached per label set: `labels()` takes a lock and builds a key on every call.
        self._requests: dict[tuple[str, str, str, str], Counter] = {}
        self._latency: dict[str, Histogram] = {}

    def count(self, webhook: str, operation: str, kind: str, decision: str, seconds: float) -> None:
        """One admission request answered after `seconds`."""
        key = (webhook, operation, kind, decision)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(*key)
        counter.inc()
        histogram = self._latency.get(webhook)
        if histogram is None:
            histogram = self._latency[webhook] = self.latency.labels(webhook)
        histogram.observe(seconds)

    def set_policy(self, digest: str) -> None:
        self.policy_info.clear()
        self.policy_info.labels(digest).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
