"""Heavy requests (a 2 MB pod with 25,000 tolerations, legal and sent by the API server) neither hold up small
ones nor fill the audit log: big bodies are evaluated off the event loop, and what one answer and one record
carry of their findings is bounded, with the count of the rest."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from scrubgate.policies.config import load_policy
from scrubgate.policies.selectors import DeviceClasses
from scrubgate.webhook import handlers
from scrubgate.webhook.fairlane import UNREAD, FairLane, tenant
from scrubgate.webhook.transport import decode, request_timeout
from webhook_support import USER, audit_records, gpu_claim, gpu_pod, review, serving

FENCE_TOLERATION = {"key": "scrubgate.dev/unsanitized", "operator": "Exists", "effect": "NoSchedule"}


def heavy_pod(tolerations: int = 25_000) -> dict:
    return gpu_pod(tolerations=[dict(FENCE_TOLERATION, value=f"v{i}") for i in range(tolerations)])


def hold_the_first_evaluation(monkeypatch, key):
    """Policy evaluation records `key(request)` of each request and holds the first one until `release` is
    set (`entered` tells when it is held): what waits behind it, and in which order, shows."""
    entered, release = threading.Semaphore(0), threading.Event()
    evaluated: list[str] = []
    real = handlers.handle_validate

    def held(request, policy, classes, *, trusted):
        evaluated.append(key(request))
        if len(evaluated) == 1:
            entered.release()
            release.wait(30)
        return real(request, policy, classes, trusted=trusted)

    monkeypatch.setattr(handlers, "handle_validate", held)
    return entered, release, evaluated


def test_a_heavy_refusal_has_a_bounded_answer_and_record_that_count_the_rest(tmp_path):
    with serving(tmp_path) as webhook:
        body = review(heavy_pod())
        assert len(json.dumps(body)) > 2_000_000
        response = webhook.http.post("/validate", json=body)
        assert response.status_code == 200
        answer = response.json()["response"]
        assert answer["allowed"] is False
        message = answer["status"]["message"]
        assert len(message) < 20_000
        assert message.endswith("more findings)")
        (record,) = audit_records(webhook)
        size = len(Path(webhook.audit_path).read_bytes())
        total = record["findingsOmitted"] + len(record["findings"])
        assert size < 64_000, f"one record of {size} bytes"
        assert len(record["findings"]) == 20 and total == sum(record["findingsByRule"].values())
        assert f"(and {total - 20} more findings)" in message


def test_a_small_request_is_answered_while_heavy_ones_are_evaluated(tmp_path, monkeypatch):
    """A heavy evaluation is held inside the policy call, others wait for the worker; a small /mutate is answered."""
    entered, release = threading.Semaphore(0), threading.Event()
    real = handlers.handle_validate

    def held(request, policy, classes, *, trusted):
        if len((request.object or {}).get("spec", {}).get("tolerations") or []) > 1000:
            entered.release()
            release.wait(30)
        return real(request, policy, classes, trusted=trusted)

    monkeypatch.setattr(handlers, "handle_validate", held)
    with serving(tmp_path) as webhook:
        body = json.dumps(review(heavy_pod(5_000))).encode()
        answers: list[int] = []

        def post_heavy() -> None:
            with webhook.client() as client:
                answers.append(
                    client.post("/validate", content=body, headers={"content-type": "application/json"}).status_code
                )

        heavy = [threading.Thread(target=post_heavy) for _ in range(3)]
        for thread in heavy:
            thread.start()
        try:
            assert entered.acquire(timeout=20), "a heavy request reached the policy"
            small = webhook.http.post("/mutate", json=review(gpu_claim()), timeout=10)
            assert small.status_code == 200 and small.json()["response"]["allowed"] is True
            assert answers == [], "answered while the heavy requests were still being evaluated or waiting for it"
        finally:
            release.set()
            for thread in heavy:
                thread.join(30)
        assert answers == [200, 200, 200]


def test_tenants_take_turns_on_the_heavy_lane():
    """A tenant's flood queued first: another tenant's request is evaluated after one of the flood's, not after
    all of them; within a tenant, in order."""
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def work(name: str):
        def run() -> str:
            if name == "blocker":
                started.set()
                release.wait(10)
            order.append(name)
            return name

        return run

    lane = FairLane()
    first = lane.submit("mallory", work("blocker"))
    assert started.wait(10)
    flood = [lane.submit("mallory", work(f"flood-{i}")) for i in range(5)]
    others = [
        lane.submit("alice", work("alice-1")),
        lane.submit("bob", work("bob-1")),
        lane.submit("alice", work("alice-2")),
    ]
    release.set()
    assert [f.result(10) for f in (first, *flood, *others)]
    assert order[:5] == ["blocker", "flood-0", "alice-1", "bob-1", "flood-1"]
    assert order[5:] == ["alice-2", "flood-2", "flood-3", "flood-4"]


def service_account(namespace: str, name: str) -> dict:
    username = f"system:serviceaccount:{namespace}:{name}"
    return {"username": username, "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"]}


def body_of(obj: dict, user: dict, **fields) -> bytes:
    return json.dumps(review(obj, user=user, **fields)).encode()


def test_a_namespaces_users_and_service_accounts_are_one_tenant_whatever_the_objects_size():
    """Anyone who may create ServiceAccount tokens in a namespace can be as many requesters as they like: the
    namespace is the tenant, read from the start of the body however big the object."""
    pod = heavy_pod(5_000)
    keys = {tenant(body_of(pod, service_account("team-a", f"sa-{i}"))) for i in range(64)}
    keys.add(tenant(body_of(pod, USER)))
    assert len(body_of(pod, USER)) > 500_000
    assert keys == {"namespace:team-a"}
    assert tenant(body_of(gpu_claim(namespace="team-b"), USER)) == "namespace:team-b"


def test_a_cluster_scoped_request_is_its_users_and_a_service_accounts_is_its_namespaces():
    device_class = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu"}}
    as_api_server = review(device_class, user=USER)
    del as_api_server["request"]["namespace"]  # omitempty: the API server writes none for a cluster-scoped object
    assert tenant(json.dumps(as_api_server).encode()) == "user:alice"
    assert tenant(body_of(device_class, USER)) == "user:alice", "an empty namespace is none"
    assert tenant(body_of(device_class, service_account("team-a", "ci"))) == "namespace:team-a"


def test_the_tenant_is_read_from_the_requests_own_fields_not_from_strings_that_look_like_them():
    """A name or an object's metadata that spells `"namespace": ...` is not the request's namespace."""
    pod = gpu_pod(name='x","namespace":"team-z')
    assert tenant(body_of(pod, USER)) == "namespace:team-a"
    device_class = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"namespace": "team-z"}}
    body = review(device_class, user={"username": 'bob","namespace":"team-z'})
    del body["request"]["namespace"]  # cluster-scoped: the API server writes none, whatever the object says
    assert tenant(json.dumps(body).encode()) == 'user:bob","namespace":"team-z'


def reordered(obj: dict, user: dict, first: str) -> bytes:
    """A review whose `first` member comes before all the others (the API server writes them in Go order)."""
    request = review(obj, user=user)["request"]
    request = {first: request.pop(first), **request}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


@pytest.mark.parametrize(
    "make",
    [
        lambda user: reordered(heavy_pod(3_000), user, "object"),  # the namespace after the prefix read
        lambda user: body_of(gpu_pod(), user)[:300],  # cut off before the namespace
        lambda user: body_of(gpu_pod(), user).replace(b'"namespace": "team-a"', b'"namespace": 7', 1),
        lambda user: b"not json " + body_of(gpu_pod(), user),
        lambda user: body_of(gpu_pod(), user).replace(b'"uid": ', b'"uid": ' + b"[" * 10_000, 1),
    ],
    ids=["object-first", "cut-off", "namespace-not-a-string", "not-json", "nested-past-measure"],
)
def test_a_request_whose_tenant_cannot_be_read_gets_no_lane_of_its_own(make):
    """Every such request shares one queue, whoever sends it: no namespace read does not mean "cluster-scoped,
    key by user", which would give each of a namespace's ServiceAccounts a turn of its own."""
    keys = {tenant(make(service_account("team-a", f"sa-{i}"))) for i in range(8)}
    assert keys == {UNREAD}


def test_a_tenants_heavy_flood_does_not_hold_up_another_tenants_large_object(tmp_path, monkeypatch):
    """Through the webhook: heavy dry runs of six ServiceAccounts of team-a are being evaluated and queued;
    alice's one large pod in team-b is answered after at most one more of team-a's, while most of the flood
    still waits. Keyed by requester, the six would have taken six turns to alice's one."""
    entered, release, evaluated = hold_the_first_evaluation(monkeypatch, lambda request: request.username)
    with serving(tmp_path) as webhook:

        def post(pod: dict, user: dict, answers: list[float]) -> None:
            body = json.dumps(review(pod, user=user, dry_run=True)).encode()
            with webhook.client() as client:
                response = client.post(
                    "/validate", content=body, headers={"content-type": "application/json"}, timeout=60
                )
                assert response.status_code == 200
                answers.append(time.monotonic())

        flood_answers: list[float] = []
        flood = [
            threading.Thread(target=post, args=(heavy_pod(3_000), service_account("team-a", f"sa-{i}"), flood_answers))
            for i in range(6)
        ]
        flood[0].start()
        assert entered.acquire(timeout=20)
        for thread in flood[1:]:
            thread.start()
        deadline = time.monotonic() + 20
        while webhook.state.heavy_lane.queued() < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        alice_answers: list[float] = []
        alices_pod = gpu_pod(namespace="team-b", tolerations=heavy_pod(3_000)["spec"]["tolerations"])
        alice = threading.Thread(target=post, args=(alices_pod, USER, alice_answers))
        alice.start()
        while webhook.state.heavy_lane.queued() < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()
        alice.join(30)
        for thread in flood:
            thread.join(30)
        assert evaluated.index("alice") <= 2, evaluated
        assert len(flood_answers) == 6 and len(alice_answers) == 1
        assert "scrubgate_webhook_heavy_requests_queued 0.0" in webhook.metrics()


@pytest.mark.parametrize("size", [10, 200])
def test_a_deny_message_lists_at_most_twenty_findings(size):
    request = decode(json.dumps(review(heavy_pod(size))).encode())
    outcome = handlers.handle_validate(request, load_policy(None), DeviceClasses(), trusted=False)
    message = outcome.response.status.message
    assert message.count("SG005") == min(size, 20)
    assert ("more findings" in message) is (size > 20)


def test_a_heavy_request_the_api_server_stopped_waiting_for_is_not_evaluated(tmp_path, monkeypatch):
    """The worker is busy past the second request's `?timeout=1s`: its turn comes too late, and it is skipped."""
    entered, release, evaluated = hold_the_first_evaluation(monkeypatch, lambda request: request.uid)
    with serving(tmp_path) as webhook:
        statuses: dict[str, int] = {}

        def post_heavy(name: str, query: str) -> None:
            body = json.dumps(review(heavy_pod(5_000))).encode()
            with webhook.client() as client:
                response = client.post(f"/validate{query}", content=body, headers={"content-type": "application/json"})
                statuses[name] = response.status_code

        first = threading.Thread(target=post_heavy, args=("first", "?timeout=30s"))
        first.start()
        assert entered.acquire(timeout=20)
        late = threading.Thread(target=post_heavy, args=("late", "?timeout=1s"))
        late.start()
        time.sleep(1.5)  # past the late request's timeout while the worker is still busy
        release.set()
        first.join(30)
        late.join(30)
        assert statuses == {"first": 200, "late": 503}
        assert len(evaluated) == 1, "the late request never reached the policy"


@pytest.mark.parametrize(
    ("query", "seconds"),
    [(b"timeout=5s", 5.0), (b"timeout=1m0s", 60.0), (b"timeout=500ms", 0.5), (b"", None), (b"timeout=soon", None)],
)
def test_the_api_servers_timeout_is_read_from_the_query(query, seconds):
    assert request_timeout(query) == seconds
