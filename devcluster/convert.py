"""Conversion between the served API versions and the storage ("hub") version.

Only resource.k8s.io has more than one version. What differs between them (kubernetes/api
``resource/v1*/types.go``):

- device requests: ``v1``/``v1beta2`` nest the request under ``exactly: {...}`` or
  ``firstAvailable: [...]``; ``v1beta1``/``v1alpha3`` put ``deviceClassName``, ``selectors``,
  ``allocationMode``, ``count``, ``adminAccess``, ``tolerations`` directly on the request;
- ResourceSlice devices: ``v1``/``v1beta2`` are flat; ``v1beta1``/``v1alpha3`` wrap the fields in
  ``basic: {...}``, and ``v1alpha3`` capacities are bare quantities instead of ``{value: ...}``.

Everything else (status, allocation results, DeviceClass, DeviceTaintRule) has the same shape.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from .resources import HUB_VERSION, RESOURCE_GROUP, ResourceType

FLAT_REQUEST_VERSIONS = frozenset({"v1beta1", "v1alpha3"})


def to_hub(rt: ResourceType, version: str, obj: dict) -> dict:
    """A copy of ``obj`` (in ``version``) in the storage version."""
    out = copy.deepcopy(obj)
    if rt.group == RESOURCE_GROUP:
        out["apiVersion"] = rt.api_version(HUB_VERSION)
        if version in FLAT_REQUEST_VERSIONS:
            _convert(rt, out, _request_from_flat, _device_from_basic(version))
    return out


def from_hub(rt: ResourceType, version: str, obj: dict) -> dict:
    """A copy of a stored object as a client of ``version`` sees it."""
    out = copy.deepcopy(obj)
    out["apiVersion"] = rt.api_version(version)
    out["kind"] = rt.kind
    if rt.group == RESOURCE_GROUP and version in FLAT_REQUEST_VERSIONS:
        _convert(rt, out, _request_to_flat, _device_to_basic(version))
    return out


def hub_version(rt: ResourceType) -> str:
    return HUB_VERSION if rt.group == RESOURCE_GROUP else rt.versions[0]


def _convert(rt: ResourceType, obj: dict, request: Callable[[dict], dict], device: Callable[[dict], dict]) -> None:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    if rt.plural == "resourceclaims":
        _map_list(spec.get("devices"), "requests", request)
    elif rt.plural == "resourceclaimtemplates":
        inner = spec.get("spec")
        if isinstance(inner, dict):
            _map_list(inner.get("devices"), "requests", request)
    elif rt.plural == "resourceslices":
        _map_list(spec, "devices", device)


def _map_list(parent: object, key: str, fn: Callable[[dict], dict]) -> None:
    if isinstance(parent, dict) and isinstance(parent.get(key), list):
        parent[key] = [fn(item) if isinstance(item, dict) else item for item in parent[key]]


def _request_to_flat(request: dict) -> dict:
    flat = {k: v for k, v in request.items() if k != "exactly"}
    exactly = request.get("exactly")
    if isinstance(exactly, dict):
        flat.update(exactly)
    return flat


def _request_from_flat(request: dict) -> dict:
    nested: dict = {}
    exactly: dict = {}
    for key, value in request.items():
        if key in ("name", "firstAvailable"):
            nested[key] = value
        else:
            exactly[key] = value
    # A flat request that names neither sub-requests nor anything else is still an exact request;
    # fields next to firstAvailable end up in `exactly` so that validation rejects the mix.
    if exactly or "firstAvailable" not in nested:
        nested["exactly"] = exactly
    return nested


def _device_to_basic(version: str) -> Callable[[dict], dict]:
    def convert(device: dict) -> dict:
        basic = {k: v for k, v in device.items() if k != "name"}
        if version == "v1alpha3" and isinstance(basic.get("capacity"), dict):
            basic["capacity"] = {k: v.get("value") if isinstance(v, dict) else v for k, v in basic["capacity"].items()}
        out = {"name": device.get("name")}
        if basic:
            out["basic"] = basic
        return out

    return convert


def _device_from_basic(version: str) -> Callable[[dict], dict]:
    def convert(device: dict) -> dict:
        out = {"name": device.get("name")}
        basic = device.get("basic")
        if isinstance(basic, dict):
            out.update(basic)
        if version == "v1alpha3" and isinstance(out.get("capacity"), dict):
            out["capacity"] = {k: v if isinstance(v, dict) else {"value": v} for k, v in out["capacity"].items()}
        return out

    return convert
