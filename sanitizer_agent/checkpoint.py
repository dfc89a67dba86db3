"""The agent's checkpoint: every teardown it owes, persisted at every state transition.

One JSON file on the node (hostPath), written atomically: a temp file in the same directory, fsync,
rename over the real one, fsync the directory. A crash leaves either the old or the new file, never a
mix; a stray temp file is ignored. The file carries a version; the agent reads the versions it knows
(1 and 2, written when every allocation was fenced from first sight, are carried over: their teardowns
keep their fences; 3, written before the agent held its claims, carries over with no hold: a teardown still
allocated gets one, a later one is attested by its allocation's timestamp and consumers) and refuses any other
loudly rather than guess: a misread checkpoint could lift a fence on a dirty device.
"""

from __future__ import annotations

import json
import os
import threading
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from .gpu.base import MigPlacement

VERSION = 4
DEFAULT_PATH = Path("/var/lib/scrubgate/agent-checkpoint.json")


class CheckpointError(RuntimeError):
    """The checkpoint cannot be read or written; the agent must not go on guessing."""


class State(StrEnum):
    """Teardown states, in order; FAILED can follow any of them."""

    # The claim holds the devices. Its allocation keeps them from every other claim, and stays until the
    # attestation lands (the webhook's SG007), so no fence is needed unless `Teardown.fenced`.
    ALLOCATED = "allocated"
    RELEASED = "released"  # the claim let go; the device may hold the tenant's data
    DRAINING = "draining"  # waiting (bounded) for every process on the device to exit
    SCRUBBING = "scrubbing"  # zero, verify, health check
    VERIFIED = "verified"  # every device verified clean; next: sign
    # Attestation signed; next: write it to the claim, removing the finalizer in the same patch where it holds
    # for the claim (or, the claim gone, into an Event on the node).
    ATTESTED = "attested"
    # Attestation published; next: lift the teardown's fences, if it has any (only now: a fenced device's claim
    # may no longer hold it, and it is handed out again only once its attestation can be read), remove the
    # finalizer if it is still there (a crash, a claim that changed), then forget the teardown.
    DONE = "done"
    FAILED = "failed"  # fenced, scrub-failed taint added; retried with backoff, then an operator


# Where a device may hold a tenant's data: out of reach of other claims, by its claim's allocation or a fence.
DIRTY_STATES = frozenset({State.ALLOCATED, State.RELEASED, State.DRAINING, State.SCRUBBING, State.FAILED})
# Where the teardown's own fences, if it has any, still stand: until its attestation is published (`done`).
OWED_STATES = DIRTY_STATES | {State.VERIFIED, State.ATTESTED}

FenceKind = Literal["rule", "node"]


class FenceReason(StrEnum):
    """Why a teardown fences its devices instead of leaving them to its claim's allocation (a metric label)."""

    # At first sight: the allocation does not keep every device from other claims (admin access, a device
    # several claims may hold, memory shared with a device that consumes none of the allocation's counters).
    NOT_HELD = "not-held"
    # The allocation went (cleared, or the claim deleted) before the attestation: the guard was bypassed.
    ALLOCATION_LOST = "allocation-lost"
    FAILED = "failed"  # the teardown failed: its claim may be let go (break-glass) while the device is dirty
    HAND_OVER = "hand-over"  # the agent stopped with the teardown owed (uninstall, upgrade, a node shutting down)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ClaimRef(_Model):
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


class ScrubRecord(_Model):
    bytes_scrubbed: int
    bytes_total: int
    bytes_reserved: int
    bytes_unreachable: int
    duration_s: float
    verified: bool
    method: str
    reason: str | None = None
    scrub_on_free: bool | None = None
    ecc_enabled: bool | None = None


class FencedDevice(_Model):
    """A device a teardown keeps fenced until its own devices are verified clean."""

    driver: str
    pool: str
    device: str
    # The GPU (or MIG device) UUID from the ResourceSlice's `uuid` attribute; None when the slice did
    # not say (for a claim's own device the scrub then fails closed).
    uuid: str | None
    fence_rule: str  # our DeviceTaintRule with scrubgate.dev/unsanitized for this claim and device

    @property
    def key(self) -> str:
        return f"{self.driver}/{self.pool}/{self.device}"


class DeviceRecord(FencedDevice):
    """One of the claim's own devices: drained, scrubbed and attested."""

    failed_rule: str  # our DeviceTaintRule with scrubgate.dev/scrub-failed, while failed
    scrub: ScrubRecord | None = None
    # A dynamic MIG device: NVIDIA's driver deletes it on unprepare, so it is scrubbed through its placement.
    placement: MigPlacement | None = None


class OverlapRecord(FencedDevice):
    """A device of this node whose memory overlaps one of the claim's (the GPU a MIG device is carved
    from, or a MIG device carved from the claim's GPU). With partitionable devices (dynamic MIG) they
    consume the same counters, so the claim's allocation keeps it from other claims too; without shared
    counters it does not, and the teardown fences it. Never scrubbed itself: it is clean once the claim's
    devices are."""

    shares_memory_with: list[str]  # keys of the claim's devices it overlaps


class Teardown(_Model):
    claim: ClaimRef
    devices: list[DeviceRecord]
    overlaps: list[OverlapRecord] = []
    state: State
    fence: FenceKind  # how it fences where it must: DeviceTaintRules, or the node taint where none are served
    # Whether its fences stand (or are owed after a crash): set, and checkpointed, before the first one goes up;
    # they go only after a verified scrub. None while its claim's allocation alone keeps the devices.
    fenced: FenceReason | None = None
    not_held: list[str] = []  # why its allocation does not keep every device it covers from other claims
    # Where the teardown was learnt from: "cluster" (a claim on this node) or "nvidia-checkpoint".
    source: str = "cluster"
    allocated_at: float  # unix time of the claim's creation (or first sight); health is checked since then
    # Unix time of first sight: the record of its devices goes on the claim once the allocation has lasted a
    # while (`TeardownSettings.record_after_s`); None (an older checkpoint): due now.
    seen_at: float | None = None
    released_at: float | None = None
    release_reason: str | None = None
    consumers: list[tuple[str, str]] = []  # (name, UID) of the pods the claim was reserved for at release
    # The agent's hold on the claim (a scrubgate.dev/nodeagents consumer in its status.reservedFor): its UID, set
    # and checkpointed before the hold is written, released after the attestation; and the allocation's
    # allocationTimestamp. Both go into the attestation, which covers this allocation and no later one.
    hold: str | None = None
    allocated_stamp: str | None = None
    drain_deadline: float | None = None
    scrub_started_at: float | None = None
    scrub_finished_at: float | None = None
    health: dict[str, Any] | None = None
    attestation: str | None = None
    reason: str | None = None  # why it failed, for the status annotation, the Event and `agent status`
    failure_reported: bool = False
    attempts: int = 0  # failed attempts so far
    retry_at: float | None = None  # None while failed: waiting for an operator (`agent rescrub`)

    def holds(self, key: str) -> bool:
        return any(d.key == key for d in self.devices)

    def fence_targets(self) -> list[FencedDevice]:
        """Every device a fence of this teardown covers until its own are verified clean: its devices and
        those sharing memory with them."""
        return [*self.devices, *self.overlaps]


class CheckpointFile(_Model):
    version: Literal[4]
    node: str
    teardowns: dict[str, Teardown] = {}  # by claim UID


class CheckpointStore:
    """The checkpoint file and its in-memory copy; `save()` persists the whole copy atomically.

    Threads that change teardowns hold `lock` while they change them, so that a write never catches a
    transition half made; saves asked for at the same time share one write (and its fsyncs)."""

    def __init__(self, path: Path | str, node: str) -> None:
        self.path = Path(path)
        self.data = CheckpointFile(version=VERSION, node=node)
        self.lock = threading.RLock()
        self._writes = threading.Condition()
        self._asked = 0  # saves asked for so far
        self._written = 0  # of those, how many a finished write covers
        self._writing = False

    @property
    def teardowns(self) -> dict[str, Teardown]:
        return self.data.teardowns

    def load(self) -> None:
        """Reads the file if it exists; refuses another node's file, another version, or a damaged one."""
        self.data = read(self.path, expect_node=self.data.node) or CheckpointFile(version=VERSION, node=self.data.node)

    def save(self) -> None:
        """Returns once a write that began after this call has finished: what the caller changed before is on
        disk. While one write runs, the saves asked for meanwhile wait and share the next one."""
        with self._writes:
            self._asked += 1
            mine = self._asked
            while self._written < mine:
                if self._writing:
                    self._writes.wait()
                    continue
                self._writing = True
                covers = self._asked
                self._writes.release()
                try:
                    with self.lock:
                        content = self.data.model_dump_json(indent=1).encode()
                    write_atomic(self.path, content)
                finally:
                    self._writes.acquire()
                    self._writing = False
                    self._writes.notify_all()
                self._written = covers  # reached only when the write succeeded


def read(path: Path, expect_node: str | None = None) -> CheckpointFile | None:
    """The checkpoint at `path`, or None when there is none yet."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is not JSON ({exc}); refusing to start. Move it aside to start fresh: the agent "
            "then fences every device that the claims on this node or NVIDIA's checkpoint show as used"
        ) from exc
    version = data.get("version") if isinstance(data, dict) else None
    if version in (1, 2):
        data = _from_version_2(_from_version_1(data) if version == 1 else data)
    elif version == 3:
        data = {**data, "version": VERSION}  # no hold yet: the fields default to None
    elif version != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has version {version!r}; this agent reads versions 1 to {VERSION}. Refusing to "
            "start rather than misread it: run the agent release that wrote it, or move the file aside"
        )
    try:
        checkpoint = CheckpointFile.model_validate(data)
    except ValidationError as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {exc}; refusing to start") from exc
    if expect_node is not None and checkpoint.node != expect_node:
        raise CheckpointError(
            f"checkpoint {path} belongs to node {checkpoint.node!r}, not {expect_node!r}; check --node and the "
            "hostPath mount"
        )
    return checkpoint


def _from_version_1(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 wrote the attestation to the claim before it lifted the fences: its `unfenced` (attestation
    written, fences still up) is version 2's `attested` (lift, then write again: both idempotent). Its other
    states mean what they mean in version 2."""
    teardowns = data.get("teardowns")
    if isinstance(teardowns, dict):
        for teardown in teardowns.values():
            if isinstance(teardown, dict) and teardown.get("state") == "unfenced":
                teardown["state"] = State.ATTESTED.value
    return {**data, "version": 2}


def _from_version_2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 fenced every allocation with DeviceTaintRules from first sight (in weak mode, with the node
    taint once the teardown began), and lifted them before writing the attestation: its `unfenced` (lifted,
    attestation next) is version 3's `attested` with no fence; every earlier state keeps its fences, which go
    after the attestation is written, as a fenced teardown's do in version 3 (and 4)."""
    teardowns = data.get("teardowns")
    if isinstance(teardowns, dict):
        for teardown in teardowns.values():
            if not isinstance(teardown, dict):
                continue
            if teardown.get("state") == "unfenced":
                teardown["state"] = State.ATTESTED.value
            elif teardown.get("state") != State.DONE and (
                teardown.get("fence") != "node" or teardown.get("state") != State.ALLOCATED
            ):
                teardown["fenced"] = FenceReason.HAND_OVER.value
    return {**data, "version": VERSION}


def write_atomic(path: Path, content: bytes) -> None:
    """Replace `path` with `content` so that a crash at any instant leaves the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from exc
