"""The cluster as `scrubgate reports` holds it: what the rules read of each object that may matter (slim.py),
packed (marshal: about 300 bytes for a GPU pod, where its Python objects would take some kilobytes), from the
last full list, kept current by watch events (ADDED, MODIFIED, DELETED) from each list's resourceVersion as an
informer keeps its cache. It notes which objects changed, so that only those are checked again (rechecks.py).
"""

from __future__ import annotations

import marshal
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from .cluster import SKIPPED_NAMESPACES, Kind, Snapshot
from .slim import slim

# marshal's format 2: the same bytes for the same object, which tell a changed object from one that is not. Later
# formats write a string met twice as a back-reference, which depends on how the object was built (a list page
# shares strings a watch event does not).
PACKING = 2

Key = tuple[str, str]  # (namespace, or "" for a cluster-scoped object; name)
Ref = tuple[str, Key]  # (the list's path, the object's key)


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def entry(obj: dict[str, Any]) -> tuple[Key, bytes] | None:
    """What the mirror holds of a listed or watched object (with its apiVersion and kind): its key and packed slim
    form; None for an object that cannot produce a finding, or one in a namespace the webhooks leave alone."""
    key = key_of(obj)
    if key[0] in SKIPPED_NAMESPACES:
        return None
    kept = slim(obj)
    return None if kept is None else (key, marshal.dumps(kept, PACKING))


class Mirror:
    """Filled by `load` (a full list) and `apply` (a watch event of the current list's generation; those of an
    earlier one, still draining, are dropped). Threads: the watches apply, the rounds read and take changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation = 0
        self.kinds: dict[str, tuple[Kind, str]] = {}  # path -> its Kind and apiVersion
        self.versions: dict[str, str] = {}  # path -> the resourceVersion to watch from
        self._objects: dict[str, dict[Key, bytes]] = {}
        self._changed: set[Ref] = set()

    def load(self, snapshot: Snapshot) -> int:
        """Holds what a full list read (`snapshot.objects`: (Kind, `entry`) pairs) instead of what was held, notes
        what differs as changed, and returns the new generation."""
        by_kind = {kind: path for path, (kind, _) in snapshot.kinds.items()}
        objects: dict[str, dict[Key, bytes]] = {path: {} for path in snapshot.kinds}
        for kind, (key, packed) in snapshot.objects:
            objects[by_kind[kind]][key] = packed
        with self._lock:
            for path in objects.keys() | self._objects.keys():
                old, new = self._objects.get(path, {}), objects.get(path, {})
                self._changed.update((path, key) for key in old.keys() | new.keys() if old.get(key) != new.get(key))
            self._objects, self.kinds = objects, dict(snapshot.kinds)
            self.versions = dict(snapshot.resource_versions)
            self.generation += 1
            return self.generation

    def apply(self, generation: int, path: str, event: Mapping[str, Any]) -> bool:
        """One watch event of `path`; False when the watch cannot go on from here (ERROR: e.g. 410 Gone) or a
        newer list has replaced the one it follows."""
        kind, obj = event.get("type"), event.get("object") or {}
        with self._lock:
            if kind == "ERROR" or generation != self.generation:
                return False
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.versions[path] = version
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                return True
            held = self._objects[path]
            key = key_of(obj)
            kept = entry({**obj, "apiVersion": self.kinds[path][1], "kind": self.kinds[path][0].kind})
            if kind == "DELETED" or kept is None:
                if held.pop(key, None) is not None:
                    self._changed.add((path, key))
            elif held.get(key) != kept[1]:
                held[key] = kept[1]
                self._changed.add((path, key))
            return True

    def take_changes(self) -> set[Ref]:
        """What changed since the last call."""
        with self._lock:
            changed, self._changed = self._changed, set()
            return changed

    def get(self, ref: Ref) -> dict[str, Any] | None:
        path, key = ref
        with self._lock:
            packed = self._objects.get(path, {}).get(key)
        return None if packed is None else marshal.loads(packed)

    def refs(self, path: str | None = None) -> list[Ref]:
        """Every object held (of the list at `path`), in the order of the lists and of their keys."""
        with self._lock:
            paths = [path] if path is not None else list(self._objects)
            return [(p, key) for p in paths for key in sorted(self._objects.get(p, {}))]

    def values(self, path: str) -> Iterator[dict[str, Any]]:
        for ref in self.refs(path):
            found = self.get(ref)
            if found is not None:
                yield found

    def path_of(self, kind_name: str) -> str | None:
        return next((path for path, (kind, _) in self.kinds.items() if kind.kind == kind_name), None)

    def count(self, path: str | None = None) -> int:
        """How many objects are held (of the list at `path`)."""
        with self._lock:
            return sum(len(held) for p, held in self._objects.items() if path in (None, p))

    def __len__(self) -> int:
        return self.count()
