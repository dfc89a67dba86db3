"""Whether a device can be scrubbed now, and how much memory it has: read with NVML open, before the scrub's
child runs with NVML closed (scrubber.py)."""

from __future__ import annotations

from typing import Any

from . import device_info, mig
from .base import GpuError
from .handles import Devices


def scrub_target(
    nvml: Any, devices: Devices, capabilities: mig.CapabilityNodes, uuid: str
) -> tuple[bool | None, int, int, str | None]:
    """(ECC on, total and reserved bytes, why the device cannot be scrubbed or None), read with NVML open."""
    entry = device_info.lookup(nvml, devices, uuid)
    if entry is None:
        why = (
            f"device {uuid} no longer exists (a dynamically created MIG device is destroyed when the claim is "
            "unprepared): its memory cannot be reached to verify it"
        )
        return None, 0, 0, why
    ecc = _ecc_enabled(nvml, entry.parent)
    if entry.mig_enabled:
        why = (
            f"GPU {uuid} is in MIG mode: CUDA cannot reach its memory as a whole; scrub it with MIG disabled, "
            "or scrub each of its MIG devices"
        )
        return ecc, 0, 0, why
    holders = device_info.processes(nvml, uuid, entry.handle)
    if holders:
        pids = ", ".join(str(p.pid) for p in holders)
        return ecc, 0, 0, f"device {uuid} is still held by pid {pids}; their memory cannot be scrubbed"
    try:
        total, reserved, _free = device_info.memory(nvml, entry.handle)
    except nvml.NVMLError as exc:
        raise GpuError(f"NVML cannot read memory of {uuid}: {exc}", uuid) from exc
    if entry.parent_uuid is not None:
        # A MIG device created after the agent started (NVIDIA's dynamic MIG, the scrub's own instance) has
        # capability nodes this container's /dev lacks: without them CUDA does not see it.
        try:
            capabilities.mig_device(
                int(nvml.nvmlDeviceGetMinorNumber(entry.parent)),
                int(nvml.nvmlDeviceGetGpuInstanceId(entry.handle)),
                int(nvml.nvmlDeviceGetComputeInstanceId(entry.handle)),
            )
        except (GpuError, nvml.NVMLError) as exc:
            return ecc, total, reserved, f"cannot open MIG device {uuid} for its scrub: {exc}"
    return ecc, total, reserved, None


def _ecc_enabled(nvml: Any, gpu: Any) -> bool | None:
    """The physical GPU's current ECC mode; None where NVML cannot say (no ECC on the model, a lost GPU)."""
    if gpu is None:
        return None
    try:
        current, _pending = nvml.nvmlDeviceGetEccMode(gpu)
    except nvml.NVMLError:
        return None
    return current == nvml.NVML_FEATURE_ENABLED
