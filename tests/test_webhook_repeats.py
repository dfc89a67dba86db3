"""Expected refusals do not flood the audit log: the resourceclaim controller retrying a deallocation that awaits
its attestation is recorded once per claim, and every refusal is counted in a metric."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from scrubgate.policies import names
from scrubgate.webhook.repeats import RepeatedRefusals
from test_webhook_deallocation import deallocation_review
from webhook_support import (
    AGENT_KEYS,
    allocated_claim,
    audit_records,
    gpu_claim,
    post_review,
    review,
    serving,
    with_changes,
)

CONTROLLER = {
    "username": "system:serviceaccount:kube-system:resource-claim-controller",
    "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"],
}


@pytest.fixture
def webhook(tmp_path):
    with serving(tmp_path, {"attestationKeys": AGENT_KEYS}) as running:
        yield running


def metric(webhook, name: str, **labels: str) -> float:
    text = webhook.metrics()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def claim_with_uid(uid: str) -> dict:
    claim = allocated_claim()
    claim["metadata"]["uid"] = uid
    return claim


def test_the_controllers_retries_are_recorded_once_and_all_counted(webhook):
    claim = claim_with_uid("c1a1m000-0000-4000-8000-00000000000a")
    for _ in range(12):  # 5 ms doubling: a dozen retries before the agent's attestation lands
        response = post_review(webhook, "/validate", deallocation_review(claim, CONTROLLER))
        assert response["allowed"] is False and "SG007" in response["status"]["message"]
    records = audit_records(webhook)
    assert len(records) == 1
    assert (records[0]["user"], records[0]["subResource"]) == (CONTROLLER["username"], "status")
    assert "repeatsUnrecorded" not in records[0]
    assert metric(webhook, "scrubgate_webhook_refusals_total", rule="SG007", reason="/status/allocation") == 12
    assert metric(webhook, "scrubgate_webhook_audit_repeats_unrecorded_total") == 11


def test_another_claim_or_another_user_is_recorded_again(webhook):
    first = claim_with_uid("c1a1m000-0000-4000-8000-00000000000b")
    other = claim_with_uid("c1a1m000-0000-4000-8000-00000000000c")
    for body in (
        deallocation_review(first, CONTROLLER),
        deallocation_review(first, CONTROLLER),
        deallocation_review(other, CONTROLLER),
        deallocation_review(first),  # a user, not the controller
    ):
        assert post_review(webhook, "/validate", body)["allowed"] is False
    recorded = [(r["user"], r["name"]) for r in audit_records(webhook)]
    assert len(recorded) == 3
    assert recorded[-1][0] == "alice"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_is_recorded_again_after_the_window_with_the_number_left_out():
    clock = Clock()
    repeats = RepeatedRefusals(window_s=60.0, max_keys=10, clock=clock)
    assert repeats.record(b"k") == 0
    assert [repeats.record(b"k") for _ in range(3)] == [None, None, None]
    clock.now = 61.0
    assert repeats.record(b"k") == 3, "the next record says how many identical refusals it stands for"
    assert repeats.record(b"k") is None
    assert repeats.record(None) == 0 and repeats.record(None) == 0, "a refusal of no stored object: always"


def test_the_table_is_bounded_and_a_forgotten_refusal_is_recorded_again():
    repeats = RepeatedRefusals(window_s=3600.0, max_keys=2, clock=Clock())
    assert [repeats.record(key) for key in (b"a", b"b", b"c")] == [0, 0, 0]
    assert repeats.record(b"a") == 0, "evicted: more records, never fewer"
    assert repeats.record(b"c") is None


def test_repeated_refusals_of_the_object_itself_are_each_recorded(webhook):
    """A person trying again (the finalizer's removal, say) is worth a record each time: only status writes,
    the controller's retries, are recorded once."""
    held = claim_with_uid("c1a1m000-0000-4000-8000-00000000000d")
    released = with_changes(held, finalizers=[])
    for _ in range(3):
        body = review(released, operation="UPDATE", old=held)
        assert post_review(webhook, "/validate", body)["allowed"] is False
    assert len(audit_records(webhook)) == 3


def test_a_flood_of_refused_dry_runs_is_recorded_once_and_all_counted(webhook):
    """One tenant's dry runs (they change nothing) refused for the same reason, under any object name, are one
    record and a count: tens of thousands of them would otherwise roll the audit log over. The same refusal for
    real is still recorded each time."""
    for i in range(30):
        claim = gpu_claim(name=f"probe-{i}", annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"})
        assert post_review(webhook, "/validate", review(claim, dry_run=True))["allowed"] is False
    records = audit_records(webhook)
    assert len(records) == 1 and records[0]["dryRun"] is True
    assert metric(webhook, "scrubgate_webhook_audit_repeats_unrecorded_total") == 29
    real = gpu_claim(name="for-real", annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"})
    for _ in range(2):
        assert post_review(webhook, "/validate", review(real))["allowed"] is False
    assert len(audit_records(webhook)) == 3
