"""GPU instances through NVML, for the scrub of a dynamic MIG placement.

NVIDIA's DRA driver deletes a dynamic MIG device on unprepare; its memory slices still hold what the tenant
left. The agent creates a GPU instance with the same GI profile at the same placement (so it owns exactly
those memory slices), one compute instance in it (CUDA needs one to see the device), scrubs the MIG device
that appears, and destroys both. Creating and destroying GPU instances needs the MIG management
capability: root in the host's view, or read access to `/proc/driver/nvidia/capabilities/mig/config`
(the DaemonSet's comment says why the agent is privileged).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import GpuError, MigPlacement

log = logging.getLogger(__name__)

PROC_CAPABILITIES = Path("/proc/driver/nvidia/capabilities")
CAPS_DEVICE_DIR = Path("/dev/nvidia-caps")
PROC_DEVICES = Path("/proc/devices")


def _mknod(path: Path, major: int, minor: int) -> None:
    os.mknod(path, stat.S_IFCHR | 0o400, os.makedev(major, minor))


@dataclass(frozen=True)
class CapabilityNodes:
    """The `/dev/nvidia-caps/nvidia-cap<minor>` nodes a process needs: the MIG config capability to create GPU
    instances, and each MIG device's GPU and compute instance access capabilities to open it with CUDA. The
    minor of each is the `DeviceFileMinor` of its file under /proc/driver/nvidia/capabilities.

    A container's /dev is filled when it starts, privileged or not: the nodes of a GPU instance created later
    (by the agent's scrub, or by NVIDIA's DRA driver for a dynamic MIG claim) are not in it, and the NVIDIA
    container runtime keeps the driver from creating them (NVreg_ModifyDeviceFiles). So the agent makes the
    ones it needs itself, with mknod, as NVIDIA's driver gives its workload containers theirs through CDI; the
    privileged container's device cgroup lets it open them."""

    proc: Path = PROC_CAPABILITIES
    dev: Path = CAPS_DEVICE_DIR
    devices: Path = PROC_DEVICES
    mknod: Callable[[Path, int, int], None] = _mknod

    def node(self, access_file: Path) -> Path:
        """The node of the capability `access_file` describes, made when missing; raises GpuError."""
        try:
            text = access_file.read_text()
        except OSError as exc:
            raise GpuError(
                f"cannot read {access_file} ({exc.strerror or exc}); the driver has no MIG or /proc is not the host's"
            ) from exc
        match = re.search(r"DeviceFileMinor:\s*(\d+)", text)
        if match is None:
            raise GpuError(f"{access_file} names no DeviceFileMinor")
        node = self.dev / f"nvidia-cap{match.group(1)}"
        if node.exists():
            return node
        try:
            major = next(
                int(fields[0])
                for fields in (line.split() for line in self.devices.read_text().splitlines())
                if len(fields) == 2 and fields[1] == "nvidia-caps"
            )
        except (OSError, StopIteration, ValueError) as exc:
            raise GpuError(
                f"{self.devices} names no nvidia-caps device major ({exc}); is the NVIDIA driver loaded?"
            ) from exc
        try:
            self.dev.mkdir(parents=True, exist_ok=True)
            self.mknod(node, major, int(match.group(1)))
        except FileExistsError:
            pass  # another scrub made it meanwhile
        except OSError as exc:
            raise GpuError(
                f"cannot create {node} ({exc.strerror or exc}): the agent needs the privileged securityContext "
                "(CAP_MKNOD) to reach MIG devices created after it started"
            ) from exc
        return node

    def opens(self, node: Path) -> str | None:
        """Why `node` cannot be opened, or None."""
        try:
            os.close(os.open(node, os.O_RDONLY))
        except OSError as exc:
            return f"cannot open {node} ({exc.strerror or exc})"
        return None

    def config_problem(self) -> str | None:
        """Why this process cannot create GPU instances, or None once the MIG config capability's node exists
        (made if missing) and opens: the start-up check that the scrub of a dynamic MIG placement can run."""
        try:
            return self.opens(self.node(self.proc / "mig" / "config"))
        except GpuError as exc:
            return str(exc)

    def mig_device(self, gpu_minor: int, gi_id: int, ci_id: int) -> None:
        """Makes (when missing) and opens the nodes CUDA needs for MIG device (GPU instance `gi_id`, compute
        instance `ci_id`) of the GPU with minor number `gpu_minor`; raises GpuError. A driver without a
        capabilities tree guards MIG devices with none: nothing to make (CUDA still says whether it sees it)."""
        if not self.proc.is_dir():
            return
        gi = self.proc / f"gpu{gpu_minor}" / "mig" / f"gi{gi_id}"
        for access in (gi / "access", gi / f"ci{ci_id}" / "access"):
            problem = self.opens(self.node(access))
            if problem is not None:
                raise GpuError(f"{problem}: CUDA cannot open the MIG device of GPU instance {gi_id} on GPU {gpu_minor}")


@dataclass(frozen=True)
class LiveInstance:
    """A MIG device that exists now, with its GPU instance's placement."""

    uuid: str
    handle: Any
    profile_id: int
    start: int
    size: int

    def overlaps(self, placement: MigPlacement) -> bool:
        return bool(set(range(self.start, self.start + self.size)) & placement.slices)

    def is_at(self, placement: MigPlacement) -> bool:
        return (self.profile_id, self.start, self.size) == (placement.profile_id, placement.start, placement.size)


def live_instances(nvml: Any, gpu: Any) -> list[LiveInstance]:
    """Every MIG device of the GPU (handle `gpu`) with its GPU instance's profile and placement."""
    found = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == nvml.NVML_ERROR_NOT_FOUND:
                continue
            raise
        info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(gpu, nvml.nvmlDeviceGetGpuInstanceId(mig)))
        found.append(
            LiveInstance(
                nvml.nvmlDeviceGetUUID(mig),
                mig,
                int(info.profileId),
                int(info.placement.start),
                int(info.placement.size),
            )
        )
    return found


@contextmanager
def scratch_instance(
    nvml: Any, session: Callable[[], AbstractContextManager[None]], placement: MigPlacement
) -> Iterator[str]:
    """A GPU instance at `placement` with one compute instance, for the time of the block: yields the UUID
    of its MIG device. NVML is open (`session`) to create it and to destroy it, not while the block runs (the
    scrub: see nvml.py). Raises GpuError when NVML refuses; destroys what it created, and raises GpuError
    when that fails (the placement would stay blocked)."""
    where = (
        f"GI profile {placement.profile_id} at memory slices {placement.start}..{placement.start + placement.size - 1}"
    )
    with session():
        gpu = _gpu(nvml, placement)
        c_placement = nvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
        try:
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, placement.profile_id, ctypes.byref(c_placement))
        except nvml.NVMLError as exc:
            raise GpuError(f"NVML cannot create a GPU instance ({where}) on {placement.parent_uuid}: {exc}") from exc
        ci = None
        try:
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            got = (int(info.profileId), int(info.placement.start), int(info.placement.size))
            if got != (placement.profile_id, placement.start, placement.size):
                raise GpuError(f"NVML created the GPU instance for {where} with profile/placement {got}")
            ci = _compute_instance(nvml, gi, where)
            ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
            uuid = next(
                (
                    live.uuid
                    for live in live_instances(nvml, gpu)
                    if live.is_at(placement) and int(nvml.nvmlDeviceGetComputeInstanceId(live.handle)) == ci_id
                ),
                None,
            )
            if uuid is None:
                raise GpuError(f"the MIG device of the GPU instance created for {where} does not show in NVML")
        except BaseException:
            _destroy(nvml, gi, ci, where)
            _mig_off_if_empty(nvml, gpu, placement.parent_uuid)
            raise
    try:
        yield uuid
    finally:
        with session():
            gpu = _gpu(nvml, placement)
            gi, ci = _still_ours(nvml, gpu, placement, uuid, where)
            _destroy(nvml, gi, ci, where)
            _mig_off_if_empty(nvml, gpu, placement.parent_uuid)


def _gpu(nvml: Any, placement: MigPlacement) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
    except nvml.NVMLError as exc:
        raise GpuError(f"NVML cannot find GPU {placement.parent_uuid}: {exc}", placement.parent_uuid) from exc


def _still_ours(nvml: Any, gpu: Any, placement: MigPlacement, uuid: str, where: str) -> tuple[Any, Any]:
    """The GPU and compute instance of the scrub's MIG device `uuid`, looked up again (NVML was closed meanwhile).
    A MIG device's UUID is new at each creation, so only the one created here matches; GPU instance IDs are
    reused and name nothing on their own."""
    try:
        mine = next((live for live in live_instances(nvml, gpu) if live.uuid == uuid), None)
        if mine is None:
            # Destroyed under us: NVIDIA's DRA driver, starting, tears down every MIG device its checkpoint
            # does not name (obliterateStaleMIGDevices). Whatever the scrub saw of it counts for nothing.
            raise ScratchInstanceGone(
                f"the GPU instance the scrub created ({where}) on {placement.parent_uuid} was destroyed by another "
                "party during the scrub (NVIDIA's DRA driver tears down MIG devices it did not create when it starts)"
            )
        gi = nvml.nvmlDeviceGetGpuInstanceById(gpu, int(nvml.nvmlDeviceGetGpuInstanceId(mine.handle)))
        return gi, nvml.nvmlGpuInstanceGetComputeInstanceById(gi, int(nvml.nvmlDeviceGetComputeInstanceId(mine.handle)))
    except nvml.NVMLError as exc:
        raise GpuError(
            f"NVML cannot find the GPU instance the scrub created ({where}) on {placement.parent_uuid} to destroy it: "
            f"{exc}; the placement stays taken until an operator removes it (nvidia-smi mig -dci, then -dgi)"
        ) from exc


class ScratchInstanceGone(GpuError):
    """The scrub's own GPU instance vanished before the scrub ended: its result is void, the scrub may run again
    (the claim's allocation still keeps the placement from everyone else)."""


def _mig_off_if_empty(nvml: Any, gpu: Any, uuid: str) -> None:
    """Leaves the GPU as NVIDIA's DRA driver would have: with dynamic MIG it turns MIG mode off when it deletes
    a MIG device and finds none left, and it may have found ours. A GPU left in MIG mode with no MIG device is
    one the next whole-GPU tenant cannot use. A GPU instance someone else has (mid-prepare) keeps it on."""
    try:
        if live_instances(nvml, gpu) or nvml.nvmlDeviceGetMigMode(gpu)[0] != nvml.NVML_DEVICE_MIG_ENABLE:
            return
        nvml.nvmlDeviceSetMigMode(gpu, nvml.NVML_DEVICE_MIG_DISABLE)
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) != nvml.NVML_ERROR_IN_USE:
            raise GpuError(
                f"NVML cannot turn MIG mode off on {uuid}, which the scrub left with no MIG device: {exc}; turn it "
                "off (nvidia-smi -i <gpu> -mig 0) before a whole-GPU claim gets it",
                uuid,
            ) from exc
        if _any_instance(nvml, gpu):
            return  # a GPU instance appeared meanwhile: MIG stays on, as the driver would leave it
        # No instance, so another process's NVML session refused it: with DynamicMIG, NVIDIA's driver keeps one
        # open and is then the only one that can change MIG modes. Fail closed rather than hand a whole-GPU
        # tenant a GPU in MIG mode: the claim keeps the placement, so no whole-GPU claim gets it meanwhile.
        raise GpuError(
            f"NVML refused to turn MIG mode off on {uuid} ({exc}), which the scrub left with no MIG device: another "
            "process holds NVML (NVIDIA's DRA driver does with DynamicMIG). Restart NVIDIA's DRA kubelet plugin on "
            "this node (at start it turns MIG off on every GPU with no MIG device), or turn it off with nvidia-smi "
            "-i <gpu> -mig 0 while nothing holds NVML; then `scrubgate agent rescrub --device <device>` on this node",
            uuid,
        ) from exc
    log.info("GPU %s: MIG mode off, as NVIDIA's driver leaves a GPU with no MIG device", uuid)


def _any_instance(nvml: Any, gpu: Any) -> bool:
    try:
        return bool(live_instances(nvml, gpu))
    except nvml.NVMLError as exc:
        raise GpuError(f"NVML cannot list the MIG devices left after the scrub: {exc}") from exc


def _compute_instance(nvml: Any, gi: Any, where: str) -> Any:
    """The largest compute instance the GPU instance takes (any covers the instance's whole memory; the
    largest has the most SMs, so the scrub runs fastest)."""
    last: Exception | None = None
    for profile in reversed(range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, profile, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            return nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
        except nvml.NVMLError as exc:
            last = exc
    raise GpuError(f"NVML cannot create a compute instance in the GPU instance for {where}: {last}")


def _destroy(nvml: Any, gi: Any, ci: Any, where: str) -> None:
    try:
        if ci is not None:
            nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlGpuInstanceDestroy(gi)
    except nvml.NVMLError as exc:
        raise GpuError(
            f"NVML cannot destroy the GPU instance the scrub created ({where}): {exc}; the placement stays "
            "taken until an operator removes it (nvidia-smi mig -dci, then -dgi)"
        ) from exc
