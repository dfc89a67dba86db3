"""SG007's deallocation guard: a status write that clears a GPU claim's allocation (its devices back to the
pool) is allowed only with an attestation of their scrub on the stored claim, from the scheduler undoing its
own cycle, or under an admin's break-glass (audited)."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies import names
from scrubgate.policies.attestation import public_key_pem, sign
from scrubgate.policies.config import PolicyConfig, PolicyError, load_policy, parse_policy
from scrubgate.policies.engine import Admission, DeviceClasses, Operation, default, validate
from scrubgate.policies.findings import Finding
from test_attestation import DEVICE, KID, payload
from test_attestation import claim as recorded_claim
from webhook_support import gpu_claim

KEY = Ed25519PrivateKey.generate()
KEYS = [{"kid": KID, "publicKey": public_key_pem(KEY)}]
POLICY = parse_policy({"attestationKeys": KEYS})
UID = "uid-1"  # the claim UID test_attestation's payload attests by default
OTHER_DEVICE = {**DEVICE, "device": "gpu-1", "uuid": "GPU-5678"}
SCHEDULER = "system:kube-scheduler"
PATH = "/status/allocation"
# NVIDIA's classes as its DRA driver defines them, as the webhook learns them from the cluster.
NVIDIA_CLASSES = DeviceClasses.of(
    [
        {"metadata": {"name": name}, "spec": {"selectors": [{"cel": {"expression": expression}}]}}
        for name, expression in [
            (
                "vfio.gpu.nvidia.com",
                "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'",
            ),
            ("compute-domain-daemon.nvidia.com", "device.driver == 'compute-domain.nvidia.com'"),
            ("compute-domain-default-channel.nvidia.com", "device.driver == 'compute-domain.nvidia.com'"),
        ]
    ],
    ["gpu.nvidia.com"],
)
FPGA = {"driver": "fpga.example.com", "pool": "node-a", "device": "fpga-0"}


def allocated(
    *,
    devices: tuple[dict[str, str], ...] = (DEVICE,),
    annotations: dict[str, str] | None = None,
    finalizers: tuple[str, ...] = (names.FINALIZER,),
    device_class: str = "gpu.nvidia.com",
    recorded: bool = True,
) -> dict[str, Any]:
    """A claim as stored while allocated: `devices` in status.allocation and, when `recorded`, in the agent's
    scrubgate.dev/devices annotation."""
    shape = recorded_claim(UID, devices)
    agent = shape["metadata"]["annotations"] if recorded else {}
    obj = gpu_claim(
        "c",
        uid=UID,
        finalizers=list(finalizers),
        annotations={**agent, **(annotations or {})},
        deviceClassName=device_class,
    )
    obj["status"] = shape["status"]
    return obj


def attested(**kwargs: Any) -> dict[str, str]:
    """The attestation annotation of a token signed by the policy's key; kwargs go to the payload."""
    return {names.ANNOTATION_ATTESTATION: sign(payload(**kwargs), KEY, KID)}


def deallocated(old: dict[str, Any]) -> dict[str, Any]:
    """The status write that clears the allocation: the API server keeps the stored metadata and spec."""
    new = copy.deepcopy(old)
    del new["status"]["allocation"]
    return new


def status_update(
    old: dict[str, Any] | None,
    new: dict[str, Any] | None,
    user: str = "alice",
    *,
    groups: tuple[str, ...] = ("tenants",),
    policy: PolicyConfig = POLICY,
    operation: Operation = "UPDATE",
    subresource: str = "status",
    classes: DeviceClasses = NVIDIA_CLASSES,
) -> list[Finding]:
    admission = Admission(operation, user, groups, old_object=old, subresource=subresource, node="node-a")
    return validate(new, policy, trusted=False, admission=admission, classes=classes)


def assert_denied(findings: list[Finding], *fragments: str) -> None:
    assert [(f.rule, f.action, f.path) for f in findings] == [("SG007", "deny", PATH)], findings
    for fragment in fragments:
        assert fragment in findings[0].message, findings[0].message


# -- denied without proof of a scrub ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finalizers", "device_class"),
    [((names.FINALIZER,), "gpu.nvidia.com"), ((), "mig.nvidia.com"), ((names.FINALIZER,), "fpga.example.com")],
    ids=["finalizer-and-gpu-class", "gpu-class-only", "gpu-driver-under-an-unlisted-class"],
)
def test_clearing_a_gpu_claims_allocation_without_attestation_is_denied(finalizers, device_class):
    old = allocated(finalizers=finalizers, device_class=device_class)
    assert_denied(
        status_update(old, deallocated(old)),
        "user 'alice' cleared the allocation",
        f"without a {names.ANNOTATION_ATTESTATION} annotation",
    )


def test_a_status_write_that_drops_the_whole_status_or_swaps_devices_is_a_deallocation():
    old = allocated()
    no_status = copy.deepcopy(old)
    del no_status["status"]
    assert_denied(status_update(old, no_status))
    swapped = copy.deepcopy(old)
    swapped["status"]["allocation"]["devices"]["results"][0]["device"] = OTHER_DEVICE["device"]
    assert_denied(status_update(old, swapped))


def test_the_guard_holds_in_every_served_api_version(dra, resource_version):
    old = dra.claim(resource_version, name="c", finalizers=[names.FINALIZER])
    old["metadata"]["uid"] = UID
    old["status"] = recorded_claim(UID)["status"]
    assert_denied(status_update(old, deallocated(old)))


@pytest.mark.parametrize("user", ["system:serviceaccount:scrubgate-system:scrubgate-agent", "root-admin"])
def test_neither_the_agent_nor_an_admin_is_exempt(user):
    old = allocated()
    findings = status_update(old, deallocated(old), user, groups=("system:masters",))
    assert_denied(findings, f"user {user!r}")


def test_the_rules_action_applies_to_the_denial():
    old = allocated()
    warned = parse_policy({"attestationKeys": KEYS, "rules": {"SG007": {"action": "warn"}}})
    assert [(f.rule, f.action, f.path) for f in status_update(old, deallocated(old), policy=warned)] == [
        ("SG007", "warn", PATH)
    ]


# -- the attestation on the stored claim ----------------------------------------------------------------


def test_a_valid_attestation_on_the_stored_claim_allows_the_deallocation():
    old = allocated(annotations=attested())
    assert status_update(old, deallocated(old)) == []


def test_an_attestation_covering_both_allocated_devices_allows_the_deallocation():
    old = allocated(devices=(DEVICE, OTHER_DEVICE), annotations=attested(devices=(DEVICE, OTHER_DEVICE)))
    assert status_update(old, deallocated(old)) == []


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (lambda: sign(payload(uid="uid-2"), KEY, KID), "claim UID 'uid-2', not this claim's 'uid-1'"),
        (lambda: sign(payload(), Ed25519PrivateKey.generate(), KID), f"signature does not verify with key {KID!r}"),
        (lambda: sign(payload(), KEY, "stranger"), "key id 'stranger' is not among the policy's attestation keys"),
        (lambda: sign(payload(verified=False), KEY, KID), "not verified clean"),
        (lambda: "not-a-jws", "not a compact JWS"),
    ],
    ids=["other-claim", "unknown-key", "unknown-kid", "dirty", "garbage"],
)
def test_an_attestation_that_does_not_hold_is_denied_saying_why(token, why):
    old = allocated(annotations={names.ANNOTATION_ATTESTATION: token()})
    assert_denied(status_update(old, deallocated(old)), "with an attestation that does not hold", why)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded-by-the-agent", "allocation-only"])
def test_an_attestation_missing_one_of_two_allocated_devices_is_denied(recorded):
    old = allocated(devices=(DEVICE, OTHER_DEVICE), annotations=attested(devices=(DEVICE,)), recorded=recorded)
    assert_denied(status_update(old, deallocated(old)), "does not cover", "gpu.nvidia.com/node-a/gpu-1")


def test_a_status_write_cannot_bring_its_own_attestation():
    old = allocated()
    new = deallocated(old)
    new["metadata"]["annotations"].update(attested())
    assert_denied(status_update(old, new), f"without a {names.ANNOTATION_ATTESTATION} annotation")
    # ...nor replace a stored one that does not hold.
    stale = allocated(annotations=attested(uid="uid-2"))
    new = deallocated(stale)
    new["metadata"]["annotations"].update(attested())
    assert_denied(status_update(stale, new), "claim UID 'uid-2'")


# -- exemptions -------------------------------------------------------------------------------------------

CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
PROTECTED = (names.FINALIZER, names.DELETE_PROTECTION_FINALIZER)


def scheduled(**kwargs: Any) -> dict[str, Any]:
    """A claim as the scheduler leaves it when the pod it allocated the claim for could not be bound: allocated,
    `resource.kubernetes.io/delete-protection` added with the allocation, no node agent's record of it."""
    return allocated(recorded=False, finalizers=PROTECTED, **kwargs)


def test_the_scheduler_undoes_its_own_allocation_without_attestation():
    old = scheduled()
    assert status_update(old, deallocated(old), SCHEDULER, groups=("system:authenticated",)) == []
    pending = scheduled()
    pending["status"]["reservedFor"] = [{"resource": "pods", "name": "a", "uid": "pod-a"}]
    assert status_update(pending, deallocated(pending), SCHEDULER) == []


@pytest.mark.parametrize(
    "reserved",
    [
        [{"resource": "pods", "name": "a", "uid": "pod-a"}, {"resource": "pods", "name": "b", "uid": "pod-b"}],
        [{"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "g", "uid": "pg"}],
    ],
    ids=["two-pods", "a-pod-group"],
)
def test_the_scheduler_may_not_clear_a_claim_in_use_by_more_than_its_pending_pod(reserved):
    """PostFilter clears only a claim reserved for nobody or for the one pod being scheduled."""
    old = scheduled()
    old["status"]["reservedFor"] = reserved
    assert_denied(status_update(old, deallocated(old), SCHEDULER), f"user {SCHEDULER!r}")


@pytest.mark.parametrize(
    "claim",
    [
        lambda: allocated(finalizers=PROTECTED),  # the agent saw it on its node: it was used
        lambda: allocated(recorded=False),  # delete-protection removed: its reservation may have gone with it
    ],
    ids=["recorded-by-the-agent", "without-delete-protection"],
)
def test_the_scheduler_may_not_clear_a_claim_that_was_used(claim):
    """The hole found on the real control plane: with delete-protection removed, the resourceclaim controller
    drops the reservation of a used claim and keeps its allocation; reserved for nobody, it looked like the
    scheduler's own, and PostFilter cleared it unattested."""
    old = claim()
    assert_denied(status_update(old, deallocated(old), SCHEDULER), f"user {SCHEDULER!r}")


def test_the_policy_names_the_scheduler():
    custom = "system:serviceaccount:kube-system:gpu-scheduler"
    policy = parse_policy({"attestationKeys": KEYS, "scheduler": {"identities": [custom]}})
    old = scheduled()
    assert status_update(old, deallocated(old), custom, policy=policy) == []
    assert_denied(status_update(old, deallocated(old), SCHEDULER, policy=policy), f"user {SCHEDULER!r}")


FAILED = {names.ANNOTATION_SCRUB_STATUS: f"{names.SCRUB_FAILED_PREFIX}scrub-failed: gpu-0 not verified"}


def test_break_glass_after_a_failed_scrub_lets_the_controller_deallocate_audited():
    """The agent fenced the devices with DeviceTaintRules when the scrub failed: the allocation may go."""
    old = allocated(annotations={**FAILED, names.ANNOTATION_BREAK_GLASS: "node-a lost in a fire"})
    findings = status_update(old, deallocated(old), CONTROLLER, groups=("system:serviceaccounts",))
    assert [(f.rule, f.action, f.path) for f in findings] == [("SG007", "audit", PATH)], findings
    assert f"break-glass deallocation by {CONTROLLER!r}, devices fenced after a failed scrub" in findings[0].message
    assert "node-a lost in a fire" in findings[0].message


def test_break_glass_before_the_agents_fence_refuses_the_controllers_deallocation():
    """Mid-teardown, or with the agent gone, nothing but the allocation keeps the devices from the next claim."""
    for status in ({}, {names.ANNOTATION_SCRUB_STATUS: names.SCRUB_SCRUBBING}):
        old = allocated(annotations={**status, names.ANNOTATION_BREAK_GLASS: "node-a lost"})
        assert_denied(
            status_update(old, deallocated(old), CONTROLLER),
            "break-glass (node-a lost) lets it go only once the node agent has fenced the devices",
            "a member of the policy's admin groups clears the allocation",
        )


def test_an_admin_clearing_the_allocation_under_break_glass_is_allowed_and_audited():
    old = allocated(annotations={names.ANNOTATION_BREAK_GLASS: "node-a lost in a fire"})
    findings = status_update(old, deallocated(old), "root-admin", groups=("system:masters",))
    assert [(f.rule, f.action, f.path) for f in findings] == [("SG007", "audit", PATH)], findings
    assert "break-glass deallocation by admin 'root-admin', devices neither fenced nor attested" in findings[0].message


def test_break_glass_is_audited_whatever_the_rules_action():
    old = allocated(annotations={**FAILED, names.ANNOTATION_BREAK_GLASS: "node-a lost"})
    for action in ("warn", "audit"):
        policy = parse_policy({"rules": {"SG007": {"action": action}}})
        assert [f.action for f in status_update(old, deallocated(old), CONTROLLER, policy=policy)] == ["audit"]


def test_break_glass_counts_only_on_the_stored_claim_and_with_a_reason():
    old = allocated(annotations=FAILED)
    new = deallocated(old)
    new["metadata"]["annotations"][names.ANNOTATION_BREAK_GLASS] = "trust me"
    assert_denied(status_update(old, new, CONTROLLER))
    blank = allocated(annotations={**FAILED, names.ANNOTATION_BREAK_GLASS: "   "})
    assert_denied(status_update(blank, deallocated(blank), CONTROLLER))


# -- Kubernetes' delete-protection on a claim holding a GPU ------------------------------------------------


def without_delete_protection(old: dict[str, Any]) -> dict[str, Any]:
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = [f for f in new["metadata"]["finalizers"] if f != names.DELETE_PROTECTION_FINALIZER]
    return new


def claim_update(old: dict[str, Any], new: dict[str, Any], user: str, groups: tuple[str, ...]) -> list[Finding]:
    return status_update(old, new, user, groups=groups, subresource="")


def test_removing_delete_protection_from_a_claim_holding_a_gpu_is_denied():
    old = allocated(finalizers=PROTECTED)
    (finding,) = claim_update(old, without_delete_protection(old), "alice", ("tenants",))
    assert (finding.rule, finding.action, finding.path) == ("SG007", "deny", "/metadata/finalizers")
    assert f"user 'alice' removed {names.DELETE_PROTECTION_FINALIZER} from a claim that still holds a GPU" in (
        finding.message
    )


def test_an_admin_may_remove_delete_protection_audited():
    old = allocated(finalizers=PROTECTED)
    (finding,) = claim_update(old, without_delete_protection(old), "root-admin", ("system:masters",))
    assert (finding.rule, finding.action) == ("SG007", "audit")
    assert f"admin 'root-admin' removed {names.DELETE_PROTECTION_FINALIZER}" in finding.message


def mutate(old: dict[str, Any], new: dict[str, Any], user: str) -> list[dict[str, Any]]:
    """The JSON Patch /mutate would answer for this claim UPDATE."""
    findings = default(new, POLICY, "UPDATE", Admission("UPDATE", user, old_object=old))
    return [op for finding in findings for op in finding.patch]


def applied(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return jsonpatch.apply_patch(obj, ops)


def test_the_scheduler_releasing_its_own_unbound_claim_takes_the_finalizer_with_it():
    """KEP-5004: after a failed binding, kube-scheduler's Unreserve removes delete-protection from the
    extended-resource claim it allocated in that cycle, then deletes it. /mutate takes the sanitize finalizer
    away in that update (nothing to scrub: no container used it), and the validating side allows both removals,
    recorded; kept, the finalizer would hold the claim and its GPU with nobody to attest it."""
    old = scheduled()
    old["status"]["reservedFor"] = [{"resource": "pods", "name": "a", "uid": "pod-a"}]
    update = without_delete_protection(old)
    ops = mutate(old, update, SCHEDULER)
    assert ops == [
        {"op": "test", "path": "/metadata/finalizers/0", "value": names.FINALIZER},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]
    released = applied(update, ops)
    assert released["metadata"]["finalizers"] == []
    (finding,) = claim_update(old, released, SCHEDULER, ("system:authenticated",))
    assert (finding.rule, finding.action, finding.path) == ("SG007", "audit", "/metadata/finalizers")
    assert "binding failed" in finding.message and "nothing to scrub" in finding.message
    # The same update with the finalizer left (SG004 off, say) is allowed too: the claim would only wait longer.
    assert [f.action for f in claim_update(old, update, SCHEDULER, ())] == ["audit"]


@pytest.mark.parametrize(
    "user, claim",
    [
        ("alice", scheduled),
        (SCHEDULER, lambda: allocated(finalizers=PROTECTED)),  # on the agent's record: it was used
        (
            SCHEDULER,
            lambda: (
                scheduled()
                | {
                    "status": {
                        **scheduled()["status"],
                        "reservedFor": [
                            {"resource": "pods", "name": "a", "uid": "pod-a"},
                            {"resource": "pods", "name": "b", "uid": "pod-b"},
                        ],
                    }
                }
            ),
        ),
    ],
    ids=["a-tenant", "a-used-claim", "reserved-for-two-pods"],
)
def test_no_one_else_and_no_used_claim_loses_the_finalizer_that_way(user, claim):
    old = claim()
    update = without_delete_protection(old)
    assert mutate(old, update, user) == []
    findings = claim_update(old, update, user, ("tenants",))
    assert [(f.rule, f.action) for f in findings] == [("SG007", "deny")]
    assert f"removed {names.DELETE_PROTECTION_FINALIZER}" in findings[0].message
    both = claim_update(old, applied(update, [{"op": "remove", "path": "/metadata/finalizers/0"}]), user, ("tenants",))
    assert [(f.rule, f.action) for f in both] == [("SG007", "deny")] * 2
    assert f"removed the {names.FINALIZER} finalizer" in both[1].message


def test_delete_protection_goes_freely_once_the_claim_holds_no_gpu():
    """As the resourceclaim controller removes it: after the deallocation. A claim of devices no agent
    scrubs is not guarded at all."""
    deallocated_claim = deallocated(allocated(finalizers=PROTECTED, annotations=attested()))
    assert claim_update(deallocated_claim, without_delete_protection(deallocated_claim), CONTROLLER, ()) == []
    fpga = allocated(devices=(FPGA,), finalizers=PROTECTED, device_class="fpga.example.com", recorded=False)
    assert claim_update(fpga, without_delete_protection(fpga), "alice", ("tenants",)) == []


# -- not this guard's business ----------------------------------------------------------------------------


def test_a_non_gpu_claim_is_not_guarded_with_or_without_the_finalizer():
    for finalizers in ((), (names.FINALIZER,)):
        old = allocated(devices=(FPGA,), finalizers=finalizers, device_class="fpga.example.com", recorded=False)
        assert status_update(old, deallocated(old)) == []


# -- what is guarded is known from what was allocated (a GPU driver), not from the class's name ----------


def test_a_gpu_drivers_device_under_a_class_the_policy_does_not_list_is_guarded():
    """A cluster's own class for one GPU model (`h100-80gb`, selecting gpu.nvidia.com's devices)."""
    old = allocated(finalizers=(), device_class="h100-80gb", recorded=False)
    assert_denied(status_update(old, deallocated(old)), f"without a {names.ANNOTATION_ATTESTATION} annotation")
    other = parse_policy({"attestationKeys": KEYS, "gpuDrivers": ["gpu.example.com"]})
    assert status_update(old, deallocated(old), policy=other) == []


COMPUTE_DOMAIN_CHANNEL = {"driver": "compute-domain.nvidia.com", "pool": "node-a", "device": "channel-0"}


@pytest.mark.parametrize(
    ("device_class", "device"),
    [
        ("compute-domain-default-channel.nvidia.com", COMPUTE_DOMAIN_CHANNEL),
        ("compute-domain-daemon.nvidia.com", {**COMPUTE_DOMAIN_CHANNEL, "device": "daemon-0"}),
        ("vfio.gpu.nvidia.com", DEVICE),  # a GPU bound to vfio-pci: served by gpu.nvidia.com, scrubbed by no one
    ],
)
def test_claims_no_agent_scrubs_are_never_held(device_class, device):
    """They may carry the finalizer from an older policy (`*.nvidia.com`): their deallocation still goes
    through, and once deleted their finalizer may go, or their namespace would hang in Terminating. A vfio GPU is
    a gpu.nvidia.com device: it is left alone because its class is excluded and proven to select only vfio
    devices; not known so, it is guarded (fail closed)."""
    old = allocated(devices=(device,), device_class=device_class, recorded=False)
    assert status_update(old, deallocated(old), "system:serviceaccount:kube-system:resource-claim-controller") == []
    assert _finalizer_removed(_deleted(deallocated(old))) == []
    assert _finalizer_removed(_deleted(old)) == []
    # The finalizer of one that still exists stays the agent's to remove.
    assert [f.rule for f in _finalizer_removed(old)] == ["SG007"]
    impostor = DeviceClasses.of(
        [{"metadata": {"name": device_class}, "spec": {"selectors": [{"cel": {"expression": "true"}}]}}],
        ["gpu.nvidia.com"],
    )
    held = status_update(old, deallocated(old), "resource-claim-controller", classes=impostor)
    assert [f.rule for f in held] == (["SG007"] if device["driver"] == "gpu.nvidia.com" else [])


def test_a_gpu_allocated_through_a_class_named_like_an_excluded_family_is_guarded():
    """Exclusions name classes exactly: a GPU model class named after the ComputeDomain it serves is no IMEX
    channel class, and its gpu.nvidia.com device keeps its allocation until the attestation."""
    old = allocated(device_class="compute-domain-h100.gpu.nvidia.com", recorded=False)
    assert_denied(status_update(old, deallocated(old)), f"without a {names.ANNOTATION_ATTESTATION} annotation")


def test_an_excluded_class_in_one_request_leaves_the_gpu_of_another_guarded():
    old = allocated(device_class="vfio.gpu.nvidia.com", recorded=False)
    old["spec"]["devices"]["requests"].append({"name": "compute", "exactly": {"deviceClassName": "gpu.nvidia.com"}})
    old["status"]["allocation"]["devices"]["results"].append({**OTHER_DEVICE, "request": "compute"})
    assert_denied(status_update(old, deallocated(old)), "without a")


def test_allocating_is_not_guarded():
    allocated_claim = allocated()
    pending = copy.deepcopy(allocated_claim)
    del pending["status"]
    assert status_update(pending, allocated_claim) == []
    empty_status = copy.deepcopy(allocated_claim)
    empty_status["status"] = {}
    assert status_update(empty_status, allocated_claim) == []


def test_a_pod_leaves_the_reservation_of_a_gpu_claim_no_agent_holds_only_attested():
    """A pod that ran must not leave a GPU claim looking unused: while no node agent holds the claim, only
    kube-scheduler (its Unreserve drops a pod whose binding failed) takes a pod out before the attestation; once
    the agent holds it, the resourceclaim controller drops ended pods freely."""
    old = allocated()
    old["status"]["reservedFor"] = [{"resource": "pods", "name": "trainer", "uid": "pod-1"}]
    new = copy.deepcopy(old)
    new["status"]["reservedFor"] = []
    (finding,) = status_update(old, new, "system:serviceaccount:kube-system:resource-claim-controller")
    assert finding.path == "/status/reservedFor" and "removed pod(s) trainer" in finding.message
    assert status_update(old, new, SCHEDULER) == []
    hold = {"apiGroup": "scrubgate.dev", "resource": "nodeagents", "name": "node-a", "uid": "hold-1"}
    held = copy.deepcopy(old)
    held["status"]["reservedFor"].append(hold)
    dropped = copy.deepcopy(held)
    dropped["status"]["reservedFor"] = [hold]
    assert status_update(held, dropped, "system:serviceaccount:kube-system:resource-claim-controller") == []


def test_a_main_resource_update_is_not_a_deallocation():
    # The API server keeps the stored status on a write to the main resource: what the object says there
    # about status.allocation clears nothing.
    old = allocated()
    assert status_update(old, deallocated(old), subresource="") == []


def test_sg007_off_turns_the_guard_off():
    policy = parse_policy({"rules": {"SG007": {"action": "off"}}})
    old = allocated()
    assert status_update(old, deallocated(old), policy=policy) == []
    glass = allocated(annotations={names.ANNOTATION_BREAK_GLASS: "node-a lost"})
    assert status_update(glass, deallocated(glass), policy=policy) == []


def test_only_updates_of_a_claims_status_are_guarded():
    old = allocated()
    assert status_update(None, old, operation="CREATE") == []
    assert status_update(old, None, operation="DELETE") == []
    template = allocated()
    template["kind"] = "ResourceClaimTemplate"
    assert status_update(template, deallocated(template)) == []


# -- configuration ----------------------------------------------------------------------------------------


def test_scheduler_identities_default_and_parse():
    assert load_policy().scheduler.identities == (SCHEDULER,)
    assert parse_policy({}).scheduler.identities == (SCHEDULER,)
    policy = parse_policy({"scheduler": {"identities": ["sched-a", "sched-b"]}})
    assert policy.scheduler.identities == ("sched-a", "sched-b")
    assert parse_policy({"scheduler": {"identities": []}}).scheduler.identities == ()


@pytest.mark.parametrize(
    ("scheduler", "path", "reason"),
    [
        ({"users": ["x"]}, "scheduler.users", "Extra inputs are not permitted"),
        ({"identities": "system:kube-scheduler"}, "scheduler.identities", "tuple"),
        ({"identities": [["x"]]}, "scheduler.identities.0", "string"),
        (["system:kube-scheduler"], "scheduler", ""),
    ],
)
def test_bad_scheduler_settings_are_refused_with_the_field_path(scheduler, path, reason):
    with pytest.raises(PolicyError) as err:
        parse_policy({"scheduler": scheduler}, "team.yaml")
    message = str(err.value)
    assert message.startswith("team.yaml: invalid policy: ")
    assert f"{path}: " in message and reason in message


# -- a claim deleted before it ever held a device ------------------------------------------------------


def _deleted(claim: dict[str, Any]) -> dict[str, Any]:
    claim = copy.deepcopy(claim)
    claim["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return claim


def _finalizer_removed(old: dict[str, Any], user: str = "alice") -> list[Finding]:
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = []
    return status_update(old, new, user, subresource="")


def test_the_finalizer_of_a_claim_deleted_before_any_allocation_may_go_unattested() -> None:
    never = deallocated(allocated(recorded=False))
    assert _finalizer_removed(_deleted(never)) == []
    # Not while it still exists, nor once it held a device (allocated now, or on the agent's record).
    assert [f.rule for f in _finalizer_removed(never)] == ["SG007"]
    assert [f.rule for f in _finalizer_removed(_deleted(allocated(recorded=False)))] == ["SG007"]
    assert [f.rule for f in _finalizer_removed(_deleted(deallocated(allocated())))] == ["SG007"]


def test_an_attestation_does_not_cover_a_later_use_of_the_claim() -> None:
    """A named claim used again by another pod after its attested scrub: that pod's data is not covered."""
    first = ("p1", "pod-1")
    old = allocated(annotations=attested(consumers=[first]))
    old["status"]["reservedFor"] = [{"resource": "pods", "name": "p1", "uid": "pod-1"}]
    assert status_update(old, deallocated(old), "resource-claim-controller") == []
    old["status"]["reservedFor"] = [{"resource": "pods", "name": "p2", "uid": "pod-2"}]
    (finding,) = status_update(old, deallocated(old), "resource-claim-controller")
    assert finding.rule == "SG007" and "predates the claim's use by pod(s) p2 (pod-2)" in finding.message


# -- a claim with a GPU and a device of another kind -------------------------------------------------------


NIC = {"driver": "nic.example.com", "pool": "node-a", "device": "nic-0"}


def _mixed(nic_request: str = "nic", **kwargs: Any) -> dict[str, Any]:
    """A GPU claim that also holds a NIC (another request, another class): the agent attests the GPU only."""
    old = allocated(**kwargs)
    old["spec"]["devices"]["requests"].append({"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}})
    results = old["status"]["allocation"]["devices"]["results"]
    results[0]["request"] = "gpu/h200"  # a subrequest of the GPU request (firstAvailable)
    results.append({**NIC, "request": nic_request})
    return old


def test_the_devices_of_requests_that_cannot_use_a_gpu_class_need_no_attestation() -> None:
    old = _mixed(annotations=attested())
    assert status_update(old, deallocated(old), "resource-claim-controller") == []
    agent = POLICY.agent.identities[0]
    stripped = copy.deepcopy(old)
    stripped["metadata"]["finalizers"] = []
    assert status_update(old, stripped, agent, subresource="") == []


def test_a_gpu_of_an_unknown_request_still_needs_the_attestation() -> None:
    """A device of a GPU driver whose request the spec does not name is guarded (fail closed); a device of
    another driver holds no GPU memory an agent could scrub, whatever request it came from."""
    old = _mixed("not-in-the-spec", annotations=attested())
    assert status_update(old, deallocated(old), "resource-claim-controller") == []
    old["status"]["allocation"]["devices"]["results"].append({**OTHER_DEVICE, "request": "not-in-the-spec"})
    (finding,) = status_update(old, deallocated(old), "resource-claim-controller")
    assert "does not cover the claim's devices: gpu.nvidia.com/node-a/gpu-1" in finding.message
