"""What `scrubgate reports` keeps of an object (scrubgate/slim.py) gives the engine's findings on the whole object:
for every manifest of manifests/examples and tests/realworld, under both tenancies, with the DeviceClasses and
claims among them (as reports runs it: manifest mode, read from a cluster); an object it drops has no finding; and
so for malformed variants (a wrong type anywhere, as tests/test_policies_fuzz.py makes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scrubgate.policies.config import load_policy
from scrubgate.policies.engine import DeviceClasses, shared_claims, validate
from test_policies_fuzz import json_values, paths, seeds, substitute

from scrubgate.check import known_from
from scrubgate.slim import slim
from scrubgate.sources import Document

REPO = Path(__file__).resolve().parents[1]
POLICY = load_policy(None)


def documents() -> list[dict[str, Any]]:
    found = []
    for root in (REPO / "manifests" / "examples", REPO / "tests" / "realworld"):
        for file in sorted(root.rglob("*.yaml")):
            found += [d for d in yaml.safe_load_all(file.read_text()) if isinstance(d, dict) and d.get("kind")]
    return found


def context(objects: list[dict[str, Any]]) -> tuple[DeviceClasses, dict[tuple[str, str], dict[str, object]]]:
    """The DeviceClasses and claims among the objects, as `scrubgate check` reads them."""
    return known_from([Document("cluster", i, o, None) for i, o in enumerate(objects)], POLICY)


def findings(obj: dict[str, Any], trusted: bool, known: tuple[DeviceClasses, dict]) -> list[Any]:
    classes, claims = known
    return validate(obj, POLICY, trusted=trusted, stored=True, classes=classes, claims=claims)


def assert_same_findings(whole: list[dict[str, Any]]) -> None:
    kept = [slim(o) for o in whole]
    known_whole, known_kept = context(whole), context([o for o in kept if o is not None])
    for obj, small in zip(whole, kept, strict=True):
        for trusted in (False, True):
            expected = findings(obj, trusted, known_whole)
            if small is None:
                assert expected == [], (obj.get("kind"), obj.get("metadata"))
            else:
                assert findings(small, trusted, known_kept) == expected, (obj.get("kind"), obj.get("metadata"))
    for trusted in (False, True):
        shared = shared_claims(((i, o, trusted) for i, o in enumerate(whole)), POLICY)
        assert shared_claims(((i, o, trusted) for i, o in enumerate(kept) if o is not None), POLICY) == shared


def test_the_examples_and_real_world_manifests_give_the_same_findings_slim() -> None:
    whole = documents()
    assert len(whole) > 80
    assert_same_findings(whole)
    assert any(f for o in whole for f in findings(o, False, context(whole))), "the corpus has findings to keep"


def test_a_pod_of_no_device_is_dropped_and_a_gpu_pod_keeps_only_what_the_rules_read(dra) -> None:
    web = dra.carrier("Pod", {"containers": [{"name": "web", "image": "nginx", "resources": {"limits": {"cpu": "1"}}}]})
    assert slim(web) is None
    spec = dra.pod_spec(claim_name="shared", grace=30)
    spec["containers"] = [
        {"name": "side", "image": "envoy", "env": [{"name": "A", "value": "b" * 1000}]},
        {"name": "main", "image": "trainer", "resources": {"limits": {"cpu": "2", "example.com/nic": 1}}},
    ]
    spec["tolerations"] = [
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
        {"key": "scrubgate.dev/unsanitized", "operator": "Exists"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
    ]
    pod = dra.carrier("Pod", spec)
    pod["metadata"].update(managedFields=[{"manager": "kubectl"}], labels={"app": "x"}, uid="u")
    pod["status"] = {"phase": "Running"}
    kept = slim(pod)
    assert kept["metadata"] == {"name": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"], "uid": "u"}
    assert set(kept) == {"apiVersion", "kind", "metadata", "spec"}
    assert kept["spec"]["containers"] == [{}, {"resources": {"limits": {"example.com/nic": 1}}}]
    assert kept["spec"]["tolerations"] == [{}, {"key": "scrubgate.dev/unsanitized", "operator": "Exists"}]
    assert kept["spec"]["resourceClaims"] == spec["resourceClaims"]
    assert kept["spec"]["terminationGracePeriodSeconds"] == 30
    assert_same_findings([pod])
    # An extended resource of any domain keeps a pod: a DeviceClass may offer its devices under any name.
    plugin = dra.carrier("Deployment", {"containers": [{"resources": {"requests": {"vendor.example/accel": 1}}}]})
    assert slim(plugin) is not None


def test_a_claim_keeps_its_requests_finalizers_and_scrubgates_annotations_not_its_status(dra) -> None:
    claim = dra.claim("v1", annotations={"scrubgate.dev/deallocation-policy": "Retain", "team": "x"})
    claim["status"] = {"allocation": {"devices": {"results": [{"device": "gpu-0"}]}}, "reservedFor": [{"uid": "p"}]}
    claim["spec"]["devices"]["config"] = [{"opaque": {"driver": "gpu.nvidia.com", "parameters": {"x": "y" * 500}}}]
    kept = slim(claim)
    assert "status" not in kept and kept["spec"] == {"devices": {"requests": claim["spec"]["devices"]["requests"]}}
    assert kept["metadata"]["annotations"] == {"scrubgate.dev/deallocation-policy": "Retain"}
    template = dra.claim(
        "v1", "ResourceClaimTemplate", template_annotations={"scrubgate.dev/deallocation-policy": "Retain"}
    )
    assert slim(template)["spec"]["metadata"] == {"annotations": {"scrubgate.dev/deallocation-policy": "Retain"}}
    assert_same_findings([claim, template])


@pytest.fixture(scope="module")
def seed_objects(dra) -> list[dict[str, Any]]:
    return seeds(dra)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), value=json_values)
def test_a_wrong_type_anywhere_gives_the_same_findings_slim(seed_objects, data, value) -> None:
    seed = data.draw(st.sampled_from(seed_objects))
    path = data.draw(st.sampled_from(paths(seed)))
    mutated = substitute(seed, path, value)
    if isinstance(mutated, dict):
        assert_same_findings([mutated])
