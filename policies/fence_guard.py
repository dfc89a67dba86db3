"""SG007 for scrubgate's fences and for what a node agent's credentials may write outside claims.

A fence (a DeviceTaintRule with a `scrubgate.dev/` taint, or, where no DeviceTaintRule API is served, a node taint
with such a key) keeps a device that may hold a tenant's data from the scheduler. Only the agent of its node lifts
or moves it, after a verified scrub; an admin may, and is recorded.

An agent's own writes are bound to its node too: it creates or changes only NoSchedule `scrubgate.dev/` fences of
its own node's devices, and changes nothing of a Node but its own `scrubgate.dev/` NoSchedule taints. One node's
token can then neither evict every GPU workload of the cluster (a NoExecute rule over every GPU) nor cordon or
relabel another node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import names
from .config import PolicyConfig
from .findings import Violation
from .model import annotations, as_dict, as_list, as_str, fence_key, metadata
from .requester import Requester, not_the_agents_node, object_name

_VOLATILE_METADATA = ("resourceVersion", "managedFields", "generation")


def fence_guard(
    obj: dict[str, Any] | None, old: dict[str, Any], who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on a DELETE (`obj` None) or UPDATE of one of scrubgate's fences, a DeviceTaintRule with a
    scrubgate.dev/ taint: lifting it, or pointing it at another device, hands a device that may still hold
    a tenant's data to the scheduler. An UPDATE that leaves spec as it was (labels, annotations) moves no fence.
    An agent lifts only its own node's fences (the node the agent named on it, else its device's pool). Returns
    (violations, admin lifts to audit)."""
    if obj is not None and obj.get("spec") == old.get("spec"):
        return [], []
    spec = as_dict(old.get("spec"))
    selector = as_dict(spec.get("deviceSelector"))
    device = "/".join(as_str(selector.get(field)) or "*" for field in ("driver", "pool", "device"))
    fence_node = as_str(annotations(old).get(names.ANNOTATION_FENCE_NODE)) or as_str(selector.get("pool"))
    what = "deleted" if obj is None else "changed the spec of"
    rule = f"DeviceTaintRule {as_str(metadata(old).get('name'))!r}, scrubgate's fence ({fence_key(old)}) on {device}"
    lift = FenceLift(f"{what} {rule}", fence_node, f"fence {object_name(old)}", "/spec")
    return _fence_lift(lift, who, policy)


def _scrubgate_taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    taints = as_list(as_dict(node.get("spec")).get("taints"))
    return [as_dict(t) for t in taints if as_str(as_dict(t).get("key")).startswith(f"{names.DOMAIN}/")]


def node_fence_guard(
    obj: dict[str, Any], old: dict[str, Any], who: Requester, policy: PolicyConfig
) -> tuple[list[Violation], list[Violation]]:
    """SG007 on an UPDATE of a Node that lifts or changes scrubgate's fallback fence, a node taint with a
    scrubgate.dev/ key (where no DeviceTaintRule API is served): as for a DeviceTaintRule, only the agent of
    that node, after a verified scrub; an admin may, and is recorded. Adding one only fences more."""
    after = _scrubgate_taints(obj)
    lifted = [t for t in _scrubgate_taints(old) if t not in after]
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
        elsewhere = not_the_agents_node({lift.node} - {""}, who, lift.subject, policy)
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


def agent_taint_rule(obj: dict[str, Any], who: Requester, policy: PolicyConfig) -> list[Violation]:
    """SG007 on a DeviceTaintRule the agent creates or changes: only a NoSchedule `scrubgate.dev/` fence of one
    device (driver, pool and device all named) of its own node's pool, annotated with its node. Other writers'
    rules are theirs: creating one only fences more."""
    if not who.is_agent(policy):
        return []
    spec = as_dict(obj.get("spec"))
    taint, selector = as_dict(spec.get("taint")), as_dict(spec.get("deviceSelector"))
    name = f"DeviceTaintRule {as_str(metadata(obj).get('name'))!r}"
    problems = []
    if not as_str(taint.get("key")).startswith(f"{names.DOMAIN}/") or taint.get("effect") != "NoSchedule":
        problems.append(
            f"its taint is {as_str(taint.get('key')) or '(no key)'}:{as_str(taint.get('effect')) or '(no effect)'}, "
            f"not a {names.DOMAIN}/ NoSchedule fence"
        )
    unnamed = [f for f in ("driver", "pool", "device") if not as_str(selector.get(f))]
    if unnamed or set(selector) - {"driver", "pool", "device"}:
        problems.append("its deviceSelector does not name exactly one device (driver, pool and device)")
    if problems:
        return [(f"the scrubgate node agent wrote {name}: {'; '.join(problems)}", "/spec", ())]
    pool, marked = as_str(selector.get("pool")), as_str(annotations(obj).get(names.ANNOTATION_FENCE_NODE))
    elsewhere = not_the_agents_node({pool}, who, f"the device pool {pool!r}", policy)
    if elsewhere is None and policy.agent.node_binding and marked != who.node:
        elsewhere = f"the agent of node {who.node!r} wrote a fence annotated {names.ANNOTATION_FENCE_NODE}={marked!r}"
    return [(f"{name}: {elsewhere}", "/spec/deviceSelector/pool", ())] if elsewhere else []


def _without_scrubgate_taints(node: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in as_dict(node.get("metadata")).items() if k not in _VOLATILE_METADATA}
    spec = dict(as_dict(node.get("spec")))
    spec["taints"] = [t for t in as_list(spec.get("taints")) if as_dict(t) not in _scrubgate_taints(node)]
    return {**node, "metadata": meta, "spec": spec, "status": None}


def agent_node_write(obj: dict[str, Any], old: dict[str, Any], who: Requester, policy: PolicyConfig) -> list[Violation]:
    """SG007 on a Node UPDATE by the agent: its own Node only, and nothing but its `scrubgate.dev/` taints, each
    NoSchedule (the fallback fence where no DeviceTaintRule API is served). No label, no cordon, no other taint."""
    if not who.is_agent(policy):
        return []
    name = as_str(metadata(old).get("name"))
    elsewhere = not_the_agents_node({name}, who, f"node {name!r}", policy)
    if elsewhere:
        return [(elsewhere, "/metadata/name", ())]
    if _without_scrubgate_taints(obj) != _without_scrubgate_taints(old):
        return [
            (
                f"the scrubgate node agent changed node {name!r} beyond its own {names.DOMAIN}/ taints: it may only "
                f"add or remove those (its fallback fence); remove the other changes",
                "/spec",
                (),
            )
        ]
    wrong = [t for t in _scrubgate_taints(obj) if t.get("effect") != "NoSchedule" and t not in _scrubgate_taints(old)]
    if wrong:
        return [
            (
                f"the scrubgate node agent tainted node {name!r} with {as_str(wrong[0].get('key'))}:"
                f"{as_str(wrong[0].get('effect'))}: its fence is NoSchedule only (it never evicts a running pod)",
                "/spec/taints",
                (),
            )
        ]
    return []
