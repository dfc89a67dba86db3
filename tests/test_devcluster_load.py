"""devcluster.load's reading of what the observer saw: the load test and bench/lifecycle.py trust it to say
whether every claim ended clean, so a claim that was not attested, deallocated, unfenced (where it was fenced)
or released must show; and its reading of kube-scheduler's and kube-apiserver's counters."""

from __future__ import annotations

import copy
import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies import names
from scrubgate.policies.attestation import sign

from devcluster.load import (
    APISERVER_COUNTERS,
    ClaimOutcome,
    LoadResult,
    LoadSpec,
    agent_flow_schema,
    counted_since,
    counters,
    ended_at,
    follow,
    percentile,
    reallocations,
    scheduler_counts,
    scrubgate_requests,
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


def lifecycle(uid: str) -> list[Observed]:
    """The normal path: allocated at 1.0, attested while still allocated at 5.2 (the webhook refuses the
    deallocation before), deallocated at 5.3, the finalizer removed with the deletion at 5.4."""
    return events(
        (0.0, "ADDED", claim(uid, allocated=False, reserved=False)),
        (1.0, "MODIFIED", claim(uid, allocated=True, reserved=True)),
        (5.2, "MODIFIED", claim(uid, allocated=True, reserved=True, token=token(uid))),
        (5.3, "MODIFIED", claim(uid, allocated=False, reserved=False, token=token(uid))),
        (5.4, "DELETED", claim(uid, allocated=False, reserved=False, token=token(uid))),
    )


def pod_ended_at_4_9() -> float | None:
    return ended_at(
        [pod(20, 1.0, "ADDED", "Running"), pod(21, 4.9, "MODIFIED", "Succeeded"), pod(22, 5.0, "DELETED", "Succeeded")]
    )


def test_a_clean_lifecycle_without_fences_is_read_in_order() -> None:
    outcome = finished(ClaimOutcome("load", "p", "mig", name="a", uid="a"))
    follow(outcome, lifecycle("a"), [], KEYS)
    outcome.released_at = pod_ended_at_4_9()
    assert (outcome.allocated_at, outcome.released_at, outcome.deallocated_at) == (1.0, 4.9, 5.3)
    assert outcome.finalizer_removed_at == 5.4
    assert outcome.fenced_at is None and outcome.unfenced_at is None
    assert outcome.allocatable_at == 5.3  # no fence: the deallocation is what frees the devices
    assert outcome.attested and outcome.devices == (DEVICE[2],)
    assert outcome.problems() == []


def test_a_fenced_claims_devices_are_allocatable_once_deallocated_and_unfenced_whichever_is_later() -> None:
    late = finished(ClaimOutcome("load", "p", "mig", name="a", uid="a"))
    fences = [fence(10, 1.1, "ADDED", "own"), fence(11, 1.2, "ADDED", "parent")]
    follow(
        late, lifecycle("a"), [*fences, fence(12, 5.25, "DELETED", "own"), fence(13, 5.6, "DELETED", "parent")], KEYS
    )
    late.released_at = pod_ended_at_4_9()
    assert (late.fenced_at, late.unfenced_at, late.deallocated_at) == (1.1, 5.6, 5.3)
    assert late.allocatable_at == 5.6 and late.problems() == []

    early = finished(ClaimOutcome("load", "p", "mig", name="a", uid="a"))
    follow(
        early, lifecycle("a"), [*fences, fence(12, 5.0, "DELETED", "own"), fence(13, 5.1, "DELETED", "parent")], KEYS
    )
    assert early.unfenced_at == 5.1 and early.allocatable_at == 5.3

    standing = finished(ClaimOutcome("load", "p", "mig", name="a", uid="a"))
    follow(standing, lifecycle("a"), [*fences, fence(12, 5.0, "DELETED", "own")], KEYS)
    standing.released_at = pod_ended_at_4_9()
    assert standing.deallocated_at == 5.3 and standing.allocatable_at is None
    (problem,) = standing.problems()
    assert "fences were not all lifted" in problem and "allocation" not in problem


def test_what_did_not_happen_shows_as_a_problem() -> None:
    history = events(
        (1.0, "ADDED", claim("b", allocated=True, reserved=True)),
        (5.0, "MODIFIED", claim("b", allocated=False, reserved=False, token=token("b", verified=False))),
        (5.4, "DELETED", claim("b", allocated=False, reserved=False, token=token("b", verified=False))),
    )
    outcome = finished(ClaimOutcome("load", "p", "mig", name="b", uid="b"))
    follow(outcome, history, [], KEYS)
    outcome.released_at = 4.0
    assert not outcome.attested and outcome.deallocated_at == 5.0
    (problem,) = outcome.problems()
    assert "no attestation verified" in problem and "fences" not in problem and "allocation" not in problem

    held = finished(ClaimOutcome("load", "q", "mig", name="c", uid="c"))
    follow(held, events((1.0, "ADDED", claim("c", allocated=True, reserved=True))), [], KEYS)
    assert held.deallocated_at is None and held.allocatable_at is None
    (problem,) = held.problems()
    assert "allocation was never cleared" in problem and "never seen ending" in problem and "finalizer" in problem
    assert "fence" not in problem  # having no fence is the normal path

    found = ClaimOutcome("load", "r", "gpu", finished=True, canary_found=True)
    assert "found an earlier tenant's canary" in found.problems()[0]


def test_the_table_counts_fenced_claims_and_says_n_a_when_none_was() -> None:
    outcomes = []
    for i in range(4):
        outcome = finished(ClaimOutcome("load", f"p{i}", "mig", name=f"c{i}", uid=f"c{i}"))
        follow(outcome, lifecycle(f"c{i}"), [], KEYS)
        outcome.released_at = 4.9 + i / 10  # released 0.4, 0.3, 0.2, 0.1 s before the deallocation at 5.3
        outcomes.append(outcome)
    result = LoadResult(LoadSpec(claims=4), 8, 7, 10.0, outcomes, 0, [], [])
    rows = dict(result.rows())
    assert rows["allocated -> fenced p50 / p99 / max"] == "n/a (0 of 4 claims fenced)"
    assert rows["release -> fences lifted p50 / p99"] == "n/a (0 of 0 fenced claims)"
    assert rows["release -> devices allocatable p50 / p99"] == "200 / 400 ms"
    assert rows["claims not ended clean"] == "0"

    fences = [fence(10, 1.5, "ADDED", "own"), fence(11, 6.3, "DELETED", "own")]
    follow(outcomes[0], lifecycle("c0"), fences, KEYS)
    rows = dict(result.rows())
    assert rows["allocated -> fenced p50 / p99 / max"] == "500 / 500 / 500 ms (1 of 4 claims fenced)"
    assert rows["release -> fences lifted p50 / p99"] == "1400 / 1400 ms (1 of 1 fenced claims)"
    assert rows["release -> devices allocatable p50 / p99"] == "200 / 1400 ms"


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


# What kube-apiserver 1.37 serves, cut down, before and after a run of 10 claims: every request by resource and
# verb (the deallocations SG007 refused among them, and kube-controller-manager's status applies of a fence),
# those API Priority and Fairness dispatched by FlowSchema, and admission webhooks' rejections by webhook name.
APISERVER_METRICS = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests broken out for each verb, dry run value, group, version, resource, scope, component, and HTTP response code.
# TYPE apiserver_request_total counter
apiserver_request_total{{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="cluster",subresource="",verb="LIST",version="v1"}} {pods}
apiserver_request_total{{code="403",component="apiserver",dry_run="",group="resource.k8s.io",resource="resourceclaims",scope="resource",subresource="status",verb="UPDATE",version="v1"}} {refused}
apiserver_request_total{{code="200",component="apiserver",dry_run="",group="resource.k8s.io",resource="devicetaintrules",scope="cluster",subresource="",verb="WATCH",version="v1"}} {watches}
apiserver_request_total{{code="200",component="apiserver",dry_run="",group="resource.k8s.io",resource="devicetaintrules",scope="resource",subresource="status",verb="APPLY",version="v1"}} {status}
{patches}
# HELP apiserver_flowcontrol_dispatched_requests_total [BETA] Number of requests executed by API Priority and Fairness subsystem
# TYPE apiserver_flowcontrol_dispatched_requests_total counter
apiserver_flowcontrol_dispatched_requests_total{{flow_schema="{schema}",priority_level="workload-low"}} {agent}
apiserver_flowcontrol_dispatched_requests_total{{flow_schema="service-accounts",priority_level="workload-low"}} {accounts}
apiserver_flowcontrol_dispatched_requests_total{{flow_schema="exempt",priority_level="exempt"}} {exempt}
# HELP apiserver_admission_webhook_rejection_count [ALPHA] Admission webhook rejection count, identified by name and broken out for each admission type (validating or admit) and operation.
# TYPE apiserver_admission_webhook_rejection_count counter
apiserver_admission_webhook_rejection_count{{error_type="no_error",name="validate-multi-tenant.scrubgate.dev",operation="UPDATE",rejection_code="403",type="validating"}} {rejected}
apiserver_admission_webhook_rejection_count{{error_type="no_error",name="deny.example.com",operation="CREATE",rejection_code="403",type="validating"}} {others}
# HELP apiserver_admission_webhook_admission_duration_seconds [STABLE] Admission webhook latency histogram in seconds, identified by name and broken out for each operation and API resource and type (validating or admit).
# TYPE apiserver_admission_webhook_admission_duration_seconds histogram
apiserver_admission_webhook_admission_duration_seconds_bucket{{name="mutate.scrubgate.dev",operation="CREATE",rejected="false",type="admit",le="+Inf"}} {calls}
apiserver_admission_webhook_admission_duration_seconds_sum{{name="mutate.scrubgate.dev",operation="CREATE",rejected="false",type="admit"}} {seconds}
apiserver_admission_webhook_admission_duration_seconds_count{{name="mutate.scrubgate.dev",operation="CREATE",rejected="false",type="admit"}} {calls}
apiserver_admission_webhook_admission_duration_seconds_bucket{{name="deny.example.com",operation="CREATE",rejected="true",type="validating",le="+Inf"}} {others}
apiserver_admission_webhook_admission_duration_seconds_sum{{name="deny.example.com",operation="CREATE",rejected="true",type="validating"}} {others}
apiserver_admission_webhook_admission_duration_seconds_count{{name="deny.example.com",operation="CREATE",rejected="true",type="validating"}} {others}
"""
PATCHES = (
    'apiserver_request_total{code="200",component="apiserver",dry_run="",group="resource.k8s.io",'
    'resource="resourceclaims",scope="resource",subresource="",verb="PATCH",version="v1"} 30'
)


def apiserver_metrics(**changed: object) -> str:
    """The text with the counts at the run's start, less those `changed`."""
    values = dict(pods=100, refused=10, watches=5, status=2, patches="", agent=20, accounts=100, exempt=7)
    values |= dict(rejected=10, others=1, calls=4, seconds=0.1, schema=agent_flow_schema()["metadata"]["name"])
    return APISERVER_METRICS.format(**(values | changed))


def test_scrubgates_share_of_the_api_requests_is_the_agents_the_rejected_and_the_fence_status_writes() -> None:
    before = counters(apiserver_metrics(), APISERVER_COUNTERS)
    after = counters(
        apiserver_metrics(
            pods=300,
            refused=50,
            watches=7,
            status=6,
            patches=PATCHES,
            agent=50,
            accounts=400,
            rejected=50,
            others=5,
            calls=64,
            seconds=0.85,
        ),
        APISERVER_COUNTERS,
    )
    run = counted_since(before, after)
    assert run is not None
    assert run["requests"] == 200 + 40 + 2 + 4 + 30  # every request, a label set new since the start included
    # 30 the agent made, 40 deallocations refused, 4 fence status writes; not the other webhook's rejections,
    # other accounts' dispatches nor the fences' watches
    assert scrubgate_requests(run) == 30 + 40 + 4
    outcomes = [finished(ClaimOutcome("load", f"p{i}", "mig")) for i in range(10)]
    result = LoadResult(LoadSpec(claims=10), 8, 7, 10.0, outcomes, 0, [], [], api_requests=run)
    assert dict(result.rows())["API requests per claim (scrubgate's share)"] == "7.4 (27.6 in all)"
    # 60 calls to scrubgate's webhooks (not another's), 0.75 s waited on them in all
    assert dict(result.rows())["kube-apiserver: scrubgate webhook calls per claim, mean wait"] == "6.0, 12.5 ms"


def test_without_scrubgate_its_share_comes_out_zero_and_unread_metrics_show_n_a() -> None:
    before = counters(apiserver_metrics(), APISERVER_COUNTERS)
    baseline = counted_since(before, counters(apiserver_metrics(pods=250, accounts=300), APISERVER_COUNTERS))
    outcomes = [finished(ClaimOutcome("load", f"p{i}", "mig")) for i in range(10)]
    result = LoadResult(LoadSpec(claims=10), 8, 7, 10.0, outcomes, 0, [], [], api_requests=baseline)
    assert dict(result.rows())["API requests per claim (scrubgate's share)"] == "0.0 (15.0 in all)"
    assert dict(result.rows())["kube-apiserver: scrubgate webhook calls per claim, mean wait"] == "0.0, n/a"
    result.api_requests = counted_since(None, before)
    assert dict(result.rows())["API requests per claim (scrubgate's share)"] == "n/a"
    assert dict(result.rows())["kube-apiserver: scrubgate webhook calls per claim, mean wait"] == "n/a"
