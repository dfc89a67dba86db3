"""The real GPU backend: NVML (``nvidia-ml-py``, import name ``pynvml``) for inventory, processes and
health; the CUDA driver API, in a child process per device (``cuda_scrub.py``), for the scrub; XIDs from the
kernel log (``xid.py``).

NVML is open only while an operation runs, never while the agent waits, and an operation attaches only the GPU
it is about (handles.py): with DynamicMIG, NVIDIA's DRA driver changes a GPU's MIG mode when it creates the
first MIG device and deletes the last, and NVML refuses that while another process has the GPU attached ("in use
by another client"; k8s-dra-driver-gpu's nvlib.go says so of its own long-lived session and mig-parted). An idle
agent holding NVML would make every such change fail; one attaching every GPU for each operation would make
those on any GPU fail while it runs. The scrub itself (cuda_scrub.py, in a child) takes about 0.1 s of device
time on an H200 (zero and read back 141 GB at 4.8 TB/s); its wall time is the child's start, CUDA's and the
allocation's, seconds. NVML stays closed meanwhile all the same.

``pynvml`` is imported when the backend is opened, never at module import, so the project installs
and its tests run on machines without a GPU (``pip install scrubgate[gpu]`` adds the bindings).

The backend composes its parts: NVML's shared session (session.py), device lookups and the inventory
(device_info.py), health with its ECC sampler and XID watch (health.py), the scrub (scrubber.py) and MIG
placements (placements.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from . import cuda_scrub, device_info, mig
from .base import GpuDevice, GpuError, GpuProcess, HealthSnapshot, MigPlacement, ScrubResult
from .child import ScrubChild
from .driver_params import PARAMS_PATH
from .handles import Devices, Handle
from .health import GpuHealth, without_persistence
from .placements import MigPlacements
from .scrubber import DEFAULT_MAX_UNREACHABLE, DEFAULT_MAX_UNREACHABLE_BYTES, Scrubber
from .session import NvmlSession
from .xid import KERNEL_LOG

# Scrub processes at once (child.py): the agent tears down up to 16 claims at once, which must not all scrub at
# once inside the DaemonSet's 4 GiB memory limit. The rest wait for a slot.
DEFAULT_MAX_PARALLEL_SCRUBS = 4

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _in_session(method: _Method) -> _Method:
    """Runs a backend method with NVML open (see the module's docstring)."""

    @functools.wraps(method)
    def run(self: NvmlBackend, *args: Any, **kwargs: Any) -> Any:
        with self._session():
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class NvmlBackend:
    """GpuBackend over NVML and the CUDA driver API."""

    def __init__(
        self,
        *,
        scrub_timeout_s: float = 600.0,
        chunk_bytes: int = cuda_scrub.DEFAULT_CHUNK_BYTES,
        min_chunk_bytes: int = cuda_scrub.DEFAULT_MIN_CHUNK_BYTES,
        margin_bytes: int = cuda_scrub.DEFAULT_MARGIN_BYTES,
        max_unreachable_fraction: float = DEFAULT_MAX_UNREACHABLE,
        max_unreachable_bytes: int = DEFAULT_MAX_UNREACHABLE_BYTES,
        max_parallel_scrubs: int = DEFAULT_MAX_PARALLEL_SCRUBS,
        watch_xids: bool = True,
        kernel_log: Path = KERNEL_LOG,
        python: str = sys.executable,
        child_env: Mapping[str, str] | None = None,
        params_path: Path = PARAMS_PATH,
        capabilities: mig.CapabilityNodes | None = None,
        ecc_history_path: Path | None = None,
    ) -> None:
        try:
            self._nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            raise GpuError(f"NVML bindings not installed ({exc}): pip install 'scrubgate[gpu]'") from exc
        if max_parallel_scrubs < 1:
            raise GpuError(f"max_parallel_scrubs must be at least 1, got {max_parallel_scrubs}")
        child = ScrubChild(python=python, env=child_env, timeout_s=scrub_timeout_s, max_parallel=max_parallel_scrubs)
        self._capabilities = capabilities or mig.CapabilityNodes()
        self._session = NvmlSession(self._nvml).open
        self._devices = Devices(self._nvml)
        self._scrubber = Scrubber(
            self._nvml,
            self._session,
            self._devices,
            child,
            self._capabilities,
            params_path=params_path,
            chunk_bytes=chunk_bytes,
            min_chunk_bytes=min_chunk_bytes,
            margin_bytes=margin_bytes,
            max_unreachable_fraction=max_unreachable_fraction,
            max_unreachable_bytes=max_unreachable_bytes,
        )
        self._placements = MigPlacements(self._nvml, self._session, self._devices, self._scrubber.scrub)
        with self._session():
            # The inventory at start also learns each GPU's PCI address, by which an operation attaches its GPU alone.
            gpus = {h.uuid: h.handle for _i, h in self._devices.enumerate()[0] if h.parent_uuid is None}
            unpersistent = without_persistence(self._nvml, gpus)
        self._health = GpuHealth(
            self._nvml,
            self._session,
            self._devices,
            unpersistent,
            ecc_history_path=ecc_history_path,
            watch_xids=watch_xids,
            kernel_log=kernel_log,
        )

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._health.close()

    def watch_error(self) -> str | None:
        """Why the XID watch is over, or None while it runs (or was not asked for): /healthz fails on it."""
        return self._health.watch_error()

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resolve(self, uuid: str) -> Handle:
        return device_info.resolve(self._nvml, self._devices, uuid)

    # ------------------------------------------------------------ GpuBackend

    @_in_session
    def list_devices(self) -> list[GpuDevice]:
        """Every GPU and MIG device: attaches every GPU, so for the inventory at start, not for a teardown."""
        return device_info.list_devices(self._nvml, self._devices)

    @_in_session
    def processes(self, uuid: str) -> list[GpuProcess]:
        return device_info.processes(self._nvml, uuid, self._resolve(uuid).handle)

    @_in_session
    def health(self, uuid: str, since: float) -> HealthSnapshot:
        """A MIG device's health is its GPU's: ECC, row remapping and XIDs are per GPU, and the driver names no GPU
        instance in an XID (xid.py), so an XID counts against every MIG device of its GPU."""
        return self._health.snapshot(uuid, self._resolve(uuid), since)

    @_in_session
    def placement_health(self, placement: MigPlacement, since: float) -> HealthSnapshot:
        return self._health.snapshot(placement.parent_uuid, self._resolve(placement.parent_uuid), since)

    def scrub(self, uuid: str) -> ScrubResult:
        return self._scrubber.scrub(uuid)

    def cuda_problem(self) -> str | None:
        """Why this process cannot open a CUDA context and run the scrub's kernels, or None (checked at start)."""
        return self._scrubber.cuda_problem()

    @_in_session
    def placement_processes(self, placement: MigPlacement) -> list[GpuProcess]:
        return self._placements.processes(placement)

    def live_instances(self, gpu_uuid: str) -> list[mig.LiveInstance]:
        """The MIG devices of a GPU in MIG mode, with their placements; raises GpuError."""
        return self._placements.live_instances(gpu_uuid)

    def scratch_instance(self, placement: MigPlacement) -> contextlib.AbstractContextManager[str]:
        """A GPU instance of the placement for the time of the block (mig.scratch_instance): yields its MIG UUID."""
        return self._placements.scratch_instance(placement)

    def scrub_placement(self, placement: MigPlacement) -> ScrubResult:
        return self._placements.scrub(placement)

    def scrub_on_free_disabled(self) -> bool | None:
        return self._scrubber.scrub_on_free_disabled()

    def mig_management_problem(self) -> str | None:
        """Why this process cannot create GPU instances and open them, or None: the MIG config capability's
        device node (named by `DeviceFileMinor` in its /proc file) is made if missing and must open."""
        return self._capabilities.config_problem()
