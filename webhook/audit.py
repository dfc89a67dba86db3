"""The audit log (DESIGN.md, "Audit log"): JSON Lines, one record per deny, warn or audit decision,
hash-chained across size-based rotation.

Each record carries `seq` (1, 2, ... for the life of the log), `prev` (the previous record's hash;
`GENESIS` for the first) and `hash` = SHA-256 over the canonical JSON of the record without `hash`
(sorted keys, compact separators, ASCII). Rotation renames `audit.jsonl` to `audit.jsonl.1`
(`.1` to `.2`, ...) and keeps the chain: the first record of the new file points at the last of the
old one. On start the chain resumes from the last record on disk.

Durability: one writer thread owns the file. It takes every record queued so far, writes them
with one write(2), then fsync(2)s, and only then resolves their futures (group commit). The
webhook awaits that future before it answers, so no decision reaches the API server before its
record is on disk, and the event loop never blocks on the disk.

Evidence beyond the file (audit_checkpoints.py): with a `stream` (the webhook's stdout) each record is
also written there once it is on disk, and with a `checkpointer` a signed checkpoint of the chain head
goes there at open, every `interval` seconds when the head moved, and at close.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .audit_checkpoints import STREAM_KEY, Checkpointer, stream_entries, stream_line
from .defaults import AUDIT_BACKUPS, AUDIT_MAX_BYTES

log = logging.getLogger(__name__)

GENESIS = "sha256:" + "0" * 64
_MAX_BATCH = 512
_TAIL_BLOCK = 64 * 1024


class AuditLogError(RuntimeError):
    """The audit log cannot be opened or written; the message names the file and what to do."""


def canonical(record: Mapping[str, Any]) -> bytes:
    """The bytes `hash` covers: the record without `hash`, sorted keys, compact separators, ASCII
    (non-ASCII as \\u escapes, so that any string, even one with a lone surrogate, has one encoding)."""
    body = {key: value for key, value in record.items() if key != "hash"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("ascii")


def record_hash(record: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical(record)).hexdigest()


def backup_path(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def _last_line(path: Path) -> bytes | None:
    """The last complete line of `path` (without its newline); None when the file is empty or absent."""
    try:
        with path.open("rb") as handle:
            end = handle.seek(0, os.SEEK_END)
            data = b""
            position = end
            while position > 0:
                step = min(_TAIL_BLOCK, position)
                position -= step
                handle.seek(position)
                data = handle.read(step) + data
                if data.count(b"\n") >= 2 or position == 0:
                    break
    except FileNotFoundError:
        return None
    lines = data.rstrip(b"\n").rsplit(b"\n", 1)
    return lines[-1] if lines[-1] else None


def _drop_torn_tail(path: Path) -> None:
    """A crash inside write(2) can leave a last line without its newline. That record was never
    acknowledged (the answer waits for fsync), so it is cut off, loudly, to keep the chain whole."""
    try:
        with path.open("r+b") as handle:
            end = handle.seek(0, os.SEEK_END)
            if end == 0:
                return
            handle.seek(end - 1)
            if handle.read(1) == b"\n":
                return
            position = end
            keep = 0
            while position > 0:
                step = min(_TAIL_BLOCK, position)
                position -= step
                handle.seek(position)
                newline = handle.read(step).rfind(b"\n")
                if newline >= 0:
                    keep = position + newline + 1
                    break
            handle.truncate(keep)
            os.fsync(handle.fileno())
    except FileNotFoundError:
        return
    log.warning(
        "audit log %s ended in a partial record (a crash during a write); removed its last %d bytes, "
        "which no admission answer depended on",
        path,
        end - keep,
        extra={"file": str(path), "bytes_removed": end - keep},
    )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Pending:
    fields: Mapping[str, Any]
    future: Future[dict[str, Any]]


_STOP = object()


class AuditLog:
    """Appends hash-chained records from any thread or coroutine; see the module docstring."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = AUDIT_MAX_BYTES,
        backups: int = AUDIT_BACKUPS,
        stream: TextIO | None = None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        if max_bytes < 1024:
            raise ValueError(f"audit max bytes must be at least 1024, got {max_bytes}")
        if backups < 1:
            raise ValueError(f"audit backups must be at least 1, got {backups}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.stream = stream
        self.checkpointer = checkpointer
        self.host = checkpointer.host if checkpointer is not None else socket.gethostname()
        self._checkpointed: tuple[int, str] | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._size = 0
        self.seq = 0
        self.head = GENESIS

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._resume()
        self._open_current()
        self._checkpoint()
        self._thread = threading.Thread(target=self._run, name="scrubgate-audit-writer", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Writes everything queued so far, then closes the file."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._thread = None
        self._checkpoint()
        os.close(self._fd)
        self._fd = -1

    def _resume(self) -> None:
        _drop_torn_tail(self.path)
        for candidate in (self.path, backup_path(self.path, 1)):
            line = _last_line(candidate)
            if line is None:
                continue
            try:
                record = json.loads(line)
                seq, digest = record["seq"], record["hash"]
                intact = isinstance(seq, int) and digest == record_hash(record)
            except (ValueError, TypeError, KeyError):
                intact = False
            if not intact:
                raise AuditLogError(
                    f"audit log {candidate}: the last record is not an intact audit record, so the chain "
                    f"cannot be resumed; run `scrubgate audit verify {candidate}`, move the file aside "
                    "(keep it as evidence) and restart"
                )
            self.seq, self.head = seq, digest
            return

    def _open_current(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        except OSError as exc:
            raise AuditLogError(f"audit log {self.path}: cannot open for appending: {exc.strerror}") from None
        self._size = os.fstat(self._fd).st_size

    # -- appending -------------------------------------------------------------------------------

    def submit(self, fields: Mapping[str, Any]) -> Future[dict[str, Any]]:
        """Queues a record; the future resolves to the record as written (with seq, prev and hash)
        once it is on disk, or raises OSError when it could not be written."""
        if self._thread is None:
            raise AuditLogError(f"audit log {self.path} is not open")
        future: Future[dict[str, Any]] = Future()
        self._queue.put(_Pending(fields, future))
        return future

    async def append(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        return await asyncio.wrap_future(self.submit(fields))

    def _run(self) -> None:
        interval = self.checkpointer.interval if self.checkpointer is not None else None
        due = None if interval is None else time.monotonic() + interval
        while True:
            if interval is not None and due is not None and time.monotonic() >= due:
                self._checkpoint()
                due = time.monotonic() + interval
            try:
                batch = [self._queue.get(timeout=None if due is None else max(0.0, due - time.monotonic()))]
            except queue.Empty:
                continue
            while len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            pending = [item for item in batch if item is not _STOP and item.future.set_running_or_notify_cancel()]
            if pending:
                try:
                    self._write(pending)
                except Exception as exc:  # the writer must outlive any one batch
                    log.exception("audit log %s: unexpected error while writing", self.path)
                    for item in pending:
                        if not item.future.done():
                            item.future.set_exception(exc)
            if stop:
                return

    def _write(self, pending: list[_Pending]) -> None:
        seq, head = self.seq, self.head
        written: list[tuple[_Pending, dict[str, Any]]] = []
        chunk = bytearray()
        try:
            for item in pending:
                try:
                    record = {**item.fields, "seq": seq + 1, "prev": head}
                    record["hash"] = record_hash(record)
                    data = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")
                except (TypeError, ValueError) as exc:
                    # A record that cannot be serialised fails alone; the chain skips nothing.
                    item.future.set_exception(exc)
                    continue
                seq, head = record["seq"], record["hash"]
                if self._size + len(chunk) > 0 and self._size + len(chunk) + len(data) > self.max_bytes:
                    self._flush(chunk)
                    chunk.clear()
                    self._rotate()
                chunk += data
                written.append((item, record))
            self._flush(chunk)
        except OSError as exc:
            log.error(
                "audit log %s: write failed (%s); %d record(s) not written, their requests are answered with "
                "an error; free space or fix permissions on the volume",
                self.path,
                exc.strerror or exc,
                len(written),
                extra={"file": str(self.path), "errno": exc.errno},
            )
            self._recover()
            for item, _ in written:
                item.future.set_exception(exc)
            return
        self.seq, self.head = seq, head
        self._emit(stream_line("record", record, self.host) for _, record in written)
        for item, record in written:
            item.future.set_result(record)

    def _emit(self, lines: Iterable[str]) -> None:
        """Copies to the stream; a stream that fails costs its copies, never an admission answer."""
        if self.stream is None:
            return
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError) as exc:
            log.error("audit log %s: cannot write the copy to the output stream: %s", self.path, exc)

    def _checkpoint(self) -> None:
        """A signed checkpoint of the head, unless the last one already names it."""
        if self.checkpointer is None or self._checkpointed == (self.seq, self.head):
            return
        self._emit([stream_line("checkpoint", self.checkpointer.sign(self.path, self.seq, self.head), self.host)])
        self._checkpointed = (self.seq, self.head)

    def _flush(self, chunk: bytes | bytearray) -> None:
        view = memoryview(chunk)
        while view:
            count = os.write(self._fd, view)
            view = view[count:]
            self._size += count
        if chunk:
            os.fsync(self._fd)

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = -1
        for index in range(self.backups, 0, -1):
            source = self.path if index == 1 else backup_path(self.path, index - 1)
            if source.exists():
                os.replace(source, backup_path(self.path, index))
        _fsync_dir(self.path.parent)
        self._open_current()

    def _recover(self) -> None:
        """After a failed write the file may end in a partial line, or rotation may have stopped
        half-way; reopen and resume the chain from what is really on disk."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._resume()
            self._open_current()
        except (OSError, AuditLogError) as exc:
            log.error("audit log %s: cannot recover after a failed write: %s", self.path, exc)


# -- verification --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    seq: int | None
    what: str


@dataclass
class VerifyResult:
    files: list[str] = field(default_factory=list)
    records: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    last_hash: str | None = None
    starts_at_genesis: bool = False
    problem: Problem | None = None
    unreadable: str | None = None
    # seq -> hash of every record read (first occurrence), broken chain or not, for the checkpoints.
    hashes: dict[int, str] = field(default_factory=dict)

    @property
    def intact(self) -> bool:
        return self.problem is None and self.unreadable is None


_ROTATED = re.compile(r"^(?P<base>.*)\.(?P<index>\d+)$")


def _chain_order(paths: Sequence[Path]) -> list[Path]:
    """Rotated files of one log (`x`, `x.1`, `x.2`...) in the order they were written (oldest first),
    so that a shell glob's order does not matter; any other list is taken in the order given."""
    bases = set()
    indexed = []
    for path in paths:
        match = _ROTATED.match(path.name)
        base, index = (match["base"], int(match["index"])) if match else (path.name, 0)
        bases.add((path.parent, base))
        indexed.append((index, path))
    if len(bases) != 1:
        return list(paths)
    return [path for _, path in sorted(indexed, key=lambda item: -item[0])]


@dataclass(frozen=True)
class _Entry:
    file: str
    line: int
    record: dict[str, Any] | None
    error: str | None


def _read_stream(path: Path, host: str | None) -> list[_Entry]:
    """The records among the stream's lines in `path` (of pod `host`, when given)."""
    entries = []
    for number, entry in stream_entries(path):
        if entry[STREAM_KEY] != "record" or (host is not None and entry.get("host") != host):
            continue
        record = entry.get("record")
        if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
            entries.append(_Entry(str(path), number, None, "altered: not an audit record (no integer seq)"))
        else:
            entries.append(_Entry(str(path), number, record, None))
    return entries


def _read(paths: Iterable[Path], result: VerifyResult, stream: bool, host: str | None) -> list[_Entry] | None:
    entries = []
    for path in paths:
        try:
            if stream:
                entries += _read_stream(path, host)
                result.files.append(str(path))
                continue
            data = path.read_bytes()
        except OSError as exc:
            result.unreadable = f"{path}: {exc.strerror or exc}"
            return None
        result.files.append(str(path))
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for number, raw in enumerate(lines, start=1):
            try:
                record = json.loads(raw)
            except ValueError:
                entries.append(_Entry(str(path), number, None, "altered: the line is not valid JSON"))
                continue
            if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
                entries.append(_Entry(str(path), number, None, "altered: not an audit record (no integer seq)"))
                continue
            entries.append(_Entry(str(path), number, record, None))
    return entries


def verify_files(paths: Sequence[str | Path], *, stream: bool = False, host: str | None = None) -> VerifyResult:
    """Recomputes the chain over `paths` (rotated files of one log in any order, or files given in
    chain order; with `stream`, captures of the webhook's stdout, whose records of pod `host` are read)
    and names the first record that was altered, dropped, reordered or duplicated."""
    result = VerifyResult()
    entries = _read(_chain_order([Path(p) for p in paths]), result, stream, host)
    if entries is None:
        return result
    positions = {entry.record["seq"]: entry for entry in entries if entry.record is not None}
    for entry in entries:
        if entry.record is not None:
            result.hashes.setdefault(entry.record["seq"], str(entry.record.get("hash")))
    previous: dict[str, Any] | None = None
    for entry in entries:
        record = entry.record
        if record is None:
            result.problem = Problem(entry.file, entry.line, None, entry.error or "altered")
            return result
        seq = record["seq"]

        def broken(what: str, entry: _Entry = entry, seq: int = seq) -> VerifyResult:
            result.problem = Problem(entry.file, entry.line, seq, what)
            return result

        if record.get("hash") != record_hash(record):
            return broken("altered: the record does not match its hash")
        if previous is None:
            result.first_seq = seq
            result.starts_at_genesis = seq == 1 and record.get("prev") == GENESIS
            if seq == 1 and record.get("prev") != GENESIS:
                return broken("altered: the first record of the log does not point at the genesis hash")
        else:
            expected = previous["seq"] + 1
            if seq != expected:
                if seq <= previous["seq"]:
                    return broken(f"reordered or duplicated: seq {seq} follows seq {previous['seq']}")
                later = positions.get(expected)
                if later is not None and (later.file, later.line) != (entry.file, entry.line):
                    return broken(
                        f"reordered: seq {seq} follows seq {previous['seq']}; seq {expected} is at "
                        f"{later.file}:{later.line}"
                    )
                missing = f"seq {expected}" if seq == expected + 1 else f"seq {expected}..{seq - 1}"
                return broken(f"dropped: {missing} missing before this record")
            if record.get("prev") != previous["hash"]:
                return broken("altered: prev does not match the hash of the record before it")
        previous = record
        result.records += 1
        result.last_seq, result.last_hash = seq, record["hash"]
    return result
