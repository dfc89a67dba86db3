"""SG009: a DeviceClass that hands out a GPU driver's devices is one the policy knows, so that no GPU reaches a
claim under a class name that every guard passes over; in admission (CREATE and UPDATE) and in CI alike."""

from __future__ import annotations

from typing import Any

import pytest
from scrubgate.policies.config import parse_policy
from scrubgate.policies.engine import Admission, validate
from scrubgate.policies.rules import selected_drivers

ADMIN = ("system:masters",)


def device_class(name: str, expression: str | None, version: str = "v1", **spec: Any) -> dict[str, Any]:
    if expression is not None:
        spec["selectors"] = [{"cel": {"expression": expression}}]
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


def admitted(obj: dict[str, Any], policy, operation: str = "CREATE") -> list:
    old = obj if operation == "UPDATE" else None
    admission = Admission(operation, "driver-installer", ADMIN, old_object=old)  # admins are not exempt
    return validate(obj, policy, trusted=False, admission=admission)


H100 = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB'"


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1", "v1alpha3"])
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_a_gpu_model_class_under_an_unlisted_name_is_refused_naming_the_policy_field(policy, version, operation):
    (finding,) = admitted(device_class("h100-80gb", H100, version), policy, operation)
    assert (finding.rule, finding.action, finding.path) == ("SG009", "deny", "/spec/selectors/0/cel/expression")
    assert "'h100-80gb' selects devices of the GPU driver gpu.nvidia.com" in finding.message
    assert "add 'h100-80gb' to gpuDeviceClasses" in finding.message
    assert "excludeDeviceClasses" in finding.message


def test_the_same_class_is_reported_in_ci(policy):
    assert [(f.rule, f.action) for f in validate(device_class("h100-80gb", H100), policy, trusted=True)] == [
        ("SG009", "deny")
    ]


def test_listing_or_excluding_the_class_allows_it():
    listed = parse_policy({"gpuDeviceClasses": ["gpu.nvidia.com", "h100-*"]})
    excluded = parse_policy({"excludeDeviceClasses": ["h100-80gb"]})
    for policy in (listed, excluded):
        assert admitted(device_class("h100-80gb", H100), policy) == []


@pytest.mark.parametrize(
    ("name", "expression"),
    [
        ("gpu.nvidia.com", "device.driver == 'gpu.nvidia.com'"),
        ("mig-1g-12gb.gpu.nvidia.com", "device.driver == 'gpu.nvidia.com' && device.attributes['x'].type == 'mig'"),
        ("vfio.gpu.nvidia.com", "device.driver == 'gpu.nvidia.com' && device.attributes['x'].type == 'vfio'"),
        ("compute-domain-default-channel.nvidia.com", "device.driver == 'compute-domain.nvidia.com'"),
        ("nic.example.com", 'device.driver == "nic.example.com"'),
        ("fast-nic", "device.driver == 'nic.example.com' && device.attributes['nic.example.com'].speed >= 100"),
        ("all-but-gpus", "!(device.driver == 'gpu.nvidia.com')"),  # names the GPU driver, and selects none
        (
            "wide-nic",  # Kubernetes' quantity(): it compiles here; the driver rules GPUs out before it runs
            "device.driver == 'nic.example.com' && device.capacity['nic.example.com'].bw.compareTo(quantity('1')) >= 0",
        ),
    ],
)
def test_classes_the_policy_knows_and_other_drivers_pass(policy, name, expression):
    assert admitted(device_class(name, expression), policy) == []


@pytest.mark.parametrize(
    ("expression", "what"),
    [
        ("device.driver in ['gpu.nvidia.com', 'nic.example.com']", "gpu.nvidia.com devices"),
        ("('gpu.nvidia.com' == device.driver)", "gpu.nvidia.com devices"),
        ("device.driver == 'gpu\\x2envidia.com'", "gpu.nvidia.com devices"),  # an escaped dot
        ("device.driver.startsWith('gpu.')", "gpu.nvidia.com devices"),
        ("device.attributes['gpu.nvidia.com'].type == 'mig'", "gpu.nvidia.com MIG devices"),
        ("device.attributes['gpu.nvidia.com'].productName.contains('H100')", "by their attributes"),
        (None, "it has no selector"),
    ],
    ids=["in-list", "reversed-parenthesised", "escaped", "startsWith", "attributes-only", "by-model", "no-selector"],
)
def test_what_a_class_selects_decides_not_how_it_compares_the_driver(policy, expression, what):
    """The selectors are evaluated against the devices a GPU driver publishes: any way of writing it that
    picks GPUs makes it a GPU class, which the policy must know."""
    (finding,) = admitted(device_class("sneaky", expression), policy)
    assert (finding.rule, finding.action) == ("SG009", "deny")
    assert "selects devices of the GPU driver gpu.nvidia.com" in finding.message and what in finding.message


@pytest.mark.parametrize(
    "expression",
    [
        "device.attributes['example.com'].speed > 1",  # an attribute a GPU does not have: an error on it
        "semver('1.0.0').isGreaterThan(semver('0.1.0'))",  # Kubernetes' semver(), not evaluated here
    ],
)
def test_a_class_whose_selection_cannot_be_decided_is_refused(policy, expression):
    (finding,) = admitted(device_class("unclear", expression), policy)
    assert (finding.rule, finding.action) == ("SG009", "deny")
    assert "scrubgate cannot tell whether DeviceClass 'unclear' hands out GPUs" in finding.message
    assert "gpuDeviceClasses" in finding.message and "excludeDeviceClasses" in finding.message


@pytest.mark.parametrize(
    "expression",
    [
        'device.driver == "gpu.nvidia.com"',
        "device.driver=='gpu.nvidia.com'",
        "'gpu.nvidia.com' == device.driver && device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
    ],
)
def test_the_driver_is_read_from_either_side_and_quote(expression):
    assert selected_drivers(device_class("c", expression)) == [("gpu.nvidia.com", "/spec/selectors/0/cel/expression")]


def test_a_gpu_class_offered_as_an_unlisted_extended_resource_is_refused(policy):
    obj = device_class("gpu.nvidia.com", "device.driver == 'gpu.nvidia.com'", extendedResourceName="example.com/gpu")
    (finding,) = admitted(obj, policy)
    assert (finding.rule, finding.path) == ("SG009", "/spec/extendedResourceName")
    assert "add 'example.com/gpu' to gpuExtendedResources" in finding.message
    listed = device_class("mig-1g-12gb.gpu.nvidia.com", None, extendedResourceName="nvidia.com/mig-1g.12gb")
    assert admitted(listed, policy) == []
    other = device_class(
        "nic.example.com", "device.driver == 'nic.example.com'", extendedResourceName="example.com/nic"
    )
    assert admitted(other, policy) == []


def test_sg009_action_from_policy():
    off = parse_policy({"rules": {"SG009": {"action": "off"}}})
    assert admitted(device_class("h100-80gb", H100), off) == []
    warn = parse_policy({"rules": {"SG009": {"action": "warn"}}})
    assert [f.action for f in admitted(device_class("h100-80gb", H100), warn)] == ["warn"]
