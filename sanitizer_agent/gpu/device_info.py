"""What NVML says of this node's devices: the inventory of them all, and of one device found by UUID (handles.py)
its memory and the processes on it. Every function needs NVML open (the caller's session)."""

from __future__ import annotations

import logging
from typing import Any

from .base import GpuDevice, GpuError, GpuProcess, ProcessKind
from .handles import Devices, Handle
from .nvml_errors import nvml_error_is

log = logging.getLogger(__name__)


def lookup(nvml: Any, devices: Devices, uuid: str) -> Handle | None:
    """A GPU or MIG device by UUID; None when NVML does not know it. Raises GpuError when NVML fails."""
    try:
        return devices.lookup(uuid)
    except nvml.NVMLError as exc:
        raise GpuError(f"NVML cannot reach device {uuid}: {exc}", uuid) from exc


def resolve(nvml: Any, devices: Devices, uuid: str) -> Handle:
    """As `lookup`, and a device NVML does not know is a GpuError too."""
    entry = lookup(nvml, devices, uuid)
    if entry is None:
        raise GpuError(f"GPU device {uuid} not found by NVML (gone, or not on this node)", uuid)
    return entry


def memory(nvml: Any, handle: Any) -> tuple[int, int, int]:
    """(total, reserved, free) in bytes; reserved needs NVML's v2 memory info (driver >= 510)."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return int(info.total), int(info.reserved), int(info.free)
        except nvml.NVMLError as exc:
            if not any(
                nvml_error_is(nvml, exc, n)
                for n in ("FUNCTION_NOT_FOUND", "NOT_SUPPORTED", "ARGUMENT_VERSION_MISMATCH")
            ):
                raise
    info = nvml.nvmlDeviceGetMemoryInfo(handle)
    return int(info.total), 0, int(info.free)


def processes(nvml: Any, uuid: str, handle: Any) -> list[GpuProcess]:
    """The compute, graphics and MPS processes on the device; raises GpuError."""
    queries: list[tuple[ProcessKind, str]] = [
        ("compute", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
        ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
    ]
    found: dict[tuple[int, str], GpuProcess] = {}
    for kind, function in queries:
        try:
            infos = getattr(nvml, function)(handle)
        except nvml.NVMLError as exc:
            if nvml_error_is(nvml, exc, "NOT_SUPPORTED"):  # e.g. graphics on a MIG device
                continue
            raise GpuError(f"NVML cannot list {kind} processes on {uuid}: {exc}", uuid) from exc
        for info in infos:
            found.setdefault((info.pid, kind), GpuProcess(int(info.pid), kind, info.usedGpuMemory))
    return list(found.values())


def list_devices(nvml: Any, devices: Devices) -> list[GpuDevice]:
    """Every GPU and MIG device: attaches every GPU, so for the inventory at start, not for a teardown."""
    entries, errors = devices.enumerate()
    for error in errors:
        # Left out, not guessed at: the agent keeps any device it cannot see fenced.
        log.warning("NVML could not read a GPU, leaving it out of the inventory: %s", error)
    found = []
    for index, entry in entries:
        try:
            total, reserved, free = memory(nvml, entry.handle)
            name = nvml.nvmlDeviceGetName(entry.handle)
        except nvml.NVMLError as exc:
            log.warning("NVML could not read device %s, leaving it out of the inventory: %s", entry.uuid, exc)
            continue
        found.append(GpuDevice(entry.uuid, index, name, entry.parent_uuid, total, reserved, free))
    return found
