"""MIG placements, the memory slices of a GPU whose MIG device NVIDIA's DRA driver creates and deletes: the MIG
devices that overlap one now, the processes on them, and the scrub of its slices through whichever device reaches
them now (the live MIG device, the whole GPU once MIG is off, or a scratch GPU instance of mig.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from scrubgate.policies.names import ATTESTATION_METHOD

from . import device_info, mig
from .base import GpuError, GpuProcess, MigPlacement, ScrubResult
from .handles import Devices
from .session import OpenNvml

log = logging.getLogger(__name__)

# Scrubs of a dynamic MIG placement whose scratch GPU instance another party destroyed (NVIDIA's driver restarting)
SCRATCH_ATTEMPTS = 3


class MigPlacements:
    """The placement operations of the backend, over its NVML session, device handles and scrub."""

    def __init__(self, nvml: Any, session: OpenNvml, devices: Devices, scrub: Callable[[str], ScrubResult]) -> None:
        self._nvml = nvml
        self._session = session
        self._devices = devices
        self._scrub = scrub  # of one device by UUID (Scrubber.scrub): opens NVML for its checks only

    def processes(self, placement: MigPlacement) -> list[GpuProcess]:
        """Processes on the MIG devices that overlap the placement, with NVML open (the caller's session)."""
        gpu = device_info.resolve(self._nvml, self._devices, placement.parent_uuid)
        if not gpu.mig_enabled:
            return device_info.processes(self._nvml, gpu.uuid, gpu.handle)  # MIG off again: part of the GPU
        overlapping = [live for live in self.live_instances(placement.parent_uuid) if live.overlaps(placement)]
        return [p for live in overlapping for p in device_info.processes(self._nvml, live.uuid, live.handle)]

    def live_instances(self, gpu_uuid: str) -> list[mig.LiveInstance]:
        """The MIG devices of a GPU in MIG mode, with their placements; raises GpuError."""
        with self._session():
            gpu = device_info.resolve(self._nvml, self._devices, gpu_uuid)
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

    def scrub(self, placement: MigPlacement) -> ScrubResult:
        for attempt in range(1, SCRATCH_ATTEMPTS + 1):
            try:
                return self._scrub_once(placement)
            except mig.ScratchInstanceGone as exc:
                # NVIDIA's driver restarted mid-scrub: the way in is chosen again (its start may also have
                # turned MIG off, and the placement is then scrubbed through the whole GPU).
                if attempt == SCRATCH_ATTEMPTS:
                    return _unverified(placement, f"cannot scrub {_where(placement)}: {exc}, {attempt} times")
                log.warning("%s; scrubbing %s again", exc, _where(placement))
            except GpuError as exc:
                return _unverified(placement, f"cannot scrub {_where(placement)}: {exc}")
        raise AssertionError("unreachable: the last attempt returns")

    def _scrub_once(self, placement: MigPlacement) -> ScrubResult:
        parent = placement.parent_uuid
        # NVML open to choose the way in, closed again before the scrub runs (the scrub opens it for its checks).
        with self._session():
            gpu = device_info.resolve(self._nvml, self._devices, parent)
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
            return self._scrub(through)
        with self.scratch_instance(placement) as uuid:
            return self._scrub(uuid)


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
        method=ATTESTATION_METHOD,
        reason=reason,
    )
