"""The cluster's DeviceClasses, as the webhook decides with them: a list, then a watch, from the API server.

A claim is guarded unless its class is proven unable to hand out a GPU (policies/scope.py), so the webhook must know
the classes: their selectors prove it, or do not. Until the first list has come in, every class is unknown, hence
guarded (fail closed: more is guarded, nothing is let through), and /readyz says so. Classes that exist before
scrubgate is installed get the same verdict as those created later: the list reads them all. An excluded class
(`excludeDeviceClasses`) whose selectors do not prove it hands out no GPU memory is named in the log and in the
metric `scrubgate_webhook_unproven_excluded_classes`: its claims skip the webhook by name, so the agent's hold
and the deallocation guard are what keep its GPUs (both decide from the allocated devices, not the class).

The watch keeps what the verdict reads (name, selectors, extendedResourceName) of a few dozen objects; a broken
watch lists again after a backoff, keeping the last verdicts meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.selectors import UNKNOWN, ClassVerdict, DeviceClasses, class_verdict

from scrubgate.kubeapi import Api, ApiError, dra_version, list_all

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
BACKOFF_S = (1.0, 30.0)


def _trimmed(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    kept = {k: spec[k] for k in ("selectors", "extendedResourceName") if k in spec}
    return {"metadata": {"name": meta.get("name")}, "spec": kept}


class DeviceClassWatch:
    """`connect` gives the API (it may fail: a kubeconfig or token not there yet; the watch retries it). Each class's
    verdict is computed when the class is listed or changes, not per request: a bulk of class writes costs one
    verdict each."""

    def __init__(self, connect: Callable[[], Api], on_unproven: Callable[[list[str]], None] | None = None) -> None:
        self.connect = connect
        self.api: Api | None = None
        self.on_unproven = on_unproven
        self._objects: dict[str, dict[str, Any]] = {}
        self._verdicts: dict[str, ClassVerdict] = {}
        self._drivers: tuple[str, ...] | None = None  # the GPU drivers the verdicts are under
        self._current: DeviceClasses = UNKNOWN
        self._lock = threading.Lock()
        self._last_unproven: list[str] = []
        self.synced = threading.Event()

    def classes(self, policy: PolicyConfig) -> DeviceClasses:
        """The verdicts under `policy`'s GPU drivers; unknown (everything guarded) before the first list."""
        if not self.synced.is_set():
            return UNKNOWN
        drivers = tuple(policy.gpu_drivers)
        with self._lock:
            if drivers != self._drivers:  # a policy reload changed them: every verdict again, once
                self._drivers = drivers
                self._verdicts = {name: class_verdict(obj, drivers) for name, obj in self._objects.items()}
                self._current = DeviceClasses(dict(self._verdicts))
            return self._current

    def unproven_excluded(self, policy: PolicyConfig) -> list[str]:
        """Excluded classes whose selectors do not prove they hand out no GPU memory."""
        verdicts = self.classes(policy).verdicts
        return sorted(n for n in policy.exclude_device_classes if n in verdicts and verdicts[n].gpu_memory)

    def _replace(self, items: list[dict[str, Any]]) -> None:
        with self._lock:
            self._objects = {o["metadata"]["name"]: o for o in map(_trimmed, items) if o["metadata"]["name"]}
            self._drivers = None  # recomputed at the next decision

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        trimmed = _trimmed(obj)
        name = trimmed["metadata"]["name"]
        if not name:
            return
        with self._lock:
            if kind == "DELETED":
                self._objects.pop(name, None)
                self._verdicts.pop(name, None)
            else:
                self._objects[name] = trimmed
                if self._drivers is not None:
                    self._verdicts[name] = class_verdict(trimmed, self._drivers)
            self._current = DeviceClasses(dict(self._verdicts))

    def run(self, stop: threading.Event, policy: Callable[[], PolicyConfig]) -> None:
        """List, then watch from the list's version; on any error, list again after a backoff."""
        delay = BACKOFF_S[0]
        while not stop.is_set():
            try:
                api = self.api = self.api or self.connect()
                version = dra_version(api)
                if version is None:
                    raise ApiError("the API server serves no resource.k8s.io version scrubgate reads", 404)
                path = f"/apis/resource.k8s.io/{version}/deviceclasses"
                items, resource_version = list_all(api, path)
                self._replace(items)
                first = not self.synced.is_set()
                self.synced.set()
                self._report(policy(), first)
                delay = BACKOFF_S[0]
                while not stop.is_set():
                    query = {
                        "watch": "true",
                        "allowWatchBookmarks": "true",
                        "resourceVersion": resource_version,
                        "timeoutSeconds": str(WATCH_TIMEOUT_S),
                    }
                    for event in api.stream(path, query):
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":
                            raise ApiError(f"watch of DeviceClasses: {obj.get('message')}", int(obj.get("code") or 0))
                        resource_version = (obj.get("metadata") or {}).get("resourceVersion") or resource_version
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            self._apply(kind, obj)
                            self._report(policy(), False)
                        if stop.is_set():
                            return
            except ApiError as exc:
                if exc.status != 410:  # expired: list again at once
                    log.warning(
                        "cannot list or watch DeviceClasses (%s); %s, retrying in %.0fs",
                        exc,
                        "keeping the last verdicts" if self.synced.is_set() else "every claim is guarded meanwhile",
                        delay,
                    )
                    stop.wait(delay)
                    delay = min(delay * 2, BACKOFF_S[1])
            except Exception:
                log.exception("the DeviceClass watch crashed; listing again in %.0fs", delay)
                stop.wait(delay)
                delay = min(delay * 2, BACKOFF_S[1])

    def _report(self, policy: PolicyConfig, first: bool) -> None:
        unproven = self.unproven_excluded(policy)
        if unproven and (first or unproven != self._last_unproven):
            log.error(
                "DeviceClass(es) %s are in the policy's excludeDeviceClasses, but their selectors do not prove they "
                "hand out no gpu or mig device of a GPU driver: their claims skip the webhook by name, so they get "
                "no finalizer and no SG001/SG005/SG006 check (the agent's hold and SG007 still keep their GPUs). "
                'Make each selector name its driver (`device.driver == "..."`), or take the class out of '
                "excludeDeviceClasses",
                ", ".join(unproven),
            )
        self._last_unproven = unproven
        if self.on_unproven is not None:
            self.on_unproven(unproven)
