"""Crash the agent anywhere, restart it on the same checkpoint: the device ends fenced or verified clean,
never unfenced and dirty, and the finalizer goes only with a valid attestation."""

from __future__ import annotations

import pytest
from agent_support import GpuNode, Interceptor, make_node
from scrubgate.policies import names
from scrubgate.sanitizer_agent.checkpoint import State, Teardown
from scrubgate.sanitizer_agent.gpu import simulated


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


def run_crashing(node: GpuNode, plan: CrashPlan) -> bool:
    """One agent lifetime through first sight, release and teardown; True if it crashed.
    The world moves on while the agent is down: a crash after first sight finds the pod finished."""
    _, pod = node.tenant("train", [0])
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
        # Mid-teardown: the device is released, so it must still be fenced unless already clean.
        assert node.fenced(0) or node.clean(0), f"crash {plan.where}: device 0 unfenced and dirty"
        return True
    return False


def restart_and_finish(node: GpuNode) -> None:
    agent = node.agent()
    agent.start()
    for pod in list(node.cluster.pods.values()):  # finishing again is a no-op for a finished pod
        agent.observe_pod("MODIFIED", node.finish(pod))
    node.settle(agent)
    assert node.clean(0), "the restarted agent scrubbed the device"
    assert not node.cluster.rules, "and lifted its fence"
    assert ("team-a", "train") not in node.cluster.claims, "the finalizer was removed, so the deleted claim went"
    assert agent.store.teardowns == {}
    assert node.violations.found == []


STATES = [State.ALLOCATED, State.RELEASED, State.DRAINING, State.SCRUBBING, State.VERIFIED, State.ATTESTED,
          State.UNFENCED, State.DONE]  # fmt: skip


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
def test_crash_right_after_each_transition_is_checkpointed(tmp_path, state):
    node = make_node(tmp_path)
    plan = CrashPlan(at_state=state)
    assert run_crashing(node, plan), f"never reached {state.value}"
    restart_and_finish(node)


def test_crash_before_and_after_every_call_the_agent_makes(tmp_path):
    clean_run = CrashPlan()
    assert not run_crashing(make_node(tmp_path / "clean"), clean_run)
    assert clean_run.events > 40  # every API and GPU call, twice, plus the transitions
    for event in range(1, clean_run.events + 1):
        node = make_node(tmp_path / str(event))
        plan = CrashPlan(at_event=event)
        assert run_crashing(node, plan)
        try:
            restart_and_finish(node)
        except AssertionError as exc:
            raise AssertionError(f"after a crash {plan.where} (event {event}): {exc}") from exc


def test_crash_after_a_failure_is_checkpointed_keeps_the_device_fenced(tmp_path):
    node = make_node(tmp_path)
    simulated.inject_fault(node.root, node.gpus[0].uuid, "scrub_error", "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert run_crashing(node, CrashPlan(at_state=State.FAILED))
    agent = node.agent()
    agent.start()
    node.settle(agent)
    td = next(iter(agent.store.teardowns.values()))
    assert td.state == State.FAILED and td.failure_reported
    assert node.cluster.taints_on(*node.key(0)) == [names.TAINT_SCRUB_FAILED, names.TAINT_UNSANITIZED]
    assert node.canary_present(0)
    assert names.FINALIZER in node.cluster.claims[("team-a", "train")]["metadata"]["finalizers"]
