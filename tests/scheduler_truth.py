"""What DeviceClasses select, as kube-scheduler decides it: the ground truth of the differential test
(tests/test_e2e_device_classes.py).

For each class, one claim for all its devices (allocationMode All) on a Node of its own without a kubelet
(devcluster/fakenode.py), first one node with all of NVIDIA's GPU driver's devices and one with other drivers'
devices. Its allocation is exactly what the class selects there. A selector that errs on any device of the node
(a lookup of an attribute that device lacks: a CEL runtime error) aborts the allocation there, and says nothing
of the node's other devices: then the class gets one node per device of that group, and each answers for its
device alone (the error, if it persists, is the device's own: that class can never be allocated it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from devcluster import fakenode
from devcluster.harness import Cluster, wait_for

T = TypeVar("T")
R = TypeVar("R")
WORKERS = 8  # the official client keeps 5 connections per CPU; more threads would only queue for them
GROUPS: dict[str, tuple[fakenode.Shape, ...]] = {
    "gpu-driver": tuple(s for s in fakenode.SHAPES if s.driver == fakenode.NVIDIA),
    "other": tuple(s for s in fakenode.SHAPES if s.driver != fakenode.NVIDIA),
}
UNSCHEDULABLE = "cannot allocate all claims"  # DynamicResources' Filter: no (complete) allocation on the node
CEL_ERROR = "CEL runtime error"
ANYTHING = "diff-anything.example.com"  # the barrier's class: selects every device
ROUND = "diff.scrubgate.dev/round"  # a label on each round's claims and pods


def in_parallel(call: Callable[[T], R], items: Iterable[T]) -> list[R]:
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(call, items))


@dataclass(frozen=True)
class Job:
    device_class: str
    node: str
    shapes: tuple[fakenode.Shape, ...]


@dataclass
class Outcome:
    """A job's answer: the variants allocated, or the scheduler's CEL error (nothing allocated), or neither."""

    variants: frozenset[str] = frozenset()
    error: str = ""
    created: dict[str, Any] = field(default_factory=dict)  # the claim as admission left it
    allocated: dict[str, Any] | None = None  # the claim once allocated


@dataclass
class Truth:
    """What one class selects among all of `fakenode.SHAPES`."""

    matched: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)  # variant -> the error its device gives
    claims: list[Outcome] = field(default_factory=list)

    def got(self, driver: str, types: Iterable[str] | None = None) -> set[str]:
        wanted = None if types is None else set(types)
        return {
            v
            for v in self.matched
            if fakenode.BY_VARIANT[v].driver == driver and (wanted is None or fakenode.BY_VARIANT[v].type in wanted)
        }


class Scheduler:
    """Runs the jobs of each round in `namespace` (claims by name: a trusted namespace), as the admin."""

    def __init__(self, cluster: Cluster, namespace: str, timeout: float = 240.0) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.timeout = timeout
        self.units = 0  # nodes, claims and pods made, one of each per job
        self._rounds = itertools.count()
        self.round = ""

    def truth(self, classes: Sequence[str]) -> dict[str, Truth]:
        found = {name: Truth() for name in classes}
        first = [
            Job(name, f"t{index:04d}-{group}", shapes)
            for index, name in enumerate(classes)
            for group, shapes in GROUPS.items()
        ]
        second = []
        for job, outcome in self.run(first).items():
            self._record(found[job.device_class], job, outcome)
            if outcome.error:  # says nothing of the node's other devices: one node per device
                second += [Job(job.device_class, f"{job.node}-{s.variant}", (s,)) for s in job.shapes]
        for job, outcome in self.run(second).items():
            self._record(found[job.device_class], job, outcome)
            if outcome.error:
                found[job.device_class].errors[job.shapes[0].variant] = outcome.error
        return found

    @staticmethod
    def _record(truth: Truth, job: Job, outcome: Outcome) -> None:
        truth.claims.append(outcome)
        truth.matched |= outcome.variants

    def run(self, jobs: list[Job]) -> dict[Job, Outcome]:
        """One round: every job's node and slices, a barrier, then every claim and pod; their outcomes."""
        if not jobs:
            return {}
        self.round = f"{next(self._rounds)}"
        barrier = Job(ANYTHING, f"barrier-{self.round}", (fakenode.BY_VARIANT["nic"],))
        in_parallel(self._publish, jobs)
        self._publish(barrier)
        self.cluster.apply(  # created, or updated: a newer version than every class the jobs name
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": ANYTHING, "labels": {"round": barrier.node}},
                "spec": {"selectors": [{"cel": {"expression": "true"}}]},
            }
        )
        # kube-scheduler's informers deliver each kind in order: once it allocates on the barrier's node, it has
        # every node, slice and class made before, and no job is judged on a node it has not seen yet.
        claim = self._claim(barrier)
        self._pod(barrier)
        (barrier_outcome,) = self._resolve([barrier], [claim]).values()
        if not barrier_outcome.variants:
            raise AssertionError(f"the barrier claim on {barrier.node} got nothing: {barrier_outcome.error}")
        created = in_parallel(self._claim, jobs)
        in_parallel(self._pod, jobs)
        outcomes = self._resolve(jobs, created)
        # Pods left pending (nothing, or an error) would be retried by kube-scheduler for nothing.
        self.cluster.request(
            "DELETE", f"/api/v1/namespaces/{self.namespace}/pods", query=[("fieldSelector", "spec.nodeName=")]
        )
        return outcomes

    def _publish(self, job: Job) -> None:
        self.cluster.request("POST", "/api/v1/nodes", fakenode.node(job.node))
        for piece in fakenode.resource_slices(job.node, job.shapes):
            self.cluster.request("POST", "/apis/resource.k8s.io/v1/resourceslices", piece)
        self.units += 1

    def _claim(self, job: Job) -> dict[str, Any]:
        body = fakenode.all_devices_claim(f"c-{job.node}", job.device_class, {ROUND: self.round})
        return self.cluster.request("POST", self.cluster.resource_path("resourceclaims", self.namespace), body)

    def _pod(self, job: Job) -> None:
        body = fakenode.pinned_pod(f"p-{job.node}", f"c-{job.node}", job.node, {ROUND: self.round})
        self.cluster.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body)

    def _resolve(self, jobs: list[Job], created: list[dict[str, Any]]) -> dict[Job, Outcome]:
        pending = {f"c-{job.node}": (job, claim) for job, claim in zip(jobs, created, strict=True)}
        done: dict[Job, Outcome] = {}

        def progress() -> bool:
            query = [("labelSelector", f"{ROUND}={self.round}")]  # this round's only
            path = self.cluster.resource_path("resourceclaims", self.namespace)
            claims = {c["metadata"]["name"]: c for c in self.cluster.request("GET", path, query=query)["items"]}
            pods = self.cluster.request("GET", f"/api/v1/namespaces/{self.namespace}/pods", query=query)["items"]
            conditions = {
                p["metadata"]["name"]: c
                for p in pods
                for c in (p.get("status") or {}).get("conditions") or []
                if c["type"] == "PodScheduled" and c["status"] == "False"
            }
            for name, (job, claim) in list(pending.items()):
                outcome = _outcome(claims.get(name), conditions.get(f"p-{job.node}"))
                if outcome is not None:
                    outcome.created = claim
                    done[job] = outcome
                    del pending[name]
            return not pending

        wait_for(progress, self.timeout, f"kube-scheduler's answer for {len(jobs)} claims", interval=1.0)
        return done


def _outcome(claim: dict[str, Any] | None, condition: dict[str, Any] | None) -> Outcome | None:
    """None while kube-scheduler has not answered (or answered for a reason that is not the devices')."""
    allocation = ((claim or {}).get("status") or {}).get("allocation")
    if allocation:
        variants = set()
        for result in allocation["devices"]["results"]:
            shape = fakenode.shape_of(result["driver"], result["device"])
            assert shape is not None, f"allocated a device no fake node publishes: {result}"
            variants.add(shape.variant)
        return Outcome(frozenset(variants), allocated=claim)
    message = (condition or {}).get("message") or ""
    if condition is None:
        return None
    if condition.get("reason") == "Unschedulable" and UNSCHEDULABLE in message:
        return Outcome()
    if condition.get("reason") == "SchedulerError" and CEL_ERROR in message:
        return Outcome(error=message)
    return None
