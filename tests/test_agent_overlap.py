"""A GPU and its MIG slices share memory. Where they consume shared counters (NVIDIA's dynamic MIG), the
allocation of one keeps the others from every other claim until it goes, which SG007 holds until the
attestation: no fence. Where a slice publishes nothing but its `parentUUID`, the scheduler may hand out the
parent GPU while a slice is allocated, or a slice while its GPU is: so the teardown fences the devices that
share memory with its own from first sight, and lifts those fences only with its own, after a verified scrub.
Most tests here take that second layout (`make_node(counters=False)`)."""

from __future__ import annotations

import json

import e2e_support
import pytest
from agent_support import (
    CANARY,
    DRIVER,
    CrashPlan,
    eventually,
    make_node,
    restart_and_finish,
    run_crashing,
)
from scrubgate.policies import names
from scrubgate.policies.attestation import verify
from scrubgate.sanitizer_agent import claims, rescrub
from scrubgate.sanitizer_agent.checkpoint import FenceReason, State
from scrubgate.sanitizer_agent.fences import SHARES_MEMORY_ANNOTATION
from scrubgate.sanitizer_agent.gpu import simulated

GPU, SLICE, SIBLING = 0, 1, 2  # make_node(gpus=1, mig_per_gpu=2): gpu-0 and its slices mig-1, mig-2


def _release(node, agent, pod):
    """The pod completes; the resourceclaim controller deallocates its claim (the counters are free)."""
    agent.observe_pod("MODIFIED", node.finish(pod))


@pytest.mark.parametrize("held", [SLICE, GPU], ids=["mig-slice", "full-gpu"])
def test_with_shared_counters_the_allocation_keeps_the_overlapping_devices_and_nothing_is_fenced(tmp_path, held):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("train", [held])
    agent.observe_pod("ADDED", pod)
    assert agent.store.teardowns[claim["metadata"]["uid"]].not_held == []
    # Hold the teardown in draining: the claim is released and its memory dirty.
    simulated.attach(node.root, node.gpus[held].uuid, pid=4_000_002)
    simulated.inject_fault(node.root, node.gpus[held].uuid, "linger")
    _release(node, agent, pod)
    assert node.canary_present(held) and all(node.held(i) for i in [held, *node.overlapping(held)])
    assert not node.cluster.rules
    simulated.clear_faults(node.root)
    simulated.detach(node.root, node.gpus[held].uuid, pid=4_000_002)
    node.settle(agent)
    assert node.clean(held) and ("team-a", "train") not in node.cluster.claims, "deallocated after the attestation"
    assert node.cluster.calls.count("create_device_taint_rule") == 0
    assert node.violations.found == []


def test_overlapping_devices_are_found_through_uuid_and_parent_uuid():
    slices = {
        ("d", "p", "gpu-0"): claims.SliceDevice("GPU-0", None),
        ("d", "p", "gpu-0-mig-0"): claims.SliceDevice("MIG-0", "GPU-0"),
        ("d", "p", "gpu-0-mig-1"): claims.SliceDevice(None, "GPU-0"),  # dynamic MIG: not created yet
        ("d", "p", "gpu-1"): claims.SliceDevice("GPU-1", None),
    }
    assert claims.overlapping(("d", "p", "gpu-0"), slices) == [("d", "p", "gpu-0-mig-0"), ("d", "p", "gpu-0-mig-1")]
    assert claims.overlapping(("d", "p", "gpu-0-mig-0"), slices) == [("d", "p", "gpu-0")], "siblings share no memory"
    assert claims.overlapping(("d", "p", "gpu-1"), slices) == []
    assert claims.overlapping(("d", "p", "unknown"), slices) == []


def test_mig_slice_teardown_fences_the_parent_gpu_until_the_verified_scrub(tmp_path):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2, counters=False)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("train", [SLICE])
    agent.observe_pod("ADDED", pod)

    assert node.fenced(SLICE) and node.fenced(GPU), "the parent GPU is fenced from first sight"
    assert not node.fenced(SIBLING), "a sibling slice shares no memory"
    (parent_rule,) = [r for r in node.cluster.rules.values() if r["spec"]["deviceSelector"]["device"] == "gpu-0"]
    assert parent_rule["spec"]["taint"] == {
        "key": names.TAINT_UNSANITIZED,
        "value": claim["metadata"]["uid"],
        "effect": "NoSchedule",
    }
    assert parent_rule["metadata"]["annotations"][SHARES_MEMORY_ANNOTATION] == "/".join(node.key(SLICE))
    on_disk = json.loads(node.checkpoint.read_text())["teardowns"][claim["metadata"]["uid"]]
    assert [(o["device"], o["uuid"]) for o in on_disk["overlaps"]] == [("gpu-0", node.gpus[GPU].uuid)]

    # Hold the teardown in draining: the slice is released and dirty, its counters free again.
    simulated.attach(node.root, node.gpus[SLICE].uuid, pid=4_000_001)
    simulated.inject_fault(node.root, node.gpus[SLICE].uuid, "linger")
    _release(node, agent, pod)
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.DRAINING and node.canary_present(SLICE)
    assert node.fenced(SLICE) and node.fenced(GPU)

    simulated.clear_faults(node.root)
    simulated.detach(node.root, node.gpus[SLICE].uuid, pid=4_000_001)
    node.settle(agent)
    assert node.clean(SLICE) and not node.cluster.rules, "both fences lifted after the verified scrub"
    assert agent.store.teardowns == {}
    assert node.violations.found == [], "no fence went while the memory it guards was dirty"


def test_full_gpu_teardown_fences_its_mig_slices(tmp_path):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2, counters=False)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("train", [GPU])
    agent.observe_pod("ADDED", pod)
    assert all(node.fenced(i) for i in (GPU, SLICE, SIBLING))

    seen: list[bool] = []
    backend = node.backend()
    original = backend.scrub

    def scrub(uuid: str):
        seen.append(node.fenced(SLICE) and node.fenced(SIBLING))
        return original(uuid)

    backend.scrub = scrub
    agent.backend = agent.engine.gpu_steps.backend = backend
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert seen == [True], "the slices stayed fenced while the GPU was scrubbed"
    assert node.clean(GPU) and not node.cluster.rules
    token = node.cluster.claims[("team-a", "train")]["metadata"]["annotations"][names.ANNOTATION_ATTESTATION]
    assert [d["device"] for d in verify(token, node.signer.public_keys)["devices"]] == ["gpu-0"], (
        "the attestation covers what was scrubbed: the claim's GPU, not the slices fenced for it"
    )
    assert node.violations.found == []


@pytest.mark.parametrize("held", [SLICE, GPU], ids=["mig-slice", "full-gpu"])
def test_failed_scrub_keeps_the_overlapping_devices_fenced(tmp_path, held):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2, counters=False)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("train", [held])
    agent.observe_pod("ADDED", pod)
    simulated.inject_fault(node.root, node.gpus[held].uuid, "scrub_error", "CUDA_ERROR_ILLEGAL_ADDRESS")
    _release(node, agent, pod)
    node.settle(agent)
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.FAILED and node.canary_present(held)
    assert node.cluster.taints_on(*node.key(held)) == [names.TAINT_SCRUB_FAILED, names.TAINT_UNSANITIZED]
    for other in node.overlapping(held):
        assert node.cluster.taints_on(*node.key(other)) == [names.TAINT_UNSANITIZED], "fenced, not marked failed"

    node.clock.advance(3600)  # retries spent: waiting for an operator, still fenced
    node.settle(agent)
    assert td.state == State.FAILED and td.retry_at is None and node.guarded(held)
    simulated.clear_faults(node.root)
    rescrub.submit(node.checkpoint, node.gpus[held].uuid)
    node.settle(agent)
    assert node.clean(held) and not node.cluster.rules, "all fences go after the verified rescrub"
    assert node.violations.found == []


def test_gpu_two_slices_overlap_stays_fenced_until_both_are_torn_down(tmp_path):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2, counters=False)
    agent = node.agent()
    agent.start()
    _, pod_a = node.tenant("a", [SLICE])
    _, pod_b = node.tenant("b", [SIBLING])
    agent.observe_pod("ADDED", pod_a)
    agent.observe_pod("ADDED", pod_b)
    assert len(node.cluster.rules) == 4, "each claim fences its slice and, with its own rule, the GPU"

    _release(node, agent, pod_a)
    node.settle(agent)
    assert node.clean(SLICE) and not node.fenced(SLICE)
    assert node.fenced(GPU), "slice b's memory is still in use: the GPU stays fenced for it"

    _release(node, agent, pod_b)
    node.settle(agent)
    assert node.clean(SIBLING) and not node.cluster.rules and agent.store.teardowns == {}
    assert node.violations.found == []


STATES = [State.ALLOCATED, State.RELEASED, State.DRAINING, State.SCRUBBING, State.VERIFIED, State.ATTESTED,
          State.DONE]  # fmt: skip


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
def test_crash_after_each_transition_keeps_slice_and_parent_fenced(tmp_path, state):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=1, counters=False)
    assert run_crashing(node, CrashPlan(at_state=state), device=SLICE), f"never reached {state.value}"
    restart_and_finish(node, device=SLICE)


def test_crash_before_and_after_every_call_keeps_slice_and_parent_fenced(tmp_path):
    clean_run = CrashPlan()
    assert not run_crashing(
        make_node(tmp_path / "clean", gpus=1, mig_per_gpu=1, counters=False), clean_run, device=SLICE
    )
    for event in range(1, clean_run.events + 1):
        node = make_node(tmp_path / str(event), gpus=1, mig_per_gpu=1, counters=False)
        plan = CrashPlan(at_event=event)
        assert run_crashing(node, plan, device=SLICE)
        try:
            restart_and_finish(node, device=SLICE)
        except AssertionError as exc:
            raise AssertionError(f"after a crash {plan.where} (event {event}): {exc}") from exc


def test_restart_fences_what_a_checkpoint_without_overlaps_missed(tmp_path):
    """A teardown recorded before the slices said what shares its memory (or by an agent that did not
    look): the restarted agent fences the parent before anything else, and lifts it with the slice's."""
    node = make_node(tmp_path, gpus=1, mig_per_gpu=1, counters=False)
    _, pod = node.tenant("train", [SLICE])
    first = node.agent()
    first.start()
    data = json.loads(node.checkpoint.read_text())
    for td in data["teardowns"].values():
        td.pop("overlaps")
    node.checkpoint.write_text(json.dumps(data))
    for name, rule in list(node.cluster.rules.items()):
        if rule["spec"]["deviceSelector"]["device"] == "gpu-0":
            del node.cluster.rules[name]
    node.finish(pod)

    calls: list[str] = []
    monitor = node.cluster.hook

    def hook(operation, args):
        monitor(operation, args)
        if operation == "create_device_taint_rule":
            calls.append(args[1]["spec"]["deviceSelector"]["device"])
        elif operation in ("get_claim", "patch_claim"):
            calls.append(operation)

    node.cluster.hook = hook
    agent = node.agent()
    agent.start()
    assert calls[:3] == ["mig-1", "gpu-0", "get_claim"], "the parent is fenced before anything else happens"
    node.settle(agent)
    assert node.clean(SLICE) and not node.cluster.rules
    assert node.violations.found == []


# ---------------------------------------------------------------- the real scheduler's view

cluster_factory_fixture = e2e_support.cluster_factory_fixture


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_scheduler_does_not_hand_out_the_parent_gpu_while_the_slice_is_dirty(cluster_factory):
    """kube-scheduler, the resourceclaim controller, the kubelet stand-in and the NVIDIA-like driver, the
    agent as a process: a tenant's MIG slice fails its scrub; its claim is deallocated, so the GPU's counters
    are free, yet a pod asking for a full GPU stays pending until the slice is verified clean."""
    cluster = cluster_factory(
        gpus=1, mig_per_gpu=1, agent_args=["--resync", "1", "--max-attempts", "1", "--drain-timeout", "10"]
    )
    mig = next(d for d in cluster.gpus() if d.is_mig)
    ns = e2e_support.tenant_namespace(cluster, "overlap")
    e2e_support.create_template(cluster, "alice", ns, "one-mig", device_class="mig.nvidia.com")
    e2e_support.create_template(cluster, "alice", ns, "one-gpu", device_class="gpu.nvidia.com")

    def fences() -> dict[str, set[str]]:
        """device -> the taint keys DeviceTaintRules put on it"""
        found: dict[str, set[str]] = {}
        for rule in cluster.taint_rules():
            found.setdefault(rule["spec"]["deviceSelector"]["device"], set()).add(rule["spec"]["taint"]["key"])
        return found

    cluster.inject_fault(mig.uuid, "scrub_error", "CUDA_ERROR_ILLEGAL_ADDRESS")
    e2e_support.tenant_pod(
        cluster, "alice", ns, "slice-tenant", template="one-mig", canary=CANARY.decode(), run_seconds=1
    )
    # The agent writes one DeviceTaintRule per device, one after the other: wait for both, then no third.
    eventually(
        lambda: {"gpu-0", "gpu-0-mig-0"} <= set(fences()), "the fences of the slice and, for its memory, the GPU"
    )
    assert set(fences()) == {"gpu-0", "gpu-0-mig-0"}, "the slice and, for its memory, the GPU"
    eventually(lambda: names.TAINT_SCRUB_FAILED in fences().get("gpu-0-mig-0", set()), "the failed scrub", timeout=60)
    assert CANARY in cluster.gpu_memory(mig.uuid), "the slice is still dirty"

    e2e_support.tenant_pod(cluster, "alice", ns, "gpu-tenant", template="one-gpu")
    eventually(lambda: _unschedulable(cluster, ns, "gpu-tenant"), "the scheduler's verdict", timeout=60)
    assert not (cluster.pod(ns, "gpu-tenant") or {}).get("spec", {}).get("nodeName")

    cluster.clear_faults()
    rescrub.submit(cluster.paths.checkpoint, mig.uuid)  # the operator, once the GPU is fixed
    eventually(lambda: (cluster.pod(ns, "gpu-tenant") or {}).get("spec", {}).get("nodeName") == cluster.node,
               "binding", timeout=60)  # fmt: skip
    assert cluster.gpu_memory(mig.uuid).count(0) == len(cluster.gpu_memory(mig.uuid))
    gpu_claim = cluster.claim(ns, e2e_support.wait_for(lambda: cluster.pod_claim(ns, "gpu-tenant"), 30, "its claim"))
    assert [(r["driver"], r["device"]) for r in gpu_claim["status"]["allocation"]["devices"]["results"]] == [
        (DRIVER, "gpu-0")
    ]
    e2e_support.assert_invariant(cluster)


def _unschedulable(cluster, namespace: str, name: str) -> str:
    pod = cluster.pod(namespace, name) or {}
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return condition.get("message") or ""
    return ""


@pytest.mark.parametrize("how", ["allowMultipleAllocations", "shareID"])
def test_a_device_several_claims_may_hold_is_fenced_from_first_sight(tmp_path, how):
    """Consumable capacity (KEP-5075): a device published with allowMultipleAllocations, or allocated as a share,
    may go to other claims while this one holds it, so its allocation keeps it from nobody."""
    node = make_node(tmp_path, gpus=2)
    if how == "allowMultipleAllocations":
        node.cluster.slices[0]["spec"]["devices"][0]["allowMultipleAllocations"] = True
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("share", [0])
    if how == "shareID":
        result = node.cluster.claims[("team-a", "share")]["status"]["allocation"]["devices"]["results"][0]
        result["shareID"] = "0f9bb8b4-8d26-4a6c-9a2f-4b1e6c1c2f3a"
    agent.observe_pod("ADDED", pod)
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.fenced == FenceReason.NOT_HELD and "may be allocated to several claims at once" in td.not_held[0]
    assert node.fenced(0) and not node.fenced(1)
    agent.observe_pod("MODIFIED", node.finish(pod))
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules and node.violations.found == []
