"""A GPU and its MIG slices share memory. With partitionable devices (dynamic MIG) the scheduler may hand
out the parent GPU once a slice's claim is released, or a slice once its GPU's claim is: so a teardown
fences the devices that share memory with its own, and lifts those fences only with its own, after a
verified scrub."""

from __future__ import annotations

import json
import threading

import pytest
from agent_support import (
    CANARY,
    DRIVER,
    NODE,
    CrashPlan,
    eventually,
    make_node,
    restart_and_finish,
    run_crashing,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kubernetes import client
from scrubgate.policies import names
from scrubgate.policies.attestation import verify
from scrubgate.sanitizer_agent import claims, rescrub
from scrubgate.sanitizer_agent.agent import Agent, AgentSettings
from scrubgate.sanitizer_agent.checkpoint import CheckpointStore, State
from scrubgate.sanitizer_agent.fences import SHARES_MEMORY_ANNOTATION
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.kube import KubernetesClusterClient
from scrubgate.sanitizer_agent.teardown import Signer, TeardownSettings

from devcluster.apiserver import ApiServer

GPU, SLICE, SIBLING = 0, 1, 2  # make_node(gpus=1, mig_per_gpu=2): gpu-0 and its slices mig-1, mig-2


def _release(node, agent, pod):
    """The pod completes; the resourceclaim controller deallocates its claim (the counters are free)."""
    agent.observe_pod("MODIFIED", node.finish(pod))


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
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2)
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
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2)
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
    agent.backend = agent.engine.backend = backend
    node.cluster.deallocate("team-a", "train")
    agent.resync()
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
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2)
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
    node = make_node(tmp_path, gpus=1, mig_per_gpu=2)
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
          State.UNFENCED, State.DONE]  # fmt: skip


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
def test_crash_after_each_transition_keeps_slice_and_parent_fenced(tmp_path, state):
    node = make_node(tmp_path, gpus=1, mig_per_gpu=1)
    assert run_crashing(node, CrashPlan(at_state=state), device=SLICE), f"never reached {state.value}"
    restart_and_finish(node, device=SLICE)


def test_crash_before_and_after_every_call_keeps_slice_and_parent_fenced(tmp_path):
    clean_run = CrashPlan()
    assert not run_crashing(make_node(tmp_path / "clean", gpus=1, mig_per_gpu=1), clean_run, device=SLICE)
    for event in range(1, clean_run.events + 1):
        node = make_node(tmp_path / str(event), gpus=1, mig_per_gpu=1)
        plan = CrashPlan(at_event=event)
        assert run_crashing(node, plan, device=SLICE)
        try:
            restart_and_finish(node, device=SLICE)
        except AssertionError as exc:
            raise AssertionError(f"after a crash {plan.where} (event {event}): {exc}") from exc


def test_restart_fences_what_a_checkpoint_without_overlaps_missed(tmp_path):
    """A teardown recorded before the slices said what shares its memory (or by an agent that did not
    look): the restarted agent fences the parent before anything else, and lifts it with the slice's."""
    node = make_node(tmp_path, gpus=1, mig_per_gpu=1)
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


# ---------------------------------------------------------------- the scheduler's view (devcluster)


@pytest.mark.timeout(60)
def test_scheduler_does_not_hand_out_the_parent_gpu_while_the_slice_is_dirty(tmp_path):
    """Real scheduler, resourceclaim controller, kubelet and NVIDIA-like driver (devcluster), the agent over
    HTTP: a tenant's MIG slice fails its scrub; its claim is deallocated, so the GPU's counters are free,
    yet a pod asking for a full GPU stays pending until the slice is verified clean."""
    root = tmp_path / "gpus"
    simulated.create_inventory(root, gpus=1, mig_per_gpu=1, memory_bytes=1 << 16)
    mig = next(d for d in simulated.SimulatedGpu(root).list_devices() if d.is_mig)
    checkpoint = tmp_path / "agent-checkpoint.json"
    with ApiServer(control_plane=True, nodes={NODE: root}).start() as server:
        api = client.ApiClient(client.Configuration(host=server.url))
        core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
        core.create_namespace({"metadata": {"name": "team-a"}})
        for template, device_class in (("one-mig", "mig.nvidia.com"), ("one-gpu", "gpu.nvidia.com")):
            resource.create_namespaced_resource_claim_template("team-a", {
                "metadata": {"name": template},
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": device_class}}]}}},
            })  # fmt: skip
        cluster = KubernetesClusterClient(api)
        agent = Agent(
            AgentSettings(
                node=NODE,
                nvidia_checkpoint=None,
                resync_s=0.2,
                rescrub_dir=rescrub.request_dir(checkpoint),
                teardown=TeardownSettings(max_attempts=1),  # a failure waits for the operator
            ),
            cluster=cluster,
            backend=simulated.SimulatedGpu(root),
            store=CheckpointStore(checkpoint, NODE),
            signer=Signer(Ed25519PrivateKey.generate(), "overlap-test"),
        )
        stop = threading.Event()
        runner = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        runner.start()

        def fences() -> dict[str, set[str]]:
            """device -> the taint keys DeviceTaintRules put on it"""
            found: dict[str, set[str]] = {}
            for rule in cluster._call("GET", "/apis/resource.k8s.io/v1/devicetaintrules")["items"]:
                found.setdefault(rule["spec"]["deviceSelector"]["device"], set()).add(rule["spec"]["taint"]["key"])
            return found

        try:
            eventually(lambda: agent.healthy()[0], "the agent's first tick")
            simulated.inject_fault(root, mig.uuid, "scrub_error", "CUDA_ERROR_ILLEGAL_ADDRESS")
            core.create_namespaced_pod("team-a", _pod("slice-tenant", "one-mig", {
                "devcluster.scrubgate.dev/canary": CANARY.decode(), "devcluster.scrubgate.dev/run-seconds": "1"}))  # fmt: skip
            eventually(lambda: "gpu-0" in fences(), "the fences")
            assert set(fences()) == {"gpu-0", "gpu-0-mig-0"}, "the slice and, for its memory, the GPU"
            eventually(lambda: names.TAINT_SCRUB_FAILED in fences().get("gpu-0-mig-0", set()), "the failed scrub")
            # No webhook here: the agent added the finalizer, which keeps the claim object (not its allocation).
            eventually(
                lambda: not [c for c in resource.list_namespaced_resource_claim("team-a").items if c.status.allocation],
                "the claim's deallocation",
            )
            assert CANARY in simulated.read(root, mig.uuid), "the slice is still dirty"

            core.create_namespaced_pod("team-a", _pod("gpu-tenant", "one-gpu", {}))
            eventually(lambda: "untainted" in _unschedulable(core, "gpu-tenant"), "the scheduler's verdict")
            assert "0 of 1 untainted, free 'gpu.nvidia.com' devices" in _unschedulable(core, "gpu-tenant")
            assert core.read_namespaced_pod("gpu-tenant", "team-a").spec.node_name is None

            simulated.clear_faults(root)
            rescrub.submit(checkpoint, mig.uuid)  # the operator, once the GPU is fixed
            eventually(lambda: core.read_namespaced_pod("gpu-tenant", "team-a").spec.node_name == NODE, "binding")
            assert simulated.read(root, mig.uuid).count(0) == simulated.memory_size(root, mig.uuid)
            (gpu_claim,) = [c for c in resource.list_namespaced_resource_claim("team-a").items if c.status.allocation]
            assert [(r.driver, r.device) for r in gpu_claim.status.allocation.devices.results] == [(DRIVER, "gpu-0")]
        finally:
            stop.set()
            runner.join(timeout=10)


def _pod(name: str, template: str, annotations: dict[str, str]) -> dict:
    return {
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        },
    }


def _unschedulable(core: client.CoreV1Api, name: str) -> str:
    pod = core.read_namespaced_pod(name, "team-a")
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
            return condition.message or ""
    return ""
