"""The teardown state machine, one per claim (with the claim's devices on this node).

    allocated -> released -> draining -> scrubbing -> verified -> attested -> done
                          \\-----------------\\------------> failed (fenced)

Until the attestation is on the claim, the claim's own allocation keeps its devices from every other claim:
SG007 refuses the resourceclaim controller's deallocation until then. So a teardown fences (DeviceTaintRules,
`fences.py`) only where that allocation cannot hold (`checkpoint.FenceReason`): admin access or memory the
allocation does not cover, an allocation gone before the attestation, a failed teardown (its claim may be
let go by break-glass), and the agent stopping with the teardown owed. Fences, where there are any, go only
after the attestation is published (on the claim, or in an Event on the node when the claim is gone): a
fenced device, whose claim may no longer hold it, is handed out again only once a verified attestation of its
scrub can be read. kube-scheduler retries waiting pods when a DeviceTaintRule goes.

Crash safety: every transition is written to the checkpoint *before* the side effect that follows it
(`released` and `verified` are not written: nothing follows them that a restart could not redo from the state
before), and every side effect is idempotent (create-if-absent, delete-if-present, patch guarded by `test` ops).
The state in the checkpoint therefore names the next step to (re)do, and a restarted agent simply
resumes: it re-ensures the fences of every teardown that has them, makes sure the allocation still holds
the others' devices, then carries on. A fence is deleted only in `done`, which only follows a verified scrub
and an attestation published; the finalizer is removed only by the patch that writes an attestation that
verifies for the claim (`attested`), or after the claim carries one (`done`, which removes it where that
patch could not). What a fence covers is `Teardown.fence_targets()`: the claim's devices and those sharing
memory with them, all in the checkpoint before any of them is fenced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from scrubgate.policies import names
from scrubgate.policies.attestation import (
    AttestationError,
    build_payload,
    check_claim_attestation,
    claim_consumers,
    claimed_devices,
    is_ended_pod,
    load_private_key,
    sign,
)

from .checkpoint import (
    DIRTY_STATES,
    OWED_STATES,
    CheckpointError,
    CheckpointStore,
    ClaimRef,
    DeviceRecord,
    FenceReason,
    OverlapRecord,
    ScrubRecord,
    State,
    Teardown,
)
from .claims import (
    DeviceKey,
    SliceDevice,
    allocation_stamp,
    annotation_ops,
    devices_annotation,
    finalizer_removal_ops,
    hold_ops,
    hold_release_ops,
    key_str,
    node_event,
    node_hold,
    overlapping,
)
from .fences import Fencer, label_value, rule_name
from .gpu import GpuBackend, GpuError, HealthSnapshot
from .kube import ClusterClient, ClusterError, Conflict, NotFound
from .metrics import AgentMetrics
from .partitions import device_health, device_processes, scrub_device

log = logging.getLogger(__name__)

CONFLICT_RETRIES = 5
STATUS_MAX = 256
# `scrubbing` is announced once a scrub has run this long: each claim write also wakes the resourceclaim
# controller into a deallocation that SG007 refuses, so a scrub that ends first is not announced at all.
ANNOUNCE_SCRUBBING_AFTER_S = 1.0

# States written to the checkpoint as the teardown enters them: first sight (what the agent owes, should the
# claim go while it is down), the signed attestation (before it is published: a restart publishes the same one),
# and a failure (its attempts count). Every other state is written only where the teardown stops in it (waits,
# backs off, or announces it): one it merely passes through is redone by a restart from the last written state
# (the release seen again, the drain and the scrub redone), so the normal path writes three times, not six.
WRITTEN_ON_ENTRY = frozenset({State.ALLOCATED, State.ATTESTED, State.FAILED})

TransitionHook = Callable[[Teardown, State], None]
Outcome = tuple[State, dict[str, Any]] | None


@dataclass(frozen=True)
class TeardownSettings:
    drain_timeout_s: float = 120.0
    max_attempts: int = 3  # failed attempts before the teardown waits for an operator
    retry_backoff_s: float = 30.0  # doubled after each failed attempt
    # The record of an allocation (`scrubgate.dev/devices`, `scrub-status: fenced`) is written once it has lasted
    # this long: a claim released sooner gets it with its attestation, one claim write and webhook call less.
    record_after_s: float = 2.0
    # A drain poll or a scrub still running after this long is stuck (a GPU fallen off the bus hangs NVML and
    # CUDA calls): its devices are fenced and marked failed, an Event says so, and /healthz fails.
    scrub_timeout_s: float = 900.0


class Signer:
    """The agent's Ed25519 attestation key (mounted from a Secret) and its key id."""

    def __init__(self, key: Ed25519PrivateKey, kid: str) -> None:
        self.key = key
        self.kid = kid

    @classmethod
    def from_file(cls, path: Path | str, kid: str) -> Signer:
        try:
            pem = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the attestation signing key {path}: {exc}") from exc
        return cls(load_private_key(pem), kid)

    @property
    def public_keys(self) -> dict[str, Ed25519PublicKey]:
        return {self.kid: self.key.public_key()}

    def sign(self, payload: dict[str, Any]) -> str:
        return sign(payload, self.key, self.kid)


@contextlib.contextmanager
def _unless_done_within(delay_s: float, function: Callable[..., object], *args: Any) -> Iterator[None]:
    """Calls `function(*args)` from a timer thread if the block is still running after `delay_s` seconds (the
    block's own thread is busy in it); on the way out, a call already under way is waited for."""
    timer = threading.Timer(delay_s, function, args)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()


def _when(ts: float | None) -> datetime:
    return datetime.fromtimestamp(ts or 0.0, UTC)


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


class TeardownEngine:
    def __init__(
        self,
        *,
        node: str,
        store: CheckpointStore,
        backend: GpuBackend,
        cluster: ClusterClient,
        fencer: Fencer,
        signer: Signer,
        metrics: AgentMetrics,
        settings: TeardownSettings = TeardownSettings(),
        clock: Callable[[], float] = time.time,
        on_transition: TransitionHook | None = None,
        schedule: Callable[[Teardown], None] | None = None,
    ) -> None:
        self.node = node
        self.store = store
        self.backend = backend
        self.cluster = cluster
        self.fencer = fencer
        self.signer = signer
        self.metrics = metrics
        self.settings = settings
        self.clock = clock
        self.on_transition = on_transition
        # What this process already made sure of; empty after a restart, so everything is re-ensured once.
        self._fenced: set[str] = set()  # claim UIDs whose fences stand
        # Fencing a teardown and lifting its fences, one at a time: a fence decided on another thread (the
        # allocation found gone) must not go up after its teardown's lane has lifted the others.
        self._fence_lock = threading.Lock()
        self._status: dict[str, str] = {}  # claim UID -> scrub-status annotation written
        self._held: set[str] = set()  # claim UIDs whose hold this process has made sure of
        self._claims: dict[str, dict[str, Any]] = {}  # claim UID -> the claim as our last write left it
        self._unwritten: set[str] = set()  # claim UIDs whose state the checkpoint does not have yet
        self._stuck: dict[str, str] = {}  # claim UID -> what of its teardown is stuck in the driver, and since when
        # How a teardown's next steps are run: here and now, or handed to the agent's workers (one claim's
        # steps in order, many claims at once). Fencing never goes through it: it is done before it returns.
        self.schedule: Callable[[Teardown], None] = schedule or self.advance
        self._scrubbing: dict[str, threading.Lock] = {}  # what `_scrub_of` keys a device by -> held meanwhile
        self._scrubbing_lock = threading.Lock()

    # ---------------------------------------------------------------- entry points

    def begin(
        self,
        claim: ClaimRef,
        devices: list[tuple[DeviceKey, str | None]],
        *,
        source: str,
        allocated_at: float,
        slices: Mapping[DeviceKey, SliceDevice],
        not_held: list[str] | None = None,
        seen: dict[str, Any] | None = None,
    ) -> Teardown:
        """A new allocation on this node: record it (with the devices of `slices` sharing memory with it), and
        fence it where the allocation does not keep its devices from other claims (`not_held`, the claim's own
        reasons, and memory shared without a counter). `seen`: the claim as just read, for the first write."""
        records = [
            DeviceRecord(
                driver=key[0],
                pool=key[1],
                device=key[2],
                uuid=uuid,
                fence_rule=rule_name(names.TAINT_UNSANITIZED, claim.uid, key_str(key)),
                failed_rule=rule_name(names.TAINT_SCRUB_FAILED, claim.uid, key_str(key)),
                placement=slices[key].placement if key in slices else None,
            )
            for key, uuid in devices
        ]
        overlaps = overlap_records(claim.uid, records, slices)
        td = Teardown(
            claim=claim,
            devices=records,
            overlaps=overlaps,
            state=State.ALLOCATED,
            fence="node" if self.fencer.weak else "rule",
            not_held=[*(not_held or []), *unheld_overlaps(records, overlaps, slices)],
            source=source,
            allocated_at=allocated_at,
            seen_at=self.clock(),
            # A hold the claim carries already (a restart that lost its checkpoint) is adopted.
            hold=(node_hold(seen, self.node) if seen is not None else None) or str(uuid.uuid4()),
            allocated_stamp=allocation_stamp(seen) if seen is not None else None,
        )
        with self.store.lock:
            self.store.teardowns[claim.uid] = td
        if seen is not None:
            self._claims[claim.uid] = seen
        log.info("claim %s: allocated %s on %s", claim, ", ".join(d.key for d in records), self.node)
        self._commit(td)
        self.ensure_fenced(td)
        self.schedule(td)
        return td

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

    def release(
        self,
        td: Teardown,
        reason: str,
        consumers: list[tuple[str, str]] | None = None,
        claim: dict[str, Any] | None = None,
    ) -> None:
        """The claim no longer holds its devices; `consumers` are the pods it was reserved for (the attestation
        names them: its scrub is for what they left). `claim`, as read: the hold it carries is the one the
        attestation names (a teardown of an older checkpoint learns it here)."""
        if td.state != State.ALLOCATED:
            return
        log.info("claim %s released (%s); tearing down %s", td.claim, reason, ", ".join(d.key for d in td.devices))
        hold = (node_hold(claim, self.node) if claim is not None else None) or td.hold
        self._transition(
            td,
            State.RELEASED,
            released_at=self.clock(),
            release_reason=reason,
            consumers=list(consumers or []),
            hold=hold,
        )
        self.ensure_fenced(td)  # weak mode: a fence its allocation needs waited for the release
        self.schedule(td)

    def rescrub(self, td: Teardown) -> bool:
        """An operator asked for another attempt at a failed teardown."""
        if td.state != State.FAILED:
            return False
        log.warning("claim %s: operator asked for another teardown attempt (last failure: %s)", td.claim, td.reason)
        # One more attempt: `attempts` keeps counting, so another failure waits for the operator again.
        self._transition(td, State.DRAINING, **self._drain_fields())
        self._write_if_unwritten(td)  # the operator's request is used up: a restart must not wait for another
        self.schedule(td)
        return True

    def advance(self, td: Teardown) -> None:
        """Runs the teardown as far as it can go now. ClusterError propagates (the caller retries later
        with backoff; the state is unchanged and every step is safe to redo). The state it stops in is written
        to the checkpoint."""
        try:
            while self.store.teardowns.get(td.claim.uid) is td:
                if td.state in OWED_STATES:
                    self.ensure_fenced(td)
                with self._watched(td):
                    outcome = getattr(self, f"_on_{td.state.value}")(td)
                if outcome is None:
                    return
                state, changes = outcome
                self._transition(td, state, **changes)
        finally:
            self._write_if_unwritten(td)

    def waiting(self, td: Teardown) -> bool:
        """Whether `advance` has nothing to do for `td` until something happens to it: allocated, fenced where it
        must be and announced (until its release), or failed and reported with no retry due (until an operator
        acts)."""
        uid = td.claim.uid
        if td.state == State.ALLOCATED:
            record_due = self.record_due(td)
            fenced = td.fenced is None or uid in self._fenced
            return fenced and uid in self._held and (record_due is None or record_due > 0)
        if td.state == State.FAILED:
            return td.failure_reported and (td.retry_at is None or self.clock() < td.retry_at)
        return False

    def record_due(self, td: Teardown) -> float | None:
        """Seconds until the record of the allocation is due on the claim (<= 0: due now); None once written."""
        if td.claim.uid in self._status:
            return None
        return (td.seen_at or 0.0) + self.settings.record_after_s - self.clock()

    def fenced_devices(self) -> tuple[int, int]:
        """(devices under a fence of ours, devices failed)."""
        fenced = failed = 0
        for td in list(self.store.teardowns.values()):  # also read by the /healthz thread
            if td.fenced is not None and td.state in OWED_STATES:
                fenced += len(td.fence_targets())
            if td.state == State.FAILED:
                failed += len(td.devices)
        return fenced, failed

    def stuck(self) -> list[str]:
        """What of the teardowns is stuck in the driver now (for /healthz)."""
        return list(self._stuck.values())

    @contextlib.contextmanager
    def _watched(self, td: Teardown) -> Iterator[None]:
        """Around a step that calls into the GPU driver (a drain poll, a scrub): past scrub_timeout_s, the
        watchdog (a timer thread: the step's own thread is stuck in the call) fails the teardown closed."""
        if td.state not in (State.DRAINING, State.SCRUBBING):
            yield
            return
        try:
            with _unless_done_within(self.settings.scrub_timeout_s, self._stuck_in_driver, td, td.state, self.clock()):
                yield
        finally:
            self._stuck.pop(td.claim.uid, None)  # after the watchdog, if it fired: nothing marks it stuck later

    def _stuck_in_driver(self, td: Teardown, state: State, since: float) -> None:
        devices = ", ".join(f"{d.key} ({d.uuid})" for d in td.devices)
        what = f"{state.value} of {devices} for claim {td.claim} stuck in the GPU driver since {_when(since).isoformat(timespec='seconds')}"
        log.error(
            "%s; fencing the devices and failing /healthz. Check the GPU (nvidia-smi, dmesg for Xid 79: fallen off the bus)",
            what,
        )
        self.metrics.failures.labels(reason="scrub-timeout").inc()
        status = f"{names.SCRUB_FAILED_PREFIX}scrub-timeout: {state.value} still running after {self.settings.scrub_timeout_s:.0f}s"
        try:
            self.fence(td, FenceReason.FAILED)
            self._write_claim(td, {names.ANNOTATION_SCRUB_STATUS: status[:STATUS_MAX]})
            self._status[td.claim.uid] = status[:STATUS_MAX]
            self.record_event(
                td,
                "ScrubTimeout",
                f"{what}: the devices are fenced and the agent reports unhealthy until it ends; if the GPU fell off "
                "the bus, drain the node and reset or replace the GPU",
            )
        except (ClusterError, CheckpointError) as exc:
            log.error("claim %s: could not fence or mark its stuck teardown: %s", td.claim, exc)
        finally:
            self._stuck[td.claim.uid] = what  # /healthz fails from here on, fenced or not

    def oldest_release_s(self) -> float:
        """Seconds since the release of the oldest teardown still under way (not failed: that has its own
        gauge); 0 when none is. Minutes mean a stuck teardown: a drain that does not end, an attestation the
        webhook refuses (a key the policy does not know), a webhook the agent cannot reach."""
        now = self.clock()
        released = [
            td.released_at
            for td in list(self.store.teardowns.values())  # read by the /metrics thread
            if td.released_at is not None and td.state not in (State.ALLOCATED, State.FAILED)
        ]
        return max((now - at for at in released), default=0.0)

    # ---------------------------------------------------------------- bookkeeping

    def _save(self) -> None:
        self.store.save()
        fenced, failed = self.fenced_devices()
        self.metrics.fenced_devices.set(fenced)
        self.metrics.failed_devices.set(failed)

    def _commit(self, td: Teardown) -> None:
        if td.state in WRITTEN_ON_ENTRY:
            self._unwritten.discard(td.claim.uid)
            self._save()
        else:
            self._unwritten.add(td.claim.uid)
        if self.on_transition:
            self.on_transition(td, td.state)

    def _transition(self, td: Teardown, state: State, **changes: Any) -> None:
        with self.store.lock:  # a checkpoint write sees the whole transition or none of it
            for key, value in changes.items():
                setattr(td, key, value)
            td.state = state
        self._commit(td)

    def _write_if_unwritten(self, td: Teardown) -> None:
        if td.claim.uid in self._unwritten and self.store.teardowns.get(td.claim.uid) is td:
            self._unwritten.discard(td.claim.uid)
            self._save()

    def _forget(self, td: Teardown) -> None:
        with self.store.lock:
            del self.store.teardowns[td.claim.uid]
        self._unwritten.discard(td.claim.uid)
        self._fenced.discard(td.claim.uid)
        self._held.discard(td.claim.uid)
        self._status.pop(td.claim.uid, None)
        self._claims.pop(td.claim.uid, None)
        self.store.save()

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

    def _drain_fields(self) -> dict[str, Any]:
        return {
            "drain_deadline": self.clock() + self.settings.drain_timeout_s,
            "retry_at": None,
            "failure_reported": False,
        }

    def _fail(self, td: Teardown, category: str, detail: str) -> Outcome:
        attempts = td.attempts + 1
        retry_at = None
        if attempts < self.settings.max_attempts:
            retry_at = self.clock() + self.settings.retry_backoff_s * 2 ** (attempts - 1)
        log.error("claim %s: teardown failed (%s: %s); fencing its devices", td.claim, category, detail)
        if td.fenced is None:
            self.metrics.fences.labels(reason=FenceReason.FAILED.value).inc()
        return State.FAILED, {
            "reason": f"{category}: {detail}",
            "attempts": attempts,
            "retry_at": retry_at,
            "failure_reported": False,
            # Fenced by `_on_failed`, before the claim says `failed:`, which lets break-glass deallocate it.
            "fenced": td.fenced or FenceReason.FAILED,
        }

    # ---------------------------------------------------------------- the hold

    def _ensure_hold(self, td: Teardown) -> None:
        """Holds the claim for this teardown: a `scrubgate.dev/nodeagents` consumer in its status.reservedFor, its
        UID checkpointed (at first sight) before it is written. Kubernetes' resourceclaim controller keeps consumers it does not
        know, so until the hold goes with the attested release it neither deallocates nor deletes the claim (no
        refused attempt, no retry), and the scheduler never takes the used claim for an unused one. Once per process;
        a hold the claim already carries (a restart) is adopted."""
        uid = td.claim.uid
        if uid in self._held or not td.claim.name:
            return
        # The copy last read first; where it was stale (the claim since deleted: the API server takes no new
        # consumer then, 422; or changed), fresh reads decide.
        attempts = (self._claims.pop(uid, None), None, None)
        for attempt, cached in enumerate(attempts, 1):
            claim = cached or self.cluster.get_claim(td.claim.namespace, td.claim.name)
            if claim is None or (claim.get("metadata") or {}).get("uid") != uid:
                return  # gone: the release check sees it
            try:
                self._hold(td, claim)
                break
            except NotFound:
                return
            except Conflict:
                if attempt == len(attempts):
                    raise
        self._held.add(uid)

    def _hold(self, td: Teardown, claim: dict[str, Any]) -> None:
        held = node_hold(claim, self.node)
        if held is None and td.hold is None:  # a teardown of an older checkpoint
            with self.store.lock:
                td.hold = str(uuid.uuid4())
            self._save()  # before the side effect: a restart adopts or rewrites this one
        elif held is not None and held != td.hold:
            with self.store.lock:
                td.hold = held
            self._save()
        ops = hold_ops(claim, self.node, td.hold or "")
        if ops is not None:
            self._claims[td.claim.uid] = self.cluster.patch_claim_status(td.claim.namespace, td.claim.name, ops)
            log.info("claim %s: held by node %s's agent until its attested release", td.claim, self.node)
        elif held is None:
            # Being deleted (the API server takes no new consumer then) or no longer allocated: SG007 keeps its
            # allocation until the attestation all the same; the resourceclaim controller retries meanwhile.
            log.warning(
                "claim %s: cannot be held (%s); SG007 keeps its allocation until the attestation",
                td.claim,
                "being deleted" if (claim.get("metadata") or {}).get("deletionTimestamp") else "not allocated",
            )

    def release_hold(self, td: Teardown) -> None:
        """Takes this node's hold off the claim, after its attestation is on it (SG007 lets nothing else release
        it), and where nothing else is left in its reservation, the allocation with it (`hold_release_ops`); the
        resourceclaim controller then deletes the claim where it was a pod's. A claim a later pod uses (a shared
        claim) keeps it: that use is not attested, and the agent's next teardown of the claim adopts the hold."""
        if not td.claim.name:
            return
        # The copy the attestation's write returned first (the patch's tests catch a stale one), then a fresh read.
        for cached in (self._claims.pop(td.claim.uid, None), None):
            claim = cached or self.cluster.get_claim(td.claim.namespace, td.claim.name)
            if claim is None or (claim.get("metadata") or {}).get("uid") != td.claim.uid:
                return
            ops = hold_release_ops(claim, self.node)
            if ops is None:
                return
            try:
                self.cluster.patch_claim_status(td.claim.namespace, td.claim.name, ops)
                return
            except NotFound:
                return
            except Conflict:
                continue
            except ClusterError as exc:
                if exc.status != 403:
                    raise
                log.warning(
                    "claim %s: admission kept node %s's hold on it (%s): a later use of the claim is not covered by "
                    "this attestation; the hold stays for the teardown of that use",
                    td.claim,
                    self.node,
                    exc,
                )
                return
        raise Conflict(f"claim {td.claim} kept changing while the agent released its hold; will retry", 409)

    # ---------------------------------------------------------------- claim writes

    def _write_claim(self, td: Teardown, updates: dict[str, str], *, release: bool = False) -> bool:
        """Sets annotations on the claim; False when the claim is gone (nothing left to annotate). `release`:
        the same patch removes the finalizer where the attestation among `updates` holds for the claim and the
        claim outlives that patch, so that the resource claim controller sees one change, attested and
        released, instead of two, the second of which would fail its deallocation with a conflict and put it
        into its backoff.

        The first try patches the copy the last write returned, saving a GET on the teardown's path; the
        patch's `test` ops make a stale copy fail (Conflict), and then the claim is read afresh."""
        if not td.claim.name:
            return False
        for attempt in range(CONFLICT_RETRIES):
            claim = self._claims.pop(td.claim.uid, None) if attempt == 0 else None
            if claim is None:
                claim = self.cluster.get_claim(td.claim.namespace, td.claim.name)
                if claim is None or (claim.get("metadata") or {}).get("uid") != td.claim.uid:
                    return False
                current = (claim.get("metadata") or {}).get("annotations") or {}
                if all(current.get(k) == v for k, v in updates.items()):
                    self._claims[td.claim.uid] = claim
                    return True
            ops = annotation_ops(claim, updates)
            releasing = release and _outlives_the_write(claim) and self._attestation_problem(td, claim) is None
            if releasing:
                ops += finalizer_removal_ops(claim, None) or []  # the attestation is written by this patch
            try:
                self._claims[td.claim.uid] = self.cluster.patch_claim(td.claim.namespace, td.claim.name, ops)
                return True
            except NotFound:
                return False
            except Conflict:
                continue
            except ClusterError as exc:
                if not releasing or exc.status != 403:
                    raise
                # Admission refused the release (a webhook that does not trust this agent's key, say): the
                # attestation and `verified` still go on the claim, for the operator to see; `done` retries.
                log.warning(
                    "claim %s: admission refused the removal of finalizer %s (%s); writing the attestation alone, "
                    "the removal is retried. The denial says why; where it names the key, add this agent's public "
                    "key to the webhook's policy (attestationKeys, kid %r)",
                    td.claim,
                    names.FINALIZER,
                    exc,
                    self.signer.kid,
                )
                return self._write_claim(td, updates)
        raise Conflict(f"claim {td.claim} kept changing while the agent annotated it; will retry", 409)

    def _stays_in(self, td: Teardown, status: str) -> None:
        """The teardown stays a while in its state: written to the checkpoint, and announced on the claim."""
        self._write_if_unwritten(td)
        self._announce(td, status)

    def _announce(self, td: Teardown, status: str) -> None:
        """Best-effort progress annotation: an API hiccup must not hold up a scrub. The first one carries the
        record of the claim's devices."""
        if self._status.get(td.claim.uid) == status:
            return
        record = {} if td.claim.uid in self._status else {names.ANNOTATION_DEVICES: self._devices_annotation(td)}
        try:
            self._write_claim(td, {**record, names.ANNOTATION_SCRUB_STATUS: status})
            self._status[td.claim.uid] = status
        except ClusterError as exc:
            log.warning("claim %s: could not set %s=%s: %s", td.claim, names.ANNOTATION_SCRUB_STATUS, status, exc)

    def _devices_annotation(self, td: Teardown) -> str:
        return devices_annotation(((d.driver, d.pool, d.device), d.uuid) for d in td.devices)

    def record_event(
        self,
        td: Teardown,
        reason: str,
        message: str,
        *,
        kind: str = "Warning",
        annotations: dict[str, str] | None = None,
        on_node: bool = False,
    ) -> None:
        """An Event about the claim, or about the Node when the claim has no name or `on_node`."""
        if td.claim.name and not on_node:
            namespace = td.claim.namespace
            involved = {
                "apiVersion": f"{names.RESOURCE_GROUP}/v1",
                "kind": "ResourceClaim",
                "namespace": td.claim.namespace,
                "name": td.claim.name,
                "uid": td.claim.uid,
            }
        else:
            namespace, involved = "default", {"apiVersion": "v1", "kind": "Node", "name": self.node}
        try:
            event = node_event(
                node=self.node,
                namespace=namespace,
                involved=involved,
                reason=reason,
                message=message,
                now=self.clock(),
                kind=kind,
                annotations=annotations,
            )
            self.cluster.create_event(namespace, event)
        except ClusterError as exc:
            log.warning("could not record Warning event %s for claim %s: %s", reason, td.claim, exc)

    # ---------------------------------------------------------------- the steps: side effect, then what next

    def _on_allocated(self, td: Teardown) -> Outcome:
        # The hold first, at once: a pod on this node may use the claim from now on.
        self._ensure_hold(td)
        # The record of its devices, which SG007 reads once the allocation is gone, and `fenced`: kept from
        # other claims (by the allocation, or where it cannot, by fences). Once the allocation has lasted a while.
        record_due = self.record_due(td)
        if record_due is not None and record_due <= 0:
            self._announce(td, names.SCRUB_FENCED)
        return None  # until release

    def _on_released(self, td: Teardown) -> Outcome:
        # A device that another claim still holds (shared) cannot be drained yet: wait for that claim.
        for other in list(self.store.teardowns.values()):
            if other is not td and other.state == State.ALLOCATED and any(other.holds(d.key) for d in td.devices):
                return None
        return State.DRAINING, self._drain_fields()

    def _on_draining(self, td: Teardown) -> Outcome:
        holders = []
        for device in td.devices:
            if device.uuid is None and device.placement is None:
                continue  # fails in scrubbing, with the reason
            try:
                where = device.uuid or device.key
                holders += [f"pid {p.pid} ({p.kind}) on {where}" for p in device_processes(self.backend, device)]
            except GpuError as exc:
                return self._fail(td, "gpu-error", f"cannot list processes on {device.key} ({device.uuid}): {exc}")
        if not holders:
            return State.SCRUBBING, {"scrub_started_at": self.clock()}
        # Announced only when there is something to wait for: one claim PATCH less per teardown otherwise.
        self._stays_in(td, names.SCRUB_DRAINING)
        if self.clock() >= (td.drain_deadline or 0):
            return self._fail(
                td,
                "drain-timeout",
                f"{', '.join(holders)} still running {self.settings.drain_timeout_s:.0f}s after release",
            )
        return None  # poll again

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

    @contextlib.contextmanager
    def _announced_after(self, td: Teardown, status: str, delay_s: float) -> Iterator[None]:
        """Announces `status` if the block is still running after `delay_s` seconds (from a timer thread: the
        claim's lane is in the block meanwhile, and nothing else writes this claim)."""
        with _unless_done_within(delay_s, self._stays_in, td, status):
            yield

    def _on_scrubbing(self, td: Teardown) -> Outcome:
        with self._announced_after(td, names.SCRUB_SCRUBBING, ANNOUNCE_SCRUBBING_AFTER_S):
            return self._scrub(td)

    def _scrub(self, td: Teardown) -> Outcome:
        started = self.clock()
        scrubbed = []
        for device in td.devices:
            if device.uuid is None and device.placement is None:
                return self._fail(
                    td,
                    "no-uuid",
                    f"{device.key} has no uuid attribute in this node's ResourceSlices; cannot tell which GPU to scrub",
                )
            try:
                with self._scrub_of(device):
                    result = scrub_device(self.backend, device)
            except GpuError as exc:
                return self._fail(td, "gpu-error", f"cannot reach {device.key} ({device.uuid}) to scrub it: {exc}")
            self.metrics.scrub_duration.observe(result.duration_s)
            self.metrics.scrubbed_bytes.inc(result.bytes_scrubbed)
            if not result.verified:
                return self._fail(
                    td, "scrub-failed", f"{device.key} ({device.uuid}): {result.reason or 'not verified'}"
                )
            # The checkpoint keeps the backend's result under the same field names.
            record = ScrubRecord.model_validate(result, from_attributes=True)
            scrubbed.append(device.model_copy(update={"scrub": record}))
        snapshots = []
        for device in td.devices:
            try:
                snapshots.append(device_health(self.backend, device, td.allocated_at))
            except GpuError as exc:
                return self._fail(td, "gpu-error", f"cannot read the health of {device.key} ({device.uuid}): {exc}")
        problems = [f"{d.uuid}: {p}" for d, s in zip(td.devices, snapshots, strict=True) for p in s.problems()]
        if problems:
            return self._fail(td, "unhealthy", "; ".join(problems))
        return State.VERIFIED, {
            "devices": scrubbed,
            "health": _merge_health(snapshots),
            "scrub_started_at": started,
            "scrub_finished_at": self.clock(),
        }

    def _on_verified(self, td: Teardown) -> Outcome:
        payload = build_payload(
            namespace=td.claim.namespace,
            name=td.claim.name,
            uid=td.claim.uid,
            node=self.node,
            devices=[
                {
                    "driver": d.driver,
                    "pool": d.pool,
                    "device": d.device,
                    "uuid": d.uuid,
                    "bytesScrubbed": d.scrub.bytes_scrubbed if d.scrub else 0,
                    "bytesTotal": d.scrub.bytes_total if d.scrub else 0,
                    # Coverage, stated: what the driver reserves, and what the scrub could not reach.
                    "bytesReserved": d.scrub.bytes_reserved if d.scrub else 0,
                    "bytesUnreachable": d.scrub.bytes_unreachable if d.scrub else 0,
                    "method": d.scrub.method if d.scrub else "",
                    "verified": bool(d.scrub and d.scrub.verified),
                    # Beyond the scrub's reach: the driver zeroing freed memory, and ECC (null: not readable).
                    "scrubOnFree": d.scrub.scrub_on_free if d.scrub else None,
                    "eccEnabled": d.scrub.ecc_enabled if d.scrub else None,
                }
                for d in td.devices
            ],
            started_at=_when(td.scrub_started_at),
            finished_at=_when(td.scrub_finished_at),
            health=td.health or {},
            consumers=td.consumers,
            allocation={"reservation": td.hold, "allocatedAt": td.allocated_stamp},
        )
        return State.ATTESTED, {"attestation": self.signer.sign(payload)}

    def _on_attested(self, td: Teardown) -> Outcome:
        # Only reachable through a verified scrub and a signed attestation (see the module docstring). Published
        # before any fence of the teardown goes.
        written = self._write_claim(
            td,
            {
                names.ANNOTATION_DEVICES: self._devices_annotation(td),
                names.ANNOTATION_ATTESTATION: td.attestation or "",
                names.ANNOTATION_SCRUB_STATUS: names.SCRUB_VERIFIED,
            },
            release=True,
        )
        if not written:
            self._keep_orphan_attestation(td)
        if td.released_at is not None:
            scrub_time = (td.scrub_finished_at or 0.0) - (td.scrub_started_at or 0.0)
            self.metrics.teardown_overhead.observe(max(self.clock() - td.released_at - scrub_time, 0.0))
        log.info("claim %s: %s verified clean", td.claim, ", ".join(d.key for d in td.devices))
        return State.DONE, {"reason": None}  # the finalizer is removed there where this write did not

    def _on_done(self, td: Teardown) -> Outcome:
        with self._fence_lock:
            if td.fenced is not None:
                self.fencer.lift(td, list(self.store.teardowns.values()))
                log.info("claim %s: fences of %s lifted", td.claim, ", ".join(d.key for d in td.fence_targets()))
        self._remove_finalizer(td)
        if not self._controller_releases(td):
            self.release_hold(td)
        self._forget(td)
        return None

    def _controller_releases(self, td: Teardown) -> bool:
        """Whether the resourceclaim controller makes the release itself: the claim, as the attestation's write
        left it, is reserved for ended pods the controller has yet to drop beside this node's hold (and records of
        ended pods), and for nothing else. That write sends the controller the claim; it drops the pods, and the
        webhook's /mutate makes its drop the release (holds, records and allocation out:
        policies/release_guard.kept_consumers_patch). Then the agent writes nothing more, so no write of its races
        the controller's (a conflict, a retry in its rate-limited queue). Anything else (only records left, which
        the controller does not drop; a PodGroup, a claim read afresh, no hold) the agent releases itself."""
        claim = self._claims.get(td.claim.uid)
        if claim is None or node_hold(claim, self.node) is None:
            return False
        resources = [resource for resource, _, _ in claim_consumers(claim)]
        return "pods" in resources and all(resource == "pods" or is_ended_pod(resource) for resource in resources)

    def _on_failed(self, td: Teardown) -> Outcome:
        if not td.failure_reported:
            category = (td.reason or "scrub-failed").partition(":")[0]
            self.fencer.mark_failed(td, category)
            status = f"{names.SCRUB_FAILED_PREFIX}{td.reason}"[:STATUS_MAX]
            self._write_claim(td, {names.ANNOTATION_SCRUB_STATUS: status})
            self._status[td.claim.uid] = status
            next_step = (
                f"retrying at {_when(td.retry_at).isoformat(timespec='seconds')}"
                if td.retry_at is not None
                else f"waiting for an operator: fix the GPU, then `scrubgate agent rescrub --device {td.devices[0].uuid or td.devices[0].key}`"
            )
            self.record_event(
                td,
                "ScrubFailed",
                f"teardown of {', '.join(d.key for d in td.devices)} on node {self.node} failed "
                f"(attempt {td.attempts}): {td.reason}; devices stay fenced, {next_step}",
            )
            self.metrics.failures.labels(reason=label_value(category)).inc()
            with self.store.lock:
                td.failure_reported = True
            self.store.save()
        if td.retry_at is not None and self.clock() >= td.retry_at:
            log.info("claim %s: retrying teardown (attempt %d)", td.claim, td.attempts + 1)
            return State.DRAINING, self._drain_fields()
        return None

    def _keep_orphan_attestation(self, td: Teardown) -> None:
        """The claim went before its attestation could land on it (break-glass): the attestation goes into
        an Event on the Node instead, so that the scrub of its devices stays on record."""
        devices = ", ".join(f"{d.key} ({d.uuid})" for d in td.devices)
        self.record_event(
            td,
            "ScrubAttested",
            f"claim {td.claim} was deleted before its teardown ended (break-glass?); {devices} verified clean on "
            f"node {self.node}; the signed attestation is in this Event's annotation {names.ANNOTATION_ATTESTATION}",
            kind="Normal",
            annotations={names.ANNOTATION_ATTESTATION: td.attestation or ""},
            on_node=True,
        )
        log.info("claim %s: gone before its attestation landed; recorded it in an Event: %s", td.claim, td.attestation)

    def _attestation_problem(self, td: Teardown, claim: dict[str, Any]) -> AttestationError | None:
        """Why the teardown's attestation does not let the claim go (None when it does). Devices of other
        drivers in the claim (a NIC, say) are not the agent's to scrub or attest."""
        drivers = {d.driver for d in td.devices}
        try:
            required = {key for key in claimed_devices(claim) if key[0] in drivers}
            check_claim_attestation(td.attestation or "", claim, self.signer.public_keys, required)
        except AttestationError as exc:
            return exc
        return None

    def _remove_finalizer(self, td: Teardown) -> None:
        if not td.claim.name or not td.attestation:
            return
        for attempt in range(CONFLICT_RETRIES):
            # As in _write_claim: first the copy the attestation's write returned; a stale one fails the tests.
            claim = self._claims.pop(td.claim.uid, None) if attempt == 0 else None
            if claim is None:
                claim = self.cluster.get_claim(td.claim.namespace, td.claim.name)
            if claim is None or (claim.get("metadata") or {}).get("uid") != td.claim.uid:
                return  # gone after the attestation was published (on it, or in an Event on the node)
            annotations = (claim.get("metadata") or {}).get("annotations") or {}
            if annotations.get(names.ANNOTATION_ATTESTATION) != td.attestation:
                self._write_claim(td, {names.ANNOTATION_ATTESTATION: td.attestation})
                continue
            problem = self._attestation_problem(td, claim)
            if problem is not None:
                # The devices are verified clean; only the claim object stays. Say why.
                log.error("claim %s: keeping finalizer %s: %s", td.claim, names.FINALIZER, problem)
                self.record_event(td, "AttestationMismatch", f"finalizer {names.FINALIZER} kept: {problem}")
                return
            ops = finalizer_removal_ops(claim, td.attestation)
            if ops is None:
                self._claims[td.claim.uid] = claim  # for the hold's release, next
                return
            try:
                self._claims[td.claim.uid] = self.cluster.patch_claim(td.claim.namespace, td.claim.name, ops)
                return
            except NotFound:
                return
            except Conflict:
                continue
        raise Conflict(f"claim {td.claim} kept changing while the agent removed its finalizer; will retry", 409)


def _outlives_the_write(claim: dict[str, Any]) -> bool:
    """Whether the claim stays after a write that removes our finalizer: it is not being deleted, or another
    finalizer holds it (Kubernetes' delete-protection, until the deallocation). One that would vanish with the
    write would take the attestation with it, unseen: its finalizer goes in a write of its own, after."""
    meta = claim.get("metadata") or {}
    return not meta.get("deletionTimestamp") or any(f != names.FINALIZER for f in meta.get("finalizers") or [])


_FENCE_WHY = {
    FenceReason.NOT_HELD: "its allocation does not keep them from other claims",
    FenceReason.ALLOCATION_LOST: "its allocation is gone before their scrub was attested",
    FenceReason.FAILED: "the teardown failed",
    FenceReason.HAND_OVER: "the agent is stopping with the teardown owed",
}


def _merge_health(snapshots: list[HealthSnapshot]) -> dict[str, Any]:
    """One `health` object for the attestation over all of the claim's devices."""
    return {
        "eccUncorrectable": sum(s.ecc_uncorrectable_volatile for s in snapshots),
        "remapPending": any(s.remapped_rows_pending for s in snapshots),
        "xids": sorted({x for s in snapshots for x in s.xids}),
    }
