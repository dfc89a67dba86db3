"""The loop every simulated controller runs: wake on any change in the store (or every
``interval_s``), look at everything, act, repeat. Level-triggered like a real controller's resync,
without informers: the store is in the same process. A worker whose input is not in the store only
looks every ``interval_s``; one that scans every object may take a pause between passes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .api import Api, Call
from .auth import UserInfo
from .convert import from_hub, to_hub
from .errors import ApiError
from .resources import ResourceType
from .store import Key

log = logging.getLogger("devcluster.worker")


class Worker:
    name = "worker"
    # False: sync every ``interval_s`` only, for a worker whose input is not in the store (the driver
    # watches the GPUs), so that it does not redo its work on every write to the store.
    wakes_on_change = True
    # At least this long between passes: changes meanwhile are taken together (for a worker that looks at
    # every object, where a short delay is as faithful as an informer's and much cheaper under load).
    min_period_s = 0.0

    def __init__(self, api: Api, user: UserInfo, interval_s: float = 0.5) -> None:
        self.api = api
        self.user = user
        self.interval_s = interval_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"devcluster-{self.name}", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        seen = 0
        first = True
        while not self._stopping.is_set() and not self.api.store.closed:
            if self.wakes_on_change:
                current = self.api.store.wait_for_change(seen, self.interval_s)
            else:
                current = 0
                if not first and self._stopping.wait(self.interval_s):
                    return
            first = False
            if self._stopping.is_set():
                return
            try:
                self.sync()
            except Exception:  # a controller bug must not kill the loop; it is logged with its trace
                log.exception("devcluster %s: sync failed", self.name)
            seen = current
            if self.min_period_s and self._stopping.wait(self.min_period_s):
                return

    def sync(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ API access as this component

    def call(self, rt: ResourceType, namespace: str = "", name: str = "", subresource: str = "") -> Call | None:
        """A call in the newest served version of ``rt`` (None when it is not served at all)."""
        version = self.api.surface.preferred_version(rt)
        if version is None:
            return None
        return Call(self.user, rt, version, namespace, name, subresource)

    def create(self, rt: ResourceType, obj: dict) -> dict | None:
        """Create from a storage-form object; returns it in storage form, None when refused."""
        namespace = obj["metadata"].get("namespace", "")
        call = self.call(rt, namespace)
        if call is None:
            return None
        name = obj["metadata"].get("name") or obj["metadata"].get("generateName", "")
        return self._attempt(
            call,
            f"create {rt.plural} {namespace}/{name}",
            lambda: self.api.create(call, from_hub(rt, call.version, obj)),
        )

    def update(self, rt: ResourceType, obj: dict, subresource: str = "") -> dict | None:
        """Update (or ``/status``) from a storage-form object, conditional on its resourceVersion."""
        meta = obj["metadata"]
        call = self.call(rt, meta.get("namespace", ""), meta["name"], subresource)
        if call is None:
            return None
        what = (
            f"update {rt.plural}{'/' + subresource if subresource else ''} {meta.get('namespace', '')}/{meta['name']}"
        )
        return self._attempt(call, what, lambda: self.api.update(call, from_hub(rt, call.version, obj)))

    def delete(self, rt: ResourceType, namespace: str, name: str, options: dict | None = None) -> dict | None:
        call = self.call(rt, namespace, name)
        if call is None:
            return None
        return self._attempt(call, f"delete {rt.plural} {namespace}/{name}", lambda: self.api.delete(call, options))

    def _attempt(self, call: Call, what: str, fn: Callable[[], tuple[dict, list[str]]]) -> dict | None:
        # Conflicts and NotFound are ordinary races: the next pass sees the new state and retries.
        try:
            obj, _ = fn()
        except ApiError as e:
            if e.code not in (404, 409):
                log.warning("devcluster %s: %s failed: %s (HTTP %s)", self.name, what, e.message, e.code)
            return None
        return to_hub(call.rt, call.version, obj) if obj.get("kind") == call.rt.kind else obj


def key_of(rt: ResourceType, obj: dict) -> Key:
    meta = obj["metadata"]
    return (rt.group, rt.plural, meta.get("namespace", "") if rt.namespaced else "", meta["name"])
