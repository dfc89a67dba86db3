"""The node agent's happy paths on the simulated backend: recorded on sight, kept from other claims by their own
allocations, torn down on release."""

from __future__ import annotations

import pytest
from agent_support import CANARY, NODE, Interceptor, claim_annotations, make_node, recorded
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation, verify
from scrubgate.sanitizer_agent.checkpoint import State
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.kube import ClusterError
from scrubgate.sanitizer_agent.teardown import TeardownSettings


@pytest.mark.parametrize("mig", [False, True], ids=["full-gpu", "mig-slice"])
def test_canary_written_by_a_tenant_is_gone_after_teardown(tmp_path, mig):
    node = make_node(tmp_path, gpus=2, mig_per_gpu=1 if mig else 0)
    target = 1 if mig else 0  # with MIG: [gpu, its slice, gpu, its slice]
    bystander = len(node.gpus) - 1
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("train", [target])
    simulated.fill(node.root, node.gpus[bystander].uuid, CANARY)  # another tenant's live data

    agent.observe_pod("ADDED", pod)
    assert not node.cluster.rules, "no fence: the claim's allocation keeps the device, and with MIG its GPU"
    assert node.guarded(target)
    annotations = claim_annotations(node, "train")
    assert annotations[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_FENCED
    assert recorded(node, "train") == [
        {"driver": "gpu.nvidia.com", "pool": NODE, "device": node.device_names[target], "uuid": node.gpus[target].uuid}
    ]

    node.finish(pod, controller=False)
    agent.observe_pod("MODIFIED", node.cluster.pods[pod["metadata"]["uid"]])

    assert node.clean(target) and not node.canary_present(target)
    assert node.canary_present(bystander), "only the claim's device is scrubbed"
    assert not node.cluster.rules, "fence lifted after the verified scrub"
    after = node.cluster.claims[("team-a", "train")]
    assert names.FINALIZER not in after["metadata"]["finalizers"]
    token = after["metadata"]["annotations"][names.ANNOTATION_ATTESTATION]
    payload = check_claim_attestation(token, after, node.signer.public_keys)
    assert payload["claim"] == {"namespace": "team-a", "name": "train", "uid": claim["metadata"]["uid"]}
    assert payload["node"] == NODE
    assert payload["devices"][0]["uuid"] == node.gpus[target].uuid
    assert payload["devices"][0]["bytesScrubbed"] == simulated.memory_size(node.root, node.gpus[target].uuid)
    # Coverage stated: the driver's reserve, and nothing out of the scrub's reach.
    assert payload["devices"][0]["bytesReserved"] == node.gpus[target].memory_reserved
    assert payload["devices"][0]["bytesUnreachable"] == 0
    # Beyond the scrub's reach, stated: the simulated driver does not zero freed memory; ECC is on.
    assert (payload["devices"][0]["scrubOnFree"], payload["devices"][0]["eccEnabled"]) == (False, True)
    assert payload["health"] == {"eccUncorrectable": 0, "remapPending": False, "xids": []}
    assert after["metadata"]["annotations"][names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_VERIFIED
    assert agent.store.teardowns == {}
    assert node.violations.found == []


@pytest.mark.parametrize(
    "release", ["pod-succeeded", "pod-deleted", "deallocated-bypassing-the-guard", "claim-deleted"]
)
def test_each_kind_of_release_starts_the_teardown(tmp_path, release):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    uid = pod["metadata"]["uid"]
    if release == "pod-succeeded":
        agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(uid, "Succeeded"))
    elif release == "pod-deleted":
        agent.observe_pod("DELETED", node.cluster.delete_pod(uid))
    elif release == "deallocated-bypassing-the-guard":
        assert node.cluster.deallocate("team-a", "job", bypass=True)
        agent.resync()
        # Fenced as soon as the agent saw the allocation gone (then scrubbed: the agent runs every step here).
        assert node.cluster.calls.count("create_device_taint_rule") == 1
        (event,) = [e for e in node.cluster.events if e["reason"] == "UnattestedDeallocation"]
        assert "lost its allocation before the scrub of gpu.nvidia.com/gpu-node-1/gpu-0" in event["message"]
        assert agent.metrics.unattested_deallocations._value.get() == 1
    else:
        # Deleted, and no longer reserved: the pod went without the agent seeing it (deletion alone releases
        # nothing while a reserved pod runs: test_agent_release.py). The controller's deallocation waits.
        node.cluster.delete_claim("team-a", "job")
        node.cluster.pods.pop(uid)
        node.cluster.claims[("team-a", "job")]["status"]["reservedFor"] = []
        assert not node.cluster.deallocate("team-a", "job")
        agent.resync()
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    if release == "claim-deleted":
        assert ("team-a", "job") not in node.cluster.claims, "held, then deallocated and deleted after the attestation"
    if release != "deallocated-bypassing-the-guard":
        assert not [e for e in node.cluster.events if e["reason"] == "UnattestedDeallocation"]
    assert node.violations.found == []


def test_claim_still_reserved_by_a_running_pod_is_not_released(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("shared", [0])
    other = node.cluster.add_pod("team-a", "second", NODE, ["shared"])
    agent.observe_pod("ADDED", pod)
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    agent.resync()
    assert agent.store.teardowns[claim["metadata"]["uid"]].state == State.ALLOCATED
    assert node.held(0) and not node.cluster.rules and node.canary_present(0)
    agent.observe_pod("DELETED", node.cluster.delete_pod(other["metadata"]["uid"]))
    assert node.clean(0) and not node.cluster.rules


def test_device_shared_by_two_claims_waits_for_both(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    first, pod_a = node.tenant("a", [0])
    node.cluster.add_claim("team-a", "b", [node.key(0)])
    pod_b = node.cluster.add_pod("team-a", "b-pod", NODE, ["b"])
    agent.observe_pod("ADDED", pod_a)
    agent.observe_pod("ADDED", pod_b)
    assert len(agent.store.teardowns) == 2 and not node.cluster.rules
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod_a["metadata"]["uid"], "Succeeded"))
    node.settle(agent)
    assert agent.store.teardowns[first["metadata"]["uid"]].state == State.RELEASED, "not drained under claim b"
    assert node.canary_present(0) and node.held(0)
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod_b["metadata"]["uid"], "Succeeded"))
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules and agent.store.teardowns == {}
    assert node.violations.found == []


def test_drain_waits_for_processes_to_exit(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    simulated.attach(node.root, node.gpus[0].uuid, pid=4_000_000)  # exits only when we say
    simulated.inject_fault(node.root, node.gpus[0].uuid, "linger")
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.DRAINING and node.held(0) and node.canary_present(0)
    assert claim_annotations(node, "job")[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_DRAINING
    simulated.clear_faults(node.root)
    simulated.detach(node.root, node.gpus[0].uuid, pid=4_000_000)
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules


def test_allocation_seen_after_release_is_still_scrubbed_from_the_devices_annotation(tmp_path):
    """The agent was away while the pod ran and finished: the claim is deallocated, but the agent's
    devices annotation (written at first sight by its previous run) says what it held."""
    node = make_node(tmp_path)
    _, pod = node.tenant("job", [0])
    first = node.agent()
    first.start()
    node.checkpoint.unlink()  # the checkpoint was lost with the node's disk
    node.finish(pod)
    agent = node.agent()
    agent.start()
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    assert ("team-a", "job") not in node.cluster.claims
    assert node.violations.found == []


def test_attestation_header_names_the_configured_key(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0, 1])
    agent.observe_pod("ADDED", pod)
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    token = claim_annotations(node, "job")[names.ANNOTATION_ATTESTATION]
    payload = verify(token, node.signer.public_keys)
    assert sorted(d["device"] for d in payload["devices"]) == ["gpu-0", "gpu-1"]
    assert all(d["verified"] for d in payload["devices"])
    assert node.clean(0) and node.clean(1)


def test_a_claim_that_also_holds_another_drivers_device_is_released_on_the_gpus_attestation(tmp_path):
    """A NIC in the same claim is not the agent's to scrub: the attestation covers the GPU, and the finalizer
    goes (the webhook does not ask for the NIC either)."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    claim = node.cluster.claims[("team-a", "job")]
    claim["spec"]["devices"]["requests"].append({"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}})
    nic = {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "nic-0"}
    claim["status"]["allocation"]["devices"]["results"].append(nic)
    agent.observe_pod("ADDED", pod)
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    after = node.cluster.claims[("team-a", "job")]
    assert node.clean(0) and names.FINALIZER not in after["metadata"]["finalizers"]
    assert not [e for e in node.cluster.events if e["reason"] == "AttestationMismatch"]
    assert node.violations.found == []


def test_the_record_of_an_allocation_waits_until_it_has_lasted_a_while(tmp_path):
    """Each claim write also wakes the resourceclaim controller: a claim released within `record_after_s` of
    first sight gets the record of its devices with its attestation, in one write; one that lasts gets it then."""
    node = make_node(tmp_path)
    node.settings = TeardownSettings(drain_timeout_s=5.0, record_after_s=2.0)
    agent = node.agent()
    agent.start()
    _, short = node.tenant("short", [0])
    _, long = node.tenant("long", [1])
    agent.observe_pod("ADDED", short)
    agent.observe_pod("ADDED", long)
    agent.tick()
    assert names.ANNOTATION_DEVICES not in claim_annotations(node, "short")
    assert names.ANNOTATION_DEVICES not in claim_annotations(node, "long")
    patches = node.cluster.calls.count("patch_claim")

    agent.observe_pod("MODIFIED", node.finish(short, controller=False))
    node.settle(agent)
    assert node.cluster.calls.count("patch_claim") == patches + 1, "the record and the attestation in one write"
    assert recorded(node, "short")[0]["device"] == node.device_names[0]

    node.clock.advance(2.0)
    assert agent.tick() == pytest.approx(agent.settings.resync_s, abs=1), "nothing due but the resync"
    assert claim_annotations(node, "long")[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_FENCED
    assert recorded(node, "long")[0]["device"] == node.device_names[1]
    assert node.violations.found == []


def test_a_record_the_api_server_refuses_is_tried_again_after_a_backoff_not_at_every_tick(tmp_path):
    """The record of an allocation that lasts is a claim write like any other: where it fails, its step backs off
    (as every API error does) instead of being tried again at each tick of the loop, which would send the API
    server a PATCH per tick for as long as the error lasts. Its release is not held up once the backoff is over."""
    node = make_node(tmp_path)
    node.settings = TeardownSettings(drain_timeout_s=5.0, record_after_s=2.0)
    refusing = True
    attempts = 0

    def on_call(name: str, phase: str) -> None:
        nonlocal attempts
        if name == "patch_claim" and phase == "before":
            attempts += 1
            if refusing:
                raise ClusterError("etcdserver: request timed out", 500)

    agent = node.agent(cluster=Interceptor(node.cluster, on_call))
    agent.start()
    _, pod = node.tenant("long", [0])
    agent.observe_pod("ADDED", pod)
    agent.tick()
    node.clock.advance(2.0)
    waits = [agent.tick() for _ in range(5)]
    assert attempts == 1, "one refused write, then the backoff"
    # the fake clock runs with the wall clock: a busy machine spends some of the backoff between the ticks
    assert waits[-1] == pytest.approx(agent.settings.api_backoff_s, abs=0.5), "the loop wakes when the backoff ends"
    assert names.ANNOTATION_SCRUB_STATUS not in claim_annotations(node, "long")

    refusing = False
    node.clock.advance(waits[-1])
    agent.tick()
    assert attempts == 2 and claim_annotations(node, "long")[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_FENCED
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert names.ANNOTATION_ATTESTATION in claim_annotations(node, "long") and node.clean(0)
    assert node.violations.found == []


def test_the_node_label_goes_with_the_first_annotation_write(tmp_path):
    """The agent lists and watches its claims by their node label: it writes the label with the record of an
    allocation that lasts, or with the attestation of one released sooner, never in a claim write of its own."""
    node = make_node(tmp_path)
    node.settings = TeardownSettings(drain_timeout_s=5.0, record_after_s=2.0)
    agent = node.agent()
    agent.start()

    def label(name: str) -> str | None:
        return (node.cluster.claims[("team-a", name)]["metadata"].get("labels") or {}).get(names.LABEL_NODE)

    pods = {}
    for name, i in (("short", 0), ("long", 1)):
        node.cluster.add_claim("team-a", name, [node.key(i)], labelled=False)
        pods[name] = node.cluster.add_pod("team-a", f"{name}-pod", NODE, [name])
        agent.observe_pod("ADDED", pods[name])
    agent.tick()
    assert {td.claim.name for td in agent.store.teardowns.values()} == {"short", "long"}
    assert node.cluster.calls.count("patch_claim") == 0 and label("short") is None and label("long") is None

    agent.observe_pod("MODIFIED", node.finish(pods["short"], controller=False))
    node.settle(agent)
    assert node.cluster.calls.count("patch_claim") == 1, "the attestation, the record and the label in one write"
    assert label("short") == NODE and names.ANNOTATION_ATTESTATION in claim_annotations(node, "short")

    node.clock.advance(2.0)
    agent.tick()
    assert node.cluster.calls.count("patch_claim") == 2, "the record and the label in one write"
    assert (
        label("long") == NODE and claim_annotations(node, "long")[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_FENCED
    )
    assert node.violations.found == []


def test_a_resync_reads_no_claim_the_agent_follows_before_labelling_it(tmp_path):
    """The node's list shows only labelled claims: one the agent follows but has not labelled yet stays in its view,
    so a resync's look at it reads nothing (no quorum GET per claim per resync), and its release still rests on a
    read of the claim as it is now."""
    node = make_node(tmp_path)
    node.settings = TeardownSettings(drain_timeout_s=5.0, record_after_s=60.0)
    agent = node.agent()
    agent.start()
    node.cluster.add_claim("team-a", "job", [node.key(0)], labelled=False)
    pod = node.cluster.add_pod("team-a", "job-pod", NODE, ["job"])
    agent.observe_pod("ADDED", pod)
    agent.tick()
    reads = node.cluster.calls.count("get_claim")
    for _ in range(3):
        agent.resync()
        agent.tick()
    assert node.cluster.calls.count("get_claim") == reads
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert node.cluster.calls.count("get_claim") == reads + 1, "the release, decided on a read of the claim"
    assert names.ANNOTATION_ATTESTATION in claim_annotations(node, "job") and node.clean(0)
    assert node.violations.found == []


def test_the_oldest_release_still_under_way_is_exported(tmp_path):
    """scrubgate_agent_oldest_release_seconds: a long job is not a stuck teardown (0 while the claim is
    allocated, fenced or not); a teardown that does not end after its release is, and the gauge says how long."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()

    def oldest() -> float:
        return agent.metrics.registry.get_sample_value("scrubgate_agent_oldest_release_seconds")

    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    node.clock.advance(86_400.0)
    assert oldest() == 0.0
    simulated.attach(node.root, node.gpus[0].uuid, pid=4_000_001)
    simulated.inject_fault(node.root, node.gpus[0].uuid, "linger")
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    node.clock.advance(900.0)
    assert oldest() == pytest.approx(900.0, abs=1.0)
    simulated.clear_faults(node.root)
    simulated.detach(node.root, node.gpus[0].uuid, pid=4_000_001)
    node.settle(agent)
    assert oldest() == 0.0 and node.clean(0)
