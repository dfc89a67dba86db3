"""Dynamic MIG: NVIDIA's driver publishes every MIG placement as a partitionable device consuming memory-slice
counters, creates the MIG device on prepare and deletes it on unprepare. The agent fences every device that
shares the released memory slices and scrubs the placement itself, through a GPU instance it creates there."""

from __future__ import annotations

import json

from agent_support import CANARY, DRIVER, NODE, make_node
from memcluster import InMemoryCluster
from scrubgate.policies import names
from scrubgate.policies.attestation import verify
from scrubgate.sanitizer_agent import claims
from scrubgate.sanitizer_agent.checkpoint import State
from scrubgate.sanitizer_agent.gpu import MigPlacement, simulated

COUNTERS = "gpu-0-counter-set"
FULL, ONE_G_AT_0, TWO_G_AT_0, ONE_G_AT_1, ONE_G_AT_4 = (
    "gpu-0",
    "gpu-0-mig-1g10gb-19-0",
    "gpu-0-mig-2g20gb-15-0",
    "gpu-0-mig-1g10gb-19-1",
    "gpu-0-mig-1g10gb-19-4",
)


def nvidia_slice(gpu_uuid: str) -> dict:
    """A ResourceSlice as k8s-dra-driver-gpu publishes one GPU with dynamic MIG (v1 shape): the devices'
    attributes, then the counters they consume from the GPU's shared counter set."""
    mig = {"type": "mig", "parentUUID": gpu_uuid, "profile": "1g.10gb"}
    consumed = {
        FULL: range(8),
        ONE_G_AT_0: range(0, 1),
        TWO_G_AT_0: range(0, 2),
        ONE_G_AT_1: range(1, 2),
        ONE_G_AT_4: range(4, 5),
    }
    cluster = InMemoryCluster()
    cluster.add_slice(NODE, DRIVER, NODE, {n: {"uuid": gpu_uuid} if n == FULL else mig for n in consumed})
    (published,) = cluster.slices
    spec = published["spec"]
    spec["sharedCounters"] = [{"name": COUNTERS, "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}]
    for device in spec["devices"]:
        counters = {f"memory-slice-{i}": {"value": "1"} for i in consumed[device["name"]]}
        device["consumesCounters"] = [
            {"counterSet": COUNTERS, "counters": {"multiprocessors": {"value": "16"}, **counters}}
        ]
    return published


def key(name: str) -> tuple[str, str, str]:
    return (DRIVER, NODE, name)


def partitioned_node(tmp_path, dirty_slices: range = range(0, 0)):
    """One simulated GPU published as NVIDIA's driver does with dynamic MIG. The invariant monitor: no
    fence is deleted while a memory slice in `dirty_slices` still holds the tenant's bytes."""
    node = make_node(tmp_path, gpus=1)
    gpu = node.gpus[0].uuid
    node.cluster.slices[:] = [nvidia_slice(gpu)]
    step = simulated.memory_size(node.root, gpu) // simulated.MEMORY_SLICES

    def check(operation, args):
        if operation == "delete_device_taint_rule":
            memory = simulated.read(node.root, gpu)
            dirty = [i for i in dirty_slices if memory[i * step : (i + 1) * step].count(0) != step]
            if dirty:
                node.violations.found.append(f"fence {args[1]} deleted while memory slices {dirty} are dirty")

    node.cluster.hook = check
    return node, gpu, step


def running_claim(node, device: str):
    """An agent that saw a claim on `device` allocated and its pod running: (agent, claim, pod)."""
    agent = node.agent()
    agent.start()
    claim = node.cluster.add_claim("team-a", "train", [key(device)])
    pod = node.cluster.add_pod("team-a", "train-pod", NODE, ["train"])
    return agent, claim, pod


def test_partitionable_devices_overlap_through_shared_memory_slices():
    found = claims.slice_devices([nvidia_slice("GPU-A")])
    assert found[key(ONE_G_AT_0)].placement == MigPlacement("GPU-A", 19, 0, 1)
    assert found[key(TWO_G_AT_0)].placement == MigPlacement("GPU-A", 15, 0, 2)
    assert found[key(FULL)].placement is None, "the full GPU has a uuid and is scrubbed whole"
    assert set(claims.overlapping(key(ONE_G_AT_0), found)) == {key(FULL), key(TWO_G_AT_0)}
    assert set(claims.overlapping(key(TWO_G_AT_0), found)) == {key(FULL), key(ONE_G_AT_0), key(ONE_G_AT_1)}
    assert set(claims.overlapping(key(ONE_G_AT_4), found)) == {key(FULL)}
    assert set(claims.overlapping(key(FULL), found)) == {
        key(n) for n in (ONE_G_AT_0, TWO_G_AT_0, ONE_G_AT_1, ONE_G_AT_4)
    }


def test_a_device_off_the_drivers_naming_or_layout_gets_no_placement():
    spec = nvidia_slice("GPU-A")
    spec["spec"]["devices"][1]["name"] = "gpu-0-mig-1g10gb-19-3"  # name says start 3, counters say slice 0
    found = claims.slice_devices([spec])
    assert found[key("gpu-0-mig-1g10gb-19-3")].placement is None, "no guess: the scrub then fails closed"


def test_released_dynamic_mig_device_is_scrubbed_through_its_placement_its_overlaps_held_by_the_counters(tmp_path):
    node, gpu, slice_bytes = partitioned_node(tmp_path, dirty_slices=range(0, 1))
    agent, claim, pod = running_claim(node, ONE_G_AT_0)
    # The tenant wrote into memory slice 0 (the first eighth of the simulated GPU); slice 4 holds another's.
    simulated.write(node.root, gpu, 0, CANARY * (slice_bytes // len(CANARY)))
    simulated.write(node.root, gpu, 4 * slice_bytes, CANARY)
    agent.observe_pod("ADDED", pod)

    on_disk = json.loads(node.checkpoint.read_text())["teardowns"][claim["metadata"]["uid"]]
    assert on_disk["devices"][0]["placement"] == {"parent_uuid": gpu, "profile_id": 19, "start": 0, "size": 1}
    assert {o["device"] for o in on_disk["overlaps"]} == {TWO_G_AT_0, FULL}, "every device consuming memory slice 0"
    assert on_disk["not_held"] == [] and not node.cluster.rules, "all of them consume the allocation's counter"

    agent.observe_pod("MODIFIED", node.finish(pod))  # unprepare has deleted the MIG device by now
    node.settle(agent)

    memory = simulated.read(node.root, gpu)
    assert memory[:slice_bytes].count(0) == slice_bytes, "memory slice 0 zeroed and verified"
    assert CANARY in memory[4 * slice_bytes : 5 * slice_bytes], "another placement's memory is not touched"
    assert node.cluster.calls.count("create_device_taint_rule") == 0
    assert agent.store.teardowns == {} and node.violations.found == []


def test_a_failed_placement_scrub_keeps_every_overlapping_device_fenced(tmp_path):
    node, gpu, _ = partitioned_node(tmp_path)
    agent, claim, pod = running_claim(node, TWO_G_AT_0)
    agent.observe_pod("ADDED", pod)
    simulated.inject_fault(node.root, gpu, "scrub_error", "GPU instance creation refused")
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)

    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.FAILED and "GPU instance creation refused" in (td.reason or "")
    fenced = {r["spec"]["deviceSelector"]["device"] for r in node.cluster.rules.values()}
    assert {FULL, ONE_G_AT_0, TWO_G_AT_0, ONE_G_AT_1} <= fenced
    assert ONE_G_AT_4 not in fenced


def test_the_attestation_of_a_placement_scrub_verifies(tmp_path):
    node, _, _ = partitioned_node(tmp_path)
    agent, claim, pod = running_claim(node, ONE_G_AT_4)
    agent.observe_pod("ADDED", pod)
    attested: list[str] = []
    agent.engine.on_transition = lambda td, state: (
        attested.append(td.attestation or "") if state == State.ATTESTED else None
    )
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    payload = verify(attested[-1], node.signer.public_keys)
    (device,) = payload["devices"]
    assert (device["device"], device["verified"]) == (ONE_G_AT_4, True)
    assert claim["metadata"]["uid"] == payload["claim"]["uid"]
    assert names.TAINT_UNSANITIZED not in node.cluster.taints_on(*key(FULL))
