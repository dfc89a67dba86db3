"""The rules SG001-SG008 (DESIGN.md, "Rules") as pure functions.

Each rule takes the object and what it needs to know, and returns `(message, path, patch)` violations;
the engine turns them into findings with the action the policy gives the rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import names
from .attestation import (
    AttestationError,
    allocation_results,
    check_claim_attestation,
    deleted_before_allocation,
    device_key,
    recorded_devices,
    reserved_consumers,
)
from .config import PolicyConfig
from .findings import pointer
from .model import (
    DeviceRequest,
    PodSpecRef,
    annotations,
    as_dict,
    as_list,
    as_str,
    device_requests,
    extended_resources,
    fence_key,
    metadata,
    pod_claims,
    pod_spec,
)
from .selectors import Verdict, gpu_verdict

Violation = tuple[str, str, tuple[dict[str, Any], ...]]

AGENT_ANNOTATIONS = (names.ANNOTATION_DEVICES, names.ANNOTATION_SCRUB_STATUS, names.ANNOTATION_ATTESTATION)
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def gpu_requests(obj: dict[str, Any], policy: PolicyConfig) -> list[DeviceRequest]:
    """Requests that may be satisfied by a GPU class: the claim is in scope if there is any."""
    return [r for r in device_requests(obj) if any(policy.is_gpu_class(c) for c in r.device_classes())]


def _result_classes(obj: dict[str, Any]) -> dict[str, str]:
    """Device class by the name an allocation result gives its request: `request`, or `request/subrequest`."""
    classes: dict[str, str] = {}
    for request in device_requests(obj):
        for choice in request.choices:
            if not choice.device_class:
                continue
            if choice.path[len(request.path) : len(request.path) + 1] == ("firstAvailable",):
                classes[f"{request.name}/{as_str(choice.fields.get('name'))}"] = choice.device_class
            else:
                classes[request.name] = choice.device_class
    return classes


def guarded_devices(claim: dict[str, Any], policy: PolicyConfig) -> set[tuple[str, str, str]]:
    """The allocated devices that may hold a tenant's GPU memory, known from what was allocated rather than
    from the class's name: a result from one of the policy's GPU drivers, or for a GPU class, unless its
    request used an excluded class (a GPU bound to vfio-pci, an IMEX channel), which no agent scrubs. A result
    of a request the spec does not have is guarded too (fail closed)."""
    classes = _result_classes(claim)
    found = set()
    for result in allocation_results(claim):
        device_class = classes.get(as_str(result.get("request")), "")
        if device_class and policy.is_excluded_class(device_class):
            continue
        gpu_driver = as_str(result.get("driver")) in policy.gpu_drivers
        if not device_class or gpu_driver or policy.is_gpu_class(device_class):
            found.add(device_key(result))
    return found


def gpu_extended_resources(ref: PodSpecRef, policy: PolicyConfig) -> list[str]:
    """The extended resources of a pod spec that stand for GPUs (KEP-5004: the scheduler creates their claim,
    named only in the pod's status; the pod has no spec.resourceClaims)."""
    return [r.name for r in extended_resources(ref) if policy.is_gpu_extended_resource(r.name)]


def is_gpu_pod(ref: PodSpecRef, policy: PolicyConfig) -> bool:
    """A pod spec that may hold a GPU claim: DRA claims of its own, or a GPU extended resource."""
    return bool(as_list(ref.spec.get("resourceClaims"))) or bool(gpu_extended_resources(ref, policy))


def retain_deallocation(obj: dict[str, Any]) -> list[Violation]:
    """SG001, for an in-scope claim or template in a multi-tenant namespace."""
    places = [("metadata",)]
    if as_str(obj.get("kind")) == "ResourceClaimTemplate":
        places.append(("spec", "metadata"))
    found = []
    for place in places:
        node: Any = obj
        for key in place:
            node = as_dict(node).get(key)
        value = as_dict(as_dict(node).get("annotations")).get(names.ANNOTATION_DEALLOCATION_POLICY)
        if value is None or value == names.DEALLOCATION_DELETE:
            continue
        path = pointer(*place, "annotations", names.ANNOTATION_DEALLOCATION_POLICY)
        what = "Retain" if value == names.DEALLOCATION_RETAIN else f"{value!r}, which is not Delete or Retain,"
        found.append(
            (
                f"{names.ANNOTATION_DEALLOCATION_POLICY} is {what} in a multi-tenant namespace: set it to "
                f"Delete, or label the namespace {names.TENANCY_LABEL}={names.TENANCY_TRUSTED} if one tenant owns it",
                path,
                ({"op": "replace", "path": path, "value": names.DEALLOCATION_DELETE},),
            )
        )
    return found


def shared_claim(ref: PodSpecRef, is_pod: bool) -> list[Violation]:
    """SG002, for a workload's pod template, or a pod in a multi-tenant namespace."""
    holder = "pod" if is_pod else "pod template"
    return [
        (
            f"{holder} names ResourceClaim {claim.claim_name!r} in resourceClaims[{claim.name or '?'}]: use "
            f"resourceClaimTemplateName so each pod gets its own claim, scrubbed when the pod ends",
            pointer(*claim.claim_name_path),
            (),
        )
        for claim in pod_claims(ref)
        if claim.claim_name
    ]


def grace_period(ref: PodSpecRef, policy: PolicyConfig, manifest: bool) -> list[Violation]:
    """SG003, for a GPU pod spec. Absence counts only in manifests: the API server defaults the field (30 s)
    before any admission webhook sees the pod."""
    if not is_gpu_pod(ref, policy):
        return []
    limits = policy.grace_period
    path = pointer(*ref.path, "terminationGracePeriodSeconds")
    if "terminationGracePeriodSeconds" not in ref.spec:
        if not manifest:
            return []
        return [
            (
                f"GPU pod spec has no terminationGracePeriodSeconds (the API server would set 30s): set it "
                f"between {limits.minimum_seconds} and {limits.maximum_seconds} so the driver can unprepare the "
                f"device before the pod ends (`scrubgate check --fix` writes {limits.default_seconds})",
                path,
                ({"op": "add", "path": path, "value": limits.default_seconds},),
            )
        ]
    value = ref.spec["terminationGracePeriodSeconds"]
    if not isinstance(value, int) or isinstance(value, bool):
        return [(f"terminationGracePeriodSeconds must be an integer number of seconds, not {value!r}", path, ())]
    if value < limits.minimum_seconds:
        return [
            (
                f"terminationGracePeriodSeconds is {value}s, below the minimum of {limits.minimum_seconds}s "
                f"for GPU pods: raise it to at least {limits.minimum_seconds}",
                path,
                (),
            )
        ]
    if value > limits.maximum_seconds:
        return [
            (
                f"terminationGracePeriodSeconds is {value}s, above the maximum of {limits.maximum_seconds}s: "
                f"lower it so a released device is not held dirty for longer",
                path,
                (),
            )
        ]
    return []


def claim_finalizer(obj: dict[str, Any]) -> list[Violation]:
    """SG004, for an in-scope ResourceClaim. The patch adds to the user's finalizers, never replaces them."""
    meta = obj.get("metadata")
    finalizers = as_dict(meta).get("finalizers")
    if isinstance(finalizers, list) and names.FINALIZER in finalizers:
        return []
    if not isinstance(meta, dict):
        op = {"op": "add", "path": "/metadata", "value": {"finalizers": [names.FINALIZER]}}
    elif not isinstance(finalizers, list):
        op = {"op": "add", "path": "/metadata/finalizers", "value": [names.FINALIZER]}
    else:
        op = {"op": "add", "path": "/metadata/finalizers/-", "value": names.FINALIZER}
    return [
        (
            f"GPU ResourceClaim lacks the {names.FINALIZER} finalizer: add it so the claim stays until the "
            f"node agent attests the scrub",
            "/metadata/finalizers",
            (op,),
        )
    ]


def _tolerates_fence(toleration: Any, keyless_exists: bool) -> bool:
    toleration = as_dict(toleration)
    key = as_str(toleration.get("key"))
    if key.startswith(names.DOMAIN + "/"):
        return True
    return keyless_exists and not key and toleration.get("operator") == "Exists"


def fence_toleration(obj: dict[str, Any], requests: list[DeviceRequest]) -> list[Violation]:
    """SG005: a device request that tolerates the fence (or every taint) can be allocated a dirty device."""
    found = []
    for request in requests:
        for choice in request.choices:
            for index, toleration in enumerate(as_list(choice.fields.get("tolerations"))):
                if _tolerates_fence(toleration, keyless_exists=True):
                    key = as_str(as_dict(toleration).get("key")) or "every taint (operator: Exists, no key)"
                    found.append(
                        (
                            f"device request {request.name!r} tolerates {key}: remove the toleration; scrubgate's "
                            f"fence keeps devices that may hold another tenant's data from being allocated",
                            pointer(*choice.path, "tolerations", index),
                            (),
                        )
                    )
    return found


def pod_fence_toleration(ref: PodSpecRef, policy: PolicyConfig, trusted: bool) -> list[Violation]:
    """SG005 for GPU pods: where no DeviceTaintRule API is served the agent fences with a node taint, which a
    pod toleration of a scrubgate.dev/ key, or of every taint (`operator: Exists` without a key, whatever
    its effect), would defeat. In a single-tenant namespace a key-less toleration is left alone (a tenant's
    own device). A pod without GPU claims (the agent itself, system DaemonSets) gets no GPU through the fence,
    so its tolerations are none of this rule's business."""
    if not is_gpu_pod(ref, policy):
        return []
    found = []
    for index, toleration in enumerate(as_list(ref.spec.get("tolerations"))):
        if not _tolerates_fence(toleration, keyless_exists=not trusted):
            continue
        key = as_str(as_dict(toleration).get("key"))
        what = f"the node taint {key}" if key else "every taint (operator: Exists, no key)"
        found.append(
            (
                f"GPU pod tolerates {what}: remove the toleration (or give it a key); it defeats scrubgate's "
                f"fence on nodes without DeviceTaintRule support",
                pointer(*ref.path, "tolerations", index),
                (),
            )
        )
    return found


def admin_access(requests: list[DeviceRequest]) -> list[Violation]:
    """SG006, in a multi-tenant namespace: admin access reaches devices that other claims hold."""
    return [
        (
            f"device request {request.name!r} asks for adminAccess in a multi-tenant namespace: remove "
            f"adminAccess, or run it in a namespace labelled {names.TENANCY_LABEL}={names.TENANCY_TRUSTED}",
            pointer(*choice.path, "adminAccess"),
            (),
        )
        for request in requests
        for choice in request.choices
        if choice.fields.get("adminAccess") is True
    ]


@dataclass(frozen=True)
class Requester:
    """Who sends a write, as admission names them: the user, the groups, and the node the credentials are bound
    to (a DaemonSet pod's projected token; "" for any other). A manifest (CI) has none: the empty requester."""

    username: str = ""
    groups: tuple[str, ...] = ()
    node: str = ""

    def is_agent(self, policy: PolicyConfig) -> bool:
        return self.username in policy.agent.identities

    def is_admin(self, policy: PolicyConfig) -> bool:
        return any(group in policy.admin_groups for group in self.groups)


def _annotation_writes(
    old: dict[str, Any],
    new: dict[str, Any],
    place: tuple[str, ...],
    who: Requester,
    policy: PolicyConfig,
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
    places = [("metadata",)]
    if as_str(obj.get("kind")) == "ResourceClaimTemplate":
        places.append(("spec", "metadata"))
    violations: list[Violation] = []
    for place in places:
        node: Any = obj
        for key in place:
            node = as_dict(node).get(key)
        violations += _annotation_writes({}, as_dict(as_dict(node).get("annotations")), place, who, policy)
    return violations


def finalizer_guard(
    obj: dict[str, Any], old: dict[str, Any], who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on an UPDATE of a ResourceClaim. Returns (violations, break-glass removals to audit)."""
    is_agent, username = who.is_agent(policy), who.username
    old_annotations, new_annotations = annotations(old), annotations(obj)
    violations = _annotation_writes(old_annotations, new_annotations, ("metadata",), who, policy)
    if is_agent and old != obj:
        elsewhere = _not_the_agents_node(claim_nodes(old), who.node, f"claim {_object_name(old)}", policy)
        if elsewhere:
            return [*violations, (elsewhere, "/metadata", ())], []  # nothing else it writes here counts
    old_finalizers = as_list(metadata(old).get("finalizers"))
    new_finalizers = as_list(metadata(obj).get("finalizers"))
    if scheduler_release(old, new_finalizers, username, policy):
        message = (
            f"kube-scheduler ({username!r}) deletes a claim it allocated and reserved in a scheduling cycle whose "
            f"binding failed, no container having used it: {names.DELETE_PROTECTION_FINALIZER} and "
            f"{names.FINALIZER} removed, nothing to scrub"
        )
        return violations, [(message, "/metadata/finalizers", ())]
    protection = _delete_protection_removal(old, new_finalizers, who, policy)
    violations += protection[0]
    if names.FINALIZER not in old_finalizers or names.FINALIZER in new_finalizers:
        return violations, protection[1]
    if deleted_before_allocation(old) or _owes_no_scrub(old, policy):
        return violations, []
    path = "/metadata/finalizers"
    reason = as_str(new_annotations.get(names.ANNOTATION_BREAK_GLASS)).strip()
    if is_agent:
        problem = _attestation_problem(obj, old, policy, who.node if policy.agent.node_binding else None)
        if problem:
            violations.append((f"{names.FINALIZER} removed {problem}", path, ()))
        return violations, protection[1]
    if who.is_admin(policy) and reason:
        removal = (f"break-glass removal of {names.FINALIZER} by {username!r}: {reason}", path, ())
        return violations, [*protection[1], removal]
    violations.append(
        (
            f"user {username!r} removed the {names.FINALIZER} finalizer: only the scrubgate node agent removes it "
            f"after a verified scrub (an admin may set {names.ANNOTATION_BREAK_GLASS}: <reason> first)",
            path,
            (),
        )
    )
    return violations, protection[1]


def _delete_protection_removal(
    old: dict[str, Any], new_finalizers: list[Any], who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG007: Kubernetes' `resource.kubernetes.io/delete-protection` removed from a claim that holds a GPU.
    The resourceclaim controller removes it only once the allocation is gone; without it, the controller drops
    the claim's reservation but keeps the allocation, and the claim then looks to the webhook like one the
    scheduler allocated and never used. Refused; an admin may, and is recorded (the scheduler's exemption does
    not cover a claim without it, so the allocation still holds until the attestation)."""
    if names.DELETE_PROTECTION_FINALIZER not in as_list(metadata(old).get("finalizers")):
        return [], []
    if names.DELETE_PROTECTION_FINALIZER in new_finalizers or not as_dict(old.get("status")).get("allocation"):
        return [], []
    if not _holds_guarded_devices(old, policy):
        return [], []
    path = "/metadata/finalizers"
    if who.is_admin(policy):
        return [], [
            (f"admin {who.username!r} removed {names.DELETE_PROTECTION_FINALIZER} from a claim holding a GPU", path, ())
        ]
    message = (
        f"user {who.username!r} removed {names.DELETE_PROTECTION_FINALIZER} from a claim that still holds a GPU: "
        f"Kubernetes removes it once the claim is deallocated, which scrubgate allows after the node agent has "
        f"attested the device's scrub; remove the change"
    )
    return [(message, path, ())], []


def _required_devices(claim: dict[str, Any], policy: PolicyConfig) -> set[tuple[str, str, str]]:
    """What an attestation must cover: the claim's guarded devices and those on the agent's record."""
    return guarded_devices(claim, policy) | recorded_devices(claim)


def _holds_guarded_devices(claim: dict[str, Any], policy: PolicyConfig) -> bool:
    """Whether the claim holds, or the agent recorded, a device that may hold GPU memory; an agent's record that
    cannot be read counts as one (fail closed)."""
    try:
        return bool(_required_devices(claim, policy))
    except AttestationError:
        return True


def _owes_no_scrub(claim: dict[str, Any], policy: PolicyConfig) -> bool:
    """A claim being deleted that holds no guarded device and has none on the agent's record (a ComputeDomain
    channel, a vfio GPU, a claim given the finalizer under an older policy): no agent will ever attest it,
    so its finalizer may go, or the claim and its namespace would hang in Terminating."""
    if not metadata(claim).get("deletionTimestamp"):
        return False
    try:
        return not _required_devices(claim, policy)
    except AttestationError:
        return False


def _attestation_problem(
    claim: dict[str, Any], old: dict[str, Any], policy: PolicyConfig, node: str | None = None
) -> str | None:
    """Why the claim's attestation does not cover every GPU it holds or held (None when it does). Devices of
    requests that cannot use a GPU class (a NIC in the same claim, say) hold no GPU memory: the agent does
    not scrub them, and they need no attestation. With `node` (the agent's, under node binding), the
    attestation must be that node's."""
    token = annotations(claim).get(names.ANNOTATION_ATTESTATION)
    if not isinstance(token, str) or not token:
        return f"without a {names.ANNOTATION_ATTESTATION} annotation"
    try:
        required = _required_devices(old, policy) | _required_devices(claim, policy)
        coverage = policy.scrub_coverage
        limits = (coverage.max_unreachable_percent / 100, coverage.max_unreachable_bytes)
        payload = check_claim_attestation(token, claim, policy.public_keys, required, limits)
    except AttestationError as exc:
        return f"with an attestation that does not hold: {exc}"
    if node is not None and payload.get("node") != node:
        return (
            f"with an attestation of node {payload.get('node')!r} submitted by the agent of node {node!r}: an agent "
            "attests only the scrub of its own node's devices"
        )
    return None


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


def _not_the_agents_node(nodes: set[str], node: str, what: str, policy: PolicyConfig) -> str | None:
    """Under node binding, why an agent bound to `node` may not act on `what` (on `nodes`), or None."""
    if not policy.agent.node_binding:
        return None
    if not node:
        return (
            "the agent's credentials name no node (userInfo.extra authentication.kubernetes.io/node-name): SG007 "
            "binds an agent to its node, so it acts only with its pod's projected token (Kubernetes 1.32 and "
            "later), or a token bound to its Node; or set agent.nodeBinding: false in the policy"
        )
    if nodes and node not in nodes:
        return f"the agent of node {node!r} acted on {what} of node {', '.join(sorted(nodes))}: an agent acts on its own node only"
    return None


def _object_name(obj: dict[str, Any]) -> str:
    meta = metadata(obj)
    namespace = as_str(meta.get("namespace"))
    return f"{namespace}/{as_str(meta.get('name'))}" if namespace else as_str(meta.get("name"))


def _scheduler_may_clear(old: dict[str, Any]) -> bool:
    """Whether a deallocation by the scheduler can only be its PostFilter undoing an allocation of its own that
    no container used. The scheduler writes the allocation together with the one pod it reserves the claim for,
    after adding `resource.kubernetes.io/delete-protection`; if that pod's binding fails, it leaves the claim
    reserved for nobody or that pod, and PostFilter may clear it. A claim that has been used looks otherwise:
    SG007 refuses the resourceclaim controller's release of it as a whole (reservation and allocation in one
    update), so it stays reserved for its pods; the node agent records its devices (`scrubgate.dev/devices`)
    when it sees the claim on its node; and a claim without delete-protection may have lost its reservation
    through the controller while keeping its allocation. None of those is the scheduler's to clear."""
    if names.DELETE_PROTECTION_FINALIZER not in as_list(metadata(old).get("finalizers")):
        return False
    if names.ANNOTATION_DEVICES in annotations(old):
        return False
    consumers = reserved_consumers(old)
    return not consumers or (len(consumers) == 1 and consumers[0][0] == "pods")


def scheduler_release(old: dict[str, Any], new_finalizers: list[Any], username: str, policy: PolicyConfig) -> bool:
    """Whether an UPDATE of a GPU claim is kube-scheduler deleting an extended-resource claim of its own after a
    failed binding (its Unreserve removes `resource.kubernetes.io/delete-protection`, then deletes the claim):
    from the scheduler, delete-protection going while the claim is allocated, and a claim it may clear
    (`_scheduler_may_clear`: reserved for at most the one pod it was binding, never on an agent's record). No
    container used it, so the sanitize finalizer may go with it: kept, it would hold the claim, and its GPU,
    with nobody to attest it, and the pod Pending for good."""
    if username not in policy.scheduler.identities or names.DELETE_PROTECTION_FINALIZER in new_finalizers:
        return False
    return bool(as_dict(old.get("status")).get("allocation")) and _scheduler_may_clear(old)


def scheduler_release_patch(
    obj: dict[str, Any], old: dict[str, Any], username: str, policy: PolicyConfig
) -> list[Violation]:
    """SG004's other half, for /mutate: the sanitize finalizer removed from a claim kube-scheduler is releasing
    (`scheduler_release`), with a `test` of the entry it removes."""
    finalizers = as_list(metadata(obj).get("finalizers"))
    if names.FINALIZER not in finalizers or not scheduler_release(old, finalizers, username, policy):
        return []
    path = f"/metadata/finalizers/{finalizers.index(names.FINALIZER)}"
    ops = ({"op": "test", "path": path, "value": names.FINALIZER}, {"op": "remove", "path": path})
    message = (
        f"kube-scheduler deletes a GPU claim of its own that no container used (its binding failed): "
        f"{names.FINALIZER} goes with {names.DELETE_PROTECTION_FINALIZER}, so that the claim and its GPU are freed"
    )
    return [(message, "/metadata/finalizers", ops)]


def deallocation_guard(
    obj: dict[str, Any], old: dict[str, Any], who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on an UPDATE of a GPU claim's status: the allocation goes (its devices back to the pool) only
    once the claim carries an attestation of their scrub. Until then the allocation is what keeps the devices
    from the next claim, and the agent always finds a released claim still allocated, however late it looks.
    Exempt: the scheduler undoing an allocation of its own that no container used (`_scheduler_may_clear`),
    and break-glass, where the devices are kept out of reach otherwise: the agent has fenced them with
    DeviceTaintRules after a failed scrub (`scrub-status: failed:...`), or an admin clears the allocation
    personally (a node gone for good, whose devices no one can be allocated).
    Returns (violations, break-glass deallocations to audit)."""
    username = who.username
    allocation = as_dict(old.get("status")).get("allocation")
    if not allocation or as_dict(obj.get("status")).get("allocation") == allocation:
        return [], []
    # Only devices that may hold GPU memory are guarded: one no agent scrubs would stay allocated forever.
    if not _holds_guarded_devices(old, policy):
        return [], []
    if username in policy.scheduler.identities and _scheduler_may_clear(old):
        return [], []
    # The metadata of a status write is the stored one: read the attestation from the old object.
    problem = _attestation_problem(old, old, policy)
    if problem is None:
        return [], []
    path = "/status/allocation"
    reason = as_str(annotations(old).get(names.ANNOTATION_BREAK_GLASS)).strip()
    status = as_str(annotations(old).get(names.ANNOTATION_SCRUB_STATUS))
    if reason and status.startswith(names.SCRUB_FAILED_PREFIX):
        audit = f"break-glass deallocation by {username!r}, devices fenced after a failed scrub ({status}): {reason}"
        return [], [(audit, path, ())]
    if reason and who.is_admin(policy):
        audit = f"break-glass deallocation by admin {username!r}, devices neither fenced nor attested clean: {reason}"
        return [], [(audit, path, ())]
    if reason:
        message = (
            f"user {username!r} cleared the allocation {problem}; break-glass ({reason}) lets it go only once the "
            f"node agent has fenced the devices after a failed scrub (scrub-status {names.SCRUB_FAILED_PREFIX}...), "
            f"since until then this allocation is all that keeps them from the next claim. Wait for the agent, or, "
            f"for a node that is gone for good, a member of the policy's admin groups clears the allocation"
        )
        return [(message, path, ())], []
    return [
        (
            f"user {username!r} cleared the allocation {problem}: its devices may still hold the last tenant's "
            f"data. Once the scrubgate node agent has attested their scrub, the retried deallocation is "
            f"allowed; if it stays refused, check the agent on the devices' node (`scrubgate agent status`)",
            path,
            (),
        )
    ], []


def fence_guard(
    obj: dict[str, Any] | None, old: dict[str, Any], who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on a DELETE (`obj` None) or UPDATE of one of scrubgate's fences, a DeviceTaintRule with a
    scrubgate.dev/ taint: lifting it, or pointing it at another device, hands a device that may still hold
    a tenant's data to the scheduler. Only the agent does that, after a verified scrub; an admin may, and
    is recorded. An UPDATE that leaves spec as it was (labels, annotations) moves no fence; creating a
    fence only fences more, so CREATE is not guarded. An agent lifts only its own node's fences (the node the
    agent named on it, else its device's pool). Returns (violations, admin lifts to audit)."""
    if obj is not None and obj.get("spec") == old.get("spec"):
        return [], []
    spec = as_dict(old.get("spec"))
    selector = as_dict(spec.get("deviceSelector"))
    device = "/".join(as_str(selector.get(field)) or "*" for field in ("driver", "pool", "device"))
    fence_node = as_str(annotations(old).get(names.ANNOTATION_FENCE_NODE)) or as_str(selector.get("pool"))
    what = "deleted" if obj is None else "changed the spec of"
    rule = f"DeviceTaintRule {as_str(metadata(old).get('name'))!r}, scrubgate's fence ({fence_key(old)}) on {device}"
    lift = FenceLift(f"{what} {rule}", fence_node, f"fence {_object_name(old)}", "/spec")
    return _fence_lift(lift, who, policy)


def node_fence_guard(
    obj: dict[str, Any], old: dict[str, Any], who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on an UPDATE of a Node that lifts or changes scrubgate's fallback fence, a node taint with a
    scrubgate.dev/ key (where no DeviceTaintRule API is served): as for a DeviceTaintRule, only the agent of
    that node, after a verified scrub; an admin may, and is recorded. Adding one only fences more."""

    def ours(node_obj: dict[str, Any]) -> list[dict[str, Any]]:
        taints = as_list(as_dict(node_obj.get("spec")).get("taints"))
        return [as_dict(t) for t in taints if as_str(as_dict(t).get("key")).startswith(f"{names.DOMAIN}/")]

    after = ours(obj)
    lifted = [t for t in ours(old) if t not in after]
    if not lifted:
        return [], []
    name = as_str(metadata(old).get("name"))
    keys = ", ".join(sorted({as_str(t.get("key")) for t in lifted}))
    lift = FenceLift(
        f"lifted scrubgate's fence {keys} from node {name!r}", name, f"the taints of node {name!r}", "/spec/taints"
    )
    return _fence_lift(lift, who, policy)


@dataclass(frozen=True)
class FenceLift:
    """A request that lifts or moves one of scrubgate's fences: what it does (after the user's name), the node
    whose agent placed the fence, the fence as an agent's refusal names it, and the field it is about."""

    act: str
    node: str
    subject: str
    path: str


def _fence_lift(lift: FenceLift, who: Requester, policy: PolicyConfig) -> tuple[list[Violation], list[Violation]]:
    """Who may lift a fence, DeviceTaintRule or node taint alike: the agent of its node; an admin, recorded;
    nobody else. Returns (violations, admin lifts to audit)."""
    if who.is_agent(policy):
        elsewhere = _not_the_agents_node({lift.node} - {""}, who.node, lift.subject, policy)
        return ([(elsewhere, lift.path, ())] if elsewhere else []), []
    if who.is_admin(policy):
        return [], [(f"admin {who.username!r} {lift.act}; the device is not attested clean", lift.path, ())]
    return [
        (
            f"user {who.username!r} {lift.act}: only the scrubgate node agent lifts or changes its fences, after "
            f"a verified scrub, since the device may still hold a tenant's data; members of the policy's admin "
            f"groups ({', '.join(policy.admin_groups) or 'none configured'}) may, and are audited",
            lift.path,
            (),
        )
    ], []


def _pod_done(pod: dict[str, Any]) -> bool:
    """A pod whose containers are gone or never ran: its final deletion (the kubelet deletes with grace 0
    after the containers stopped) skips no teardown."""
    spec, status = as_dict(pod.get("spec")), as_dict(pod.get("status"))
    if not spec.get("nodeName") or status.get("phase") in TERMINAL_PHASES:
        return True
    if not metadata(pod).get("deletionTimestamp"):
        return False
    statuses = [as_dict(s) for key in ("initContainerStatuses", "containerStatuses") for s in as_list(status.get(key))]
    return bool(statuses) and all("terminated" in as_dict(s.get("state")) for s in statuses)


def force_delete(
    pod: dict[str, Any], options: Mapping[str, Any] | None, groups: tuple[str, ...], policy: PolicyConfig
) -> list[Violation]:
    """SG008 on a DELETE of a GPU pod. A pod already terminal (the pod GC marks a pod of a lost node Failed
    before it deletes it with grace 0) runs nothing that a graceful delete would stop, and its claim's
    allocation stays guarded by SG007 until its devices are attested clean."""
    ref = pod_spec(pod)
    grace = as_dict(options).get("gracePeriodSeconds")
    if ref is None or not is_gpu_pod(ref, policy) or grace != 0 or _pod_done(pod):
        return []
    if any(group in policy.admin_groups for group in groups):
        return []
    return [
        (
            "pod with DRA claims deleted with grace period 0 (force): delete it without --force --grace-period=0 "
            "so its devices are unprepared and scrubbed; only the policy's admin groups may force-delete",
            "/spec",
            (),
        )
    ]


def force_evict(eviction: dict[str, Any], groups: tuple[str, ...], policy: PolicyConfig) -> list[Violation]:
    """SG008 on an Eviction (`pods/eviction`): the API server deletes the pod with the eviction's
    deleteOptions and runs no admission for that DELETE. The webhook sees the Eviction only, not the pod, so a
    grace period of 0 is refused whatever the pod (fail closed); evictions that keep the pod's grace period
    (kubectl drain, the autoscalers) pass."""
    if as_dict(eviction.get("deleteOptions")).get("gracePeriodSeconds") != 0:
        return []
    if any(group in policy.admin_groups for group in groups):
        return []
    return [
        (
            "eviction with deleteOptions.gracePeriodSeconds 0 (a force delete): evict without gracePeriodSeconds "
            "(e.g. kubectl drain without --grace-period=0) so the pod's devices are unprepared and scrubbed; only "
            "the policy's admin groups may force-evict",
            "/deleteOptions/gracePeriodSeconds",
            (),
        )
    ]


# DeviceClass selectors name their driver in CEL: `device.driver == "gpu.nvidia.com"` (either side, either quote).
_DRIVER_COMPARISON = re.compile(
    r"""device\.driver\s*==\s*(["'])(?P<a>[^"']+)\1|(["'])(?P<b>[^"']+)\3\s*==\s*device\.driver"""
)


def selected_drivers(device_class: dict[str, Any]) -> list[tuple[str, str]]:
    """(driver, JSON pointer of its expression) for each driver a DeviceClass's CEL selectors compare with."""
    found = []
    for index, selector in enumerate(as_list(as_dict(device_class.get("spec")).get("selectors"))):
        expression = as_str(as_dict(as_dict(selector).get("cel")).get("expression"))
        for match in _DRIVER_COMPARISON.finditer(expression):
            found.append(
                (match.group("a") or match.group("b"), pointer("spec", "selectors", index, "cel", "expression"))
            )
    return found


def gpu_class_coverage(device_class: dict[str, Any], policy: PolicyConfig) -> list[Violation]:
    """SG009: a DeviceClass that hands out a GPU driver's devices under a name the policy does not count as a
    GPU class would put its claims out of every guard (no finalizer, tolerations and adminAccess allowed).
    Whether it does is decided from what its selectors select (policies/selectors.py), not from its name; one
    that cannot be decided is refused too. Excluded classes (vfio-pci) are the operator's explicit choice. A
    GPU class advertised as an extended resource (KEP-5004) must be one the policy knows, or pods asking for
    it would not count as GPU pods."""
    name = as_str(metadata(device_class).get("name"))
    if policy.is_excluded_class(name):
        return []
    found: list[Violation] = []
    is_gpu = policy.is_gpu_class(name)
    selects_gpus = False
    if not is_gpu:
        selectors = [
            (
                as_str(as_dict(as_dict(selector).get("cel")).get("expression")),
                pointer("spec", "selectors", index, "cel", "expression"),
            )
            for index, selector in enumerate(as_list(as_dict(device_class.get("spec")).get("selectors")))
        ]
        verdict = gpu_verdict(selectors, policy.gpu_drivers)
        compared = [(driver, path) for driver, path in selected_drivers(device_class) if driver in policy.gpu_drivers]
        if verdict.outcome == "undecided" and compared:  # it compares the driver with a GPU driver's name
            verdict = Verdict("selects", f"{compared[0][0]} devices", compared[0][1], compared[0][0])
        fix = (
            f"add {name!r} to gpuDeviceClasses in the scrubgate policy (or to excludeDeviceClasses if no agent can "
            f"scrub its devices), then create it"
        )
        if verdict.outcome == "selects":
            selects_gpus = True
            found.append(
                (
                    f"DeviceClass {name!r} selects devices of the GPU driver {verdict.driver} ({verdict.what}), but "
                    f"scrubgate's policy does not count it as a GPU class, so its claims would get no scrub: {fix}",
                    verdict.path,
                    (),
                )
            )
        elif verdict.outcome == "undecided":
            found.append(
                (
                    f"scrubgate cannot tell whether DeviceClass {name!r} hands out GPUs ({verdict.what}), so it does "
                    f"not let it in unguarded: {fix}",
                    verdict.path,
                    (),
                )
            )
    extended = as_str(as_dict(device_class.get("spec")).get("extendedResourceName"))
    if extended and (is_gpu or selects_gpus) and not policy.is_gpu_extended_resource(extended):
        found.append(
            (
                f"DeviceClass {name!r} is a GPU class offered as the extended resource {extended!r}, which "
                f"scrubgate's policy does not list: add {extended!r} to gpuExtendedResources in the scrubgate "
                f"policy so that pods asking for it are guarded as GPU pods",
                "/spec/extendedResourceName",
                (),
            )
        )
    return found


def tenancy_label(
    obj: dict[str, Any], old: dict[str, Any] | None, who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG010 on a Namespace CREATE or UPDATE that sets, changes or removes the tenancy label: `trusted`
    switches SG001, SG006 and SG002 for pods off in the namespace, so only the policy's admin groups may
    change it, and every change is recorded. Returns (violations, admin changes to audit)."""
    label = policy.tenancy.label

    def value(namespace: dict[str, Any] | None) -> str | None:
        labels = as_dict(metadata(namespace or {}).get("labels"))
        return as_str(labels[label]) if label in labels else None

    before, after = value(old), value(obj)
    if before == after:
        return [], []
    name = as_str(metadata(obj).get("name"))
    change = f"{label} of namespace {name!r} from {before!r} to {after!r}"
    path = pointer("metadata", "labels", label)
    if who.is_admin(policy):
        return [], [(f"admin {who.username!r} changed {change}", path, ())]
    return [
        (
            f"user {who.username!r} changed {change}: only members of the policy's admin groups "
            f"({', '.join(policy.admin_groups) or 'none configured'}) may set or remove it, since "
            f"{label}={policy.tenancy.trusted_value} lifts scrubgate's multi-tenant rules in the namespace",
            path,
            (),
        )
    ], []


def pod_group_claims(pod_group: dict[str, Any]) -> list[Violation]:
    """SG002 for a PodGroup in a multi-tenant namespace: each of its `spec.resourceClaims` is one claim that
    every pod of the group shares, and scrubbed only when the whole group is done."""
    return [
        (
            f"PodGroup claim {as_str(as_dict(entry).get('name')) or '?'!r} is shared by every pod of the group: "
            f"leave it out of the PodGroup and give each pod its own claim (resourceClaimTemplateName in the pod "
            f"template), or run the group in a namespace labelled {names.TENANCY_LABEL}={names.TENANCY_TRUSTED}",
            pointer("spec", "resourceClaims", index),
            (),
        )
        for index, entry in enumerate(as_list(as_dict(pod_group.get("spec")).get("resourceClaims")))
    ]


def group_reservation(claim: dict[str, Any]) -> list[Violation]:
    """SG002 for a GPU claim in a multi-tenant namespace reserved for a consumer that is not a pod (a PodGroup):
    the pods behind it share the claim."""
    return [
        (
            f"GPU ResourceClaim is reserved for {resource} {name!r}, not for one pod: its pods share the device; "
            f"give each pod its own claim, or label the namespace {names.TENANCY_LABEL}={names.TENANCY_TRUSTED}",
            "/status/reservedFor",
            (),
        )
        for resource, name, _ in reserved_consumers(claim)
        if resource != "pods"
    ]
