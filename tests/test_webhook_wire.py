"""The hot path's parts without a server: the decoder's strictness where it parses JSON and validates the
envelope in separate steps, the encoder's shortcut for a plain allow, and the admission metrics' exposition."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from scrubgate.webhook import responses
from scrubgate.webhook.metrics import Metrics
from scrubgate.webhook.review import compact_json
from scrubgate.webhook.transport import TransportError, check_content_type, decode, encode
from webhook_support import gpu_claim, gpu_pod, review

ADMIN = {"username": "root-admin", "groups": ["system:masters", "system:authenticated"]}


def _refused(body: bytes, fragment: str) -> None:
    with pytest.raises(TransportError) as caught:
        decode(body)
    assert caught.value.status == 400
    assert fragment in caught.value.message


def test_a_review_is_decoded_with_the_fields_the_handlers_read():
    body = review(gpu_claim(), operation="UPDATE", old=gpu_claim(), user=ADMIN, dry_run=True)
    request = decode(json.dumps(body).encode())
    assert request.uid == body["request"]["uid"]
    assert (request.api_version, request.kind_name) == ("resource.k8s.io/v1", "ResourceClaim")
    assert (request.username, request.groups) == (ADMIN["username"], tuple(ADMIN["groups"]))
    assert request.operation == "UPDATE" and request.dry_run is True
    assert request.object == gpu_claim() and request.old_object == gpu_claim()
    core = decode(json.dumps(review(gpu_pod())).encode())
    assert (core.api_version, core.kind_name) == ("v1", "Pod")


def test_json_that_the_api_server_cannot_send_is_malformed():
    good = json.dumps(review(gpu_claim()))
    _refused(good.replace('"dryRun": false', '"dryRun": NaN').encode(), "malformed JSON")
    _refused(good.encode()[:-1], "malformed JSON")
    _refused(good.encode("utf-16"), "malformed JSON")


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("userInfo", {"username": "alice", "groups": "system:masters"}, "request.userInfo.groups"),
        ("userInfo", {"username": 7}, "request.userInfo.username"),
        ("userInfo", {"extra": {"scopes": "all"}}, "request.userInfo.extra"),
        ("requestKind", {"group": "", "version": "v1", "kind": ""}, "request.requestKind.kind"),
        ("requestResource", {"version": "v1"}, "request.requestResource.resource"),
        ("resource", {"group": 1, "version": "v1", "resource": "resourceclaims"}, "request.resource.group"),
        ("kind", {"group": "resource.k8s.io", "version": "", "kind": "ResourceClaim"}, "request.kind.version"),
        ("dryRun", "false", "request.dryRun"),
        ("options", [], "request.options"),
        ("name", None, "request.name"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_not_coerced(field, value, fragment):
    body = review(gpu_claim())
    body["request"][field] = value
    _refused(json.dumps(body).encode(), fragment)


@pytest.mark.parametrize("value", [b"application/json", b"application/json; charset=utf-8", b"Application/JSON "])
def test_json_content_types_are_accepted(value):
    check_content_type(value)


@pytest.mark.parametrize(("value", "shown"), [(None, "'none'"), (b"text/plain", "'text/plain'"), (b"", "'none'")])
def test_other_content_types_are_refused_with_415(value, shown):
    with pytest.raises(TransportError) as caught:
        check_content_type(value)
    assert caught.value.status == 415
    assert caught.value.message == f"Content-Type must be application/json, got {shown}"


def test_a_review_that_is_not_an_object_is_refused():
    _refused(b"[]", "AdmissionReview")
    _refused(b'"AdmissionReview"', "AdmissionReview")
    body = review(gpu_claim())
    body["request"] = [body["request"]]
    _refused(json.dumps(body).encode(), "request")


@pytest.mark.parametrize(
    "uid", ["7a1c0000-0000-4000-8000-000000000001", 'quote " and \\ backslash', "tab\tnl\n", "ünï"]
)
def test_a_plain_allow_is_encoded_like_every_other_answer(uid):
    response = responses.allowed(uid)
    assert encode(response) == compact_json(response.to_review()).encode()
    assert json.loads(encode(response)) == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": True},
    }


def test_admission_metrics_are_exposed_as_prometheus_counters_and_a_histogram():
    metrics = Metrics()
    for seconds in (0.0002, 0.0005, 0.003, 7.0):
        metrics.admission.count("/validate", "CREATE", "Pod", "allow", seconds)
    metrics.admission.count("/mutate", "CREATE", "ResourceClaim", "patch", 0.0007)
    metrics.admission.hit("SG004", "warn")
    metrics.admission.hit("SG004", "warn")
    exposed = {
        (sample.name, *sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    pod = (("decision", "allow"), ("kind", "Pod"), ("operation", "CREATE"), ("webhook", "/validate"))
    assert exposed[("scrubgate_admission_requests_total", *pod)] == 4
    assert exposed[("scrubgate_admission_requests_created", *pod)] > 0
    bucket = "scrubgate_admission_duration_seconds_bucket"
    validate = ("webhook", "/validate")
    # Cumulative buckets, a bound counting the observations equal to it (0.0005 <= 0.0005).
    assert exposed[(bucket, ("le", "0.0005"), validate)] == 2
    assert exposed[(bucket, ("le", "0.0025"), validate)] == 2
    assert exposed[(bucket, ("le", "0.005"), validate)] == 3
    assert exposed[(bucket, ("le", "5.0"), validate)] == 3
    assert exposed[(bucket, ("le", "+Inf"), validate)] == 4
    assert exposed[("scrubgate_admission_duration_seconds_count", validate)] == 4
    assert exposed[("scrubgate_admission_duration_seconds_sum", validate)] == pytest.approx(7.0037)
    assert exposed[(bucket, ("le", "0.001"), ("webhook", "/mutate"))] == 1
    assert exposed[("scrubgate_admission_duration_seconds_created", validate)] > 0
    assert exposed[("scrubgate_rule_hits_total", ("action", "warn"), ("rule", "SG004"))] == 2
