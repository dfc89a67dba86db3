"""The stand-in's admission chain against a real HTTPS webhook (devcluster.testing.FakeWebhook)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from devcluster.admission import ServiceMap
from devcluster.apiserver import ApiServer
from devcluster.auth import parse_token_file
from devcluster.testing import FakeWebhook, allow, deny

pytestmark = pytest.mark.timeout(60)

AGENT = "system:serviceaccount:scrubgate-system:scrubgate-agent"
TOKENS = parse_token_file(
    f'tenant-token,alice,uid-alice,"tenants"\nagent-token,{AGENT},uid-agent,"system:serviceaccounts"\n'
)
TENANT = {"Authorization": "Bearer tenant-token"}
AGENT_AUTH = {"Authorization": "Bearer agent-token"}
CLAIMS_V1 = {
    "apiGroups": ["resource.k8s.io"],
    "apiVersions": ["v1"],
    "operations": ["CREATE", "UPDATE"],
    "resources": ["resourceclaims"],
}
CLAIM = {
    "metadata": {"generateName": "claim-", "labels": {"app": "train"}},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
}


@pytest.fixture
def hook() -> Iterator[FakeWebhook]:
    webhook = FakeWebhook().start()
    yield webhook
    webhook.stop()


@pytest.fixture
def srv(hook: FakeWebhook) -> Iterator[ApiServer]:
    with ApiServer(tokens=TOKENS, services=ServiceMap({hook.service: hook.port})).start() as server:
        httpx.post(f"{server.url}/api/v1/namespaces", json={"metadata": {"name": "team-a", "labels": {"tier": "gpu"}}})
        yield server


def register(srv: ApiServer, kind: str, name: str, *webhooks: dict) -> None:
    body = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": f"{kind.title()}WebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": list(webhooks),
    }
    r = httpx.post(f"{srv.url}/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations", json=body)
    assert r.status_code == 201, r.text


def webhook(hook: FakeWebhook, name: str, path: str, rules: list[dict] | None = None, **extra: object) -> dict:
    return {
        "name": name,
        "clientConfig": hook.client_config(path),
        "rules": rules or [CLAIMS_V1],
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "failurePolicy": "Fail",
        **extra,
    }


def claims_url(srv: ApiServer, version: str = "v1", ns: str = "team-a") -> str:
    return f"{srv.url}/apis/resource.k8s.io/{version}/namespaces/{ns}/resourceclaims"


def test_mutation_warnings_and_the_admission_review_shape(srv: ApiServer, hook: FakeWebhook) -> None:
    hook.respond["/mutate"] = lambda review: allow(
        review,
        patch=[{"op": "add", "path": "/metadata/finalizers", "value": ["scrubgate.dev/sanitize"]}],
        warnings=['claim "x" is "fine"'],
    )
    register(srv, "mutating", "m", webhook(hook, "mutate.scrubgate.dev", "/mutate"))
    register(srv, "validating", "v", webhook(hook, "validate.scrubgate.dev", "/validate"))
    r = httpx.post(claims_url(srv), json=CLAIM, headers=TENANT)
    assert r.status_code == 201, r.text
    assert r.json()["metadata"]["finalizers"] == ["scrubgate.dev/sanitize"]
    assert r.headers.get_list("Warning") == ['299 - "claim \\"x\\" is \\"fine\\""']
    (mutating,), (validating,) = hook.calls("/mutate"), hook.calls("/validate")
    assert mutating["kind"] == {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"}
    assert (
        mutating["resource"]
        == mutating["requestResource"]
        == {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"}
    )
    assert mutating["operation"] == "CREATE" and mutating["namespace"] == "team-a" and mutating["name"] == ""
    assert mutating["userInfo"] == {
        "username": "alice",
        "uid": "uid-alice",
        "groups": ["tenants", "system:authenticated"],
    }
    assert mutating["options"] == {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
    assert mutating["dryRun"] is False and mutating["oldObject"] is None and "subResource" not in mutating
    assert "uid" not in mutating["object"]["metadata"]  # mutation runs before the API server fills identity
    assert mutating["uid"] != validating["uid"]  # a fresh uid per webhook call, as the API server does
    assert validating["object"]["metadata"]["uid"] == r.json()["metadata"]["uid"]
    assert validating["object"]["metadata"]["name"] == r.json()["metadata"]["name"]
    assert validating["object"]["metadata"]["finalizers"] == ["scrubgate.dev/sanitize"]  # validation sees mutations


def test_denials_carry_the_webhooks_message_and_code(srv: ApiServer, hook: FakeWebhook) -> None:
    hook.respond["/deny403"] = lambda review: deny(review, "SG001 retain-deallocation: use Delete", code=403)
    register(srv, "validating", "v", webhook(hook, "deny.scrubgate.dev", "/deny403"))
    r = httpx.post(claims_url(srv), json=CLAIM, headers=TENANT)
    assert r.status_code == 403
    assert (
        r.json()["message"]
        == 'admission webhook "deny.scrubgate.dev" denied the request: SG001 retain-deallocation: use Delete'
    )
    hook.respond["/deny403"] = lambda review: deny(review, "no")
    assert httpx.post(claims_url(srv), json=CLAIM, headers=TENANT).status_code == 400  # as webhookerrors.ToStatusErr
    assert httpx.get(claims_url(srv)).json()["items"] == []


def test_failure_policy_decides_when_the_webhook_cannot_be_reached(srv: ApiServer, hook: FakeWebhook) -> None:
    register(srv, "validating", "v", webhook(hook, "down.scrubgate.dev", "/v", failurePolicy="Fail"))
    srv.services.set(*hook.service, None)  # no endpoints
    r = httpx.post(claims_url(srv), json=CLAIM)
    assert r.status_code == 500 and r.json()["reason"] == "InternalError"
    assert 'failed calling webhook "down.scrubgate.dev"' in r.json()["message"]
    srv.services.set(*hook.service, 1)  # nothing listens there
    assert httpx.post(claims_url(srv), json=CLAIM).status_code == 500
    assert httpx.get(claims_url(srv)).json()["items"] == []
    register(srv, "validating", "w", webhook(hook, "other.scrubgate.dev", "/v", failurePolicy="Ignore"))
    httpx.delete(f"{srv.url}/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/v")
    assert httpx.post(claims_url(srv), json=CLAIM).status_code == 201


def test_a_slow_webhook_times_out_and_fails_closed(srv: ApiServer, hook: FakeWebhook) -> None:
    register(srv, "validating", "v", webhook(hook, "slow.scrubgate.dev", "/v", timeoutSeconds=1))
    hook.delay_s = 1.5
    r = httpx.post(claims_url(srv), json=CLAIM, timeout=10)
    assert r.status_code == 500 and "context deadline exceeded" in r.json()["message"]
    assert "timeout=1s" in r.json()["message"]


def test_a_wrong_ca_bundle_fails_the_tls_handshake(srv: ApiServer, hook: FakeWebhook) -> None:
    other = FakeWebhook()
    spec = webhook(hook, "tls.scrubgate.dev", "/v")
    spec["clientConfig"]["caBundle"] = other.ca_bundle
    register(srv, "validating", "v", spec)
    r = httpx.post(claims_url(srv), json=CLAIM)
    assert r.status_code == 500 and "CERTIFICATE_VERIFY_FAILED" in r.json()["message"]


def test_url_client_config(srv: ApiServer, hook: FakeWebhook) -> None:
    spec = webhook(hook, "url.scrubgate.dev", "/by-url")
    spec["clientConfig"] = hook.client_config("/by-url", url=True)
    register(srv, "validating", "v", spec)
    assert httpx.post(claims_url(srv), json=CLAIM).status_code == 201
    assert len(hook.calls("/by-url")) == 1


def test_rules_match_operations_resources_and_subresources(srv: ApiServer, hook: FakeWebhook) -> None:
    def rule(ops: list[str], resources: list[str]) -> list[dict]:
        return [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"], "operations": ops, "resources": resources}]

    register(
        srv,
        "validating",
        "v",
        webhook(hook, "status.test", "/status", rule(["UPDATE"], ["resourceclaims/status"])),
        webhook(hook, "star.test", "/star", rule(["*"], ["*"])),
        webhook(hook, "all.test", "/all", rule(["*"], ["*/*"])),
        webhook(hook, "delete.test", "/delete", rule(["DELETE"], ["resourceclaims"])),
    )
    name = httpx.post(claims_url(srv), json=CLAIM).json()["metadata"]["name"]
    allocation = {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n", "device": "gpu-0"}]}
    }
    r = httpx.patch(
        f"{claims_url(srv)}/{name}/status",
        json={"status": {"allocation": allocation}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert r.status_code == 200, r.text
    assert [c["operation"] for c in hook.calls("/star")] == ["CREATE"]  # "*" excludes subresources
    assert [(c["operation"], c.get("subResource")) for c in hook.calls("/all")] == [
        ("CREATE", None),
        ("UPDATE", "status"),
    ]
    (status_call,) = hook.calls("/status")
    assert status_call["subResource"] == "status" and status_call["object"]["status"]["allocation"] == allocation
    assert status_call["options"]["kind"] == "UpdateOptions"
    assert hook.calls("/delete") == []


def test_match_policy_equivalent_converts_to_the_registered_version(srv: ApiServer, hook: FakeWebhook) -> None:
    hook.respond["/v1-only"] = lambda review: allow(
        review,
        patch=[
            {
                "op": "add",
                "path": "/metadata/annotations",
                "value": {"seen-as": review["request"]["object"]["apiVersion"]},
            }
        ],
    )
    register(
        srv,
        "mutating",
        "m",
        webhook(hook, "equivalent.test", "/v1-only"),
        webhook(hook, "exact.test", "/exact", matchPolicy="Exact"),
    )
    flat = {
        "metadata": {"name": "flat"},
        "spec": {"devices": {"requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}]}},
    }
    r = httpx.post(claims_url(srv, "v1beta1"), json=flat)
    assert r.status_code == 201, r.text
    assert r.json()["apiVersion"] == "resource.k8s.io/v1beta1"
    assert r.json()["metadata"]["annotations"] == {"seen-as": "resource.k8s.io/v1"}
    (call,) = hook.calls("/v1-only")
    assert call["resource"]["version"] == "v1" and call["requestResource"]["version"] == "v1beta1"
    assert call["kind"]["version"] == "v1" and call["requestKind"]["version"] == "v1beta1"
    assert call["object"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    assert hook.calls("/exact") == []


def test_namespace_and_object_selectors(srv: ApiServer, hook: FakeWebhook) -> None:
    httpx.post(f"{srv.url}/api/v1/namespaces", json={"metadata": {"name": "scrubgate-system"}})
    not_system = {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["scrubgate-system"]}
        ]
    }
    register(
        srv,
        "validating",
        "v",
        webhook(hook, "ns.test", "/ns", namespaceSelector=not_system),
        webhook(hook, "tier.test", "/tier", namespaceSelector={"matchLabels": {"tier": "gpu"}}),
        webhook(hook, "obj.test", "/obj", objectSelector={"matchLabels": {"app": "train"}}),
    )
    httpx.post(claims_url(srv, ns="scrubgate-system"), json=CLAIM)
    httpx.post(claims_url(srv), json={**CLAIM, "metadata": {"generateName": "c-"}})
    assert [c["namespace"] for c in hook.calls("/ns")] == ["team-a"]
    assert [c["namespace"] for c in hook.calls("/tier")] == ["team-a"]
    assert [c["namespace"] for c in hook.calls("/obj")] == ["scrubgate-system"]


def test_match_conditions_skip_and_fail_per_failure_policy(srv: ApiServer, hook: FakeWebhook) -> None:
    not_agent = {"name": "not-the-agent", "expression": f'request.userInfo.username != "{AGENT}"'}
    register(srv, "validating", "v", webhook(hook, "cond.test", "/cond", matchConditions=[not_agent]))
    httpx.post(claims_url(srv), json=CLAIM, headers=AGENT_AUTH)
    httpx.post(claims_url(srv), json=CLAIM, headers=TENANT)
    assert [c["userInfo"]["username"] for c in hook.calls("/cond")] == ["alice"]
    broken = {"name": "broken", "expression": "object.metadata.noSuchField == 'x'"}
    register(srv, "validating", "w", webhook(hook, "broken.test", "/broken", matchConditions=[broken]))
    r = httpx.post(claims_url(srv), json=CLAIM)
    assert r.status_code == 500 and "no such key: noSuchField" in r.json()["message"]
    httpx.delete(f"{srv.url}/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/w")
    register(
        srv,
        "validating",
        "w",
        webhook(hook, "broken.test", "/broken", matchConditions=[broken], failurePolicy="Ignore"),
    )
    assert httpx.post(claims_url(srv), json=CLAIM).status_code == 201


def test_reinvocation_if_needed(srv: ApiServer, hook: FakeWebhook) -> None:
    hook.respond["/labeler"] = lambda review: allow(
        review,
        patch=[]
        if "labeled" in review["request"]["object"]["metadata"].get("labels", {})
        else [{"op": "add", "path": "/metadata/labels/labeled", "value": "yes"}],
    )
    register(
        srv,
        "mutating",
        "a-first",
        webhook(hook, "first.test", "/first", reinvocationPolicy="IfNeeded"),
        webhook(hook, "never.test", "/never"),
    )
    register(srv, "mutating", "b-labeler", webhook(hook, "labeler.test", "/labeler"))
    assert httpx.post(claims_url(srv), json=CLAIM).json()["metadata"]["labels"]["labeled"] == "yes"
    first = hook.calls("/first")
    assert len(first) == 2 and first[1]["object"]["metadata"]["labels"]["labeled"] == "yes"
    assert len(hook.calls("/never")) == 1


def test_dry_run_reaches_side_effect_free_webhooks_only(srv: ApiServer, hook: FakeWebhook) -> None:
    register(srv, "validating", "v", webhook(hook, "pure.test", "/pure"))
    r = httpx.post(claims_url(srv), params={"dryRun": "All"}, json=CLAIM)
    assert r.status_code == 201
    (call,) = hook.calls("/pure")
    assert call["dryRun"] is True and call["options"]["dryRun"] == ["All"]
    assert httpx.get(claims_url(srv)).json()["items"] == []
    register(srv, "validating", "w", webhook(hook, "effects.test", "/effects", sideEffects="Unknown"))
    r = httpx.post(claims_url(srv), params={"dryRun": "All"}, json=CLAIM)
    assert r.status_code == 400 and "does not support dry run" in r.json()["message"]


def test_delete_admission_sends_old_object_and_delete_options(srv: ApiServer, hook: FakeWebhook) -> None:
    pods = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["pods"]}
    hook.respond["/pods"] = lambda review: (
        deny(review, "SG008 force-delete", code=403)
        if review["request"]["options"].get("gracePeriodSeconds") == 0
        else allow(review)
    )
    register(srv, "validating", "v", webhook(hook, "pods.test", "/pods", rules=[pods]))
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}}
    httpx.post(f"{srv.url}/api/v1/namespaces/team-a/pods", json=pod)
    forced = httpx.request(
        "DELETE", f"{srv.url}/api/v1/namespaces/team-a/pods/p", json={"gracePeriodSeconds": 0}, headers=TENANT
    )
    assert forced.status_code == 403 and "SG008" in forced.json()["message"]
    graceful = httpx.delete(f"{srv.url}/api/v1/namespaces/team-a/pods/p", params={"propagationPolicy": "Background"})
    assert graceful.status_code == 200 and graceful.json()["metadata"]["deletionGracePeriodSeconds"] == 30
    forced_call, graceful_call = hook.calls("/pods")
    assert forced_call["operation"] == "DELETE" and forced_call["object"] is None
    assert forced_call["oldObject"]["metadata"]["name"] == "p" and forced_call["name"] == "p"
    assert forced_call["options"] == {"gracePeriodSeconds": 0, "kind": "DeleteOptions", "apiVersion": "meta.k8s.io/v1"}
    assert graceful_call["options"]["propagationPolicy"] == "Background"
    assert json.loads(json.dumps(graceful_call["userInfo"]))["username"] == "system:anonymous"
