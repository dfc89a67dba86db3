"""When a claim counts as released: only once no live pod holds it, whatever its deletionTimestamp says."""

from __future__ import annotations

import copy
import logging

import pytest
from agent_support import DRIVER, NODE, make_node, recorded
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation, ended_pod_entry
from scrubgate.sanitizer_agent.checkpoint import State

pytestmark = pytest.mark.timeout(60)


def test_a_claim_being_deleted_is_not_scrubbed_while_its_pod_runs(tmp_path):
    """The API server only forbids new reservations on a claim being deleted; the reserved pod keeps using
    the GPU. Scrubbing then would attest memory the tenant is still writing."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    node.cluster.delete_claim("team-a", "job")  # held by our finalizer: deletionTimestamp set, pod still runs
    agent.observe_pod("MODIFIED", node.cluster.pods[pod["metadata"]["uid"]])
    agent.resync()
    node.settle(agent)
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.ALLOCATED, "not released while the reserved pod runs"
    assert node.canary_present(0) and node.held(0) and not node.cluster.rules
    annotations = node.cluster.claims[("team-a", "job")]["metadata"].get("annotations") or {}
    assert names.ANNOTATION_ATTESTATION not in annotations

    agent.observe_pod("MODIFIED", node.finish(pod))  # the controller's deallocation waits for the attestation
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    assert ("team-a", "job") not in node.cluster.claims, "attested, finalizer removed, the deleted claim went"
    assert node.violations.found == []


def extended_resource_pod(node, name: str, devices: list[int]) -> tuple[dict, dict]:
    """A pod asking for `nvidia.com/gpu` (KEP-5004): the scheduler created and allocated its claim, reserved
    it for the pod and named it in `status.extendedResourceClaimStatus`; the pod has no `spec.resourceClaims`."""
    claim, pod = node.tenant(name, devices)
    stored = node.cluster.pods[pod["metadata"]["uid"]]
    del stored["spec"]["resourceClaims"]
    del stored["status"]["resourceClaimStatuses"]
    stored["status"]["extendedResourceClaimStatus"] = {
        "resourceClaimName": name,
        "requestMappings": [
            {"containerName": "main", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
        ],
    }
    return claim, copy.deepcopy(stored)


def test_an_extended_resource_claim_is_recorded_from_the_pod_event_and_scrubbed(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = extended_resource_pod(node, "pod-gpu-x7k2q", [1])
    agent.observe_pod("ADDED", pod)
    assert claim["metadata"]["uid"] in agent.store.teardowns, "found from the pod, not at the claim resync"
    assert recorded(node, "pod-gpu-x7k2q")[0]["device"] == node.device_names[1] and node.held(1)
    assert node.cluster.calls.count("list_node_claims") == 1, "only the list at start"

    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert node.clean(1) and not node.cluster.rules
    annotations = node.cluster.claims[("team-a", "pod-gpu-x7k2q")]["metadata"]["annotations"]
    assert names.ANNOTATION_ATTESTATION in annotations
    assert node.violations.found == []


def test_a_gpu_claim_without_the_finalizer_gets_it_and_a_warning(tmp_path):
    """A claim of class `h100-80gb` (selecting gpu.nvidia.com's devices) created while the webhook was not called
    (down under failurePolicy Ignore, say): no finalizer. The ResourceSlice says the device is a GPU, so the agent
    adds it, and the node label, and tells the operator what to check."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim = node.cluster.add_claim("team-a", "model", [node.key(0)], finalizer=False, labelled=False)
    node.cluster.claims[("team-a", "model")]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = (
        "h100-80gb"
    )
    pod = node.cluster.add_pod("team-a", "model-pod", NODE, ["model"])
    agent.observe_pod("ADDED", pod)
    stored = node.cluster.claims[("team-a", "model")]
    assert names.FINALIZER in stored["metadata"]["finalizers"]
    assert stored["metadata"]["labels"] == {names.LABEL_NODE: NODE}
    (event,) = [e for e in node.cluster.events if e["reason"] == "MissingScrubFinalizer"]
    assert event["type"] == "Warning"
    assert event["involvedObject"]["name"] == "model" and event["involvedObject"]["uid"] == claim["metadata"]["uid"]
    assert "h100-80gb" in event["message"] and "failurePolicy Ignore" in event["message"]
    agent.resync()
    assert len([e for e in node.cluster.events if e["reason"] == "MissingScrubFinalizer"]) == 1, "once"

    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert node.clean(0)
    after = node.cluster.claims[("team-a", "model")]
    assert names.ANNOTATION_ATTESTATION in after["metadata"]["annotations"]
    assert names.FINALIZER not in after["metadata"]["finalizers"], "removed again with the attestation"
    assert node.violations.found == []


def test_no_finalizer_is_added_to_a_claim_being_deleted(tmp_path):
    """The API server refuses new finalizers on an object being deleted: the agent does not try."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    node.cluster.add_claim("team-a", "going", [node.key(0)], finalizer=False)
    meta = node.cluster.claims[("team-a", "going")]["metadata"]
    meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    meta["finalizers"] = [names.DELETE_PROTECTION_FINALIZER]  # the resourceclaim controller's, held while allocated
    pod = node.cluster.add_pod("team-a", "going-pod", NODE, ["going"])
    agent.observe_pod("ADDED", pod)
    assert "going" in [td.claim.name for td in agent.store.teardowns.values()]
    assert node.cluster.claims[("team-a", "going")]["metadata"]["finalizers"] == [names.DELETE_PROTECTION_FINALIZER]
    assert not [e for e in node.cluster.events if e["reason"] == "MissingScrubFinalizer"]


def test_devices_the_agent_cannot_scrub_are_left_alone_and_said_once(tmp_path, caplog):
    """A GPU bound to vfio-pci (NVIDIA's `type: vfio`) and a ComputeDomain channel (another driver, no uuid): no
    fence that no scrub would ever lift, no teardown holding the claim; one log line per device."""
    node = make_node(tmp_path)
    node.cluster.add_slice(NODE, DRIVER, NODE, {"vfio-0": {"type": "vfio", "uuid": "GPU-vfio-0"}})
    node.cluster.add_slice(NODE, "compute-domain.nvidia.com", NODE, {"channel-0": {"type": "channel"}})
    agent = node.agent()
    agent.start()
    vfio, channel = (DRIVER, NODE, "vfio-0"), ("compute-domain.nvidia.com", NODE, "channel-0")
    claim = node.cluster.add_claim("team-a", "passthrough", [vfio, channel])
    pod = node.cluster.add_pod("team-a", "vm-pod", NODE, ["passthrough"])
    with caplog.at_level(logging.WARNING, logger="scrubgate.sanitizer_agent.agent"):
        agent.observe_pod("ADDED", pod)
        agent.observe_pod("MODIFIED", node.cluster.pods[pod["metadata"]["uid"]])
        agent.resync()
    assert claim["metadata"]["uid"] not in agent.store.teardowns
    assert not node.cluster.rules
    said = [r.getMessage() for r in caplog.records if "is not scrubbed or fenced" in r.getMessage()]
    assert len(said) == 2, said
    assert any("vfio-0" in m and "vfio-pci" in m for m in said)
    assert any("channel-0" in m and "compute-domain.nvidia.com" in m for m in said)


def test_the_attestation_and_the_finalizers_removal_are_one_update_of_the_claim(tmp_path):
    """The resourceclaim controller requeues a claim on any update of it, so its refused deallocation is retried
    right after the attestation lands, not at the end of its backoff (up to 1000 s): the attestation must be a
    write of the claim object itself (its annotations), not of a status or another object. The same write
    removes the finalizer: a second update right after it would fail the controller's deallocation with a
    conflict (it acts on the first), and put the claim back into its backoff."""
    node = make_node(tmp_path)
    writes: list[tuple[str, str, list[dict]]] = []
    monitor = node.cluster.hook

    def hook(operation, args):
        monitor(operation, args)
        if operation == "patch_claim":
            writes.append(args)

    node.cluster.hook = hook
    agent = node.agent()
    agent.start()
    node.job_ends(agent)
    node.settle(agent)
    key = "/metadata/annotations/" + names.ANNOTATION_ATTESTATION.replace("/", "~1")
    attesting = [(ns, name, ops) for ns, name, ops in writes if any(op["path"] == key for op in ops)]
    assert [(ns, name) for ns, name, _ in attesting] == [("team-a", "job")], "into the claim's own annotations"
    assert writes[-1][2] is attesting[0][2], "no write of the claim after it"
    assert any(op["path"] == "/metadata/finalizers" for op in attesting[0][2])
    claim = node.cluster.claims[("team-a", "job")]["metadata"]
    assert names.ANNOTATION_ATTESTATION in claim["annotations"] and names.FINALIZER not in claim["finalizers"]
    assert node.violations.found == []


def test_claims_that_never_held_a_device_are_left_to_the_controller(tmp_path):
    """kube-controller-manager deletes an ended pod's claim, makes a new one from the template (it does not check
    that the pod ended), names it in the pod's status and deletes it; a running pod's claim may be deleted before
    its allocation. Neither ever held a device: the agent writes nothing to them, neither at the pod's events
    nor at a resync; scrubgate's controller removes their finalizer (tests/test_controller.py)."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    pods = {}
    for name in ("job-2", "pending"):
        node.cluster.add_claim("team-a", name, [])
        del node.cluster.claims[("team-a", name)]["status"]["allocation"]
        node.cluster.delete_claim("team-a", name)  # deletionTimestamp set, held by our finalizer
        pods[name] = node.cluster.add_pod("team-a", f"{name}-pod", NODE, [name])
    agent.observe_pod("ADDED", pods["pending"])
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pods["job-2"]["metadata"]["uid"], "Succeeded"))
    agent.resync()
    assert "patch_claim" not in node.cluster.calls
    for name in ("job-2", "pending"):
        assert names.FINALIZER in node.cluster.claims[("team-a", name)]["metadata"]["finalizers"]
    assert agent.store.teardowns == {} and not node.cluster.rules


def test_a_pods_end_is_read_once_not_at_each_of_its_events(tmp_path):
    """A pod's end comes as several watch events (Succeeded, deletionTimestamp, DELETED): the claim is read for
    the first, which releases it; the others change nothing and cost no API call."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    reads = node.cluster.calls.count("get_claim")
    done = node.finish(pod, controller=False)
    agent.observe_pod("MODIFIED", done)
    assert node.cluster.calls.count("get_claim") == reads + 1
    deleting = copy.deepcopy(done)
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    agent.observe_pod("MODIFIED", deleting)
    agent.observe_pod("DELETED", node.cluster.delete_pod(pod["metadata"]["uid"]))
    assert node.cluster.calls.count("get_claim") == reads + 1, "no read for the end's later events"
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules


def test_a_claim_held_only_by_our_finalizer_shows_its_attestation_before_it_goes(tmp_path):
    """Deallocated behind the webhook's back and deleted, the claim is held by scrubgate's finalizer alone. One
    patch writing the attestation and removing that finalizer would delete the claim with an attestation no one
    ever saw: the attestation is written first, the finalizer removed after."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    writes: list[dict] = []
    monitor = node.cluster.hook

    def hook(operation, args):
        monitor(operation, args)
        if operation == "patch_claim":
            writes.append(copy.deepcopy(node.cluster.claims[("team-a", "job")]))

    node.cluster.hook = hook
    assert node.cluster.deallocate("team-a", "job", bypass=True)
    node.cluster.delete_claim("team-a", "job")
    assert node.cluster.claims[("team-a", "job")]["metadata"]["finalizers"] == [names.FINALIZER]
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert ("team-a", "job") not in node.cluster.claims and node.clean(0)
    attested = [w for w in writes if names.ANNOTATION_ATTESTATION in (w["metadata"].get("annotations") or {})]
    assert attested and names.FINALIZER in attested[0]["metadata"]["finalizers"], "stored with the attestation"
    assert node.violations.found == []


def test_a_claim_reserved_for_a_pod_group_is_released_once_the_group_is_gone(tmp_path):
    """A claim shared through a PodGroup (1.36 workload API; SG002 allows it in single-tenant namespaces) is
    reserved for the group, not its pods: its pods ending release nothing while the group exists; once the
    group is deleted the agent asks the API, tears the claim down, and its attestation names the group (which
    SG007 requires before the claim may go)."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("shared", [0])
    group_key = ("scheduling.k8s.io", "podgroups", "team-a", "trainers")
    node.cluster.consumers[group_key] = {"metadata": {"name": "trainers", "namespace": "team-a", "uid": "group-1"}}
    with node.cluster._lock:
        node.cluster.claims[("team-a", "shared")]["status"]["reservedFor"] = [
            {"resource": "podgroups", "apiGroup": "scheduling.k8s.io", "name": "trainers", "uid": "group-1"}
        ]
    agent.observe_pod("ADDED", pod)
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    agent.resync()
    node.settle(agent)
    (td,) = agent.store.teardowns.values()
    assert td.state == State.ALLOCATED and node.canary_present(0), "released while the group still holds it"

    del node.cluster.consumers[group_key]  # the group is deleted
    agent.resync()
    node.settle(agent)
    assert node.clean(0) and not agent.store.teardowns
    after = node.cluster.claims[("team-a", "shared")]
    assert names.FINALIZER not in after["metadata"]["finalizers"]
    payload = check_claim_attestation(
        after["metadata"]["annotations"][names.ANNOTATION_ATTESTATION], after, node.signer.public_keys
    )
    assert {"name": "trainers", "uid": "group-1"} in payload["consumers"]
    assert claim["metadata"]["uid"] == payload["claim"]["uid"]


def test_the_controller_drops_the_ended_pod_once_and_the_agent_releases_in_one_write(tmp_path):
    """Issue 29 item 2: the resourceclaim controller's drop of the ended pod leaves the webhook's record of it in its
    place, after which the controller has nothing to drop or reserve again; the agent's attested release takes the
    hold, the record and the allocation in one status write. Nothing is refused, so nothing is retried."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    assert node.cluster.requests()["patch_claim_status"] == 1, "the hold"
    agent.observe_pod("MODIFIED", node.finish(pod))
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    assert node.cluster.requests()["patch_claim_status"] == 2, "the hold, then the release with the allocation"
    assert ("team-a", "job") not in node.cluster.claims, "released, and deleted"
    assert node.cluster.refused_deallocations == 0
    assert node.violations.found == []


def test_a_record_of_a_pod_that_still_runs_does_not_release_the_claim(tmp_path):
    """The webhook's record of an ended pod is taken for that pod, not for its end: a status writer who put one in
    the place of a running pod's entry gets no scrub under the pod: the agent goes by what it knows of the pod (here: running), or asks the API."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    stored = node.cluster.claims[("team-a", "job")]
    stored["status"]["reservedFor"] = [
        ended_pod_entry(entry) if entry.get("resource") == "pods" else entry
        for entry in stored["status"]["reservedFor"]
    ]
    agent.observe_claim("MODIFIED", stored)
    agent.resync()
    node.settle(agent)
    (td,) = agent.store.teardowns.values()
    assert td.state == State.ALLOCATED, "released while its pod runs"
    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert node.clean(0), "released once the pod has ended"
