"""The CEL subset the stand-in evaluates matchConditions and device selectors with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from devcluster.cel import CelError, evaluate

REQUEST = {
    "userInfo": {
        "username": "system:serviceaccount:scrubgate-system:scrubgate-agent",
        "groups": ["system:serviceaccounts", "system:authenticated"],
    },
    "operation": "UPDATE",
    "namespace": "team-a",
    "subResource": "status",
}
OBJECT = {
    "metadata": {"name": "c", "labels": {"app": "x"}, "finalizers": ["scrubgate.dev/sanitize"]},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
}
DEVICE = {"driver": "gpu.nvidia.com", "attributes": {"gpu.nvidia.com": {"type": "mig", "index": 3}}}
VARS = {"request": REQUEST, "object": OBJECT, "oldObject": None, "device": DEVICE}


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ('request.userInfo.username == "system:serviceaccount:scrubgate-system:scrubgate-agent"', True),
        ("!('system:masters' in request.userInfo.groups)", True),
        ("has(object.metadata.labels) && object.metadata.labels.app == 'x'", True),
        ("has(object.metadata.annotations)", False),
        ("oldObject == null || oldObject.metadata.name == object.metadata.name", True),
        ("request.operation in ['CREATE', 'UPDATE'] ? request.subResource != 'status' : false", False),
        ("object.metadata.finalizers.exists(f, f.startsWith('scrubgate.dev/'))", True),
        (
            "object.spec.devices.requests.all(r, has(r.exactly) && r.exactly.deviceClassName.endsWith('.nvidia.com'))",
            True,
        ),
        ("size(object.metadata.finalizers) == 1 && object.metadata.finalizers[0] == 'scrubgate.dev/sanitize'", True),
        ('device.driver == "gpu.nvidia.com" && device.attributes["gpu.nvidia.com"].type == "mig"', True),
        ('device.attributes["gpu.nvidia.com"].index >= 2 && device.attributes["gpu.nvidia.com"].index < 7', True),
        ("1 + 2 * 3 == 7 && -1 < 0 && 7 / 2 == 3 && 7 % 2 == 1", True),
        ("'a' + 'b' == 'ab' && 'abc'.contains('b') && 'ABC'.lowerAscii() == 'abc'", True),
        ("false && object.metadata.missing", False),  # CEL: a decisive side absorbs the other's error
        ("object.metadata.missing || true", True),
        ("1 == true", False),  # no cross-type equality
    ],
)
def test_expressions(expression: str, expected: object) -> None:
    assert evaluate(expression, VARS) is expected


@pytest.mark.parametrize(
    "expression",
    [
        "object.metadata.missing == 'x'",  # selecting an absent field is an error, not false
        "true && object.metadata.missing",
        "oldObject.metadata.name == 'c'",  # null has no fields
        "unknownVariable",
        "'a' < 1",
        "object.metadata.name.frobnicate()",
        "object.metadata.name ==",  # syntax
        "object @ 1",
    ],
)
def test_errors(expression: str) -> None:
    with pytest.raises(CelError):
        evaluate(expression, VARS)


# ---------------------------------------------------------------------------- the shipped matchConditions

MANIFEST_SETTINGS = Path(__file__).resolve().parents[1] / "manifests" / "webhook-settings.yaml"
POD_WITH_CLAIMS = {"metadata": {"name": "p"}, "spec": {"containers": [], "resourceClaims": [{"name": "gpu"}]}}
POD_WITHOUT = {"metadata": {"name": "p"}, "spec": {"containers": []}}
CLAIM_OBJ = {"metadata": {"name": "c"}, "spec": {"devices": {"requests": []}}}
DEPLOYMENT = {"metadata": {"name": "d"}, "spec": {"template": {"spec": {"containers": [], "resourceClaims": [{}]}}}}


def _request(group: str, resource: str, operation: str) -> dict:
    return {
        "resource": {"group": group, "version": "v1", "resource": resource},
        "operation": operation,
        "userInfo": {"username": "alice", "groups": []},
    }


@pytest.mark.parametrize(
    ("request_", "obj", "old", "called"),
    [
        (_request("", "pods", "CREATE"), POD_WITH_CLAIMS, None, True),
        (_request("", "pods", "CREATE"), POD_WITHOUT, None, False),
        (_request("", "pods", "DELETE"), None, POD_WITH_CLAIMS, False),  # no grace 0: not SG008's to decide
        (_request("", "pods", "DELETE"), None, POD_WITHOUT, False),
        (_request("resource.k8s.io", "resourceclaims", "UPDATE"), CLAIM_OBJ, CLAIM_OBJ, True),
        (_request("resource.k8s.io", "resourceclaims", "CREATE"), CLAIM_OBJ, None, True),
        (_request("apps", "deployments", "CREATE"), DEPLOYMENT, None, True),
        (_request("apps", "deployments", "CREATE"), {"metadata": {}, "spec": {"template": {"spec": {}}}}, None, False),
    ],
)
def test_every_shipped_match_condition_evaluates(
    request_: dict, obj: dict | None, old: dict | None, called: bool
) -> None:
    """The manifests' matchConditions run in the stand-in: each must evaluate to a bool, never error."""
    conditions = yaml.safe_load(MANIFEST_SETTINGS.read_text())["matchConditions"]
    assert conditions
    results = [evaluate(c["expression"], {"request": request_, "object": obj, "oldObject": old}) for c in conditions]
    assert all(isinstance(r, bool) for r in results)
    assert all(results) is called
