"""The GPU side of a teardown's steps: what still runs on its devices (the drain), their scrub (one at a time per
device), and their health after it; StepFailed where the teardown has to fail."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from .checkpoint import DeviceRecord, ScrubRecord, Teardown
from .gpu import GpuBackend, GpuError, HealthSnapshot
from .metrics import AgentMetrics
from .partitions import device_health, device_processes, scrub_device


class StepFailed(Exception):
    """The teardown fails: `category` (the start of its `failed:` status, a metric label) and what happened."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail


class GpuSteps:
    def __init__(self, backend: GpuBackend, metrics: AgentMetrics) -> None:
        self.backend = backend
        self.metrics = metrics
        self._scrubbing: dict[str, threading.Lock] = {}  # what `_scrub_of` keys a device by -> held meanwhile
        self._scrubbing_lock = threading.Lock()

    def holders(self, td: Teardown) -> list[str]:
        """The processes still on the teardown's devices, each as `pid <pid> (<kind>) on <device>`."""
        holders = []
        for device in td.devices:
            if device.uuid is None and device.placement is None:
                continue  # fails in scrubbing, with the reason
            try:
                where = device.uuid or device.key
                holders += [f"pid {p.pid} ({p.kind}) on {where}" for p in device_processes(self.backend, device)]
            except GpuError as exc:
                raise StepFailed("gpu-error", f"cannot list processes on {device.key} ({device.uuid}): {exc}") from exc
        return holders

    def scrub(self, td: Teardown) -> tuple[list[DeviceRecord], dict[str, Any]]:
        """Scrubs the teardown's devices, then reads their health since the allocation: the devices with their
        scrubs recorded, and the `health` object of the attestation."""
        scrubbed = []
        for device in td.devices:
            if device.uuid is None and device.placement is None:
                raise StepFailed(
                    "no-uuid",
                    f"{device.key} has no uuid attribute in this node's ResourceSlices; cannot tell which GPU to scrub",
                )
            try:
                with self._scrub_of(device):
                    result = scrub_device(self.backend, device)
            except GpuError as exc:
                raise StepFailed("gpu-error", f"cannot reach {device.key} ({device.uuid}) to scrub it: {exc}") from exc
            self.metrics.scrub_duration.observe(result.duration_s)
            self.metrics.scrubbed_bytes.inc(result.bytes_scrubbed)
            if not result.verified:
                raise StepFailed("scrub-failed", f"{device.key} ({device.uuid}): {result.reason or 'not verified'}")
            # The checkpoint keeps the backend's result under the same field names.
            record = ScrubRecord.model_validate(result, from_attributes=True)
            scrubbed.append(device.model_copy(update={"scrub": record}))
        snapshots = []
        for device in td.devices:
            try:
                snapshots.append(device_health(self.backend, device, td.allocated_at))
            except GpuError as exc:
                raise StepFailed("gpu-error", f"cannot read the health of {device.key} ({device.uuid}): {exc}") from exc
        problems = [f"{d.uuid}: {p}" for d, s in zip(td.devices, snapshots, strict=True) for p in s.problems()]
        if problems:
            raise StepFailed("unhealthy", "; ".join(problems))
        return scrubbed, _merge_health(snapshots)

    @contextlib.contextmanager
    def _scrub_of(self, device: DeviceRecord) -> Iterator[None]:
        """One scrub at a time per device (two teardowns of one device: a shared claim). Devices with UUIDs of
        their own, MIG slices of one GPU among them, are scrubbed side by side, as MIG isolates them; dynamic
        MIG placements one at a time per GPU, since scrubbing one creates a GPU instance on it."""
        key = device.placement.parent_uuid if device.placement is not None else device.uuid or device.key
        with self._scrubbing_lock:
            lock = self._scrubbing.setdefault(key, threading.Lock())
        with lock:
            yield


def _merge_health(snapshots: list[HealthSnapshot]) -> dict[str, Any]:
    """One `health` object for the attestation over all of the claim's devices."""
    return {
        "eccUncorrectable": sum(s.ecc_uncorrectable_volatile for s in snapshots),
        "remapPending": any(s.remapped_rows_pending for s in snapshots),
        "xids": sorted({x for s in snapshots for x in s.xids}),
    }
