"""PodGroup-shared claims (Kubernetes 1.36 alpha): a PodGroup's spec.resourceClaims are one claim shared by every
pod of the group, and the claim is reserved for the PodGroup, not for a pod. SG002 treats both as a shared
claim in multi-tenant namespaces, and an attestation naming only pods does not cover a PodGroup's use."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies.attestation import AttestationError, check_claim_attestation, sign
from scrubgate.policies.engine import Admission, validate
from test_attestation import KID, claim, payload

GROUP_REF = {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "group-1", "uid": "pg-uid"}
POD_REF = {"resource": "pods", "name": "p1", "uid": "pod-1"}


def pod_group(claims: list[dict[str, Any]] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": 2}}}
    if claims is not None:
        spec["resourceClaims"] = claims
    return {
        "apiVersion": "scheduling.k8s.io/v1alpha2",
        "kind": "PodGroup",
        "metadata": {"namespace": "team-a", "name": "group-1"},
        "spec": spec,
    }


@pytest.mark.parametrize("admission", [None, Admission("CREATE", "alice")], ids=["ci", "admission"])
def test_a_pod_group_sharing_a_claim_is_sg002_in_a_multi_tenant_namespace(policy, admission):
    obj = pod_group([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])
    (finding,) = validate(obj, policy, trusted=False, admission=admission)
    assert (finding.rule, finding.action, finding.path) == ("SG002", "deny", "/spec/resourceClaims/0")
    assert "shared by every pod of the group" in finding.message
    assert validate(obj, policy, trusted=True, admission=admission) == []
    assert validate(pod_group(None), policy, trusted=False, admission=admission) == []


def allocated_gpu_claim(reserved: list[dict[str, Any]]) -> dict[str, Any]:
    obj = claim()
    obj.update(
        apiVersion="resource.k8s.io/v1",
        kind="ResourceClaim",
        spec={"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    )
    obj["metadata"].update(namespace="team-a", name="c")
    obj["status"]["reservedFor"] = reserved
    return obj


def reserve(old: dict[str, Any], policy, trusted: bool) -> list:
    new = copy.deepcopy(old)
    new["status"]["reservedFor"] = [GROUP_REF]
    admission = Admission("UPDATE", "system:kube-scheduler", old_object=old, subresource="status")
    return validate(new, policy, trusted=trusted, admission=admission)


def test_reserving_a_gpu_claim_for_a_pod_group_is_sg002_in_a_multi_tenant_namespace(policy):
    (finding,) = reserve(allocated_gpu_claim([]), policy, trusted=False)
    assert (finding.rule, finding.action, finding.path) == ("SG002", "deny", "/status/reservedFor")
    assert "reserved for podgroups.scheduling.k8s.io 'group-1'" in finding.message
    assert reserve(allocated_gpu_claim([]), policy, trusted=True) == []


def test_a_reservation_the_claim_already_had_blocks_no_later_write(policy):
    assert reserve(allocated_gpu_claim([GROUP_REF]), policy, trusted=False) == []


def test_an_attestation_naming_only_pods_does_not_cover_a_pod_groups_use():
    key = Ed25519PrivateKey.generate()
    keys = {KID: key.public_key()}
    used = allocated_gpu_claim([POD_REF, GROUP_REF])
    pods_only = sign(payload(consumers=[("p1", "pod-1")]), key, KID)
    with pytest.raises(
        AttestationError, match=r"does not cover the claim's use by podgroups.scheduling.k8s.io group-1"
    ):
        check_claim_attestation(pods_only, used, keys)
    both = sign(payload(consumers=[("p1", "pod-1"), ("group-1", "pg-uid")]), key, KID)
    assert check_claim_attestation(both, used, keys)["claim"]["uid"] == "uid-1"
    no_uid = allocated_gpu_claim([{**GROUP_REF, "uid": ""}])
    with pytest.raises(AttestationError, match="no UID"):
        check_claim_attestation(both, no_uid, keys)
