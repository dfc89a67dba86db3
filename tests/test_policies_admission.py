"""SG007 (finalizer guard) and SG008 (force delete) with hand-built admission inputs and real Ed25519 signatures."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies import names
from scrubgate.policies.attestation import build_payload, public_key_pem, sign
from scrubgate.policies.config import ScrubCoverage, parse_policy
from scrubgate.policies.engine import Admission, validate

AGENT = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
ADMINS = ("system:authenticated", "system:masters")
KID = "agent-2025"
UID = "7d1b5c1e-0b2a-4c55-9a39-5d4f6b0f3a11"
DEVICES = [
    {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0", "uuid": "GPU-aaaa"},
    {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1", "uuid": "GPU-bbbb"},
]


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def keyed_policy(key):
    return parse_policy({"attestationKeys": [{"kid": KID, "publicKey": public_key_pem(key)}]})


def allocated_claim(devices=DEVICES, annotate=True) -> dict:
    """A v1 GPU claim as the agent finds it after the pod ended: finalizer on, devices recorded, allocation kept."""
    annotations = {names.ANNOTATION_SCRUB_STATUS: names.SCRUB_SCRUBBING}
    if annotate:
        annotations[names.ANNOTATION_DEVICES] = json.dumps(devices)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": "team-a",
            "name": "train-gpu-x7k2p",
            "uid": UID,
            "finalizers": [names.DELETE_PROTECTION_FINALIZER, names.FINALIZER],
            "annotations": annotations,
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": d["driver"], "pool": d["pool"], "device": d["device"]}
                        for d in devices
                    ]
                }
            }
        },
    }


def attestation(key, *, uid=UID, devices=DEVICES, verified=True, kid=KID, node="node-a", **figures: int) -> str:
    now = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    payload = build_payload(
        namespace="team-a",
        name="train-gpu-x7k2p",
        uid=uid,
        node=node,
        devices=[
            {
                **d,
                "bytesScrubbed": 80 << 30,
                "bytesTotal": 80 << 30,
                "method": names.ATTESTATION_METHOD,
                "verified": verified,
                **figures,
            }
            for d in devices
        ],
        started_at=now,
        finished_at=now,
        health={"eccUncorrectable": 0, "remapPending": False, "xids": []},
    )
    return sign(payload, key, kid)


def released(old: dict, token: str | None = None, **extra_annotations) -> dict:
    """The agent's UPDATE: sanitize finalizer removed, attestation and `verified` written."""
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = [f for f in new["metadata"]["finalizers"] if f != names.FINALIZER]
    annotations = new["metadata"]["annotations"]
    annotations[names.ANNOTATION_SCRUB_STATUS] = names.SCRUB_VERIFIED
    if token is not None:
        annotations[names.ANNOTATION_ATTESTATION] = token
    annotations.update(extra_annotations)
    return new


def update(new, old, policy, user=AGENT, groups=("system:serviceaccounts",), node="node-a"):
    """An UPDATE by `user`, its credentials bound to `node` (the agent's pod runs on node-a, where the claims'
    devices are)."""
    admission = Admission("UPDATE", user, tuple(groups), old, node=node)
    return validate(new, policy, trusted=False, admission=admission)


def verdict(findings):
    return sorted((f.rule, f.action) for f in findings)


# --- SG007 -----------------------------------------------------------------------------------------------------


def test_agent_with_a_valid_attestation_may_remove_the_finalizer(key, keyed_policy):
    old = allocated_claim()
    assert update(released(old, attestation(key)), old, keyed_policy) == []


def test_an_agent_acts_only_on_its_own_nodes_claims(key, keyed_policy):
    """Issue: every agent shares one ServiceAccount and one key, so one node's agent could release another
    node's claim. Its credentials name its node (a pod's projected token): the claim's devices must be there,
    and so must the attestation's node."""
    old = allocated_claim()  # its devices are on node-a
    (finding,) = update(released(old, attestation(key)), old, keyed_policy, node="node-b")
    assert finding.action == "deny" and "the agent of node 'node-b' acted on claim" in finding.message
    assert "of node node-a" in finding.message
    (finding,) = update(released(old, attestation(key, node="node-b")), old, keyed_policy)
    assert "with an attestation of node 'node-b' for a claim allocated on node node-a" in finding.message
    failed = copy.deepcopy(old)
    failed["metadata"]["annotations"][names.ANNOTATION_SCRUB_STATUS] = "failed:scrub"
    assert verdict(update(failed, old, keyed_policy, node="node-b")) == [("SG007", "deny")], "a status too"


def test_an_agent_whose_credentials_name_no_node_is_refused_unless_binding_is_off(key, keyed_policy):
    old = allocated_claim()
    (finding,) = update(released(old, attestation(key)), old, keyed_policy, node="")
    assert "the agent's credentials name no node" in finding.message and "nodeBinding: false" in finding.message
    unbound = keyed_policy.model_copy(update={"agent": keyed_policy.agent.model_copy(update={"node_binding": False})})
    assert update(released(old, attestation(key, node="node-a")), old, unbound, node="") == []
    # Whatever the binding, the attestation is of the node the claim's devices are on.
    (finding,) = update(released(old, attestation(key, node="anywhere")), old, unbound, node="")
    assert "with an attestation of node 'anywhere' for a claim allocated on node node-a" in finding.message


GiB = 1 << 30


@pytest.mark.parametrize(
    ("figures", "problem"),
    [
        ({"bytesScrubbed": 0}, "scrubbed 0 of 85899345920 bytes"),
        ({"bytesScrubbed": 40 * GiB}, f"accounts for {40 * GiB} of its {80 * GiB} bytes"),
        ({"bytesScrubbed": 78 * GiB, "bytesUnreachable": 2 * GiB}, f"left {2 * GiB} bytes unreached, more than"),
        # 2% of a small slice's usable memory is the tighter bound there
        (
            {"bytesTotal": 10 * GiB, "bytesScrubbed": 9 * GiB, "bytesReserved": GiB // 2, "bytesUnreachable": GiB // 2},
            "left 536870912 bytes unreached, more than the 204010946",
        ),
        ({"bytesTotal": "80Gi"}, "states no byte count for bytesTotal"),
    ],
)
def test_an_attestation_that_does_not_show_a_full_scrub_is_refused(key, keyed_policy, figures, problem):
    """Verified with 0 of 80 GiB scrubbed, or with more unreached than the policy allows, is no scrub."""
    old = allocated_claim()
    findings = update(released(old, attestation(key, **figures)), old, keyed_policy)
    assert verdict(findings) == [("SG007", "deny")]
    assert "does not show a full scrub" in findings[0].message and problem in findings[0].message


def test_the_unreached_memory_the_policy_allows_is_its_own_setting(key, keyed_policy):
    old = allocated_claim()
    within = attestation(key, bytesScrubbed=80 * GiB - 512 * 1024 * 1024, bytesUnreachable=512 * 1024 * 1024)
    assert update(released(old, within), old, keyed_policy) == []
    over = attestation(key, bytesScrubbed=78 * GiB, bytesUnreachable=2 * GiB)
    looser = keyed_policy.model_copy(
        update={"scrub_coverage": ScrubCoverage(maxUnreachablePercent=3, maxUnreachableBytes=4 * GiB)}
    )
    assert update(released(old, over), old, looser) == []


def test_agent_release_after_the_allocation_was_cleared_is_checked_against_the_devices_annotation(key, keyed_policy):
    old = allocated_claim()
    del old["status"]
    assert update(released(old, attestation(key)), old, keyed_policy) == []
    partial = attestation(key, devices=DEVICES[:1])
    found = update(released(old, partial), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    assert "gpu-1" in found[0].message


def test_tenant_removing_the_finalizer_is_denied(key, keyed_policy):
    old = allocated_claim()
    found = update(released(old), old, keyed_policy, user="alice", groups=("team-a",))
    assert ("SG007", "deny") in verdict(found)
    assert any(names.FINALIZER in f.message and "alice" in f.message for f in found)


def test_tenant_removing_the_finalizer_with_a_valid_attestation_is_still_denied(key, keyed_policy):
    old = allocated_claim()
    found = update(released(old, attestation(key)), old, keyed_policy, user="alice", groups=("team-a",))
    assert {f.rule for f in found} == {"SG007"}
    assert all(f.action == "deny" for f in found)


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        (names.ANNOTATION_ATTESTATION, "eyJ.eyJ.sig"),
        (names.ANNOTATION_SCRUB_STATUS, names.SCRUB_VERIFIED),
        (names.ANNOTATION_DEVICES, "[]"),
        (names.ANNOTATION_DEVICES, None),
    ],
)
def test_tenant_editing_an_agent_annotation_is_denied(keyed_policy, annotation, value):
    old = allocated_claim()
    new = copy.deepcopy(old)
    if value is None:
        del new["metadata"]["annotations"][annotation]
    else:
        new["metadata"]["annotations"][annotation] = value
    found = update(new, old, keyed_policy, user="alice", groups=("team-a",))
    assert verdict(found) == [("SG007", "deny")]
    assert annotation in found[0].message
    # The same edit by the agent is its job.
    assert update(new, old, keyed_policy) == []


def test_tenant_may_edit_other_annotations(keyed_policy):
    old = allocated_claim()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"]["team-a.example.com/owner"] = "alice"
    assert update(new, old, keyed_policy, user="alice") == []


def test_replayed_attestation_of_another_claim_is_denied(key, keyed_policy):
    old = allocated_claim()
    found = update(released(old, attestation(key, uid="another-claim-uid")), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    assert "another-claim-uid" in found[0].message


def test_attestation_signed_with_another_key_is_denied(keyed_policy):
    old = allocated_claim()
    forged = attestation(Ed25519PrivateKey.generate())
    found = update(released(old, forged), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    assert "attestation signature does not verify" in found[0].message, found[0].message


def test_attestation_with_an_unknown_key_id_is_denied(key, keyed_policy):
    old = allocated_claim()
    found = update(released(old, attestation(key, kid="other")), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    assert "key id 'other' is not among the policy's attestation keys" in found[0].message, found[0].message


def test_no_configured_key_means_no_release(key, policy):
    old = allocated_claim()
    found = update(released(old, attestation(key)), old, policy)
    assert verdict(found) == [("SG007", "deny")]
    assert "is not among the policy's attestation keys" in found[0].message, found[0].message


def test_agent_without_an_attestation_is_denied(keyed_policy):
    old = allocated_claim()
    found = update(released(old), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    assert names.ANNOTATION_ATTESTATION in found[0].message


def test_tampered_attestation_is_denied(key, keyed_policy):
    old = allocated_claim()
    header, _, signature = attestation(key).split(".")
    _, other_payload, _ = attestation(key, uid="x").split(".")
    spliced = f"{header}.{other_payload}.{signature}"
    found = update(released(old, spliced), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    # Refused for its signature, not only because the spliced payload names another claim.
    assert "attestation signature does not verify" in found[0].message, found[0].message


def test_attestation_missing_an_allocated_device_is_denied(key, keyed_policy):
    # The annotation lists only gpu-0, but the allocation in the status holds gpu-1 too.
    old = allocated_claim()
    old["metadata"]["annotations"][names.ANNOTATION_DEVICES] = json.dumps(DEVICES[:1])
    found = update(released(old, attestation(key, devices=DEVICES[:1])), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    assert "gpu.nvidia.com/node-a/gpu-1" in found[0].message


def test_attestation_missing_a_device_of_the_annotation_is_denied(key, keyed_policy):
    old = allocated_claim(annotate=False)
    old["status"]["allocation"]["devices"]["results"] = old["status"]["allocation"]["devices"]["results"][:1]
    new = released(old, attestation(key, devices=DEVICES[:1]))
    # A devices annotation written in the same update still counts (the agent cannot shrink what it must cover).
    new["metadata"]["annotations"][names.ANNOTATION_DEVICES] = json.dumps(DEVICES)
    assert verdict(update(new, old, keyed_policy)) == [("SG007", "deny")]


def test_device_not_verified_clean_is_denied(key, keyed_policy):
    old = allocated_claim()
    found = update(released(old, attestation(key, verified=False)), old, keyed_policy)
    assert verdict(found) == [("SG007", "deny")]
    assert "not verified" in found[0].message


def test_admin_break_glass_is_audited_not_denied(keyed_policy):
    old = allocated_claim()
    new = released(old, **{names.ANNOTATION_BREAK_GLASS: "node-a lost in zone outage INC-4711"})
    new["metadata"]["annotations"][names.ANNOTATION_SCRUB_STATUS] = old["metadata"]["annotations"][
        names.ANNOTATION_SCRUB_STATUS
    ]
    found = update(new, old, keyed_policy, user="oncall", groups=ADMINS)
    assert verdict(found) == [("SG007", "audit")]
    assert "INC-4711" in found[0].message and "oncall" in found[0].message


def test_break_glass_is_audited_even_when_sg007_only_warns():
    warn = parse_policy({"rules": {"SG007": {"action": "warn"}}})
    old = allocated_claim()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][names.ANNOTATION_BREAK_GLASS] = "node gone"
    new["metadata"]["finalizers"] = [names.DELETE_PROTECTION_FINALIZER]
    assert verdict(update(new, old, warn, user="oncall", groups=ADMINS)) == [("SG007", "audit")]
    assert verdict(update(new, old, warn, user="alice", groups=("team-a",))) == [("SG007", "warn"), ("SG007", "warn")]


def test_admin_removing_the_finalizer_without_a_reason_is_denied(keyed_policy):
    old = allocated_claim()
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = [names.DELETE_PROTECTION_FINALIZER]
    new["metadata"]["annotations"][names.ANNOTATION_BREAK_GLASS] = "   "
    found = update(new, old, keyed_policy, user="oncall", groups=ADMINS)
    assert verdict(found) == [("SG007", "deny")]
    assert f"user 'oncall' removed the {names.FINALIZER} finalizer" in found[0].message, found[0].message


def test_non_admin_setting_break_glass_is_denied(keyed_policy):
    old = allocated_claim()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][names.ANNOTATION_BREAK_GLASS] = "please"
    found = update(new, old, keyed_policy, user="alice", groups=("team-a",))
    assert verdict(found) == [("SG007", "deny")]
    assert names.ANNOTATION_BREAK_GLASS in found[0].message
    # Setting it and removing the finalizer in one go is two violations.
    new["metadata"]["finalizers"] = [names.DELETE_PROTECTION_FINALIZER]
    assert verdict(update(new, old, keyed_policy, user="alice", groups=("team-a",))) == [
        ("SG007", "deny"),
        ("SG007", "deny"),
    ]


def test_sg007_off_allows_everything(keyed_policy):
    off = parse_policy({"rules": {"SG007": {"action": "off"}}})
    old = allocated_claim()
    assert update(released(old), old, off, user="alice") == []


def test_finalizer_guard_only_for_resource_claims(keyed_policy):
    old = allocated_claim()
    old["apiVersion"] = "resource.k8s.io/v1alpha2"
    assert update(released(old), old, keyed_policy, user="alice") == []


# --- SG008 -----------------------------------------------------------------------------------------------------


def running_pod(**status) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "team-a", "name": "train", "uid": "pod-uid"},
        "spec": {
            "nodeName": "node-a",
            "terminationGracePeriodSeconds": 60,
            "containers": [{"name": "main", "image": "busybox"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}],
        },
        "status": {"phase": "Running", "containerStatuses": [{"name": "main", "state": {"running": {}}}], **status},
    }


def delete(pod, policy, grace, groups=("team-a",), user="alice"):
    options = (
        None
        if grace is None
        else {"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions", "gracePeriodSeconds": grace}
    )
    return validate(None, policy, trusted=False, admission=Admission("DELETE", user, tuple(groups), pod, options))


def test_force_delete_of_a_running_pod_with_claims_is_denied(policy):
    found = delete(running_pod(), policy, 0)
    assert verdict(found) == [("SG008", "deny")]
    assert "grace period 0" in found[0].message


def test_admins_may_force_delete(policy):
    assert delete(running_pod(), policy, 0, groups=ADMINS, user="oncall") == []


@pytest.mark.parametrize("grace", [30, 1, None])
def test_delete_with_a_grace_period_is_allowed(policy, grace):
    assert delete(running_pod(), policy, grace) == []


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_terminal_pod_may_be_deleted_with_grace_zero(policy, phase):
    assert delete(running_pod(phase=phase), policy, 0) == []


def test_kubelets_final_delete_after_containers_stopped_is_allowed(policy):
    pod = running_pod(containerStatuses=[{"name": "main", "state": {"terminated": {"exitCode": 0}}}])
    pod["metadata"]["deletionTimestamp"] = "2025-06-01T12:00:00Z"
    assert delete(pod, policy, 0, groups=("system:nodes",), user="system:node:node-a") == []
    # A container still running: not the kubelet's final delete, whatever the user claims.
    pod["status"]["initContainerStatuses"] = [{"name": "init", "state": {"terminated": {}}}]
    pod["status"]["containerStatuses"].append({"name": "side", "state": {"running": {}}})
    assert verdict(delete(pod, policy, 0, groups=("system:nodes",), user="system:node:node-a")) == [("SG008", "deny")]


def test_pod_gc_deletes_a_pod_of_a_lost_node_it_marked_failed(policy, keyed_policy):
    """The pod GC patches pods/status to Failed, then deletes with grace 0. Nothing runs that a graceful delete
    would stop, and the claim stays allocated under SG007 until its devices are attested (or break-glass)."""
    gc = "system:serviceaccount:kube-system:pod-garbage-collector"
    marked = running_pod(phase="Failed", conditions=[{"type": "DisruptionTarget", "reason": "DeletionByPodGC"}])
    assert delete(marked, policy, 0, groups=("system:serviceaccounts",), user=gc) == []
    # Before it is marked, the pod GC is refused like anyone outside the admin groups.
    assert verdict(delete(running_pod(), policy, 0, groups=("system:serviceaccounts",), user=gc)) == [("SG008", "deny")]
    # Once the pod is gone the resourceclaim controller's deallocation is still held until an attestation.
    claim = allocated_claim()
    cleared = copy.deepcopy(claim)
    del cleared["status"]["allocation"]
    admission = Admission("UPDATE", "system:serviceaccount:kube-system:resource-claim-controller", old_object=claim)
    held = validate(cleared, keyed_policy, trusted=False, admission=replace(admission, subresource="status"))
    assert verdict(held) == [("SG007", "deny")]


def eviction(grace=None) -> dict:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"namespace": "team-a", "name": "train"}}
    if grace is not None:
        body["deleteOptions"] = {"gracePeriodSeconds": grace}
    return body


def evict(body, policy, groups=("team-a",), user="alice"):
    admission = Admission("CREATE", user, tuple(groups), subresource="eviction")
    return validate(body, policy, trusted=False, admission=admission)


def test_a_force_eviction_is_denied(policy):
    """pods/eviction deletes the pod with the eviction's deleteOptions, and no pod DELETE admission runs."""
    (finding,) = evict(eviction(0), policy)
    assert (finding.rule, finding.action, finding.path) == ("SG008", "deny", "/deleteOptions/gracePeriodSeconds")
    assert "gracePeriodSeconds 0" in finding.message


@pytest.mark.parametrize("grace", [None, 30, 1])
def test_evictions_that_keep_a_grace_period_pass(policy, grace):
    assert evict(eviction(grace), policy) == []


def test_admins_may_force_evict(policy):
    assert evict(eviction(0), policy, groups=ADMINS, user="oncall") == []


def test_unscheduled_pod_may_be_force_deleted(policy):
    pod = running_pod()
    del pod["spec"]["nodeName"]
    assert delete(pod, policy, 0) == []


def test_pod_without_claims_may_be_force_deleted(policy):
    pod = running_pod()
    del pod["spec"]["resourceClaims"]
    assert delete(pod, policy, 0) == []


def test_force_delete_of_other_kinds_is_not_sg008(policy, dra):
    assert delete(dra.carrier("Deployment", dra.pod_spec()), policy, 0) == []
    assert delete(None, policy, 0) == []


def test_sg008_action_from_policy(policy):
    audit = parse_policy({"rules": {"SG008": {"action": "audit"}}})
    assert verdict(delete(running_pod(), audit, 0)) == [("SG008", "audit")]
    off = parse_policy({"rules": {"SG008": {"action": "off"}}})
    assert delete(running_pod(), off, 0) == []
