"""The teardown state machine, one per claim (with the claim's devices on this node).

    allocated(fenced) -> released -> draining -> scrubbing -> verified -> attested -> unfenced -> done
                                 \\-----------------\\-----------------------> failed (fence kept)

The fences go before the attestation is written to the claim: the claim stays allocated (its devices out
of the scheduler's reach) until then, and the resourceclaim controller's deallocation, which kube-scheduler
acts on, then finds the devices unfenced.

Crash safety: every transition is written to the checkpoint *before* the side effect that follows it,
and every side effect is idempotent (create-if-absent, delete-if-present, patch guarded by `test` ops).
The state in the checkpoint therefore names the next step to (re)do, and a restarted agent simply
resumes: it re-ensures the fences of every teardown that may still be dirty, then carries on. A fence
is deleted only in `attested`, which only follows a verified scrub and a signed attestation; the
finalizer is removed only by the patch that writes an attestation that verifies for the claim (`unfenced`),
or after the claim carries one (`done`, which removes it where that patch could not).
What a teardown fences is `Teardown.fenced()`: its devices and those sharing memory with them, all in
the checkpoint before any of them is fenced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
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
    claimed_devices,
    load_private_key,
    sign,
)

from .checkpoint import CheckpointStore, ClaimRef, DeviceRecord, OverlapRecord, ScrubRecord, State, Teardown
from .claims import (
    DeviceKey,
    SliceDevice,
    annotation_ops,
    devices_annotation,
    finalizer_removal_ops,
    key_str,
    node_event,
    overlapping,
)
from .fences import Fencer, label_value, rule_name
from .gpu import GpuBackend, GpuError, HealthSnapshot
from .kube import ClusterClient, ClusterError, Conflict, NotFound
from .metrics import AgentMetrics
from .partitions import device_health, device_processes, scrub_device

log = logging.getLogger(__name__)

# States in which a device may hold a tenant's data (or is about to be checked): the fence must stand.
FENCED_STATES = frozenset(
    {State.ALLOCATED, State.RELEASED, State.DRAINING, State.SCRUBBING, State.VERIFIED, State.ATTESTED, State.FAILED}
)
CONFLICT_RETRIES = 5
STATUS_MAX = 256

TransitionHook = Callable[[Teardown, State], None]
Outcome = tuple[State, dict[str, Any]] | None


@dataclass(frozen=True)
class TeardownSettings:
    drain_timeout_s: float = 120.0
    max_attempts: int = 3  # failed attempts before the teardown waits for an operator
    retry_backoff_s: float = 30.0  # doubled after each failed attempt


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
        self._fenced: dict[str, bool] = {}  # claim UID -> fenced for teardown (True) or allocation (False)
        self._status: dict[str, str] = {}  # claim UID -> scrub-status annotation written
        self._claims: dict[str, dict[str, Any]] = {}  # claim UID -> the claim as our last write left it
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
    ) -> Teardown:
        """A new allocation on this node: record it (with the devices of `slices` sharing memory with it),
        then fence it."""
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
        td = Teardown(
            claim=claim,
            devices=records,
            overlaps=overlap_records(claim.uid, records, slices),
            state=State.ALLOCATED,
            fence="node" if self.fencer.weak else "rule",
            source=source,
            allocated_at=allocated_at,
        )
        with self.store.lock:
            self.store.teardowns[claim.uid] = td
        log.info("claim %s: allocated %s on %s; fencing", claim, ", ".join(d.key for d in records), self.node)
        if td.overlaps:
            log.info(
                "claim %s: also fencing %s (memory shared with its devices)",
                claim,
                ", ".join(o.key for o in td.overlaps),
            )
        self._commit(td)
        self.ensure_fenced(td)
        self.schedule(td)
        return td

    def cover_overlaps(self, td: Teardown, slices: Mapping[DeviceKey, SliceDevice]) -> None:
        """Fences, for a teardown that may still be dirty, the devices of `slices` sharing memory with its
        own that it does not fence yet (the slices were unknown at first sight, or have changed since);
        checkpointed first. Fences are only ever added here: a device drops out with the teardown."""
        with self.store.lock:  # the claim's lane may be moving it on meanwhile
            if td.state not in FENCED_STATES:
                return
            known = {o.key for o in td.overlaps}
            added = [o for o in overlap_records(td.claim.uid, td.devices, slices) if o.key not in known]
            if added:
                td.overlaps = [*td.overlaps, *added]
        if not added:
            return
        log.warning(
            "claim %s: now also fencing %s (memory shared with its devices)", td.claim, ", ".join(o.key for o in added)
        )
        self._save()
        # Under the lock: an unfence (a transition, then the lift) cannot slip in between, or it could lift the
        # fences before these go up and leave them standing.
        with self.store.lock:
            if td.state in FENCED_STATES:
                self._fenced.pop(td.claim.uid, None)
                self.ensure_fenced(td)

    def release(self, td: Teardown, reason: str, consumers: list[tuple[str, str]] | None = None) -> None:
        """The claim no longer holds its devices; `consumers` are the pods it was reserved for (the attestation
        names them: its scrub is for what they left)."""
        if td.state != State.ALLOCATED:
            return
        log.info("claim %s released (%s); tearing down %s", td.claim, reason, ", ".join(d.key for d in td.devices))
        self._transition(
            td, State.RELEASED, released_at=self.clock(), release_reason=reason, consumers=list(consumers or [])
        )
        self.schedule(td)

    def rescrub(self, td: Teardown) -> bool:
        """An operator asked for another attempt at a failed teardown."""
        if td.state != State.FAILED:
            return False
        log.warning("claim %s: operator asked for another teardown attempt (last failure: %s)", td.claim, td.reason)
        # One more attempt: `attempts` keeps counting, so another failure waits for the operator again.
        self._transition(td, State.DRAINING, **self._drain_fields())
        self.schedule(td)
        return True

    def advance(self, td: Teardown) -> None:
        """Runs the teardown as far as it can go now. ClusterError propagates (the caller retries later
        with backoff; the state is unchanged and every step is safe to redo)."""
        while self.store.teardowns.get(td.claim.uid) is td:
            if td.state in FENCED_STATES:
                self.ensure_fenced(td)
            outcome = getattr(self, f"_on_{td.state.value}")(td)
            if outcome is None:
                return
            state, changes = outcome
            self._transition(td, state, **changes)

    def waiting(self, td: Teardown) -> bool:
        """Whether `advance` has nothing to do for `td` until something happens to it: allocated, fenced and
        announced (until its release), or failed and reported with no retry due (until an operator acts)."""
        uid = td.claim.uid
        if td.state == State.ALLOCATED:
            return uid in self._fenced and uid in self._status
        if td.state == State.FAILED:
            return td.failure_reported and (td.retry_at is None or self.clock() < td.retry_at)
        return False

    def fenced_devices(self) -> tuple[int, int]:
        """(devices under a fence, devices failed)."""
        fenced = failed = 0
        for td in list(self.store.teardowns.values()):  # also read by the /healthz thread
            if td.state in FENCED_STATES and not (td.fence == "node" and td.state == State.ALLOCATED):
                fenced += len(td.fenced())
            if td.state == State.FAILED:
                failed += len(td.devices)
        return fenced, failed

    # ---------------------------------------------------------------- bookkeeping

    def _save(self) -> None:
        self.store.save()
        fenced, failed = self.fenced_devices()
        self.metrics.fenced_devices.set(fenced)
        self.metrics.failed_devices.set(failed)

    def _commit(self, td: Teardown) -> None:
        self._save()
        if self.on_transition:
            self.on_transition(td, td.state)

    def _transition(self, td: Teardown, state: State, **changes: Any) -> None:
        with self.store.lock:  # a checkpoint write sees the whole transition or none of it
            for key, value in changes.items():
                setattr(td, key, value)
            td.state = state
        self._commit(td)

    def _forget(self, td: Teardown) -> None:
        with self.store.lock:
            del self.store.teardowns[td.claim.uid]
        self._fenced.pop(td.claim.uid, None)
        self._status.pop(td.claim.uid, None)
        self._claims.pop(td.claim.uid, None)
        self.store.save()

    def ensure_fenced(self, td: Teardown) -> None:
        """Makes sure, once per process and teardown, that its fence stands (again, after a restart)."""
        tearing_down = td.state != State.ALLOCATED
        # Weak mode: the node taint goes up only when the teardown starts, so ensure it again then.
        level = tearing_down and self.fencer.weak
        done = self._fenced.get(td.claim.uid)
        if done is None or (level and not done):
            self.fencer.fence(td, tearing_down=tearing_down)
            self._fenced[td.claim.uid] = level

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
        log.error("claim %s: teardown failed (%s: %s); devices stay fenced", td.claim, category, detail)
        return State.FAILED, {
            "reason": f"{category}: {detail}",
            "attempts": attempts,
            "retry_at": retry_at,
            "failure_reported": False,
        }

    # ---------------------------------------------------------------- claim writes

    def _write_claim(self, td: Teardown, updates: dict[str, str], *, release: bool = False) -> bool:
        """Sets annotations on the claim; False when the claim is gone (nothing left to annotate). `release`:
        the same patch removes the finalizer where the attestation among `updates` holds for the claim, so
        that the resource claim controller sees one change, attested and released, instead of two, the
        second of which would fail its deallocation with a conflict and put it into its backoff.

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
            releasing = release and self._attestation_problem(td, claim) is None
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

    def _announce(self, td: Teardown, status: str, extra: dict[str, str] | None = None) -> None:
        """Best-effort progress annotation: an API hiccup must not hold up a scrub."""
        if self._status.get(td.claim.uid) == status:
            return
        try:
            self._write_claim(td, {**(extra or {}), names.ANNOTATION_SCRUB_STATUS: status})
            self._status[td.claim.uid] = status
        except ClusterError as exc:
            log.warning("claim %s: could not set %s=%s: %s", td.claim, names.ANNOTATION_SCRUB_STATUS, status, exc)

    def _devices_annotation(self, td: Teardown) -> str:
        return devices_annotation(((d.driver, d.pool, d.device), d.uuid) for d in td.devices)

    def _event(
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
        if self._status.get(td.claim.uid) is None:
            if td.fence == "rule":
                self._announce(td, names.SCRUB_FENCED, {names.ANNOTATION_DEVICES: self._devices_annotation(td)})
            elif self._write_claim(td, {names.ANNOTATION_DEVICES: self._devices_annotation(td)}):
                # Weak mode: nothing fences the device while it is allocated; say nothing we don't do.
                self._status[td.claim.uid] = ""
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
        self._announce(td, names.SCRUB_DRAINING)
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

    def _on_scrubbing(self, td: Teardown) -> Outcome:
        self._announce(td, names.SCRUB_SCRUBBING)
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
                }
                for d in td.devices
            ],
            started_at=_when(td.scrub_started_at),
            finished_at=_when(td.scrub_finished_at),
            health=td.health or {},
            consumers=td.consumers,
        )
        return State.ATTESTED, {"attestation": self.signer.sign(payload)}

    def _on_attested(self, td: Teardown) -> Outcome:
        # Only reachable through a verified scrub and a signed attestation (see the module docstring).
        self.fencer.lift(td, list(self.store.teardowns.values()))
        if td.released_at is not None:
            scrub_time = (td.scrub_finished_at or 0.0) - (td.scrub_started_at or 0.0)
            self.metrics.teardown_overhead.observe(max(self.clock() - td.released_at - scrub_time, 0.0))
        log.info("claim %s: %s verified clean; fence lifted", td.claim, ", ".join(d.key for d in td.devices))
        return State.UNFENCED, {"reason": None}

    def _on_unfenced(self, td: Teardown) -> Outcome:
        self._write_claim(
            td,
            {
                names.ANNOTATION_DEVICES: self._devices_annotation(td),
                names.ANNOTATION_ATTESTATION: td.attestation or "",
                names.ANNOTATION_SCRUB_STATUS: names.SCRUB_VERIFIED,
            },
            release=True,
        )
        return State.DONE, {}  # done: the finalizer is removed where this write did not (a crash, a mismatch)

    def _on_done(self, td: Teardown) -> Outcome:
        self._remove_finalizer(td)
        self._forget(td)
        return None

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
            self._event(
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
        self._event(
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
                self._keep_orphan_attestation(td)
                return
            annotations = (claim.get("metadata") or {}).get("annotations") or {}
            if annotations.get(names.ANNOTATION_ATTESTATION) != td.attestation:
                self._write_claim(td, {names.ANNOTATION_ATTESTATION: td.attestation})
                continue
            problem = self._attestation_problem(td, claim)
            if problem is not None:
                # The devices are verified clean and unfenced; only the claim object stays. Say why.
                log.error("claim %s: keeping finalizer %s: %s", td.claim, names.FINALIZER, problem)
                self._event(td, "AttestationMismatch", f"finalizer {names.FINALIZER} kept: {problem}")
                return
            ops = finalizer_removal_ops(claim, td.attestation)
            if ops is None:
                return
            try:
                self.cluster.patch_claim(td.claim.namespace, td.claim.name, ops)
                return
            except NotFound:
                self._keep_orphan_attestation(td)
                return
            except Conflict:
                continue
        raise Conflict(f"claim {td.claim} kept changing while the agent removed its finalizer; will retry", 409)


def _merge_health(snapshots: list[HealthSnapshot]) -> dict[str, Any]:
    """One `health` object for the attestation over all of the claim's devices."""
    return {
        "eccUncorrectable": sum(s.ecc_uncorrectable_volatile for s in snapshots),
        "remapPending": any(s.remapped_rows_pending for s in snapshots),
        "xids": sorted({x for s in snapshots for x in s.xids}),
    }
