"""Watching what happens to ResourceClaims and DeviceTaintRules, and checking scrubgate's invariant over
it afterwards. Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from scrubgate.policies import names
from scrubgate.policies.attestation import (
    AttestationError,
    check_claim_attestation,
    claimed_devices,
    is_ended_pod_record,
)

from .processes import wait_for

log = logging.getLogger("devcluster.observer")


@dataclass(frozen=True)
class Observed:
    """One change the observer saw: ``rv`` orders all of them (etcd's revision, one counter for all objects); ``at`` is when
    it arrived (``time.monotonic()``), for latencies between changes (the watch delay cancels out)."""

    rv: int
    resource: str  # resourceclaims, devicetaintrules
    type: str  # ADDED, MODIFIED, DELETED, SYNC (from a list after a gap)
    obj: dict[str, Any]
    at: float = 0.0


def first_rv(events: Iterable[Observed], predicate: Callable[[Observed], bool]) -> int | None:
    """The resourceVersion of the first event that matches; None when none does."""
    return min((e.rv for e in events if predicate(e)), default=None)


def is_allocated(event: Observed) -> bool:
    return bool(_allocated(event.obj))


def is_attested(event: Observed) -> bool:
    return names.ANNOTATION_ATTESTATION in ((event.obj.get("metadata") or {}).get("annotations") or {})


def _allocated(claim: dict[str, Any]) -> set[tuple[str, str, str]]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return {(r.get("driver", ""), r.get("pool", ""), r.get("device", "")) for r in results}


def _claim_name(claim: dict[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')} (uid {meta.get('uid')})"


def invariant_violations(events: Iterable[Observed], public_keys: dict[str, Ed25519PublicKey]) -> list[str]:
    """What breaks scrubgate's invariant in a stream of claim (and pod) changes, in resourceVersion order:

    - a device allocated to a claim while an earlier claim that held it, and was used, has shown no
      attestation that verifies (signature, claim UID, that device verified clean);
    - the ``scrubgate.dev/sanitize`` finalizer gone from a used claim whose attestation does not verify,
      and no break-glass annotation on it (break-glass is allowed by design; it releases the object only);
    - the allocation of a used claim that carried that finalizer cleared while no verified attestation
      covers its devices, and no break-glass annotation on it.

    Used: reserved for a pod that was bound to a node. A claim no pod ever ran with holds no tenant's data
    (kube-scheduler clears such an allocation of its own in PostFilter, and deletes its extended-resource claim,
    finalizer and all, after a failed binding). A claim deleted before it was ever allocated may lose the
    finalizer without an attestation.
    """
    violations: list[str] = []
    guarded: set[str] = set()  # claims that carried the finalizer
    held: set[str] = set()  # claims that were allocated a device
    bound: set[str] = set()  # pods seen bound to a node
    reserving: dict[str, set[str]] = {}  # pod UID -> the claims whose latest state is reserved for it
    reserved_pods: dict[str, set[str]] = {}  # claim UID -> those pods (the same, the other way round)
    used_claims: set[str] = set()  # claims reserved for a pod while it was bound
    last: dict[str, dict[str, Any]] = {}
    clean: dict[str, set[tuple[str, str, str]]] = {}
    holders: dict[tuple[str, str, str], set[str]] = {}

    def used(uid: str) -> bool:
        return uid in used_claims

    for event in sorted(events, key=lambda e: e.rv):
        if event.resource == "pods":
            if (event.obj.get("spec") or {}).get("nodeName"):
                pod = (event.obj.get("metadata") or {}).get("uid", "")
                bound.add(pod)
                used_claims.update(reserving.get(pod, set()))
            continue
        if event.resource != "resourceclaims":
            continue
        claim = event.obj
        meta = claim.get("metadata") or {}
        uid = meta.get("uid", "")
        prev = last.get(uid)
        reserved = (claim.get("status") or {}).get("reservedFor") or []
        # A pod that a claim was reserved for while it was bound used it; one bound only later, with another
        # claim (kube-scheduler's new one after a failed binding), did not use this one.
        # scrubgate's record of an ended pod carries the pod's UID: still reserved for it.
        pods = (
            set()
            if event.type == "DELETED"
            else {r.get("uid", "") for r in reserved if r.get("resource") == "pods" or is_ended_pod_record(r)}
        )
        for pod in reserved_pods.pop(uid, set()) - pods:
            reserving[pod].discard(uid)
        for pod in pods:
            reserving.setdefault(pod, set()).add(uid)
        reserved_pods[uid] = pods
        if pods & bound:
            used_claims.add(uid)
        token = (meta.get("annotations") or {}).get(names.ANNOTATION_ATTESTATION)
        verified: set[tuple[str, str, str]] = set()
        if token:
            with contextlib.suppress(AttestationError):
                payload = check_claim_attestation(token, claim, public_keys)
                verified = {(d["driver"], d["pool"], d["device"]) for d in payload["devices"]}
        clean.setdefault(uid, set()).update(verified)
        before = _allocated(prev) if prev else set()
        for device in sorted(_allocated(claim) - before):
            dirty = [
                other
                for other in holders.get(device, set()) - {uid}
                if device not in clean.get(other, set()) and used(other)
            ]
            for other in dirty:
                violations.append(
                    f"rv {event.rv}: {'/'.join(device)} allocated to claim {_claim_name(claim)} while claim "
                    f"{_claim_name(last[other])} that held it has no verified attestation"
                )
            holders.setdefault(device, set()).add(uid)
        # A DELETED event carries the object as it was stored before the last finalizer went, so the
        # removal that deleted it shows as the object disappearing with the finalizer still listed.
        gone = event.type == "DELETED"
        listed = names.FINALIZER in (meta.get("finalizers") or [])
        had = names.FINALIZER in ((prev or {}).get("metadata") or {}).get("finalizers", []) or (gone and listed)
        has = listed and not gone
        break_glass = bool((meta.get("annotations") or {}).get(names.ANNOTATION_BREAK_GLASS))
        if listed:
            guarded.add(uid)
        unattested = before - clean[uid]
        if uid in guarded and before and not _allocated(claim) and unattested and not break_glass and used(uid):
            devices = ", ".join("/".join(d) for d in sorted(unattested))
            violations.append(
                f"rv {event.rv}: claim {_claim_name(claim)} deallocated while {devices} has no verified attestation"
            )
        if _allocated(claim):
            held.add(uid)
        # A claim deleted before it ever held a device owes no scrub: its finalizer may go unattested.
        if had and not has and not break_glass and (uid in held or claimed_devices(claim)) and used(uid):
            required = claimed_devices(prev or {}) | claimed_devices(claim)
            try:
                if not token:
                    raise AttestationError("no attestation annotation")
                check_claim_attestation(token, claim, public_keys, required)
            except AttestationError as exc:
                violations.append(f"rv {event.rv}: {names.FINALIZER} removed from claim {_claim_name(claim)}: {exc}")
        last[uid] = claim  # kept after DELETED too: it may have held a device
    return violations


class Observer:
    """Watches ResourceClaims, DeviceTaintRules and pods (all namespaces) through the API server's watch and
    keeps every change, so tests can check orderings after the fact. Survives a restarted or killed
    API server: it resumes from the last resourceVersion, or lists again (noted in ``gaps``) when the
    server no longer has it."""

    RESOURCES = ("resourceclaims", "devicetaintrules", "pods")

    def __init__(self, port: Callable[[], int], token: str, ca_file: Path) -> None:
        self._port = port
        self._token = token
        self._ca_file = ca_file
        self._lock = threading.Lock()
        self._events: list[Observed] = []
        self.gaps: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._synced: set[str] = set()
        # How far each watch has read (events and bookmarks); absent for a resource the server does not serve.
        self._positions: dict[str, int] = {}
        self._paths: dict[str, str] = {}

    def start(self) -> Observer:
        for resource in self.RESOURCES:
            thread = threading.Thread(target=self._run, args=(resource,), name=f"observer-{resource}", daemon=True)
            thread.start()
            self._threads.append(thread)
        wait_for(lambda: self._synced >= set(self.RESOURCES), 30, "the observer's first list")
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        for thread in self._threads:
            thread.join(timeout=10)

    def sync(self, timeout: float = 30) -> int:
        """Waits until every watch has read up to the API server's current resourceVersion, and returns it:
        whatever changed before this call is then in ``events()``, so a check that something never happened
        tests something. The watches advance on events, or on the bookmarks the server sends shortly before
        each watch call times out; the consistent lists that read the target bring the server's watch cache
        up to it first."""
        target = 0
        for path in list(self._paths.values()):
            status, body = self._get(path)
            if status != 200:
                raise OSError(f"list {path} to sync the observer: HTTP {status}")
            target = max(target, int(body["metadata"]["resourceVersion"]))
        wait_for(
            lambda: all(self._positions.get(r, 0) >= target for r in self._paths),
            timeout,
            f"the observer's watches reaching rv {target} (they are at {self._positions})",
        )
        return target

    def events(self, resource: str | None = None) -> list[Observed]:
        with self._lock:
            found = [e for e in self._events if resource is None or e.resource == resource]
        return sorted(found, key=lambda e: e.rv)

    def claims(self) -> list[Observed]:
        return self.events("resourceclaims")

    def taint_rules(self) -> list[Observed]:
        return self.events("devicetaintrules")

    def pods(self) -> list[Observed]:
        return self.events("pods")

    def dump(self, path: Path) -> None:
        """Every change seen, one JSON line each in resourceVersion order (``obj`` null for a deletion): the
        API server's history of these objects, for checking a run after the fact."""
        with path.open("w") as out:
            for event in self.events():
                meta = event.obj.get("metadata") or {}
                key = [names.RESOURCE_GROUP if event.resource != "pods" else "", event.resource,
                       meta.get("namespace", ""), meta.get("name", "")]  # fmt: skip
                obj = None if event.type == "DELETED" else event.obj
                out.write(json.dumps({"rv": event.rv, "type": event.type, "key": key, "obj": obj}) + "\n")

    def violations(self, public_keys: dict[str, Ed25519PublicKey]) -> list[str]:
        return invariant_violations(self.events(), public_keys)

    # ------------------------------------------------------------------ watching

    def _path(self, resource: str) -> str | None:
        """The collection to list and watch; None when the API server does not serve it."""
        if resource == "pods":
            return "/api/v1/pods"
        for version in names.RESOURCE_VERSIONS:
            status, body = self._get(f"/apis/{names.RESOURCE_GROUP}/{version}")
            if status == 200 and any(r.get("name") == resource for r in body.get("resources") or []):
                return f"/apis/{names.RESOURCE_GROUP}/{version}/{resource}"
        return None

    def _connect(self, timeout: float) -> http.client.HTTPSConnection:
        context = ssl.create_default_context(cafile=str(self._ca_file))
        return http.client.HTTPSConnection("127.0.0.1", self._port(), timeout=timeout, context=context)

    def _get(self, path: str) -> tuple[int, dict[str, Any]]:
        conn = self._connect(timeout=10)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {self._token}"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def _record(self, resource: str, kind: str, obj: dict[str, Any], rv: int) -> None:
        with self._lock:
            self._events.append(Observed(rv, resource, kind, obj, time.monotonic()))

    def _advance(self, resource: str, rv: str) -> None:
        with self._lock:
            self._positions[resource] = max(self._positions.get(resource, 0), int(rv))

    def _run(self, resource: str) -> None:
        path: str | None = None
        rv = ""
        while not self._stop.is_set():
            try:
                if path is None:
                    path = self._path(resource)
                    if path is None:  # not served (e.g. no DeviceTaintRule API): nothing to watch
                        self._synced.add(resource)
                        return
                    self._paths[resource] = path
                if not rv:
                    status, body = self._get(path)
                    if status != 200:
                        raise OSError(f"list {path}: HTTP {status}")
                    rv = body["metadata"]["resourceVersion"]
                    for obj in body.get("items") or []:
                        self._record(resource, "SYNC", obj, int(obj["metadata"]["resourceVersion"]))
                    self._advance(resource, rv)
                    self._synced.add(resource)
                rv = self._watch(resource, path, rv)
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                if self._stop.is_set():
                    return
                log.debug("observer: watch of %s interrupted (%s); resuming", resource, exc)
                time.sleep(0.2)

    def _watch(self, resource: str, path: str, rv: str) -> str:
        """One watch call from ``rv``; returns the resourceVersion to resume from ("" to list again)."""
        conn = self._connect(timeout=30)
        with self._lock:
            self._conns[resource] = conn
        try:
            conn.request(
                "GET",
                f"{path}?watch=1&allowWatchBookmarks=true&timeoutSeconds=3&resourceVersion={rv}",
                headers={"Authorization": f"Bearer {self._token}"},
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise OSError(f"watch {path}: HTTP {resp.status}")
            for line in resp:
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == 410:
                        self.gaps.append(f"{resource}: history from rv {rv} expired; listed again")
                        return ""
                    raise OSError(f"watch {path}: {obj.get('message')}")
                rv = obj["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK":
                    self._record(resource, event["type"], obj, int(rv))
                self._advance(resource, rv)
            return rv
        finally:
            with self._lock:
                self._conns.pop(resource, None)
            conn.close()
