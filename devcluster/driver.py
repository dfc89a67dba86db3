"""An NVIDIA-like DRA driver over the simulated GPU backend, as a client of the real API server: it publishes
the node's devices as ResourceSlices (driver ``gpu.nvidia.com``, pool = node name) and prepares/unprepares
claims for the kubelet stand-in.

Devices are named as NVIDIA's driver names them: ``gpu-<index>`` for full GPUs and ``gpu-<index>-mig-<n>``
for MIG slices, with attributes ``type`` (``gpu``/``mig``), ``uuid``, ``parentUUID`` (MIG), ``index``,
``productName`` and a ``memory`` capacity. A GPU and its MIG slices consume the same ``memory-slice-<n>`` (NVIDIA's names)
counters, so the scheduler never hands out a GPU and one of its slices at once; the counter sets go in a
ResourceSlice of their own in the same pool from 1.35 (which refuses ``sharedCounters`` beside ``devices``),
beside the devices on 1.34 (which wants them there).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence

from kubernetes.client.exceptions import ApiException
from scrubgate.sanitizer_agent.gpu.base import GpuBackend, GpuDevice

from .rest import Rest, status_message

log = logging.getLogger("devcluster.driver")

DRIVER = "gpu.nvidia.com"
DRIVER_NAMESPACE = "nvidia-dra-driver-gpu"
DRIVER_SERVICE_ACCOUNT = "nvidia-dra-driver-gpu-kubelet-plugin"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"

# What the driver's ServiceAccount may do (NVIDIA's chart grants its kubelet plugin about as much).
DRIVER_RULES = [
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
]


def device_classes() -> list[dict]:
    """The DeviceClasses NVIDIA's chart installs for GPUs and MIG slices (``gpu.nvidia.com`` also backs the
    extended resource ``nvidia.com/gpu``, as the chart sets it)."""
    return [
        _device_class("gpu.nvidia.com", "gpu", extended_resource="nvidia.com/gpu"),
        _device_class("mig.nvidia.com", "mig"),
    ]


def _device_class(name: str, device_type: str, extended_resource: str | None = None) -> dict:
    expression = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{device_type}"'
    spec: dict = {"selectors": [{"cel": {"expression": expression}}]}
    if extended_resource:
        spec["extendedResourceName"] = extended_resource
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


def device_names(devices: Sequence[GpuDevice]) -> dict[str, str]:
    """uuid -> device name in the slice."""
    gpus = {d.uuid: d for d in devices if d.parent_uuid is None}
    names = {uuid: f"gpu-{d.index}" for uuid, d in gpus.items()}
    for d in devices:
        if d.parent_uuid is not None:
            # The MIG index, not a position: a slice that drops out must not rename the others.
            names[d.uuid] = f"{names.get(d.parent_uuid, f'gpu-{d.parent_uuid}')}-mig-{d.index}"
    return names


def resource_slices(
    node: str, devices: Sequence[GpuDevice], generation: int = 1, *, counters_apart: bool = True
) -> list[dict]:
    """The pool of ``node``: its devices and, when there are MIG slices, the counter sets they share with their
    parent GPU: in a slice of their own (``counters_apart``, Kubernetes 1.35+, which refuses both in one
    slice), or, on 1.34, which wants a counter set in the slice that uses it and at most 32 counters in a slice,
    one slice per GPU with its MIG slices and its counter set (as NVIDIA's driver publishes)."""
    names = device_names(devices)
    children: dict[str, list[GpuDevice]] = defaultdict(list)
    for d in devices:
        if d.parent_uuid is not None:
            children[d.parent_uuid].append(d)
    slice_devices: list[dict] = []
    counter_sets: list[dict] = []
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
            counter_set = f"{names.get(d.parent_uuid or '', '')}-counter-set"
            entry["consumesCounters"] = [
                {"counterSet": counter_set, "counters": {f"memory-slice-{d.index}": {"value": "1"}}}
            ]
        elif children.get(d.uuid):
            counters = {f"memory-slice-{m.index}": {"value": "1"} for m in children[d.uuid]}
            counter_sets.append({"name": f"{names[d.uuid]}-counter-set", "counters": counters})
            entry["consumesCounters"] = [{"counterSet": f"{names[d.uuid]}-counter-set", "counters": counters}]
        slice_devices.append(entry)
    if not counter_sets:
        groups = {"": slice_devices}
    elif counters_apart:
        groups = {"": slice_devices, "counters": counter_sets}
    else:  # a slice per GPU, its counter set beside its devices (1.34 allows 32 counters in a slice)
        groups = {}
        for entry in slice_devices:
            gpu = entry["name"].split("-mig-")[0]
            groups.setdefault(gpu, []).append(entry)
    pool = {"name": node, "generation": generation, "resourceSliceCount": len(groups)}
    slices = []
    for suffix, items in groups.items():
        spec: dict = {"driver": DRIVER, "nodeName": node, "pool": pool}
        if suffix == "counters":
            spec["sharedCounters"] = items
        else:
            spec["devices"] = items
            used = {c["counterSet"] for e in items for c in e.get("consumesCounters") or []}
            if not counters_apart and used:
                spec["sharedCounters"] = [c for c in counter_sets if c["name"] in used]
        slices.append(_slice(f"{node}-{DRIVER}" + (f"-{suffix}" if suffix else ""), spec))
    return slices


def _slice(name: str, spec: dict) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


class Driver:
    """Keeps the node's slices current (``sync``, called by the node's loop) and prepares claims."""

    def __init__(self, rest: Rest, node: str, backend: GpuBackend) -> None:
        self.rest = rest
        self.node = node
        self.backend = backend
        self._lock = threading.Lock()
        self._prepared: dict[str, list[str]] = {}  # claim uid -> device UUIDs
        self._counters_apart: bool | None = None

    def _slices(self, generation: int) -> list[dict]:
        if self._counters_apart is None:
            version = self.rest.request("GET", "/version")
            self._counters_apart = (int(version["major"]), int(version["minor"].rstrip("+"))) >= (1, 35)
        return resource_slices(self.node, self.backend.list_devices(), generation, counters_apart=self._counters_apart)

    def sync(self) -> None:
        listed = self.rest.request("GET", SLICES_PATH, query=[("fieldSelector", f"spec.nodeName={self.node}")])
        current = {s["metadata"]["name"]: s for s in listed.get("items") or []}
        generation = max((int(s["spec"]["pool"].get("generation") or 1) for s in current.values()), default=1)
        wanted = self._slices(generation)
        if {name: s["spec"] for name, s in current.items()} == {w["metadata"]["name"]: w["spec"] for w in wanted}:
            return
        if current:  # a new generation replaces the whole pool
            wanted = self._slices(generation + 1)
        for obj in wanted:
            name = obj["metadata"]["name"]
            try:
                if name in current:
                    obj["metadata"]["resourceVersion"] = current[name]["metadata"]["resourceVersion"]
                    self.rest.request("PUT", f"{SLICES_PATH}/{name}", obj)
                else:
                    self.rest.request("POST", SLICES_PATH, obj)
            except ApiException as exc:
                log.warning(
                    "driver on %s: publishing ResourceSlice %s failed: %s", self.node, name, status_message(exc)
                )
        for name in set(current) - {w["metadata"]["name"] for w in wanted}:
            self.rest.request("DELETE", f"{SLICES_PATH}/{name}")

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
