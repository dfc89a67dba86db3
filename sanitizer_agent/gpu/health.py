"""A GPU's health: its uncorrectable ECC errors since a time (against a baseline sampled every minute), row
remapping, the driver's recovery action and the critical XIDs from the kernel log (xid.py); and which GPUs run
without persistence mode, whose ECC counters cannot be sampled."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import GpuError, HealthSnapshot
from .handles import Devices, Handle
from .nvml_errors import nvml_error_is
from .session import OpenNvml
from .xid import EccBaseline, XidWatcher

log = logging.getLogger(__name__)

# c_nvmlFieldValue_t.valueType -> the member of its value union that holds the number.
_FIELD_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def without_persistence(nvml: Any, gpus: Mapping[str, Any]) -> set[str]:
    """The GPUs (UUID -> handle, NVML open) that run without persistence mode, each named in a warning.

    Without persistence mode the driver tears a GPU's state down when its last client goes, and sets it up
    again at the next attach (each agent operation on the GPU, each scrub): seconds of initialisation each
    time, and the volatile ECC counters start again from 0, so errors during a claim are gone by its teardown.
    Such GPUs are not sampled for the ECC baseline (a sample would be one more attach); the XIDs the driver logs
    for those errors (48, 94, 95) still count, from the kernel log."""
    unpersistent: set[str] = set()
    for uuid, gpu in gpus.items():
        try:
            off = nvml.nvmlDeviceGetPersistenceMode(gpu) == nvml.NVML_FEATURE_DISABLED
        except nvml.NVMLError:
            continue  # not a setting of this GPU or platform
        if off:
            unpersistent.add(uuid)
            log.warning(
                "GPU %s runs without persistence mode: each attach (every agent operation on it, each scrub) "
                "initialises it again (seconds) and resets its volatile ECC counters, so ECC errors during a "
                "claim are seen only through the driver's XIDs (48, 94, 95); run nvidia-persistenced (NVIDIA's "
                "GPU Operator does)",
                uuid,
            )
    return unpersistent


class GpuHealth:
    """Samples the ECC baseline from a thread of its own (and once at start), watches the kernel log's XIDs
    unless told not to, and answers health snapshots from both and from NVML."""

    def __init__(
        self,
        nvml: Any,
        session: OpenNvml,
        devices: Devices,
        unpersistent: set[str],
        *,
        ecc_history_path: Path | None,
        watch_xids: bool,
        kernel_log: Path,
    ) -> None:
        self._nvml = nvml
        self._session = session
        self._devices = devices
        self._ecc = EccBaseline(ecc_history_path)
        # GPUs without persistence mode: not sampled (each sample would attach, so initialise, the GPU again).
        self._unpersistent = unpersistent
        self.sample_ecc()
        self.xids: XidWatcher | None = None
        if watch_xids:
            try:
                by_pci = {pci: uuid for uuid, pci in devices.pci.items()}
                self.xids = XidWatcher(by_pci, kernel_log)
            except OSError as exc:
                raise GpuError(
                    f"cannot read XID events from the kernel log {kernel_log} ({exc}): the agent needs the host's "
                    "/dev/kmsg (the chart runs it privileged, which gives it); or open the backend with "
                    "watch_xids=False to run without them (ECC and row-remapping counters are still checked)"
                ) from exc
        self._closed = threading.Event()
        threading.Thread(target=self._sample_ecc_until_closed, name="scrubgate-ecc-sampler", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        if self.xids is not None:
            self.xids.close()
            self.xids = None

    def watch_error(self) -> str | None:
        """Why the XID watch is over, or None while it runs (or was not asked for): /healthz fails on it."""
        return self.xids.problem() if self.xids is not None else None

    def _sample_ecc_until_closed(self) -> None:
        while not self._closed.wait(self._ecc.sample_every_s):
            self.sample_ecc()

    def sample_ecc(self) -> None:
        """The ECC baseline: each GPU's count every minute (from its own thread, and at open), each GPU in a short
        NVML window of its own, so that a MIG mode change on one GPU never waits on a sample of all."""
        for uuid in [u for u in self._devices.pci if u not in self._unpersistent]:
            now = time.time()
            try:
                with self._session():
                    gpu = self._devices.gpu(uuid)
                    if gpu is None:
                        continue  # gone: its teardowns fail on their own
                    count = _ecc_count(self._nvml, gpu)
            except (GpuError, self._nvml.NVMLError) as exc:
                log.warning("cannot sample the ECC errors of GPU %s: %s", uuid, exc)
                continue
            self._ecc.record(uuid, now, count)

    def snapshot(self, uuid: str, entry: Handle, since: float) -> HealthSnapshot:
        """The health of device `uuid` (`entry`, NVML open): its GPU's, the errors since `since` (unix time)."""
        nvml = self._nvml
        gpu = entry.parent
        gpu_uuid = entry.parent_uuid or entry.uuid
        try:
            ecc = _ecc_count(nvml, gpu)
        except nvml.NVMLError as exc:
            raise GpuError(f"NVML cannot read ECC errors of {uuid}: {exc}", uuid) from exc
        ecc = max(ecc - self._ecc.at(gpu_uuid, since), 0)
        try:
            _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(gpu)
        except nvml.NVMLError as exc:
            if not nvml_error_is(nvml, exc, "NOT_SUPPORTED"):  # before Ampere there is no row remapping
                raise GpuError(f"NVML cannot read remapped rows of {uuid}: {exc}", uuid) from exc
            pending = failed = 0
        return HealthSnapshot(
            ecc_uncorrectable_volatile=int(ecc),
            remapped_rows_pending=bool(pending),
            remapped_rows_failed=bool(failed),
            recovery_action=_recovery_action(nvml, gpu),
            xids=self.xids.since(gpu_uuid, since) if self.xids is not None else (),
        )


def _ecc_count(nvml: Any, gpu: Any) -> int:
    """Volatile uncorrectable ECC errors of a physical GPU; 0 where it has no ECC (or it is off)."""
    try:
        return int(
            nvml.nvmlDeviceGetTotalEccErrors(gpu, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        )
    except nvml.NVMLError as exc:
        if nvml_error_is(nvml, exc, "NOT_SUPPORTED"):
            return 0
        raise


def _recovery_action(nvml: Any, gpu: Any) -> int | None:
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
