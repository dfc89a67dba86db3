"""An in-memory stand-in for scrubgate.cluster.Api: lists with limit/continue, get, create, update with
resourceVersion, delete, and watches fed from a list of events. It records every call."""

from __future__ import annotations

import copy
import itertools
import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from scrubgate.cluster import CHECKED_KINDS, NAMESPACES, ApiError

Obj = dict[str, Any]
# The last segment of a collection's path; any other GET path names one object.
PLURALS = {kind.plural for kind in (NAMESPACES, *CHECKED_KINDS)} | {
    "policyreports", "clusterpolicyreports", "reports", "clusterreports",
}  # fmt: skip


class FakeApi:
    def __init__(self, *, dra_versions: tuple[str, ...] = ("v1",), served: tuple[str, ...] = ("/apis/",)) -> None:
        self.collections: dict[str, list[Obj]] = {}  # collection path (all namespaces) -> items
        self.dra_versions = dra_versions
        self.served = served  # path prefixes the server answers; others are 404
        self.calls: list[tuple[str, str, dict[str, str]]] = []
        self.events: dict[str, list[Obj]] = {}  # watch path -> events the next watch of it sends
        self.watched = threading.Event()
        self._rv = itertools.count(100)

    # -- set-up ----------------------------------------------------------------------------------

    def add(self, collection: str, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._rv))
        self.collections.setdefault(collection, []).append(obj)
        return obj

    def writes(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path, _ in self.calls if method != "GET"]

    # -- Api -------------------------------------------------------------------------------------

    def request(self, method: str, path: str, query: Mapping[str, str] | None = None, body: Any = None) -> Obj:
        self.calls.append((method, path, dict(query or {})))
        if path == "/apis/resource.k8s.io":
            if not self.dra_versions:
                raise ApiError(f"GET {path}: HTTP 404: not found", 404)
            return {
                "versions": [{"version": v} for v in self.dra_versions],
                "preferredVersion": {"version": self.dra_versions[0]},
            }
        if not path.startswith(("/api/", *self.served)):
            raise ApiError(f"{method} {path}: HTTP 404: the server could not find the requested resource", 404)
        if method == "GET" and path.rsplit("/", 1)[-1] in PLURALS:
            return self._list(path, dict(query or {}))
        collection, namespace, name = self._split(path)
        if method == "POST":
            return self._create(path, body)
        items = self.collections.get(collection, [])
        found = next((o for o in items if self._key(o) == (namespace, name)), None)
        if found is None:
            raise ApiError(f"{method} {path}: HTTP 404: not found", 404)
        if method == "GET":
            return copy.deepcopy(found)
        if method == "DELETE":
            items.remove(found)
            return {}
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != found["metadata"]["resourceVersion"]:
                raise ApiError(f"PUT {path}: HTTP 409: the object has been modified", 409)
            stamped = self._stamp(body)
            items[items.index(found)] = stamped
            return copy.deepcopy(stamped)
        raise ApiError(f"{method} {path}: HTTP 405", 405)

    def stream(self, path: str, query: Mapping[str, str]) -> Iterator[Obj]:
        self.calls.append(("WATCH", path, dict(query)))
        self.watched.set()
        yield from self.events.pop(path, [])  # each event once, as a watch from a later resourceVersion sends it

    # -- internals -------------------------------------------------------------------------------

    def _stamp(self, obj: Obj) -> Obj:
        # Stored as the API server stores it: JSON whose object keys come back sorted (Go maps).
        obj = json.loads(json.dumps(obj, sort_keys=True))
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        return obj

    def _create(self, path: str, body: Obj) -> Obj:
        collection, namespace, _ = self._split(path + "/x")
        if any(self._key(o) == (namespace, body["metadata"]["name"]) for o in self.collections.get(collection, [])):
            raise ApiError(f"POST {path}: HTTP 409: already exists", 409)
        obj = self._stamp({**body, "metadata": {**body["metadata"], **({"namespace": namespace} if namespace else {})}})
        self.collections.setdefault(collection, []).append(obj)
        return copy.deepcopy(obj)

    @staticmethod
    def _key(obj: Obj) -> tuple[str | None, str]:
        meta = obj.get("metadata") or {}
        return meta.get("namespace"), meta.get("name", "")

    @staticmethod
    def _split(path: str) -> tuple[str, str | None, str]:
        """/apis/g/v/namespaces/ns/plural/name -> (/apis/g/v/plural, ns, name)."""
        parts = path.split("/")
        name = parts[-1]
        if "namespaces" in parts[:-2]:
            i = parts.index("namespaces")
            return "/".join(parts[:i] + parts[i + 2 : -1]), parts[i + 1], name
        return "/".join(parts[:-1]), None, name

    def _list(self, path: str, query: dict[str, str]) -> Obj:
        items = list(self.collections.get(path, []))
        selector = query.get("labelSelector")
        if selector:
            wanted = dict(pair.split("=", 1) for pair in selector.split(","))
            items = [o for o in items if wanted.items() <= ((o.get("metadata") or {}).get("labels") or {}).items()]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or len(items) or 1)
        page = items[start : start + limit]
        more = start + limit < len(items)
        return {
            "metadata": {"resourceVersion": str(next(self._rv)), **({"continue": str(start + limit)} if more else {})},
            "items": [{k: v for k, v in copy.deepcopy(o).items() if k not in ("apiVersion", "kind")} for o in page],
        }
