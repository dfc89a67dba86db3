"""The policy engine: which rules run on which object, in CI (manifests) and in admission.

Validation and defaulting are separate steps, as in controller-runtime: `default` returns the mutations
(each a finding with a JSON patch), `validate` the findings that allow, warn about or deny the object.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import fence_guard, node_label, release_guard, rules
from .config import PolicyConfig
from .findings import Finding, Violation, pointer
from .model import (
    as_dict,
    as_str,
    device_requests,
    fence_key,
    is_claim,
    is_device_class,
    is_eviction,
    is_known,
    is_namespace,
    is_node,
    is_pod_group,
    is_taint_rule,
    kind_of,
    metadata,
    pod_claims,
    pod_spec,
)
from .requester import Requester
from .scope import Scope, gpu_requests, guarded_devices
from .selectors import UNKNOWN, DeviceClasses

Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]

__all__ = ["Admission", "DeviceClasses", "Finding", "default", "is_known", "shared_claims", "validate"]


@dataclass(frozen=True, slots=True)
class Admission:
    """What an admission request adds to the object: who, which operation, the old object, the options."""

    operation: Operation
    username: str = ""
    groups: tuple[str, ...] = ()
    old_object: Mapping[str, Any] | None = None
    options: Mapping[str, Any] | None = None
    dry_run: bool = False
    subresource: str = ""
    node: str = ""  # the node the requester's credentials are bound to (a pod's or a Node-bound token)

    @property
    def requester(self) -> Requester:
        return Requester(self.username, self.groups, self.node)


def _findings(policy: PolicyConfig, rule_id: str, violations: list[Violation]) -> list[Finding]:
    if not violations:
        return []
    action = policy.action(rule_id)
    if action == "off":
        return []
    return [Finding(rule_id, action, message, path, patch) for message, path, patch in violations]


def _enabled(policy: PolicyConfig, rule_id: str) -> bool:
    return policy.action(rule_id) != "off"


def validate(
    obj: Mapping[str, Any] | None,
    policy: PolicyConfig,
    *,
    trusted: bool,
    admission: Admission | None = None,
    stored: bool = False,
    classes: DeviceClasses = UNKNOWN,
    claims: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
) -> list[Finding]:
    """Findings for `obj`. Without `admission` the object is a manifest (CI): an absent grace period and a
    missing finalizer are reported, since nothing will default them; `stored` says it was read from a cluster
    (`check --cluster`), where scrubgate's annotations are the agent's writes, not a manifest's forgery.
    `classes` are the DeviceClasses known (the cluster's, or those among the manifests): a claim is guarded
    unless its class is known and proven unable to hand out a GPU; `claims`, by (namespace, name), those among
    the manifests, so that a workload naming one that may hold no GPU is not a shared GPU claim (SG002). On
    UPDATE only what the update
    introduces counts: a finding the old object had too (it predates scrubgate, or its namespace was
    relabelled) would otherwise block every later write to it, the agent's attested release included."""
    scope = Scope(policy, classes)
    if admission is not None and admission.operation == "DELETE":
        old = admission.old_object
        if not isinstance(old, dict):
            return []
        if kind_of(old) != ("v1", "Pod"):
            return _fence_findings(None, old, policy, admission)
        if not _enabled(policy, "SG008"):
            return []
        return _findings(policy, "SG008", rules.force_delete(old, admission.options, admission.groups, scope))
    if not isinstance(obj, dict) or not is_known(obj):
        return _other_findings(obj if isinstance(obj, dict) else {}, scope, trusted, admission)
    if admission is not None and admission.subresource == "status":
        old = admission.old_object
        if admission.operation != "UPDATE" or not isinstance(old, dict) or kind_of(obj)[1] != "ResourceClaim":
            return []
        return _status_findings(obj, old, scope, trusted, admission.requester)
    found = _object_findings(obj, scope, trusted, manifest=admission is None, claims=claims)
    if admission is None or admission.operation == "CREATE":
        if is_claim(obj) and not stored and _enabled(policy, "SG007"):
            who = admission.requester if admission is not None else Requester()
            found += _findings(policy, "SG007", release_guard.preset_annotations(obj, who, policy))
            found += _findings(policy, "SG007", node_label.preset_node_label(obj, who, policy))
        return found
    old = admission.old_object
    if admission.operation != "UPDATE" or not isinstance(old, dict):
        return found
    existing = {(f.rule, f.path, f.message) for f in _object_findings(old, scope, trusted, manifest=False)}
    found = [f for f in found if (f.rule, f.path, f.message) not in existing]
    if kind_of(obj)[1] == "ResourceClaim" and _enabled(policy, "SG007"):
        found += _guarded(policy, release_guard.finalizer_guard(obj, old, admission.requester, scope))
        found += _findings(policy, "SG007", node_label.node_label_guard(obj, old, admission.requester, policy))
    return found


def _status_findings(
    obj: dict[str, Any], old: dict[str, Any], scope: Scope, trusted: bool, who: Requester
) -> list[Finding]:
    """A claim's status write (the API server keeps spec and metadata): who it is reserved for and whether it is
    still allocated (SG007), and a GPU claim reserved for a PodGroup (SG002)."""
    policy = scope.policy
    found = []
    if not trusted and guarded_devices(obj, scope):
        shared = _findings(policy, "SG002", rules.group_reservation(obj))
        before = {f.message for f in _findings(policy, "SG002", rules.group_reservation(old))}
        found += [f for f in shared if f.message not in before]
    if _enabled(policy, "SG007"):
        found += _guarded(policy, release_guard.deallocation_guard(obj, old, who, scope))
        found += _guarded(policy, release_guard.reservation_guard(obj, old, who, scope))
    return found


def _other_findings(obj: dict[str, Any], scope: Scope, trusted: bool, admission: Admission | None) -> list[Finding]:
    """The kinds the claim and pod rules do not read, of which a few are guarded: DeviceClasses (SG009, in CI
    too), PodGroups sharing claims (SG002), Namespaces' tenancy label (SG010), Evictions (SG008), scrubgate's
    own fences, DeviceTaintRules and node taints, and what an agent writes to them and to Nodes (SG007)."""
    policy = scope.policy
    if is_device_class(obj):
        return _findings(policy, "SG009", rules.gpu_class_coverage(obj, scope))
    if is_pod_group(obj):
        return [] if trusted else _findings(policy, "SG002", rules.pod_group_claims(obj))
    if admission is None:
        return []
    who = admission.requester
    old = admission.old_object if isinstance(admission.old_object, dict) else None
    if is_namespace(obj) and admission.operation in ("CREATE", "UPDATE") and _enabled(policy, "SG010"):
        return _guarded(policy, rules.tenancy_label(obj, old, who, policy), "SG010")
    if is_eviction(obj) and admission.operation == "CREATE":
        return _findings(policy, "SG008", rules.force_evict(obj, admission.groups, policy))
    if not _enabled(policy, "SG007"):
        return []
    if is_node(obj) and admission.operation == "UPDATE" and old is not None:
        found = _guarded(policy, fence_guard.node_fence_guard(obj, old, who, policy))
        return found or _findings(policy, "SG007", fence_guard.agent_node_write(obj, old, who, policy))
    if admission.operation == "CREATE" and is_taint_rule(obj):
        return _findings(policy, "SG007", fence_guard.agent_taint_rule(obj, who, policy))
    if admission.operation == "UPDATE" and old is not None and is_taint_rule(old):
        # A new object that cannot be read is a change of the fence too (fail closed).
        found = _fence_findings(obj, old, policy, admission)
        return found or _findings(policy, "SG007", fence_guard.agent_taint_rule(obj, who, policy))
    return []


def _fence_findings(
    obj: dict[str, Any] | None, old: dict[str, Any], policy: PolicyConfig, admission: Admission
) -> list[Finding]:
    """SG007 on a DELETE (`obj` None) or UPDATE of a DeviceTaintRule that is one of scrubgate's fences."""
    if not fence_key(old) or not _enabled(policy, "SG007"):
        return []
    return _guarded(policy, fence_guard.fence_guard(obj, old, admission.requester, policy))


def _guarded(
    policy: PolicyConfig, result: tuple[list[Violation], list[Violation]], rule_id: str = "SG007"
) -> list[Finding]:
    """A guard's findings from its (violations, admin uses): break-glass, an admin lifting a fence or changing
    a namespace's tenancy, is allowed, and always recorded, whatever the rule's action."""
    violations, admin_uses = result
    return _findings(policy, rule_id, violations) + [
        Finding(rule_id, "audit", message, path) for message, path, _ in admin_uses
    ]


def _object_findings(
    obj: dict[str, Any],
    scope: Scope,
    trusted: bool,
    manifest: bool,
    claims: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
) -> list[Finding]:
    """SG001-SG006: what the object itself says, whoever writes it. Admin access and the fence's tolerations
    are refused in every request of every claim (a class's name proves nothing); Retain and the finalizer are
    for claims that may get a GPU."""
    policy = scope.policy
    found: list[Finding] = []
    if is_claim(obj):
        requests = device_requests(obj)
        if not trusted:
            found += _findings(policy, "SG006", rules.admin_access(requests))
        found += _findings(policy, "SG005", rules.fence_toleration(requests, scope, trusted))
        if gpu_requests(obj, scope):
            if not trusted:
                found += _findings(policy, "SG001", rules.retain_deallocation(obj))
            if manifest and kind_of(obj)[1] == "ResourceClaim":
                found += _findings(policy, "SG004", rules.claim_finalizer(obj))
        return found
    ref = pod_spec(obj)
    if ref is None:
        return found
    is_pod = kind_of(obj)[1] == "Pod"
    if not (is_pod and trusted):
        namespace = as_str(metadata(obj).get("namespace")) or "default"

        def holds_no_gpu(name: str) -> bool:
            known = (claims or {}).get((namespace, name))
            return known is not None and not gpu_requests(dict(known), scope)

        found += _findings(policy, "SG002", rules.shared_claim(ref, is_pod, holds_no_gpu))
    found += _findings(policy, "SG003", rules.grace_period(ref, scope, manifest=manifest))
    found += _findings(policy, "SG005", rules.pod_fence_toleration(ref, scope, trusted))
    return found


def default(
    obj: Mapping[str, Any] | None,
    policy: PolicyConfig,
    operation: Operation = "CREATE",
    admission: Admission | None = None,
    classes: DeviceClasses = UNKNOWN,
) -> list[Finding]:
    """Mutations (SG004): the sanitize finalizer added to an in-scope ResourceClaim being created, and removed
    on the UPDATE by which kube-scheduler releases a claim of its own that no container used
    (`release_guard.scheduler_release`); (SG007) a held claim's ended pods recorded in its reservation
    (`release_guard.kept_consumers_patch`). Never added on UPDATE: the agent's own removal of the finalizer must not be
    undone. No grace period is defaulted here: the API server sets an absent terminationGracePeriodSeconds to
    30 s before any admission webhook sees the object; SG003's patch is for manifests (`scrubgate check --fix`)."""
    scope = Scope(policy, classes)
    if operation not in ("CREATE", "UPDATE") or not isinstance(obj, dict) or not is_claim(obj):
        return []
    if admission is not None and admission.subresource == "status":
        old = admission.old_object
        if operation != "UPDATE" or not isinstance(old, dict) or kind_of(obj)[1] != "ResourceClaim":
            return []
        return _findings(policy, "SG007", release_guard.kept_consumers_patch(obj, old, admission.requester, scope))
    if kind_of(obj)[1] != "ResourceClaim" or not gpu_requests(obj, scope):
        return []
    if operation == "CREATE":
        return _findings(policy, "SG004", rules.claim_finalizer(obj))
    if admission is None or not isinstance(admission.old_object, dict):
        return []
    patch = release_guard.scheduler_release_patch(obj, admission.old_object, admission.requester, scope)
    return _findings(policy, "SG004", patch)


def shared_claims(
    objects: Iterable[tuple[Any, Mapping[str, Any], bool]], policy: PolicyConfig
) -> list[tuple[Any, Finding]]:
    """SG002 across the documents of one CI run: two pods in a trusted namespace naming the same claim.
    (Workloads and multi-tenant pods that name a claim are already reported one by one.) A pod without a
    namespace is in `default`, where kubectl would create it; pods are told apart by key, not by name,
    since `generateName` pods have none.

    `objects` are (key, object, trusted) triples; returns (key, finding) pairs."""
    if not _enabled(policy, "SG002"):
        return []
    users: dict[tuple[str, str], list[tuple[Any, str, str]]] = {}
    for key, obj, trusted in objects:
        if not trusted or kind_of(obj) != ("v1", "Pod"):
            continue
        ref = pod_spec(obj)
        if ref is None:
            continue
        namespace = as_str(metadata(obj).get("namespace")) or "default"
        name = object_ref(obj)["name"] or "<unnamed>"
        for claim in pod_claims(ref):
            if claim.claim_name:
                users.setdefault((namespace, claim.claim_name), []).append((key, name, pointer(*claim.claim_name_path)))
    out = []
    for (namespace, claim_name), holders in users.items():
        if len({key for key, _, _ in holders}) < 2:
            continue
        for key, _, path in holders:
            others = ", ".join(sorted({name for other, name, _ in holders if other != key}))
            message = (
                f"ResourceClaim {claim_name!r} in namespace {namespace} is also named by pod(s) {others}: give "
                f"each pod its own claim through resourceClaimTemplateName"
            )
            out += [(key, f) for f in _findings(policy, "SG002", [(message, path, ())])]
    return out


def object_ref(obj: Mapping[str, Any]) -> dict[str, str]:
    """apiVersion, kind, namespace, name of an object, for reports."""
    api_version, kind = kind_of(as_dict(obj))
    meta = metadata(as_dict(obj))
    return {
        "apiVersion": api_version,
        "kind": kind,
        "namespace": as_str(meta.get("namespace")),
        "name": as_str(meta.get("name")) or as_str(meta.get("generateName")),
    }
