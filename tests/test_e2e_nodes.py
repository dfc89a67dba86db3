"""Two simulated GPU nodes, each with its own agent: a tenant pod pinned to each node gets its GPU from that
node's pool, and that node's agent (and no other) scrubs and attests the release; kube-scheduler's PostFilter
really deallocates a claim allocated on one node and picks the other, where SG007 lets it."""

from __future__ import annotations

from collections.abc import Callable

import e2e_support
import pytest
from e2e_support import (
    WAIT_S,
    allocated_device,
    assert_invariant,
    canary_found,
    create_template,
    expect_denied,
    patch_claim,
    running_claim,
    tenant_namespace,
    verified_attestation,
    wait_gone,
    wait_phase,
)
from scrubgate.policies import names
from test_e2e_kubernetes import binding_refused, refuse_binding, unschedulable

from devcluster import workloads
from devcluster.harness import CLAIM_CONTROLLER_USER, Cluster, wait_for
from devcluster.kubeapi import object_path
from devcluster.sim_nodes import SimNode

cluster_factory_fixture = e2e_support.cluster_factory_fixture


def canary(node: SimNode) -> str:
    return f"SECRET-OF-A-TENANT-ON-{node.name}"


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_each_node_agent_scrubs_its_own_pool(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(gpus=1, nodes=2)
    ns = tenant_namespace(cluster, "team-a")
    create_template(cluster, "alice", ns, "one-gpu")
    core = cluster.core("alice")
    for node in cluster.nodes:
        annotations = workloads.workload_annotations(canary=canary(node))
        core.create_namespaced_pod(
            ns, workloads.pod(f"on-{node.name}", template="one-gpu", node=node.name, annotations=annotations)
        )

    # Each pod runs on its node with that node's one GPU: device names repeat across pools, UUIDs do not.
    claims = {node.name: running_claim(cluster, ns, f"on-{node.name}") for node in cluster.nodes}
    uuids = {node.name: node.device_uuid("gpu-0") for node in cluster.nodes}
    assert len(set(uuids.values())) == len(cluster.nodes), f"two nodes share a GPU UUID: {uuids}"
    for node in cluster.nodes:
        assert allocated_device(claims[node.name]) == (workloads.DRIVER, node.name, "gpu-0")
        assert canary(node).encode() in node.gpu_memory(uuids[node.name]), f"no canary on {node.name}'s GPU"

    for node in cluster.nodes:
        core.delete_namespaced_pod(f"on-{node.name}", ns)
    for node in cluster.nodes:
        claim = claims[node.name]
        wait_gone(cluster, ns, claim["metadata"]["name"])
        payload = verified_attestation(cluster, claim["metadata"]["uid"])
        assert payload["node"] == node.name, f"claim on {node.name} attested by the agent of {payload['node']}"
        assert [(d["pool"], d["uuid"]) for d in payload["devices"]] == [(node.name, uuids[node.name])]
        assert canary(node).encode() not in node.gpu_memory(uuids[node.name])
    assert_invariant(cluster)


# ---------------------------------------------------------------------- kube-scheduler's PostFilter on two nodes


def on_node(name: str) -> dict:
    """An allocation's node selector for one node, as kube-scheduler writes it."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [name]}]}
    return {"nodeSelectorTerms": [term]}


def pod_on(node: str, name: str, claim: str, **annotations: str) -> dict:
    return workloads.pod(name, claim=claim, node=node, annotations=workloads.workload_annotations(**annotations))


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_postfilter_clears_an_allocation_no_pod_used_and_the_pod_runs_on_the_other_node(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """kube-scheduler allocated a claim on gpu-node-1 for a pod it then could not bind (its Unreserve leaves
    the claim allocated, reserved for nobody). The next pod on that claim fits only gpu-node-2: PostFilter
    clears the allocation, which SG007 lets the scheduler do (delete-protection with the allocation, no pod
    used it, no agent recorded it), and the next cycle allocates the claim on gpu-node-2."""
    cluster = cluster_factory(gpus=1, nodes=2)
    first, second = cluster.nodes
    ns = tenant_namespace(cluster, "postfilter", trusted=True)  # a claim named by pods: single-tenant only
    path = cluster.resource_path("resourceclaims", ns)
    cluster.request("POST", path, workloads.resource_claim("mine"), user="alice")
    claim = cluster.request("GET", f"{path}/mine")
    claim["metadata"]["finalizers"].append(names.DELETE_PROTECTION_FINALIZER)
    claim = cluster.request("PUT", f"{path}/mine", claim)
    result = {"request": "gpu", "driver": workloads.DRIVER, "pool": first.name, "device": "gpu-0"}
    claim["status"] = {"allocation": {"devices": {"results": [result]}, "nodeSelector": on_node(first.name)}}
    cluster.request("PUT", f"{path}/mine/status", claim)

    cluster.core("alice").create_namespaced_pod(ns, pod_on(second.name, "elsewhere", "mine"))
    pod = wait_phase(cluster, ns, "elsewhere", "Running")
    assert pod["spec"]["nodeName"] == second.name
    history = [e.obj for e in cluster.observer.claims() if e.obj["metadata"]["name"] == "mine"]
    pools = [
        r["pool"]
        for c in history
        for r in ((c.get("status") or {}).get("allocation") or {"devices": {}})["devices"].get("results", [])
    ]
    assert pools[0] == first.name and pools[-1] == second.name, pools
    assert any(not (c.get("status") or {}).get("allocation") for c in history[1:]), "deallocated in between"
    assert not cluster.audit_denials("SG007", namespace=ns, name="mine"), "the scheduler's own allocation went freely"
    cluster.core("alice").delete_namespaced_pod("elsewhere", ns)
    wait_for(lambda: cluster.pod(ns, "elsewhere") is None, WAIT_S, "the pod gone")
    assert_invariant(cluster)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_used_claim_stripped_of_delete_protection_is_not_handed_to_another_node_unattested(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """The hole found on the real control plane. A claim used on gpu-node-1 is released, its scrub pending.
    Without `resource.kubernetes.io/delete-protection`, the resourceclaim controller drops its reservation and
    keeps its allocation; reserved for nobody, it looked like the scheduler's own, and PostFilter, scheduling a
    pod on the claim that fits only gpu-node-2, cleared it unattested: gpu-node-1's GPU went to another
    tenant with the canary in it. A tenant cannot remove delete-protection now, and even where an admin has,
    the scheduler may not clear a claim that an agent recorded."""
    agent_args = ("--resync", "1", "--drain-timeout", "120")
    cluster = cluster_factory(gpus=1, nodes=2, agent_args=agent_args)
    first, second = cluster.nodes
    ns = tenant_namespace(cluster, "hole", trusted=True)
    others = tenant_namespace(cluster, "hole-next")
    path = cluster.resource_path("resourceclaims", ns)
    cluster.request("POST", path, workloads.resource_claim("mine"), user="alice")
    secret = "SECRET-LEFT-ON-GPU-NODE-1"
    cluster.core("alice").create_namespaced_pod(ns, pod_on(first.name, "first", "mine", canary=secret))
    wait_phase(cluster, ns, "first", "Running")
    uuid = first.device_uuid("gpu-0")
    wait_for(lambda: names.ANNOTATION_DEVICES in (cluster.claim(ns, "mine") or {})["metadata"].get("annotations", {}),
             WAIT_S, "gpu-node-1's agent recording the claim")  # fmt: skip
    assert secret.encode() in first.gpu_memory(uuid)
    first.inject_fault(uuid, "linger")  # the drain waits: released, not yet scrubbed
    cluster.core("alice").delete_namespaced_pod("first", ns)
    wait_for(lambda: cluster.pod(ns, "first") is None, WAIT_S, "the first pod gone")

    claim = cluster.claim(ns, "mine") or {}
    index = claim["metadata"]["finalizers"].index(names.DELETE_PROTECTION_FINALIZER)
    drop = [
        {"op": "test", "path": f"/metadata/finalizers/{index}", "value": names.DELETE_PROTECTION_FINALIZER},
        {"op": "remove", "path": f"/metadata/finalizers/{index}"},
    ]
    message = expect_denied(lambda: patch_claim(cluster, "alice", ns, "mine", drop), "SG007")
    assert f"removed {names.DELETE_PROTECTION_FINALIZER} from a claim that still holds a GPU" in message
    patch_claim(cluster, "admin", ns, "mine", drop)  # an admin may (audited): the guard below still holds
    claim = cluster.claim(ns, "mine") or {}
    assert claim["status"]["allocation"]
    resources = {r["resource"] for r in claim["status"]["reservedFor"]}
    assert names.RESERVATION_RESOURCE in resources, "held"
    assert resources <= {"pods", names.ENDED_POD_RESOURCE, names.RESERVATION_RESOURCE}, "the pod or its record"

    # A pod on the claim that fits only gpu-node-2, and another tenant asking for gpu-node-1's GPU.
    cluster.core("alice").create_namespaced_pod(ns, pod_on(second.name, "elsewhere", "mine", look_for=secret))
    create_template(cluster, "bob", others, "that-gpu", selectors=[workloads.uuid_selector(uuid)])
    bob = workloads.pod("next", template="that-gpu", annotations=workloads.workload_annotations(look_for=secret))
    cluster.core("bob").create_namespaced_pod(others, bob)
    # The agent's hold (and the ended pod's record beside it) leaves the claim reserved: PostFilter, which clears only a
    # claim reserved for nobody or the pod at hand, does not even try.
    wait_for(lambda: unschedulable(cluster, ns, "elsewhere"), WAIT_S, "the pod on gpu-node-2 unschedulable")
    assert not cluster.audit_denials("SG007", namespace=ns, name="mine", user="system:kube-scheduler")
    claim = cluster.claim(ns, "mine") or {}
    assert allocated_device(claim) == (workloads.DRIVER, first.name, "gpu-0")
    assert not (cluster.pod(others, "next") or {})["spec"].get("nodeName")

    # The drain ends; gpu-node-1's agent scrubs and attests. kube-scheduler retries the refused pod only at its
    # periodic flush of unschedulable pods (an annotation is no status change to its queueing hint); the
    # tenant's next pod on the claim is scheduled at once: PostFilter may clear the attested allocation.
    first.clear_faults(uuid)
    wait_for(
        lambda: names.ANNOTATION_ATTESTATION in (cluster.claim(ns, "mine") or {})["metadata"].get("annotations", {}),
        WAIT_S,
        "gpu-node-1's attestation on the claim",
    )
    assert secret.encode() not in first.gpu_memory(uuid)
    cluster.core("alice").delete_namespaced_pod("elsewhere", ns)
    cluster.core("alice").create_namespaced_pod(ns, pod_on(second.name, "again", "mine", look_for=secret))
    again = wait_phase(cluster, ns, "again", "Running")
    assert again["spec"]["nodeName"] == second.name and canary_found(again) is False
    assert allocated_device(cluster.claim(ns, "mine") or {}) == (workloads.DRIVER, second.name, "gpu-0")
    assert_invariant(cluster)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_shared_claims_ended_pod_and_a_failed_binding_do_not_make_it_look_unused(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """Issue 28 item 3, the hole on the real control plane. A shared claim (single-tenant namespace) is used on
    gpu-node-1, while a second pod on it cannot bind (a ValidatingAdmissionPolicy refuses its Binding, as binding
    conditions or a node gone do), and the first pod ends with no agent on the node to hold the claim. The
    resourceclaim controller used to drop the first pod, kube-scheduler's Unreserve the second, and PostFilter,
    scheduling a third pod that fits only gpu-node-2, cleared the allocation as one nobody used: gpu-node-1's GPU
    went to another tenant with the canary in it. Now the controller may not drop a pod that may have run from a
    GPU claim no agent holds (SG007), so the claim keeps looking used; once the agent is back it holds the claim,
    scrubs, attests and releases it, and only then is anything allocated the GPU."""
    cluster = cluster_factory(gpus=1, nodes=2)
    first, second = cluster.nodes
    ns = tenant_namespace(cluster, "shared-hole", trusted=True)
    others = tenant_namespace(cluster, "shared-hole-next")
    cluster.request("POST", cluster.resource_path("resourceclaims", ns), workloads.resource_claim("mine"), user="alice")
    secret = "SECRET-OF-THE-SHARED-CLAIM"
    first.agent.stop()  # no hold: the window the issue found
    cluster.core("alice").create_namespaced_pod(ns, pod_on(first.name, "first", "mine", canary=secret))
    wait_phase(cluster, ns, "first", "Running")
    uuid = first.device_uuid("gpu-0")
    assert secret.encode() in first.gpu_memory(uuid)
    refusal = refuse_binding(ns, "second")
    for doc in refusal:
        cluster.apply(doc)
    try:
        wait_for(lambda: binding_refused(cluster, ns, "second", first.name), WAIT_S, "the Binding refusal in force")
        cluster.core("alice").create_namespaced_pod(ns, pod_on(first.name, "second", "mine"))
        cluster.core("alice").delete_namespaced_pod("first", ns)
        wait_for(lambda: cluster.pod(ns, "first") is None, WAIT_S, "the first pod gone")
        # The controller's drop of the pod that ran is refused while no agent holds the claim.
        refused = wait_for(
            lambda: [
                r
                for r in cluster.audit_denials("SG007", namespace=ns, name="mine", subResource="status")
                if "removed pod(s) first" in r["findings"][0]["message"]
            ],
            WAIT_S,
            "the resourceclaim controller's drop of the first pod refused",
        )
        assert refused[0]["user"] == CLAIM_CONTROLLER_USER
    finally:
        for doc in reversed(refusal):
            cluster.request("DELETE", object_path(doc))
    cluster.core("alice").delete_namespaced_pod("second", ns)
    # A pod on the claim that fits only gpu-node-2, and another tenant asking for gpu-node-1's GPU.
    cluster.core("alice").create_namespaced_pod(ns, pod_on(second.name, "third", "mine", look_for=secret))
    create_template(cluster, "bob", others, "that-gpu", selectors=[workloads.uuid_selector(uuid)])
    bob = workloads.pod("next", template="that-gpu", annotations=workloads.workload_annotations(look_for=secret))
    cluster.core("bob").create_namespaced_pod(others, bob)
    wait_for(lambda: cluster.pod(ns, "second") is None, WAIT_S, "the second pod gone")
    claim = cluster.claim(ns, "mine") or {}
    assert allocated_device(claim) == (workloads.DRIVER, first.name, "gpu-0"), "deallocated without a scrub"
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["first"], "the used claim looks used"
    assert not (cluster.pod(others, "next") or {})["spec"].get("nodeName")

    first.agent.start()  # its start-up finds the claim on its node, holds it, scrubs, attests, releases
    third = wait_phase(cluster, ns, "third", "Running", timeout=WAIT_S * 3)
    assert third["spec"]["nodeName"] == second.name and canary_found(third) is False
    nxt = wait_phase(cluster, others, "next", "Running", timeout=WAIT_S * 3)
    assert canary_found(nxt) is False
    payload = verified_attestation(cluster, claim["metadata"]["uid"])
    assert payload["node"] == first.name and payload["allocation"]["reservation"]
    assert_invariant(cluster)
