"""The resources the stand-in serves, which API versions serve them, and the discovery documents."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

RESOURCE_GROUP = "resource.k8s.io"
# Newest first: the order discovery prefers them in.
RESOURCE_VERSIONS: tuple[str, ...] = ("v1", "v1beta2", "v1beta1", "v1alpha3")
# Storage ("hub") version of every resource.k8s.io type; other versions are converted on the way.
HUB_VERSION = "v1"

VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
SUBRESOURCE_VERBS = ["get", "patch", "update"]
COMMON_FIELD_LABELS = ("metadata.name", "metadata.namespace")


@dataclass(frozen=True)
class ResourceType:
    group: str
    plural: str
    kind: str
    namespaced: bool
    versions: tuple[str, ...]
    status: bool = False
    short_names: tuple[str, ...] = ()
    field_labels: tuple[str, ...] = ()

    @property
    def group_resource(self) -> str:
        """``pods`` or ``resourceclaims.resource.k8s.io``: how the API server names it in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version

    def supports_field(self, label: str) -> bool:
        return label in COMMON_FIELD_LABELS or label in self.field_labels


def _resource_types() -> list[ResourceType]:
    core = ("v1",)
    dra = RESOURCE_VERSIONS
    return [
        ResourceType(
            "", "namespaces", "Namespace", False, core, status=True, short_names=("ns",), field_labels=("status.phase",)
        ),
        ResourceType(
            "", "nodes", "Node", False, core, status=True, short_names=("no",), field_labels=("spec.unschedulable",)
        ),
        ResourceType(
            "",
            "pods",
            "Pod",
            True,
            core,
            status=True,
            short_names=("po",),
            field_labels=(
                "spec.nodeName",
                "status.phase",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.restartPolicy",
            ),
        ),
        ResourceType(
            "",
            "events",
            "Event",
            True,
            core,
            short_names=("ev",),
            field_labels=(
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "reason",
                "type",
            ),
        ),
        ResourceType(
            "events.k8s.io",
            "events",
            "Event",
            True,
            core,
            short_names=("ev",),
            field_labels=("regarding.kind", "regarding.namespace", "regarding.name", "regarding.uid", "reason", "type"),
        ),
        ResourceType("coordination.k8s.io", "leases", "Lease", True, core),
        ResourceType(
            "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "MutatingWebhookConfiguration", False, core
        ),
        ResourceType(
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            "ValidatingWebhookConfiguration",
            False,
            core,
        ),
        ResourceType(RESOURCE_GROUP, "resourceclaims", "ResourceClaim", True, dra, status=True),
        ResourceType(RESOURCE_GROUP, "resourceclaimtemplates", "ResourceClaimTemplate", True, dra),
        ResourceType(
            RESOURCE_GROUP, "resourceslices", "ResourceSlice", False, dra, field_labels=("spec.nodeName", "spec.driver")
        ),
        ResourceType(RESOURCE_GROUP, "deviceclasses", "DeviceClass", False, dra),
        # Real servers have no DeviceTaintRule in v1beta1.
        ResourceType(
            RESOURCE_GROUP, "devicetaintrules", "DeviceTaintRule", False, ("v1", "v1beta2", "v1alpha3"), status=True
        ),
    ]


RESOURCE_TYPES: tuple[ResourceType, ...] = tuple(_resource_types())
_BY_GROUP_PLURAL = {(rt.group, rt.plural): rt for rt in RESOURCE_TYPES}


def resource_type(group: str, plural: str) -> ResourceType:
    return _BY_GROUP_PLURAL[(group, plural)]


def kind_known(api_version: str, kind: str) -> bool:
    """Whether the stand-in stores objects of this kind (an ownerReference's apiVersion and kind)."""
    group = api_version.rpartition("/")[0]
    return any(rt.group == group and rt.kind == kind for rt in RESOURCE_TYPES)


PODS = resource_type("", "pods")
NAMESPACES = resource_type("", "namespaces")
NODES = resource_type("", "nodes")
CLAIMS = resource_type(RESOURCE_GROUP, "resourceclaims")
CLAIM_TEMPLATES = resource_type(RESOURCE_GROUP, "resourceclaimtemplates")
SLICES = resource_type(RESOURCE_GROUP, "resourceslices")
DEVICE_CLASSES = resource_type(RESOURCE_GROUP, "deviceclasses")
TAINT_RULES = resource_type(RESOURCE_GROUP, "devicetaintrules")
MUTATING_WEBHOOKS = resource_type("admissionregistration.k8s.io", "mutatingwebhookconfigurations")
VALIDATING_WEBHOOKS = resource_type("admissionregistration.k8s.io", "validatingwebhookconfigurations")


@dataclass(frozen=True)
class Surface:
    """Which (group, version) serves which resources: lets a test play an older or partial cluster.

    ``resource_versions`` are the resource.k8s.io versions served at all; ``taint_rule_versions`` those
    of them that also serve DeviceTaintRule (the agent's fence), so "no DeviceTaintRule in v1" or
    "none at all" can be tested.
    """

    resource_versions: tuple[str, ...] = RESOURCE_VERSIONS
    taint_rule_versions: tuple[str, ...] = ("v1", "v1beta2", "v1alpha3")
    served: dict[tuple[str, str], dict[str, ResourceType]] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        unknown = set(self.resource_versions) - set(RESOURCE_VERSIONS)
        if unknown:
            raise ValueError(f"unknown resource.k8s.io versions {sorted(unknown)}; known: {RESOURCE_VERSIONS}")
        served: dict[tuple[str, str], dict[str, ResourceType]] = {}
        for rt in RESOURCE_TYPES:
            for version in rt.versions:
                if rt.group == RESOURCE_GROUP and not self._serves_dra(rt, version):
                    continue
                served.setdefault((rt.group, version), {})[rt.plural] = rt
        object.__setattr__(self, "served", served)

    def _serves_dra(self, rt: ResourceType, version: str) -> bool:
        if version not in self.resource_versions:
            return False
        return rt is not TAINT_RULES or version in self.taint_rule_versions

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.served.get((group, version), {}).get(plural)

    def versions_of(self, rt: ResourceType) -> list[str]:
        """Served versions of a resource, preferred first."""
        return [v for v in rt.versions if self.serves(rt, v)]

    def serves(self, rt: ResourceType, version: str) -> bool:
        return self.lookup(rt.group, version, rt.plural) is rt

    def preferred_version(self, rt: ResourceType) -> str | None:
        versions = self.versions_of(rt)
        return versions[0] if versions else None

    def group_versions(self, group: str) -> list[str]:
        order = RESOURCE_VERSIONS if group == RESOURCE_GROUP else ("v1",)
        return [v for v in order if (group, v) in self.served]

    def groups(self) -> list[str]:
        seen: list[str] = []
        for group, _ in self.served:
            if group and group not in seen:
                seen.append(group)
        return seen


def surface_from_args(resource_versions: Sequence[str] | None, taint_rule_versions: Sequence[str] | None) -> Surface:
    kwargs: dict[str, tuple[str, ...]] = {}
    if resource_versions is not None:
        kwargs["resource_versions"] = tuple(resource_versions)
    if taint_rule_versions is not None:
        kwargs["taint_rule_versions"] = tuple(taint_rule_versions)
    return Surface(**kwargs)


# ---------------------------------------------------------------- discovery documents


def api_versions(server_address: str) -> dict:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def api_group_list(surface: Surface) -> dict:
    groups = []
    for group in surface.groups():
        versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in surface.group_versions(group)]
        groups.append({"name": group, "versions": versions, "preferredVersion": versions[0]})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(surface: Surface, group: str) -> dict | None:
    versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in surface.group_versions(group)]
    if not versions:
        return None
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": versions,
        "preferredVersion": versions[0],
    }


def api_resource_list(surface: Surface, group: str, version: str) -> dict | None:
    served = surface.served.get((group, version))
    if served is None:
        return None
    resources: list[dict] = []
    for rt in served.values():
        entry = {
            "name": rt.plural,
            "singularName": rt.kind.lower(),
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": VERBS,
        }
        if rt.short_names:
            entry["shortNames"] = list(rt.short_names)
        resources.append(entry)
        for sub in _subresources(rt):
            resources.append(
                {
                    "name": f"{rt.plural}/{sub}",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "kind": "Binding" if sub == "binding" else rt.kind,
                    "verbs": ["create"] if sub == "binding" else SUBRESOURCE_VERBS,
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}".lstrip("/"),
        "resources": resources,
    }


def _subresources(rt: ResourceType) -> Iterable[str]:
    if rt.status:
        yield "status"
    if rt is PODS:
        yield "binding"


def subresource_allowed(rt: ResourceType, sub: str) -> bool:
    return sub in _subresources(rt)


VERSION_INFO = {
    "major": "1",
    "minor": "35",
    "gitVersion": "v1.35.0-devcluster",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
