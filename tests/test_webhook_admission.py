"""The webhook over real HTTPS on 127.0.0.1, fed the API server's AdmissionReview shapes: decisions,
messages, warnings, patches, audit records, bad input, errors inside the policy, metrics."""

from __future__ import annotations

import base64
import copy
import json

import jsonpatch
import pytest
from scrubgate.policies import names
from scrubgate.policies.selectors import DeviceClasses
from scrubgate.webhook import handlers
from scrubgate.webhook.audit import verify_files
from webhook_support import (
    ADMIN,
    AGENT_KEYS,
    AGENT_ON_NODE_1,
    USER,
    allocated_claim,
    attestation,
    audit_records,
    generated_claim,
    gpu_claim,
    gpu_pod,
    post_review,
    record_for,
    review,
    serving,
    with_changes,
)


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    policy = {"rules": {"SG005": {"action": "audit"}, "SG006": {"action": "warn"}}, "attestationKeys": AGENT_KEYS}
    with serving(tmp_path_factory.mktemp("webhook"), policy) as running:
        yield running


def _patch_ops(response: dict) -> list[dict]:
    assert response["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(response["patch"]))


# -- validation ------------------------------------------------------------------------------------


def test_a_clean_gpu_claim_is_allowed_without_a_record(webhook):
    body = review(gpu_claim(finalizers=[names.FINALIZER]))
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is True
    assert "warnings" not in response and "status" not in response
    assert not [r for r in audit_records(webhook) if r["uid"] == body["request"]["uid"]]


def test_retain_is_denied_in_a_multi_tenant_namespace_with_the_rule_and_the_fix(webhook):
    claim = gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"})
    body = review(claim)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith("scrubgate denied CREATE of ResourceClaim team-a/train-0: SG001 retain-deallocation:")
    assert "set it to Delete" in message
    record = record_for(webhook, body["request"]["uid"])
    assert record["decision"] == "deny"
    assert record["operation"] == "CREATE" and record["kind"] == "ResourceClaim"
    assert (record["namespace"], record["name"], record["user"]) == ("team-a", "train-0", "alice")
    assert record["groups"] == USER["groups"]
    assert record["dryRun"] is False
    assert [f["rule"]["id"] for f in record["findings"]] == ["SG001"]
    assert record["policyDigest"] == webhook.state.policy.policy.digest
    assert record["webhook"] == "/validate"


def test_retain_is_allowed_on_the_trusted_path(webhook):
    claim = gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"})
    assert post_review(webhook, "/validate/trusted", review(claim))["allowed"] is True


def test_a_dry_run_denial_is_recorded_as_dry_run(webhook):
    body = review(gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"}), dry_run=True)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False and "SG001" in response["status"]["message"], response["status"]
    assert record_for(webhook, body["request"]["uid"])["dryRun"] is True


def test_warn_findings_become_short_warnings_and_are_recorded(webhook):
    body = review(gpu_claim(adminAccess=True))  # SG006 is `warn` in this module's policy
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is True
    assert len(response["warnings"]) == 1
    warning = response["warnings"][0]
    assert warning.startswith("[SG006 admin-access]") and len(warning) <= 120
    assert record_for(webhook, body["request"]["uid"])["decision"] == "warn"


def test_audit_findings_allow_and_leave_a_record(webhook):
    tolerant = gpu_claim(tolerations=[{"key": names.TAINT_UNSANITIZED, "operator": "Exists", "effect": "NoSchedule"}])
    body = review(tolerant)  # SG005 is `audit` in this module's policy
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is True and "warnings" not in response
    record = record_for(webhook, body["request"]["uid"])
    assert record["decision"] == "audit"
    assert record["findings"][0]["rule"] == {"id": "SG005", "name": "fence-toleration"}


def test_a_pod_sharing_a_claim_is_denied_unless_trusted(webhook):
    pod = gpu_pod(claim_ref={"resourceClaimName": "shared-gpu"})
    response = post_review(webhook, "/validate", review(pod))
    assert response["allowed"] is False
    assert "SG002 shared-claim" in response["status"]["message"]
    assert "resourceClaimTemplateName" in response["status"]["message"]
    assert post_review(webhook, "/validate/trusted", review(pod))["allowed"] is True


def test_a_deployment_sharing_a_claim_is_denied_even_when_trusted(webhook):
    pod = gpu_pod(claim_ref={"resourceClaimName": "shared-gpu"})
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "trainer", "namespace": "team-a"},
        "spec": {"replicas": 2, "template": {"metadata": {}, "spec": pod["spec"]}},
    }
    response = post_review(webhook, "/validate/trusted", review(deployment))
    assert response["allowed"] is False and "SG002" in response["status"]["message"]


def test_a_short_grace_period_is_denied(webhook):
    response = post_review(webhook, "/validate", review(gpu_pod(grace=0)))
    assert response["allowed"] is False
    assert "SG003 grace-period" in response["status"]["message"]


def test_several_denials_are_all_named(webhook):
    pod = gpu_pod(grace=1, claim_ref={"resourceClaimName": "shared-gpu"})
    message = post_review(webhook, "/validate", review(pod))["status"]["message"]
    assert "SG002 shared-claim" in message and "SG003 grace-period" in message


def test_unknown_kinds_are_allowed_untouched(webhook):
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "team-a"}}
    for path in ("/validate", "/mutate"):
        body = review(config_map)
        assert post_review(webhook, path, body) == {"uid": body["request"]["uid"], "allowed": True}


# -- the finalizer guard (SG007) -----------------------------------------------------------------------


def _released(old: dict, token: str | None) -> dict:
    annotations = dict(old["metadata"]["annotations"], **{names.ANNOTATION_SCRUB_STATUS: names.SCRUB_VERIFIED})
    if token is not None:
        annotations[names.ANNOTATION_ATTESTATION] = token
    return with_changes(old, finalizers=[], annotations=annotations)


def test_a_user_cannot_remove_the_sanitize_finalizer(webhook):
    old = allocated_claim()
    new = with_changes(old, finalizers=[])
    body = review(new, operation="UPDATE", old=old)
    response = post_review(webhook, "/validate/trusted", body)
    assert response["allowed"] is False
    assert "SG007 finalizer-guard" in response["status"]["message"]
    assert record_for(webhook, body["request"]["uid"])["operation"] == "UPDATE"


def test_the_agent_removes_the_finalizer_with_a_validattestation(webhook):
    old = allocated_claim()
    body = review(_released(old, attestation(old)), operation="UPDATE", old=old, user=AGENT_ON_NODE_1)
    assert post_review(webhook, "/validate", body)["allowed"] is True


def test_an_attestation_for_another_claim_is_refused(webhook):
    old = allocated_claim()
    token = attestation(old, uid="00000000-0000-4000-8000-000000000099")
    body = review(_released(old, token), operation="UPDATE", old=old, user=AGENT_ON_NODE_1)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False
    assert "attestation is for claim UID '00000000-0000-4000-8000-000000000099'" in response["status"]["message"]


def test_break_glass_by_an_admin_is_allowed_and_audited(webhook):
    old = allocated_claim()
    old["metadata"]["annotations"][names.ANNOTATION_BREAK_GLASS] = "node-1 lost in a fire"
    body = review(with_changes(old, finalizers=[]), operation="UPDATE", old=old, user=ADMIN)
    assert post_review(webhook, "/validate", body)["allowed"] is True
    record = record_for(webhook, body["request"]["uid"])
    assert record["decision"] == "audit"
    assert "break-glass" in record["findings"][0]["message"]


# -- force delete (SG008) --------------------------------------------------------------------------------


def _running_pod() -> dict:
    pod = gpu_pod()
    pod["spec"]["nodeName"] = "node-1"
    pod["status"] = {"phase": "Running"}
    return pod


FORCE = {
    "apiVersion": "meta.k8s.io/v1",
    "kind": "DeleteOptions",
    "gracePeriodSeconds": 0,
    "propagationPolicy": "Background",
}


def test_force_delete_of_a_gpu_pod_is_denied(webhook):
    body = review(None, operation="DELETE", old=_running_pod(), options=FORCE)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False
    assert "SG008 force-delete" in response["status"]["message"]
    assert record_for(webhook, body["request"]["uid"])["name"] == "trainer-7d9f"


def test_force_delete_by_an_admin_and_graceful_delete_are_allowed(webhook):
    assert post_review(
        webhook, "/validate", review(None, operation="DELETE", old=_running_pod(), options=FORCE, user=ADMIN)
    )["allowed"]
    graceful = dict(FORCE, gracePeriodSeconds=30)
    assert post_review(webhook, "/validate", review(None, operation="DELETE", old=_running_pod(), options=graceful))[
        "allowed"
    ]


def eviction_review(grace: int | None, user: dict | None = None) -> dict:
    """CREATE of pods/eviction as kube-apiserver sends it: the Eviction is the object, there is no old object."""
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"namespace": "team-a", "name": "train-0"}}
    if grace is not None:
        eviction["deleteOptions"] = {"gracePeriodSeconds": grace}
    body = review(eviction, user=user)
    body["request"]["subResource"] = body["request"]["requestSubResource"] = "eviction"
    body["request"]["kind"] = body["request"]["requestKind"] = {"group": "policy", "version": "v1", "kind": "Eviction"}
    return body


def test_a_force_eviction_is_denied_and_recorded(webhook):
    body = eviction_review(0)
    response = post_review(webhook, "/validate", body)
    assert response["allowed"] is False
    assert response["status"]["message"].startswith("scrubgate denied CREATE of Eviction team-a/train-0: SG008")
    assert record_for(webhook, body["request"]["uid"])["decision"] == "deny"


def test_evictions_with_a_grace_period_and_admins_force_evictions_pass(webhook):
    assert post_review(webhook, "/validate", eviction_review(None))["allowed"]
    assert post_review(webhook, "/validate", eviction_review(30))["allowed"]
    assert post_review(webhook, "/validate", eviction_review(0, user=ADMIN))["allowed"]


# -- cluster-scoped kinds: DeviceClasses (SG009), Namespaces' tenancy label (SG010) --------------------------


def test_an_excluded_name_on_a_gpu_class_is_denied_naming_the_policy_field(webhook):
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "imex.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
    }
    for operation, old in (("CREATE", None), ("UPDATE", device_class)):
        response = post_review(webhook, "/validate", review(device_class, operation=operation, old=old, user=ADMIN))
        assert response["allowed"] is False
        assert "SG009 gpu-class-coverage" in response["status"]["message"]
        assert "excludeDeviceClasses" in response["status"]["message"]


def _namespace(**labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a", "labels": labels}}


def test_a_tenancy_label_change_is_an_admins_and_always_recorded(webhook):
    trusted = _namespace(**{names.TENANCY_LABEL: names.TENANCY_TRUSTED})
    denied = review(trusted, operation="UPDATE", old=_namespace())
    response = post_review(webhook, "/validate", denied)
    assert response["allowed"] is False and "SG010 tenancy-label" in response["status"]["message"]
    allowed = review(trusted, operation="UPDATE", old=_namespace(), user=ADMIN)
    assert post_review(webhook, "/validate", allowed)["allowed"] is True
    record = record_for(webhook, allowed["request"]["uid"])
    assert record["decision"] == "audit"
    assert record["findings"][0]["rule"] == {"id": "SG010", "name": "tenancy-label"}
    unrelated = review(_namespace(team="b"), operation="UPDATE", old=_namespace(team="a"))
    assert post_review(webhook, "/validate", unrelated)["allowed"] is True
    assert not [r for r in audit_records(webhook) if r["uid"] == unrelated["request"]["uid"]]


# -- mutation --------------------------------------------------------------------------------------


def _mutate_until_stable(webhook, obj: dict) -> tuple[dict, list[list[dict]]]:
    """Applies the webhook's patches as the API server does, reinvoking until nothing is added."""
    patches = []
    for _ in range(3):
        response = post_review(webhook, "/mutate", review(obj))
        assert response["allowed"] is True
        if "patch" not in response:
            return obj, patches
        ops = _patch_ops(response)
        assert {op["op"] for op in ops} == {"add"}
        patches.append(ops)
        obj = jsonpatch.apply_patch(obj, ops)
    raise AssertionError(f"mutation did not settle: {patches}")


def test_a_generated_claim_gets_the_finalizer_once(webhook):
    claim = generated_claim()
    result, patches = _mutate_until_stable(webhook, claim)
    assert len(patches) == 1
    assert result["metadata"]["finalizers"] == [names.FINALIZER]
    assert result["metadata"]["ownerReferences"] == claim["metadata"]["ownerReferences"]
    assert "name" not in result["metadata"]


def test_the_finalizer_is_appended_to_the_users_finalizers(webhook):
    result, patches = _mutate_until_stable(webhook, gpu_claim(finalizers=["example.com/keep"]))
    assert patches == [[{"op": "add", "path": "/metadata/finalizers/-", "value": names.FINALIZER}]]
    assert result["metadata"]["finalizers"] == ["example.com/keep", names.FINALIZER]


def test_pods_are_never_mutated(webhook):
    """The API server sets an absent grace period (30 s) before mutating admission: a default set by the
    webhook would never apply, so it sets none."""
    for grace in (None, 45):
        assert "patch" not in post_review(webhook, "/mutate", review(gpu_pod(grace=grace)))


def test_updates_are_not_mutated(webhook):
    claim = gpu_claim(finalizers=[])
    assert "patch" not in post_review(webhook, "/mutate", review(claim, operation="UPDATE", old=claim))


def test_the_schedulers_release_of_its_unbound_claim_loses_the_finalizer_over_the_wire(webhook):
    """The one UPDATE /mutate patches: kube-scheduler removing delete-protection from the extended-resource
    claim it allocated for a pod whose binding failed; the patch tests the entry it removes."""
    old = gpu_claim(finalizers=[names.FINALIZER, names.DELETE_PROTECTION_FINALIZER])
    old["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n", "device": "gpu-0"}]}
        },
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid"}],
    }
    update = {**old, "metadata": {**old["metadata"], "finalizers": [names.FINALIZER]}}
    scheduler = {"username": "system:kube-scheduler", "groups": ["system:authenticated"]}
    ops = _patch_ops(post_review(webhook, "/mutate", review(update, operation="UPDATE", old=old, user=scheduler)))
    assert jsonpatch.apply_patch(update, ops)["metadata"]["finalizers"] == []
    tenant = {"username": "alice", "groups": ["tenants"]}
    assert "patch" not in post_review(webhook, "/mutate", review(update, operation="UPDATE", old=old, user=tenant))


def test_a_claim_is_mutated_unless_the_watched_classes_prove_its_class_hands_out_no_gpu(webhook, monkeypatch):
    claim = gpu_claim()
    claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "fpga.example.com"
    assert "patch" in post_review(webhook, "/mutate", review(claim)), "an unknown class is a GPU class"
    fpga = {
        "metadata": {"name": "fpga.example.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'fpga.example.com'"}}]},
    }
    known = DeviceClasses.of([fpga], ["gpu.nvidia.com"])
    monkeypatch.setattr(webhook.state, "classes", lambda _policy: known)
    assert "patch" not in post_review(webhook, "/mutate", review(claim))


# -- bad input -------------------------------------------------------------------------------------


def _refused(response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["response"]["allowed"] is False
    assert fragment in body["response"]["status"]["message"]


def test_bad_envelopes_are_refused_with_400(webhook):
    good = review(gpu_claim())
    no_uid = copy.deepcopy(good)
    del no_uid["request"]["uid"]
    old_version = dict(good, apiVersion="admission.k8s.io/v1beta1")
    wrong_kind = dict(good, kind="ConversionReview")
    lying = copy.deepcopy(good)
    lying["request"]["object"]["kind"] = "ConfigMap"
    bad_annotations = copy.deepcopy(good)
    bad_annotations["request"]["object"]["metadata"]["annotations"] = {names.ANNOTATION_DEALLOCATION_POLICY: 1}
    no_old = review(gpu_claim(), operation="UPDATE", old=gpu_claim())
    no_old["request"]["oldObject"] = None
    cases = [
        (b"{not json", "malformed JSON"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(), "request"),
        (json.dumps(no_uid).encode(), "request.uid"),
        (json.dumps(old_version).encode(), "apiVersion"),
        (json.dumps(wrong_kind).encode(), "kind"),
        (json.dumps(lying).encode(), "but request.kind is"),
        (json.dumps(bad_annotations).encode(), "metadata.annotations is not a map of strings"),
        (json.dumps(no_old).encode(), "no request.oldObject"),
        (b"[]", "AdmissionReview"),
    ]
    for body, fragment in cases:
        response = webhook.http.post("/validate", content=body, headers={"content-type": "application/json"})
        _refused(response, 400, fragment)


def test_admission_paths_take_onlypost_review(webhook):
    response = webhook.http.get("/validate")
    assert response.status_code == 405 and response.headers["allow"] == "POST"


def test_a_wrong_content_type_is_refused_with_415(webhook):
    body = json.dumps(review(gpu_claim())).encode()
    response = webhook.http.post("/validate", content=body, headers={"content-type": "text/plain"})
    _refused(response, 415, "application/json")


def test_an_oversized_body_is_refused_with_413(webhook):
    state = webhook.state
    limit, state.max_body_bytes = state.max_body_bytes, 4096
    try:
        big = review(gpu_claim(annotations={"example.com/blob": "x" * 8192}))
        response = webhook.http.post("/mutate", json=big)
        _refused(response, 413, "exceeds the limit of 4096 bytes")

        def chunks():  # no Content-Length: the limit holds while streaming
            for _ in range(8):
                yield b" " * 1024

        response = webhook.http.post("/mutate", content=chunks(), headers={"content-type": "application/json"})
        _refused(response, 413, "exceeds the limit")
    finally:
        state.max_body_bytes = limit


def test_a_body_sent_in_chunks_is_read_whole(webhook):
    retained = review(gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"}))
    body = json.dumps(retained).encode()

    def chunks():  # no Content-Length: chunked transfer, the body arrives in several ASGI messages
        for start in range(0, len(body), 64):
            yield body[start : start + 64]

    response = webhook.http.post("/validate", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    answer = response.json()["response"]
    assert answer["uid"] == retained["request"]["uid"]
    assert answer["allowed"] is False and "SG001" in answer["status"]["message"]


# -- errors inside the policy and the audit log ----------------------------------------------------------


def test_an_exception_inside_a_rule_is_an_errored_refusal(webhook, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(handlers, "validate", broken)
    monkeypatch.setattr(handlers, "default", broken)
    for path in ("/validate", "/mutate"):
        response = post_review(webhook, path, review(gpu_claim()))
        assert response["allowed"] is False
        assert response["status"]["code"] == 500
        assert "could not evaluate ResourceClaim team-a/train-0" in response["status"]["message"]


def test_an_unwritable_audit_log_refuses_warned_requests_but_keeps_denials(webhook):
    class Broken:
        ready = False  # as an AuditLog whose writer thread died

        async def append(self, fields):
            raise OSError(28, "No space left on device")

    state = webhook.state
    sink, state.audit = state.audit, Broken()
    try:
        warned = post_review(webhook, "/validate", review(gpu_claim(adminAccess=True)))
        assert warned["allowed"] is False and warned["status"]["code"] == 500
        assert "audit log" in warned["status"]["message"]
        denied = post_review(
            webhook, "/validate", review(gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"}))
        )
        assert denied["allowed"] is False and denied["status"]["code"] == 403
        readiness = webhook.http.get("/readyz")
        assert readiness.status_code == 503 and "audit log writer" in readiness.text
    finally:
        state.audit = sink


# -- operations --------------------------------------------------------------------------------------


def test_health_readiness_and_metrics(webhook):
    assert webhook.http.get("/healthz").status_code == 200
    # No API access here: ready, every claim guarded (the DeviceClasses not read).
    assert webhook.http.get("/readyz").json() == {"status": "ready", "deviceClasses": False}
    post_review(webhook, "/validate", review(gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"})))
    text = webhook.metrics()
    assert (
        'scrubgate_admission_requests_total{decision="deny",kind="ResourceClaim",operation="CREATE",webhook="/validate"}'
        in text
    )
    assert 'scrubgate_rule_hits_total{action="deny",rule="SG001"}' in text
    assert "scrubgate_admission_duration_seconds_bucket" in text
    assert f'scrubgate_policy_info{{digest="{webhook.state.policy.policy.digest}"}} 1.0' in text


def test_the_audit_log_of_this_module_verifies(webhook):
    post_review(webhook, "/validate", review(gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: "Retain"})))
    result = verify_files([webhook.audit_path])
    assert result.intact, result.problem
    assert result.starts_at_genesis and result.records == len(audit_records(webhook))
