"""The object store: objects by (group, resource, namespace, name), one global resourceVersion
counter, a bounded event history that watches resume from, and an optional append-only journal
so that a restarted stand-in keeps its objects (``--state-dir``).

Objects are stored in their storage version; every write replaces the stored dict (stored dicts
are never mutated), so events and listings share them; ``get`` hands out a deep copy.
"""

from __future__ import annotations

import bisect
import copy
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

Key = tuple[str, str, str, str]  # group, plural, namespace ("" for cluster-scoped), name


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    key: Key
    obj: dict
    old: dict | None


class StoreError(Exception):
    pass


class Exists(StoreError):
    pass


class Missing(StoreError):
    pass


class Stale(StoreError):
    pass


class Expired(StoreError):
    def __init__(self, requested: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {requested} ({oldest})")
        self.requested = requested
        self.oldest = oldest


def object_rv(obj: dict) -> str:
    return str(obj.get("metadata", {}).get("resourceVersion", ""))


class Store:
    def __init__(self, journal: Path | None = None, history_limit: int = 50_000) -> None:
        self._cond = threading.Condition()
        self._objects: dict[Key, dict] = {}
        self._by_resource: dict[tuple[str, str], dict[Key, dict]] = {}  # (group, plural) -> its objects
        self._rv = 0
        self._history: list[Event] = []
        self._history_limit = history_limit
        # Watches may resume from any resourceVersion >= this one; older ones get 410 Gone.
        self._resumable_from = 0
        self._closed = False
        self._journal_path = journal
        self._journal: TextIO | None = None
        self._journal_lines = 0
        if journal is not None:
            self._load(journal)

    # ------------------------------------------------------------------ reads

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def get(self, key: Key) -> dict | None:
        with self._cond:
            obj = self._objects.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, group: str, plural: str, namespace: str | None = None) -> tuple[list[dict], int]:
        """The objects of one resource (in one namespace when given), sorted by key, and the
        resourceVersion they are current at. Shared with the store: read them, deep-copy to change."""
        with self._cond:
            objects = self._by_resource.get((group, plural), {})
            keys = sorted(k for k in objects if namespace is None or k[2] == namespace)
            return [objects[k] for k in keys], self._rv

    def namespaced_keys(self, namespace: str) -> list[Key]:
        with self._cond:
            return [k for k in self._objects if k[2] == namespace]

    # ------------------------------------------------------------------ writes

    def create(self, key: Key, obj: dict) -> dict:
        with self._cond:
            if key in self._objects:
                raise Exists(key)
            return self._commit("ADDED", key, obj, None)

    def replace(self, key: Key, obj: dict, expect_rv: str) -> dict:
        """Store ``obj`` if the stored object still has ``expect_rv``; raises Missing/Stale."""
        with self._cond:
            old = self._check(key, expect_rv)
            return self._commit("MODIFIED", key, obj, old)

    def remove(self, key: Key, expect_rv: str) -> dict:
        with self._cond:
            old = self._check(key, expect_rv)
            return self._commit("DELETED", key, old, old)

    def _check(self, key: Key, expect_rv: str) -> dict:
        current = self._objects.get(key)
        if current is None:
            raise Missing(key)
        if object_rv(current) != expect_rv:
            raise Stale(key)
        return current

    def _commit(self, kind: str, key: Key, obj: dict, old: dict | None) -> dict:
        self._rv += 1
        stored = copy.deepcopy(obj)
        stored.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            del self._objects[key]
            del self._by_resource[key[:2]][key]
        else:
            self._objects[key] = stored
            self._by_resource.setdefault(key[:2], {})[key] = stored
        self._history.append(Event(self._rv, kind, key, stored, old))
        if len(self._history) > self._history_limit:
            dropped = self._history[: self._history_limit // 2]
            del self._history[: self._history_limit // 2]
            self._resumable_from = dropped[-1].rv
        self._write_journal(key, None if kind == "DELETED" else stored)
        self._cond.notify_all()
        return copy.deepcopy(stored)

    # ------------------------------------------------------------------ watching

    def events_after(self, rv: int, timeout: float) -> list[Event]:
        """Events with resourceVersion > ``rv``, waiting up to ``timeout`` s for one; raises Expired."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._rv <= rv:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if rv < self._resumable_from:
                raise Expired(rv, self._resumable_from)
            start = bisect.bisect_right(self._history, rv, key=lambda e: e.rv)
            return self._history[start:]

    def check_resumable(self, rv: int) -> None:
        with self._cond:
            if rv < self._resumable_from:
                raise Expired(rv, self._resumable_from)

    def wait_for_change(self, rv: int, timeout: float) -> int:
        """Block until the resourceVersion passes ``rv`` (or timeout/close); returns the current one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._rv <= rv:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._rv

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if self._journal is not None:
                self._journal.close()
                self._journal = None

    # ------------------------------------------------------------------ journal

    def _load(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with path.open(encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        # A torn last line from a kill -9 mid-write; everything before it is intact.
                        print(f"devcluster: ignoring unreadable journal line {line_no} of {path}", flush=True)
                        continue
                    key = tuple(record["key"])
                    self._rv = max(self._rv, int(record["rv"]))
                    if record["obj"] is None:
                        self._objects.pop(key, None)  # type: ignore[arg-type]
                    else:
                        self._objects[key] = record["obj"]  # type: ignore[index]
        self._resumable_from = self._rv
        for key, obj in self._objects.items():
            self._by_resource.setdefault(key[:2], {})[key] = obj
        self._compact()

    def _compact(self) -> None:
        assert self._journal_path is not None
        tmp = self._journal_path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for key, obj in self._objects.items():
                f.write(json.dumps({"rv": int(object_rv(obj) or 0), "key": list(key), "obj": obj}) + "\n")
            # Keep the counter even if the newest write was a deletion.
            f.write(json.dumps({"rv": self._rv, "key": ["", "", "", ""], "obj": None}) + "\n")
        os.replace(tmp, self._journal_path)
        if self._journal is not None:
            self._journal.close()
        self._journal = self._journal_path.open("a", encoding="utf-8")
        self._journal_lines = len(self._objects) + 1

    def _write_journal(self, key: Key, obj: dict | None) -> None:
        if self._journal is None:
            return
        self._journal.write(json.dumps({"rv": self._rv, "key": list(key), "obj": obj}) + "\n")
        self._journal.flush()
        self._journal_lines += 1
        if self._journal_lines > 4 * len(self._objects) + 10_000:
            self._compact()

    def iter_all(self) -> Iterator[tuple[Key, dict]]:
        """Every object, for controllers that scan everything (shared and read-only, as with list)."""
        with self._cond:
            items = list(self._objects.items())
        yield from items
