"""Expected refusals do not flood the audit log: the resourceclaim controller retrying a deallocation that awaits
its attestation is recorded once per claim, one tenant's refused dry runs once per requester, kind, operation and
rules, however their messages vary; every refusal is counted in a metric."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from scrubgate.policies import names
from scrubgate.policies.config import load_policy
from scrubgate.policies.selectors import DeviceClasses
from scrubgate.webhook import handlers
from scrubgate.webhook.app import AdmissionEndpoint, WebhookState, create_app
from scrubgate.webhook.audit import backup_path
from scrubgate.webhook.defaults import AUDIT_MAX_BYTES
from scrubgate.webhook.repeats import RepeatedRefusals, refusal_key
from scrubgate.webhook.server import Settings, build
from scrubgate.webhook.transport import decode
from test_webhook_deallocation import deallocation_review
from webhook_support import (
    AGENT_KEYS,
    allocated_claim,
    audit_records,
    gpu_claim,
    gpu_pod,
    make_tls_dir,
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
    return metric_in(webhook.metrics(), name, **labels)


def metric_in(text: str, name: str, **labels: str) -> float:
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


TENANT = "team-a"
SERVICE_ACCOUNTS = [f"system:serviceaccount:{TENANT}:probe-{i}" for i in range(64)]


def varied_dry_run(i: int, *, dry_run: bool = True) -> dict:
    """The i-th of one tenant's probes, each worded differently: one of its namespace's 64 ServiceAccounts in turn,
    a pod or a claim, a new name, and 1 to 20 tolerations of scrubgate's taints with keys never used before (each
    a finding whose message and path differ), all refused by SG005."""
    tolerations = [{"key": f"scrubgate.dev/probe-{i}-{j}", "operator": "Exists"} for j in range(1 + i % 20)]
    if (i // len(SERVICE_ACCOUNTS)) % 2:
        obj = gpu_claim(name=f"probe-{i}", namespace=TENANT, tolerations=tolerations)
    else:
        obj = gpu_pod(name=f"probe-{i}", namespace=TENANT, tolerations=tolerations)
    user = {"username": SERVICE_ACCOUNTS[i % len(SERVICE_ACCOUNTS)], "groups": ["system:serviceaccounts"]}
    return review(obj, user=user, dry_run=dry_run)


def refused(body: dict):
    request = decode(json.dumps(body).encode())
    outcome = handlers.handle_validate(request, load_policy(None), DeviceClasses(), trusted=False)
    assert outcome.decision == "deny"
    return request, outcome.findings


def test_a_refused_dry_run_is_keyed_on_what_was_refused_not_on_its_words():
    """Same requester, namespace, kind, operation and rules: one key, whatever the name, the toleration keys
    (the message) or their number (the findings' paths). Any of those five changed: another key."""
    first = refusal_key(*refused(varied_dry_run(0)))
    assert first is not None
    assert {refusal_key(*refused(varied_dry_run(i))) for i in range(0, 20 * 128, 128)} == {first}
    other_user = varied_dry_run(1)
    other_kind = varied_dry_run(64)
    other_namespace = varied_dry_run(0)
    other_namespace["request"]["namespace"] = "team-b"
    update = varied_dry_run(0)
    update["request"].update(operation="UPDATE", oldObject=gpu_pod(name="probe-0", namespace=TENANT))
    more_rules = varied_dry_run(0)
    more_rules["request"]["object"]["spec"]["terminationGracePeriodSeconds"] = 0  # SG003 as well
    keys = [refusal_key(*refused(body)) for body in (other_user, other_kind, other_namespace, update, more_rules)]
    rules = {finding.rule for finding in refused(more_rules)[1]}
    assert rules == {"SG003", "SG005"}
    assert len({first, *keys}) == 6


@contextmanager
def admission(directory: Path) -> Iterator[tuple[AdmissionEndpoint, Path, WebhookState]]:
    """/validate of the real app, called as uvicorn calls it, with the shipped audit log (hash-chained, rotated
    at AUDIT_MAX_BYTES): the transport is left out, so that ten thousand requests take seconds."""
    audit_log = directory / "audit" / "audit.jsonl"
    tls = make_tls_dir(directory / "tls")
    state, audit = build(Settings(tls_cert=tls.tls_cert, tls_key=tls.tls_key, audit_log=audit_log))
    try:
        yield create_app(state).admission["/validate"], audit_log, state
    finally:
        if audit is not None:
            audit.close()


async def post_all(endpoint: AdmissionEndpoint, bodies: list[dict], at_once: int = 200) -> list[dict]:
    async def post(body: dict) -> dict:
        raw = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": "/validate", "query_string": b"", "state": {}}
        scope["headers"] = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]

        async def receive() -> dict:
            return {"type": "http.request", "body": raw, "more_body": False}

        status, answer = await endpoint.admit(scope, receive)
        assert status == 200
        return json.loads(answer)["response"]

    answers = []
    for start in range(0, len(bodies), at_once):  # many in flight, as from a flooding client
        answers += await asyncio.gather(*(post(body) for body in bodies[start : start + at_once]))
    return answers


def test_ten_thousand_varied_refused_dry_runs_of_one_tenant_roll_nothing_over(tmp_path):
    """The measurement of issue 28: one tenant's 10,000 refused dry runs, each worded differently, spread over
    its namespace's 64 ServiceAccounts. Each (ServiceAccount, kind) has its first refusal recorded, 128 records
    in all; the rest are counted; the audit log does not rotate. Keyed on the messages, all 10,000 were
    recorded (38 MB: rotated twice at the shipped 16 MiB)."""
    count = 10_000
    with admission(tmp_path) as (endpoint, audit_log, state):
        answers = asyncio.run(post_all(endpoint, [varied_dry_run(i) for i in range(count)]))
        assert all(answer["allowed"] is False for answer in answers)
        records = [json.loads(line) for line in audit_log.read_text().splitlines()]
        unrecorded = metric_in(state.metrics.render().decode(), "scrubgate_webhook_audit_repeats_unrecorded_total")
    assert not backup_path(audit_log, 1).exists(), "the audit log rotated"
    assert audit_log.stat().st_size < AUDIT_MAX_BYTES / 16
    recorded = {(record["user"], record["kind"]) for record in records}
    assert len(records) == len(recorded) == 2 * len(SERVICE_ACCOUNTS)
    assert recorded == {(user, kind) for user in SERVICE_ACCOUNTS for kind in ("Pod", "ResourceClaim")}
    assert all(record["dryRun"] and {f["rule"]["id"] for f in record["findings"]} == {"SG005"} for record in records)
    assert unrecorded == count - len(records), "every refusal left out is counted"


def test_refusals_for_real_are_each_recorded_however_alike(tmp_path):
    """Only dry runs (which change nothing) are deduplicated: the same tenant's real writes, refused by the same
    rule, are a record each."""
    with admission(tmp_path) as (endpoint, audit_log, _):
        bodies = [varied_dry_run(i, dry_run=False) for i in (0, 128, 256)] * 2
        assert all(answer["allowed"] is False for answer in asyncio.run(post_all(endpoint, bodies)))
        records = [json.loads(line) for line in audit_log.read_text().splitlines()]
    assert len(records) == 6 and not any(record["dryRun"] for record in records)
