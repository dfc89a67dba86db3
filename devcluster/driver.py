"""An NVIDIA-like DRA driver over the simulated GPU backend: it publishes one ResourceSlice per node
(driver ``gpu.nvidia.com``, pool = node name) and prepares/unprepares claims for the kubelet.

Devices are named as NVIDIA's driver names them: ``gpu-<index>`` for full GPUs and
``gpu-<index>-mig-<n>`` for MIG slices, with attributes ``type`` (``gpu``/``mig``), ``uuid``,
``parentUUID`` (MIG), ``index``, ``productName`` and a ``memory`` capacity. A GPU and its MIG
slices consume the same ``memorySlice<n>`` counters, so the scheduler never hands out a GPU and
one of its slices at once.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence

from scrubgate.sanitizer_agent.gpu.base import GpuBackend, GpuDevice

from .api import Api
from .auth import service_account
from .resources import DEVICE_CLASSES, SLICES
from .worker import Worker

log = logging.getLogger("devcluster.driver")

DRIVER = "gpu.nvidia.com"
DRIVER_USER = service_account("nvidia-dra-driver", "kubelet-plugin")


def device_classes() -> list[dict]:
    """The DeviceClasses NVIDIA's driver installs, in storage form."""
    return [_device_class("gpu.nvidia.com", "gpu"), _device_class("mig.nvidia.com", "mig")]


def _device_class(name: str, device_type: str) -> dict:
    expression = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{device_type}"'
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def device_names(devices: Sequence[GpuDevice]) -> dict[str, str]:
    """uuid -> device name in the slice."""
    gpus = {d.uuid: d for d in devices if d.parent_uuid is None}
    names = {uuid: f"gpu-{d.index}" for uuid, d in gpus.items()}
    children: dict[str, list[GpuDevice]] = defaultdict(list)
    for d in devices:
        if d.parent_uuid is not None:
            children[d.parent_uuid].append(d)
    for parent, migs in children.items():
        prefix = names.get(parent, f"gpu-{parent}")
        for mig in migs:
            # The MIG index, not a position: a slice that drops out must not rename the others.
            names[mig.uuid] = f"{prefix}-mig-{mig.index}"
    return names


def resource_slice(node: str, devices: Sequence[GpuDevice], generation: int = 1) -> dict:
    names = device_names(devices)
    children: dict[str, list[GpuDevice]] = defaultdict(list)
    for d in devices:
        if d.parent_uuid is not None:
            children[d.parent_uuid].append(d)
    slice_devices: list[dict] = []
    shared: list[dict] = []
    for d in sorted(devices, key=lambda x: names[x.uuid]):
        attributes: dict = {
            "type": {"string": "mig" if d.is_mig else "gpu"},
            "uuid": {"string": d.uuid},
            "index": {"int": d.index},
            "productName": {"string": d.name},
        }
        entry: dict = {
            "name": names[d.uuid],
            "attributes": attributes,
            "capacity": {"memory": {"value": str(d.memory_total)}},
        }
        if d.is_mig:
            attributes["parentUUID"] = {"string": d.parent_uuid}
            parent_name = names.get(d.parent_uuid or "", "")
            entry["consumesCounters"] = [
                {"counterSet": f"{parent_name}-counters", "counters": {f"memorySlice{d.index}": {"value": "1"}}}
            ]
        elif children.get(d.uuid):
            counters = {f"memorySlice{m.index}": {"value": "1"} for m in children[d.uuid]}
            shared.append({"name": f"{names[d.uuid]}-counters", "counters": counters})
            entry["consumesCounters"] = [{"counterSet": f"{names[d.uuid]}-counters", "counters": counters}]
        slice_devices.append(entry)
    spec: dict = {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "devices": slice_devices,
    }
    if shared:
        spec["sharedCounters"] = shared
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": spec,
    }


class Driver(Worker):
    """Publishes the node's slice (and the device classes) and keeps it current; prepares claims."""

    name = "dra-driver"
    wakes_on_change = False  # what it publishes comes from the GPUs: a look every interval_s

    def __init__(self, api: Api, node: str, backend: GpuBackend, interval_s: float = 2.0) -> None:
        super().__init__(api, DRIVER_USER, interval_s)
        self.node = node
        self.backend = backend
        self._lock = threading.Lock()
        self._prepared: dict[str, list[str]] = {}  # claim uid -> device UUIDs

    def sync(self) -> None:
        for device_class in device_classes():
            if (
                self.api.store.get((DEVICE_CLASSES.group, DEVICE_CLASSES.plural, "", device_class["metadata"]["name"]))
                is None
            ):
                self.create(DEVICE_CLASSES, device_class)
        devices = self.backend.list_devices()
        current = self.api.store.get((SLICES.group, SLICES.plural, "", f"{self.node}-{DRIVER}"))
        if current is None:
            self.create(SLICES, resource_slice(self.node, devices))
            return
        generation = int(current["spec"]["pool"].get("generation") or 1)
        wanted = resource_slice(self.node, devices, generation)
        if wanted["spec"] != current["spec"]:
            wanted = resource_slice(self.node, devices, generation + 1)
            current["spec"] = wanted["spec"]
            self.update(SLICES, current)

    def uuids(self, results: list[dict]) -> list[str]:
        """Device UUIDs of allocation results that name this node's pool."""
        by_name = {name: uuid for uuid, name in device_names(self.backend.list_devices()).items()}
        return [
            by_name[r["device"]]
            for r in results
            if r.get("driver") == DRIVER and r.get("pool") == self.node and r.get("device") in by_name
        ]

    def prepare(self, claim: dict) -> list[str]:
        """NodePrepareResources: the UUIDs the claim's containers get (CDI devices, in the real driver)."""
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
        uuids = self.uuids(results)
        with self._lock:
            self._prepared[claim["metadata"]["uid"]] = uuids
        return uuids

    def unprepare(self, claim_uid: str) -> None:
        """NodeUnprepareResources. Like NVIDIA's driver: no memory scrub here."""
        with self._lock:
            self._prepared.pop(claim_uid, None)

    def prepared(self) -> dict[str, list[str]]:
        with self._lock:
            return dict(self._prepared)
