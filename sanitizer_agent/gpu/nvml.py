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
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from scrubgate.policies.names import ATTESTATION_METHOD

from . import cuda_scrub, mig
from .base import (
    GpuDevice,
    GpuError,
    GpuProcess,
    HealthSnapshot,
    MigPlacement,
    ProcessKind,
    ScrubResult,
)
from .child import ScrubChild
from .driver_params import PARAMS_PATH, scrub_on_free_disabled
from .handles import Devices, Handle
from .xid import KERNEL_LOG, EccBaseline, XidWatcher

log = logging.getLogger(__name__)

# Scrubs of a dynamic MIG placement whose scratch GPU instance another party destroyed (NVIDIA's driver restarting)
SCRATCH_ATTEMPTS = 3
# What scrub() reads from cuda_scrub.py's report.
_REPORT_NUMBERS = ("bytesScrubbed", "scrubS", "nonzeroWords", "wordBytes")
# The scrub's own CUDA context and the allocator's granularity stay out of reach: about 0.3-0.5 GiB of a
# 141 GB GPU; more than this share of the usable memory unreached, or more than this many bytes (the
# policy's scrubCoverage, whose defaults these are), fails the scrub.
DEFAULT_MAX_UNREACHABLE = 0.02
DEFAULT_MAX_UNREACHABLE_BYTES = 1 << 30
# Scrub processes at once (child.py): the agent tears down up to 16 claims at once, which must not all scrub at
# once inside the DaemonSet's 4 GiB memory limit. The rest wait for a slot.
DEFAULT_MAX_PARALLEL_SCRUBS = 4
# c_nvmlFieldValue_t.valueType -> the member of its value union that holds the number.
_FIELD_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

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

    method = ATTESTATION_METHOD

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
        self.chunk_bytes = chunk_bytes
        self.min_chunk_bytes = min_chunk_bytes
        self.margin_bytes = margin_bytes
        # Memory the scrub could not allocate (its own CUDA context, allocator granularity, the driver's
        # own) beyond this share of the usable memory means the scrub cannot vouch for the device.
        self.max_unreachable_fraction = max_unreachable_fraction
        self.max_unreachable_bytes = max_unreachable_bytes
        if max_parallel_scrubs < 1:
            raise GpuError(f"max_parallel_scrubs must be at least 1, got {max_parallel_scrubs}")
        self._child = ScrubChild(
            python=python, env=child_env, timeout_s=scrub_timeout_s, max_parallel=max_parallel_scrubs
        )
        self.params_path = params_path
        self.capabilities = capabilities or mig.CapabilityNodes()
        self._sessions = 0
        self._session_lock = threading.Lock()
        self._devices = Devices(self._nvml)
        self._xids: XidWatcher | None = None
        self._ecc = EccBaseline(ecc_history_path)
        # GPUs without persistence mode: not sampled (each sample would attach, so initialise, the GPU again).
        self._unpersistent: set[str] = set()
        with self._session():
            gpus = {h.uuid: h.handle for _i, h in self._devices.enumerate()[0] if h.parent_uuid is None}
            self._warn_without_persistence(gpus)
        self._sample_ecc()
        if watch_xids:
            try:
                by_pci = {pci: uuid for uuid, pci in self._devices.pci.items()}
                self._xids = XidWatcher(by_pci, kernel_log)
            except OSError as exc:
                raise GpuError(
                    f"cannot read XID events from the kernel log {kernel_log} ({exc}): the agent needs the host's "
                    "/dev/kmsg (the chart runs it privileged, which gives it); or open the backend with "
                    "watch_xids=False to run without them (ECC and row-remapping counters are still checked)"
                ) from exc
        self._closed = threading.Event()
        threading.Thread(target=self._sample_ecc_until_closed, name="scrubgate-ecc-sampler", daemon=True).start()

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._closed.set()
        if self._xids is not None:
            self._xids.close()
            self._xids = None

    def watch_error(self) -> str | None:
        """Why the XID watch is over, or None while it runs (or was not asked for): /healthz fails on it."""
        return self._xids.problem() if self._xids is not None else None

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """NVML open for the block; operations that overlap (teardowns in parallel) share one session."""
        with self._session_lock:
            if self._sessions == 0:
                try:
                    self._nvml.nvmlInit()
                except self._nvml.NVMLError as exc:
                    raise GpuError(f"NVML could not start: {exc}; is the NVIDIA driver loaded on this node?") from exc
            self._sessions += 1
        try:
            yield
        finally:
            with self._session_lock:
                self._sessions -= 1
                if self._sessions == 0:
                    try:
                        self._nvml.nvmlShutdown()
                    except self._nvml.NVMLError as exc:
                        log.warning("NVML shutdown failed: %s", exc)

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ helpers

    def _is(self, exc: Exception, name: str) -> bool:
        return getattr(exc, "value", None) == getattr(self._nvml, f"NVML_ERROR_{name}")

    def _lookup(self, uuid: str) -> Handle | None:
        try:
            return self._devices.lookup(uuid)
        except self._nvml.NVMLError as exc:
            raise GpuError(f"NVML cannot reach device {uuid}: {exc}", uuid) from exc

    def _resolve(self, uuid: str) -> Handle:
        entry = self._lookup(uuid)
        if entry is None:
            raise GpuError(f"GPU device {uuid} not found by NVML (gone, or not on this node)", uuid)
        return entry

    def _memory(self, handle: Any) -> tuple[int, int, int]:
        """(total, reserved, free) in bytes; reserved needs NVML's v2 memory info (driver >= 510)."""
        nvml = self._nvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                return int(info.total), int(info.reserved), int(info.free)
            except nvml.NVMLError as exc:
                if not any(
                    self._is(exc, n) for n in ("FUNCTION_NOT_FOUND", "NOT_SUPPORTED", "ARGUMENT_VERSION_MISMATCH")
                ):
                    raise
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), 0, int(info.free)

    # ------------------------------------------------------------ GpuBackend

    @_in_session
    def list_devices(self) -> list[GpuDevice]:
        """Every GPU and MIG device: attaches every GPU, so for the inventory at start, not for a teardown."""
        entries, errors = self._devices.enumerate()
        for error in errors:
            # Left out, not guessed at: the agent keeps any device it cannot see fenced.
            log.warning("NVML could not read a GPU, leaving it out of the inventory: %s", error)
        devices = []
        for index, entry in entries:
            try:
                total, reserved, free = self._memory(entry.handle)
                name = self._nvml.nvmlDeviceGetName(entry.handle)
            except self._nvml.NVMLError as exc:
                log.warning("NVML could not read device %s, leaving it out of the inventory: %s", entry.uuid, exc)
                continue
            devices.append(GpuDevice(entry.uuid, index, name, entry.parent_uuid, total, reserved, free))
        return devices

    @_in_session
    def processes(self, uuid: str) -> list[GpuProcess]:
        return self._processes(uuid, self._resolve(uuid).handle)

    def _processes(self, uuid: str, handle: Any) -> list[GpuProcess]:
        nvml = self._nvml
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
                if self._is(exc, "NOT_SUPPORTED"):  # e.g. graphics on a MIG device
                    continue
                raise GpuError(f"NVML cannot list {kind} processes on {uuid}: {exc}", uuid) from exc
            for info in infos:
                found.setdefault((info.pid, kind), GpuProcess(int(info.pid), kind, info.usedGpuMemory))
        return list(found.values())

    def _ecc_count(self, gpu: Any) -> int:
        """Volatile uncorrectable ECC errors of a physical GPU; 0 where it has no ECC (or it is off)."""
        nvml = self._nvml
        try:
            return int(
                nvml.nvmlDeviceGetTotalEccErrors(gpu, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            )
        except nvml.NVMLError as exc:
            if self._is(exc, "NOT_SUPPORTED"):
                return 0
            raise

    def _warn_without_persistence(self, gpus: Mapping[str, Any]) -> None:
        """Without persistence mode the driver tears a GPU's state down when its last client goes, and sets it up
        again at the next attach (each agent operation on the GPU, each scrub): seconds of initialisation each
        time, and the volatile ECC counters start again from 0, so errors during a claim are gone by its teardown.
        Such GPUs are not sampled for the ECC baseline (a sample would be one more attach); the XIDs the driver logs
        for those errors (48, 94, 95) still count, from the kernel log."""
        for uuid, gpu in gpus.items():
            try:
                off = self._nvml.nvmlDeviceGetPersistenceMode(gpu) == self._nvml.NVML_FEATURE_DISABLED
            except self._nvml.NVMLError:
                continue  # not a setting of this GPU or platform
            if off:
                self._unpersistent.add(uuid)
                log.warning(
                    "GPU %s runs without persistence mode: each attach (every agent operation on it, each scrub) "
                    "initialises it again (seconds) and resets its volatile ECC counters, so ECC errors during a "
                    "claim are seen only through the driver's XIDs (48, 94, 95); run nvidia-persistenced (NVIDIA's "
                    "GPU Operator does)",
                    uuid,
                )

    def _sample_ecc_until_closed(self) -> None:
        while not self._closed.wait(self._ecc.sample_every_s):
            self._sample_ecc()

    def _sample_ecc(self) -> None:
        """The ECC baseline: each GPU's count every minute (from its own thread, and at open), each GPU in a short
        NVML window of its own, so that a MIG mode change on one GPU never waits on a sample of all."""
        for uuid in [u for u in self._devices.pci if u not in self._unpersistent]:
            now = time.time()
            try:
                with self._session():
                    gpu = self._devices.gpu(uuid)
                    if gpu is None:
                        continue  # gone: its teardowns fail on their own
                    count = self._ecc_count(gpu)
            except (GpuError, self._nvml.NVMLError) as exc:
                log.warning("cannot sample the ECC errors of GPU %s: %s", uuid, exc)
                continue
            self._ecc.record(uuid, now, count)

    @_in_session
    def health(self, uuid: str, since: float) -> HealthSnapshot:
        """A MIG device's health is its GPU's: ECC, row remapping and XIDs are per GPU, and the driver names no GPU
        instance in an XID (xid.py), so an XID counts against every MIG device of its GPU."""
        return self._health(uuid, self._resolve(uuid), since)

    @_in_session
    def placement_health(self, placement: MigPlacement, since: float) -> HealthSnapshot:
        return self._health(placement.parent_uuid, self._resolve(placement.parent_uuid), since)

    def _health(self, uuid: str, entry: Handle, since: float) -> HealthSnapshot:
        nvml = self._nvml
        gpu = entry.parent
        gpu_uuid = entry.parent_uuid or entry.uuid
        try:
            ecc = self._ecc_count(gpu)
        except nvml.NVMLError as exc:
            raise GpuError(f"NVML cannot read ECC errors of {uuid}: {exc}", uuid) from exc
        ecc = max(ecc - self._ecc.at(gpu_uuid, since), 0)
        try:
            _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(gpu)
        except nvml.NVMLError as exc:
            if not self._is(exc, "NOT_SUPPORTED"):  # before Ampere there is no row remapping
                raise GpuError(f"NVML cannot read remapped rows of {uuid}: {exc}", uuid) from exc
            pending = failed = 0
        return HealthSnapshot(
            ecc_uncorrectable_volatile=int(ecc),
            remapped_rows_pending=bool(pending),
            remapped_rows_failed=bool(failed),
            recovery_action=self._recovery_action(gpu),
            xids=self._xids.since(gpu_uuid, since) if self._xids is not None else (),
        )

    def _recovery_action(self, gpu: Any) -> int | None:
        nvml = self._nvml
        field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            return None
        try:
            value = nvml.nvmlDeviceGetFieldValues(gpu, [field])[0]
        except nvml.NVMLError:
            return None  # a driver older than the field
        if value.nvmlReturn != nvml.NVML_SUCCESS:
            return None
        member = _FIELD_VALUE_MEMBER.get(int(value.valueType))
        return int(getattr(value.value, member)) if member else None

    def _scrub_target(self, uuid: str) -> tuple[bool | None, int, int, str | None]:
        """(ECC on, total and reserved bytes, why the device cannot be scrubbed or None), read with NVML open."""
        entry = self._lookup(uuid)
        if entry is None:
            why = (
                f"device {uuid} no longer exists (a dynamically created MIG device is destroyed when the claim is "
                "unprepared): its memory cannot be reached to verify it"
            )
            return None, 0, 0, why
        ecc = self._ecc_enabled(entry.parent)
        if entry.mig_enabled:
            why = (
                f"GPU {uuid} is in MIG mode: CUDA cannot reach its memory as a whole; scrub it with MIG disabled, "
                "or scrub each of its MIG devices"
            )
            return ecc, 0, 0, why
        holders = self._processes(uuid, entry.handle)
        if holders:
            pids = ", ".join(str(p.pid) for p in holders)
            return ecc, 0, 0, f"device {uuid} is still held by pid {pids}; their memory cannot be scrubbed"
        try:
            total, reserved, _free = self._memory(entry.handle)
        except self._nvml.NVMLError as exc:
            raise GpuError(f"NVML cannot read memory of {uuid}: {exc}", uuid) from exc
        if entry.parent_uuid is not None:
            # A MIG device created after the agent started (NVIDIA's dynamic MIG, the scrub's own instance) has
            # capability nodes this container's /dev lacks: without them CUDA does not see it.
            try:
                self.capabilities.mig_device(
                    int(self._nvml.nvmlDeviceGetMinorNumber(entry.parent)),
                    int(self._nvml.nvmlDeviceGetGpuInstanceId(entry.handle)),
                    int(self._nvml.nvmlDeviceGetComputeInstanceId(entry.handle)),
                )
            except (GpuError, self._nvml.NVMLError) as exc:
                return ecc, total, reserved, f"cannot open MIG device {uuid} for its scrub: {exc}"
        return ecc, total, reserved, None

    def scrub(self, uuid: str) -> ScrubResult:
        started = time.monotonic()
        disabled = self.scrub_on_free_disabled()
        scrub_on_free = None if disabled is None else not disabled
        # NVML open for the checks, not while the scrub runs (see the module's docstring).
        with self._session():
            ecc, total, reserved, why_not = self._scrub_target(uuid)
        report: dict[str, Any] = {}

        def result(verified: bool, reason: str | None, scrubbed: int = 0) -> ScrubResult:
            rss = report.get("maxRssBytes")
            return ScrubResult(
                uuid=uuid,
                bytes_scrubbed=scrubbed,
                bytes_total=total,
                bytes_reserved=reserved,
                bytes_unreachable=max(total - reserved - scrubbed, 0),
                duration_s=time.monotonic() - started,
                verified=verified,
                method=self.method,
                reason=reason,
                kernel_s=float(report["scrubS"]) if "scrubS" in report else None,
                kernels=str(report["kernels"]) if "kernels" in report else None,
                scrub_on_free=scrub_on_free,
                ecc_enabled=ecc,
                host_rss_bytes=int(rss) if isinstance(rss, int) else None,
            )

        if why_not is not None:
            return result(False, why_not)
        report, failure = self._child.run(
            uuid,
            [
                f"--chunk-bytes={self.chunk_bytes}",
                f"--min-chunk-bytes={self.min_chunk_bytes}",
                f"--margin-bytes={self.margin_bytes}",
            ],
        )
        if failure is None and not all(isinstance(report.get(key), int | float) for key in _REPORT_NUMBERS):
            report, failure = {}, f"scrub of {uuid} gave a malformed report: {json.dumps(report)[:500]}"
        if failure is not None:
            return result(False, failure)
        scrubbed = int(report["bytesScrubbed"])
        if report.get("kernelErrors"):
            log.warning("scrub of %s verified with %s: %s", uuid, report["kernels"], "; ".join(report["kernelErrors"]))
        nonzero = int(report["nonzeroWords"])
        usable = total - reserved
        if nonzero:
            reason = (
                f"verification found {nonzero} non-zero {report['wordBytes']}-byte words on {uuid} "
                "after zeroing: memory does not hold writes, or something wrote to it during the scrub"
            )
            return result(False, reason, scrubbed)
        unreachable = max(usable - scrubbed, 0)
        allowed = min(int(self.max_unreachable_fraction * usable), self.max_unreachable_bytes)
        if scrubbed <= 0 or unreachable > allowed:
            reason = (
                f"scrub of {uuid} reached only {scrubbed} of {usable} usable bytes; {unreachable} could not "
                f"be allocated (held by another process or the driver), more than the {allowed} allowed "
                f"({self.max_unreachable_fraction:.1%} and at most {self.max_unreachable_bytes} bytes), so they "
                "are unverified"
            )
            return result(False, reason, scrubbed)
        if unreachable and scrub_on_free is not True:
            why = (
                "the kernel driver runs with RMDisableScrubOnFree set, so nothing zeroes them before they are "
                "handed out again; remove RMDisableScrubOnFree from NVreg_RegistryDwords"
                if scrub_on_free is False
                else f"whether the kernel driver zeroes freed memory cannot be read ({self.params_path}), so "
                "nothing says they were zeroed; mount the host's /proc/driver/nvidia into the agent"
            )
            reason = f"{unreachable} bytes of {uuid} were out of the scrub's reach (its own CUDA context, the driver's), and {why}"
            return result(False, reason, scrubbed)
        return result(True, None, scrubbed)

    def cuda_problem(self) -> str | None:
        """Why this process cannot open a CUDA context and run the scrub's kernels, or None: the start-up check,
        once, on one idle device (a whole GPU out of MIG mode, else a MIG device), so that a broken CUDA setup
        (bindings, libcuda, device nodes) is named at start rather than at the first teardown."""
        with self._session():
            entries, _errors = self._devices.enumerate()
            whole_first = sorted((h.uuid for _i, h in entries), key=lambda u: u not in self._devices.pci)
            target = next((u for u in whole_first if self._scrub_target(u)[3] is None), None)
        if target is None:
            log.info("no idle device for the CUDA check at start: CUDA is first used by the first scrub")
            return None
        report, failure = self._child.run(target, ["--check"])
        if failure is not None:
            return failure
        log.info(
            "CUDA check on %s: driver API %s, kernels %s%s",
            target,
            report.get("cudaDriverVersion"),
            report.get("kernels"),
            f" ({'; '.join(report['kernelErrors'])})" if report.get("kernelErrors") else "",
        )
        return None

    @_in_session
    def placement_processes(self, placement: MigPlacement) -> list[GpuProcess]:
        gpu = self._resolve(placement.parent_uuid)
        if not gpu.mig_enabled:
            return self._processes(gpu.uuid, gpu.handle)  # MIG off again: the placement is part of the GPU
        overlapping = [live for live in self.live_instances(placement.parent_uuid) if live.overlaps(placement)]
        return [p for live in overlapping for p in self._processes(live.uuid, live.handle)]

    def live_instances(self, gpu_uuid: str) -> list[mig.LiveInstance]:
        """The MIG devices of a GPU in MIG mode, with their placements; raises GpuError."""
        with self._session():
            gpu = self._resolve(gpu_uuid)
            try:
                found = mig.live_instances(self._nvml, gpu.handle)
            except self._nvml.NVMLError as exc:
                raise GpuError(f"NVML cannot list the MIG devices of {gpu_uuid}: {exc}", gpu_uuid) from exc
        for live in found:
            self._devices.note_parent(live.uuid, gpu_uuid)
        return found

    @contextlib.contextmanager
    def scratch_instance(self, placement: MigPlacement) -> Iterator[str]:
        """A GPU instance of the placement for the time of the block (mig.scratch_instance): yields its MIG UUID."""
        with mig.scratch_instance(self._nvml, self._session, placement, self._devices.gpu) as uuid:
            self._devices.note_parent(uuid, placement.parent_uuid)
            yield uuid

    def scrub_placement(self, placement: MigPlacement) -> ScrubResult:
        for attempt in range(1, SCRATCH_ATTEMPTS + 1):
            try:
                return self._scrub_placement_once(placement)
            except mig.ScratchInstanceGone as exc:
                # NVIDIA's driver restarted mid-scrub: the way in is chosen again (its start may also have
                # turned MIG off, and the placement is then scrubbed through the whole GPU).
                if attempt == SCRATCH_ATTEMPTS:
                    return _unverified(placement, f"cannot scrub {_where(placement)}: {exc}, {attempt} times")
                log.warning("%s; scrubbing %s again", exc, _where(placement))
            except GpuError as exc:
                return _unverified(placement, f"cannot scrub {_where(placement)}: {exc}")
        raise AssertionError("unreachable: the last attempt returns")

    def _scrub_placement_once(self, placement: MigPlacement) -> ScrubResult:
        parent = placement.parent_uuid
        # NVML open to choose the way in, closed again before the scrub runs (scrub() opens it for its checks).
        with self._session():
            gpu = self._resolve(parent)
            if not gpu.mig_enabled:
                # NVIDIA's driver turned MIG off after the last MIG device went: the placement's memory is now
                # part of the whole GPU, which its teardown fences as well (it shares the memory slices).
                through: str | None = parent
            else:
                live = [m for m in self.live_instances(parent) if m.overlaps(placement)]
                if len(live) == 1 and live[0].is_at(placement):
                    through = live[0].uuid  # not unprepared yet: the same memory, through the same device
                elif live:
                    held = ", ".join(f"{m.uuid} (slices {m.start}..{m.start + m.size - 1})" for m in live)
                    return _unverified(placement, f"memory slices of {_where(placement)} are held by MIG device {held}")
                else:
                    through = None
        if through is not None:
            return self.scrub(through)
        with self.scratch_instance(placement) as uuid:
            return self.scrub(uuid)

    def scrub_on_free_disabled(self) -> bool | None:
        return scrub_on_free_disabled(self.params_path)

    def _ecc_enabled(self, gpu: Any) -> bool | None:
        """The physical GPU's current ECC mode; None where NVML cannot say (no ECC on the model, a lost GPU)."""
        if gpu is None:
            return None
        try:
            current, _pending = self._nvml.nvmlDeviceGetEccMode(gpu)
        except self._nvml.NVMLError:
            return None
        return current == self._nvml.NVML_FEATURE_ENABLED

    def mig_management_problem(self) -> str | None:
        """Why this process cannot create GPU instances and open them, or None: the MIG config capability's
        device node (named by `DeviceFileMinor` in its /proc file) is made if missing and must open."""
        return self.capabilities.config_problem()


def _where(placement: MigPlacement) -> str:
    end = placement.start + placement.size - 1
    return f"GPU {placement.parent_uuid} memory slices {placement.start}..{end} (GI profile {placement.profile_id})"


def _unverified(placement: MigPlacement, reason: str) -> ScrubResult:
    return ScrubResult(
        uuid=placement.parent_uuid,
        bytes_scrubbed=0,
        bytes_total=0,
        bytes_reserved=0,
        bytes_unreachable=0,
        duration_s=0.0,
        verified=False,
        method=NvmlBackend.method,
        reason=reason,
    )
