"""Partitionable devices (KEP-4815) as NVIDIA's DRA driver publishes them for dynamic MIG.

Each GPU gets one shared counter set in its ResourceSlice, with a counter `memory-slice-<i>` (capacity 1)
per memory slice. The full GPU consumes every memory slice; a MIG device that does not exist yet is
published as `gpu-<minor>-mig-<profile>-<GI profile ID>-<placement start>` with its parent's `parentUUID`
attribute, no `uuid`, and consumes the memory slices `start .. start+size-1` of its placement. The driver
creates the MIG device on prepare and deletes it on unprepare.

So two devices share memory exactly when they consume a common memory-slice counter of the same counter
set, and a released dynamic MIG device is scrubbed through its placement (`MigPlacement`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .checkpoint import DeviceRecord
from .gpu.base import GpuBackend, GpuProcess, HealthSnapshot, MigPlacement, ScrubResult

_MEMORY_SLICE = re.compile(r"^memory-slice-(\d+)$")
_DYNAMIC_MIG = re.compile(r"^gpu-\d+-mig-.+-(\d+)-(\d+)$")


@dataclass(frozen=True)
class Partition:
    """The memory a partitionable device consumes: memory slices of one counter set (one GPU)."""

    counter_set: str
    memory_slices: frozenset[int]

    def overlaps(self, other: Partition | None) -> bool:
        return (
            other is not None
            and other.counter_set == self.counter_set
            and bool(self.memory_slices & other.memory_slices)
        )


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def partition_of(device: dict[str, Any]) -> Partition | None:
    """The memory slices a ResourceSlice device consumes (v1/v1beta2 on the device, v1beta1 under `basic`);
    None for a device that consumes none."""
    consumptions = device.get("consumesCounters") or _dict(device.get("basic")).get("consumesCounters")
    for consumption in consumptions if isinstance(consumptions, list) else []:
        counters = _dict(_dict(consumption).get("counters"))
        found = {int(m.group(1)) for name in counters if (m := _MEMORY_SLICE.match(str(name)))}
        counter_set = _dict(consumption).get("counterSet")
        if found and isinstance(counter_set, str):
            return Partition(counter_set, frozenset(found))
    return None


def placement_of(name: str, parent_uuid: str | None, partition: Partition | None) -> MigPlacement | None:
    """The placement of a dynamic MIG device (named by the driver's convention, with a parent and
    contiguous memory slices starting at the placement start in its name); None for anything else."""
    match = _DYNAMIC_MIG.match(name)
    if match is None or parent_uuid is None or partition is None:
        return None
    profile_id, start = int(match.group(1)), int(match.group(2))
    size = len(partition.memory_slices)
    if partition.memory_slices != frozenset(range(start, start + size)):
        return None  # not the driver's layout: fail closed on the missing uuid rather than guess
    return MigPlacement(parent_uuid=parent_uuid, profile_id=profile_id, start=start, size=size)


# ---------------------------------------------------------------- a teardown's view of its devices


def device_processes(backend: GpuBackend, device: DeviceRecord) -> list[GpuProcess]:
    """Processes still on a claim's device; raises GpuError."""
    if device.placement is not None:
        return backend.placement_processes(device.placement)
    return backend.processes(device.uuid) if device.uuid else []


def scrub_device(backend: GpuBackend, device: DeviceRecord) -> ScrubResult:
    """A dynamic MIG device through its placement (the driver deleted it, or will), anything else by UUID."""
    if device.placement is not None:
        return backend.scrub_placement(device.placement)
    return backend.scrub(device.uuid or "")


def device_health(backend: GpuBackend, device: DeviceRecord, since: float) -> HealthSnapshot:
    """Health of a claim's device since its allocation: a dynamic MIG device's through its placement (the
    device itself may be gone); raises GpuError."""
    if device.placement is not None:
        return backend.placement_health(device.placement, since)
    return backend.health(device.uuid or "", since)
