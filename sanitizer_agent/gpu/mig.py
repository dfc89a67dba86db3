"""GPU instances through NVML, for the scrub of a dynamic MIG placement.

NVIDIA's DRA driver deletes a dynamic MIG device on unprepare; its memory slices still hold what the tenant
left. The agent creates a GPU instance with the same GI profile at the same placement (so it owns exactly
those memory slices), one compute instance in it (CUDA needs one to see the device), scrubs the MIG device
that appears, and destroys both. Creating and destroying GPU instances needs the MIG management
capability: root in the host's view, or read access to `/proc/driver/nvidia/capabilities/mig/config`
(the DaemonSet's comment says why the agent is privileged).

The agent never changes a GPU's MIG mode. Under DynamicMIG NVIDIA's DRA driver owns it: it turns MIG on for a
GPU's first MIG device and off after deleting its last (and, when it starts, on every GPU with none), and it
holds NVML for its lifetime, so another process's nvmlDeviceSetMigMode only reports "in use by another client"
in its activationStatus (k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/nvlib.go, Init and maybeDisableMigMode;
nvml.h, nvmlDeviceSetMigMode). Where the scrub's GPU instance was the last on its GPU (the driver deleted the
others meanwhile, and left MIG on because ours was there), the GPU stays in MIG mode with no MIG device until
the driver deletes another MIG device there or restarts; the memory is verified all the same, and the agent
says so in its log (`_left_in_mig_mode`). On Ampere the driver never turns MIG off (a pending disable waits for
a GPU reset) and does not offer such a GPU whole.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import stat
import threading
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


def _device_of(path: Path) -> tuple[int, int] | None:
    """(major, minor) of a character device node; None when there is none at `path`."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return (os.major(found.st_rdev), os.minor(found.st_rdev)) if stat.S_ISCHR(found.st_mode) else None


# One node made at a time: a scrub must not remove the node another one just made.
_making = threading.Lock()


@dataclass(frozen=True)
class CapabilityNodes:
    """The `/dev/nvidia-caps/nvidia-cap<minor>` nodes a process needs: the MIG config capability to create GPU
    instances, and each MIG device's GPU and compute instance access capabilities to open it with CUDA. The
    minor of each is the `DeviceFileMinor` of its file under /proc/driver/nvidia/capabilities.

    A container's /dev is filled when it starts, privileged or not: the nodes of a GPU instance created later
    (by the agent's scrub, or by NVIDIA's DRA driver for a dynamic MIG claim) are not in it, and the NVIDIA
    container runtime keeps the driver from creating them (NVreg_ModifyDeviceFiles). So the agent makes the
    ones it needs itself, with mknod, as NVIDIA's driver gives its workload containers theirs through CDI; the
    privileged container's device cgroup lets it open them.

    The nvidia-caps major is the kernel's choice at each driver load: a node made before a driver reload names a
    device that is no longer there (or another one), so the major is read again each time and a node with
    another number is made again."""

    proc: Path = PROC_CAPABILITIES
    dev: Path = CAPS_DEVICE_DIR
    devices: Path = PROC_DEVICES
    mknod: Callable[[Path, int, int], None] = _mknod
    device_of: Callable[[Path], tuple[int, int] | None] = _device_of

    def node(self, access_file: Path) -> Path:
        """The node of the capability `access_file` describes, made when missing or stale; raises GpuError."""
        try:
            text = access_file.read_text()
        except OSError as exc:
            raise GpuError(
                f"cannot read {access_file} ({exc.strerror or exc}): the driver has no MIG, /proc is not the host's, "
                "or the NVIDIA container runtime hid the capabilities (it shows /proc/driver/nvidia/capabilities only "
                "to a container with NVIDIA_MIG_CONFIG_DEVICES=all, which manifests/agent-daemonset.yaml sets)"
            ) from exc
        match = re.search(r"DeviceFileMinor:\s*(\d+)", text)
        if match is None:
            raise GpuError(f"{access_file} names no DeviceFileMinor")
        minor = int(match.group(1))
        node = self.dev / f"nvidia-cap{minor}"
        major = self._major()
        with _making:
            if self.device_of(node) == (major, minor):
                return node
            try:
                self.dev.mkdir(parents=True, exist_ok=True)
                node.unlink(missing_ok=True)  # made for an earlier driver load, or not a device
                self.mknod(node, major, minor)
            except OSError as exc:
                raise GpuError(
                    f"cannot create {node} ({exc.strerror or exc}): the agent needs the privileged securityContext "
                    "(CAP_MKNOD) to reach MIG devices created after it started"
                ) from exc
        return node

    def _major(self) -> int:
        try:
            return next(
                int(fields[0])
                for fields in (line.split() for line in self.devices.read_text().splitlines())
                if len(fields) == 2 and fields[1] == "nvidia-caps"
            )
        except (OSError, StopIteration, ValueError) as exc:
            raise GpuError(
                f"{self.devices} names no nvidia-caps device major ({exc}); is the NVIDIA driver loaded?"
            ) from exc

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
    nvml: Any,
    session: Callable[[], AbstractContextManager[None]],
    placement: MigPlacement,
    gpu_of: Callable[[str], Any],
) -> Iterator[str]:
    """A GPU instance at `placement` with one compute instance, for the time of the block: yields the UUID
    of its MIG device. NVML is open (`session`) to create it and to destroy it, not while the block runs (the
    scrub: see nvml.py); `gpu_of(uuid)` gives the GPU's handle (None when gone), attaching no other GPU. Raises
    GpuError when NVML refuses; destroys what it created, and raises GpuError when that fails (the placement
    would stay blocked)."""
    where = (
        f"GI profile {placement.profile_id} at memory slices {placement.start}..{placement.start + placement.size - 1}"
    )
    with session():
        gpu = _gpu(nvml, placement, gpu_of)
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
            _left_in_mig_mode(nvml, gpu, placement.parent_uuid)
            raise
    try:
        yield uuid
    finally:
        with session():
            gpu = _gpu(nvml, placement, gpu_of)
            gi, ci = _still_ours(nvml, gpu, placement, uuid, where)
            _destroy(nvml, gi, ci, where)
            _left_in_mig_mode(nvml, gpu, placement.parent_uuid)


def _gpu(nvml: Any, placement: MigPlacement, gpu_of: Callable[[str], Any]) -> Any:
    try:
        gpu = gpu_of(placement.parent_uuid)
    except nvml.NVMLError as exc:
        raise GpuError(f"NVML cannot find GPU {placement.parent_uuid}: {exc}", placement.parent_uuid) from exc
    if gpu is None:
        raise GpuError(
            f"GPU {placement.parent_uuid} not found by NVML (gone, or not on this node)", placement.parent_uuid
        )
    return gpu


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


def _left_in_mig_mode(nvml: Any, gpu: Any, uuid: str) -> None:
    """Says so where the scrub's GPU instance was its GPU's last: the GPU stays in MIG mode with no MIG device
    until NVIDIA's driver turns MIG off (the module's docstring says why the agent does not)."""
    try:
        if live_instances(nvml, gpu) or nvml.nvmlDeviceGetMigMode(gpu)[0] != nvml.NVML_DEVICE_MIG_ENABLE:
            return
    except nvml.NVMLError as exc:
        log.warning("cannot read the MIG mode of GPU %s after the scrub: %s", uuid, exc)
        return
    log.warning(
        "GPU %s is left in MIG mode with no MIG device: the scrub's GPU instance was its last (NVIDIA's DRA driver "
        "deleted the others meanwhile). Its memory is verified clean; the agent does not change MIG modes, which "
        "NVIDIA's driver owns under DynamicMIG: the driver turns MIG off when it deletes this GPU's next MIG device "
        "or when it restarts. Until then a whole-GPU claim on it gets a GPU CUDA cannot use whole; to free it now, "
        "restart NVIDIA's DRA kubelet plugin on this node.",
        uuid,
    )


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
