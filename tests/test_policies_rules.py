"""SG001-SG006 over hand-built objects in every resource.k8s.io version, every pod-carrying kind, both tenancies."""

from __future__ import annotations

import copy

import jsonpatch
import pytest
from scrubgate.policies import names
from scrubgate.policies.config import parse_policy
from scrubgate.policies.engine import DeviceClasses, default, validate

RETAIN = {names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN}
FENCE = {"key": names.TAINT_UNSANITIZED, "operator": "Exists", "effect": "NoSchedule"}


def verdict(findings) -> list[tuple[str, str]]:
    return sorted((f.rule, f.action) for f in findings)


def shapes(version: str) -> tuple[str, ...]:
    return ("exactly", "firstAvailable") if version in ("v1", "v1beta2") else ("flat",)


# --- claims and claim templates: SG001, SG004, SG005, SG006 ---------------------------------------------------


def test_clean_gpu_claim_template_has_no_findings(dra, policy, resource_version):
    for shape in shapes(resource_version):
        obj = dra.claim(
            resource_version,
            "ResourceClaimTemplate",
            requests=[dra.device_request(resource_version, shape=shape)],
        )
        assert validate(obj, policy, trusted=False) == []


def test_gpu_claim_without_finalizer_warns_sg004_in_ci(dra, policy, resource_version):
    found = validate(dra.claim(resource_version), policy, trusted=False)
    assert verdict(found) == [("SG004", "warn")]
    with_finalizer = dra.claim(resource_version, finalizers=["other.example/keep", names.FINALIZER])
    assert validate(with_finalizer, policy, trusted=False) == []


def test_claim_template_never_gets_sg004(dra, policy, resource_version):
    # The finalizer belongs on the claims generated from the template, which the webhook sees on their CREATE.
    assert validate(dra.claim(resource_version, "ResourceClaimTemplate"), policy, trusted=False) == []


def test_retain_on_claim_metadata_is_sg001_only_when_multi_tenant(dra, policy, resource_version):
    obj = dra.claim(resource_version, annotations=RETAIN, finalizers=[names.FINALIZER])
    found = validate(obj, policy, trusted=False)
    assert verdict(found) == [("SG001", "deny")]
    assert found[0].path == "/metadata/annotations/scrubgate.dev~1deallocation-policy"
    assert found[0].patch == (
        {"op": "replace", "path": "/metadata/annotations/scrubgate.dev~1deallocation-policy", "value": "Delete"},
    )
    assert validate(obj, policy, trusted=True) == []


@pytest.mark.parametrize("place", ["metadata", "spec.metadata"])
def test_retain_on_claim_template_in_either_metadata_is_sg001(dra, policy, resource_version, place):
    kwargs = {"annotations": RETAIN} if place == "metadata" else {"template_annotations": RETAIN}
    obj = dra.claim(resource_version, "ResourceClaimTemplate", **kwargs)
    found = validate(obj, policy, trusted=False)
    assert verdict(found) == [("SG001", "deny")]
    expected = "/metadata" if place == "metadata" else "/spec/metadata"
    assert found[0].path == expected + "/annotations/scrubgate.dev~1deallocation-policy"
    fixed = jsonpatch.apply_patch(obj, list(found[0].patch))
    assert validate(fixed, policy, trusted=False) == []
    assert validate(obj, policy, trusted=True) == []


def test_retain_in_both_template_places_gives_two_findings(dra, policy):
    obj = dra.claim("v1", "ResourceClaimTemplate", annotations=RETAIN, template_annotations=RETAIN)
    assert verdict(validate(obj, policy, trusted=False)) == [("SG001", "deny"), ("SG001", "deny")]


@pytest.mark.parametrize("value", [names.DEALLOCATION_DELETE, None])
def test_delete_or_absent_policy_is_fine(dra, policy, value):
    annotations = {} if value is None else {names.ANNOTATION_DEALLOCATION_POLICY: value}
    obj = dra.claim("v1", "ResourceClaimTemplate", annotations=annotations, template_annotations=annotations)
    assert validate(obj, policy, trusted=False) == []


@pytest.mark.parametrize("value", ["retain", "Keep", 1, True, ["Retain"]])
def test_unknown_deallocation_policy_fails_closed(dra, policy, value):
    obj = dra.claim("v1", "ResourceClaimTemplate", template_annotations={names.ANNOTATION_DEALLOCATION_POLICY: value})
    assert verdict(validate(obj, policy, trusted=False)) == [("SG001", "deny")]


@pytest.mark.parametrize("key", [names.TAINT_UNSANITIZED, names.TAINT_SCRUB_FAILED, "scrubgate.dev/anything", None])
def test_request_tolerating_the_fence_is_sg005_in_any_tenancy(dra, policy, resource_version, claim_kind, key):
    toleration = {"operator": "Exists"} if key is None else {"key": key, "operator": "Exists", "effect": "NoSchedule"}
    for shape in shapes(resource_version):
        request = dra.device_request(resource_version, shape=shape, tolerations=[{"key": "other/x"}, toleration])
        obj = dra.claim(resource_version, claim_kind, requests=[request], finalizers=[names.FINALIZER])
        for trusted in (False, True):
            found = validate(obj, policy, trusted=trusted)
            assert verdict(found) == [("SG005", "deny")], (shape, trusted)
            assert found[0].path.endswith("/tolerations/1")
            assert found[0].patch == ()


def test_tolerations_of_other_taints_are_fine(dra, policy, resource_version):
    tolerations = [
        {"key": "gpu.example.com/unhealthy", "operator": "Equal", "value": "true", "effect": "NoExecute"},
        {"key": "nvidia.com/gpu", "operator": "Exists"},
        {"key": "scrubgate.devx/unsanitized", "operator": "Exists"},
    ]
    for shape in shapes(resource_version):
        request = dra.device_request(resource_version, shape=shape, tolerations=tolerations)
        obj = dra.claim(resource_version, "ResourceClaimTemplate", requests=[request])
        assert validate(obj, policy, trusted=False) == []


def test_admin_access_is_sg006_only_when_multi_tenant(dra, policy, resource_version, claim_kind):
    request = dra.device_request(resource_version, admin_access=True)
    obj = dra.claim(resource_version, claim_kind, requests=[request], finalizers=[names.FINALIZER])
    found = validate(obj, policy, trusted=False)
    assert verdict(found) == [("SG006", "deny")]
    where = "/devices/requests/0" + ("/exactly" if resource_version in ("v1", "v1beta2") else "") + "/adminAccess"
    assert found[0].path.endswith(where)
    assert validate(obj, policy, trusted=True) == []
    not_admin = dra.claim(
        resource_version, claim_kind, requests=[dra.device_request(resource_version, admin_access=False)]
    )
    assert [f.rule for f in validate(not_admin, policy, trusted=False) if f.rule == "SG006"] == []


def device_class(name: str, expression: str) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


@pytest.mark.parametrize(
    "device_class_name", ["gpu.example.com", "cpu.example.com", "nvidia.com", "gpu.nvidia.com.evil"]
)
def test_a_class_proven_to_hand_out_no_gpu_takes_its_claims_out_of_scope(
    dra, policy, resource_version, claim_kind, device_class_name
):
    """Retain and no finalizer are fine for a class whose selectors name another driver; admin access and the
    fence's tolerations are not, in a multi-tenant namespace, whatever the class (a name proves nothing)."""
    known = DeviceClasses.of(
        [device_class(device_class_name, "device.driver == 'cpu.example.com'")], ["gpu.nvidia.com"]
    )
    request = dra.device_request(resource_version, device_class_name, admin_access=True, tolerations=[FENCE])
    obj = dra.claim(resource_version, claim_kind, requests=[request], annotations=RETAIN, template_annotations=RETAIN)
    assert verdict(validate(obj, policy, trusted=False, classes=known)) == [("SG005", "deny"), ("SG006", "deny")]
    assert verdict(validate(obj, policy, trusted=True, classes=known)) == [("SG005", "deny")]  # the fence's own key
    plain = dra.claim(resource_version, claim_kind, requests=[dra.device_request(resource_version, device_class_name)])
    assert validate(plain, policy, trusted=False, classes=known) == []
    assert default(plain, policy, classes=known) == []


@pytest.mark.parametrize(
    "device_class_name", ["gpu.example.com", "cpu.example.com", "nvidia.com", "gpu.nvidia.com.evil"]
)
def test_a_class_nobody_proved_anything_of_is_a_gpu_class(dra, policy, resource_version, device_class_name):
    obj = dra.claim(resource_version, requests=[dra.device_request(resource_version, device_class_name)])
    assert verdict(validate(obj, policy, trusted=False)) == [("SG004", "warn")]


@pytest.mark.parametrize("device_class_name", ["gpu.nvidia.com", "mig.nvidia.com"])
def test_nvidia_gpu_classes_are_in_scope(dra, policy, device_class_name):
    obj = dra.claim("v1", requests=[dra.device_request("v1", device_class_name)])
    assert verdict(validate(obj, policy, trusted=False)) == [("SG004", "warn")]


# NVIDIA's classes for what no agent scrubs, as its DRA driver's chart defines them (templates/deviceclass-*.yaml).
NVIDIA_UNSCRUBBED = {
    "compute-domain-default-channel.nvidia.com": "device.driver == 'compute-domain.nvidia.com'"
    " && device.attributes['compute-domain.nvidia.com'].type == 'channel'",
    "compute-domain-daemon.nvidia.com": "device.driver == 'compute-domain.nvidia.com'"
    " && device.attributes['compute-domain.nvidia.com'].type == 'daemon'",
    "imex.nvidia.com": "device.driver == 'imex.nvidia.com'",
    "vfio.gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'",
}


@pytest.mark.parametrize("device_class_name", sorted(NVIDIA_UNSCRUBBED))
def test_nvidia_classes_no_agent_scrubs_get_no_finalizer(dra, policy, device_class_name):
    """IMEX channels hold no GPU memory and a vfio-pci GPU is scrubbed by no agent: a finalizer on their claims
    would never be removed, and their namespaces would hang in Terminating. Known as NVIDIA defines them, they
    are out of scope, and not known at all (no class of that name: no device comes through it); known under that
    name but selecting GPUs, they are guarded."""
    known = DeviceClasses.of(
        [device_class(device_class_name, NVIDIA_UNSCRUBBED[device_class_name])], ["gpu.nvidia.com"]
    )
    obj = dra.claim("v1", requests=[dra.device_request("v1", device_class_name)])
    assert validate(obj, policy, trusted=False, classes=known) == []
    assert default(obj, policy, classes=known) == []
    assert default(obj, policy) == []
    impostor = DeviceClasses.of(
        [device_class(device_class_name, "device.driver == 'gpu.nvidia.com'")], ["gpu.nvidia.com"]
    )
    assert [f.rule for f in default(obj, policy, classes=impostor)] == ["SG004"]


def test_one_gpu_alternative_in_first_available_brings_the_claim_in_scope(dra, policy, structured_version):
    request = dra.device_request(structured_version, shape="firstAvailable", tolerations=[FENCE])
    assert request["firstAvailable"][0]["deviceClassName"] == "cpu.example.com"
    obj = dra.claim(structured_version, "ResourceClaimTemplate", requests=[request], template_annotations=RETAIN)
    assert verdict(validate(obj, policy, trusted=False)) == [("SG001", "deny"), ("SG005", "deny")]


def test_policy_gpu_classes_only_add_to_scope(dra):
    """gpuDeviceClasses names classes guarded whatever their selectors prove; it never takes one out."""
    custom = parse_policy({"gpuDeviceClasses": ["gpu.example.*"]})
    known = DeviceClasses.of(
        [device_class(n, "device.driver == 'other.example.com'") for n in ("gpu.example.com", "tpu.example.com")],
        ["gpu.nvidia.com"],
    )
    example = dra.claim("v1", requests=[dra.device_request("v1", "gpu.example.com")])
    tpu = dra.claim("v1", requests=[dra.device_request("v1", "tpu.example.com")])
    nvidia = dra.claim("v1", requests=[dra.device_request("v1", "gpu.nvidia.com")])
    assert verdict(validate(example, custom, trusted=False, classes=known)) == [("SG004", "warn")]
    assert validate(tpu, custom, trusted=False, classes=known) == []
    assert verdict(validate(nvidia, custom, trusted=False, classes=known)) == [("SG004", "warn")]


def test_all_claim_rules_at_once(dra, policy, flat_version):
    request = dra.device_request(flat_version, admin_access=True, tolerations=[FENCE])
    obj = dra.claim(flat_version, requests=[request], annotations=RETAIN)
    assert verdict(validate(obj, policy, trusted=False)) == [
        ("SG001", "deny"),
        ("SG004", "warn"),
        ("SG005", "deny"),
        ("SG006", "deny"),
    ]
    assert verdict(validate(obj, policy, trusted=True)) == [("SG004", "warn"), ("SG005", "deny")]


# --- pods and workloads: SG002, SG003, SG005 --------------------------------------------------------------------


def test_clean_pod_carriers_have_no_findings(dra, policy, carrier_kind):
    obj = dra.carrier(carrier_kind, dra.pod_spec())
    assert validate(obj, policy, trusted=False) == []


def test_claim_by_name_in_a_workload_is_sg002_in_any_tenancy(dra, policy, workload_kind):
    obj = dra.carrier(workload_kind, dra.pod_spec(claim_name="shared"))
    for trusted in (False, True):
        found = validate(obj, policy, trusted=trusted)
        assert verdict(found) == [("SG002", "deny")]
        path = "/" + "/".join(dra.spec_path(workload_kind)) + "/resourceClaims/0/resourceClaimName"
        assert found[0].path == path
        assert "shared" in found[0].message


def test_claim_by_name_in_a_pod_is_sg002_only_when_multi_tenant(dra, policy):
    obj = dra.carrier("Pod", dra.pod_spec(claim_name="shared"))
    assert verdict(validate(obj, policy, trusted=False)) == [("SG002", "deny")]
    assert validate(obj, policy, trusted=True) == []


def test_old_source_shape_is_read(dra, policy, carrier_kind):
    by_name = dra.carrier(carrier_kind, dra.pod_spec(claim_name="shared", old_source=True))
    found = validate(by_name, policy, trusted=False)
    assert verdict(found) == [("SG002", "deny")]
    assert found[0].path.endswith("/resourceClaims/0/source/resourceClaimName")
    by_template = dra.carrier(carrier_kind, dra.pod_spec(old_source=True))
    assert validate(by_template, policy, trusted=False) == []


def test_missing_grace_period_is_sg003_with_a_patch_to_the_default(dra, policy, carrier_kind):
    obj = dra.carrier(carrier_kind, dra.pod_spec(grace=None))
    found = validate(obj, policy, trusted=True)
    assert verdict(found) == [("SG003", "deny")]
    path = "/" + "/".join((*dra.spec_path(carrier_kind), "terminationGracePeriodSeconds"))
    assert found[0].patch == ({"op": "add", "path": path, "value": policy.grace_period.default_seconds},)
    fixed = jsonpatch.apply_patch(copy.deepcopy(obj), list(found[0].patch))
    assert jsonpatch.JsonPointer(path).resolve(fixed) == 60
    assert validate(fixed, policy, trusted=True) == []


@pytest.mark.parametrize(
    ("grace", "rules"),
    [
        (0, ["SG003"]),
        (29, ["SG003"]),
        (30, []),
        (3600, []),
        (3601, ["SG003"]),
        (-1, ["SG003"]),
        ("60", ["SG003"]),
        (60.0, ["SG003"]),
        (True, ["SG003"]),
        (None, ["SG003"]),
    ],
)
def test_grace_period_bounds_and_types(dra, policy, grace, rules):
    spec = dra.pod_spec()
    spec["terminationGracePeriodSeconds"] = grace
    found = validate(dra.carrier("Deployment", spec), policy, trusted=True)
    assert [f.rule for f in found] == rules
    assert all(f.patch == () for f in found)


def test_grace_period_limits_come_from_the_policy(dra):
    strict = parse_policy({"gracePeriod": {"minimumSeconds": 90, "defaultSeconds": 120, "maximumSeconds": 300}})
    assert [f.rule for f in validate(dra.carrier("Pod", dra.pod_spec(grace=60)), strict, trusted=True)] == ["SG003"]
    assert validate(dra.carrier("Pod", dra.pod_spec(grace=90)), strict, trusted=True) == []
    missing = validate(dra.carrier("Pod", dra.pod_spec(grace=None)), strict, trusted=True)
    assert missing[0].patch[0]["value"] == 120


def test_pod_spec_without_claims_is_not_checked(dra, policy, carrier_kind):
    spec = dra.pod_spec(grace=None, tolerations=[{"operator": "Exists"}])
    del spec["resourceClaims"]
    assert validate(dra.carrier(carrier_kind, spec), policy, trusted=False) == []


def test_pod_toleration_of_a_scrubgate_node_taint_is_sg005(dra, policy, carrier_kind):
    tolerations = [{"operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists"}, FENCE]
    found = validate(dra.carrier(carrier_kind, dra.pod_spec(tolerations=tolerations)), policy, trusted=True)
    # In a single-tenant namespace a key-less Exists toleration is left alone; the scrubgate key is not.
    assert verdict(found) == [("SG005", "deny")]
    assert found[0].path.endswith("/tolerations/2")


@pytest.mark.parametrize("effect", [None, "NoSchedule", "NoExecute"])
def test_a_multi_tenant_gpu_pod_tolerating_every_taint_is_sg005(dra, policy, carrier_kind, effect):
    """`operator: Exists` without a key tolerates the agent's fallback node taint as well as any other: the same
    toleration on a device request is refused too."""
    everything = {"operator": "Exists", **({"effect": effect} if effect else {})}
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists"}, everything]
    found = validate(dra.carrier(carrier_kind, dra.pod_spec(tolerations=tolerations)), policy, trusted=False)
    assert verdict(found) == [("SG005", "deny")]
    assert found[0].path.endswith("/tolerations/1")
    assert "tolerates every taint (operator: Exists, no key)" in found[0].message


def test_pod_carrier_rules_at_once(dra, policy):
    spec = dra.pod_spec(claim_name="shared", grace=5, tolerations=[FENCE])
    found = validate(dra.carrier("CronJob", spec), policy, trusted=False)
    assert verdict(found) == [("SG002", "deny"), ("SG003", "deny"), ("SG005", "deny")]
    assert all(f.path.startswith("/spec/jobTemplate/spec/template/spec/") for f in found)


# --- what is passed over ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        {"apiVersion": "resource.k8s.io/v1alpha2", "kind": "ResourceClaim", "metadata": {"annotations": RETAIN}},
        {"apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule", "spec": {"taint": {"key": "x"}}},
        {"apiVersion": "gpu.resource.nvidia.com/v1alpha1", "kind": "GpuClaimParameters", "spec": {}},
        {"apiVersion": "example.com/v1", "kind": "ResourceClaim", "spec": {"devices": {"requests": []}}},
        {"apiVersion": "apps/v1", "kind": "Pod", "spec": {"resourceClaims": [{"name": "a", "resourceClaimName": "b"}]}},
        {"apiVersion": "v1", "kind": "Deployment", "spec": {"template": {"spec": {"resourceClaims": [{"name": "a"}]}}}},
        {"kind": "Pod", "spec": {"resourceClaims": [{"name": "a", "resourceClaimName": "b"}]}},
        {"apiVersion": "v1", "kind": "ConfigMap", "data": {"x": "y"}},
        {},
    ],
)
def test_unknown_kinds_and_versions_are_passed_over(policy, obj):
    assert validate(obj, policy, trusted=False) == []


def test_retain_on_a_v1alpha2_claim_with_gpu_requests_is_still_passed_over(dra, policy):
    obj = dra.claim("v1", annotations=RETAIN)
    obj["apiVersion"] = "resource.k8s.io/v1alpha2"
    assert validate(obj, policy, trusted=False) == []


@pytest.mark.parametrize("obj", [None, [], "Pod", 42, 1.5, True])
def test_non_objects_are_passed_over(policy, obj):
    assert validate(obj, policy, trusted=False) == []


# --- per-rule actions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["warn", "audit", "deny"])
def test_rule_action_from_policy(dra, action):
    custom = parse_policy({"rules": {"SG001": {"action": action}, "SG004": {"action": action}}})
    obj = dra.claim("v1", annotations=RETAIN)
    assert verdict(validate(obj, custom, trusted=False)) == [("SG001", action), ("SG004", action)]


def test_rule_action_off_removes_its_findings_only(dra):
    custom = parse_policy({"rules": {"SG003": {"action": "off"}}})
    obj = dra.carrier("Pod", dra.pod_spec(claim_name="shared", grace=None))
    assert verdict(validate(obj, custom, trusted=False)) == [("SG002", "deny")]
