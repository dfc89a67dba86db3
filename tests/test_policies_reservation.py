"""A used GPU claim never looks unused (issue 28 item 3), and a node agent's writes reach its own node only (item 4).

The node agent holds a claim a pod of it may have used with a consumer of its own in `status.reservedFor`
(`scrubgate.dev/nodeagents`), which Kubernetes' resourceclaim controller keeps (it keeps consumers it does not know:
pkg/controller/resourceclaim/controller.go, syncClaim) and kube-scheduler's PostFilter respects (it deallocates only
a claim reserved for nobody or the pod at hand). SG007 guards the hold; the attestation is bound to it.
"""

from __future__ import annotations

import copy
from typing import Any

from scrubgate.policies import names
from test_policies_deallocation import (
    SCHEDULER,
    allocated,
    attested,
    deallocated,
    status_update,
)

CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
AGENT = "system:serviceaccount:scrubgate-system:scrubgate-agent"
POD = {"resource": "pods", "name": "p1", "uid": "pod-1"}
PENDING = {"resource": "pods", "name": "p2", "uid": "pod-2"}
ENDED = {"apiGroup": names.RESERVATION_GROUP, "resource": names.ENDED_POD_RESOURCE, "name": "p1", "uid": "pod-1"}


def hold(node: str = "node-a", uid: str = "hold-1") -> dict[str, str]:
    return {"apiGroup": names.RESERVATION_GROUP, "resource": names.RESERVATION_RESOURCE, "name": node, "uid": uid}


def reserved(claim: dict[str, Any], *consumers: dict[str, str]) -> dict[str, Any]:
    new = copy.deepcopy(claim)
    new["status"]["reservedFor"] = [dict(c) for c in consumers]
    return new


def agent_update(old, new, node="node-a"):
    from scrubgate.policies.engine import Admission, validate
    from test_policies_deallocation import NVIDIA_CLASSES, POLICY

    admission = Admission("UPDATE", AGENT, ("system:serviceaccounts",), old_object=old, subresource="status", node=node)
    return validate(new, POLICY, trusted=False, admission=admission, classes=NVIDIA_CLASSES)


def test_only_the_agent_of_the_claims_node_adds_its_hold():
    old = reserved(allocated(recorded=False), POD)
    assert agent_update(old, reserved(old, POD, hold())) == []
    (finding,) = agent_update(old, reserved(old, POD, hold("node-b")), node="node-b")
    assert "the agent of node 'node-b' acted on claim" in finding.message
    (finding,) = agent_update(old, reserved(old, POD, hold("node-b")))
    assert "added a hold named for node 'node-b'" in finding.message
    (finding,) = status_update(old, reserved(old, POD, hold()), "mallory")
    assert finding.path == "/status/reservedFor" and "only scrubgate's node agent holds a claim" in finding.message


def test_the_controller_drops_ended_pods_from_a_held_claim_and_never_deallocates_it():
    """Upstream's controller writes the remaining consumers (here the hold) and keeps the allocation: no refusal,
    no retry."""
    old = reserved(allocated(recorded=False), POD, hold())
    assert status_update(old, reserved(old, hold()), CONTROLLER) == []


def test_the_shared_claim_hole_is_closed():
    """A shared claim whose first pod ran and ended while a second pod's binding failed: the controller drops
    the first, the scheduler's Unreserve the second, and PostFilter then clears the allocation as one it never
    used. Unheld, the controller's write is refused; held, the scheduler's deallocation is."""
    claim = reserved(allocated(recorded=False), POD, PENDING)
    (finding,) = status_update(claim, reserved(claim, PENDING), CONTROLLER)
    assert "removed pod(s) p1" in finding.message
    held = reserved(claim, POD, PENDING, hold())
    assert status_update(held, reserved(held, PENDING, hold()), CONTROLLER) == []
    assert status_update(held, reserved(held, hold()), SCHEDULER) == []  # Unreserve of the pod never bound
    only_hold = reserved(held, hold())
    gone = deallocated(only_hold)
    gone["status"]["reservedFor"] = []
    (finding,) = [f for f in status_update(only_hold, gone, SCHEDULER) if f.path == "/status/allocation"]
    assert "cleared the allocation" in finding.message


def test_the_hold_goes_only_with_an_attestation_bound_to_it():
    identity = {"reservation": "hold-1", "allocatedAt": None}
    claim = reserved(allocated(recorded=False, annotations=attested(allocation=identity)), hold())
    released = deallocated(claim)
    released["status"]["reservedFor"] = []
    assert agent_update(claim, released) == []
    # Another hold (the claim was allocated again, and held anew): the old attestation covers nothing of it.
    again = reserved(claim, hold(uid="hold-2"))
    problems = [f.message for f in agent_update(again, released)]
    assert problems and all("the claim was allocated again since its scrub" in m for m in problems)
    unattested = reserved(allocated(recorded=False), hold())
    (finding,) = [f for f in status_update(unattested, reserved(unattested), CONTROLLER) if "hold" in f.message]
    assert "made a release of node node-a's hold" in finding.message


def test_an_attestation_is_bound_to_the_allocation_timestamp():
    claim = allocated(annotations=attested(allocation={"reservation": None, "allocatedAt": "2026-12-04T10:00:00Z"}))
    claim["status"]["allocation"]["allocationTimestamp"] = "2026-12-04T10:00:00Z"
    assert status_update(claim, deallocated(claim), CONTROLLER) == []
    claim["status"]["allocation"]["allocationTimestamp"] = "2026-12-04T11:00:00Z"
    (finding,) = status_update(claim, deallocated(claim), CONTROLLER)
    assert "allocated again since its scrub" in finding.message


def test_an_agent_writes_no_record_on_a_claim_that_is_on_no_node():
    """A pending claim (not allocated, no record) is on no node: no agent's to annotate."""
    from scrubgate.policies.engine import Admission, validate
    from test_policies_deallocation import POLICY

    pending = allocated(recorded=False)
    del pending["status"]
    marked = copy.deepcopy(pending)
    marked["metadata"].setdefault("annotations", {})[names.ANNOTATION_SCRUB_STATUS] = "fenced"
    admission = Admission("UPDATE", AGENT, (), old_object=pending, node="node-a")
    (finding,) = validate(marked, POLICY, trusted=False, admission=admission)
    assert "which is on no node" in finding.message


def test_while_held_the_controllers_drop_of_an_ended_pod_leaves_a_record_of_it():
    """Upstream's resourceclaim controller drops an ended pod (syncClaim) and reserves the still-allocated claim for
    any bound pod not being deleted whose UID no entry of the reservation carries (syncPod, IsReservedForPod): while
    the agent holds the claim, a plain drop would make the two take turns. /mutate puts scrubgate's record of the
    pod (its name and UID) in its place: the claim still looks used, the controller keeps the record (a consumer it
    does not know) and finds nothing more to drop or reserve, and the record leaves with the attested release."""
    import jsonpatch
    from scrubgate.policies.engine import Admission, default
    from test_policies_deallocation import POLICY

    held = reserved(allocated(recorded=False), POD, hold())
    dropped = reserved(held, hold())
    admission = Admission("UPDATE", CONTROLLER, (), old_object=held, subresource="status")
    (finding,) = default(dropped, POLICY, "UPDATE", admission)
    assert finding.rule == "SG007" and "p1" in finding.message
    recorded = jsonpatch.apply_patch(dropped, list(finding.patch))
    assert recorded["status"]["reservedFor"] == [ENDED, hold()], "in the pod's place"
    (again,) = default(recorded, POLICY, "UPDATE", admission)  # reinvoked after another webhook's change
    assert jsonpatch.apply_patch(recorded, list(again.patch)) == recorded, "no record twice"
    assert status_update(held, recorded, CONTROLLER) == [], "SG007 lets the record stand for the pod"
    # The record is the controller's to keep: its next write changes nothing, and nothing is dropped any more.
    assert default(recorded, POLICY, "UPDATE", admission_for(recorded)) == []
    scheduler = Admission("UPDATE", SCHEDULER, (), old_object=held, subresource="status")
    assert default(dropped, POLICY, "UPDATE", scheduler) == [], "Unreserve: a pod that never ran"
    released = reserved(held, POD)
    assert default(released, POLICY, "UPDATE", admission) == [], "the hold itself released: nothing kept"
    unheld = reserved(allocated(recorded=False), POD)
    assert (
        default(
            reserved(unheld),
            POLICY,
            "UPDATE",
            Admission("UPDATE", CONTROLLER, (), old_object=unheld, subresource="status"),
        )
        == []
    )


def test_a_record_of_an_ended_pod_stands_only_for_that_pod_and_goes_only_with_the_attestation():
    held = reserved(allocated(recorded=False), POD, hold())
    # Not in the place of that pod's own entry: it would keep the controller from reserving the claim for the pod.
    (finding,) = status_update(held, reserved(held, POD, hold(), {**ENDED, "uid": "pod-9"}), CONTROLLER)
    assert finding.path == "/status/reservedFor" and "record of ended pod p1 (pod-9)" in finding.message
    # Taken out before the attestation: refused, as the hold's release is.
    recorded = reserved(held, ENDED, hold())
    refusals = status_update(recorded, reserved(recorded, hold()), CONTROLLER)
    assert [f.rule for f in refusals] == ["SG007"] and "record(s) of ended pod(s) p1" in refusals[0].message


def test_on_a_claim_being_deleted_the_controllers_drop_goes_through_and_the_hold_keeps_it_used():
    """A pod's claim is deleted with its pod (the garbage collector): the API server then takes no new consumer on
    it, so the controller cannot reserve it again, and the drop is let through. The hold alone keeps the claim
    used and allocated, SG007 lets the write pass, and the controller has nothing left to drop: at rest until the
    agent's attested release. Before the attestation, the allocation still goes with nobody's write but the
    agent's."""
    from scrubgate.policies.engine import Admission, default
    from test_policies_deallocation import NVIDIA_CLASSES, POLICY

    finalizers = (names.FINALIZER, names.DELETE_PROTECTION_FINALIZER)
    held = reserved(allocated(recorded=False, finalizers=finalizers), POD, hold())
    held["metadata"]["deletionTimestamp"] = "2026-12-05T19:00:00Z"
    dropped = reserved(held, hold())
    admission = Admission("UPDATE", CONTROLLER, (), old_object=held, subresource="status")
    assert default(dropped, POLICY, "UPDATE", admission, NVIDIA_CLASSES) == []
    assert status_update(held, dropped, CONTROLLER) == [], "the hold stays: the claim still looks used"
    unattested = reserved(held)
    del unattested["status"]["allocation"]
    refusals = status_update(held, unattested, CONTROLLER)
    assert {f.rule for f in refusals} == {"SG007"}
    assert {f.path for f in refusals} == {"/status/allocation", "/status/reservedFor"}


def test_with_the_attestation_on_it_the_controllers_drop_of_the_ended_pods_is_the_release():
    """Issue 29 item 2: once the agent's attestation of this allocation is on a held claim, the controller's next
    drop of its ended pods is made the release it would have made without the hold (holds and pods out, the
    allocation cleared where its delete-protection finalizer is on), in the controller's own write: the agent
    writes nothing more, and no write of the agent's races the controller's. That write then passes SG007."""
    import jsonpatch
    from scrubgate.policies.engine import Admission, default
    from test_policies_deallocation import NVIDIA_CLASSES, POLICY

    identity = {"reservation": "hold-1", "allocatedAt": None}
    finalizers = (names.FINALIZER, names.DELETE_PROTECTION_FINALIZER)
    attestation = attested(allocation=identity, consumers=[("p1", "pod-1")])
    claim = allocated(recorded=False, finalizers=finalizers, annotations=attestation)
    held = reserved(claim, POD, hold())
    admission = Admission("UPDATE", CONTROLLER, (), old_object=held, subresource="status")
    (finding,) = default(reserved(held, hold()), POLICY, "UPDATE", admission, NVIDIA_CLASSES)
    assert finding.rule == "SG007" and "released with the attestation" in finding.message
    released = jsonpatch.apply_patch(reserved(held, hold()), list(finding.patch))
    assert released["status"]["reservedFor"] == [] and "allocation" not in released["status"]
    assert status_update(held, released, CONTROLLER) == [], "SG007 lets the attested release through"

    # Without delete-protection (the controller would not clear the allocation either): the reservation only.
    plain = reserved(allocated(recorded=False, annotations=attestation), POD, hold())
    (finding,) = default(reserved(plain, hold()), POLICY, "UPDATE", admission_for(plain), NVIDIA_CLASSES)
    assert [op["path"] for op in finding.patch] == ["/status/reservedFor"]

    # A later pod still uses the claim, or the attestation is of another hold: the ended pod is kept, as before.
    for old, new in (
        (reserved(held, POD, PENDING, hold()), reserved(held, PENDING, hold())),
        (reserved(held, POD, hold("node-a", "hold-2")), reserved(held, hold("node-a", "hold-2"))),
    ):
        (finding,) = default(new, POLICY, "UPDATE", admission_for(old), NVIDIA_CLASSES)
        assert "recorded as ended" in finding.message
        entries = jsonpatch.apply_patch(new, list(finding.patch))["status"]["reservedFor"]
        assert ENDED in entries and POD not in entries


def admission_for(old: dict[str, Any]):
    from scrubgate.policies.engine import Admission

    return Admission("UPDATE", CONTROLLER, (), old_object=old, subresource="status")


def test_without_scrubgate_each_record_is_its_pod_again_unless_the_claim_is_being_deleted():
    """What an uninstall leaves: the holds out, each record its pod's entry again (which the resourceclaim controller
    then drops as ended, deallocating the claim as it would have); a claim being deleted takes no new entry, so
    there the records just go (the controller deallocates a claim being deleted that is reserved for nobody)."""
    from scrubgate.policies.attestation import without_scrubgate

    recorded = reserved(allocated(recorded=False), PENDING, ENDED, hold())
    assert without_scrubgate(recorded) == [PENDING, POD]
    recorded["metadata"]["deletionTimestamp"] = "2026-12-05T19:00:00Z"
    assert without_scrubgate(recorded) == [PENDING]
