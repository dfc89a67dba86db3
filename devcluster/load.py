"""A lifecycle load on the whole installation (devcluster.harness.Cluster): many tenants' Job pods, each
with its own claim from a ResourceClaimTemplate (MIG slices, every few a whole GPU), each looking for the
canaries earlier tenants left, writing its own, then ending. Every claim goes allocated -> released ->
drained -> scrubbed -> attested -> deallocated -> finalizer removed; its own allocation, which the webhook
keeps until the attestation, keeps its devices from the next tenant, and a fence (a DeviceTaintRule) appears
only on rarer paths (a failed scrub, a bypassed guard, admin access, shared devices, the agent's shutdown). The
observer's record of it gives the latencies and the invariant. Shared by ``bench/lifecycle.py`` (the figures)
and ``tests/test_e2e_load.py`` (the invariant under load). Part of the test and demo harness.

Pods are submitted as a Job with ``parallelism`` would: at most that many unfinished at once, the next
one as soon as one ends; a finished pod is deleted, as the TTL-after-finished controller does for a Job
with ``ttlSecondsAfterFinished: 0``. Release is the pod's end (first seen Succeeded, Failed or gone),
which releases its claim; the resourceclaim controller's clearing of ``reservedFor`` and the allocation
is refused until the agent's attestation is on the claim. Allocatable is the allocation cleared (or the claim
deleted) and the last of the claim's fences, if it had any, deleted: its devices can go to the next claim. Clean
is that, an attestation that verifies, and the finalizer removed (the claim object released).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families
from scrubgate.policies import names
from scrubgate.policies.attestation import AttestationError, check_claim_attestation, claimed_devices

from . import workloads
from .harness import Cluster
from .kubelet import CANARY_FOUND
from .observer import Observed
from .processes import HarnessError, ManagedProcess, wait_for
from .refused_claim import RefusedClaim

RUN_LABEL = "devcluster.scrubgate.dev/load-run"
CANARY_PREFIX = "SCRUBGATE-LOAD-CANARY-"
TEMPLATES = {"mig": workloads.MIG_CLASS, "gpu": workloads.GPU_CLASS}  # what a pod asks for -> device class
CLAIM_UID_LABEL = "scrubgate.dev/claim-uid"  # the agent labels each fence with its claim's UID
POLL_S = 0.1
CLIENTS = 8  # requests in flight at once, as a Job controller and the TTL controller send them
OBSERVER_GRACE_S = 30.0


@dataclass(frozen=True)
class LoadSpec:
    claims: int = 200
    gpu_every: int = 8  # every n-th pod asks for a whole GPU, the others for a MIG slice (0: MIG slices only)
    namespaces: int = 4  # tenants' namespaces, taken by the cluster's tenants in turn
    parallelism: int = 48  # pods submitted and not yet finished at any time
    run_seconds: float = 4.0  # how long a pod runs once started, on average
    run_spread: float = 0.5  # pods run between (1 - spread/2) and (1 + spread/2) x run_seconds, spread evenly
    timeout_s: float = 300.0  # a bounded wait for the whole run; what is not done by then is reported
    refused_claim: bool = False  # after the burst, how long a claim whose creation was refused once waits

    def wants(self, index: int) -> str:
        return "gpu" if self.gpu_every and index % self.gpu_every == self.gpu_every - 1 else "mig"

    def run_time(self, index: int) -> float:
        """Pod ``index``'s run time: spread (deterministically) so that pods do not all end together."""
        step = (index * 7 % 10) / 9  # 0..1, neighbours far apart
        return round(self.run_seconds * (1 + self.run_spread * (step - 0.5)), 2)


@dataclass
class ClaimOutcome:
    """One pod's claim, as the observer saw it (times are ``time.monotonic()``)."""

    namespace: str
    pod: str
    wants: str  # mig, gpu
    name: str = ""
    uid: str = ""
    devices: tuple[str, ...] = ()
    finished: bool = False  # the pod reached Succeeded or Failed
    canary_found: bool | None = None  # the kubelet's verdict for the pod; None: not reported
    allocated_at: float | None = None
    fenced_at: float | None = None  # the first of its fences created; most claims have none
    released_at: float | None = None  # its pod's end
    unfenced_at: float | None = None  # the last of its fences deleted
    deallocated_at: float | None = None  # its allocation first seen cleared, or the claim deleted
    finalizer_removed_at: float | None = None
    attested: bool = False  # an attestation that verifies for this claim and all of its devices

    @property
    def allocatable_at(self) -> float | None:
        """When its devices were allocatable again: the allocation cleared and the last of its fences (if it had
        any) deleted, whichever came later; None while either is outstanding."""
        if self.deallocated_at is None or (self.fenced_at is not None and self.unfenced_at is None):
            return None
        return max(t for t in (self.deallocated_at, self.unfenced_at) if t is not None)

    def problems(self) -> list[str]:
        """What went wrong for this claim, as one line (none when it ended clean)."""
        where = f"pod {self.namespace}/{self.pod} claim {self.name or '?'} (uid {self.uid or '?'})"
        checks = {
            "the pod did not finish": self.finished,
            "no claim was seen": bool(self.uid),
            "the kubelet never reported whether it found a canary": self.canary_found is not None,
            "found an earlier tenant's canary in its device memory": not self.canary_found,
            "its pod was never seen ending": self.released_at is not None,
            "no attestation verified for it": self.attested,
            "its allocation was never cleared": self.deallocated_at is not None,
            "its fences were not all lifted": self.fenced_at is None or self.unfenced_at is not None,
            f"finalizer {names.FINALIZER} never removed": self.finalizer_removed_at is not None,
        }
        failed = [problem for problem, ok in checks.items() if not ok]
        return [f"{where}: {'; '.join(failed)}"] if failed else []


@dataclass
class LoadResult:
    spec: LoadSpec
    gpus: int  # whole GPUs on the node
    mig_per_gpu: int  # MIG slices of each
    wall_s: float  # first pod submitted to last finalizer removed (or to the deadline)
    claims: list[ClaimOutcome]
    reallocations: int  # allocations of a device that an earlier claim of the run had held
    violations: list[str]  # the observer's invariant check
    leftover_fences: list[str]  # fences of this run's claims still standing at the end
    agent_overhead: tuple[float, int] = (0.0, 0)  # the agent's teardown-overhead histogram: sum, count
    # CPU seconds used over the run by the control plane's processes and by scrubgate's (see `cpu_seconds`)
    cpu_s: Counter[str] = field(default_factory=Counter)
    # kube-scheduler's and kube-apiserver's counters over the run (see `scheduler_counts`, `apiserver_counts`);
    # None when their /metrics could not be read
    scheduling: Counter[str] | None = None
    api_requests: Counter[str] | None = None
    controller: Counter[str] | None = None  # kube-controller-manager's (see `controller_counts`)
    # the resourceclaim controller's retry delay for a claim refused once after the burst (refused_claim.py):
    # seconds, or why it was not measured; None when the run did not ask for it
    refused_claim: float | str | None = None
    notes: list[str] = field(default_factory=list)  # what kept the run from completing in time

    @property
    def devices(self) -> int:
        """What the driver publishes: each GPU and each of its MIG slices."""
        return self.gpus * (1 + self.mig_per_gpu)

    @property
    def claims_per_s(self) -> float:
        return len(self.claims) / self.wall_s if self.wall_s > 0 else 0.0

    def latencies(self, start: str, end: str) -> list[float]:
        """Seconds from ``start`` to ``end`` (ClaimOutcome time fields) for every claim that has both, sorted."""
        out = []
        for claim in self.claims:
            begun, done = getattr(claim, start), getattr(claim, end)
            if begun is not None and done is not None:
                out.append(done - begun)
        return sorted(out)

    def problems(self) -> list[str]:
        """Everything that says the run did not end clean; empty when it did."""
        found = list(self.notes)
        if len(self.claims) != self.spec.claims:
            found.append(f"{len(self.claims)} claims accounted for, {self.spec.claims} submitted")
        found += [p for c in self.claims for p in c.problems()]
        found += [f"invariant: {v}" for v in self.violations]
        found += [f"fence still standing: {f}" for f in self.leftover_fences]
        return found

    def rows(self) -> list[tuple[str, str]]:
        """(metric, value) for the table."""
        fenced = self.latencies("allocated_at", "fenced_at")
        unfenced = self.latencies("released_at", "unfenced_at")
        allocatable = self.latencies("released_at", "allocatable_at")
        removed = self.latencies("released_at", "finalizer_removed_at")
        with_fences = sum(c.fenced_at is not None for c in self.claims)
        overhead_sum, overhead_count = self.agent_overhead
        wants = Counter(c.wants for c in self.claims)
        runs = [self.spec.run_time(i) for i in range(self.spec.claims)]
        return [
            ("claims", f"{len(self.claims)} ({wants['mig']} MIG slice, {wants['gpu']} whole GPU)"),
            ("devices", f"{self.devices} ({self.gpus} GPUs, each also as {self.mig_per_gpu} MIG slices)"),
            ("pods at once x run time", f"{self.spec.parallelism} x {min(runs):g}-{max(runs):g} s"),
            ("wall time", f"{self.wall_s:.1f} s"),
            ("claims/s", f"{self.claims_per_s:.2f}"),
            (
                "allocated -> fenced p50 / p99 / max",
                f"{_ms(fenced, 0.5, 0.99, 1.0)} ({with_fences} of {len(self.claims)} claims fenced)",
            ),
            (
                "release -> fences lifted p50 / p99",
                f"{_ms(unfenced, 0.5, 0.99)} ({len(unfenced)} of {with_fences} fenced claims)",
            ),
            ("release -> devices allocatable p50 / p99", _ms(allocatable, 0.5, 0.99)),
            ("release -> finalizer removed p50 / p99", _ms(removed, 0.5, 0.99)),
            (
                "agent's own teardown time (mean of its histogram)",
                f"{1000 * overhead_sum / overhead_count:.0f} ms over {overhead_count}" if overhead_count else "n/a",
            ),
            ("devices reused by a later claim", str(self.reallocations)),
            *self._scheduling_rows(),
            ("resourceclaim controller: failed syncs per claim", self._failed_syncs()),
            ("resourceclaim controller: a claim refused once after the burst, created after", self._refused_claim()),
            ("API requests per claim (scrubgate's share)", self._api_requests()),
            ("kube-apiserver: scrubgate webhook calls per claim, mean wait", self._webhook_calls()),
            ("CPU per claim: control plane / scrubgate's webhook and agents", self._cpu_per_claim()),
            (f"control plane CPU per claim: {' / '.join(PLANE_PROCESSES)}", self._plane_cpu_per_claim()),
            ("invariant violations (observer)", str(len(self.violations))),
            ("canaries found by a later tenant", str(sum(bool(c.canary_found) for c in self.claims))),
            ("claims not ended clean", str(sum(bool(c.problems()) for c in self.claims))),
        ]

    @property
    def failed_attempts_per_pod(self) -> float | None:
        if self.scheduling is None:
            return None
        return self.scheduling["attempts/unschedulable"] / max(len(self.claims), 1)

    @property
    def failed_syncs_per_claim(self) -> float | None:
        if self.controller is None:
            return None
        return self.controller[CLAIM_RETRIES] / max(len(self.claims), 1)

    def _failed_syncs(self) -> str:
        if self.controller is None:
            return "n/a"
        return f"{self.failed_syncs_per_claim:.2f} ({self.controller[CLAIM_RETRIES]:.0f} in all)"

    def _refused_claim(self) -> str:
        if self.refused_claim is None:
            return "not measured"
        if isinstance(self.refused_claim, str):
            return f"n/a ({self.refused_claim})"
        return f"{1000 * self.refused_claim:.0f} ms"

    def _scheduling_rows(self) -> list[tuple[str, str]]:
        failed, moved = "n/a", "n/a"
        if (counts := self.scheduling) is not None:
            failed = f"{self.failed_attempts_per_pod:.1f} ({counts['attempts/unschedulable']:.0f} in all)"
            moved = f"{counts['requeued/' + SLICE_UPDATE]:.0f} / {counts['requeued/' + CLAIM_UPDATE]:.0f}"
        return [
            ("kube-scheduler: failed attempts per pod", failed),
            ("kube-scheduler: pods requeued by ResourceSlice (fence) / claim updates", moved),
        ]

    def _api_requests(self) -> str:
        if (counts := self.api_requests) is None:
            return "n/a"
        claims = max(len(self.claims), 1)
        return f"{scrubgate_requests(counts) / claims:.1f} ({counts[ALL_REQUESTS] / claims:.1f} in all)"

    def _webhook_calls(self) -> str:
        if (counts := self.api_requests) is None:
            return "n/a"
        calls = counts[WEBHOOK_CALLS]
        wait = f"{1000 * counts[WEBHOOK_SECONDS] / calls:.1f} ms" if calls else "n/a"
        return f"{calls / max(len(self.claims), 1):.1f}, {wait}"

    def cpu_per_claim(self, group: str) -> float:
        """CPU seconds per claim of a process group over the run (CONTROL_PLANE or SCRUBGATE), or of one of the
        control plane's processes (PLANE_PROCESSES)."""
        return self.cpu_s[group] / max(len(self.claims), 1)

    def _cpu_per_claim(self) -> str:
        return " / ".join(f"{1000 * self.cpu_per_claim(group):.0f} ms" for group in (CONTROL_PLANE, SCRUBGATE))

    def _plane_cpu_per_claim(self) -> str:
        return " / ".join(f"{1000 * self.cpu_per_claim(name):.0f}" for name in PLANE_PROCESSES) + " ms"

    def table(self) -> str:
        return markdown_table([self])


def markdown_table(results: list[LoadResult], headers: list[str] | None = None) -> str:
    """One column per run, headed `headers` (default: run 1, run 2, ...)."""
    columns = [r.rows() for r in results]
    if headers is None:
        headers = [f"run {i + 1}" if len(results) > 1 else "value" for i in range(len(results))]
    header = ["metric", *headers]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(results)]
    for i, (metric, _) in enumerate(columns[0]):
        lines.append("| " + " | ".join([metric, *(column[i][1] for column in columns)]) + " |")
    return "\n".join(lines)


# kube-scheduler 1.37 puts every pending DRA pod back to be retried on any ResourceSlice update, with no
# queueing hint, and its ResourceSlice tracker reports each DeviceTaintRule created or deleted as an update of
# the slices it taints; a claim update requeues them only when it deallocates (isSchedulableAfterClaimChange).
SLICE_UPDATE = "resource.k8s.io/ResourceSliceUpdate"
CLAIM_UPDATE = "resource.k8s.io/ResourceClaimUpdate"


# What to count of a metric: the keys each of its samples adds its value to, from the sample's labels.
Keys = Callable[[dict[str, str]], tuple[str, ...]]

SCHEDULER_COUNTERS: dict[str, Keys] = {
    "scheduler_schedule_attempts_total": lambda labels: (f"attempts/{labels.get('result')}",),
    "scheduler_queue_incoming_pods_total": lambda labels: (f"requeued/{labels.get('event')}",),
}

# kube-controller-manager's resourceclaim controller puts a claim back with AddRateLimited only when its sync
# failed (pkg/controller/resourceclaim/controller.go, processNextWorkItem), which client-go's workqueue counts
# as a retry of its queue, "resource_claim" (component-base/metrics/prometheus/workqueue: workqueue_retries_total).
CLAIM_QUEUE = "resource_claim"
CLAIM_RETRIES = "claim-retries"
CONTROLLER_COUNTERS: dict[str, Keys] = {
    "workqueue_retries_total": lambda labels: (CLAIM_RETRIES,) if labels.get("name") == CLAIM_QUEUE else (),
}

# kube-apiserver counts requests by resource and verb, not by who made them; API Priority and Fairness counts
# them by the FlowSchema that matched. The agent's requests get a FlowSchema of their own (`agent_flow_schema`).
FLOW_SCHEMA = "scrubgate-agent"
ALL_REQUESTS = "requests"
AGENT_REQUESTS = "agent"  # made by scrubgate's agent
REJECTED = "rejected"  # refused by scrubgate's webhooks: each would not have been made, or repeated, without it
FENCE_STATUS = "fence-status"  # DeviceTaintRule status writes: kube-controller-manager's, as the agent writes none
WEBHOOK_CALLS = "webhook-calls"  # kube-apiserver's calls to scrubgate's webhooks
WEBHOOK_SECONDS = "webhook-seconds"  # and the time it waited on them, in all
APISERVER_COUNTERS: dict[str, Keys] = {
    "apiserver_request_total": lambda labels: (
        (ALL_REQUESTS, FENCE_STATUS)
        if (labels.get("resource"), labels.get("subresource")) == ("devicetaintrules", "status")
        else (ALL_REQUESTS,)
    ),
    "apiserver_flowcontrol_dispatched_requests_total": lambda labels: (
        (AGENT_REQUESTS,) if labels.get("flow_schema") == FLOW_SCHEMA else ()
    ),
    # exposed as apiserver_admission_webhook_rejection_count: prometheus_client names a counter's samples `*_total`
    "apiserver_admission_webhook_rejection_count_total": lambda labels: (
        (REJECTED,) if labels.get("name", "").endswith(f".{names.DOMAIN}") else ()
    ),
    "apiserver_admission_webhook_admission_duration_seconds_count": lambda labels: (
        (WEBHOOK_CALLS,) if labels.get("name", "").endswith(f".{names.DOMAIN}") else ()
    ),
    "apiserver_admission_webhook_admission_duration_seconds_sum": lambda labels: (
        (WEBHOOK_SECONDS,) if labels.get("name", "").endswith(f".{names.DOMAIN}") else ()
    ),
}


CONTROL_PLANE = "control plane"  # etcd, kube-apiserver, kube-controller-manager, kube-scheduler
SCRUBGATE = "scrubgate"  # the webhook and the agents (not running in a run without scrubgate)
PLANE_PROCESSES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def cpu_seconds(cluster: Cluster) -> Counter[str]:
    """CPU seconds (user and system) each process group, and each of the control plane's processes, has used so
    far, from /proc/<pid>/stat."""
    plane = cluster.control_plane
    found: Counter[str] = Counter()
    for name, process in zip(
        PLANE_PROCESSES, [plane.etcd, plane.apiserver, plane.controller_manager, plane.scheduler], strict=True
    ):
        found[name] = _cpu_seconds_of(process)
        found[CONTROL_PLANE] += found[name]
    for process in [cluster.webhook, *(node.agent for node in cluster.nodes)]:
        found[SCRUBGATE] += _cpu_seconds_of(process)
    return found


def _cpu_seconds_of(process: ManagedProcess) -> float:
    if process.pid is None or not process.running:
        return 0.0
    with contextlib.suppress(OSError, IndexError, ValueError):
        # after the parenthesised command name: utime and stime are fields 14 and 15 of the line
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def counters(text: str, wanted: dict[str, Keys]) -> Counter[str]:
    """The samples of the `wanted` metrics in Prometheus text, summed under the keys each one names."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (keys := wanted.get(sample.name)) is not None:
                for key in keys(sample.labels):
                    counts[key] += sample.value
    return counts


def _read_counters(read: Callable[[], str], wanted: dict[str, Keys]) -> Counter[str] | None:
    try:
        return counters(read(), wanted)
    except HarnessError:
        return None


def scheduler_counts(cluster: Cluster) -> Counter[str] | None:
    """kube-scheduler's schedule attempts by result (`attempts/<result>`) and pods put back into its queues by
    event (`requeued/<event>`); None when its /metrics cannot be read."""
    return _read_counters(cluster.control_plane.scheduler_metrics, SCHEDULER_COUNTERS)


def controller_counts(cluster: Cluster) -> Counter[str] | None:
    """kube-controller-manager's failed syncs of the resourceclaim controller (see CONTROLLER_COUNTERS); None when its
    /metrics cannot be read."""
    return _read_counters(cluster.control_plane.controller_manager_metrics, CONTROLLER_COUNTERS)


def apiserver_counts(cluster: Cluster) -> Counter[str] | None:
    """kube-apiserver's requests: all, the agent's, those scrubgate's webhooks rejected, and DeviceTaintRule status
    writes (see APISERVER_COUNTERS); None when its /metrics cannot be read."""
    return _read_counters(cluster.control_plane.apiserver_metrics, APISERVER_COUNTERS)


def counted_since(before: Counter[str] | None, after: Counter[str] | None) -> Counter[str] | None:
    """Counters over a run: at its end, less what they were at its start; None when either was not read."""
    return None if before is None or after is None else after - before


def scrubgate_requests(counts: Counter[str]) -> float:
    """Of the requests kube-apiserver received, those it received only because scrubgate is installed: the agent's,
    those scrubgate's webhooks rejected (the resourceclaim controller's deallocation, retried until the
    attestation), and the status writes of fences. A request of the agent's that a webhook rejected would count
    twice; the agent's writes are meant to pass."""
    return counts[AGENT_REQUESTS] + counts[REJECTED] + counts[FENCE_STATUS]


def agent_flow_schema(namespace: str = names.SYSTEM_NAMESPACE) -> dict[str, Any]:
    """A FlowSchema that matches only the agent's requests, so that API Priority and Fairness counts them under
    its name. It wins over the default `service-accounts` schema that matches them otherwise (matchingPrecedence
    9000) and sends them to the same priority level, workload-low, so they are served as before."""
    every_resource = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "clusterScope": True, "namespaces": ["*"]}
    agent = {"namespace": namespace, "name": names.AGENT_SERVICE_ACCOUNT}
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": FLOW_SCHEMA},
        "spec": {
            "priorityLevelConfiguration": {"name": "workload-low"},
            "matchingPrecedence": 8999,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [
                {
                    "subjects": [{"kind": "ServiceAccount", "serviceAccount": agent}],
                    "resourceRules": [every_resource],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                }
            ],
        },
    }


def _flow_schema_in_use(cluster: Cluster) -> bool:
    """Whether kube-apiserver's APF configuration has taken the FlowSchema in: it then marks it not dangling."""
    schema = cluster.request("GET", f"/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas/{FLOW_SCHEMA}")
    conditions = (schema.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Dangling" and c.get("status") == "False" for c in conditions)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def _ms(values: list[float], *quantiles: float) -> str:
    if not values:
        return "n/a"
    return " / ".join(f"{1000 * percentile(values, q):.0f}" for q in quantiles) + " ms"


# ---------------------------------------------------------------------- running it


class LoadRun:
    """One run of ``spec`` on ``cluster``: ``run()`` submits, waits (bounded), and returns the result."""

    def __init__(self, cluster: Cluster, spec: LoadSpec, progress: Callable[[str], None] | None = None) -> None:
        if spec.claims < 1 or spec.parallelism < 1 or spec.namespaces < 1:
            raise ValueError(f"a load needs at least one claim, namespace and pod at a time: {spec}")
        self.cluster = cluster
        self.spec = spec
        self.progress = progress or (lambda _: None)
        self.run_id = secrets.token_hex(3)
        tenants = [u for u in cluster.users if u not in ("admin", "agent")]
        if not tenants:
            raise ValueError("the cluster has no tenants to run the load as")
        self.namespaces = [(f"load-{self.run_id}-{i}", tenants[i % len(tenants)]) for i in range(spec.namespaces)]
        self.outcomes: dict[tuple[str, str], ClaimOutcome] = {}  # by (namespace, pod)
        self._scheduling_before: Counter[str] | None = None
        self._api_before: Counter[str] | None = None
        self._controller_before: Counter[str] | None = None
        self._cpu_before: Counter[str] = Counter()
        self.notes: list[str] = []
        self.refused = (
            RefusedClaim(cluster, f"load-{self.run_id}-refused", tenants[0], spec.timeout_s)
            if spec.refused_claim
            else None
        )

    def run(self) -> LoadResult:
        deadline = time.monotonic() + self.spec.timeout_s
        self._set_up()
        self._scheduling_before = scheduler_counts(self.cluster)
        self._api_before = apiserver_counts(self.cluster)
        self._controller_before = controller_counts(self.cluster)
        self._cpu_before = cpu_seconds(self.cluster)
        started = time.monotonic()
        if self._submit_all(deadline):
            self.progress(f"all {self.spec.claims} pods finished after {time.monotonic() - started:.1f}s")
            if self.refused is not None:
                self.refused.start()  # while the burst's claims are released
            if self._wait_clean(deadline):
                self._wait_observed(min(deadline, time.monotonic() + OBSERVER_GRACE_S))
        ended = time.monotonic()
        if self.refused is not None:
            self.refused.wait()
        return self._result(started, ended)

    def _set_up(self) -> None:
        self.cluster.apply(agent_flow_schema(self.cluster.namespace))
        wait_for(lambda: _flow_schema_in_use(self.cluster), 30, f"kube-apiserver to use FlowSchema {FLOW_SCHEMA}")
        if self.refused is not None:
            self.refused.prepare()
        for namespace, user in self.namespaces:
            self.cluster.create_namespace(namespace)
            for wants, device_class in TEMPLATES.items():
                body = workloads.claim_template(f"{wants}-claim", device_class=device_class)
                path = self.cluster.resource_path("resourceclaimtemplates", namespace)
                self.cluster.request("POST", path, body, user=user)

    def _submit(self, index: int) -> None:
        namespace, user = self.namespaces[index % len(self.namespaces)]
        wants = self.spec.wants(index)
        annotations = workloads.workload_annotations(
            canary=f"{CANARY_PREFIX}{index:05d}", look_for=CANARY_PREFIX, run_seconds=self.spec.run_time(index)
        )
        pod = workloads.pod(f"load-{index:05d}", template=f"{wants}-claim", annotations=annotations)
        pod["metadata"]["labels"] = {RUN_LABEL: self.run_id}
        created = self.cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod, user=user)
        name = created["metadata"]["name"]
        self.outcomes[(namespace, name)] = ClaimOutcome(namespace, name, wants)

    def _reap_finished(self, pool: ThreadPoolExecutor) -> int:
        """Records what finished pods reported and deletes them; returns how many pods are still unfinished."""
        pods = self.cluster.request("GET", "/api/v1/pods", query=[("labelSelector", f"{RUN_LABEL}={self.run_id}")])
        unfinished = 0
        finished = []
        for pod in pods["items"]:
            meta, status = pod["metadata"], pod.get("status") or {}
            outcome = self.outcomes.get((meta["namespace"], meta["name"]))
            if outcome is None or outcome.finished:
                continue  # being deleted
            if status.get("phase") not in ("Succeeded", "Failed"):
                unfinished += 1
                continue
            outcome.finished = True
            outcome.canary_found = _canary_found(pod)
            outcome.name = next(
                (s.get("resourceClaimName") or "" for s in status.get("resourceClaimStatuses") or []), ""
            )
            finished.append(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
        list(pool.map(self._delete, finished))
        return unfinished

    def _delete(self, path: str) -> None:
        with contextlib.suppress(ApiException):  # already gone
            self.cluster.request("DELETE", path)

    def _submit_all(self, deadline: float) -> bool:
        submitted = unfinished = 0
        last_report = time.monotonic()
        with ThreadPoolExecutor(CLIENTS, thread_name_prefix="load") as pool:
            while submitted < self.spec.claims or unfinished:
                batch = range(submitted, min(self.spec.claims, submitted + self.spec.parallelism - unfinished))
                list(pool.map(self._submit, batch))
                submitted += len(batch)
                unfinished += len(batch)
                time.sleep(POLL_S)
                unfinished = self._reap_finished(pool)
                if time.monotonic() > deadline:
                    self.notes.append(
                        f"load run {self.run_id}: {submitted} of {self.spec.claims} pods submitted, {unfinished} "
                        f"not finished after {self.spec.timeout_s:.0f}s"
                    )
                    return False
                if time.monotonic() - last_report > 5:
                    last_report = time.monotonic()
                    self.progress(f"{submitted - unfinished} of {self.spec.claims} pods finished")
        return True

    def _wait_clean(self, deadline: float) -> bool:
        """Until every claim of the run is gone (its finalizer removed by the agent, then deleted)."""
        ours = {namespace for namespace, _ in self.namespaces}
        while True:
            items = self.cluster.request("GET", self.cluster.resource_path("resourceclaims"))["items"]
            left = [c for c in items if c["metadata"]["namespace"] in ours]
            if not left:
                return True
            if time.monotonic() > deadline:
                states = Counter(
                    (c["metadata"].get("annotations") or {}).get(names.ANNOTATION_SCRUB_STATUS, "none") for c in left
                )
                self.notes.append(
                    f"load run {self.run_id}: {len(left)} claims not released after {self.spec.timeout_s:.0f}s "
                    f"(scrub status: {dict(states)})"
                )
                return False
            time.sleep(POLL_S)

    def _wait_observed(self, until: float) -> None:
        """Until the observer's watches have delivered the end of every claim and fence of the run that the
        API already shows gone (they arrive a little after); what is still missing then is reported."""
        ours = {namespace for namespace, _ in self.namespaces}
        while time.monotonic() < until:
            claims: dict[str, bool] = {}
            for event in self.cluster.observer.claims():
                if event.obj["metadata"].get("namespace") in ours:
                    claims[event.obj["metadata"]["uid"]] = event.type == "DELETED"
            fences: dict[str, bool] = {}
            for event in self.cluster.observer.taint_rules():
                if (event.obj["metadata"].get("labels") or {}).get(CLAIM_UID_LABEL) in claims:
                    fences[event.obj["metadata"]["name"]] = event.type == "DELETED"
            if all(claims.values()) and all(fences.values()):
                return
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ what happened

    def _result(self, started: float, ended: float) -> LoadResult:
        cluster = self.cluster
        ours = {namespace for namespace, _ in self.namespaces}
        history: dict[str, list[Observed]] = {}
        for event in cluster.observer.claims():
            if event.obj["metadata"].get("namespace") in ours:
                history.setdefault(event.obj["metadata"]["uid"], []).append(event)
        # A pod's claim is the one allocated for it: kube-controller-manager may make a second one from the
        # template for a pod that has ended (never allocated, deleted at once) and name that in the pod's status.
        by_pod = {
            (e[0].obj["metadata"]["namespace"], ref["name"]): uid
            for uid, e in history.items()
            if any(_allocated(event.obj) for event in e)
            for ref in e[0].obj["metadata"].get("ownerReferences") or []
            if ref.get("kind") == "Pod"
        }
        pods: dict[tuple[str, str], list[Observed]] = {}
        for event in cluster.observer.pods():
            meta = event.obj["metadata"]
            if meta.get("namespace") in ours:
                pods.setdefault((meta["namespace"], meta["name"]), []).append(event)
        fences: dict[str, list[Observed]] = {}
        for event in cluster.observer.taint_rules():
            uid = (event.obj["metadata"].get("labels") or {}).get(CLAIM_UID_LABEL)
            if uid in history:
                fences.setdefault(uid, []).append(event)
        for outcome in self.outcomes.values():
            uid = by_pod.get((outcome.namespace, outcome.pod), "")
            outcome.released_at = ended_at(pods.get((outcome.namespace, outcome.pod), []))
            if uid:
                outcome.uid, outcome.name = uid, history[uid][0].obj["metadata"]["name"]
                follow(outcome, history[uid], fences.get(uid, []), cluster.public_keys)
        leftover = [
            r["metadata"]["name"]
            for r in cluster.taint_rules()
            if (r["metadata"].get("labels") or {}).get(CLAIM_UID_LABEL) in history
        ]
        ends = [o.finalizer_removed_at for o in self.outcomes.values() if o.finalizer_removed_at is not None]
        wall = (ended if self.notes or not ends else max(ends)) - started
        devices = cluster.gpus()
        gpus = sum(d.parent_uuid is None for d in devices)
        return LoadResult(
            spec=self.spec,
            gpus=gpus,
            mig_per_gpu=(len(devices) - gpus) // max(gpus, 1),
            wall_s=wall,
            claims=sorted(self.outcomes.values(), key=lambda o: o.pod),
            reallocations=reallocations(history),
            violations=cluster.observer.violations(cluster.public_keys),
            leftover_fences=leftover,
            agent_overhead=_histogram(cluster, "scrubgate_agent_teardown_overhead_seconds"),
            scheduling=counted_since(self._scheduling_before, scheduler_counts(cluster)),
            api_requests=counted_since(self._api_before, apiserver_counts(cluster)),
            controller=counted_since(self._controller_before, controller_counts(cluster)),
            cpu_s=cpu_seconds(cluster) - self._cpu_before,
            notes=self.notes,
            refused_claim=None if self.refused is None else (self.refused.problem or self.refused.waited_s),
        )


def run_load(cluster: Cluster, spec: LoadSpec, progress: Callable[[str], None] | None = None) -> LoadResult:
    return LoadRun(cluster, spec, progress).run()


def _canary_found(pod: dict[str, Any]) -> bool | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == CANARY_FOUND:
            return condition.get("status") == "True"
    return None


def _allocated(claim: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return tuple((r.get("driver", ""), r.get("pool", ""), r.get("device", "")) for r in results)


def ended_at(pod_events: list[Observed]) -> float | None:
    """When the pod was first seen ended (Succeeded, Failed or deleted): its claim's release."""
    return min(
        (
            e.at
            for e in pod_events
            if e.type == "DELETED" or (e.obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        ),
        default=None,
    )


def follow(
    outcome: ClaimOutcome, events: list[Observed], fences: list[Observed], public_keys: dict[str, Ed25519PublicKey]
) -> None:
    """Fills in ``outcome`` from the claim's observed changes and its fences'."""
    had_finalizer = False
    held: set[tuple[str, str, str]] = set()
    for event in events:
        claim = event.obj
        if not held and _allocated(claim):
            held = set(_allocated(claim))
            outcome.devices, outcome.allocated_at = tuple(sorted(d[2] for d in held)), event.at
        if held and outcome.deallocated_at is None and (event.type == "DELETED" or not _allocated(claim)):
            outcome.deallocated_at = event.at
        finalizers = claim["metadata"].get("finalizers") or []
        # A DELETED event shows the object as stored before its last finalizer went (see observer.py).
        removed = event.type == "DELETED" or names.FINALIZER not in finalizers
        if had_finalizer and removed and outcome.finalizer_removed_at is None:
            outcome.finalizer_removed_at = event.at
        had_finalizer = had_finalizer or names.FINALIZER in finalizers
        token = (claim["metadata"].get("annotations") or {}).get(names.ANNOTATION_ATTESTATION)
        if token and not outcome.attested:
            with contextlib.suppress(AttestationError):
                check_claim_attestation(token, claim, public_keys, claimed_devices(claim) | held)
                outcome.attested = True
    added = {e.obj["metadata"]["name"]: e.at for e in fences if e.type in ("ADDED", "SYNC")}
    deleted = {e.obj["metadata"]["name"]: e.at for e in fences if e.type == "DELETED"}
    if added:
        outcome.fenced_at = min(added.values())
        if added.keys() <= deleted.keys():
            outcome.unfenced_at = max(deleted.values())


def reallocations(history: dict[str, list[Observed]]) -> int:
    """Allocations of a device some earlier claim of the run held (so the canary check means something)."""
    allocations = []
    for events in history.values():
        first = next((e for e in events if _allocated(e.obj)), None)
        if first is not None:
            allocations.append((first.rv, _allocated(first.obj)))
    held: set[tuple[str, str, str]] = set()
    reused = 0
    for _, devices in sorted(allocations):
        reused += sum(d in held for d in devices)
        held.update(devices)
    return reused


def _histogram(cluster: Cluster, name: str) -> tuple[float, int]:
    """(sum, count) of one of the agent's histograms, from its /metrics."""
    with contextlib.suppress(OSError):
        text = cluster.agent_metrics()
        total = re.search(rf"^{name}_sum (\S+)$", text, re.M)
        count = re.search(rf"^{name}_count (\S+)$", text, re.M)
        if total and count:
            return float(total.group(1)), int(float(count.group(1)))
    return 0.0, 0
