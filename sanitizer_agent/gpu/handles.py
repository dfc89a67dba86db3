"""NVML device handles, found attaching no GPU but the one an operation is about.

nvmlInit attaches no GPU; a handle lookup attaches (initialises) the GPU it returns, and the GPU stays attached
to this process until nvmlShutdown (nvml.h, nvmlInit_v2). nvmlDeviceGetHandleByIndex attaches the GPU at that
index; nvmlDeviceGetHandleByUUID "may initialize additional GPUs as it searches"; nvmlDeviceGetHandleByPciBusId_v2
attaches the target only. While this process has a GPU attached, NVIDIA's DRA driver cannot change that GPU's
MIG mode (with DynamicMIG it does, on the first MIG device's prepare and after the last one's unprepare). So an
operation on one GPU finds it by the PCI bus ID learned at start, and its MIG devices by walking that GPU's slots;
only the inventory (at start) attaches every GPU.

Without persistence mode every attach also initialises the GPU when no other client holds it (seconds on a large
GPU) and resets its volatile ECC counters: nvml.py names such GPUs at start.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .base import GpuError
from .nvml_errors import nvml_error_is
from .xid import PciAddress

PARENTS_KEPT = 4096


@dataclass(frozen=True)
class Handle:
    uuid: str
    handle: Any
    parent_uuid: str | None
    parent: Any  # the physical GPU's handle: ECC, row remapping and XIDs are per physical GPU
    mig_enabled: bool  # a full GPU in MIG mode: CUDA cannot reach its memory as a whole


def bus_id(pci: PciAddress) -> str:
    """The form nvmlDeviceGetHandleByPciBusId takes (domain:bus:device.function, in hex)."""
    return "{:08x}:{:02x}:{:02x}.0".format(*pci)


class Devices:
    """Handles of this node's GPUs and MIG devices; every call needs NVML open (the caller's session)."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.pci: dict[str, PciAddress] = {}  # GPU UUID -> PCI address, learned by `enumerate` and searches
        self._parents: dict[str, str] = {}  # MIG device UUID -> its GPU's UUID

    def note_parent(self, mig_uuid: str, gpu_uuid: str) -> None:
        """A MIG device seen through its GPU (made since the inventory): looked up through that GPU from now on."""
        if len(self._parents) >= PARENTS_KEPT:  # each scrub's own instance is a new UUID: a cache, not a record
            self._parents.clear()
        self._parents[mig_uuid] = gpu_uuid

    def _learn(self, uuid: str, gpu: Any) -> None:
        info = self._nvml.nvmlDeviceGetPciInfo(gpu)
        self.pci[uuid] = (int(info.domain), int(info.bus), int(info.device))

    def mig_enabled(self, gpu: Any) -> bool:
        nvml = self._nvml
        try:
            return bool(nvml.nvmlDeviceGetMigMode(gpu)[0] == nvml.NVML_DEVICE_MIG_ENABLE)
        except nvml.NVMLError as exc:
            if not nvml_error_is(self._nvml, exc, "NOT_SUPPORTED"):
                raise
            return False

    def mig_devices(self, gpu: Any) -> Iterator[tuple[int, Any]]:
        """(slot, handle) of each MIG device of a GPU in MIG mode."""
        nvml = self._nvml
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                yield slot, nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
            except nvml.NVMLError as exc:
                if not nvml_error_is(self._nvml, exc, "NOT_FOUND"):  # an empty slot
                    raise

    def enumerate(self) -> tuple[list[tuple[int, Handle]], list[str]]:
        """(index, handle) of every GPU and MIG device, and a message for each GPU that could not be read. Attaches
        every GPU: for the inventory at start. Raises GpuError only when NVML cannot even count the GPUs."""
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise GpuError(f"NVML cannot list GPUs: {exc}") from exc
        found: list[tuple[int, Handle]] = []
        errors: list[str] = []
        for index in range(count):
            try:
                gpu = nvml.nvmlDeviceGetHandleByIndex(index)
                gpu_uuid = nvml.nvmlDeviceGetUUID(gpu)
                self._learn(gpu_uuid, gpu)
                mig_enabled = self.mig_enabled(gpu)
                found.append((index, Handle(gpu_uuid, gpu, None, gpu, mig_enabled)))
                for slot, mig in self.mig_devices(gpu) if mig_enabled else ():
                    mig_uuid = nvml.nvmlDeviceGetUUID(mig)
                    self.note_parent(mig_uuid, gpu_uuid)
                    found.append((slot, Handle(mig_uuid, mig, gpu_uuid, gpu, False)))
            except nvml.NVMLError as exc:
                errors.append(f"GPU index {index}: {exc}")
        return found, errors

    def gpu(self, uuid: str) -> Any | None:
        """The handle of GPU `uuid`, attaching it alone; None when it is not on this node (any more)."""
        nvml = self._nvml
        if uuid not in self.pci and self._search(uuid) != uuid:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id(self.pci[uuid]))
        except nvml.NVMLError as exc:
            if nvml_error_is(self._nvml, exc, "NOT_FOUND"):
                return None
            raise
        return handle if nvml.nvmlDeviceGetUUID(handle) == uuid else None  # another GPU at that address now

    def lookup(self, uuid: str) -> Handle | None:
        """A GPU or MIG device by UUID, attaching only its GPU; None when NVML does not know it."""
        parent_uuid = uuid if uuid in self.pci else self._parents.get(uuid) or self._search(uuid)
        gpu = self.gpu(parent_uuid) if parent_uuid is not None else None
        if gpu is None:
            return None
        mig_enabled = self.mig_enabled(gpu)
        if parent_uuid == uuid:
            return Handle(uuid, gpu, None, gpu, mig_enabled)
        for _slot, mig in self.mig_devices(gpu) if mig_enabled else ():
            if self._nvml.nvmlDeviceGetUUID(mig) == uuid:
                return Handle(uuid, mig, parent_uuid, gpu, False)
        return None  # a MIG device destroyed since

    def _search(self, uuid: str) -> str | None:
        """NVML's own search, for a device not seen before (a MIG device made since the inventory): the UUID of
        its GPU, learned for the next time; None when NVML finds nothing. NVML may attach other GPUs to find it."""
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError as exc:
            if nvml_error_is(self._nvml, exc, "NOT_FOUND"):
                return None
            raise
        is_mig = nvml.nvmlDeviceIsMigDeviceHandle(handle)
        if not int(getattr(is_mig, "value", is_mig)):  # nvidia-ml-py 13 returns the c_uint itself
            self._learn(uuid, handle)
            return uuid
        gpu = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        gpu_uuid = str(nvml.nvmlDeviceGetUUID(gpu))
        self._learn(gpu_uuid, gpu)
        self.note_parent(uuid, gpu_uuid)
        return gpu_uuid
