"""scrubgate's controller end to end (the real control plane, webhook, controller and agent as separate processes):
each agent reads only its own node's claims, by the `scrubgate.dev/node` label. The controller labels a GPU claim
that no agent saw, so that its agent, back, finds it after its pod is long gone; it removes the sanitize finalizer
of a claim deleted before it held a device; and nobody else may write that label."""

from __future__ import annotations

import re

import e2e_support
import pytest
from e2e_support import (
    WAIT_S,
    allocated_device,
    assert_invariant,
    create_template,
    expect_denied,
    patch_claim,
    running_claim,
    tenant_namespace,
    tenant_pod,
    wait_gone,
)
from scrubgate.policies import names

from devcluster import workloads
from devcluster.harness import Cluster, wait_for

pytestmark = pytest.mark.e2e

cluster_factory_fixture = e2e_support.cluster_factory_fixture
cluster_fixture = e2e_support.cluster_fixture

CANARY = "CONTROLLER-E2E-CANARY"
LABEL = "/metadata/labels/" + names.LABEL_NODE.replace("/", "~1")


def node_label(claim: dict | None) -> str | None:
    return ((claim or {}).get("metadata", {}).get("labels") or {}).get(names.LABEL_NODE)


def metric(cluster: Cluster, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", cluster.controller_metrics(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.timeout(120)
def test_a_claim_its_agent_never_saw_is_found_by_the_controllers_label(cluster: Cluster) -> None:
    """The agent is down while a pod runs on its claim and is deleted: SG007 keeps the claim allocated, the
    controller labels it with its node, and the agent, back, lists it by that label, scrubs and releases it."""
    ns = tenant_namespace(cluster, "unseen")
    create_template(cluster, "alice", ns, "one-gpu")
    cluster.agent.stop()
    tenant_pod(cluster, "alice", ns, "a", template="one-gpu", canary=CANARY)
    claim = running_claim(cluster, ns, "a")
    name, device = claim["metadata"]["name"], allocated_device(claim)[2]
    assert CANARY.encode() in cluster.gpu_memory(cluster.device_uuid(device))
    wait_for(lambda: node_label(cluster.claim(ns, name)) == cluster.node, WAIT_S, "the controller's label")
    assert metric(cluster, "scrubgate_controller_claims_labelled_total") >= 1
    cluster.core("alice").delete_namespaced_pod("a", ns)
    wait_for(lambda: cluster.pod(ns, "a") is None, WAIT_S, f"pod {ns}/a deleted")
    assert cluster.claim(ns, name) is not None, "kept allocated: no agent attested it"

    cluster.agent.start()
    cluster.wait_agent_ready()
    wait_gone(cluster, ns, name)
    assert CANARY.encode() not in cluster.gpu_memory(cluster.device_uuid(device))
    assert_invariant(cluster)


@pytest.mark.timeout(120)
def test_a_claim_deleted_before_it_held_a_device_loses_the_finalizer_through_the_controller(cluster: Cluster) -> None:
    """No agent runs, so no pod event names the claim: the controller's informer sees its deletion."""
    cluster.agent.stop()
    ns = tenant_namespace(cluster, "never")
    cluster.request(
        "POST", cluster.resource_path("resourceclaims", ns), workloads.resource_claim("never"), user="alice"
    )
    assert names.FINALIZER in (cluster.claim(ns, "never") or {})["metadata"]["finalizers"], "the webhook's"
    removed = metric(cluster, "scrubgate_controller_finalizers_removed_total")
    cluster.request("DELETE", cluster.resource_path("resourceclaims", ns, "never"), user="alice")
    wait_gone(cluster, ns, "never")
    assert metric(cluster, "scrubgate_controller_finalizers_removed_total") == removed + 1
    assert_invariant(cluster)


@pytest.mark.timeout(120)
def test_a_tenant_cannot_write_a_claims_node_label(cluster: Cluster) -> None:
    """Not on a new claim, nor a template's claims; not added to a claim, changed, or removed from a claim that
    holds a GPU: it would hide the claim from the agent that must scrub it, or point another agent at it."""
    ns = tenant_namespace(cluster, "label")
    labelled = workloads.resource_claim("preset")
    labelled["metadata"]["labels"] = {names.LABEL_NODE: cluster.node}
    expect_denied(
        lambda: cluster.request("POST", cluster.resource_path("resourceclaims", ns), labelled, user="alice"), "SG007"
    )
    template = workloads.claim_template("labelled", "v1")
    template["spec"].setdefault("metadata", {})["labels"] = {names.LABEL_NODE: cluster.node}
    expect_denied(
        lambda: cluster.request("POST", cluster.resource_path("resourceclaimtemplates", ns), template, user="alice"),
        "SG007",
    )
    cluster.request("POST", cluster.resource_path("resourceclaims", ns), workloads.resource_claim("bare"), user="alice")
    add = [{"op": "add", "path": "/metadata/labels", "value": {names.LABEL_NODE: cluster.node}}]
    expect_denied(lambda: patch_claim(cluster, "alice", ns, "bare", add), "SG007")

    create_template(cluster, "alice", ns, "one-gpu")
    tenant_pod(cluster, "alice", ns, "a", template="one-gpu", run_seconds=60)
    name = running_claim(cluster, ns, "a")["metadata"]["name"]
    wait_for(lambda: node_label(cluster.claim(ns, name)) == cluster.node, WAIT_S, "the agent's label")
    for ops in (
        [{"op": "remove", "path": LABEL}],
        [{"op": "replace", "path": LABEL, "value": "gpu-node-9"}],
    ):
        expect_denied(lambda ops=ops: patch_claim(cluster, "alice", ns, name, ops), "SG007")
    assert node_label(cluster.claim(ns, name)) == cluster.node
    assert_invariant(cluster)
