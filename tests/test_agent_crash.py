"""Crash the agent anywhere, restart it on the same checkpoint: the device ends out of reach (held by its
claim's allocation, or fenced) or verified clean, never in reach and dirty, and the finalizer goes only with a
valid attestation."""

from __future__ import annotations

import pytest
from agent_support import CrashPlan, make_node, restart_and_finish, run_crashing
from scrubgate.policies import names
from scrubgate.sanitizer_agent.checkpoint import State
from scrubgate.sanitizer_agent.gpu import simulated

STATES = [State.ALLOCATED, State.RELEASED, State.DRAINING, State.SCRUBBING, State.VERIFIED, State.ATTESTED,
          State.DONE]  # fmt: skip


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
def test_crash_right_after_each_transition_is_checkpointed(tmp_path, state):
    node = make_node(tmp_path)
    plan = CrashPlan(at_state=state)
    assert run_crashing(node, plan), f"never reached {state.value}"
    restart_and_finish(node)


def test_crash_before_and_after_every_call_the_agent_makes(tmp_path):
    clean_run = CrashPlan()
    assert not run_crashing(make_node(tmp_path / "clean"), clean_run)
    assert clean_run.events > 30  # every API and GPU call, twice, plus the transitions
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
