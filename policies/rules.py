"""The rules SG001-SG006, SG008-SG010 (docs/rules.md) as pure functions; SG007 lives in release_guard.py
(claims) and fence_guard.py (fences and an agent's other writes).

Each rule takes the object and what it needs to know, and returns `(message, path, patch)` violations;
the engine turns them into findings with the action the policy gives the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import names
from .attestation import is_agent_reservation, is_ended_pod, reserved_consumers
from .config import PolicyConfig
from .findings import Violation, pointer
from .model import (
    DeviceRequest,
    PodSpecRef,
    as_dict,
    as_list,
    as_str,
    metadata,
    pod_claims,
    pod_spec,
)
from .requester import Requester
from .scope import Scope, is_gpu_pod
from .selectors import class_verdict

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


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


def shared_claim(
    ref: PodSpecRef, is_pod: bool, holds_no_gpu: Callable[[str], bool] = lambda _: False
) -> list[Violation]:
    """SG002, for a workload's pod template, or a pod in a multi-tenant namespace; a claim known to hold no GPU
    (`holds_no_gpu`: in CI, a claim among the manifests whose classes are all left out, an IMEX channel) is
    no GPU shared."""
    holder = "pod" if is_pod else "pod template"
    return [
        (
            f"{holder} names ResourceClaim {claim.claim_name!r} in resourceClaims[{claim.name or '?'}]: use "
            f"resourceClaimTemplateName so each pod gets its own claim, scrubbed when the pod ends",
            pointer(*claim.claim_name_path),
            (),
        )
        for claim in pod_claims(ref)
        if claim.claim_name and not holds_no_gpu(claim.claim_name)
    ]


def grace_period(ref: PodSpecRef, scope: Scope, manifest: bool) -> list[Violation]:
    """SG003, for a GPU pod spec. Absence counts only in manifests: the API server defaults the field (30 s)
    before any admission webhook sees the pod."""
    if not is_gpu_pod(ref, scope):
        return []
    limits = scope.policy.grace_period
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


def fence_toleration(requests: list[DeviceRequest], scope: Scope, trusted: bool) -> list[Violation]:
    """SG005: a device request that tolerates the fence (or every taint) can be allocated a dirty device. Every
    request of every claim counts, whatever its class: no device of another vendor carries scrubgate's taints,
    so a toleration of them is only ever a way past the fence. A toleration of every taint (`operator: Exists`
    without a key) is refused in a request that may get a GPU, and in every request in a multi-tenant
    namespace (the class's name proves nothing)."""
    found = []
    for request in requests:
        keyless = not trusted or any(scope.is_gpu_class(c) for c in request.device_classes())
        for choice in request.choices:
            for index, toleration in enumerate(as_list(choice.fields.get("tolerations"))):
                if _tolerates_fence(toleration, keyless_exists=keyless):
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


def pod_fence_toleration(ref: PodSpecRef, scope: Scope, trusted: bool) -> list[Violation]:
    """SG005 for GPU pods: where no DeviceTaintRule API is served the agent fences with a node taint, which a
    pod toleration of a scrubgate.dev/ key, or of every taint (`operator: Exists` without a key, whatever
    its effect), would defeat. In a single-tenant namespace a key-less toleration is left alone (a tenant's
    own device). A pod without GPU claims (the agent itself, system DaemonSets) gets no GPU through the fence,
    so its tolerations are none of this rule's business."""
    if not is_gpu_pod(ref, scope):
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
    """SG006, in a multi-tenant namespace, on every request of every claim: admin access reaches devices that
    other claims hold, and a class's name proves nothing about which devices those are."""
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
    pod: dict[str, Any], options: Mapping[str, Any] | None, groups: tuple[str, ...], scope: Scope
) -> list[Violation]:
    """SG008 on a DELETE of a GPU pod. A pod already terminal (the pod GC marks a pod of a lost node Failed
    before it deletes it with grace 0) runs nothing that a graceful delete would stop, and its claim's
    allocation stays guarded by SG007 until its devices are attested clean."""
    ref = pod_spec(pod)
    grace = as_dict(options).get("gracePeriodSeconds")
    if ref is None or not is_gpu_pod(ref, scope) or grace != 0 or _pod_done(pod):
        return []
    if any(group in scope.policy.admin_groups for group in groups):
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


def gpu_class_coverage(device_class: dict[str, Any], scope: Scope) -> list[Violation]:
    """SG009. Whether a class hands out GPUs needs no rule: any class its selectors do not prove unable to is
    guarded (policies/scope.py). Two things still need the operator's hand:
    - a class the policy excludes (`excludeDeviceClasses`: no guard, its claims skip the webhook) must prove, by
      its selectors, that it hands out no `gpu` or `mig` device of a GPU driver; otherwise its name would let
      GPU claims past every guard;
    - a GPU class offered as an extended resource (KEP-5004) must be one of gpuExtendedResources, or pods asking
      for it would not reach the webhook as GPU pods."""
    policy = scope.policy
    name = as_str(metadata(device_class).get("name"))
    verdict = class_verdict(device_class, policy.gpu_drivers)
    found: list[Violation] = []
    if policy.is_excluded_class(name) and verdict.gpu_memory:
        found.append(
            (
                f"DeviceClass {name!r} is in the scrubgate policy's excludeDeviceClasses (no guard, its claims skip "
                f"the webhook), but its selectors do not prove it hands out no gpu or mig device of a GPU driver: "
                f'{verdict.why}. Add a top-level conjunct naming its driver (`device.driver == "..."`) or, for '
                f'a GPU driver\'s other devices, their type (`device.attributes["<driver>"].type == "vfio"`); '
                f"or take {name!r} out of excludeDeviceClasses so that its claims are guarded",
                verdict.path,
                (),
            )
        )
    gpu = verdict.gpu and not (policy.is_excluded_class(name) and not verdict.gpu_memory)
    extended = verdict.extended_resource
    if extended and (gpu or policy.names_gpu_class(name)) and not policy.names_gpu_extended_resource(extended):
        found.append(
            (
                f"DeviceClass {name!r} may hand out GPUs ({verdict.why}) and is offered as the extended resource "
                f"{extended!r}, which scrubgate's policy does not list: add {extended!r} to gpuExtendedResources "
                f"in the scrubgate policy so that pods asking for it are guarded as GPU pods, or make its selectors "
                f'name its driver (`device.driver == "..."`) if it hands out no GPU',
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
        if resource != "pods" and not is_agent_reservation(resource) and not is_ended_pod(resource)
    ]
