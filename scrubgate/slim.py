"""What `scrubgate reports` keeps of each object it lists or is sent by a watch: only the fields the rules read
(policies/model.py, rules.py, scope.py, selectors.py, in manifest mode as `check --cluster` runs them), and only the
objects that can produce a finding, or that decide another's (Namespaces: tenancy; DeviceClasses: which claims
are guarded; ResourceClaims: whether a pod naming one shares a GPU). A pod as the API server returns it is about
20 KB of Python objects (managedFields, status, every container's image, env, probes, mounts); what the rules read
of a GPU pod is a few hundred bytes, and most pods of a cluster ask for no device at all.

`slim(obj)` returns that part, laid out as in the object (every finding's JSON pointer stays the same: list
entries the rules do not read are kept as `{}` up to the last one they do read), or None where nothing of the
object can produce a finding. tests/test_reports_slim.py checks that the engine's findings on the slim object are
those on the whole one, for every manifest of manifests/examples and tests/realworld and for malformed variants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.model import (
    as_dict,
    as_list,
    as_str,
    claim_spec_path,
    extended_resources,
    is_claim,
    is_device_class,
    is_namespace,
    metadata,
    pod_spec,
)

# What identifies an object in a report (policyreport.py) and a pod in SG002's message (engine.object_ref).
_IDENTITY = ("name", "generateName", "namespace", "uid")
_SCRUBGATE = f"{names.DOMAIN}/"


def slim(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The part of `obj` (with its apiVersion and kind) the rules read; None when it cannot produce a finding."""
    head = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind")}
    if is_namespace(obj):
        # The tenancy label (its key is the policy's, which may change while this runs): every label.
        return {**head, "metadata": _meta(obj, labels=True)}
    if is_device_class(obj):
        return {**head, "metadata": _meta(obj), "spec": obj.get("spec")}
    if is_claim(obj):
        return _claim(obj, head)
    ref = pod_spec(obj)
    if ref is None:  # a kind this does not know: all of it but the server's bookkeeping
        meta = {k: v for k, v in metadata(obj).items() if k != "managedFields"}
        return {**obj, "metadata": meta} if "metadata" in obj else obj
    if not (as_list(ref.spec.get("resourceClaims")) or extended_resources(ref)):
        # Neither a claim nor an extended resource of any domain. Any domain: a DeviceClass, created at any time,
        # may offer its devices under any `extendedResourceName` (scope.is_gpu_extended_resource), so this depends
        # neither on the classes nor on the policy, and neither changing asks for a new list. Pods asking for cpu,
        # memory and storage only are most of a cluster.
        return None
    node = {**head, "metadata": _meta(obj)}
    holder = node
    for key in ref.path[:-1]:
        holder[key] = {}
        holder = holder[key]
    holder[ref.path[-1]] = _pod_spec(ref.spec)
    return node


def _meta(obj: dict[str, Any], labels: bool = False) -> Any:
    """The metadata the rules read: what names the object (and its labels, for a Namespace); as it is where it
    is no map (the rules read that as absent, SG004's patch as missing)."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return meta
    kept = {key: meta[key] for key in _IDENTITY if key in meta}
    if labels and "labels" in meta:
        kept["labels"] = meta["labels"]
    return kept


def _scrubgate_annotations(meta: Any) -> dict[str, Any]:
    """scrubgate's own annotations (SG001 reads the deallocation policy): a claim's others are not read."""
    found = as_dict(as_dict(meta).get("annotations"))
    return {"annotations": {k: v for k, v in found.items() if k.startswith(_SCRUBGATE)}} if found else {}


def _claim(obj: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    """A claim or template: its requests (SG001, SG004-SG006; every claim is kept: a pod naming one is told from
    a pod sharing a GPU by it, SG002), its finalizers (SG004) and scrubgate's annotations; not its status."""
    meta = _meta(obj)
    if isinstance(meta, dict):
        meta.update(_scrubgate_annotations(obj["metadata"]))
        if "finalizers" in obj["metadata"]:
            meta["finalizers"] = obj["metadata"]["finalizers"]
    node: dict[str, Any] = {**head, "metadata": meta}
    path = claim_spec_path(obj)
    outer = as_dict(obj.get("spec"))
    if len(path) == 2:  # a template: the claims' metadata, and their spec one level down
        spec = as_dict(outer.get("spec"))
        template = {**_scrubgate_annotations(outer.get("metadata"))}
        node["spec"] = {"metadata": template} if template else {}
        holder = node["spec"]
    else:
        spec, holder = outer, node
    devices = as_dict(spec.get("devices"))
    holder["spec"] = {"devices": {"requests": devices["requests"]}} if "requests" in devices else {}
    return node


def _pod_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """What SG002, SG003 and SG005 read: the claims, the containers' extended resources, the tolerations of the
    fence (or of every taint), and the grace period."""
    kept: dict[str, Any] = {}
    if "resourceClaims" in spec:
        kept["resourceClaims"] = spec["resourceClaims"]
    for containers in ("initContainers", "containers"):
        entries = _up_to_last(as_list(spec.get(containers)), _extended)
        if entries:
            kept[containers] = entries
    tolerations = _up_to_last(as_list(spec.get("tolerations")), _fence_toleration)
    if tolerations:
        kept["tolerations"] = tolerations
    if "terminationGracePeriodSeconds" in spec:
        kept["terminationGracePeriodSeconds"] = spec["terminationGracePeriodSeconds"]
    return kept


def _up_to_last(entries: list[Any], keep: Callable[[Any], dict[str, Any] | None]) -> list[dict[str, Any]]:
    """`keep` of each entry, `{}` for those it keeps nothing of, up to the last it keeps something of: the
    indexes in a finding's path stay those of the whole list."""
    kept = [keep(entry) or {} for entry in entries]
    while kept and not kept[-1]:
        kept.pop()
    return kept


def _extended(container: Any) -> dict[str, Any] | None:
    """A container's requests and limits of domain-prefixed resources (model.extended_resources reads these)."""
    resources = as_dict(as_dict(container).get("resources"))
    kept = {}
    for section in ("requests", "limits"):
        found = {k: v for k, v in as_dict(resources.get(section)).items() if isinstance(k, str) and "/" in k}
        if found:
            kept[section] = found
    return {"resources": kept} if kept else None


def _fence_toleration(toleration: Any) -> dict[str, Any] | None:
    """A toleration SG005 may read: of a `scrubgate.dev/` key, or key-less `Exists` (rules._tolerates_fence)."""
    found = as_dict(toleration)
    key = as_str(found.get("key"))
    if key.startswith(_SCRUBGATE) or (not key and found.get("operator") == "Exists"):
        return found
    return None
