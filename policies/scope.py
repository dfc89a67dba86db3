"""What may hold a tenant's GPU memory: the policy, and the DeviceClasses a decision knows.

One invariant: **a claim is guarded unless its class is proven unable to hand out a GPU.** A class is proven so by
its own selectors (policies/selectors.py); a class the decision does not know (not created yet, not among the
manifests checked, not yet seen by the webhook's watch) is not, so it is guarded. The operator's list of classes
left out (`excludeDeviceClasses`) holds only where the selectors agree: a known excluded class is left out only
when its selectors prove it selects no `gpu` or `mig` device of a GPU driver (SG009 refuses to create one that
does not); `gpuDeviceClasses` only adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import names
from .attestation import allocation_results, device_key
from .config import PolicyConfig
from .model import DeviceRequest, PodSpecRef, as_list, as_str, device_requests, extended_resources
from .selectors import UNKNOWN, DeviceClasses


@dataclass(frozen=True, slots=True)
class Scope:
    policy: PolicyConfig
    classes: DeviceClasses = UNKNOWN

    def is_gpu_class(self, name: str) -> bool:
        """Whether a request naming class `name` may be allocated a device of a GPU driver."""
        if self.is_unguarded_class(name):
            return False
        return self.classes.may_hand_out_gpus(name) or self.policy.names_gpu_class(name)

    def is_unguarded_class(self, name: str) -> bool:
        """An excluded class (an IMEX channel, a GPU bound to vfio-pci: no agent scrubs its devices, so a guard on
        them would never be lifted), unless it is known and its selectors do not prove it hands out no GPU memory.
        An excluded name no class has yet is taken at the operator's word: no device comes through a class that
        does not exist, and SG009 refuses to create one under that name that may hand out GPU memory."""
        if not self.policy.is_excluded_class(name):
            return False
        known = self.classes.verdicts.get(name)
        return known is None or not known.gpu_memory

    def is_gpu_extended_resource(self, resource: str) -> bool:
        """An extended resource whose claim (KEP-5004) may hold a GPU: one of the policy's gpuExtendedResources,
        `deviceclass.resource.kubernetes.io/<class>` of a GPU class, or the `extendedResourceName` of one."""
        if resource.startswith(names.IMPLICIT_EXTENDED_RESOURCE_PREFIX):
            return self.is_gpu_class(resource[len(names.IMPLICIT_EXTENDED_RESOURCE_PREFIX) :])
        if self.policy.names_gpu_extended_resource(resource):
            return True
        return any(self.is_gpu_class(name) for name in self.classes.by_extended_resource(resource))


def gpu_requests(obj: dict[str, Any], scope: Scope) -> list[DeviceRequest]:
    """Requests that may be satisfied by a GPU class: the claim is in scope if there is any."""
    return [r for r in device_requests(obj) if any(scope.is_gpu_class(c) for c in r.device_classes())]


def _result_classes(obj: dict[str, Any]) -> dict[str, str]:
    """Device class by the name an allocation result gives its request: `request`, or `request/subrequest`."""
    classes: dict[str, str] = {}
    for request in device_requests(obj):
        for choice in request.choices:
            if not choice.device_class:
                continue
            if choice.path[len(request.path) : len(request.path) + 1] == ("firstAvailable",):
                classes[f"{request.name}/{as_str(choice.fields.get('name'))}"] = choice.device_class
            else:
                classes[request.name] = choice.device_class
    return classes


def guarded_devices(claim: dict[str, Any], scope: Scope) -> set[tuple[str, str, str]]:
    """The allocated devices that may hold a tenant's GPU memory, known from what was allocated, never from a
    class's name: every device of one of the policy's GPU drivers, unless its request used an excluded class
    proven to hand out no GPU memory (an IMEX channel, a GPU bound to vfio-pci), which no agent scrubs. A device
    of another driver holds no GPU memory an agent could scrub. A result of a request the spec does not have is
    guarded too (fail closed)."""
    classes = _result_classes(claim)
    found = set()
    for result in allocation_results(claim):
        if as_str(result.get("driver")) not in scope.policy.gpu_drivers:
            continue
        device_class = classes.get(as_str(result.get("request")), "")
        if device_class and scope.is_unguarded_class(device_class):
            continue
        found.add(device_key(result))
    return found


def gpu_extended_resources(ref: PodSpecRef, scope: Scope) -> list[str]:
    """The extended resources of a pod spec that stand for GPUs (KEP-5004: the scheduler creates their claim,
    named only in the pod's status; the pod has no spec.resourceClaims)."""
    return [r.name for r in extended_resources(ref) if scope.is_gpu_extended_resource(r.name)]


def is_gpu_pod(ref: PodSpecRef, scope: Scope) -> bool:
    """A pod spec that may hold a GPU claim: DRA claims of its own, or a GPU extended resource."""
    return bool(as_list(ref.spec.get("resourceClaims"))) or bool(gpu_extended_resources(ref, scope))
