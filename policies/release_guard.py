"""SG007 for claims: a GPU claim lets go of its devices only with an attestation of their scrub.

Three writes can hand a device that may hold a tenant's data to the next claim, and each is guarded here:
- removing the `scrubgate.dev/sanitize` finalizer, or writing scrubgate's annotations (`finalizer_guard`);
- clearing the claim's allocation (`deallocation_guard`): the allocation is what keeps the devices from every
  other claim until the scrub is attested;
- changing who the claim is reserved for (`reservation_guard`): a node agent's hold (a `scrubgate.dev/nodeagents`
  consumer) makes a used claim look used, to the scheduler and to the resourceclaim controller, until the hold
  goes with the attested release; before the agent holds it, the pods it was reserved for are what shows it used.
"""

from __future__ import annotations

from typing import Any

from . import names
from .attestation import (
    AttestationError,
    agent_reservations,
    allocation_results,
    check_claim_attestation,
    claim_consumers,
    deleted_before_allocation,
    ended_pod_entry,
    is_ended_pod,
    recorded_devices,
    reserved_consumers,
    reserved_pods,
)
from .config import PolicyConfig
from .findings import Violation, pointer
from .model import annotations, as_dict, as_list, as_str, claim_metadatas, metadata
from .requester import Requester, not_the_agents_node, object_name
from .scope import Scope, guarded_devices

AGENT_ANNOTATIONS = (names.ANNOTATION_DEVICES, names.ANNOTATION_SCRUB_STATUS, names.ANNOTATION_ATTESTATION)
HOLD = f"{names.RESERVATION_RESOURCE}.{names.RESERVATION_GROUP}"
_RESERVED_FOR = "/status/reservedFor"


def _annotation_writes(
    old: dict[str, Any], new: dict[str, Any], place: tuple[str, ...], who: Requester, policy: PolicyConfig
) -> list[Violation]:
    """SG007's guard of the annotations only the agent (devices, scrub-status, attestation) or an admin
    (break-glass) may write, for the annotations at `place` going from `old` to `new`."""
    violations: list[Violation] = []
    written = [k for k in AGENT_ANNOTATIONS if old.get(k) != new.get(k)]
    if written and not who.is_agent(policy):
        violations.append(
            (
                f"user {who.username!r} wrote {', '.join(written)}: only the scrubgate node agent writes these "
                f"annotations; remove the change",
                pointer(*place, "annotations", written[0]),
                (),
            )
        )
    if old.get(names.ANNOTATION_BREAK_GLASS) != new.get(names.ANNOTATION_BREAK_GLASS) and not who.is_admin(policy):
        violations.append(
            (
                f"user {who.username!r} wrote {names.ANNOTATION_BREAK_GLASS}: only members of the policy's admin "
                f"groups ({', '.join(policy.admin_groups) or 'none configured'}) may",
                pointer(*place, "annotations", names.ANNOTATION_BREAK_GLASS),
                (),
            )
        )
    return violations


def preset_annotations(obj: dict[str, Any], who: Requester, policy: PolicyConfig) -> list[Violation]:
    """SG007 on a new claim or template (and in manifests): one that arrives already carrying the agent's
    annotations or a break-glass reason would skip the guard that UPDATEs get. A template's
    `spec.metadata.annotations` are copied into every claim generated from it."""
    violations: list[Violation] = []
    for place, meta in claim_metadatas(obj):
        violations += _annotation_writes({}, as_dict(meta.get("annotations")), place, who, policy)
    return violations


def claim_nodes(claim: dict[str, Any]) -> set[str]:
    """The nodes a claim's allocation is on: its nodeSelector's `metadata.name` (the node-local devices of a DRA
    driver), else the pools of its results (NVIDIA's driver names each pool after its node)."""
    allocation = as_dict(as_dict(claim.get("status")).get("allocation"))
    found = {
        as_str(value)
        for term in as_list(as_dict(allocation.get("nodeSelector")).get("nodeSelectorTerms"))
        for field in as_list(as_dict(term).get("matchFields"))
        if as_dict(field).get("key") == "metadata.name" and as_dict(field).get("operator") == "In"
        for value in as_list(as_dict(field).get("values"))
    }
    return found or {as_str(result.get("pool")) for result in allocation_results(claim) if result.get("pool")}


def _agent_nodes(claim: dict[str, Any]) -> set[str]:
    """Where an agent may write a claim's record and attestation: its allocation's node, or, once deallocated,
    the pools of the agent's own record (written by the agent of that node while the claim was allocated)."""
    found = claim_nodes(claim)
    if found:
        return found
    try:
        return {pool for _, pool, _ in recorded_devices(claim) if pool}
    except AttestationError:
        return set()


def finalizer_guard(
    obj: dict[str, Any], old: dict[str, Any], who: Requester, scope: Scope
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on an UPDATE of a ResourceClaim. Returns (violations, break-glass removals to audit)."""
    policy = scope.policy
    old_annotations, new_annotations = annotations(old), annotations(obj)
    violations = _annotation_writes(old_annotations, new_annotations, ("metadata",), who, policy)
    old_finalizers = as_list(metadata(old).get("finalizers"))
    new_finalizers = as_list(metadata(obj).get("finalizers"))
    if scheduler_release(old, new_finalizers, who, scope):
        message = (
            f"kube-scheduler ({who.username!r}) deletes a claim it allocated and reserved in a scheduling cycle "
            f"whose binding failed, no container having used it: {names.DELETE_PROTECTION_FINALIZER} and "
            f"{names.FINALIZER} removed, nothing to scrub"
        )
        return violations, [(message, "/metadata/finalizers", ())]
    protection = _delete_protection_removal(old, new_finalizers, who, scope)
    violations += protection[0]
    removed = names.FINALIZER in old_finalizers and names.FINALIZER not in new_finalizers
    owed = removed and not (deleted_before_allocation(old) or _owes_no_scrub(old, scope))
    wrote = any(old_annotations.get(k) != new_annotations.get(k) for k in AGENT_ANNOTATIONS)
    if who.is_agent(policy) and (owed or wrote):
        elsewhere = not_the_agents_node(_agent_nodes(old), who, f"claim {object_name(old)}", policy)
        if elsewhere:
            return [*violations, (elsewhere, "/metadata", ())], []  # nothing else it writes here counts
    if not owed:
        return violations, protection[1]
    path = "/metadata/finalizers"
    reason = as_str(new_annotations.get(names.ANNOTATION_BREAK_GLASS)).strip()
    if who.is_agent(policy):
        problem = _attestation_problem(obj, old, scope, who)
        if problem:
            violations.append((f"{names.FINALIZER} removed {problem}", path, ()))
        return violations, protection[1]
    if who.is_admin(policy) and reason:
        removal = (f"break-glass removal of {names.FINALIZER} by {who.username!r}: {reason}", path, ())
        return violations, [*protection[1], removal]
    violations.append(
        (
            f"user {who.username!r} removed the {names.FINALIZER} finalizer: only the scrubgate node agent removes "
            f"it after a verified scrub (an admin may set {names.ANNOTATION_BREAK_GLASS}: <reason> first)",
            path,
            (),
        )
    )
    return violations, protection[1]


def _delete_protection_removal(
    old: dict[str, Any], new_finalizers: list[Any], who: Requester, scope: Scope
) -> tuple[list[Violation], list[Violation]]:
    """SG007: Kubernetes' `resource.kubernetes.io/delete-protection` removed from a claim that holds a GPU.
    The resourceclaim controller removes it only once the allocation is gone; without it, the claim could be
    deleted with its allocation, and the scheduler's exemption no longer applies. Refused; an admin may, and is
    recorded."""
    if names.DELETE_PROTECTION_FINALIZER not in as_list(metadata(old).get("finalizers")):
        return [], []
    if names.DELETE_PROTECTION_FINALIZER in new_finalizers or not as_dict(old.get("status")).get("allocation"):
        return [], []
    if not _holds_guarded_devices(old, scope):
        return [], []
    path = "/metadata/finalizers"
    if who.is_admin(scope.policy):
        return [], [
            (f"admin {who.username!r} removed {names.DELETE_PROTECTION_FINALIZER} from a claim holding a GPU", path, ())
        ]
    message = (
        f"user {who.username!r} removed {names.DELETE_PROTECTION_FINALIZER} from a claim that still holds a GPU: "
        f"Kubernetes removes it once the claim is deallocated, which scrubgate allows after the node agent has "
        f"attested the device's scrub; remove the change"
    )
    return [(message, path, ())], []


def _required_devices(claim: dict[str, Any], scope: Scope) -> set[tuple[str, str, str]]:
    """What an attestation must cover: the claim's guarded devices and those on the agent's record."""
    return guarded_devices(claim, scope) | recorded_devices(claim)


def _holds_guarded_devices(claim: dict[str, Any], scope: Scope) -> bool:
    """Whether the claim holds, or the agent recorded, a device that may hold GPU memory, or a node agent holds
    it (it saw a GPU there); an agent's record that cannot be read counts as one (fail closed)."""
    if agent_reservations(claim):
        return True
    try:
        return bool(_required_devices(claim, scope))
    except AttestationError:
        return True


def _owes_no_scrub(claim: dict[str, Any], scope: Scope) -> bool:
    """A claim being deleted that holds no guarded device and has none on the agent's record (a ComputeDomain
    channel, a vfio GPU, another vendor's device): no agent will ever attest it, so its finalizer may go, or the
    claim and its namespace would hang in Terminating."""
    if not metadata(claim).get("deletionTimestamp"):
        return False
    return not _holds_guarded_devices(claim, scope)


def _attestation_problem(
    claim: dict[str, Any], old: dict[str, Any], scope: Scope, who: Requester | None = None
) -> str | None:
    """Why the claim's attestation does not cover every GPU it holds or held (None when it does): its devices,
    its allocation (policies/attestation.py binds it to the allocation it attests), and the node: the
    attestation must be of the node the claim is allocated on, and, from an agent under node binding, of that
    agent's own node."""
    policy = scope.policy
    token = annotations(claim).get(names.ANNOTATION_ATTESTATION)
    if not isinstance(token, str) or not token:
        return f"without a {names.ANNOTATION_ATTESTATION} annotation"
    try:
        required = _required_devices(old, scope) | _required_devices(claim, scope)
        coverage = policy.scrub_coverage
        limits = (coverage.max_unreachable_percent / 100, coverage.max_unreachable_bytes)
        payload = check_claim_attestation(token, claim, policy.public_keys, required, limits)
    except AttestationError as exc:
        return f"with an attestation that does not hold: {exc}"
    attested = payload.get("node")
    nodes = claim_nodes(old)
    if nodes and attested not in nodes:
        return (
            f"with an attestation of node {attested!r} for a claim allocated on node {', '.join(sorted(nodes))}: "
            "only the agent of the node that holds the devices can have scrubbed them"
        )
    if who is not None and policy.agent.node_binding and attested != who.node:
        return (
            f"with an attestation of node {attested!r} submitted by the agent of node {who.node!r}: an agent "
            "attests only the scrub of its own node's devices"
        )
    return None


def _scheduler_may_clear(old: dict[str, Any]) -> bool:
    """Whether a deallocation by the scheduler can only be its PostFilter undoing an allocation of its own that
    no container used. The scheduler writes the allocation together with the one pod it reserves the claim for,
    after adding `resource.kubernetes.io/delete-protection`; if that pod's binding fails, it leaves the claim
    reserved for nobody or that pod, and PostFilter may clear it. A claim that has been used looks otherwise: a
    node agent holds it (it saw a pod of it bound), or SG007 kept the pods that used it in its reservation
    (`reservation_guard`), or the agent recorded its devices. None of those is the scheduler's to clear."""
    if names.DELETE_PROTECTION_FINALIZER not in as_list(metadata(old).get("finalizers")):
        return False
    if names.ANNOTATION_DEVICES in annotations(old):
        return False
    consumers = reserved_consumers(old)
    return not consumers or (len(consumers) == 1 and consumers[0][0] == "pods")


def scheduler_release(old: dict[str, Any], new_finalizers: list[Any], who: Requester, scope: Scope) -> bool:
    """Whether an UPDATE of a GPU claim is kube-scheduler deleting an extended-resource claim of its own after a
    failed binding (its Unreserve removes `resource.kubernetes.io/delete-protection`, then deletes the claim):
    from the scheduler, delete-protection going while the claim is allocated, and a claim it may clear
    (`_scheduler_may_clear`). No container used it, so the sanitize finalizer may go with it: kept, it would hold
    the claim, and its GPU, with nobody to attest it, and the pod Pending for good."""
    if not who.is_scheduler(scope.policy) or names.DELETE_PROTECTION_FINALIZER in new_finalizers:
        return False
    return bool(as_dict(old.get("status")).get("allocation")) and _scheduler_may_clear(old)


def scheduler_release_patch(obj: dict[str, Any], old: dict[str, Any], who: Requester, scope: Scope) -> list[Violation]:
    """SG004's other half, for /mutate: the sanitize finalizer removed from a claim kube-scheduler is releasing
    (`scheduler_release`), with a `test` of the entry it removes."""
    finalizers = as_list(metadata(obj).get("finalizers"))
    if names.FINALIZER not in finalizers or not scheduler_release(old, finalizers, who, scope):
        return []
    path = f"/metadata/finalizers/{finalizers.index(names.FINALIZER)}"
    ops = ({"op": "test", "path": path, "value": names.FINALIZER}, {"op": "remove", "path": path})
    message = (
        f"kube-scheduler deletes a GPU claim of its own that no container used (its binding failed): "
        f"{names.FINALIZER} goes with {names.DELETE_PROTECTION_FINALIZER}, so that the claim and its GPU are freed"
    )
    return [(message, "/metadata/finalizers", ops)]


def _break_glass(
    old: dict[str, Any], who: Requester, policy: PolicyConfig, act: str, path: str
) -> tuple[list[Violation], list[Violation]] | None:
    """Break-glass for a write that lets a GPU go unattested: where the agent has fenced the devices after a
    failed scrub (`scrub-status: failed:...`), or an admin does it personally (a node gone for good). None when
    neither applies."""
    reason = as_str(annotations(old).get(names.ANNOTATION_BREAK_GLASS)).strip()
    status = as_str(annotations(old).get(names.ANNOTATION_SCRUB_STATUS))
    if reason and status.startswith(names.SCRUB_FAILED_PREFIX):
        return [], [
            (
                f"break-glass {act} by {who.username!r}, devices fenced after a failed scrub ({status}): {reason}",
                path,
                (),
            )
        ]
    if reason and who.is_admin(policy):
        return [], [
            (
                f"break-glass {act} by admin {who.username!r}, devices neither fenced nor attested clean: {reason}",
                path,
                (),
            )
        ]
    if reason:
        message = (
            f"user {who.username!r} made a {act} of a claim whose GPU is not attested clean; break-glass ({reason}) "
            f"lets it go only once the node agent has fenced the devices after a failed scrub (scrub-status "
            f"{names.SCRUB_FAILED_PREFIX}...), since until then this claim is all that keeps them from the next one. "
            f"Wait for the agent, or, for a node that is gone for good, a member of the policy's admin groups clears the "
            f"allocation"
        )
        return [(message, path, ())], []
    return None


def deallocation_guard(
    obj: dict[str, Any], old: dict[str, Any], who: Requester, scope: Scope
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on an UPDATE of a GPU claim's status: the allocation goes (its devices back to the pool) only
    once the claim carries an attestation of their scrub, of the node they are on and of this allocation. Until
    then the allocation is what keeps the devices from the next claim. Exempt: the scheduler undoing an
    allocation of its own that no container used (`_scheduler_may_clear`), and break-glass.
    Returns (violations, break-glass deallocations to audit)."""
    allocation = as_dict(old.get("status")).get("allocation")
    if not allocation or as_dict(obj.get("status")).get("allocation") == allocation:
        return [], []
    # Only devices that may hold GPU memory are guarded: one no agent scrubs would stay allocated forever.
    if not _holds_guarded_devices(old, scope):
        return [], []
    if who.is_scheduler(scope.policy) and _scheduler_may_clear(old):
        return [], []
    # The metadata of a status write is the stored one: read the attestation from the old object.
    problem = _attestation_problem(old, old, scope, who if who.is_agent(scope.policy) else None)
    if problem is None:
        return [], []
    path = "/status/allocation"
    glass = _break_glass(old, who, scope.policy, "deallocation", path)
    if glass is not None:
        return glass
    return [
        (
            f"user {who.username!r} cleared the allocation {problem}: its devices may still hold the last tenant's "
            f"data. Once the scrubgate node agent has attested their scrub, the agent releases the claim; if it "
            f"stays allocated, check the agent on the devices' node (`scrubgate agent status`)",
            path,
            (),
        )
    ], []


def reservation_guard(
    obj: dict[str, Any], old: dict[str, Any], who: Requester, scope: Scope
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on a status write that changes who a GPU claim is reserved for. Returns (violations, audits).

    - A node agent's hold (`scrubgate.dev/nodeagents`) is added only by the agent of the node the claim is
      allocated on, named for that node.
    - It goes only with an attestation of this allocation's scrub (the agent's release), or by break-glass.
    - While no agent holds an allocated GPU claim, the pods it is reserved for are what shows it was used: nobody
      but kube-scheduler (whose Unreserve drops a pod whose binding failed, one that never ran) takes one out
      before the attestation. Otherwise a pod that ran and ended could leave the claim reserved for nobody, and
      the scheduler would deallocate it as one it never used."""
    policy = scope.policy
    before, after = agent_reservations(old), agent_reservations(obj)
    violations: list[Violation] = []
    for holder, _ in (r for r in after if r not in before):
        if not who.is_agent(policy):
            violations.append(
                (
                    f"user {who.username!r} added a {HOLD} hold for node {holder!r}: only scrubgate's node agent "
                    f"holds a claim, until its attested release; remove the entry",
                    _RESERVED_FOR,
                    (),
                )
            )
            continue
        nodes = claim_nodes(obj)
        problem = not_the_agents_node(nodes, who, f"claim {object_name(obj)}", policy)
        misnamed = (nodes and holder not in nodes) or (policy.agent.node_binding and holder != who.node)
        if problem is None and misnamed:
            where = ", ".join(sorted(nodes))
            problem = (
                f"the agent of node {who.node!r} added a hold named for node {holder!r} to a claim on node {where}"
            )
        if problem:
            violations.append((problem, _RESERVED_FOR, ()))
    violations += _unfounded_records(obj, old, who)
    released = [r for r in before if r not in after]
    unrecorded = [name for name, uid in ended_pod_records(old) if (name, uid) not in ended_pod_records(obj)]
    if not released and not unrecorded and after:
        return violations, []
    gone = [name for name, uid in reserved_pods(old) if (name, uid) not in reserved_pods(obj)]
    still_allocated = as_dict(obj.get("status")).get("allocation") == as_dict(old.get("status")).get("allocation")
    unheld = not released and gone and still_allocated and not who.is_scheduler(policy)
    if not (released or unrecorded or unheld) or not _holds_guarded_devices(old, scope):
        return violations, []
    problem = _attestation_problem(old, old, scope, who if who.is_agent(policy) else None)
    if problem is None:
        return violations, []
    if released:
        act = f"release of node {', '.join(h for h, _ in released)}'s hold"
    elif unrecorded:
        act = f"removal of the record(s) of ended pod(s) {', '.join(unrecorded)}"
    else:
        act = f"removal of pod(s) {', '.join(gone)} from the reservation"
    glass = _break_glass(old, who, policy, act, _RESERVED_FOR)
    if glass is not None:
        return [*violations, *glass[0]], glass[1]
    if released or unrecorded:
        message = (
            f"user {who.username!r} made a {act} {problem}: the hold and the records of ended pods keep a used "
            f"GPU claim from looking unused until its scrub is attested; the agent releases them itself"
        )
    else:
        message = (
            f"user {who.username!r} removed pod(s) {', '.join(gone)} from the reservation of a GPU claim that no "
            f"node agent holds yet {problem}: a pod that ran must not leave the claim looking unused, or the "
            f"scheduler would hand its GPU on unscrubbed. The resourceclaim controller retries this by itself once "
            f"the node agent holds the claim (moments after a pod of it starts on a node)"
        )
    return [*violations, (message, _RESERVED_FOR, ())], []


def ended_pod_records(claim: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, UID) of each ended pod scrubgate recorded in the claim's reservation (`kept_consumers_patch`)."""
    return [(name, uid) for resource, name, uid in reserved_consumers(claim) if is_ended_pod(resource)]


def _unfounded_records(obj: dict[str, Any], old: dict[str, Any], who: Requester) -> list[Violation]:
    """A record of an ended pod stands only in the place of that pod's own entry (name and UID), in the write that
    drops it: one for a pod the claim was not reserved for would keep the resourceclaim controller from reserving
    the claim for that pod."""
    known = set(ended_pod_records(old)) | (set(reserved_pods(old)) - set(reserved_pods(obj)))
    return [
        (
            f"user {who.username!r} added a record of ended pod {name} ({uid}) to a claim that was not reserved for "
            f"it in this write: scrubgate records a pod only as it drops out of the reservation; remove the entry",
            _RESERVED_FOR,
            (),
        )
        for name, uid in ended_pod_records(obj)
        if (name, uid) not in known
    ]


def kept_consumers_patch(obj: dict[str, Any], old: dict[str, Any], who: Requester, scope: Scope) -> list[Violation]:
    """SG007's other half, for /mutate: while a node agent holds a claim, each pod dropped from its reservation
    leaves a record of itself there until the attested release, which this write makes where it can.

    Kubernetes' resourceclaim controller drops an ended pod from a claim (syncClaim), keeping consumers it does not
    know (the hold), and reserves an allocated claim again for any pod bound to a node and not being deleted, ended
    or not, unless an entry of the claim's reservation carries the pod's UID (syncPod, IsReservedForPod): with the
    allocation held, dropping the pod outright would make the two take turns for as long as the hold stands
    (pkg/controller/resourceclaim/controller.go, v1.37). So before the attestation the pod's entry is replaced by
    scrubgate's record of it (names.ENDED_POD_RESOURCE, the pod's name and UID): the controller keeps that record,
    does not reserve the claim for the pod again, and has nothing left to drop, so it writes the claim no more (no
    write on a stale copy, no refused attempt in its rate-limited queue). A claim being deleted takes no new entry
    (the API server's validation of its status) and so no new reservation either: its drop goes through as it is.
    Once the claim carries an attestation of this allocation, and nothing but holds and records would be left, the
    controller's drop becomes the release it would have made without the hold: holds, records and pods go and,
    where the controller's delete-protection finalizer is on the claim, the allocation too, in the controller's own
    write; where the controller has nothing left to drop, the agent releases in one write of its own.
    kube-scheduler's Unreserve (a pod whose binding failed: it never ran) and an admin's drop are left be."""
    policy = scope.policy
    if who.is_scheduler(policy) or who.is_admin(policy):
        return []
    if not agent_reservations(old) or not agent_reservations(obj):
        return []
    old_status, new_status = as_dict(old.get("status")), as_dict(obj.get("status"))
    if new_status.get("allocation") != old_status.get("allocation"):
        return []  # a deallocation: the deallocation guard's to decide
    kept = as_list(new_status.get("reservedFor"))
    dropped = [
        as_dict(e) for e in as_list(old_status.get("reservedFor"))
        if as_dict(e).get("resource") == "pods" and not as_dict(e).get("apiGroup") and e not in kept
    ]  # fmt: skip
    if not dropped:
        return []
    op = "replace" if "reservedFor" in new_status else "add"
    holders = ", ".join(h for h, _ in agent_reservations(old))
    in_use = [c for c in claim_consumers(obj) if not is_ended_pod(c[0])]
    if not in_use and _attestation_problem(old, old, scope) is None:
        ops: tuple[dict[str, Any], ...] = ({"op": "replace", "path": _RESERVED_FOR, "value": []},)
        if names.DELETE_PROTECTION_FINALIZER in as_list(metadata(old).get("finalizers")):
            ops += ({"op": "remove", "path": "/status/allocation"},)
        message = (
            f"claim released with the attestation of node {holders}'s agent: its hold goes with the ended pod(s) "
            f"{', '.join(as_str(e.get('name')) for e in dropped)}, and the allocation with them"
        )
        return [(message, _RESERVED_FOR, ops)]
    if metadata(old).get("deletionTimestamp"):
        return []
    # In the stored order, each dropped pod's entry replaced by its record.
    old_list = as_list(old_status.get("reservedFor"))
    recorded = [ended_pod_entry(as_dict(e)) if e in dropped else e for e in old_list if e in kept or e in dropped]
    recorded += [e for e in kept if e not in old_list and e not in recorded]  # a reinvocation adds none twice
    message = (
        f"pod(s) {', '.join(as_str(e.get('name')) for e in dropped)} recorded as ended in the reservation of a claim "
        f"node {holders}'s agent holds: the records leave it with the attested release"
    )
    return [(message, _RESERVED_FOR, ({"op": op, "path": _RESERVED_FOR, "value": recorded},))]
