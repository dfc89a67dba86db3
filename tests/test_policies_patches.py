"""The mechanical fixes: SG003 (default grace period, in manifests) and SG004 (sanitize finalizer), applied with
jsonpatch; `default()` (the mutating webhook) adds only the finalizer, only on CREATE, and is idempotent."""

from __future__ import annotations

import copy

import jsonpatch
import pytest
from scrubgate.policies import names
from scrubgate.policies.config import parse_policy
from scrubgate.policies.engine import Admission, DeviceClasses, default, validate


def apply(obj, findings):
    return jsonpatch.apply_patch(copy.deepcopy(obj), [op for f in findings for op in f.patch])


@pytest.mark.parametrize(
    ("metadata", "expected_finalizers"),
    [
        ({"name": "c", "finalizers": ["example.com/keep"]}, ["example.com/keep", names.FINALIZER]),
        ({"name": "c", "finalizers": []}, [names.FINALIZER]),
        ({"name": "c", "finalizers": None}, [names.FINALIZER]),
        ({"name": "c"}, [names.FINALIZER]),
        (None, [names.FINALIZER]),
    ],
    ids=["other-finalizer", "empty-list", "null", "no-finalizers", "no-metadata"],
)
def test_sg004_patch_adds_the_finalizer_and_keeps_the_others(
    dra, policy, resource_version, metadata, expected_finalizers
):
    obj = dra.claim(resource_version)
    if metadata is None:
        del obj["metadata"]
    else:
        obj["metadata"] = metadata
    for findings in (validate(obj, policy, trusted=False), default(obj, policy)):
        assert [f.rule for f in findings] == ["SG004"]
        fixed = apply(obj, findings)
        assert fixed["metadata"]["finalizers"] == expected_finalizers
        assert fixed["spec"] == obj["spec"]
        if metadata:
            assert fixed["metadata"]["name"] == "c"
        assert validate(fixed, policy, trusted=False) == []
        assert default(fixed, policy) == []


def test_sg003_patch_sets_the_default_only_where_absent(dra, policy, carrier_kind):
    obj = dra.carrier(carrier_kind, dra.pod_spec(grace=None))
    findings = validate(obj, policy, trusted=True)  # a manifest, fixed by `scrubgate check --fix`
    assert [(f.rule, f.action) for f in findings] == [("SG003", "deny")]
    assert "the API server would set 30s" in findings[0].message
    fixed = apply(obj, findings)
    path = "/" + "/".join((*dra.spec_path(carrier_kind), "terminationGracePeriodSeconds"))
    assert jsonpatch.JsonPointer(path).resolve(fixed) == policy.grace_period.default_seconds
    assert validate(fixed, policy, trusted=True) == []
    # A value that is there, even a wrong one, is the user's: validation denies it, with no patch.
    too_short = validate(dra.carrier(carrier_kind, dra.pod_spec(grace=5)), policy, trusted=True)
    assert [(f.rule, f.patch) for f in too_short] == [("SG003", ())]


def test_the_mutating_webhook_never_sets_a_grace_period(dra, policy, carrier_kind):
    """The API server defaults an absent terminationGracePeriodSeconds (30 s) before mutating admission, so a
    default set there would never apply: the webhook leaves pods alone."""
    assert default(dra.carrier(carrier_kind, dra.pod_spec(grace=None)), policy) == []


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT"])
def test_default_only_on_create(dra, policy, operation):
    claim = dra.claim("v1")
    assert default(claim, policy, operation) == []
    assert default(claim, policy, "CREATE") != []


def test_default_gives_nothing_for_templates_non_gpu_claims_and_other_kinds(dra, policy):
    assert default(dra.claim("v1", "ResourceClaimTemplate"), policy) == []
    example = dra.claim("v1", requests=[dra.device_request("v1", "gpu.example.com")])
    other = {
        "metadata": {"name": "gpu.example.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.example.com'"}}]},
    }
    assert default(example, policy, classes=DeviceClasses.of([other], policy.gpu_drivers)) == []
    assert default({"apiVersion": "v1", "kind": "ConfigMap"}, policy) == []
    assert default(None, policy) == []


def test_default_is_idempotent(dra, policy, resource_version):
    obj = dra.claim(resource_version)
    once = apply(obj, default(obj, policy))
    assert once != obj
    assert default(once, policy) == []


def test_sg004_off_means_no_mutation(dra):
    off = parse_policy({"rules": {"SG004": {"action": "off"}}})
    assert default(dra.claim("v1"), off) == []


def test_admission_does_not_report_what_the_api_server_or_mutation_fills_in(dra, policy):
    # Before admission the API server defaults the grace period, and the mutating webhook adds the finalizer.
    create = Admission("CREATE", username="alice")
    assert validate(dra.carrier("Pod", dra.pod_spec(grace=None)), policy, trusted=False, admission=create) == []
    assert validate(dra.claim("v1"), policy, trusted=False, admission=create) == []
    short = validate(dra.carrier("Pod", dra.pod_spec(grace=5)), policy, trusted=False, admission=create)
    assert [f.rule for f in short] == ["SG003"]
