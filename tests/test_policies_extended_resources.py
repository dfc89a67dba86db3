"""Extended-resource claims (KEP-5004, beta in 1.36): a pod that asks for `nvidia.com/gpu` or
`deviceclass.resource.kubernetes.io/<GPU class>` gets its claim from the scheduler and has no
spec.resourceClaims; it is a GPU pod all the same for SG003, SG005 and SG008."""

from __future__ import annotations

from typing import Any

import pytest
from scrubgate.policies import names
from scrubgate.policies.config import parse_policy
from scrubgate.policies.engine import Admission, DeviceClasses, validate

GPU_RESOURCES = ["nvidia.com/gpu", "nvidia.com/mig-1g.12gb", "deviceclass.resource.kubernetes.io/gpu.nvidia.com"]
FENCE = {"key": names.TAINT_UNSANITIZED, "operator": "Exists", "effect": "NoSchedule"}


def extended_spec(resource: str, *, section: str = "limits", init: bool = False, **fields: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "cuda", "resources": {section: {"cpu": "1", resource: 1}}}
    spec: dict[str, Any] = {"containers": [{"name": "side", "image": "busybox"}], **fields}
    if init:
        spec["initContainers"] = [container]
    else:
        spec["containers"].append(container)
    return spec


def rules(findings) -> list[tuple[str, str]]:
    return sorted((f.rule, f.action) for f in findings)


@pytest.mark.parametrize("resource", GPU_RESOURCES)
@pytest.mark.parametrize("section", ["limits", "requests"])
def test_a_gpu_extended_resource_makes_a_gpu_pod_in_every_carrier(dra, policy, carrier_kind, resource, section):
    obj = dra.carrier(carrier_kind, extended_spec(resource, section=section))
    (finding,) = validate(obj, policy, trusted=True)  # a manifest: the grace period is missing
    assert (finding.rule, finding.action) == ("SG003", "deny")
    assert finding.path == "/" + "/".join((*dra.spec_path(carrier_kind), "terminationGracePeriodSeconds"))


def test_an_init_container_counts_too(dra, policy):
    obj = dra.carrier("Pod", extended_spec("nvidia.com/gpu", init=True, terminationGracePeriodSeconds=5))
    assert rules(validate(obj, policy, trusted=True, admission=Admission("CREATE", "alice"))) == [("SG003", "deny")]


@pytest.mark.parametrize("resource", ["example.com/fpga", "hugepages-2Mi"])
def test_other_extended_resources_are_not_gpus(dra, policy, resource):
    obj = dra.carrier("Pod", extended_spec(resource, tolerations=[FENCE]))
    assert validate(obj, policy, trusted=False) == []


def test_a_class_asked_for_as_an_extended_resource_is_a_gpu_unless_proven_not(dra, policy):
    """`deviceclass.resource.kubernetes.io/<class>` and a class's own extendedResourceName: a GPU pod unless the
    class is known and its selectors prove it hands out no GPU."""
    nic = {
        "metadata": {"name": "nic.example.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'nic.example.com'"}}]},
    }
    h100 = {
        "metadata": {"name": "h100"},
        "spec": {
            "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].productName == 'H100'"}}],
            "extendedResourceName": "example.com/h100",
        },
    }
    known = DeviceClasses.of([nic, h100], ["gpu.nvidia.com"])
    implicit = dra.carrier(
        "Pod", extended_spec("deviceclass.resource.kubernetes.io/nic.example.com", tolerations=[FENCE])
    )
    assert validate(implicit, policy, trusted=False, classes=known) == []
    assert rules(validate(implicit, policy, trusted=False)) == [("SG003", "deny"), ("SG005", "deny")]  # unknown: GPU
    named = dra.carrier("Pod", extended_spec("example.com/h100", tolerations=[FENCE]))
    assert rules(validate(named, policy, trusted=False, classes=known)) == [("SG003", "deny"), ("SG005", "deny")]


def test_the_policy_names_the_gpu_extended_resources(dra):
    custom = parse_policy({"gpuExtendedResources": ["example.com/gpu"]})
    assert rules(validate(dra.carrier("Pod", extended_spec("example.com/gpu")), custom, trusted=True)) == [
        ("SG003", "deny")
    ]
    assert validate(dra.carrier("Pod", extended_spec("nvidia.com/gpu")), custom, trusted=True) == []


@pytest.mark.parametrize("resource", GPU_RESOURCES)
def test_fence_tolerations_of_an_extended_resource_pod_are_refused(dra, policy, resource):
    obj = dra.carrier("Pod", extended_spec(resource, terminationGracePeriodSeconds=60, tolerations=[FENCE]))
    (finding,) = validate(obj, policy, trusted=True, admission=Admission("CREATE", "alice"))
    assert (finding.rule, finding.path) == ("SG005", "/spec/tolerations/0")


def running(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "team-a", "name": "p", "uid": "u"},
        "spec": {**spec, "nodeName": "node-a"},
        "status": {"phase": "Running", "extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-x"}},
    }


@pytest.mark.parametrize("resource", GPU_RESOURCES)
def test_force_delete_of_an_extended_resource_pod_is_refused(policy, resource):
    pod = running(extended_spec(resource, terminationGracePeriodSeconds=60))
    options = {"gracePeriodSeconds": 0}
    found = validate(None, policy, trusted=False, admission=Admission("DELETE", "alice", ("team",), pod, options))
    assert rules(found) == [("SG008", "deny")]
    admin = Admission("DELETE", "oncall", ("system:masters",), pod, options)
    assert validate(None, policy, trusted=False, admission=admin) == []
    fpga = running(extended_spec("example.com/fpga"))
    assert validate(None, policy, trusted=False, admission=Admission("DELETE", "alice", (), fpga, options)) == []
