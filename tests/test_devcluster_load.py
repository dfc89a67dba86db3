"""devcluster.load's reading of what the observer saw: the load test and bench/lifecycle.py trust it to say
whether every claim ended clean, so a claim that was not fenced, attested, unfenced or released must show."""

from __future__ import annotations

import copy
import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies import names
from scrubgate.policies.attestation import sign

from devcluster.load import (
    ClaimOutcome,
    LoadResult,
    LoadSpec,
    ended_at,
    follow,
    percentile,
    reallocations,
    scheduler_counts,
)
from devcluster.observer import Observed
from devcluster.processes import HarnessError

KEY = Ed25519PrivateKey.generate()
KEYS = {"k": KEY.public_key()}
DEVICE = ("gpu.nvidia.com", "node", "gpu-0-mig-1")


def claim(uid: str, *, allocated: bool, reserved: bool, finalizer: bool = True, token: str | None = None) -> dict:
    annotations = {names.ANNOTATION_DEVICES: json.dumps([dict(zip(("driver", "pool", "device"), DEVICE, strict=True))])}
    if token:
        annotations[names.ANNOTATION_ATTESTATION] = token
    obj: dict = {
        "metadata": {
            "namespace": "load",
            "name": uid,
            "uid": uid,
            "finalizers": [names.FINALIZER] if finalizer else [],
            "annotations": annotations,
        },
        "status": {},
    }
    if allocated:
        result = dict(zip(("driver", "pool", "device"), DEVICE, strict=True))
        obj["status"]["allocation"] = {"devices": {"results": [{"request": "gpu", **result}]}}
    if reserved:
        obj["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "pod-uid"}]
    return obj


def token(uid: str, verified: bool = True) -> str:
    device = {**dict(zip(("driver", "pool", "device"), DEVICE, strict=True)), "verified": verified}
    return sign(
        {"v": 1, "claim": {"namespace": "load", "name": uid, "uid": uid}, "node": "node", "devices": [device]}, KEY, "k"
    )


def events(*steps: tuple[float, str, dict]) -> list[Observed]:
    return [Observed(rv, "resourceclaims", kind, copy.deepcopy(obj), at) for rv, (at, kind, obj) in enumerate(steps, 1)]


def fence(rv: int, at: float, kind: str, name: str) -> Observed:
    return Observed(rv, "devicetaintrules", kind, {"metadata": {"name": name}}, at)


def pod(rv: int, at: float, kind: str, phase: str) -> Observed:
    return Observed(rv, "pods", kind, {"metadata": {"namespace": "load", "name": "p"}, "status": {"phase": phase}}, at)


def finished(outcome: ClaimOutcome) -> ClaimOutcome:
    outcome.finished, outcome.canary_found = True, False
    return outcome


def test_a_clean_lifecycle_is_read_in_order() -> None:
    history = events(
        (0.0, "ADDED", claim("a", allocated=False, reserved=False)),
        (1.0, "MODIFIED", claim("a", allocated=True, reserved=True)),
        (5.0, "MODIFIED", claim("a", allocated=False, reserved=False)),
        (5.2, "MODIFIED", claim("a", allocated=False, reserved=False, token=token("a"))),
        (5.4, "DELETED", claim("a", allocated=False, reserved=False, token=token("a"))),
    )
    fences = [fence(10, 1.1, "ADDED", "own"), fence(11, 1.2, "ADDED", "parent")]
    fences += [fence(12, 5.25, "DELETED", "own"), fence(13, 5.3, "DELETED", "parent")]
    outcome = finished(ClaimOutcome("load", "p", "mig", name="a", uid="a"))
    follow(outcome, history, fences, KEYS)
    outcome.released_at = ended_at(
        [pod(20, 1.0, "ADDED", "Running"), pod(21, 4.9, "MODIFIED", "Succeeded"), pod(22, 5.0, "DELETED", "Succeeded")]
    )
    assert (outcome.allocated_at, outcome.fenced_at, outcome.released_at) == (1.0, 1.1, 4.9)
    assert (outcome.unfenced_at, outcome.finalizer_removed_at) == (5.3, 5.4)
    assert outcome.attested and outcome.devices == (DEVICE[2],)
    assert outcome.problems() == []


def test_what_did_not_happen_shows_as_a_problem() -> None:
    history = events(
        (1.0, "ADDED", claim("b", allocated=True, reserved=True)),
        (5.0, "MODIFIED", claim("b", allocated=False, reserved=False, token=token("b", verified=False))),
        (5.4, "DELETED", claim("b", allocated=False, reserved=False, token=token("b", verified=False))),
    )
    outcome = finished(ClaimOutcome("load", "p", "mig", name="b", uid="b"))
    follow(outcome, history, [fence(10, 1.1, "ADDED", "own")], KEYS)
    assert not outcome.attested and outcome.unfenced_at is None
    (problem,) = outcome.problems()
    assert "no attestation verified" in problem and "fences were not all lifted" in problem

    never_fenced = finished(ClaimOutcome("load", "q", "mig", name="c", uid="c"))
    follow(never_fenced, events((1.0, "ADDED", claim("c", allocated=True, reserved=True))), [], KEYS)
    (problem,) = never_fenced.problems()
    assert "never fenced" in problem and "never seen ending" in problem and "finalizer" in problem

    found = ClaimOutcome("load", "r", "gpu", finished=True, canary_found=True)
    assert "found an earlier tenant's canary" in found.problems()[0]


def test_reallocations_count_devices_an_earlier_claim_held() -> None:
    first = events((1.0, "ADDED", claim("a", allocated=True, reserved=True)))
    later = [Observed(5, "resourceclaims", "ADDED", claim("b", allocated=True, reserved=True), 6.0)]
    assert reallocations({"a": first}) == 0
    assert reallocations({"a": first, "b": later}) == 1


def test_percentiles_and_run_times() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (50.0, 99.0, 100.0)
    spec = LoadSpec(run_seconds=4.0, run_spread=0.5)
    times = [spec.run_time(i) for i in range(200)]
    assert min(times) == 3.0 and max(times) == 5.0 and len(set(times[:10])) == 10
    assert [spec.wants(i) for i in range(8)] == ["mig"] * 7 + ["gpu"]


def test_a_pod_seen_only_running_has_not_ended() -> None:
    assert ended_at([pod(1, 1.0, "ADDED", "Pending"), pod(2, 2.0, "MODIFIED", "Running")]) is None
    assert ended_at([pod(1, 1.0, "ADDED", "Running"), pod(2, 3.0, "DELETED", "Running")]) == 3.0


# What kube-scheduler 1.37 serves, cut down: counters by label, the same event in two queues.
SCHEDULER_METRICS = """\
# HELP scheduler_schedule_attempts_total [STABLE] Number of attempts to schedule pods, by the result.
# TYPE scheduler_schedule_attempts_total counter
scheduler_schedule_attempts_total{profile="default-scheduler",result="scheduled"} 200
scheduler_schedule_attempts_total{profile="default-scheduler",result="unschedulable"} 3496
# HELP scheduler_queue_incoming_pods_total [STABLE] Number of pods added to scheduling queues by event and queue type.
# TYPE scheduler_queue_incoming_pods_total counter
scheduler_queue_incoming_pods_total{event="resource.k8s.io/ResourceClaimUpdate",queue="backoff"} 582
scheduler_queue_incoming_pods_total{event="resource.k8s.io/ResourceSliceUpdate",queue="backoff"} 2400
scheduler_queue_incoming_pods_total{event="resource.k8s.io/ResourceSliceUpdate",queue="unschedulable"} 3354
scheduler_queue_incoming_pods_total{event="UnscheduledPodAdd",queue="active"} 200
"""


class _ControlPlane:
    def __init__(self, text: str | None) -> None:
        self.text = text

    def scheduler_metrics(self) -> str:
        if self.text is None:
            raise HarnessError("GET kube-scheduler's /metrics on port 1: HTTP 0: connection refused")
        return self.text


class _Cluster:
    def __init__(self, text: str | None) -> None:
        self.control_plane = _ControlPlane(text)


def test_the_schedulers_counters_are_read_by_result_and_by_event() -> None:
    counts = scheduler_counts(_Cluster(SCHEDULER_METRICS))  # type: ignore[arg-type]
    assert counts is not None
    assert counts["attempts/scheduled"] == 200 and counts["attempts/unschedulable"] == 3496
    assert counts["requeued/resource.k8s.io/ResourceSliceUpdate"] == 5754  # both queues
    assert counts["requeued/resource.k8s.io/ResourceClaimUpdate"] == 582
    assert scheduler_counts(_Cluster(None)) is None  # type: ignore[arg-type]


def test_the_table_shows_the_schedulers_work_per_pod_or_says_it_was_not_read() -> None:
    outcomes = [finished(ClaimOutcome("load", f"p{i}", "mig")) for i in range(200)]
    result = LoadResult(LoadSpec(), 8, 7, 10.0, outcomes, 0, [], [])
    assert ("kube-scheduler: failed attempts per pod", "n/a") in result.rows()
    result.scheduling = scheduler_counts(_Cluster(SCHEDULER_METRICS))  # type: ignore[arg-type]
    rows = dict(result.rows())
    assert rows["kube-scheduler: failed attempts per pod"] == "17.5 (3496 in all)"
    assert rows["kube-scheduler: pods requeued by ResourceSlice (fence) / claim updates"] == "5754 / 582"
