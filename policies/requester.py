"""Who sends a write, and where an agent's credentials let it act: its own node only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import PolicyConfig
from .model import metadata


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

    def is_controller(self, policy: PolicyConfig) -> bool:
        return self.username in policy.controller.identities

    def is_scheduler(self, policy: PolicyConfig) -> bool:
        return self.username in policy.scheduler.identities


def not_the_agents_node(nodes: set[str], who: Requester, what: str, policy: PolicyConfig) -> str | None:
    """Why the agent `who` may not act on `what`, which is on `nodes`, or None. Under node binding an agent acts
    only on what is on the node its credentials are bound to, and on nothing that is on no node (a claim not
    allocated yet, a fence that names none): what cannot be placed is not its to touch."""
    if not policy.agent.node_binding:
        return None
    if not who.node:
        return (
            "the agent's credentials name no node (userInfo.extra authentication.kubernetes.io/node-name): SG007 "
            "binds an agent to its node, so it acts only with its pod's projected token (Kubernetes 1.32 and "
            "later), or a token bound to its Node; or set agent.nodeBinding: false in the policy"
        )
    if not nodes:
        return (
            f"the agent of node {who.node!r} acted on {what}, which is on no node: an agent acts on its own node only"
        )
    if who.node not in nodes:
        where = ", ".join(sorted(nodes))
        return f"the agent of node {who.node!r} acted on {what} of node {where}: an agent acts on its own node only"
    return None


def object_name(obj: dict[str, Any]) -> str:
    meta = metadata(obj)
    namespace, name = meta.get("namespace"), meta.get("name")
    return f"{namespace}/{name}" if namespace else str(name or "")
