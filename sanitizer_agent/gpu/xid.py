"""XID events from NVML, kept so that health() can answer "which critical XIDs hit this device since t".

As NVIDIA's DRA driver does: every XID counts except the application ones (a tenant's own faults), a
failed wait is retried (only "GPU is lost" ends the watch: health checks then fail until a restart), and
an XID NVML reports with a GPU instance ID belongs to that MIG device (and to the GPU it is carved from),
not to its siblings. NVML keeps no history: XIDs before the watch started are not seen; the ECC and
row-remapping counters, which persist, cover the memory faults among them.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import GpuError, critical_xid

log = logging.getLogger(__name__)

# XID events kept; a node sees a handful a day, this is weeks of them.
HISTORY = 4096
# nvmlEventData_t.gpuInstanceId for an event of the whole GPU.
WHOLE_GPU = 0xFFFFFFFF
UNKNOWN_GPU = "?"


@dataclass(frozen=True)
class XidEvent:
    at: float
    gpu_uuid: str  # UNKNOWN_GPU when NVML could not name the GPU: it then counts against every GPU
    gpu_instance: int  # WHOLE_GPU, or the MIG device's GPU instance ID
    xid: int
    # The memory slices of that GPU instance when the event came (a dynamic MIG device may be gone by the
    # time its teardown asks); None for the whole GPU, or when NVML could not say.
    slices: frozenset[int] | None = None

    def hits(self, gpu_instance: int | None, slices: frozenset[int] | None) -> bool:
        """Whether the event concerns a MIG device (by GPU instance ID, or by memory slices)."""
        if self.gpu_instance == WHOLE_GPU:
            return True
        if gpu_instance is not None and self.gpu_instance == gpu_instance:
            return True
        if slices is not None:
            return self.slices is None or bool(self.slices & slices)
        return gpu_instance is None


class XidWatcher:
    """Collects XID events from NVML in a thread; `on_poll` runs after every wait (the ECC sampler)."""

    def __init__(
        self,
        nvml: Any,
        gpus: Mapping[str, Any],
        poll_ms: int = 500,
        retry_s: float = 1.0,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        self._nvml = nvml
        self._poll_ms = poll_ms
        self._retry_s = retry_s
        self._on_poll = on_poll
        self._events: collections.deque[XidEvent] = collections.deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: str | None = None  # set when the GPU is lost: the watch is over
        self.wait_errors = 0  # failed waits retried so far
        self._set = nvml.nvmlEventSetCreate()
        for uuid, handle in gpus.items():
            try:
                supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if supported & nvml.nvmlEventTypeXidCriticalError:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._set)
                else:
                    log.warning("GPU %s does not report XID events; health checks see ECC and rows only", uuid)
            except nvml.NVMLError as exc:
                log.warning("cannot watch XID events of GPU %s: %s; health checks see ECC and rows only", uuid, exc)
        self._thread = threading.Thread(target=self._run, name="scrubgate-xid-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nvml = self._nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(self._set, self._poll_ms)
            except nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == nvml.NVML_ERROR_TIMEOUT:
                    self._poll()
                    continue
                if code == nvml.NVML_ERROR_GPU_IS_LOST:
                    self.error = str(exc)
                    log.error("XID event watch stopped: %s; health checks now fail until the agent restarts", exc)
                    return
                self.wait_errors += 1
                log.warning("waiting for XID events failed (%s); retrying in %.1fs", exc, self._retry_s)
                self._stop.wait(self._retry_s)
                continue
            self._poll()
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                self._record(data)

    def _poll(self) -> None:
        if self._on_poll is not None:
            self._on_poll()

    def _record(self, data: Any) -> None:
        try:
            uuid = self._nvml.nvmlDeviceGetUUID(data.device)
        except self._nvml.NVMLError as exc:
            uuid = UNKNOWN_GPU
            log.warning("XID %d from a GPU NVML cannot name: %s", data.eventData, exc)
        gpu_instance = int(getattr(data, "gpuInstanceId", WHOLE_GPU))
        slices = None if gpu_instance == WHOLE_GPU else self._slices_of(data.device, gpu_instance)
        where = "" if gpu_instance == WHOLE_GPU else f" (GPU instance {gpu_instance}, memory slices {slices})"
        log.warning("XID %d on GPU %s%s", data.eventData, uuid, where)
        with self._lock:
            self._events.append(XidEvent(time.time(), uuid, gpu_instance, int(data.eventData), slices))

    def _slices_of(self, gpu: Any, gpu_instance: int) -> frozenset[int] | None:
        nvml = self._nvml
        try:
            info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(gpu, gpu_instance))
        except nvml.NVMLError as exc:
            log.warning("cannot read the memory slices of GPU instance %d: %s", gpu_instance, exc)
            return None
        return frozenset(range(int(info.placement.start), int(info.placement.start) + int(info.placement.size)))

    def since(
        self, gpu_uuid: str, since: float, gpu_instance: int | None = None, slices: frozenset[int] | None = None
    ) -> tuple[int, ...]:
        """Critical XIDs since `since` on the GPU; with `gpu_instance` or `slices`, on that MIG device or
        placement (and the whole GPU's) only. An event NVML could not attribute counts everywhere: fail
        closed."""
        if self.error is not None:
            raise GpuError(f"XID events of {gpu_uuid} unknown: the NVML event watch stopped ({self.error})", gpu_uuid)
        with self._lock:
            return tuple(
                e.xid
                for e in self._events
                if e.at >= since
                and e.gpu_uuid in (gpu_uuid, UNKNOWN_GPU)
                and e.hits(gpu_instance, slices)
                and critical_xid(e.xid)
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._poll_ms / 1000 * 4 + self._retry_s)
        try:
            self._nvml.nvmlEventSetFree(self._set)
        except self._nvml.NVMLError as exc:
            log.warning("freeing the NVML event set failed: %s", exc)


class EccBaseline:
    """Each GPU's volatile uncorrectable ECC count over time, so that health counts only the errors since a
    device was allocated: one old error must not fence a GPU forever.

    Sampled every few seconds; kept as the first sample and every change (a few entries per GPU, however long
    a claim runs), and in `path` (the agent's state directory) so that a restarted agent still knows the
    count at allocations made before it. A count that went down means the driver was reloaded: the history
    starts again. Where no history reaches back to the allocation, the baseline is 0: every error since
    driver load counts (fail closed)."""

    def __init__(self, path: Path | None = None, sample_every_s: float = 10.0) -> None:
        self.path = path
        self.sample_every_s = sample_every_s
        self._changes: dict[str, list[tuple[float, int]]] = {}  # GPU -> [(first sample), (each change)...]
        self._seen: dict[str, float] = {}  # GPU -> time of the last sample (this process)
        self._lock = threading.Lock()
        if path is not None:
            try:
                loaded = json.loads(path.read_text())
                self._changes = {uuid: [(float(t), int(c)) for t, c in changes] for uuid, changes in loaded.items()}
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("ignoring the ECC history %s (%s): baselines start now", path, exc)

    def due(self, gpu_uuid: str, now: float) -> bool:
        with self._lock:
            return now - self._seen.get(gpu_uuid, float("-inf")) >= self.sample_every_s

    def record(self, gpu_uuid: str, at: float, count: int) -> None:
        with self._lock:
            self._seen[gpu_uuid] = at
            changes = self._changes.get(gpu_uuid)
            if changes and count == changes[-1][1]:
                return
            if not changes or count < changes[-1][1]:  # a first sample, or a driver reload
                self._changes[gpu_uuid] = [(at, count)]
            else:
                changes.append((at, count))
                del changes[1:-HISTORY]
            self._save()

    def at(self, gpu_uuid: str, since: float) -> int:
        with self._lock:
            changes = self._changes.get(gpu_uuid, [])
            older = [count for at, count in changes if at <= since]
        return older[-1] if older else 0

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(self._changes))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot keep the ECC history in %s: %s", self.path, exc)
