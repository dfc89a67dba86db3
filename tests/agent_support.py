"""Test bed for the node agent: a simulated GPU node (G's simulated backend, real bytes) and the in-memory
cluster, plus the invariant monitor every agent test runs under."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch
import kube_json_patch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from memcluster import InMemoryCluster
from scrubgate.policies import names
from scrubgate.policies.attestation import (
    AttestationError,
    check_claim_attestation,
    claimed_devices,
    deleted_before_allocation,
    public_key_pem,
)
from scrubgate.policies.config import parse_policy
from scrubgate.policies.release_guard import deallocation_guard
from scrubgate.policies.requester import Requester
from scrubgate.policies.scope import Scope
from scrubgate.sanitizer_agent.agent import Agent, AgentSettings
from scrubgate.sanitizer_agent.checkpoint import CheckpointStore, State, Teardown
from scrubgate.sanitizer_agent.fences import SHARES_MEMORY_ANNOTATION
from scrubgate.sanitizer_agent.gpu import GpuDevice, simulated
from scrubgate.sanitizer_agent.gpu.simulated import SimulatedGpu
from scrubgate.sanitizer_agent.rescrub import request_dir
from scrubgate.sanitizer_agent.signing import Signer
from scrubgate.sanitizer_agent.teardown import TeardownSettings

from devcluster.harness import CLAIM_CONTROLLER_USER

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"
KID = "agent-test"
CANARY = b"TENANT-A-SECRET-"
MEMORY = 256 << 10


class FakeClock:
    """Wall-clock time plus a manual offset, so drain timeouts and retry backoffs pass instantly."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


class Interceptor:
    """Wraps an object; `on_call(name, phase)` runs before ("before") and after ("after") each method."""

    def __init__(self, target: Any, on_call: Callable[[str, str], None]) -> None:
        self._target = target
        self._on_call = on_call

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._on_call(name, "before")
            result = attr(*args, **kwargs)
            if hasattr(result, "__next__"):  # a generator (watch): don't intercept its iteration
                return result
            self._on_call(name, "after")
            return result

        return call


@dataclass
class Violations:
    """What must never happen, checked at the instant it would happen."""

    found: list[str] = field(default_factory=list)


@dataclass
class GpuNode:
    tmp: Path
    gpus: list[GpuDevice]
    cluster: InMemoryCluster
    clock: FakeClock
    signer: Signer
    violations: Violations
    settings: TeardownSettings
    counters: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # what each device consumes

    @property
    def root(self) -> Path:
        return self.tmp / "sim"

    @property
    def checkpoint(self) -> Path:
        return self.tmp / "agent-checkpoint.json"

    def key(self, index: int) -> tuple[str, str, str]:
        return (DRIVER, NODE, self.device_names[index])

    @property
    def device_names(self) -> list[str]:
        return [f"{'mig' if g.is_mig else 'gpu'}-{i}" for i, g in enumerate(self.gpus)]

    def backend(self) -> SimulatedGpu:
        return SimulatedGpu(self.root)

    def agent(
        self,
        *,
        cluster: Any = None,
        backend: Any = None,
        on_transition: Callable[..., None] | None = None,
        nvidia_checkpoint: Path | None = None,
        max_concurrent_teardowns: int = 0,
    ) -> Agent:
        """A fresh agent process: new instance, same checkpoint file, same cluster and GPUs."""
        return Agent(
            AgentSettings(
                node=NODE,
                teardown=self.settings,
                nvidia_checkpoint=nvidia_checkpoint,
                rescrub_dir=request_dir(self.checkpoint),
                max_concurrent_teardowns=max_concurrent_teardowns,
            ),
            cluster=cluster or self.cluster,
            backend=backend or self.backend(),
            store=CheckpointStore(self.checkpoint, NODE),
            signer=self.signer,
            clock=self.clock,
            on_transition=on_transition,
        )

    def tenant(
        self, name: str, devices: list[int], namespace: str = "team-a", *, admin_access: bool = False
    ) -> tuple[dict, dict]:
        """A claim allocated `devices` and a running pod using it; the tenant fills the memory with a canary.
        `admin_access`: allocated with admin access, beside which the scheduler may allocate the devices to other
        claims (so the claim's allocation keeps them from nobody)."""
        claim = self.cluster.add_claim(namespace, name, [self.key(i) for i in devices], admin_access=admin_access)
        pod = self.cluster.add_pod(namespace, f"{name}-pod", NODE, [name])
        for i in devices:
            simulated.fill(self.root, self.gpus[i].uuid, CANARY)
        return claim, pod

    def finish(self, pod: dict, *, controller: bool = True) -> dict:
        """The pod completes; the resourceclaim controller deallocates and deletes its generated claim."""
        done = self.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded")
        if controller:
            for status in done["status"]["resourceClaimStatuses"]:
                namespace = done["metadata"]["namespace"]
                if (namespace, status["resourceClaimName"]) in self.cluster.claims:
                    self.cluster.deallocate(namespace, status["resourceClaimName"])
                    self.cluster.delete_claim(namespace, status["resourceClaimName"])
        return done

    def job_ends(self, agent: Agent, name: str = "job", devices: tuple[int, ...] = (0,)) -> tuple[dict, dict]:
        """A tenant's pod runs on `devices` (seen by `agent`) and succeeds, with no controller acting yet: the
        agent tears its claim down (a crash the test plants propagates). Returns (claim, pod) as created."""
        claim, pod = self.tenant(name, list(devices))
        agent.observe_pod("ADDED", pod)
        agent.observe_pod("MODIFIED", self.finish(pod, controller=False))
        return claim, pod

    def clean(self, index: int) -> bool:
        return simulated.read(self.root, self.gpus[index].uuid).count(0) == MEMORY

    def canary_present(self, index: int) -> bool:
        return CANARY in simulated.read(self.root, self.gpus[index].uuid, 0, 4096)

    def fenced(self, index: int) -> bool:
        return names.TAINT_UNSANITIZED in self.cluster.taints_on(*self.key(index))

    def held(self, index: int) -> bool:
        """Device `index` is allocated to a claim, or consumes a counter an allocated device consumes: no other
        claim can get it."""
        allocated = {key for claim in list(self.cluster.claims.values()) for key in _allocated(claim)}
        taken = {
            (self.counters[key[2]][0], i)
            for key in allocated
            if key[2] in self.counters
            for i in self.counters[key[2]][1]
        }
        name = self.device_names[index]
        mine = {(self.counters[name][0], i) for i in self.counters[name][1]} if name in self.counters else set()
        return self.key(index) in allocated or bool(mine & taken)

    def overlapping(self, index: int) -> list[int]:
        """The devices sharing memory with device `index`: its parent GPU, or its MIG slices."""
        me = self.gpus[index]
        return [
            i
            for i, g in enumerate(self.gpus)
            if i != index and ((me.parent_uuid and g.uuid == me.parent_uuid) or g.parent_uuid == me.uuid)
        ]

    def guarded(self, index: int) -> bool:
        """Device `index` is clean, or it and every device sharing its memory are out of other claims' reach:
        fenced, or allocated."""
        return self.clean(index) or all(self.fenced(i) or self.held(i) for i in [index, *self.overlapping(index)])

    def settle(self, agent: Agent, *, rounds: int = 50) -> None:
        """Tick until nothing is left to do now (drain polls and backoffs pass on the fake clock)."""
        for _ in range(rounds):
            agent.tick()
            # After a tick, a teardown still released is waiting for a claim sharing its device.
            idle = (State.ALLOCATED, State.RELEASED, State.FAILED)
            pending = [td for td in agent.store.teardowns.values() if td.state not in idle]
            if not pending:
                return
            self.clock.advance(1.0)
        raise AssertionError(f"agent did not settle: {[(t.claim.name, t.state) for t in pending]}")


def _allocated(claim: dict[str, Any]) -> set[tuple[str, str, str]]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return {(r["driver"], r["pool"], r["device"]) for r in results}


class Crash(BaseException):
    """The agent process dies here (BaseException: nothing in the agent may swallow it)."""


class CrashPlan:
    """Counts every API/GPU call (before and after it runs) and every checkpointed transition; dies at one."""

    def __init__(self, at_event: int | None = None, at_state: State | None = None) -> None:
        self.at_event = at_event
        self.at_state = at_state
        self.events = 0
        self.where = ""

    def _tick(self, where: str) -> None:
        self.events += 1
        if self.events == self.at_event:
            self.where = where
            raise Crash(where)

    def on_call(self, name: str, phase: str) -> None:
        self._tick(f"{phase} {name}")

    def on_transition(self, td: Teardown, state: State) -> None:
        if state == self.at_state:
            self.at_state = None
            self.where = f"after checkpointing {state.value}"
            raise Crash(self.where)
        self._tick(f"after checkpointing {state.value}")


def run_crashing(node: GpuNode, plan: CrashPlan, device: int = 0) -> bool:
    """One agent lifetime through first sight, release and teardown of a claim on `device`; True if it
    crashed. The world moves on while the agent is down: a crash after first sight finds the pod finished."""
    _, pod = node.tenant("train", [device])
    agent = node.agent(
        cluster=Interceptor(node.cluster, plan.on_call),
        backend=Interceptor(node.backend(), plan.on_call),
        on_transition=plan.on_transition,
    )
    try:
        agent.start()
    except Crash:
        return True
    finished = node.finish(pod)
    try:
        agent.observe_pod("MODIFIED", finished)
        node.settle(agent)
    except Crash:
        # Mid-teardown: the device is released, so it (and what shares its memory) must still be fenced
        # unless already clean.
        assert node.guarded(device), f"crash {plan.where}: device {device} or its memory unfenced and dirty"
        return True
    return False


def restart_and_finish(node: GpuNode, device: int = 0) -> None:
    agent = node.agent()
    agent.start()
    assert node.guarded(device), "the restarted agent fenced everything that may be dirty first"
    for pod in list(node.cluster.pods.values()):  # finishing again is a no-op for a finished pod
        agent.observe_pod("MODIFIED", node.finish(pod))
    node.settle(agent)
    assert node.clean(device), "the restarted agent scrubbed the device"
    assert not node.cluster.rules, "and lifted its fences"
    assert ("team-a", "train") not in node.cluster.claims, "the finalizer was removed, so the deleted claim went"
    assert agent.store.teardowns == {}
    assert node.violations.found == []


def make_node(
    tmp: Path, *, gpus: int = 2, mig_per_gpu: int = 0, versions: tuple[str, ...] = ("v1",), counters: bool = True
) -> GpuNode:
    """A node whose slice publishes its GPUs and their MIG slices; with `counters`, as NVIDIA's driver publishes
    dynamic MIG (a GPU and its slices consume shared memory-slice counters, so an allocation of one takes the
    others too), else with nothing but `parentUUID` to tell that they share memory."""
    devices = simulated.create_inventory(
        tmp / "sim", gpus=gpus, mig_per_gpu=mig_per_gpu, memory_bytes=MEMORY, mig_memory_bytes=MEMORY
    )
    violations = Violations()
    node = GpuNode(
        tmp=tmp,
        gpus=devices,
        cluster=InMemoryCluster(taint_rule_versions=versions),
        clock=FakeClock(),
        signer=Signer(Ed25519PrivateKey.generate(), KID),
        violations=violations,
        settings=TeardownSettings(drain_timeout_s=5.0, max_attempts=2, retry_backoff_s=10.0, record_after_s=0.0),
    )
    if counters:
        node.counters = _memory_counters(node)
    node.cluster.guard = sg007(node.signer)
    node.cluster.add_node(NODE)
    node.cluster.add_slice(
        NODE,
        DRIVER,
        NODE,
        {
            name: {"uuid": g.uuid, **({"parentUUID": g.parent_uuid} if g.parent_uuid else {})}
            for name, g in zip(node.device_names, devices, strict=True)
        },
        node.counters,
    )
    node.cluster.hook = _monitor(node)
    return node


def _memory_counters(node: GpuNode) -> dict[str, tuple[str, list[int]]]:
    """Each GPU with MIG slices consumes all of its memory slices; each slice, its own."""
    found: dict[str, tuple[str, list[int]]] = {}
    for name, gpu in zip(node.device_names, node.gpus, strict=True):
        children = [i for i, g in enumerate(node.gpus) if g.parent_uuid == gpu.uuid]
        if children:
            found[name] = (f"{name}-counters", children)
            for i in children:
                found[node.device_names[i]] = (f"{name}-counters", [i])
    return found


CLAIM_CONTROLLER = Requester(CLAIM_CONTROLLER_USER, ("system:serviceaccounts",))


def sg007(signer: Signer) -> Callable[[dict[str, Any]], bool]:
    """The webhook's verdict (the real rule) on the resourceclaim controller's deallocation of a stored claim."""
    policy = parse_policy({"attestationKeys": [{"kid": signer.kid, "publicKey": public_key_pem(signer.key)}]})

    def allowed(claim: dict[str, Any]) -> bool:
        cleared = {**claim, "status": {}}
        return not deallocation_guard(cleared, claim, CLAIM_CONTROLLER, Scope(policy))[0]

    return allowed


def _monitor(node: GpuNode) -> Callable[[str, tuple[Any, ...]], None]:
    """Before every API call: a fence is deleted only from a clean device; the finalizer is removed only
    from a claim that carries, once the patch is applied (as the webhook judges it), an attestation that
    verifies for it."""
    by_rule: dict[str, list[int]] = {}  # rule -> the device it selects, then those whose memory it shares

    def check(operation: str, args: tuple[Any, ...]) -> None:
        keys = ["/".join(node.key(i)) for i in range(len(node.gpus))]
        if operation == "create_device_taint_rule":
            rule = args[1]
            selector = rule["spec"]["deviceSelector"]
            shares = rule["metadata"]["annotations"].get(SHARES_MEMORY_ANNOTATION)
            guards = [f"{selector['driver']}/{selector['pool']}/{selector['device']}"]
            by_rule[rule["metadata"]["name"]] = [keys.index(k) for k in guards + (shares.split(", ") if shares else [])]
        elif operation == "delete_device_taint_rule":
            rule = node.cluster.rules.get(args[1])
            dirty = [i for i in by_rule.get(args[1], []) if not node.clean(i)]
            if rule and rule["spec"]["taint"]["key"] == names.TAINT_UNSANITIZED and dirty:
                node.violations.found.append(f"fence {args[1]} deleted while device {dirty[0]} is dirty")
        elif operation == "patch_claim":
            namespace, name, ops = args
            removes = any(op["path"] == "/metadata/finalizers" and op["op"] == "replace" for op in ops)
            claim = node.cluster.claims.get((namespace, name))
            # A claim deleted before it held a device owes no scrub (the webhook lets its finalizer go).
            if removes and claim is not None and not deleted_before_allocation(claim):
                try:
                    claim = kube_json_patch.apply_patch(claim, ops)
                except jsonpatch.JsonPatchException:
                    return  # its tests fail: the API server refuses it
                token = (claim["metadata"].get("annotations") or {}).get(names.ANNOTATION_ATTESTATION, "")
                try:
                    # Every GPU it holds (a device of another driver, a NIC say, is not scrubbed).
                    gpus = {key for key in claimed_devices(claim) if key[0] == DRIVER}
                    check_claim_attestation(token, claim, node.signer.public_keys, gpus)
                except AttestationError as exc:
                    node.violations.found.append(f"finalizer of {namespace}/{name} removed without attestation: {exc}")

    return check


def claim_annotations(node: GpuNode, name: str, namespace: str = "team-a") -> dict[str, str]:
    claim = node.cluster.claims.get((namespace, name))
    return dict((claim or {}).get("metadata", {}).get("annotations") or {})


def recorded(node: GpuNode, name: str, namespace: str = "team-a") -> list[dict[str, Any]]:
    return json.loads(claim_annotations(node, name, namespace)[names.ANNOTATION_DEVICES])


def eventually(check: Callable[[], object], what: str, timeout: float = 30.0, alive: Callable[[], bool] = lambda: True):
    """Polls `check` until it returns something truthy (returned); fails after `timeout` or once `alive()` is false."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if not alive() or time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return result


def seed_api(node: GpuNode, cluster: Any, core: Any) -> dict[str, Any]:
    """Puts the node, its ResourceSlice and a running pod holding claim team-a/train (allocated gpu-0, with
    the webhook's finalizer) into a real kube-apiserver through `cluster` (KubernetesClusterClient). No
    controller runs: the test plays them."""
    core.create_namespace({"metadata": {"name": "team-a"}})
    core.create_namespaced_service_account("team-a", {"metadata": {"name": "default"}})
    core.create_node({"metadata": {"name": NODE}})
    for resource_slice in node.cluster.slices:
        cluster._call("POST", "/apis/resource.k8s.io/v1/resourceslices", body=resource_slice)
    claims = "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims"
    cluster._call("POST", claims, body={
        "metadata": {"name": "train", "finalizers": [names.FINALIZER]},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    })  # fmt: skip
    pod = core.create_namespaced_pod("team-a", {"metadata": {"name": "train-0"}, "spec": {
        "nodeName": NODE, "containers": [{"name": "main", "image": "trainer"}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": "train"}],
    }})  # fmt: skip
    claim = cluster.get_claim("team-a", "train")
    claim["status"] = {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}},
        "reservedFor": [{"resource": "pods", "name": "train-0", "uid": pod.metadata.uid}],
    }
    cluster._call("PUT", f"{claims}/train/status", body=claim)
    return claim


def finalizer_removed(cluster: Any) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        claim = cluster.get_claim("team-a", "train")
        return claim if claim and names.FINALIZER not in claim["metadata"].get("finalizers", []) else None

    return check
