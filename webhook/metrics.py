"""Prometheus metrics of the webhook, on a registry of its own (one per app, so tests can run several)."""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .defaults import HEAVY_BODY_BYTES

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The API server's timeout for us is at most 5 s (manifests): buckets resolve the sub-millisecond
# hot path and the tail up to that timeout.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

REQUESTS = "scrubgate_admission_requests"
LATENCY = "scrubgate_admission_duration_seconds"
RULE_HITS = "scrubgate_rule_hits"


class AdmissionTally(Collector):
    """The metrics of every admission request (requests by webhook, operation, kind and decision; latency
    by webhook; rule hits), kept as plain numbers and turned into metric families when /metrics is read.

    prometheus_client's Counter and Histogram take a lock and check their state on every increment, and
    walk the buckets in Python: about 1.5 µs per request, which the load benchmark shows. These numbers
    change only on the event loop thread, in the admission endpoints, so plain increments suffice. The
    exposition is the same as theirs: `_total`, `_bucket`/`_count`/`_sum`, and `_created`."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self._bounds = (*buckets, math.inf)
        self._le = [floatToGoString(bound) for bound in self._bounds]
        # label values -> [count, created]
        self._requests: dict[tuple[str, str, str, str], list[float]] = {}
        self._rule_hits: dict[tuple[str, str], list[float]] = {}
        # webhook -> [count per bucket..., sum, created]
        self._latency: dict[str, list[float]] = {}

    def count(self, webhook: str, operation: str, kind: str, decision: str, seconds: float) -> None:
        key = (webhook, operation, kind, decision)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = [0, time.time()]
        counter[0] += 1
        row = self._latency.get(webhook)
        if row is None:
            row = self._latency[webhook] = [0] * len(self._bounds) + [0.0, time.time()]
        row[bisect_left(self._bounds, seconds)] += 1  # the first bucket whose bound is >= seconds
        row[-2] += seconds

    def hit(self, rule: str, action: str, count: int = 1) -> None:
        key = (rule, action)
        counter = self._rule_hits.get(key)
        if counter is None:
            counter = self._rule_hits[key] = [0, time.time()]
        counter[0] += count

    def collect(self) -> Iterator[Metric]:
        # list(...) snapshots: a scrape from another thread must not see a dict change size under it.
        requests = CounterMetricFamily(
            REQUESTS,
            "Admission requests by webhook, operation, kind and decision "
            "(allow, deny, warn, audit, patch, error, invalid, expired: not evaluated, the API server had stopped waiting).",
            labels=("webhook", "operation", "kind", "decision"),
        )
        for labels, (value, created) in list(self._requests.items()):
            requests.add_metric(labels, value, created=created)
        yield requests
        latency = HistogramMetricFamily(
            LATENCY, "Time from the request's arrival to the answer, audit write included.", labels=("webhook",)
        )
        for webhook, row in list(self._latency.items()):
            *counts, total, created = list(row)
            latency.add_metric((webhook,), list(zip(self._le, accumulate(counts), strict=True)), total)
            latency.add_sample(f"{LATENCY}_created", {"webhook": webhook}, created)
        yield latency
        hits = CounterMetricFamily(RULE_HITS, "Findings by rule id and action.", labels=("rule", "action"))
        for labels, (value, created) in list(self._rule_hits.items()):
            hits.add_metric(labels, value, created=created)
        yield hits


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.admission = AdmissionTally(_LATENCY_BUCKETS)
        r.register(self.admission)
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
        self.refusals = Counter(
            "scrubgate_webhook_refusals",
            "Deny findings in refused admission requests, every one (audited or not), by rule and reason (the "
            "field the finding is about, list indices as *).",
            ["rule", "reason"],
            registry=r,
        )
        self.audit_repeats_unrecorded = Counter(
            "scrubgate_webhook_audit_repeats_unrecorded",
            "Refusals not written to the audit log because an identical one of the same object and user was "
            "recorded within the repeat window (the next record after it says how many).",
            registry=r,
        )
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
        self.heavy_queued = Gauge(
            "scrubgate_webhook_heavy_requests_queued",
            f"Heavy requests (bodies over {HEAVY_BODY_BYTES // 1024} KiB) waiting for the one worker that evaluates "
            "them, which serves requesters in turn; a queue that stays long means the API server's 5 s timeout "
            "refuses some.",
            registry=r,
        )
        self.device_classes_synced = Gauge(
            "scrubgate_webhook_device_classes_synced",
            "1 once the webhook has listed the cluster's DeviceClasses; 0 before (every claim is then guarded as one "
            "that may hold a GPU) or without API access.",
            registry=r,
        )
        self.unproven_excluded = Gauge(
            "scrubgate_webhook_unproven_excluded_classes",
            "DeviceClasses in the policy's excludeDeviceClasses whose selectors do not prove they hand out no GPU "
            "memory: their claims skip the webhook by name. Fix the class or the policy (the webhook's log names "
            "them).",
            registry=r,
        )
        self.connections = Gauge(
            "scrubgate_webhook_connections",
            "Open connections by budget: handshake (TLS handshake under way), apiserver (a client certificate of "
            "--client-ca with an allowed name, or every caller without --client-ca), unverified (probes, anyone "
            "else), metrics (the metrics port).",
            ["budget"],
            registry=r,
        )
        self.connections_closed = Counter(
            "scrubgate_webhook_connections_closed",
            "Connections the webhook closed, by budget and reason: shed (the budget was full: its oldest made room "
            "for a new one), refused (the apiserver budget was full: the new one), handshake (TLS handshake failed "
            "or timed out), deadline (no whole request in time), idle (kept alive, unused for the keep-alive: the API "
            "server's connections, longer than the API server keeps them; others, the read deadline).",
            ["budget", "reason"],
            registry=r,
        )
        self.cert_not_after = Gauge(
            "scrubgate_tls_certificate_not_after_seconds",
            "Expiry of the serving certificate in force, as a Unix time.",
            registry=r,
        )

    def set_policy(self, digest: str) -> None:
        self.policy_info.clear()
        self.policy_info.labels(digest).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
