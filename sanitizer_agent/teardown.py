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

The engine runs the steps and writes the checkpoint; the rest is in the parts it holds: `fence_decisions.py`
(where a teardown is fenced, and why), `claim_writes.py` (the hold, the annotations, the finalizer, Events),
`gpu_steps.py` (the drain's look for processes, the scrub, the health read), `watchdog.py` (steps stuck in the
GPU driver), and `signing.py` (the attestation).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from scrubgate.policies import names

from .checkpoint import OWED_STATES, CheckpointStore, ClaimRef, DeviceRecord, FenceReason, State, Teardown
from .claim_writes import ClaimWriter
from .claims import DeviceKey, SliceDevice, allocation_stamp, key_str, node_hold
from .fence_decisions import FenceDecisions, overlap_records, unheld_overlaps
from .fences import Fencer, label_value, rule_name
from .gpu import GpuBackend
from .gpu_steps import GpuSteps, StepFailed
from .kube import ClusterClient, ClusterError
from .metrics import AgentMetrics
from .signing import Signer, attestation_payload
from .watchdog import Watchdog, unless_done_within

log = logging.getLogger(__name__)

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


def new_teardown(
    claim: ClaimRef,
    devices: list[tuple[DeviceKey, str | None]],
    *,
    node: str,
    fence: str,
    source: str,
    allocated_at: float,
    seen_at: float,
    slices: Mapping[DeviceKey, SliceDevice],
    not_held: list[str] | None,
    seen: dict[str, Any] | None,
) -> Teardown:
    """The teardown of a new allocation on `node`, as first recorded (see `TeardownEngine.begin`)."""
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
    return Teardown(
        claim=claim,
        devices=records,
        overlaps=overlaps,
        state=State.ALLOCATED,
        fence=fence,
        not_held=[*(not_held or []), *unheld_overlaps(records, overlaps, slices)],
        source=source,
        allocated_at=allocated_at,
        seen_at=seen_at,
        # A hold the claim carries already (a restart that lost its checkpoint) is adopted.
        hold=(node_hold(seen, node) if seen is not None else None) or str(uuid.uuid4()),
        allocated_stamp=allocation_stamp(seen) if seen is not None else None,
    )


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
        self.fencer = fencer
        self.signer = signer
        self.metrics = metrics
        self.settings = settings
        self.clock = clock
        self.on_transition = on_transition
        self._unwritten: set[str] = set()  # claim UIDs whose state the checkpoint does not have yet
        self.fences = FenceDecisions(fencer=fencer, store=store, metrics=metrics, save=self._save)
        self.claim_writer = ClaimWriter(
            node=node, cluster=cluster, store=store, signer=signer, clock=clock, save=self._save
        )
        self.gpu_steps = GpuSteps(backend, metrics)
        self.watchdog = Watchdog(
            node=node,
            timeout_s=settings.scrub_timeout_s,
            store=store,
            cluster=cluster,
            claim_writer=self.claim_writer,
            fences=self.fences,
            metrics=metrics,
            clock=clock,
        )
        # How a teardown's next steps are run: here and now, or handed to the agent's workers (one claim's
        # steps in order, many claims at once). Fencing never goes through it: it is done before it returns.
        self.schedule: Callable[[Teardown], None] = schedule or self.advance

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
        td = new_teardown(
            claim,
            devices,
            node=self.node,
            fence="node" if self.fencer.weak else "rule",
            source=source,
            allocated_at=allocated_at,
            seen_at=self.clock(),
            slices=slices,
            not_held=not_held,
            seen=seen,
        )
        with self.store.lock:
            self.store.teardowns[claim.uid] = td
        if seen is not None:
            self.claim_writer.remember(claim.uid, seen)
        log.info("claim %s: allocated %s on %s", claim, ", ".join(d.key for d in td.devices), self.node)
        self._commit(td)
        self.fences.ensure_fenced(td)
        self.schedule(td)
        return td

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
        self.fences.ensure_fenced(td)  # weak mode: a fence its allocation needs waited for the release
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
                    self.fences.ensure_fenced(td)
                with self.watchdog.watched(td):
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
            fenced = td.fenced is None or self.fences.stand(uid)
            return fenced and self.claim_writer.held(uid) and (record_due is None or record_due > 0)
        if td.state == State.FAILED:
            return td.failure_reported and (td.retry_at is None or self.clock() < td.retry_at)
        return False

    def record_due(self, td: Teardown) -> float | None:
        """Seconds until the record of the allocation is due on the claim (<= 0: due now); None once written."""
        if self.claim_writer.status_written(td.claim.uid):
            return None
        return (td.seen_at or 0.0) + self.settings.record_after_s - self.clock()

    # ---------------------------------------------------------------- bookkeeping

    def _save(self) -> None:
        self.store.save()
        fenced, failed = self.fences.fenced_devices()
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
        self.fences.forget(td.claim.uid)
        self.claim_writer.forget(td.claim.uid)
        self.store.save()

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

    def _stays_in(self, td: Teardown, status: str) -> None:
        """The teardown stays a while in its state: written to the checkpoint, and announced on the claim (best
        effort: an API hiccup must not hold up a drain or a scrub)."""
        self._write_if_unwritten(td)
        try:
            self.claim_writer.announce(td, status)
        except ClusterError as exc:
            log.warning("claim %s: could not set %s=%s: %s", td.claim, names.ANNOTATION_SCRUB_STATUS, status, exc)

    # ---------------------------------------------------------------- the steps: side effect, then what next

    def _on_allocated(self, td: Teardown) -> Outcome:
        # The hold first, at once: a pod on this node may use the claim from now on.
        self.claim_writer.ensure_hold(td)
        # The record of its devices, which SG007 reads once the allocation is gone, and `fenced`: kept from
        # other claims (by the allocation, or where it cannot, by fences). Once the allocation has lasted a while;
        # where the write fails, this step backs off (steps.py) instead of trying again at every tick.
        record_due = self.record_due(td)
        if record_due is not None and record_due <= 0:
            self.claim_writer.announce(td, names.SCRUB_FENCED)
        return None  # until release

    def _on_released(self, td: Teardown) -> Outcome:
        # A device that another claim still holds (shared) cannot be drained yet: wait for that claim.
        for other in list(self.store.teardowns.values()):
            if other is not td and other.state == State.ALLOCATED and any(other.holds(d.key) for d in td.devices):
                return None
        return State.DRAINING, self._drain_fields()

    def _on_draining(self, td: Teardown) -> Outcome:
        try:
            holders = self.gpu_steps.holders(td)
        except StepFailed as exc:
            return self._fail(td, exc.category, exc.detail)
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

    def _on_scrubbing(self, td: Teardown) -> Outcome:
        # Announced from a timer thread if the scrub runs long: the claim's lane is in it meanwhile, and nothing
        # else writes this claim.
        with unless_done_within(ANNOUNCE_SCRUBBING_AFTER_S, self._stays_in, td, names.SCRUB_SCRUBBING):
            started = self.clock()
            try:
                devices, health = self.gpu_steps.scrub(td)
            except StepFailed as exc:
                return self._fail(td, exc.category, exc.detail)
            return State.VERIFIED, {
                "devices": devices,
                "health": health,
                "scrub_started_at": started,
                "scrub_finished_at": self.clock(),
            }

    def _on_verified(self, td: Teardown) -> Outcome:
        return State.ATTESTED, {"attestation": self.signer.sign(attestation_payload(td, self.node))}

    def _on_attested(self, td: Teardown) -> Outcome:
        # Only reachable through a verified scrub and a signed attestation (see the module docstring). Published
        # before any fence of the teardown goes.
        self.claim_writer.publish_attestation(td)
        if td.released_at is not None:
            scrub_time = (td.scrub_finished_at or 0.0) - (td.scrub_started_at or 0.0)
            self.metrics.teardown_overhead.observe(max(self.clock() - td.released_at - scrub_time, 0.0))
        log.info("claim %s: %s verified clean", td.claim, ", ".join(d.key for d in td.devices))
        return State.DONE, {"reason": None}  # the finalizer is removed there where this write did not

    def _on_done(self, td: Teardown) -> Outcome:
        self.fences.lift(td)
        self.claim_writer.remove_finalizer(td)
        if not self.claim_writer.controller_releases(td):
            self.claim_writer.release_hold(td)
        self._forget(td)
        return None

    def _on_failed(self, td: Teardown) -> Outcome:
        if not td.failure_reported:
            category = (td.reason or "scrub-failed").partition(":")[0]
            self.fencer.mark_failed(td, category)
            self.claim_writer.report_failure(td)
            self.metrics.failures.labels(reason=label_value(category)).inc()
            with self.store.lock:
                td.failure_reported = True
            self.store.save()
        if td.retry_at is not None and self.clock() >= td.retry_at:
            log.info("claim %s: retrying teardown (attempt %d)", td.claim, td.attempts + 1)
            return State.DRAINING, self._drain_fields()
        return None
