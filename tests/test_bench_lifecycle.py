"""bench/lifecycle.py's row `resourceclaim controller: failed syncs per claim`: read from kube-controller-manager's
/metrics, the retries of the resourceclaim controller's workqueue and no other's."""

from __future__ import annotations

from collections import Counter

from devcluster import refused_claim
from devcluster.load import (
    CLAIM_RETRIES,
    CONTROL_PLANE,
    CONTROLLER_COUNTERS,
    PLANE_PROCESSES,
    ClaimOutcome,
    LoadResult,
    LoadSpec,
    counted_since,
    counters,
)

# As kube-controller-manager v1.37.2 exposes them (component-base/metrics/prometheus/workqueue).
METRICS = """\
# HELP workqueue_retries_total [BETA] Total number of retries handled by workqueue
# TYPE workqueue_retries_total counter
workqueue_retries_total{name="resource_claim"} %d
workqueue_retries_total{name="job"} 40
workqueue_retries_total{name="garbage_collector_attempt_to_delete"} 7
# HELP workqueue_adds_total [BETA] Total number of adds handled by workqueue
# TYPE workqueue_adds_total counter
workqueue_adds_total{name="resource_claim"} 900
"""


def test_failed_syncs_are_the_resource_claim_queues_retries_over_the_run() -> None:
    before, after = counters(METRICS % 5, CONTROLLER_COUNTERS), counters(METRICS % 95, CONTROLLER_COUNTERS)
    assert before == Counter({CLAIM_RETRIES: 5})
    over_run = counted_since(before, after)
    claims = [ClaimOutcome("team-a", f"pod-{i}", "mig") for i in range(40)]
    result = LoadResult(LoadSpec(claims=40), 1, 0, 1.0, claims, reallocations=0, violations=[], leftover_fences=[])
    result.controller = over_run
    assert result.failed_syncs_per_claim == 90 / 40
    assert dict(result.rows())["resourceclaim controller: failed syncs per claim"] == "2.25 (90 in all)"


def test_unread_metrics_say_so() -> None:
    result = LoadResult(LoadSpec(claims=1), 1, 0, 1.0, claims=[], reallocations=0, violations=[], leftover_fences=[])
    assert result.failed_syncs_per_claim is None
    assert dict(result.rows())["resourceclaim controller: failed syncs per claim"] == "n/a"


def test_the_control_planes_cpu_is_split_by_process() -> None:
    claims = [ClaimOutcome("team-a", f"pod-{i}", "mig") for i in range(10)]
    result = LoadResult(LoadSpec(claims=10), 1, 0, 1.0, claims, reallocations=0, violations=[], leftover_fences=[])
    result.cpu_s = Counter(
        {
            CONTROL_PLANE: 0.8,
            "etcd": 0.1,
            "kube-apiserver": 0.5,
            "kube-controller-manager": 0.08,
            "kube-scheduler": 0.12,
        }
    )
    rows = dict(result.rows())
    assert rows["CPU per claim: control plane / scrubgate's webhook and agents"] == "80 ms / 0 ms"
    split = f"control plane CPU per claim: {' / '.join(PLANE_PROCESSES)}"
    assert rows[split] == "10 / 50 / 8 / 12 ms"


def test_the_refused_claim_row_says_what_was_measured() -> None:
    def row(value: float | str | None) -> str:
        result = LoadResult(LoadSpec(claims=1), 1, 0, 1.0, [], reallocations=0, violations=[], leftover_fences=[])
        result.refused_claim = value
        return dict(result.rows())["resourceclaim controller: a claim refused once after the burst, created after"]

    assert row(0.0423) == "42 ms"
    assert row("HarnessError: no Event") == "n/a (HarnessError: no Event)"
    assert row(None) == "not measured"


class QuotaCluster:
    """kube-apiserver as the probe meets it: the controller's refusal shows as an Event a few reads after the
    pod, and the claim exists only once the quota is gone (a few reads later: the controller's retry)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.quota = True
        self.reads_after_lift = 0

    def resource_path(self, resource: str, namespace: str) -> str:
        return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/{resource}"

    def request(self, method: str, path: str, body: object = None, user: str = "admin") -> dict:
        self.calls.append((method, path))
        if method == "DELETE" and path.endswith(f"/resourcequotas/{refused_claim.QUOTA}"):
            self.quota = False
        if path.endswith("/events"):
            refusals = sum(1 for m, p in self.calls if p.endswith("/pods") and m == "POST") and len(self.calls) > 4
            return {"items": [{"reason": refused_claim.REFUSED}] if refusals else []}
        if path.endswith("/resourceclaims"):
            if self.quota:
                return {"items": []}
            self.reads_after_lift += 1
            return {"items": [{"metadata": {"name": "probe-gpu-x"}}] if self.reads_after_lift > 2 else []}
        return {}


def test_the_probe_lifts_the_quota_only_after_the_refusal_and_times_the_retry() -> None:
    cluster = QuotaCluster()
    probe = refused_claim.RefusedClaim(cluster, "load-x-refused", "tenant-a", timeout_s=5)
    probe.start()
    probe.wait()
    assert probe.problem is None and probe.waited_s is not None and probe.waited_s > 0
    lifted = cluster.calls.index(("DELETE", f"/api/v1/namespaces/load-x-refused/resourcequotas/{refused_claim.QUOTA}"))
    assert any(p.endswith("/events") for _, p in cluster.calls[:lifted]), "lifted before the refusal was seen"
    assert cluster.calls[-1] == ("DELETE", "/api/v1/namespaces/load-x-refused/pods/probe")


def test_a_probe_that_sees_no_refusal_says_so() -> None:
    cluster = QuotaCluster()
    cluster.request = lambda method, path, body=None, user="admin": {"items": []}
    probe = refused_claim.RefusedClaim(cluster, "load-x-refused", "tenant-a", timeout_s=0.2)
    probe.start()
    probe.wait()
    assert probe.waited_s is None and probe.problem is not None and "FailedResourceClaimCreation" in probe.problem
