"""The agent with `max_concurrent_teardowns`: teardowns of different devices run side by side, bounded; fencing a
new allocation never waits behind a scrub; one claim's steps stay in order; a crash anywhere still restarts
into "fenced" or "verified clean"; concurrent checkpoint saves share writes and lose nothing."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from agent_support import (
    NODE,
    Crash,
    CrashPlan,
    GpuNode,
    Interceptor,
    make_node,
    restart_and_finish,
)
from scrubgate.policies import names
from scrubgate.sanitizer_agent.agent import LANE_POLL_S, Agent
from scrubgate.sanitizer_agent.checkpoint import CheckpointStore, ClaimRef, State, Teardown
from scrubgate.sanitizer_agent.cli import add_arguments
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.lanes import Lanes
from scrubgate.sanitizer_agent.teardown import ANNOUNCE_SCRUBBING_AFTER_S, TeardownSettings

WAIT_S = 10.0


def concurrent_agent(node: GpuNode, workers: int = 4, **parts: Any) -> Agent:
    """A fresh agent process of `node` whose teardowns run in `workers` lanes."""
    return node.agent(max_concurrent_teardowns=workers, **parts)


def settle(node: GpuNode, agent: Agent, rounds: int = 50) -> None:
    """Ticks and lets the lanes finish until nothing is left to do now."""
    for _ in range(rounds):
        agent.tick()
        assert agent.wait_idle(WAIT_S), "lanes still busy"
        idle = (State.ALLOCATED, State.RELEASED, State.FAILED)
        if all(td.state in idle for td in agent.store.teardowns.values()):
            return
        node.clock.advance(1.0)
    raise AssertionError("agent did not settle")


class GatedScrubs:
    """A backend whose scrubs wait at a gate; counts the scrubs running at once."""

    def __init__(self, backend: Any, gate: threading.Event | None = None) -> None:
        self._backend = backend
        self.gate = gate or threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.started = threading.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def scrub(self, uuid: str) -> Any:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.started.release()
        try:
            assert self.gate.wait(WAIT_S), "the gate never opened"
            return self._backend.scrub(uuid)
        finally:
            with self.lock:
                self.running -= 1


def started(scrubs: GatedScrubs, count: int) -> bool:
    return all(scrubs.started.acquire(timeout=WAIT_S) for _ in range(count))


@pytest.fixture
def node(tmp_path) -> GpuNode:
    return make_node(tmp_path, gpus=4)


def test_the_loop_does_not_spin_on_work_already_in_a_lane(node):
    """A record due while its claim's lane is writing it: the loop looks again after LANE_POLL_S, not at once. It
    used to wait 0 s and tick at full speed for as long as the lane worked (about 1,800 ticks/s under
    bench/lifecycle.py's load, half of the agent's CPU)."""
    node.settings = TeardownSettings(drain_timeout_s=5.0, record_after_s=2.0)
    gate, writing = threading.Event(), threading.Event()

    def on_call(name: str, phase: str) -> None:
        if name == "patch_claim" and phase == "before":
            writing.set()
            assert gate.wait(WAIT_S), "the gate never opened"

    agent = concurrent_agent(node, cluster=Interceptor(node.cluster, on_call))
    agent.start()
    try:
        _, pod = node.tenant("long", [0])
        agent.observe_pod("ADDED", pod)
        agent.tick()
        assert agent.wait_idle(WAIT_S)
        node.clock.advance(2.0)
        agent.tick()
        assert writing.wait(WAIT_S), "the record's write is under way in the claim's lane"
        assert agent.tick() == LANE_POLL_S > 0
        gate.set()
        assert agent.wait_idle(WAIT_S)
        assert agent.tick() == pytest.approx(agent.settings.resync_s, abs=1), "nothing due but the resync"
        annotations = node.cluster.claims[("team-a", "long")]["metadata"]["annotations"]
        assert annotations[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_FENCED
    finally:
        gate.set()
        agent.close()


def test_scrubs_of_different_gpus_run_at_once_and_at_most_as_many_as_configured(node):
    scrubs = GatedScrubs(node.backend())
    agent = concurrent_agent(node, workers=3, backend=scrubs)
    agent.start()
    try:
        for i in range(4):
            node.job_ends(agent, f"job-{i}", (i,))
        agent.tick()
        assert started(scrubs, 3), "three teardowns scrub side by side"
        assert not scrubs.started.acquire(timeout=0.3), "the fourth waits for a free worker"
        scrubs.gate.set()
        settle(node, agent)
    finally:
        scrubs.gate.set()
        agent.close()
    assert scrubs.most == 3
    assert all(node.clean(i) for i in range(4)) and not node.cluster.rules
    assert agent.store.teardowns == {} and node.violations.found == []


def test_a_new_allocation_that_needs_a_fence_is_fenced_while_another_gpu_is_scrubbed(node):
    scrubs = GatedScrubs(node.backend())
    agent = concurrent_agent(node, workers=2, backend=scrubs)
    agent.start()
    try:
        node.job_ends(agent, "old", (0,))
        assert started(scrubs, 1)
        _, pod = node.tenant("new", [1], admin_access=True)
        agent.observe_pod("ADDED", pod)  # returns with the fence up: nothing waited for the scrub
        assert node.fenced(1) and scrubs.running == 1
        scrubs.gate.set()
        settle(node, agent)
    finally:
        scrubs.gate.set()
        agent.close()
    assert node.clean(0) and node.fenced(1) and not node.fenced(0)
    assert claim_status(node, "new") == names.SCRUB_FENCED
    assert agent.metrics.fences.labels(reason="not-held")._value.get() == 1


def claim_status(node: GpuNode, name: str) -> str | None:
    claim = node.cluster.claims[("team-a", name)]
    return (claim["metadata"].get("annotations") or {}).get(names.ANNOTATION_SCRUB_STATUS)


def test_each_claims_steps_stay_in_order_while_claims_run_side_by_side(node):
    steps: dict[str, list[str]] = {}  # a claim's scrub-status writes and its fence's lift, in order

    def record(operation: str, args: tuple[Any, ...]) -> None:
        if operation == "patch_claim":
            for op in args[2]:
                if op["op"] == "test":
                    continue
                if op["path"] == "/metadata/annotations":  # the claim's first annotations, all at once
                    value = op["value"].get(names.ANNOTATION_SCRUB_STATUS)
                elif op["path"].endswith(names.ANNOTATION_SCRUB_STATUS.replace("/", "~1")):
                    value = op["value"]
                else:
                    continue
                steps.setdefault(args[1], []).append(value)
        elif operation == "delete_device_taint_rule":
            claim = node.cluster.rules[args[1]]["metadata"]["annotations"]["scrubgate.dev/claim"].partition("/")[2]
            steps.setdefault(claim, []).append("lift")

    monitor = node.cluster.hook
    node.cluster.hook = lambda operation, args: (monitor(operation, args), record(operation, args))
    agent = concurrent_agent(node, workers=4)
    agent.start()
    try:
        for i in range(4):
            _, pod = node.tenant(f"job-{i}", [i], admin_access=bool(i % 2))
            if i >= 2:  # a scrub that outlasts ANNOUNCE_SCRUBBING_AFTER_S is announced
                simulated.inject_fault(node.root, node.gpus[i].uuid, "slow_scrub", ANNOUNCE_SCRUBBING_AFTER_S + 0.5)
            agent.observe_pod("ADDED", pod)
            agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
        settle(node, agent)
    finally:
        agent.close()

    # A fence, where there is one, goes only after the attestation (status `verified`) is on the claim: the
    # device is handed out again only once the attestation of its scrub can be read. `scrubbing` is announced
    # only for a scrub that takes a while (each claim write wakes the resourceclaim controller).
    def expected(i: int) -> list[str]:
        scrubbing = [names.SCRUB_SCRUBBING] if i >= 2 else []
        return [names.SCRUB_FENCED, *scrubbing, names.SCRUB_VERIFIED, *(["lift"] if i % 2 else [])]

    assert steps == {f"job-{i}": expected(i) for i in range(4)}
    assert node.violations.found == []


def test_lanes_run_one_keys_tasks_in_order_and_different_keys_at_once():
    lanes = Lanes(2)
    order: list[str] = []
    both = threading.Barrier(2, timeout=WAIT_S)
    try:
        for key in ("a", "b"):
            lanes.submit(key, both.wait)  # both lanes at once, or the barrier breaks
            for i in range(20):
                lanes.submit(key, lambda key=key, i=i: order.append(f"{key}{i}"))
        assert lanes.wait_idle(WAIT_S)
    finally:
        lanes.close()
    assert not both.broken
    for key in ("a", "b"):
        assert [x for x in order if x[0] == key] == [f"{key}{i}" for i in range(20)]


def test_a_tagged_task_waiting_in_its_lane_is_not_queued_twice():
    lanes = Lanes(1)
    gate, ran = threading.Event(), []
    try:
        lanes.submit("a", lambda: gate.wait(WAIT_S))
        for _ in range(5):
            lanes.submit("a", lambda: ran.append("advance"), "advance")
        lanes.submit("a", lambda: ran.append("other"))
        gate.set()
        assert lanes.wait_idle(WAIT_S)
    finally:
        lanes.close()
    assert ran == ["advance", "other"]


@pytest.mark.parametrize("at_event", range(1, 115, 3))
def test_a_crash_anywhere_among_concurrent_teardowns_restarts_into_fenced_or_clean(tmp_path, at_event):
    node = make_node(tmp_path, gpus=3)
    plan = CrashPlan(at_event=at_event)
    pods = [node.tenant(f"job-{i}", [i])[1] for i in range(3)]
    agent = concurrent_agent(
        node,
        workers=3,
        cluster=Interceptor(node.cluster, plan.on_call),
        backend=Interceptor(node.backend(), plan.on_call),
        on_transition=plan.on_transition,
    )
    crashed, seen = False, False
    try:
        agent.start()
        seen = True  # from here on every device was seen allocated: it stays fenced until clean
        for pod in pods:
            agent.observe_pod("MODIFIED", node.finish(pod))
        settle(node, agent)
    except Crash:
        crashed = True
    finally:
        agent.close()
    if not crashed:
        return
    assert not seen or all(node.guarded(i) for i in range(3)), f"crash {plan.where}: a dirty device lost its fence"
    restarted = node.agent()
    restarted.start()
    assert all(node.guarded(i) for i in range(3))
    for pod in node.cluster.pods.values():
        restarted.observe_pod("MODIFIED", node.finish(pod))
    node.settle(restarted)
    assert all(node.clean(i) for i in range(3)) and not node.cluster.rules
    assert node.violations.found == []


def test_restart_after_a_concurrent_run_finishes_the_work(node):
    plan = CrashPlan(at_state=State.SCRUBBING)
    agent = concurrent_agent(node, workers=2, on_transition=plan.on_transition)
    _, pod = node.tenant("train", [0])
    agent.start()
    with pytest.raises(Crash):
        agent.observe_pod("MODIFIED", node.finish(pod))
        settle(node, agent)
    agent.close()
    restart_and_finish(node)


def test_saves_asked_for_at_once_share_writes_and_each_finds_its_change_on_disk(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoint.json", NODE)
    writes = []
    real = store.data.model_dump_json

    def dump(**kwargs: Any) -> str:
        writes.append(1)
        time.sleep(0.05)  # a write takes a while: saves asked for meanwhile wait for the next
        return real(**kwargs)

    object.__setattr__(store.data, "model_dump_json", dump)
    missing: list[str] = []
    together = threading.Barrier(16, timeout=WAIT_S)

    def one(i: int) -> None:
        ref = ClaimRef(namespace="team-a", name=f"c{i}", uid=f"uid-{i}")
        with store.lock:
            store.teardowns[ref.uid] = Teardown(
                claim=ref, devices=[], state=State.ALLOCATED, fence="rule", allocated_at=0.0
            )
        together.wait()
        store.save()
        if f"uid-{i}" not in json.loads((tmp_path / "checkpoint.json").read_text())["teardowns"]:
            missing.append(ref.uid)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert missing == []
    assert len(writes) < 16


def test_the_cli_bounds_concurrent_teardowns():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).max_concurrent_teardowns == 16
    assert parser.parse_args(["--max-concurrent-teardowns", "0"]).max_concurrent_teardowns == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-concurrent-teardowns", "-1"])


def test_closing_waits_for_the_task_under_way_and_starts_no_other():
    lanes = Lanes(1)
    started, gate, ran = threading.Event(), threading.Event(), []
    lanes.submit("a", lambda: (started.set(), gate.wait(WAIT_S), ran.append("a1")))
    lanes.submit("a", lambda: ran.append("a2"))
    lanes.submit("b", lambda: ran.append("b1"))
    assert started.wait(WAIT_S), "the first task never started"  # under way, not merely queued
    closing = threading.Thread(target=lanes.close)
    closing.start()
    deadline = time.monotonic() + WAIT_S
    while not lanes._closing and time.monotonic() < deadline:  # close() has begun
        time.sleep(0.01)
    gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive() and ran == ["a1"]


def test_the_api_client_keeps_a_connection_per_concurrent_call(tmp_path):
    from scrubgate.sanitizer_agent.kube import KubernetesClusterClient

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    client = KubernetesClusterClient.from_config(str(kubeconfig), 300)
    assert client.api.rest_client.pool_manager.connection_pool_kw["maxsize"] == 300
    assert client.api.configuration.host == "https://127.0.0.1:1"


def test_a_burst_of_allocations_is_read_side_by_side(node):
    both = threading.Barrier(2, timeout=WAIT_S)

    class Api:
        def __getattr__(self, name: str) -> Any:
            return getattr(node.cluster, name)

        def get_claim(self, namespace: str, name: str, not_older_than: str = "") -> Any:
            if name in ("a", "b"):
                both.wait()  # two first sights at once, or the barrier breaks
            return node.cluster.get_claim(namespace, name, not_older_than)

    scrubs = GatedScrubs(node.backend())
    agent = concurrent_agent(node, workers=2, cluster=Api(), backend=scrubs)
    agent.start()
    try:
        node.job_ends(agent, "old", (0,))
        assert started(scrubs, 1)  # a scrub runs all along
        pods = [node.tenant(name, [i])[1] for name, i in (("a", 1), ("b", 2))]
        agent.observe_batch([("POD", ("ADDED", pod)) for pod in pods])
        assert not both.broken and {"a", "b"} <= {td.claim.name for td in agent.store.teardowns.values()}
        scrubs.gate.set()
        settle(node, agent)
    finally:
        scrubs.gate.set()
        agent.close()
    assert [claim_status(node, name) for name in ("a", "b")] == [names.SCRUB_FENCED] * 2
    assert node.clean(0) and node.violations.found == []


def test_a_first_sight_reads_the_claim_as_of_its_pods_event(node):
    """A claim the agent has not seen, found on a pod of its node, is read as of that pod's resourceVersion (from
    the API server's watch cache, which it keeps at least that fresh): no read of etcd per allocation, in a burst
    (side by side) or alone."""
    reads: list[tuple[str, str]] = []

    class Api:
        def __getattr__(self, name: str) -> Any:
            return getattr(node.cluster, name)

        def get_claim(self, namespace: str, name: str, not_older_than: str = "") -> Any:
            reads.append((name, not_older_than))
            return node.cluster.get_claim(namespace, name, not_older_than)

    agent = concurrent_agent(node, workers=2, cluster=Api())
    agent.start()
    try:
        pods = [node.tenant(name, [i])[1] for name, i in (("a", 1), ("b", 2), ("c", 3))]
        agent.observe_batch([("POD", ("ADDED", pod)) for pod in pods[:2]])
        agent.observe_batch([("POD", ("ADDED", pods[2]))])
        settle(node, agent)
        assert {td.claim.name for td in agent.store.teardowns.values()} == {"a", "b", "c"}
    finally:
        agent.close()
    versions = [pod["metadata"]["resourceVersion"] for pod in pods]
    assert all(versions) and sorted(reads) == sorted(zip(("a", "b", "c"), versions, strict=True))


def test_the_fences_of_one_claims_devices_go_up_and_down_at_once(tmp_path):
    # gpu-0 and its two MIG slices, no counters: the GPU's allocation does not hold the slices, three fences
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2, counters=False)
    together = threading.Barrier(3, timeout=WAIT_S)

    class Api:
        def __getattr__(self, name: str) -> Any:
            return getattr(node.cluster, name)

        def create_device_taint_rule(self, version: str, rule: dict[str, Any]) -> None:
            together.wait()  # all three at once, or the barrier breaks
            node.cluster.create_device_taint_rule(version, rule)

        def delete_device_taint_rule(self, version: str, name: str) -> None:
            together.wait()
            node.cluster.delete_device_taint_rule(version, name)

    agent = concurrent_agent(node, workers=3, cluster=Api())
    agent.start()
    try:
        _, pod = node.tenant("whole", [0])
        agent.observe_pod("ADDED", pod)
        assert all(node.fenced(i) for i in range(3))
        agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
        settle(node, agent)
    finally:
        agent.close()
    assert not together.broken and not node.cluster.rules and node.clean(0)
    assert node.violations.found == []


def test_weak_fences_of_teardowns_side_by_side_stand_while_any_device_is_dirty(tmp_path):
    node = make_node(tmp_path, gpus=3, versions=())  # no DeviceTaintRule API: the node taint is the fence
    lifted_while_dirty: list[str] = []
    monitor = node.cluster.hook

    def check(operation: str, args: tuple[Any, ...]) -> None:
        monitor(operation, args)
        for op in args[1] if operation == "patch_node" else []:
            if op["op"] == "replace" and op["path"] == "/spec/taints":
                keeps = any(t.get("key") == names.TAINT_UNSANITIZED for t in op["value"])
                if not keeps and not all(node.clean(i) for i in range(3)):  # all three pods ended together
                    lifted_while_dirty.append(json.dumps(op["value"]))

    node.cluster.hook = check
    agent = concurrent_agent(node, workers=3)
    agent.start()
    try:
        pods = [node.tenant(f"job-{i}", [i])[1] for i in range(3)]
        for pod in pods:
            agent.observe_pod("ADDED", pod)
        agent.observe_batch([("POD", ("MODIFIED", node.finish(pod, controller=False))) for pod in pods])
        settle(node, agent)
    finally:
        agent.close()
    assert lifted_while_dirty == []
    assert all(node.clean(i) for i in range(3)) and node.cluster.node_taints(NODE) == []
    assert node.violations.found == []
