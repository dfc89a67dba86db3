"""What the agent needs from a GPU backend: devices, their processes, health, and a verified scrub.

The real backend (``nvml``) and the simulated one (``simulated``) both implement ``GpuBackend``; the
agent's state machine only ever sees these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

# Application XIDs: faults a tenant's own program causes (13 graphics engine exception, 31 memory page
# fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor exception, 109 context
# switch timeout). NVIDIA's DRA driver ignores exactly these; every other XID makes the GPU suspect.
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})


def critical_xid(xid: int) -> bool:
    return xid not in APPLICATION_XIDS


# nvmlGpuRecoveryAction_t, for the operator reading a failure reason.
RECOVERY_ACTIONS: dict[int, str] = {
    1: "GPU reset",
    2: "node reboot",
    3: "drain peer-to-peer traffic",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}

ProcessKind = Literal["compute", "graphics", "mps"]


class GpuError(Exception):
    """A backend failure (NVML error, CUDA error, device gone); the message names the device UUID."""

    def __init__(self, message: str, uuid: str | None = None) -> None:
        super().__init__(message)
        self.uuid = uuid


@dataclass(frozen=True)
class GpuDevice:
    uuid: str
    index: int
    name: str
    parent_uuid: str | None
    memory_total: int
    memory_reserved: int
    memory_free: int

    @property
    def is_mig(self) -> bool:
        return self.parent_uuid is not None


@dataclass(frozen=True)
class MigPlacement:
    """Where a dynamic MIG device lives on its GPU: NVIDIA's driver creates it on prepare and deletes it on
    unprepare, so after release only this (GPU, GPU instance profile ID, memory slices) is left to scrub.
    A GPU instance created with this profile at this placement owns exactly these memory slices."""

    parent_uuid: str
    profile_id: int  # nvmlGpuInstanceProfileInfo_t.id, as in the device name gpu-<minor>-mig-<profile>-<id>-<start>
    start: int  # first memory slice
    size: int  # memory slices

    @property
    def slices(self) -> frozenset[int]:
        return frozenset(range(self.start, self.start + self.size))


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    kind: ProcessKind
    used_memory: int | None


@dataclass(frozen=True)
class HealthSnapshot:
    # Uncorrectable ECC errors since the device's allocation (the baseline), not since driver load.
    ecc_uncorrectable_volatile: int
    remapped_rows_pending: bool
    remapped_rows_failed: bool
    # NVML's nvmlGpuRecoveryAction_t (0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and
    # reset, ...); None where the driver does not report it.
    recovery_action: int | None
    xids: tuple[int, ...]

    @property
    def healthy(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        found = []
        if self.ecc_uncorrectable_volatile:
            found.append(f"{self.ecc_uncorrectable_volatile} uncorrectable ECC errors since the allocation")
        if self.remapped_rows_pending:
            found.append("row remapping pending (GPU reset needed)")
        if self.remapped_rows_failed:
            found.append("row remapping failed (GPU needs service)")
        if self.recovery_action:
            action = RECOVERY_ACTIONS.get(self.recovery_action, "unknown")
            found.append(f"driver asks for recovery action {self.recovery_action} ({action})")
        if self.xids:
            found.append("critical XID events: " + ", ".join(str(x) for x in self.xids))
        return found

    def to_attestation(self) -> dict[str, object]:
        """The attestation's ``health`` object (DESIGN.md, "Attestation")."""
        return {
            "eccUncorrectable": self.ecc_uncorrectable_volatile,
            "remapPending": self.remapped_rows_pending,
            "xids": list(self.xids),
        }


@dataclass(frozen=True)
class ScrubResult:
    uuid: str
    bytes_scrubbed: int
    bytes_total: int
    bytes_reserved: int
    # Memory the scrub could not allocate (held by someone else, or the driver's own); never verified.
    bytes_unreachable: int
    duration_s: float
    verified: bool
    method: str
    reason: str | None = None
    # Seconds the device spent zeroing and verifying, without process start, CUDA init or allocation:
    # the figure to compare with the card's copy bandwidth. None where the backend does not measure it.
    kernel_s: float | None = None
    # What verified: "cubin sm_90", "ptx" (the driver's JIT), or memset and read back without kernels.
    kernels: str | None = None
    # Coverage beyond the scrub's own reach, recorded in the attestation: whether the kernel driver zeroes
    # freed memory (what the scrub could not reach was freed by the driver before it) and whether the GPU
    # runs with ECC (None: could not be read).
    scrub_on_free: bool | None = None
    ecc_enabled: bool | None = None
    # Peak host memory of the scrub's process (its CUDA context, the driver's): None where not measured.
    host_rss_bytes: int | None = None

    @property
    def gbps(self) -> float:
        """Scrub rate in GB/s (10^9 bytes per second, the unit GPU bandwidth is quoted in)."""
        return self.bytes_scrubbed / self.duration_s / 1e9 if self.duration_s > 0 else 0.0


@runtime_checkable
class GpuBackend(Protocol):
    def list_devices(self) -> list[GpuDevice]: ...

    def processes(self, uuid: str) -> list[GpuProcess]:
        """Processes holding the device now; raises GpuError."""
        ...

    def health(self, uuid: str, since: float) -> HealthSnapshot:
        """Health now, with the critical XIDs seen since ``since`` (unix time); raises GpuError."""
        ...

    def scrub(self, uuid: str) -> ScrubResult:
        """Zero and verify the device's free memory.

        A scrub that fails returns ``verified=False`` with a reason; GpuError only when the device
        cannot be reached at all.
        """
        ...

    def placement_health(self, placement: MigPlacement, since: float) -> HealthSnapshot:
        """As ``health`` of the placement's GPU (its XIDs included: the driver names no GPU instance in them);
        raises GpuError."""
        ...

    def placement_processes(self, placement: MigPlacement) -> list[GpuProcess]:
        """Processes on any MIG device whose memory overlaps ``placement`` (none once the driver deleted
        the device); raises GpuError."""
        ...

    def scrub_placement(self, placement: MigPlacement) -> ScrubResult:
        """Zero and verify the memory slices of ``placement`` through a GPU instance the backend creates
        there (and destroys afterwards); as ``scrub`` for failures."""
        ...

    def scrub_on_free_disabled(self) -> bool | None:
        """The kernel driver's RMDisableScrubOnFree setting; None when it cannot be read."""
        ...

    def watch_error(self) -> str | None:
        """Why what the backend watches on its own (the kernel log's XIDs) is no longer watched, or None: the
        agent's health check fails on it."""
        ...

    def close(self) -> None:
        """Release what the backend holds (its XID watch of the kernel log, its ECC sampler)."""
        ...
