"""A claim is guarded unless its class is proven unable to hand out a GPU (policies/scope.py, selectors.py).

The classes below are the ones review rounds got past the guard with when classes were judged by name or by
sampling their selectors: each is a GPU class now, so its claims get the finalizer and its pods count as GPU pods,
however it is written. Classes that prove their driver pass, however else they are written. SG009 is left with
two refusals: an excluded class that does not prove it hands out no GPU memory, and a GPU class offered as an
extended resource the policy does not list.
"""

from __future__ import annotations

from typing import Any

import pytest
from scrubgate.policies.config import parse_policy
from scrubgate.policies.engine import Admission, DeviceClasses, default, validate
from scrubgate.policies.selectors import class_verdict

ADMIN = ("system:masters",)
GPU_DRIVERS = ("gpu.nvidia.com",)


def device_class(name: str, expression: str | None, version: str = "v1", **spec: Any) -> dict[str, Any]:
    if expression is not None:
        spec["selectors"] = [{"cel": {"expression": expression}}]
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


def admitted(obj: dict[str, Any], policy, operation: str = "CREATE") -> list:
    old = obj if operation == "UPDATE" else None
    admission = Admission(operation, "driver-installer", ADMIN, old_object=old)  # admins are not exempt
    return validate(obj, policy, trusted=False, admission=admission)


def claim(device_class_name: str, **request: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a"},
        "spec": {
            "devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": device_class_name, **request}}]}
        },
    }


# Classes a platform admin might well write, each of which picks NVIDIA GPUs (issue 28's construction).
GPU_CLASSES = {
    "by-model": "device.driver in device.attributes && has(device.attributes[device.driver].productName)"
    " && device.attributes[device.driver].productName == 'NVIDIA H100 80GB HBM3'",
    "shared-gpus": "device.driver == 'gpu.nvidia.com' && has(device.allowMultipleAllocations)",
    "by-pcie-root": "has(device.attributes['resource.kubernetes.io'].pcieRoot)",
    "in-list": "device.driver in ['gpu.nvidia.com', 'nic.example.com']",
    "reversed": "('gpu.nvidia.com' == device.driver)",
    "escaped-dot": "device.driver == 'gpu\\x2envidia.com'",
    "octal-escape": 'device.driver == "gpu\\056nvidia.com"',
    "raw-string": "device.driver == r'gpu.nvidia.com'",
    "starts-with": "device.driver.startsWith('gpu.')",
    "negated-nic": "!(device.driver == 'nic.example.com')",
    "either": "device.driver == 'nic.example.com' || device.driver == 'gpu.nvidia.com'",
    "ternary": "device.driver == 'x' ? false : true",
    "comment": "device.driver == 'gpu.nvidia.com' // && device.driver == 'nic.example.com'",
    "in-a-string": "device.attributes['example.com'].note == \"a && device.driver == 'nic.example.com'\" || true",
    "mig-type-only": "device.attributes['gpu.nvidia.com'].type == 'mig'",
    "optional-driver": "device.?driver.orValue('') == 'gpu.nvidia.com'",
}


@pytest.mark.parametrize("name", sorted(GPU_CLASSES))
def test_a_class_not_proven_unable_to_hand_out_gpus_is_a_gpu_class(policy, name):
    """Not refused (nothing about it needs the operator), but guarded: its claims get the finalizer, and
    admin access in them is refused in a multi-tenant namespace."""
    obj = device_class(name, GPU_CLASSES[name])
    assert admitted(obj, policy) == []
    classes = DeviceClasses.of([obj], GPU_DRIVERS)
    assert [f.rule for f in default(claim(name), policy, classes=classes)] == ["SG004"]
    found = validate(claim(name, adminAccess=True), policy, trusted=False, classes=classes)
    assert "SG006" in {f.rule for f in found}


def test_a_class_without_selectors_selects_everything(policy):
    verdict = class_verdict(device_class("anything", None), GPU_DRIVERS)
    assert verdict.gpu and verdict.gpu_memory
    assert "no selector restricts device.driver" in verdict.why


# Other vendors' classes prove their driver, as NVIDIA's own classes do, however else they are written.
OTHER_CLASSES = {
    "nic.example.com": 'device.driver == "nic.example.com"',
    "fast-nic": "device.driver == 'nic.example.com' && device.attributes['nic.example.com'].speed >= 100",
    "wide-nic": "device.driver == 'nic.example.com'"
    " && device.capacity['nic.example.com'].bw.compareTo(quantity('1Gi')) >= 0",
    "string-ext": "'nic.example.com' == device.driver"
    " && device.attributes['nic.example.com'].model.lowerAscii().matches('^cx[67]$')",
    "optional": "device.driver == 'nic.example.com' && device.attributes['nic.example.com'].?vf.orValue(false)",
    "comprehension": "device.driver in ['fpga.example.com', 'nic.example.com']"
    " && ['a', 'b'].exists(x, device.attributes['fpga.example.com'].region == x)",
    "second-selector": None,  # the proof is in its second selector (below)
    "multi-line": "device.driver == 'tpu.example.com'\n  && // the model\n  device.attributes['tpu.example.com'].gen > 4",
    "compute-domain-default-channel.nvidia.com": "device.driver == 'compute-domain.nvidia.com'"
    " && device.attributes['compute-domain.nvidia.com'].type == 'channel'"
    " && device.attributes['compute-domain.nvidia.com'].id == 0",
}


@pytest.mark.parametrize("name", sorted(OTHER_CLASSES))
def test_a_class_that_proves_its_driver_passes_and_guards_nothing(policy, name):
    if OTHER_CLASSES[name] is None:
        obj = device_class(name, None)
        obj["spec"]["selectors"] = [
            {"cel": {"expression": "semver(device.attributes['x.example.com'].fw).isGreaterThan(semver('1.0.0'))"}},
            {"cel": {"expression": "device.driver == 'x.example.com'"}},
        ]
    else:
        obj = device_class(name, OTHER_CLASSES[name])
    assert admitted(obj, policy) == []
    classes = DeviceClasses.of([obj], GPU_DRIVERS)
    assert not class_verdict(obj, GPU_DRIVERS).gpu
    assert default(claim(name), policy, classes=classes) == []


def test_an_unknown_class_is_a_gpu_class(policy):
    """A claim naming a class the decision does not know (not created yet, not in the manifests) is guarded."""
    assert [f.rule for f in default(claim("nic.example.com"), policy)] == ["SG004"]


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1", "v1alpha3"])
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_an_excluded_name_that_may_hand_out_gpu_memory_is_refused(policy, version, operation):
    """The policy's excluded names (no guard, no webhook) are evaluated too: a class named imex.nvidia.com that
    selects GPUs would otherwise take GPU claims past every guard."""
    obj = device_class("imex.nvidia.com", GPU_CLASSES["by-model"], version)
    (finding,) = admitted(obj, policy, operation)
    assert (finding.rule, finding.action, finding.path) == ("SG009", "deny", "/spec/selectors")
    assert "excludeDeviceClasses" in finding.message and "device.driver" in finding.message
    # ... and, known to the webhook, its claims are guarded all the same.
    classes = DeviceClasses.of([obj], GPU_DRIVERS)
    assert [f.rule for f in default(claim("imex.nvidia.com"), policy, classes=classes)] == ["SG004"]


@pytest.mark.parametrize(
    ("name", "expression"),
    [
        (
            "vfio.gpu.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'",
        ),
        (
            "vfio.gpu.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.attributes[device.driver]['type'] == 'vfio'",
        ),
        ("imex.nvidia.com", "device.driver == 'imex.nvidia.com'"),
        (
            "compute-domain-daemon.nvidia.com",
            "device.driver == 'compute-domain.nvidia.com' && device.attributes['compute-domain.nvidia.com'].type == 'daemon'",
        ),
    ],
)
def test_nvidias_excluded_classes_prove_they_hand_out_no_gpu_memory(policy, name, expression):
    """NVIDIA's own classes (deployments/helm/.../templates/deviceclass-*.yaml of its DRA driver)."""
    obj = device_class(name, expression)
    assert admitted(obj, policy) == []
    classes = DeviceClasses.of([obj], GPU_DRIVERS)
    assert default(claim(name), policy, classes=classes) == []


def test_an_excluded_gpu_driver_class_must_prove_its_type(policy):
    obj = device_class("vfio.gpu.nvidia.com", "device.driver == 'gpu.nvidia.com'")
    (finding,) = admitted(obj, policy)
    assert finding.rule == "SG009" and "gpu.nvidia.com" in finding.message
    with_mig = device_class(
        "vfio.gpu.nvidia.com",
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type in ['vfio', 'mig']",
    )
    assert [f.rule for f in admitted(with_mig, policy)] == ["SG009"]


def test_a_gpu_class_offered_as_an_unlisted_extended_resource_is_refused(policy):
    obj = device_class("gpu.nvidia.com", "device.driver == 'gpu.nvidia.com'", extendedResourceName="example.com/gpu")
    (finding,) = admitted(obj, policy)
    assert (finding.rule, finding.path) == ("SG009", "/spec/extendedResourceName")
    assert "add 'example.com/gpu' to gpuExtendedResources" in finding.message
    sneaky = device_class("h100", GPU_CLASSES["by-model"], extendedResourceName="example.com/h100")
    assert [f.path for f in admitted(sneaky, policy)] == ["/spec/extendedResourceName"]
    listed = device_class("mig-1g-12gb.gpu.nvidia.com", None, extendedResourceName="nvidia.com/mig-1g.12gb")
    assert admitted(listed, policy) == []
    other = device_class(
        "nic.example.com", "device.driver == 'nic.example.com'", extendedResourceName="example.com/nic"
    )
    assert admitted(other, policy) == []


def test_sg009_action_from_policy():
    obj = device_class("imex.nvidia.com", GPU_CLASSES["by-model"])
    assert admitted(obj, parse_policy({"rules": {"SG009": {"action": "off"}}})) == []
    warn = parse_policy({"rules": {"SG009": {"action": "warn"}}})
    assert [f.action for f in admitted(obj, warn)] == ["warn"]
