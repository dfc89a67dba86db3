"""bench/lifecycle.py's row `resourceclaim controller: failed syncs per claim`: read from kube-controller-manager's
/metrics, the retries of the resourceclaim controller's workqueue and no other's."""

from __future__ import annotations

from collections import Counter

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
