"""Objects nested deeper than pydantic-core's parser goes (200 levels), as Kubernetes stores them (opaque driver
parameters, up to 10,000 levels): decoded and evaluated like any other; malformed ones still refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scrubgate.policies import names
from scrubgate.webhook import deepjson
from scrubgate.webhook.transport import TransportError, decode
from webhook_support import audit_records, gpu_claim, review, serving

PLACEHOLDER = "__parameters__"


def nested_parameters(depth: int) -> str:
    """Opaque driver parameters nested `depth` levels deep, as JSON text (json.dumps itself recurses)."""
    opening = "".join("[" if level % 2 else f'{{"level{level % 7}": ' for level in range(depth))
    closing = "".join("]" if level % 2 else "}" for level in reversed(range(depth)))
    return f'{opening}{{"leaf": true}}{closing}'


def nested_review(depth: int, **claim_fields) -> tuple[dict, bytes]:
    """An AdmissionReview of a GPU claim whose opaque parameters are nested `depth` deep, and its body."""
    claim = gpu_claim(**claim_fields)
    claim["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": PLACEHOLDER}}
    ]
    body = review(claim)
    return body, json.dumps(body).replace(f'"{PLACEHOLDER}"', nested_parameters(depth)).encode()


def post(webhook, path: str, content: bytes):
    return webhook.http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("deep")) as running:
        yield running


@pytest.mark.parametrize("depth", [250, 9_000])
def test_a_deeply_nested_claim_is_evaluated_like_any_other(webhook, depth):
    _, content = nested_review(depth)
    mutated = post(webhook, "/mutate", content)
    assert mutated.status_code == 200, mutated.text
    assert mutated.json()["response"]["allowed"] is True
    assert "patch" in mutated.json()["response"], "the finalizer is added, as to any GPU claim"

    body, content = nested_review(depth, annotations={names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN})
    denied = post(webhook, "/validate", content)
    assert denied.status_code == 200, denied.text
    assert denied.json()["response"]["allowed"] is False and "SG001" in denied.json()["response"]["status"]["message"]
    assert [r["uid"] for r in audit_records(webhook)].count(body["request"]["uid"]) == 1


def test_malformed_deep_json_is_still_refused_with_400(webhook):
    text = nested_review(300)[1].decode()
    for broken in (text[:-1], text.replace('"leaf": true', '"leaf": tru'), text.replace('{"leaf"', '{"leaf",')):
        response = post(webhook, "/validate", broken.encode())
        assert response.status_code == 400, response.text
        assert response.json()["response"]["allowed"] is False
        assert "malformed JSON" in response.json()["response"]["status"]["message"]


def test_deeper_than_kubernetes_stores_is_refused():
    with pytest.raises(TransportError) as caught:
        decode(nested_review(deepjson.KUBERNETES_MAX_DEPTH + 10)[1])
    assert caught.value.status == 400 and "nested deeper than 10000 levels" in caught.value.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from([None, 1, 2]))
def test_the_deep_decoder_reads_what_the_standard_one_reads(value, indent):
    text = json.dumps(value, indent=indent, ensure_ascii=bool(indent))
    assert deepjson.loads(text.encode()) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        "[1,]",
        '{"a":1,}',
        "[1 2]",
        '{"a" 1}',
        "[",
        "",
        "[NaN]",
        "[Infinity]",
        '{"a":1}x',
        "[1e400]",
        '"\\x"',
        "tru",
        "01",
    ],
)
def test_the_deep_decoder_refuses_what_is_not_json(text):
    with pytest.raises(deepjson.DeepJSONError):
        deepjson.loads(text.encode())
