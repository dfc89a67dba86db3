"""The garbage collector and namespace controller of kube-controller-manager, simplified.

- An object whose owners (``ownerReferences``, matched by UID) are all gone is deleted in the
  background; references to owners that are gone are dropped when other owners remain.
- ``propagationPolicy: Orphan`` (finalizer ``orphan``): dependents lose their reference to the
  owner, then the finalizer goes. ``Foreground`` (finalizer ``foregroundDeletion``): dependents
  are deleted, the finalizer goes when none is left.
- A namespace being deleted (phase Terminating) has its content deleted, then goes away.

Every write goes through the API (and so through admission) as the component's service account.
"""

from __future__ import annotations

import copy
from collections import defaultdict

from .api import Api
from .auth import GARBAGE_COLLECTOR, NAMESPACE_CONTROLLER
from .resources import kind_known, resource_type
from .store import Key
from .worker import Worker


class GarbageCollector(Worker):
    name = "garbage-collector"
    min_period_s = 0.2  # it scans every object

    def __init__(self, api: Api, interval_s: float = 0.5) -> None:
        super().__init__(api, GARBAGE_COLLECTOR, interval_s)

    def sync(self) -> None:
        objects = dict(self.api.store.iter_all())
        by_uid = {obj["metadata"].get("uid"): key for key, obj in objects.items()}
        dependents: dict[str, list[Key]] = defaultdict(list)
        for key, obj in objects.items():
            for ref in obj["metadata"].get("ownerReferences") or []:
                dependents[ref.get("uid", "")].append(key)
        for key, obj in objects.items():
            self._collect_orphan(key, obj, by_uid)
            meta = obj["metadata"]
            if meta.get("deletionTimestamp"):
                finalizers = meta.get("finalizers") or []
                if "orphan" in finalizers:
                    self._orphan(key, obj, [(k, objects[k]) for k in dependents.get(meta["uid"], [])])
                if "foregroundDeletion" in finalizers:
                    self._foreground(key, obj, [(k, objects[k]) for k in dependents.get(meta["uid"], [])])

    def _collect_orphan(self, key: Key, obj: dict, by_uid: dict[str, Key]) -> None:
        meta = obj["metadata"]
        refs = meta.get("ownerReferences") or []
        if not refs:
            return
        # Owners of kinds the stand-in does not serve (a Job, a ReplicaSet) cannot be checked: kept.
        alive = [
            r
            for r in refs
            if not kind_known(r.get("apiVersion", ""), r.get("kind", ""))
            or (r.get("uid") in by_uid and by_uid[r["uid"]][3] == r.get("name"))
        ]
        rt = resource_type(key[0], key[1])
        if not alive and not meta.get("deletionTimestamp"):
            self.delete(rt, key[2], key[3], {"propagationPolicy": "Background", "preconditions": {"uid": meta["uid"]}})
        elif alive and len(alive) < len(refs):
            updated = copy.deepcopy(obj)
            updated["metadata"]["ownerReferences"] = alive
            self.update(rt, updated)

    def _orphan(self, key: Key, owner: dict, dependents: list[tuple[Key, dict]]) -> None:
        uid = owner["metadata"]["uid"]
        for dep_key, dep in dependents:
            updated = copy.deepcopy(dep)
            updated["metadata"]["ownerReferences"] = [
                r for r in dep["metadata"].get("ownerReferences") or [] if r.get("uid") != uid
            ]
            if self.update(resource_type(dep_key[0], dep_key[1]), updated) is None:
                return  # next pass: the finalizer stays until every dependent is released
        self._drop_finalizer(key, owner, "orphan")

    def _foreground(self, key: Key, owner: dict, dependents: list[tuple[Key, dict]]) -> None:
        blocking = [
            (k, d)
            for k, d in dependents
            if any(
                r.get("uid") == owner["metadata"]["uid"] and r.get("blockOwnerDeletion")
                for r in d["metadata"].get("ownerReferences") or []
            )
        ]
        for dep_key, dep in dependents:
            if not dep["metadata"].get("deletionTimestamp"):
                self.delete(
                    resource_type(dep_key[0], dep_key[1]), dep_key[2], dep_key[3], {"propagationPolicy": "Foreground"}
                )
        if not blocking:
            self._drop_finalizer(key, owner, "foregroundDeletion")

    def _drop_finalizer(self, key: Key, obj: dict, finalizer: str) -> None:
        updated = copy.deepcopy(obj)
        updated["metadata"]["finalizers"] = [f for f in obj["metadata"].get("finalizers") or [] if f != finalizer]
        self.update(resource_type(key[0], key[1]), updated)


class NamespaceController(Worker):
    """Deletes the content of a Terminating namespace, then the namespace itself."""

    name = "namespace-controller"

    def __init__(self, api: Api, interval_s: float = 0.5) -> None:
        super().__init__(api, NAMESPACE_CONTROLLER, interval_s)

    def sync(self) -> None:
        namespaces, _ = self.api.store.list("", "namespaces")
        for ns in namespaces:
            if not ns["metadata"].get("deletionTimestamp"):
                continue
            name = ns["metadata"]["name"]
            content = self.api.store.namespaced_keys(name)
            if not content:
                self.api.finalize_namespace(name)
            for key in content:
                obj = self.api.store.get(key)
                if obj is not None and not obj["metadata"].get("deletionTimestamp"):
                    self.delete(resource_type(key[0], key[1]), key[2], key[3])
