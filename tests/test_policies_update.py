"""On UPDATE only what the update introduces is judged: a pre-existing finding must not block later writes
(the agent's attested release above all), while a new violation is still denied."""

import copy

from scrubgate.policies import names
from scrubgate.policies.config import load_policy
from scrubgate.policies.engine import Admission, shared_claims, validate

POLICY = load_policy()


def retained_claim() -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "c",
            "namespace": "team-a",
            "uid": "uid-1",
            "annotations": {names.ANNOTATION_DEALLOCATION_POLICY: "Retain"},
            "finalizers": [names.FINALIZER],
        },
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "adminAccess": True}}]
            }
        },
    }


def update(old: dict, new: dict, user: str = "alice") -> list:
    return validate(new, POLICY, trusted=False, admission=Admission("UPDATE", user, ("tenants",), old_object=old))


def test_preexisting_violations_do_not_block_an_unrelated_update() -> None:
    old = retained_claim()
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"team": "a"}
    assert update(old, new) == []
    # ...whereas the same object arriving new is denied for both.
    created = validate(new, POLICY, trusted=False, admission=Admission("CREATE", "alice"))
    assert {f.rule for f in created} == {"SG001", "SG006"}


def test_an_update_that_introduces_retain_is_denied() -> None:
    new = retained_claim()
    old = copy.deepcopy(new)
    old["metadata"]["annotations"][names.ANNOTATION_DEALLOCATION_POLICY] = "Delete"
    assert [f.rule for f in update(old, new)] == ["SG001"]


def test_a_workload_update_that_introduces_a_shared_claim_is_denied() -> None:
    old = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "team-a"},
        "spec": {
            "template": {
                "spec": {
                    "terminationGracePeriodSeconds": 60,
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                }
            }
        },
    }
    new = copy.deepcopy(old)
    new["spec"]["template"]["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared"}]
    assert [f.rule for f in update(old, new)] == ["SG002"]
    scaled = copy.deepcopy(new)
    scaled["spec"]["replicas"] = 3
    assert update(new, scaled) == []


def test_the_finalizer_guard_still_applies_to_preexisting_violators() -> None:
    old = retained_claim()
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = []
    assert [f.rule for f in update(old, new)] == ["SG007"]


def pod(name: str, namespace: str | None, generate: bool = False) -> dict:
    meta = {"generateName": name} if generate else {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "shared-gpu"}]},
    }


def test_cross_document_pairs_absent_namespace_with_default() -> None:
    found = shared_claims([(0, pod("a", None), True), (1, pod("b", "default"), True)], POLICY)
    assert sorted(key for key, _ in found) == [0, 1]
    assert "namespace default" in found[0][1].message


def test_cross_document_tells_generate_name_pods_apart() -> None:
    found = shared_claims([(0, pod("worker-", "lab", True), True), (1, pod("worker-", "lab", True), True)], POLICY)
    assert sorted(key for key, _ in found) == [0, 1]


def test_one_pod_naming_a_claim_twice_is_not_shared() -> None:
    one = pod("a", "lab")
    one["spec"]["resourceClaims"].append({"name": "gpu2", "resourceClaimName": "shared-gpu"})
    assert shared_claims([(0, one, True)], POLICY) == []
