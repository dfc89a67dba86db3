"""Reads the parts of Kubernetes objects that the rules need, across every API version that carries them.

Objects are plain dicts as decoded from YAML or JSON. Nothing here trusts a field's type: a field of the
wrong type reads as absent, so that malformed input yields findings or nothing, never an exception.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import names
from .findings import pointer

RESOURCE_API_VERSIONS = frozenset(
    {"resource.k8s.io/v1", "resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1", "resource.k8s.io/v1alpha3"}
)
CLAIM_KINDS = frozenset({"ResourceClaim", "ResourceClaimTemplate"})

# kind -> (apiVersions that carry it, path from the object to its PodSpec)
POD_SPEC_PATHS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "Pod": (frozenset({"v1"}), ("spec",)),
    "PodTemplate": (frozenset({"v1"}), ("template", "spec")),
    "ReplicationController": (frozenset({"v1"}), ("spec", "template", "spec")),
    "Deployment": (frozenset({"apps/v1", "apps/v1beta2", "apps/v1beta1"}), ("spec", "template", "spec")),
    "StatefulSet": (frozenset({"apps/v1", "apps/v1beta2", "apps/v1beta1"}), ("spec", "template", "spec")),
    "ReplicaSet": (frozenset({"apps/v1", "apps/v1beta2"}), ("spec", "template", "spec")),
    "DaemonSet": (frozenset({"apps/v1", "apps/v1beta2"}), ("spec", "template", "spec")),
    "Job": (frozenset({"batch/v1"}), ("spec", "template", "spec")),
    "CronJob": (frozenset({"batch/v1", "batch/v1beta1"}), ("spec", "jobTemplate", "spec", "template", "spec")),
}
WORKLOAD_KINDS = frozenset(POD_SPEC_PATHS) - {"Pod"}


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def kind_of(obj: dict[str, Any]) -> tuple[str, str]:
    return as_str(obj.get("apiVersion")), as_str(obj.get("kind"))


def metadata(obj: dict[str, Any]) -> dict[str, Any]:
    return as_dict(obj.get("metadata"))


def annotations(obj: dict[str, Any]) -> dict[str, Any]:
    return as_dict(metadata(obj).get("annotations"))


def claim_metadatas(obj: dict[str, Any]) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """The metadata a claim gets from a new claim or template, with where each is: a claim's own, and a
    template's `spec.metadata` too (copied into every claim generated from it)."""
    places = [("metadata",)]
    if as_str(obj.get("kind")) == "ResourceClaimTemplate":
        places.append(("spec", "metadata"))
    found = []
    for place in places:
        node: Any = obj
        for key in place:
            node = as_dict(node).get(key)
        found.append((place, as_dict(node)))
    return found


def is_claim(obj: dict[str, Any]) -> bool:
    api_version, kind = kind_of(obj)
    return kind in CLAIM_KINDS and api_version in RESOURCE_API_VERSIONS


def is_pod_carrier(obj: dict[str, Any]) -> bool:
    api_version, kind = kind_of(obj)
    known = POD_SPEC_PATHS.get(kind)
    return known is not None and api_version in known[0]


def is_known(obj: Any) -> bool:
    """A kind and version the rules read; everything else is passed over."""
    return isinstance(obj, dict) and (is_claim(obj) or is_pod_carrier(obj))


def is_device_class(obj: dict[str, Any]) -> bool:
    api_version, kind = kind_of(obj)
    return kind == "DeviceClass" and api_version in RESOURCE_API_VERSIONS


def is_namespace(obj: dict[str, Any]) -> bool:
    return kind_of(obj) == ("v1", "Namespace")


def is_node(obj: dict[str, Any]) -> bool:
    return kind_of(obj) == ("v1", "Node")


def is_eviction(obj: dict[str, Any]) -> bool:
    api_version, kind = kind_of(obj)
    return kind == "Eviction" and api_version in ("policy/v1", "policy/v1beta1")


def is_pod_group(obj: dict[str, Any]) -> bool:
    """A PodGroup of the workload API (1.36 alpha): its `spec.resourceClaims` are one claim per group, which
    every pod of the group shares."""
    api_version, kind = kind_of(obj)
    return kind == "PodGroup" and api_version.startswith(names.SCHEDULING_GROUP + "/")


def is_taint_rule(obj: dict[str, Any]) -> bool:
    api_version, kind = kind_of(obj)
    return kind == "DeviceTaintRule" and api_version in RESOURCE_API_VERSIONS


def fence_key(obj: dict[str, Any]) -> str:
    """The `scrubgate.dev/` taint key a DeviceTaintRule puts on devices: scrubgate's fence. "" for any other
    object, or a rule with another key. DeviceTaintRule is served in v1, v1beta2 and v1alpha3; any
    resource.k8s.io version counts, so that no version can slip past the guard."""
    if not is_taint_rule(obj):
        return ""
    key = as_str(as_dict(as_dict(obj.get("spec")).get("taint")).get("key"))
    return key if key.startswith(names.DOMAIN + "/") else ""


@dataclass(frozen=True, slots=True)
class PodSpecRef:
    spec: dict[str, Any]
    path: tuple[str, ...]

    @property
    def pointer(self) -> str:
        return pointer(*self.path)


def pod_spec(obj: dict[str, Any]) -> PodSpecRef | None:
    """The PodSpec of a Pod or of the pod template a workload embeds."""
    known = POD_SPEC_PATHS.get(as_str(obj.get("kind")))
    if known is None or as_str(obj.get("apiVersion")) not in known[0]:
        return None
    node: Any = obj
    for key in known[1]:
        node = as_dict(node).get(key)
    if not isinstance(node, dict):
        return None
    return PodSpecRef(node, known[1])


@dataclass(frozen=True, slots=True)
class PodClaim:
    """One entry of `spec.resourceClaims`: a claim by name (shared) or a template (one claim per pod)."""

    name: str
    claim_name: str
    template_name: str
    path: tuple[str | int, ...]
    # The field that names the claim, for line numbers: `resourceClaimName` or, before 1.31, `source.resourceClaimName`.
    claim_name_path: tuple[str | int, ...]


def pod_claims(ref: PodSpecRef) -> list[PodClaim]:
    claims = []
    for index, entry in enumerate(as_list(ref.spec.get("resourceClaims"))):
        entry = as_dict(entry)
        base = (*ref.path, "resourceClaims", index)
        # Kubernetes 1.26-1.30 nested the reference under `source`; 1.31+ put it on the entry.
        source = as_dict(entry.get("source"))
        holder, holder_path = (source, (*base, "source")) if source else (entry, base)
        claims.append(
            PodClaim(
                name=as_str(entry.get("name")),
                claim_name=as_str(holder.get("resourceClaimName")),
                template_name=as_str(holder.get("resourceClaimTemplateName")),
                path=base,
                claim_name_path=(*holder_path, "resourceClaimName"),
            )
        )
    return claims


@dataclass(frozen=True, slots=True)
class ExtendedResource:
    """One extended resource a container asks for (requests or limits): a device plugin's, or since
    KEP-5004 one that the scheduler turns into a ResourceClaim."""

    name: str
    path: tuple[str | int, ...]


def extended_resources(ref: PodSpecRef) -> list[ExtendedResource]:
    """The domain-prefixed resource names (`vendor.com/x`) in the resources of every container and init
    container; cpu, memory and the like have no `/`."""
    found = []
    for containers in ("initContainers", "containers"):
        for index, container in enumerate(as_list(ref.spec.get(containers))):
            resources = as_dict(as_dict(container).get("resources"))
            for section in ("requests", "limits"):
                for name in as_dict(resources.get(section)):
                    if isinstance(name, str) and "/" in name:
                        found.append(ExtendedResource(name, (*ref.path, containers, index, "resources", section, name)))
    return found


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """One way a request can be satisfied: the request itself (v1beta1/v1alpha3 flat shape), its `exactly`
    (v1/v1beta2), or one of its `firstAvailable` subrequests."""

    fields: dict[str, Any]
    path: tuple[str | int, ...]

    @property
    def device_class(self) -> str:
        return as_str(self.fields.get("deviceClassName"))


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    name: str
    path: tuple[str | int, ...]
    choices: tuple[DeviceChoice, ...]

    def device_classes(self) -> Iterator[str]:
        return (c.device_class for c in self.choices if c.device_class)


def claim_spec_path(obj: dict[str, Any]) -> tuple[str, ...]:
    return ("spec", "spec") if as_str(obj.get("kind")) == "ResourceClaimTemplate" else ("spec",)


def device_requests(obj: dict[str, Any]) -> list[DeviceRequest]:
    spec_path = claim_spec_path(obj)
    spec: Any = obj
    for key in spec_path:
        spec = as_dict(spec).get(key)
    requests = []
    for index, raw in enumerate(as_list(as_dict(as_dict(spec).get("devices")).get("requests"))):
        if not isinstance(raw, dict):
            continue
        path = (*spec_path, "devices", "requests", index)
        choices = [DeviceChoice(raw, path)]
        exactly = raw.get("exactly")
        if isinstance(exactly, dict):
            choices.append(DeviceChoice(exactly, (*path, "exactly")))
        for sub_index, sub in enumerate(as_list(raw.get("firstAvailable"))):
            if isinstance(sub, dict):
                choices.append(DeviceChoice(sub, (*path, "firstAvailable", sub_index)))
        requests.append(DeviceRequest(as_str(raw.get("name")), path, tuple(choices)))
    return requests
