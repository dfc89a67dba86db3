"""The fence guard through the real webhook over HTTPS: the API server's AdmissionReview for a DELETE or
UPDATE of a cluster-scoped DeviceTaintRule (no namespace, `object` null on DELETE), the decision, and the
one audit record naming it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from scrubgate.policies import names
from test_policies_fence_guard import fence
from webhook_support import ADMIN, AGENT, audit_records, post_review, record_for, review, serving

NAME = fence()["metadata"]["name"]


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("fence-guard")) as running:
        yield running


def fence_review(
    operation: str, old: dict[str, Any], new: dict[str, Any] | None = None, user: dict[str, Any] | None = None
) -> dict[str, Any]:
    """As kube-apiserver sends it for a cluster-scoped object: no namespace, in the rule's own version."""
    body = review(new, operation=operation, old=old, user=user)
    request = body["request"]
    version = old["apiVersion"].partition("/")[2]
    for field in ("kind", "resource", "requestKind", "requestResource"):
        request[field]["version"] = version
    del request["namespace"]
    return body


def unrecorded(webhook, body: dict[str, Any]) -> bool:
    return not [record for record in audit_records(webhook) if record["uid"] == body["request"]["uid"]]


def test_a_user_deleting_a_fence_is_denied_and_recorded_once(webhook):
    body = fence_review("DELETE", fence())
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False and response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith(f"scrubgate denied DELETE of DeviceTaintRule {NAME}: SG007 finalizer-guard: ")
    assert f"user 'alice' deleted DeviceTaintRule {NAME!r}, scrubgate's fence ({names.TAINT_UNSANITIZED})" in message
    record = record_for(webhook, body["request"]["uid"])
    assert (record["decision"], record["operation"], record["kind"], record["namespace"], record["name"]) == (
        "deny",
        "DELETE",
        "DeviceTaintRule",
        "",
        NAME,
    )
    assert (record["apiVersion"], record["user"]) == ("resource.k8s.io/v1", "alice")
    assert [(f["rule"]["id"], f["action"], f["path"]) for f in record["findings"]] == [("SG007", "deny", "/spec")]


@pytest.mark.parametrize("version", ["v1beta2", "v1alpha3"])
def test_every_served_version_is_guarded(webhook, version: str):
    old = fence(version, names.TAINT_SCRUB_FAILED)
    moved = copy.deepcopy(old)
    moved["spec"]["deviceSelector"]["device"] = "gpu-7"
    for body in (fence_review("DELETE", old), fence_review("UPDATE", old, moved)):
        response = post_review(webhook, "/validate", body)
        assert response["allowed"] is False and "SG007" in response["status"]["message"]
        assert record_for(webhook, body["request"]["uid"])["apiVersion"] == f"resource.k8s.io/{version}"


def test_the_agent_lifts_its_fence_without_a_record(webhook):
    body = fence_review(
        "DELETE",
        fence(),
        user={
            "username": AGENT,
            "groups": ["system:serviceaccounts"],
            "extra": {"authentication.kubernetes.io/node-name": ["node-1"]},
        },
    )
    assert post_review(webhook, "/validate", body) == {"uid": body["request"]["uid"], "allowed": True}
    assert unrecorded(webhook, body)


def test_an_admin_lifts_a_fence_allowed_and_recorded_as_audit(webhook):
    body = fence_review("DELETE", fence(), user=ADMIN)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is True and "warnings" not in response
    record = record_for(webhook, body["request"]["uid"])
    assert record["decision"] == "audit" and record["user"] == ADMIN["username"]
    assert record["findings"][0]["message"].startswith(f"admin 'root-admin' deleted DeviceTaintRule {NAME!r}")


def test_a_label_change_and_other_rules_pass_unrecorded(webhook):
    old = fence()
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"]["team"] = "a"
    other = fence(key="example.com/maintenance")
    for body in (fence_review("UPDATE", old, relabelled), fence_review("DELETE", other)):
        assert post_review(webhook, "/validate", body)["allowed"] is True
        assert unrecorded(webhook, body)
