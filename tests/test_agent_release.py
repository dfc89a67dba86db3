"""When a claim counts as released: only once no live pod holds it, whatever its deletionTimestamp says."""

from __future__ import annotations

import copy

import pytest
from agent_support import make_node
from scrubgate.policies import names
from scrubgate.sanitizer_agent.checkpoint import State

pytestmark = pytest.mark.timeout(60)


def test_a_claim_being_deleted_is_not_scrubbed_while_its_pod_runs(tmp_path):
    """The API server only forbids new reservations on a claim being deleted; the reserved pod keeps using
    the GPU. Scrubbing then would attest memory the tenant is still writing."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    node.cluster.delete_claim("team-a", "job")  # held by our finalizer: deletionTimestamp set, pod still runs
    agent.observe_pod("MODIFIED", node.cluster.pods[pod["metadata"]["uid"]])
    agent.resync()
    node.settle(agent)
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.ALLOCATED, "not released while the reserved pod runs"
    assert node.canary_present(0) and node.fenced(0)
    annotations = node.cluster.claims[("team-a", "job")]["metadata"].get("annotations") or {}
    assert names.ANNOTATION_ATTESTATION not in annotations

    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    assert ("team-a", "job") not in node.cluster.claims, "attested, finalizer removed, the deleted claim went"
    assert node.violations.found == []


def extended_resource_pod(node, name: str, devices: list[int]) -> tuple[dict, dict]:
    """A pod asking for `nvidia.com/gpu` (KEP-5004): the scheduler created and allocated its claim, reserved
    it for the pod and named it in `status.extendedResourceClaimStatus`; the pod has no `spec.resourceClaims`."""
    claim, pod = node.tenant(name, devices)
    stored = node.cluster.pods[pod["metadata"]["uid"]]
    del stored["spec"]["resourceClaims"]
    del stored["status"]["resourceClaimStatuses"]
    stored["status"]["extendedResourceClaimStatus"] = {
        "resourceClaimName": name,
        "requestMappings": [
            {"containerName": "main", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
        ],
    }
    return claim, copy.deepcopy(stored)


def test_an_extended_resource_claim_is_fenced_from_the_pod_event_and_scrubbed(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = extended_resource_pod(node, "pod-gpu-x7k2q", [1])
    agent.observe_pod("ADDED", pod)
    assert claim["metadata"]["uid"] in agent.store.teardowns, "found from the pod, not at the claim resync"
    assert node.fenced(1)
    assert node.cluster.calls.count("list_claims") == 1, "only the list at start"

    agent.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(agent)
    assert node.clean(1) and not node.cluster.rules
    annotations = node.cluster.claims[("team-a", "pod-gpu-x7k2q")]["metadata"]["annotations"]
    assert names.ANNOTATION_ATTESTATION in annotations
    assert node.violations.found == []
