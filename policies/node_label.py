"""SG007 for a claim's node label (`scrubgate.dev/node`): each node agent reads only the claims labelled with its
node, so a tenant who removed the label, or pointed it at another node, would hide a used claim from the agent that
must scrub its devices. Only the agent of the claim's node (naming its own node) and scrubgate's controller (naming
the node of the claim's allocation) set, change or remove it; nobody creates a claim or template carrying it."""

from __future__ import annotations

from typing import Any

from . import names
from .config import PolicyConfig
from .findings import Violation, pointer
from .model import as_dict, as_str, claim_metadatas, metadata
from .release_guard import claim_nodes
from .requester import Requester, not_the_agents_node, object_name


def node_label(meta: dict[str, Any]) -> str | None:
    """The node a claim's metadata is labelled with (`scrubgate.dev/node`), or None."""
    value = as_dict(meta.get("labels")).get(names.LABEL_NODE)
    return None if value is None else as_str(value)


def _refusal(who: Requester, path: str) -> Violation:
    message = (
        f"user {who.username!r} set, changed or removed the {names.LABEL_NODE} label: it tells the scrubgate node "
        f"agent which claims are its own to scrub, and only that agent and scrubgate's controller write it; remove "
        f"the change"
    )
    return (message, path, ())


def node_label_guard(obj: dict[str, Any], old: dict[str, Any], who: Requester, policy: PolicyConfig) -> list[Violation]:
    """SG007 on an UPDATE of a ResourceClaim that sets, changes or removes its node label."""
    before, after = node_label(metadata(old)), node_label(metadata(obj))
    if before == after:
        return []
    path = pointer("metadata", "labels", names.LABEL_NODE)
    nodes = claim_nodes(obj)
    what = f"claim {object_name(obj)}"
    if who.is_controller(policy):
        if after is not None and after not in nodes:
            where = ", ".join(sorted(nodes)) or "no node"
            return [
                (f"scrubgate's controller labelled {what} for node {after!r}; it is allocated on {where}", path, ())
            ]
        return []
    if not who.is_agent(policy):
        return [_refusal(who, path)]
    # An agent names its own node, on a claim allocated there, or takes off its own node's label.
    mine = after if after is not None else before
    problem = not_the_agents_node(nodes if after is not None else {as_str(before)}, who, what, policy)
    if problem is None and after is not None and after not in nodes:
        problem = f"the agent of node {who.node!r} labelled {what} for node {after!r}, which holds none of its devices"
    if problem is None and policy.agent.node_binding and mine != who.node:
        problem = f"the agent of node {who.node!r} wrote the {names.LABEL_NODE} label of node {mine!r}"
    return [] if problem is None else [(problem, path, ())]


def preset_node_label(obj: dict[str, Any], who: Requester, policy: PolicyConfig) -> list[Violation]:
    """SG007 on a new claim or template: none carries the node label (a template's `spec.metadata.labels` are
    copied into every claim generated from it), since neither the agent nor the controller creates claims."""
    return [
        _refusal(who, pointer(*place, "labels", names.LABEL_NODE))
        for place, meta in claim_metadatas(obj)
        if node_label(meta) is not None
    ]
