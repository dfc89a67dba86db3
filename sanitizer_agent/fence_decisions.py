"""Which teardowns are fenced, and why: the decision to fence, checkpointed before the fences go up (`fences.py`
writes them), the fences made sure of once per process, and lifted once the scrub is attested; and the devices of
the node a teardown owes a fence for sharing memory with its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from scrubgate.policies import names

from .checkpoint import (
    DIRTY_STATES,
    OWED_STATES,
    CheckpointStore,
    DeviceRecord,
    FenceReason,
    OverlapRecord,
    State,
    Teardown,
)
from .claims import DeviceKey, SliceDevice, key_str, overlapping
from .fences import Fencer, rule_name
from .metrics import AgentMetrics

log = logging.getLogger(__name__)

_FENCE_WHY = {
    FenceReason.NOT_HELD: "its allocation does not keep them from other claims",
    FenceReason.ALLOCATION_LOST: "its allocation is gone before their scrub was attested",
    FenceReason.FAILED: "the teardown failed",
    FenceReason.HAND_OVER: "the agent is stopping with the teardown owed",
}


def overlap_records(
    claim_uid: str, devices: list[DeviceRecord], slices: Mapping[DeviceKey, SliceDevice]
) -> list[OverlapRecord]:
    """The fences a claim's teardown owes the devices of this node that share memory with its `devices`."""
    own = {d.key for d in devices}
    found: dict[DeviceKey, list[str]] = {}
    for device in devices:
        for key in overlapping((device.driver, device.pool, device.device), slices):
            if key_str(key) not in own:
                found.setdefault(key, []).append(device.key)
    return [
        OverlapRecord(
            driver=key[0],
            pool=key[1],
            device=key[2],
            uuid=slices[key].uuid,
            fence_rule=rule_name(names.TAINT_UNSANITIZED, claim_uid, key_str(key)),
            shares_memory_with=of,
        )
        for key, of in found.items()
    ]


def unheld_overlaps(
    devices: list[DeviceRecord], overlaps: list[OverlapRecord], slices: Mapping[DeviceKey, SliceDevice]
) -> list[str]:
    """Why the claim's allocation does not keep some of `overlaps` from other claims: a device sharing memory
    with one of the claim's that consumes none of the same counters (NVIDIA's dynamic MIG publishes a GPU and
    its MIG placements on shared memory-slice counters, so allocating one takes the others; static MIG
    publishes no parent GPU at all). Unknown devices count as not held (fail closed)."""
    found = []
    for overlap in overlaps:
        mine = [slices.get((d.driver, d.pool, d.device)) for d in devices if d.key in overlap.shares_memory_with]
        other = slices.get((overlap.driver, overlap.pool, overlap.device))
        if not any(
            d is not None and d.partition is not None and d.partition.overlaps(other and other.partition) for d in mine
        ):
            found.append(f"{overlap.key} shares memory with {', '.join(overlap.shares_memory_with)} but no counter")
    return found


class FenceDecisions:
    def __init__(
        self,
        *,
        fencer: Fencer,
        store: CheckpointStore,
        metrics: AgentMetrics,
        save: Callable[[], None],
    ) -> None:
        """`save` writes the checkpoint (a decision to fence is in it before the fences go up)."""
        self.fencer = fencer
        self.store = store
        self.metrics = metrics
        self._save = save
        # What this process already made sure of; empty after a restart, so everything is re-ensured once.
        self._fenced: set[str] = set()  # claim UIDs whose fences stand
        # Fencing a teardown and lifting its fences, one at a time: a fence decided on another thread (the
        # allocation found gone) must not go up after its teardown's lane has lifted the others.
        self._fence_lock = threading.Lock()

    def stand(self, uid: str) -> bool:
        """Whether this process has made sure of the fences of the claim's teardown."""
        return uid in self._fenced

    def forget(self, uid: str) -> None:
        self._fenced.discard(uid)

    def fence(self, td: Teardown, reason: FenceReason) -> bool:
        """Fences the teardown's devices (and what shares their memory) while they may hold a tenant's data,
        the decision checkpointed first; True when this decided it (it was not fenced yet)."""
        with self._fence_lock:
            with self.store.lock:
                if td.state not in DIRTY_STATES or self.store.teardowns.get(td.claim.uid) is not td:
                    return False  # verified clean, or gone
                decided = td.fenced is None
                if decided:
                    td.fenced = reason
            if decided:
                log.warning(
                    "claim %s: fencing %s (%s)",
                    td.claim,
                    ", ".join(d.key for d in td.fence_targets()),
                    _FENCE_WHY[reason] + (f": {'; '.join(td.not_held)}" if reason == FenceReason.NOT_HELD else ""),
                )
                self._save()
                self.metrics.fences.labels(reason=reason.value).inc()
            self.ensure_fenced(td)
            return decided

    def ensure_fenced(self, td: Teardown) -> None:
        """Makes sure, once per process and teardown, that the fences it must have stand (again, after a
        restart): those it has, and where its allocation does not hold every device (weak mode: once the
        teardown begins, since the node taint keeps the whole node from other claims), the first ones."""
        if td.fenced is None:
            if td.not_held and td.state in DIRTY_STATES and (td.state != State.ALLOCATED or not self.fencer.weak):
                self.fence(td, FenceReason.NOT_HELD)  # back here once decided
        elif td.claim.uid not in self._fenced:
            self.fencer.fence(td)
            self._fenced.add(td.claim.uid)

    def cover_overlaps(self, td: Teardown, slices: Mapping[DeviceKey, SliceDevice]) -> None:
        """Adds, for a teardown that may still be dirty, the devices of `slices` sharing memory with its own that
        it does not cover yet (the slices were unknown at first sight, or have changed since), checkpointed;
        fences them where the teardown is fenced, or where its allocation does not hold them. Devices are only
        ever added here: one drops out with the teardown."""
        with self.store.lock:  # the claim's lane may be moving it on meanwhile
            if td.state not in DIRTY_STATES:
                return
            known = {o.key for o in td.overlaps}
            added = [o for o in overlap_records(td.claim.uid, td.devices, slices) if o.key not in known]
            unheld = unheld_overlaps(td.devices, added, slices)
            if added:
                td.overlaps = [*td.overlaps, *added]
                td.not_held = [*td.not_held, *unheld]
        if not added:
            return
        log.warning("claim %s: its memory is now also shared with %s", td.claim, ", ".join(o.key for o in added))
        self._save()
        if td.fenced is not None:
            self._fenced.discard(td.claim.uid)  # the new ones too
            self.fence(td, td.fenced)
        else:
            self.ensure_fenced(td)

    def lift(self, td: Teardown) -> None:
        """Lifts the teardown's fences, if it has any: only once its scrub is attested (`done`)."""
        with self._fence_lock:
            if td.fenced is not None:
                self.fencer.lift(td, list(self.store.teardowns.values()))
                log.info("claim %s: fences of %s lifted", td.claim, ", ".join(d.key for d in td.fence_targets()))

    def fenced_devices(self) -> tuple[int, int]:
        """(devices under a fence of ours, devices failed)."""
        fenced = failed = 0
        for td in list(self.store.teardowns.values()):  # also read by the /healthz thread
            if td.fenced is not None and td.state in OWED_STATES:
                fenced += len(td.fence_targets())
            if td.state == State.FAILED:
                failed += len(td.devices)
        return fenced, failed
