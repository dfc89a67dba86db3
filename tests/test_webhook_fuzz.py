"""Property-based fuzzing of the envelope and the object, over real HTTPS: no crash becomes a 5xx, no
malformed request is allowed, and junk added to a denied object never turns it into an allow."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scrubgate.policies import names
from scrubgate.webhook.server import Settings
from webhook_support import gpu_claim, make_tls_dir, review, running_webhook

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    tls = make_tls_dir(directory / "tls")
    settings_ = Settings(tls_cert=tls.tls_cert, tls_key=tls.tls_key, audit_log=directory / "audit.jsonl")
    with running_webhook(settings_, tls.ca_cert) as running, running.client() as client:
        running.http = client
        yield running


def denied_review() -> dict[str, Any]:
    """A ResourceClaim CREATE that the default policy denies (Retain in a multi-tenant namespace)."""
    return review(gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"}), uid="f0zz-0000")


def post(webhook, body: bytes) -> tuple[int, dict[str, Any]]:
    response = webhook.http.post("/validate", content=body, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    out = response.json()
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert isinstance(out["response"]["allowed"], bool)
    if response.status_code != 200:
        assert out["response"]["allowed"] is False
    return response.status_code, out["response"]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


# Required envelope fields, and the values that would still be valid there (excluded from replacements).
REQUIRED = {
    ("apiVersion",): {"admission.k8s.io/v1"},
    ("kind",): {"AdmissionReview"},
    ("request",): set(),
    ("request", "uid"): None,  # any non-empty string is a valid uid
    ("request", "kind"): set(),
    ("request", "kind", "version"): {"v1"},
    ("request", "kind", "kind"): {"ResourceClaim"},
    ("request", "resource"): set(),
    ("request", "resource", "resource"): None,
    ("request", "operation"): {"CREATE", "CONNECT"},
    ("request", "userInfo"): set(),
    ("request", "object"): None,
}


@FUZZ
@given(path=st.sampled_from(sorted(REQUIRED)), delete=st.booleans(), value=json_values)
def test_a_broken_required_field_is_refused(webhook, path, delete, value):
    body = denied_review()
    parent, key = _get(body, path[:-1]), path[-1]
    valid = REQUIRED[path]
    if delete:
        del parent[key]
    else:
        if valid is None:  # free-form strings/objects: only a wrong type (or an empty string) breaks them
            if (isinstance(value, str) and value) or (key == "object" and isinstance(value, dict)):
                value = 0
        elif (isinstance(value, str) and value in valid) or (not valid and isinstance(value, dict)):
            value = []
        parent[key] = value
    status, response = post(webhook, json.dumps(body).encode())
    assert status == 400, response
    assert response["allowed"] is False


@FUZZ
@given(data=st.data())
def test_junk_added_anywhere_never_turns_a_denial_into_an_allow(webhook, data):
    body = denied_review()
    containers = [p for p in _paths(body) if isinstance(_get(body, p), dict)]
    for _ in range(data.draw(st.integers(1, 4))):
        target = _get(body, data.draw(st.sampled_from(containers)))
        key = data.draw(st.text(min_size=1, max_size=12).filter(lambda k, t=target: k not in t))
        target[key] = data.draw(json_values)
    status, response = post(webhook, json.dumps(body).encode())
    assert response["allowed"] is False
    if status == 200:
        assert response["uid"] == body["request"]["uid"]
        assert "SG001" in response["status"]["message"]


@FUZZ
@given(data=st.data())
def test_a_corrupted_object_is_answered_without_a_crash(webhook, data):
    body = denied_review()
    obj = body["request"]["object"]
    path = data.draw(st.sampled_from([p for p in _paths(obj) if p]))
    replacement = data.draw(json_values)
    parent = _get(obj, path[:-1])
    parent[path[-1]] = replacement
    status, response = post(webhook, json.dumps(body).encode())
    if status == 200:
        assert response["uid"] == body["request"]["uid"]
        # An allow only where the corruption removed what the policy denies.
        assert not (response["allowed"] and _still_retains_a_gpu(obj))


def _still_retains_a_gpu(obj: Any) -> bool:
    try:
        return (
            obj["apiVersion"] == "resource.k8s.io/v1"
            and obj["kind"] == "ResourceClaim"
            and obj["metadata"]["annotations"][names.ANNOTATION_DEALLOCATION_POLICY] == "Retain"
            and obj["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.nvidia.com"
        )
    except (KeyError, IndexError, TypeError):
        return False


@FUZZ
@given(body=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_arbitrary_bytes_are_refused(webhook, body):
    status, response = post(webhook, body)
    assert status == 400 and response["allowed"] is False
