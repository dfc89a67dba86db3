"""The deallocation guard through the real webhook over HTTPS: the API server's AdmissionReview for the
`resourceclaims/status` subresource, the decision, and the audit record naming the subresource."""

from __future__ import annotations

from typing import Any

import pytest
from scrubgate.policies import names
from test_policies_deallocation import deallocated
from webhook_support import (
    ADMIN,
    AGENT_KEYS,
    allocated_claim,
    attestation,
    audit_records,
    post_review,
    record_for,
    review,
    serving,
    with_changes,
)

SCHEDULER = {"username": "system:kube-scheduler", "groups": ["system:authenticated"]}


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("deallocation"), {"attestationKeys": AGENT_KEYS}) as running:
        yield running


def deallocation_review(old: dict[str, Any], user: dict[str, Any] | None = None) -> dict[str, Any]:
    """The UPDATE of resourceclaims/status that clears `old`'s allocation, as kube-apiserver sends it."""
    body = review(deallocated(old), operation="UPDATE", old=old, user=user)
    body["request"]["subResource"] = body["request"]["requestSubResource"] = "status"
    return body


def unrecorded(webhook, uid: str) -> bool:
    return not [record for record in audit_records(webhook) if record["uid"] == uid]


def test_a_user_clearing_a_gpu_claims_allocation_is_denied_and_recorded(webhook):
    body = deallocation_review(allocated_claim())
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith("scrubgate denied UPDATE of ResourceClaim team-a/train-0: SG007 finalizer-guard:")
    assert "user 'alice' cleared the allocation" in message
    record = record_for(webhook, body["request"]["uid"])
    assert (record["decision"], record["operation"], record["subResource"]) == ("deny", "UPDATE", "status")
    assert [(f["rule"]["id"], f["path"]) for f in record["findings"]] == [("SG007", "/status/allocation")]


def test_the_trusted_path_guards_the_deallocation_too(webhook):
    response = post_review(webhook, "/validate/trusted", deallocation_review(allocated_claim()))
    assert response["allowed"] is False and "SG007" in response["status"]["message"]


def test_the_scheduler_undoes_its_own_allocation_without_a_record(webhook):
    old = allocated_claim()
    del old["metadata"]["annotations"][names.ANNOTATION_DEVICES]  # no agent saw it used
    old["metadata"]["finalizers"].append(names.DELETE_PROTECTION_FINALIZER)
    body = deallocation_review(old, SCHEDULER)
    response = post_review(webhook, "/validate", body)
    assert response == {"uid": body["request"]["uid"], "allowed": True}
    assert unrecorded(webhook, body["request"]["uid"])


def test_the_scheduler_may_not_clear_a_claim_the_agent_saw_used(webhook):
    body = deallocation_review(allocated_claim(), SCHEDULER)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False
    assert "user 'system:kube-scheduler' cleared the allocation" in response["status"]["message"]


def test_an_attested_claim_is_deallocated_without_a_record(webhook):
    old = allocated_claim()
    old["metadata"]["annotations"][names.ANNOTATION_ATTESTATION] = attestation(old)
    body = deallocation_review(old)
    assert post_review(webhook, "/validate", body)["allowed"] is True
    assert unrecorded(webhook, body["request"]["uid"])


def test_an_attestation_for_another_claim_does_not_deallocate(webhook):
    old = allocated_claim()
    old["metadata"]["annotations"][names.ANNOTATION_ATTESTATION] = attestation(
        old, uid="00000000-0000-4000-8000-000000000099"
    )
    response = post_review(webhook, "/validate", deallocation_review(old))
    assert response["allowed"] is False
    assert "attestation is for claim UID '00000000-0000-4000-8000-000000000099'" in response["status"]["message"]


def test_break_glass_deallocation_is_allowed_and_recorded_as_audit(webhook):
    old = allocated_claim()
    old["metadata"]["annotations"][names.ANNOTATION_BREAK_GLASS] = "node-1 lost in a fire"
    body = deallocation_review(old, ADMIN)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is True and "warnings" not in response
    record = record_for(webhook, body["request"]["uid"])
    assert (record["decision"], record["subResource"]) == ("audit", "status")
    assert "break-glass deallocation by admin 'root-admin'" in record["findings"][0]["message"]


def test_a_main_resource_record_has_an_empty_subresource(webhook):
    old = allocated_claim()
    body = review(with_changes(old, finalizers=[]), operation="UPDATE", old=old)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False and "SG007 finalizer-guard" in response["status"]["message"], response["status"]
    record = record_for(webhook, body["request"]["uid"])
    assert record["subResource"] == ""
    assert [f["path"] for f in record["findings"]] == ["/metadata/finalizers"]
