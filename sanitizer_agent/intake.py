"""What the agent watches, and how an allocation of its node's devices becomes a teardown: its node's pods (their
claims read by name), its node's claims (by the `scrubgate.dev/node` label: those allocated here whose pods ended
while it was not looking, which the webhook keeps allocated until their scrub is attested), its node's
ResourceSlices (DRA devices to GPU UUIDs), and the claims NVIDIA's driver still has prepared. A new allocation
is taken up (and fenced where it must be) at once; whether a claim is released is release.py's to decide."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.attestation import claim_consumers

from . import nvidia
from .checkpoint import CheckpointStore, ClaimRef, State, Teardown
from .claims import (
    DeviceKey,
    SliceDevice,
    allocated_devices,
    created_at,
    pod_claim_names,
    pod_finished,
    recorded_devices,
    scrub_status,
    slice_devices,
    unheld_devices,
    unscrubbable,
)
from .kube import ClusterClient, ClusterError
from .node_view import NodeView
from .release import ReleaseChecks
from .teardown import TeardownEngine

log = logging.getLogger(__name__)

Claim = dict[str, Any]
SLICE_REFRESH_S = 5.0
# A teardown past its verified scrub: nothing left but API writes, done in one advance when the API answers.
VERIFIED_STATES = frozenset({State.VERIFIED, State.ATTESTED, State.DONE})


class Intake:
    def __init__(
        self,
        *,
        node: str,
        cluster: ClusterClient,
        store: CheckpointStore,
        view: NodeView,
        releases: ReleaseChecks,
        engine: Callable[[], TeardownEngine],
        clock: Callable[[], float],
        finish: Callable[[Teardown], None],
        backoff: Callable[[Teardown, ClusterError], None],
    ) -> None:
        self.node = node
        self.cluster = cluster
        self.store = store
        self.view = view
        self.releases = releases
        self._engine = engine
        self.clock = clock
        self._finish = finish  # advances a verified teardown now, or queues it where its lane is at work
        self._backoff = backoff  # an API error for a teardown: it waits before its next call
        self.slices: dict[DeviceKey, SliceDevice] = {}
        self._slices_read = float("-inf")
        self._slices_lock = threading.Lock()  # one refresh at a time (first sights run side by side)
        self._unscrubbable: set[DeviceKey] = set()  # devices already logged as not the agent's to scrub

    @property
    def engine(self) -> TeardownEngine:
        return self._engine()

    # ---------------------------------------------------------------- slices

    def refresh_slices(self) -> None:
        with self._slices_lock:
            self._slices_read = time.monotonic()
            try:
                self.slices = slice_devices(self.cluster.list_node_slices(self.node))
            except ClusterError as exc:
                log.warning(
                    "cannot list ResourceSlices of node %s (%s); keeping the last known devices", self.node, exc
                )
                return
            # A teardown that may be dirty fences what now shares memory with its devices (at start, this also
            # covers teardowns begun while the slices could not be read). It calls the API only for a new fence,
            # which is too urgent to wait out a teardown's backoff.
            for td in list(self.store.teardowns.values()):
                try:
                    self.engine.fences.cover_overlaps(td, self.slices)
                except ClusterError as exc:
                    self._backoff(td, exc)

    def _slice(self, key: DeviceKey) -> SliceDevice | None:
        """The device in this node's slices; an unknown one re-reads them (at most every few seconds, since
        claims on this node may also hold devices of other nodes or drivers)."""
        if key not in self.slices and time.monotonic() - self._slices_read > SLICE_REFRESH_S:
            self.refresh_slices()
        return self.slices.get(key)

    # ---------------------------------------------------------------- pods

    def observe_pod(self, kind: str, pod: dict[str, Any]) -> None:
        """A pod on this node was listed, added, modified or deleted."""
        meta = pod.get("metadata") or {}
        namespace, uid = meta.get("namespace") or "", meta.get("uid") or ""
        finished = kind == "DELETED" or pod_finished(pod)
        if finished and uid:
            self.view.end(uid, self.clock())
            self.view.live_pods.discard(uid)
        elif uid:
            self.view.live_pods.add(uid)
        for name in pod_claim_names(pod):
            known = self.find(namespace, name)
            allocated = known is not None and known.state == State.ALLOCATED
            if finished:
                # A pod's end comes as several events (Succeeded, deletionTimestamp, DELETED): each of its claims
                # is looked at once then, until what it shows settles the claim.
                if not self.view.first_look_at_end(uid, name):
                    continue
                if allocated:
                    self.releases.check_release_later(known)
                    continue
            elif allocated:
                continue
            # From the watch cache, as of this event or later: no read of etcd. The claim was allocated before the
            # pod was bound, and what a look decides from here on rests on a quorum read (release.py).
            try:
                claim = self.cluster.get_claim(namespace, name, not_older_than=meta.get("resourceVersion") or "")
            except ClusterError as exc:
                log.warning("cannot get claim %s/%s of pod %s: %s; the next resync retries", namespace, name, uid, exc)
                self.view.look_again_at_end(uid, name)
                continue
            if claim is None:
                if known is not None:
                    self.releases.check_release_later(known)
                continue
            if finished and not allocated_devices(claim) and not recorded_devices(claim):
                # kube-controller-manager (1.37) makes a new claim from the template for a pod that has ended
                # once it deleted the pod's claim, then deletes that one too. It never holds a device: scrubgate's
                # controller removes its finalizer once it is being deleted (its informer sees every claim).
                continue
            self.follow(claim)

    def observe_pod_list(self, pods: list[dict[str, Any]]) -> bool:
        """A full list of this node's pods. A running pod that is not in it may have gone though no watch said
        so, or the list may be older than the pod: it is no longer taken as running, and the next release
        check asks the API about it. Returns whether there was one."""
        vanished = self.view.live_pods - {(p.get("metadata") or {}).get("uid") for p in pods}
        self.view.live_pods = set()
        for pod in pods:
            self.observe_pod("SYNC", pod)
        return bool(vanished)

    def first_sight(self, namespace: str, name: str, pod_version: str) -> None:
        """What `observe_pod` does for a running pod's claim that the agent has not seen, given the resourceVersion
        of the pod as seen (`pod_version`)."""
        try:
            claim = self.cluster.get_claim(namespace, name, not_older_than=pod_version)
        except ClusterError:
            return  # the event's own handling asks again
        if claim is not None:
            self.follow(claim)

    # ---------------------------------------------------------------- claims

    def observe_claims(self, claims: list[Claim]) -> None:
        """A list of this node's claims (at start, at each resync, when the claim watch starts again): claims new to
        the agent are taken up, and every teardown is looked at against its claim as listed. A list from the watch
        cache may be a little behind: that is safe here, since it only prompts looks. A claim it misses was
        labelled since (its watch event follows) or is gone (read by name); what a look decides rests on a
        quorum read or a resourceVersion-tested write; and the webhook keeps a used claim allocated until its
        scrub is attested, so a late look loses nothing."""
        known = list(self.store.teardowns.values())
        self.view.listed(claims, self.node, {td.claim.uid for td in known})
        self._sync(claims)
        for td in known:
            self.releases.check(td)

    def observe_claim(self, kind: str, claim: Claim) -> None:
        """A watch event of one of this node's claims (DELETED: deleted, or its node label gone)."""
        uid = (claim.get("metadata") or {}).get("uid") or ""
        if kind == "DELETED":
            self.view.forget(uid)
        else:
            self.view.remember(claim)
        td = self.store.teardowns.get(uid)
        if td is not None:
            self.releases.check(td)
        elif kind != "DELETED":
            self._sync([claim])

    def _sync(self, claims: list[Claim]) -> None:
        """This node's claims as listed or watched, among them those no pod of it led the agent to: allocated
        and released while it was down (scrubgate's controller labelled them). The webhook keeps such a claim
        allocated until its scrub is attested, so it is here however late the agent looks."""
        for claim in claims:
            uid = (claim.get("metadata") or {}).get("uid")
            known = self.store.teardowns.get(uid or "")
            if known is not None and known.state in VERIFIED_STATES:
                # Finished first (a restart after the scrub, before the finalizer's removal), so that a later use
                # of the claim, which its attestation does not cover, is seen below and gets a teardown of its own.
                self._finish(known)
            if not uid or uid in self.store.teardowns:
                continue
            if not any(key in self.slices for key in allocated_devices(claim)):
                continue
            self.follow(claim)

    def follow(self, claim: Claim) -> None:
        """Tracks the claim (fenced on first sight of its allocation here) and checks in its lane whether it is
        released."""
        td = self._track(claim)
        if td is not None:
            self.view.remember(claim)
            self.releases.check_release_later(td)

    def find(self, namespace: str, name: str) -> Teardown | None:
        return next(
            (
                td
                for td in list(self.store.teardowns.values())
                if (td.claim.namespace, td.claim.name) == (namespace, name)
            ),
            None,
        )

    # ---------------------------------------------------------------- new allocations

    def _track(self, claim: Claim) -> Teardown | None:
        """The teardown for this claim, started (and fenced) on first sight of its allocation here."""
        meta = claim.get("metadata") or {}
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid:
            return None
        if uid in self.store.teardowns:
            return self.store.teardowns[uid]
        released = self.view.released_for(uid)
        if released is not None and {uid for _, _, uid in claim_consumers(claim)} <= released:
            return None  # torn down for these pods already; a new pod on the claim starts a new teardown
        recorded = dict(recorded_devices(claim))
        keys = allocated_devices(claim)
        if not keys:
            # Deallocated before the agent got to it: our own annotation says what it held, unless a
            # verified scrub already cleaned it.
            if scrub_status(claim) == names.SCRUB_VERIFIED:
                return None
            keys = list(recorded)
        devices = []
        for key in keys:
            known = self._slice(key)
            # Ours: a GPU or dynamic MIG placement of this node the agent can scrub, or one our own annotation
            # recorded.
            if (known is not None and self._scrubbable(key, known)) or key in recorded:
                devices.append((key, (known.uuid if known else None) or recorded.get(key)))
        if not devices:
            return None
        ref = ClaimRef(namespace=meta.get("namespace") or "", name=meta.get("name") or "", uid=uid)
        not_held = unheld_devices(claim, [key for key, _ in devices], self.slices)
        # Health counts XIDs from the claim's creation: the agent may see the allocation late.
        return self._begin(ref, devices, source="cluster", since=created_at(claim), not_held=not_held, seen=claim)

    def adopt_prepared(self, prepared: nvidia.PreparedClaim) -> None:
        """A claim NVIDIA's driver still has prepared: fence its devices, and tear down if it is gone."""
        if prepared.uid in self.store.teardowns:
            return
        devices: dict[DeviceKey, str | None] = {}
        for key, uuid in prepared.devices.items():
            known = self._slice(key)
            if known is None or self._scrubbable(key, known):
                devices[key] = uuid or (known.uuid if known else None)
        by_uuid = {d.uuid: k for k, d in self.slices.items() if d.uuid}
        for uuid in prepared.loose_uuids:
            if uuid in by_uuid:
                devices.setdefault(by_uuid[uuid], uuid)
            else:
                log.error(
                    "NVIDIA's checkpoint shows GPU %s prepared for claim %s, but no ResourceSlice of node %s names "
                    "it: cannot fence it with a device taint; check the GPU before reusing it",
                    uuid,
                    prepared.uid,
                    self.node,
                )
        if not devices:
            return
        ref = ClaimRef(namespace=prepared.namespace, name=prepared.name, uid=prepared.uid)
        log.warning("claim %s: prepared in NVIDIA's checkpoint but unknown to the agent; fencing it", ref)
        td = self._begin(ref, list(devices.items()), source="nvidia-checkpoint")
        if td is not None:
            self.releases.check_release_later(td)

    def _scrubbable(self, key: DeviceKey, device: SliceDevice) -> bool:
        """Whether the agent fences and scrubs this device of its node; one that it cannot scrub (a ComputeDomain
        channel, a GPU bound to vfio-pci, no uuid) is left alone, since its fence would never be lifted and its
        claim never attested. Said once per device."""
        reason = unscrubbable(key, device)
        if reason is not None and key not in self._unscrubbable:
            self._unscrubbable.add(key)
            log.warning(
                "device %s on node %s is not scrubbed or fenced by scrubgate: %s", "/".join(key), self.node, reason
            )
        return reason is None

    def _begin(
        self,
        ref: ClaimRef,
        devices: list[tuple[DeviceKey, str | None]],
        source: str,
        since: float | None = None,
        not_held: list[str] | None = None,
        seen: Claim | None = None,
    ) -> Teardown | None:
        now = self.clock()
        try:
            return self.engine.begin(
                ref,
                devices,
                source=source,
                allocated_at=min(since or now, now),
                slices=self.slices,
                not_held=not_held,
                seen=seen,
            )
        except ClusterError as exc:
            td = self.store.teardowns.get(ref.uid)
            if td is not None:
                self._backoff(td, exc)
            return td
