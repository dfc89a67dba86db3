"""Every injected GPU fault ends in `failed`: fence kept, scrub-failed taint added, the reason in the
claim's status annotation, a Warning Event, a metric; retried with backoff, then held for an operator."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from agent_support import claim_annotations, eventually, make_node
from scrubgate.policies import names
from scrubgate.sanitizer_agent import cli
from scrubgate.sanitizer_agent.agent import RESCRUB_POLL_S
from scrubgate.sanitizer_agent.checkpoint import State
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.kube import ClusterError, NotFound, with_retries

FAULTS = {
    # fault: (kind, value, expected reason category)
    "scrub-error": ("scrub_error", "CUDA_ERROR_LAUNCH_FAILED", "scrub-failed"),
    "verification-mismatch": ("verify_mismatch", True, "scrub-failed"),
    "nvml-error": ("nvml_error", "NVML_ERROR_GPU_IS_LOST", "gpu-error"),
    "ecc-appears": ("ecc_error", 2, "unhealthy"),
    "critical-xid": ("xid", 79, "unhealthy"),
    "process-never-exits": ("linger", True, "drain-timeout"),
}


def _failures(agent, reason: str) -> float:
    return agent.metrics.registry.get_sample_value("scrubgate_agent_scrub_failures_total", {"reason": reason})


def _release(node, agent, fault=None, name="job", devices=(0,)):
    claim, pod = node.tenant(name, list(devices))
    agent.observe_pod("ADDED", pod)
    if fault:  # while the tenant runs (health counts XIDs since the allocation)
        simulated.inject_fault(node.root, node.gpus[devices[0]].uuid, *fault)
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    return agent.store.teardowns[claim["metadata"]["uid"]]


@pytest.mark.parametrize("fault", FAULTS)
def test_injected_fault_fails_closed(tmp_path, fault):
    kind, value, category = FAULTS[fault]
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    td = _release(node, agent, (kind, value))
    node.settle(agent)  # the drain timeout passes on the fake clock

    assert td.state == State.FAILED
    assert node.cluster.taints_on(*node.key(0)) == [names.TAINT_SCRUB_FAILED, names.TAINT_UNSANITIZED]
    status = claim_annotations(node, "job")[names.ANNOTATION_SCRUB_STATUS]
    assert status.startswith(f"{names.SCRUB_FAILED_PREFIX}{category}: ")
    assert node.gpus[0].uuid in status, "the reason names the GPU"
    assert names.ANNOTATION_ATTESTATION not in claim_annotations(node, "job")
    assert names.FINALIZER in node.cluster.claims[("team-a", "job")]["metadata"]["finalizers"]
    assert [e["reason"] for e in node.cluster.events] == ["ScrubFailed"]
    assert node.cluster.events[0]["type"] == "Warning"
    assert node.cluster.events[0]["involvedObject"]["name"] == "job"
    assert _failures(agent, category) == 1
    if kind not in ("ecc_error", "xid", "verify_mismatch"):
        assert node.canary_present(0), "failed before the scrub: the data is still there, behind the fence"
    assert node.violations.found == []


def test_failure_is_retried_with_backoff_then_held_for_an_operator(tmp_path):
    node = make_node(tmp_path)  # max_attempts=2, retry_backoff_s=10
    agent = node.agent()
    agent.start()
    td = _release(node, agent, ("scrub_error", "CUDA_ERROR_ECC_UNCORRECTABLE"))
    assert td.state == State.FAILED and td.attempts == 1 and td.retry_at is not None
    node.clock.advance(9)
    agent.tick()
    assert td.attempts == 1, "not before the backoff"
    node.clock.advance(2)
    agent.tick()
    assert td.state == State.FAILED and td.attempts == 2 and td.retry_at is None, "now waiting for an operator"
    node.clock.advance(3600)
    agent.tick()
    assert td.attempts == 2 and node.fenced(0)
    assert len(node.cluster.events) == 2 and "rescrub --device" in node.cluster.events[1]["message"]
    assert agent.tick() == RESCRUB_POLL_S < agent.settings.resync_s, "an operator's request is looked for soon"

    simulated.clear_faults(node.root)
    assert cli.run(_args(["rescrub", "--device", node.gpus[0].uuid, "--checkpoint", str(node.checkpoint)])) == 0
    agent.tick()
    assert node.clean(0) and not node.cluster.rules, "both taints go after the verified rescrub"
    assert claim_annotations(node, "job")[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_VERIFIED
    assert agent.store.teardowns == {}
    assert node.violations.found == []


def test_rescrub_refuses_a_device_that_has_not_failed(tmp_path, capsys):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    assert (
        cli.run(_args(["rescrub", "--device", "gpu.nvidia.com/gpu-node-1/gpu-0", "--checkpoint", str(node.checkpoint)]))
        == 1
    )
    err = capsys.readouterr().err
    assert "no failed teardown holds device gpu.nvidia.com/gpu-node-1/gpu-0" in err and "team-a/job: allocated" in err
    assert not (tmp_path / "agent-checkpoint.json.rescrub").exists()


def test_vanished_mig_device_is_not_unfenced_on_faith(tmp_path):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=1)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [1])
    agent.observe_pod("ADDED", pod)
    simulated.remove_device(node.root, node.gpus[1].uuid)  # dynamic MIG: gone after the driver's unprepare
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.FAILED and td.reason.startswith("gpu-error")
    assert node.fenced(1) and node.canary_present(1)


def test_status_and_json_output(tmp_path, capsys):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _release(node, agent, ("verify_mismatch", True))
    assert cli.run(_args(["status", "--checkpoint", str(node.checkpoint)])) == 0
    text = capsys.readouterr().out
    assert "team-a/job" in text and "failed" in text and node.gpus[0].uuid in text
    assert cli.run(_args(["status", "--checkpoint", str(node.checkpoint), "--format", "json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["node"] == "gpu-node-1"
    assert [(d["device"], d["state"], d["attempts"]) for d in data["devices"]] == [
        ("gpu.nvidia.com/gpu-node-1/gpu-0", "failed", 1)
    ]
    assert data["devices"][0]["reason"].startswith("scrub-failed: ")


def _args(argv: list[str]):
    parser = argparse.ArgumentParser(prog="scrubgate agent")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_api_outage_mid_teardown_keeps_the_device_held_and_resumes_after_backoff(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    monitor = node.cluster.hook
    outage = {"on": True}

    def hook(operation, args):
        monitor(operation, args)
        if outage["on"] and operation == "patch_claim":
            raise ClusterError(f"{operation}: HTTP 503: etcdserver: request timed out", 503)

    node.cluster.hook = hook
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.ATTESTED, "scrubbed and signed; writing the attestation waits for the API"
    assert node.held(0) and node.clean(0)
    calls = len(node.cluster.calls)
    agent.tick()
    assert len(node.cluster.calls) == calls, "backing off: no call before the delay"
    outage["on"] = False
    node.clock.advance(1.5)
    agent.tick()
    assert agent.store.teardowns == {} and not node.cluster.rules
    assert names.FINALIZER not in node.cluster.claims[("team-a", "job")]["metadata"]["finalizers"]
    assert node.violations.found == []


def test_transient_api_errors_are_retried_with_backoff_others_are_not():
    delays: list[float] = []
    answers = iter([ClusterError("GET x: unreachable", 0), ClusterError("GET x: HTTP 429", 429), "ok"])

    def call():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert with_retries("GET x", call, sleep=delays.append) == "ok"
    assert delays == [0.2, 0.4]

    def missing():
        raise NotFound("GET y: HTTP 404", 404)

    with pytest.raises(NotFound):
        with_retries("GET y", missing, sleep=delays.append)
    assert delays == [0.2, 0.4], "a 404 is an answer, not an outage"


def test_xid_while_the_agent_had_not_seen_the_allocation_yet_still_counts(tmp_path):
    node = make_node(tmp_path)
    claim, pod = node.tenant("job", [0])
    simulated.inject_fault(node.root, node.gpus[0].uuid, "xid", 79)  # fell off the bus mid-job
    agent = node.agent()
    agent.start()  # first sight after the XID: health is checked since the claim's creation
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.FAILED and "critical XID events: 79" in td.reason


def test_a_scrub_stuck_in_the_driver_fails_closed_and_fails_healthz(tmp_path):
    """A GPU fallen off the bus hangs the scrub's driver calls: past --scrub-timeout the watchdog fences the
    devices, marks the claim failed (an admin's break-glass may then let it go), says so in an Event and a
    metric, and /healthz fails (the kubelet restarts the agent); once the call returns, the teardown goes on."""
    node = make_node(tmp_path)
    node.settings = dataclasses.replace(node.settings, scrub_timeout_s=0.5)
    agent = node.agent(max_concurrent_teardowns=2)
    agent.start()
    uuid = node.gpus[0].uuid
    simulated.inject_fault(node.root, uuid, "slow_scrub", 60)
    td = _release(node, agent)
    agent.tick()
    eventually(lambda: not agent.healthy()[0], "/healthz failing for the stuck scrub")
    _, why = agent.healthy()
    assert "scrubbing of gpu.nvidia.com" in why and uuid in why and "stuck in the GPU driver" in why
    assert td.state == State.SCRUBBING and node.fenced(0) and node.canary_present(0)
    assert claim_annotations(node, "job")[names.ANNOTATION_SCRUB_STATUS].startswith(
        f"{names.SCRUB_FAILED_PREFIX}scrub-timeout"
    )
    assert [e["reason"] for e in node.cluster.events if e["reason"] == "ScrubTimeout"] == ["ScrubTimeout"]
    assert _failures(agent, "scrub-timeout") == 1

    simulated.clear_faults(node.root)  # the call returns
    eventually(lambda: not agent.store.teardowns, "the teardown to end", alive=lambda: agent.tick() is not None)
    agent.tick()
    assert agent.healthy()[0] and node.clean(0) and not node.cluster.rules
