"""SG007's guard of a claim's node label (scrubgate.dev/node), by which each node agent reads its own claims: only
the agent of the claim's node and scrubgate's controller set, change or remove it; no claim or template is created
with it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from scrubgate.policies import names
from scrubgate.policies.config import load_policy
from scrubgate.policies.engine import Admission, validate
from scrubgate.policies.findings import Finding

POLICY = load_policy()
AGENT = POLICY.agent.identities[0]
CONTROLLER = POLICY.controller.identities[0]
TENANT, TENANT_GROUPS = "ns-admin", ("team-a", "system:authenticated")
ADMIN, ADMIN_GROUPS = "root-admin", ("system:masters", "system:authenticated")
LABEL_PATH = "/metadata/labels/scrubgate.dev~1node"


def claim(label: str | None = None, node: str | None = "node-1") -> dict[str, Any]:
    """A GPU claim allocated on `node` (the nodeSelector the scheduler writes for node-local devices)."""
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "train",
            "namespace": "team-a",
            "uid": "uid-1",
            "resourceVersion": "7",
            "finalizers": [names.FINALIZER],
            "labels": {"app": "train"},
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {},
    }
    if label is not None:
        obj["metadata"]["labels"][names.LABEL_NODE] = label
    if node is not None:
        selector = {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
        }
        results = [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": "gpu-0"}]
        obj["status"]["allocation"] = {"devices": {"results": results}, "nodeSelector": selector}
    return obj


def relabelled(old: dict[str, Any], label: str | None) -> dict[str, Any]:
    new = copy.deepcopy(old)
    new["metadata"]["labels"].pop(names.LABEL_NODE, None)
    if label is not None:
        new["metadata"]["labels"][names.LABEL_NODE] = label
    return new


def update(old: dict[str, Any], new: dict[str, Any], user: str, node: str = "", groups=TENANT_GROUPS) -> list[Finding]:
    admission = Admission("UPDATE", user, groups, old_object=old, node=node)
    return validate(new, POLICY, trusted=False, admission=admission)


def refusals(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.rule == "SG007" and f.action == "deny" and f.path == LABEL_PATH]


@pytest.mark.parametrize(
    ("before", "after"),
    [(None, "node-1"), ("node-1", None), ("node-1", "node-2"), (None, "node-2")],
    ids=["add", "remove", "point-elsewhere", "add-elsewhere"],
)
@pytest.mark.parametrize(("user", "groups"), [(TENANT, TENANT_GROUPS), (ADMIN, ADMIN_GROUPS)], ids=["tenant", "admin"])
def test_nobody_else_writes_the_label(before, after, user, groups):
    old = claim(before)
    found = refusals(update(old, relabelled(old, after), user, groups=groups))
    assert len(found) == 1 and names.LABEL_NODE in found[0].message, found


def test_the_agent_of_the_claims_node_labels_it_with_its_node():
    old = claim()
    assert refusals(update(old, relabelled(old, "node-1"), AGENT, node="node-1")) == []


@pytest.mark.parametrize(
    ("before", "after", "agent_node"),
    [
        (None, "node-1", "node-2"),  # another node's agent labels the claim for the claim's node
        (None, "node-2", "node-2"),  # another node's agent labels it for itself
        ("node-1", None, "node-2"),  # another node's agent takes the label off
        ("node-1", "node-2", "node-1"),  # the claim's own agent points it elsewhere
    ],
)
def test_an_agent_writes_only_its_own_nodes_label_of_its_own_nodes_claims(before, after, agent_node):
    old = claim(before)
    assert len(refusals(update(old, relabelled(old, after), AGENT, node=agent_node))) == 1


def test_the_controller_labels_a_claim_with_its_allocations_node_only():
    old = claim()
    assert refusals(update(old, relabelled(old, "node-1"), CONTROLLER)) == []
    assert len(refusals(update(old, relabelled(old, "node-2"), CONTROLLER))) == 1
    unallocated = claim(node=None)
    assert len(refusals(update(unallocated, relabelled(unallocated, "node-1"), CONTROLLER))) == 1


def test_other_label_changes_are_nobodys_concern():
    old = claim("node-1")
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["app"] = "other"
    assert refusals(update(old, new, TENANT)) == []


def test_no_claim_or_template_is_created_with_the_label():
    new = claim("node-1", node=None)
    del new["status"]
    admission = Admission("CREATE", TENANT, TENANT_GROUPS)
    assert len(refusals(validate(new, POLICY, trusted=False, admission=admission))) == 1
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "team-a"},
        "spec": {"metadata": {"labels": {names.LABEL_NODE: "node-1"}}, "spec": new["spec"]},
    }
    found = [f for f in validate(template, POLICY, trusted=False, admission=admission) if f.rule == "SG007"]
    assert [f.path for f in found] == ["/spec/metadata/labels/scrubgate.dev~1node"]
