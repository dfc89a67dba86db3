"""Per-resource behaviour of the API server's registry strategies, for the fields the system uses:
defaulting, what create/update may set, and the validation our components depend on.

Validation is deliberately partial: names, immutable specs (Pod, ResourceClaim,
ResourceClaimTemplate), the shape of device requests and the ResourceClaim status rules
(allocation set once or cleared, ``reservedFor`` only while allocated, unique consumers). It is
not the API server's full OpenAPI validation.
"""

from __future__ import annotations

import re

from .resources import CLAIM_TEMPLATES, CLAIMS, NAMESPACES, NODES, PODS, ResourceType

Causes = list[tuple[str, str]]

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Pod spec fields an update may change (api/pod validation: image, activeDeadlineSeconds,
# tolerations, schedulingGates); everything else is immutable.
_MUTABLE_POD_SPEC = ("activeDeadlineSeconds", "tolerations", "schedulingGates")


def apply_defaults(rt: ResourceType, obj: dict) -> None:
    """Defaulting the API server applies when it decodes a request (and again after mutation)."""
    meta = obj.setdefault("metadata", {})
    if rt is NAMESPACES:
        if meta.get("name"):
            meta.setdefault("labels", {})[NAMESPACE_NAME_LABEL] = meta["name"]
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
    elif rt is PODS:
        spec = obj.setdefault("spec", {})
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("serviceAccountName", "default")
        spec.setdefault("dnsPolicy", "ClusterFirst")
    elif rt is CLAIMS:
        _default_requests(((obj.get("spec") or {}).get("devices") or {}).get("requests"))
    elif rt is CLAIM_TEMPLATES:
        inner = (obj.get("spec") or {}).get("spec") or {}
        _default_requests((inner.get("devices") or {}).get("requests"))


def _default_requests(requests: object) -> None:
    if not isinstance(requests, list):
        return
    for request in requests:
        if not isinstance(request, dict):
            continue
        targets = [request.get("exactly"), *list(request.get("firstAvailable") or [])]
        for target in targets:
            if not isinstance(target, dict):
                continue
            target.setdefault("allocationMode", "ExactCount")
            if target["allocationMode"] == "ExactCount":
                target.setdefault("count", 1)
            for toleration in target.get("tolerations") or []:
                if isinstance(toleration, dict):
                    toleration.setdefault("operator", "Equal")


def drop_empty(obj: dict) -> None:
    """Empty metadata lists and maps are absent on the wire (Go's ``omitempty``), as is an empty
    ``status.reservedFor``; clients compare against absence."""
    meta = obj.get("metadata") or {}
    for name in ("labels", "annotations", "finalizers", "ownerReferences", "managedFields"):
        if name in meta and not meta[name]:
            del meta[name]
    status = obj.get("status")
    if isinstance(status, dict) and "reservedFor" in status and not status["reservedFor"]:
        del status["reservedFor"]


def initial_status(rt: ResourceType, obj: dict) -> None:
    """Status on create: what a create may not set is reset (PrepareForCreate)."""
    if not rt.status or rt is NODES:
        return
    if rt is PODS:
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    elif rt is NAMESPACES:
        obj["status"] = {"phase": "Active"}
    else:
        obj.pop("status", None)


def validate(rt: ResourceType, obj: dict, old: dict | None) -> Causes:
    causes: Causes = []
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or "")
    pattern, limit = (_DNS_LABEL, 63) if rt is NAMESPACES else (_DNS_SUBDOMAIN, 253)
    if not pattern.match(name) or len(name) > limit:
        causes.append(("metadata.name", f"Invalid value: {name!r}: must be a lowercase RFC 1123 name"))
    for finalizer in meta.get("finalizers") or []:
        if not isinstance(finalizer, str) or not finalizer:
            causes.append(("metadata.finalizers", f"Invalid value: {finalizer!r}"))
    if rt is CLAIMS:
        causes += _validate_claim_spec((obj.get("spec") or {}).get("devices"), "spec.devices")
        causes += _validate_claim_status(obj.get("status") or {}, (old or {}).get("status") or {})
    elif rt is CLAIM_TEMPLATES:
        causes += _validate_claim_spec(((obj.get("spec") or {}).get("spec") or {}).get("devices"), "spec.spec.devices")
    if old is not None:
        causes += _validate_immutable(rt, obj, old)
    return causes


def _validate_immutable(rt: ResourceType, obj: dict, old: dict) -> Causes:
    if rt in (CLAIMS, CLAIM_TEMPLATES) and obj.get("spec") != old.get("spec"):
        return [("spec", "Invalid value: field is immutable")]
    if rt is PODS and _pod_spec_core(obj) != _pod_spec_core(old):
        return [
            (
                "spec",
                "Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                "`spec.activeDeadlineSeconds`, `spec.tolerations` (only additions), "
                "`spec.schedulingGates` (only removals)",
            )
        ]
    return []


def _pod_spec_core(pod: dict) -> dict:
    spec = {k: v for k, v in (pod.get("spec") or {}).items() if k not in _MUTABLE_POD_SPEC}
    spec["containers"] = [{k: v for k, v in c.items() if k != "image"} for c in spec.get("containers") or []]
    return spec


def _validate_claim_spec(devices: object, path: str) -> Causes:
    if devices is None:
        return []
    if not isinstance(devices, dict):
        return [(path, "Invalid value: must be an object")]
    causes: Causes = []
    names: set[str] = set()
    for i, request in enumerate(devices.get("requests") or []):
        where = f"{path}.requests[{i}]"
        if not isinstance(request, dict) or not request.get("name"):
            causes.append((f"{where}.name", "Required value"))
            continue
        if request["name"] in names:
            causes.append((f"{where}.name", f"Duplicate value: {request['name']!r}"))
        names.add(request["name"])
        exactly, first = request.get("exactly"), request.get("firstAvailable")
        if (exactly is None) == (first is None):
            causes.append((where, "Invalid value: exactly one of `exactly` or `firstAvailable` is required"))
        for j, target in enumerate([exactly] if exactly is not None else list(first or [])):
            sub = f"{where}.exactly" if exactly is not None else f"{where}.firstAvailable[{j}]"
            if not isinstance(target, dict) or not target.get("deviceClassName"):
                causes.append((f"{sub}.deviceClassName", "Required value"))
            elif target.get("allocationMode") not in ("ExactCount", "All"):
                causes.append((f"{sub}.allocationMode", f"Unsupported value: {target.get('allocationMode')!r}"))
    return causes


def _validate_claim_status(status: dict, old_status: dict) -> Causes:
    causes: Causes = []
    allocation, old_allocation = status.get("allocation"), old_status.get("allocation")
    if old_allocation is not None and allocation is not None and allocation != old_allocation:
        causes.append(("status.allocation", "Invalid value: field is immutable once set; clear it first"))
    reserved = status.get("reservedFor") or []
    if reserved and allocation is None:
        causes.append(("status.reservedFor", "Forbidden: may not be specified when `allocation` is not set"))
    uids: set[str] = set()
    for i, ref in enumerate(reserved):
        if not isinstance(ref, dict) or not ref.get("resource") or not ref.get("name") or not ref.get("uid"):
            causes.append((f"status.reservedFor[{i}]", "Required value: resource, name and uid"))
            continue
        if ref["uid"] in uids:
            causes.append((f"status.reservedFor[{i}].uid", f"Duplicate value: {ref['uid']!r}"))
        uids.add(ref["uid"])
    return causes
