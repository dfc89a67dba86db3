"""The node agent: sees allocations on its node, fences them, and tears them down when they are released.

Inputs: this node's pods (list + watch, field selector `spec.nodeName`), their claims (by name), this node's
claims (list + watch, label selector `scrubgate.dev/node=<node>`: the agent labels a claim at first sight, and
scrubgate's controller labels those allocated here while no agent looked, whose pods may be long gone: the
webhook keeps a GPU claim allocated until its scrub is attested), this node's ResourceSlices (to map DRA
devices to GPU UUIDs), NVIDIA's driver checkpoint (claims prepared while the agent was away), the
agent's own checkpoint, and operator rescrub requests. Everything that
changes state goes through the TeardownEngine; this module decides *when*.

What it reads grows with its node, not with the cluster: no list of every claim, no list of a namespace, and
no periodic read of each claim it tracks. The lists and the watch of its claims come from the API server's
watch cache and only prompt a look; a decision that needs the claim as it is now reads it by name (a quorum
read): before a release starts a scrub (`_check_release`), before an allocation is taken for lost
(`_check_held`), before break-glass releases a hold (`_release_if_glass_broken`); the TeardownEngine attests
and releases its hold with resourceVersion-tested patches of a claim it read itself.

A device that may hold a tenant's data is kept from other claims by its claim's allocation, which the webhook
keeps until the attestation lands; the agent fences it (DeviceTaintRules) only where that allocation cannot
hold (see teardown.py). Start-up order matters: the fences the checkpoint owes go up, and every other
owed teardown's allocation is checked (and fenced when gone) before anything else happens, so a restarted
agent never lifts a fence while another device it owes a scrub stands in reach. On the way out (SIGTERM:
an uninstall, an upgrade, the node shutting down) it fences what it still owes, since the webhook that keeps
those allocations may be removed next.

Concurrency (`max_concurrent_teardowns` > 0): the loop's thread reads events and takes up new allocations
(fencing those that need it) itself, at once; everything else a claim's teardown does (release checks, drain, scrub, attestation, API
writes) runs in the claim's lane (`lanes.py`): in order for one claim, side by side for different claims, at
most that many at once. Each step is still checkpointed before its side effect, so a crash anywhere restarts
into "fenced" or "verified clean".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.attestation import claim_consumers, deleted_before_allocation

from . import nvidia, rescrub
from .checkpoint import DIRTY_STATES, OWED_STATES, CheckpointStore, ClaimRef, FenceReason, State, Teardown
from .claims import (
    DeviceKey,
    SliceDevice,
    allocated_devices,
    created_at,
    finalizer_removal_ops,
    holds_devices,
    pod_claim_names,
    pod_finished,
    recorded_devices,
    release_reason,
    scrub_status,
    slice_devices,
    unheld_devices,
    unscrubbable,
)
from .device_access import require_device_access
from .fences import Fencer
from .gpu import GpuBackend
from .informer import Backoff, follow
from .kube import ClusterClient, ClusterError, Conflict, NotFound, with_retries
from .lanes import Lanes
from .metrics import AgentMetrics
from .teardown import Signer, TeardownEngine, TeardownSettings, TransitionHook
from .unguarded import mark_claim

log = logging.getLogger(__name__)

FINISHED_POD_MEMORY_S = 3600.0
# A teardown past its verified scrub: nothing left but API writes, done in one advance when the API answers.
VERIFIED_STATES = frozenset({State.VERIFIED, State.ATTESTED, State.DONE})
# Released, not yet verified clean: the allocation of the claim is asked about at each resync.
TEARING_DOWN = frozenset({State.RELEASED, State.DRAINING, State.SCRUBBING})
SLICE_REFRESH_S = 5.0
RESCRUB_POLL_S = 1.0  # how often a failed device waiting for an operator looks for a rescrub request


def _glass_broken(claim: dict[str, Any] | None) -> bool:
    return bool((((claim or {}).get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_BREAK_GLASS))


def api_connections(max_concurrent_teardowns: int) -> int:
    """API calls the agent may make at once: a call from each lane, each fence worker (a lane waits on them)
    and each first-sight worker, the loop's, the pod watch's and the claim watch's. The client keeps that many
    connections open: one it cannot keep is closed, and a later call pays for a new TLS handshake with
    kube-apiserver."""
    return 3 * max(max_concurrent_teardowns, 1) + 3


@dataclass(frozen=True)
class AgentSettings:
    node: str
    teardown: TeardownSettings = field(default_factory=TeardownSettings)
    nvidia_checkpoint: Path | None = nvidia.DEFAULT_PATH
    rescrub_dir: Path | None = None
    drain_poll_s: float = 0.05
    resync_s: float = 30.0
    watch_timeout_s: int = 300
    api_backoff_s: float = 1.0
    api_backoff_max_s: float = 60.0
    # /healthz fails when the loop has not come round for this long (a scrub of a big GPU takes a while).
    liveness_s: float = 600.0
    # Teardowns worked on at once, each in a thread of its own; 0: every step in the calling thread.
    max_concurrent_teardowns: int = 0


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        *,
        cluster: ClusterClient,
        backend: GpuBackend,
        store: CheckpointStore,
        signer: Signer,
        metrics: AgentMetrics | None = None,
        clock: Callable[[], float] = time.time,
        on_transition: TransitionHook | None = None,
    ) -> None:
        self.settings = settings
        self.node = settings.node
        self.cluster = cluster
        self.backend = backend
        self.store = store
        self.signer = signer
        self.metrics = metrics or AgentMetrics()
        self.clock = clock
        self.on_transition = on_transition
        self._engine: TeardownEngine | None = None
        self._slices: dict[DeviceKey, SliceDevice] = {}
        self._slices_read = float("-inf")
        # consumer UID -> when seen ended (a pod terminal or deleted, another consumer such as a PodGroup deleted)
        self._ended: dict[str, float] = {}
        self._live_pods: set[str] = set()  # UIDs of this node's running pods, as of the last list and watch
        # Claim UID -> (pod UIDs it was released by, when): a released claim stays allocated until the
        # controller deallocates it after the attestation; a pod event meanwhile must not start it again.
        self._released: dict[str, tuple[frozenset[str], float]] = {}
        self._ends_looked_at: dict[str, set[str]] = {}  # ended pod uid -> its claims looked at since
        # Claim UID -> this node's claim as its last list, watch event or read by name showed it (from the watch
        # cache: what prompts a look, never what a decision rests on)
        self._seen: dict[str, dict[str, Any]] = {}
        self._api_retry: dict[str, tuple[float, float]] = {}  # claim UID -> (retry at, last delay)
        self._last_tick: float | None = None
        self._unscrubbable: set[DeviceKey] = set()  # devices already logged as not the agent's to scrub
        # Guards the maps above that the lanes change too (finished pods, releases, API backoffs).
        self._lock = threading.Lock()
        workers = settings.max_concurrent_teardowns
        self._lanes = Lanes(workers, f"teardown-{self.node}") if workers > 0 else None
        self._sight_pool = ThreadPoolExecutor(workers, f"first-sight-{self.node}") if workers > 0 else None
        # The fences of one claim's devices (a whole GPU and its MIG slices: eight) go up and down at once.
        self._fence_pool = ThreadPoolExecutor(workers, f"fence-{self.node}") if workers > 0 else None
        self._slices_lock = threading.Lock()  # one refresh at a time (first sights run side by side)

    @property
    def engine(self) -> TeardownEngine:
        if self._engine is None:
            raise RuntimeError("Agent.start() has not run")
        return self._engine

    # ---------------------------------------------------------------- start-up

    def start(self) -> None:
        """Loads the checkpoint, picks the fence, and makes sure everything that may be dirty is out of reach."""
        self.store.load()
        # Released before the restart: once finished, not to be started again for the same pods.
        self._released = {
            uid: (frozenset(pod for _, pod in td.consumers), self.clock())
            for uid, td in self.store.teardowns.items()
            if td.released_at is not None
        }
        version = with_retries("DeviceTaintRule discovery", self.cluster.device_taint_rule_version)
        pool = self._fence_pool
        fencer = Fencer(
            self.cluster,
            self.node,
            version,
            self.metrics,
            (lambda call, items: list(pool.map(call, items))) if pool else None,
        )
        self._engine = TeardownEngine(
            node=self.node,
            store=self.store,
            backend=self.backend,
            cluster=self.cluster,
            fencer=fencer,
            signer=self.signer,
            metrics=self.metrics,
            settings=self.settings.teardown,
            clock=self.clock,
            on_transition=self.on_transition,
            schedule=(lambda td: self._submit(td, lambda: self.engine.advance(td), "advance")) if self._lanes else None,
        )
        self.metrics.oldest_release.set_function(self._engine.oldest_release_s)  # at each scrape
        if version:
            log.info("node %s: fencing with DeviceTaintRule %s/%s", self.node, "resource.k8s.io", version)
        self._refresh_slices()
        require_device_access(self.node, self._slices, self.backend)
        owed = [td for td in self.store.teardowns.values() if td.state in OWED_STATES]
        if owed:
            log.info("node %s: checkpoint owes %d teardown(s); making sure they are out of reach", self.node, len(owed))
        for td in owed:
            self._guarded(td, lambda td=td: self.engine.ensure_fenced(td))
        self._check_holds(DIRTY_STATES)
        if self.settings.nvidia_checkpoint is not None:
            for prepared in nvidia.read_prepared_claims(self.settings.nvidia_checkpoint):
                self._adopt_prepared(prepared)
        pods, _ = with_retries(f"list pods on {self.node}", lambda: self.cluster.list_node_pods(self.node))
        self._observe_list(pods)
        claims, _ = with_retries(f"list the claims of {self.node}", lambda: self.cluster.list_node_claims(self.node))
        self._observe_claims(claims)

    def _refresh_slices(self) -> None:
        with self._slices_lock:
            self._slices_read = time.monotonic()
            try:
                self._slices = slice_devices(self.cluster.list_node_slices(self.node))
            except ClusterError as exc:
                log.warning(
                    "cannot list ResourceSlices of node %s (%s); keeping the last known devices", self.node, exc
                )
                return
            # A teardown that may be dirty fences what now shares memory with its devices (at start, this also
            # covers teardowns begun while the slices could not be read). It calls the API only for a new fence,
            # which is too urgent to wait out a teardown's backoff.
            for td in self._teardowns():
                try:
                    self.engine.cover_overlaps(td, self._slices)
                except ClusterError as exc:
                    self._backoff(td, exc)

    def _slice(self, key: DeviceKey) -> SliceDevice | None:
        """The device in this node's slices; an unknown one re-reads them (at most every few seconds, since
        claims on this node may also hold devices of other nodes or drivers)."""
        if key not in self._slices and time.monotonic() - self._slices_read > SLICE_REFRESH_S:
            self._refresh_slices()
        return self._slices.get(key)

    def _adopt_prepared(self, prepared: nvidia.PreparedClaim) -> None:
        """A claim NVIDIA's driver still has prepared: fence its devices, and tear down if it is gone."""
        if prepared.uid in self.store.teardowns:
            return
        devices: dict[DeviceKey, str | None] = {}
        for key, uuid in prepared.devices.items():
            known = self._slice(key)
            if known is None or self._scrubbable(key, known):
                devices[key] = uuid or (known.uuid if known else None)
        by_uuid = {d.uuid: k for k, d in self._slices.items() if d.uuid}
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
            self._submit(td, lambda: self._check_release(td))

    # ---------------------------------------------------------------- events

    def observe_pod(self, kind: str, pod: dict[str, Any]) -> None:
        """A pod on this node was listed, added, modified or deleted."""
        meta = pod.get("metadata") or {}
        namespace, uid = meta.get("namespace") or "", meta.get("uid") or ""
        finished = kind == "DELETED" or pod_finished(pod)
        if finished and uid:
            with self._lock:
                self._ended[uid] = self.clock()
            self._live_pods.discard(uid)
        elif uid:
            self._live_pods.add(uid)
        for name in pod_claim_names(pod):
            known = self._find(namespace, name)
            allocated = known is not None and known.state == State.ALLOCATED
            if finished:
                # A pod's end comes as several events (Succeeded, deletionTimestamp, DELETED): each of its claims
                # is looked at once then, until what it shows settles the claim.
                if not self._first_look_at_end(uid, name):
                    continue
                if allocated:
                    self._submit(known, lambda td=known: self._check_release(td), "check-release")  # its lane reads
                    continue
            elif allocated:
                continue
            try:
                claim = self.cluster.get_claim(namespace, name)
            except ClusterError as exc:
                log.warning("cannot get claim %s/%s of pod %s: %s; the next resync retries", namespace, name, uid, exc)
                self._look_again_at_end(uid, name)
                continue
            if claim is None:
                if known is not None:
                    self._submit(known, lambda td=known: self._check_release(td), "check-release")
                continue
            if finished and not allocated_devices(claim) and not recorded_devices(claim):
                # kube-controller-manager (1.37) makes a new claim from the template for a pod that has ended
                # once it deleted the pod's claim, then deletes that one too. It never holds a device: its
                # finalizer goes once it is being deleted. Where that comes after the pod's last event,
                # scrubgate's controller removes it (its informer sees every claim).
                if deleted_before_allocation(claim):
                    self._drop_finalizer(claim)
                else:
                    self._look_again_at_end(uid, name)
                continue
            self._follow(claim)

    def _follow(self, claim: dict[str, Any]) -> None:
        """Tracks the claim (fenced on first sight of its allocation here) and checks in its lane whether it is
        released."""
        td = self._track(claim)
        if td is not None:
            self._remember(claim)
            self._submit(td, lambda: self._check_release(td), "check-release")

    def _first_look_at_end(self, pod_uid: str, claim_name: str) -> bool:
        with self._lock:
            looked = self._ends_looked_at.setdefault(pod_uid, set())
            first = claim_name not in looked
            looked.add(claim_name)
        return first

    def _look_again_at_end(self, pod_uid: str, claim_name: str) -> None:
        """At the pod's next event."""
        with self._lock:
            self._ends_looked_at.get(pod_uid, set()).discard(claim_name)

    def _observe_list(self, pods: list[dict[str, Any]]) -> bool:
        """A full list of this node's pods. A running pod that is not in it may have gone though no watch said
        so, or the list may be older than the pod: it is no longer taken as running, and the next release
        check asks the API about it. Returns whether there was one."""
        vanished = self._live_pods - {(p.get("metadata") or {}).get("uid") for p in pods}
        self._live_pods = set()
        for pod in pods:
            self.observe_pod("SYNC", pod)
        return bool(vanished)

    def _sync_claims(self, claims: list[dict[str, Any]]) -> None:
        """This node's claims as listed or watched, among them those no pod of it led the agent to: allocated
        and released while it was down (scrubgate's controller labelled them). The webhook keeps such a claim
        allocated until its scrub is attested, so it is here however late the agent looks."""
        for claim in claims:
            uid = (claim.get("metadata") or {}).get("uid")
            known = self.store.teardowns.get(uid or "")
            if known is not None and known.state in VERIFIED_STATES:
                # Finished first, here and now (a restart after the scrub, before the finalizer's removal), so
                # that a later use of the claim, which its attestation does not cover, is seen below and gets a
                # teardown of its own. Queued instead when its lane is already at work on it.
                if self._lanes is not None and self._lanes.busy(known.claim.uid):
                    self._submit(known, lambda td=known: self.engine.advance(td), "advance")
                else:
                    self._guarded(known, lambda td=known: self.engine.advance(td))
            if not uid or uid in self.store.teardowns:
                continue
            if not any(key in self._slices for key in allocated_devices(claim)):
                continue
            self._follow(claim)

    def _drop_finalizer(self, claim: dict[str, Any]) -> None:
        """A claim deleted before it ever held a device: nothing to scrub, and no agent will attest it, so its
        finalizer goes (the webhook allows it). scrubgate's controller may try too; the patch's tests let one
        win."""
        meta = claim.get("metadata") or {}
        ops = finalizer_removal_ops(claim, None)
        if ops is None:
            return
        try:
            self.cluster.patch_claim(meta.get("namespace") or "", meta.get("name") or "", ops)
            log.info(
                "claim %s/%s: deleted before it held a device; removed %s",
                meta.get("namespace"),
                meta.get("name"),
                names.FINALIZER,
            )
        except (Conflict, NotFound):
            pass  # the controller was first, or it changed: the controller's informer sees it again
        except ClusterError as exc:
            log.warning(
                "claim %s/%s: cannot remove %s: %s", meta.get("namespace"), meta.get("name"), names.FINALIZER, exc
            )

    def _note_ended_consumers(self, claim: dict[str, Any]) -> None:
        """Consumers the claim is reserved for that the agent has not seen end: pods it has neither seen running
        nor ending (they ended while it was down, or were bound since its last list), and consumers that are not
        pods (a PodGroup, whose pods may all be gone while the claim stays reserved for it): asks the API which
        have ended (a pod terminal or deleted, another consumer deleted)."""
        namespace = (claim.get("metadata") or {}).get("namespace") or ""
        for resource, name, uid in claim_consumers(claim):
            if not uid or uid in self._ended or uid in self._live_pods:
                continue
            if resource == "pods":
                found = self.cluster.get_pod(namespace, name)
                ended = found is None or pod_finished(found)
            else:
                plural, _, group = resource.partition(".")
                found = self.cluster.get_consumer(namespace, group, plural, name)
                ended = found is None
            if ended or (found or {}).get("metadata", {}).get("uid") != uid:
                with self._lock:
                    self._ended[uid] = self.clock()

    def _find(self, namespace: str, name: str) -> Teardown | None:
        return next(
            (td for td in self._teardowns() if (td.claim.namespace, td.claim.name) == (namespace, name)),
            None,
        )

    def _teardowns(self) -> list[Teardown]:
        """The teardowns now (a copy: lanes add and drop teardowns while the loop looks)."""
        return list(self.store.teardowns.values())

    def _track(self, claim: dict[str, Any]) -> Teardown | None:
        """The teardown for this claim, started (and fenced) on first sight of its allocation here."""
        meta = claim.get("metadata") or {}
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid:
            return None
        if uid in self.store.teardowns:
            return self.store.teardowns[uid]
        with self._lock:
            released = self._released.get(uid)
        if released is not None and {uid for _, _, uid in claim_consumers(claim)} <= released[0]:
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
        not_held = unheld_devices(claim, [key for key, _ in devices], self._slices)
        # Health counts XIDs from the claim's creation: the agent may see the allocation late.
        return self._begin(ref, devices, source="cluster", since=created_at(claim), not_held=not_held, seen=claim)

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
        seen: dict[str, Any] | None = None,
    ) -> Teardown | None:
        now = self.clock()
        try:
            return self.engine.begin(
                ref,
                devices,
                source=source,
                allocated_at=min(since or now, now),
                slices=self._slices,
                not_held=not_held,
                seen=seen,
            )
        except ClusterError as exc:
            td = self.store.teardowns.get(ref.uid)
            if td is not None:
                self._backoff(td, exc)
            return td

    def _check_release(self, td: Teardown) -> None:
        if td.state != State.ALLOCATED:
            return
        claim, cached = self._claim_of(td)
        if claim is not None and (claim.get("metadata") or {}).get("uid") == td.claim.uid:
            mark_claim(self.cluster, self.node, claim, [d.key for d in td.devices], self.clock())
        reason = self._release_reason(td, claim)
        if reason and cached:
            # A release starts the drain and the scrub: decided on the claim as it is now (a quorum read), never
            # on the watch cache's copy, which may miss a pod that the shared claim was reserved for since.
            claim = self._read(td)
            reason = self._release_reason(td, claim)
        if reason:
            if not self._holds(td, claim):
                self._allocation_lost(td, claim)
            # What the attestation names as used by: every consumer (a PodGroup too, which SG007 requires).
            consumers = [(name, uid) for _, name, uid in claim_consumers(claim)] if claim else []
            with self._lock:
                self._released[td.claim.uid] = (frozenset(uid for _, uid in consumers), self.clock())
            self.engine.release(td, reason, consumers, claim)

    def _release_reason(self, td: Teardown, claim: dict[str, Any] | None) -> str | None:
        reason = release_reason(claim, td.claim.uid, self._ended)
        if reason is None and claim is not None:
            self._note_ended_consumers(claim)
            reason = release_reason(claim, td.claim.uid, self._ended)
        return reason

    def _claim_of(self, td: Teardown) -> tuple[dict[str, Any] | None, bool]:
        """The teardown's claim as this node's list or watch last showed it (True: from the watch cache), or, where
        they do not show it (deleted, or not labelled yet), read by name."""
        seen = self._seen.get(td.claim.uid)
        return (seen, True) if seen is not None else (self._read(td), False)

    def _read(self, td: Teardown) -> dict[str, Any] | None:
        """The teardown's claim as it is now: a GET without resourceVersion, which the API server answers from
        etcd."""
        claim = self.cluster.get_claim(td.claim.namespace, td.claim.name) if td.claim.name else None
        if claim is not None and (claim.get("metadata") or {}).get("uid") == td.claim.uid:
            self._remember(claim)
        return claim

    def _remember(self, claim: dict[str, Any]) -> None:
        uid = (claim.get("metadata") or {}).get("uid")
        if isinstance(uid, str) and uid:
            with self._lock:
                self._seen[uid] = claim

    def _holds(self, td: Teardown, claim: dict[str, Any] | None) -> bool:
        return holds_devices(claim, td.claim.uid, [(d.driver, d.pool, d.device) for d in td.devices])

    def _allocation_lost(self, td: Teardown, claim: dict[str, Any] | None) -> None:
        """The claim's allocation went (cleared, or the claim deleted) before the scrub of its devices was
        attested, which SG007 refuses: the guard was bypassed or removed. The devices are fenced at once."""
        if not self.engine.fence(td, FenceReason.ALLOCATION_LOST):
            return  # fenced already
        self.metrics.unattested_deallocations.inc()
        gone = claim is None or (claim.get("metadata") or {}).get("uid") != td.claim.uid
        message = (
            f"claim {td.claim} {'was deleted' if gone else 'lost its allocation'} before the scrub of "
            f"{', '.join(d.key for d in td.devices)} on node {self.node} was attested: scrubgate's admission guard "
            "was bypassed or removed (its webhooks deleted or not called, an admin clearing the allocation). The "
            "devices are fenced until their scrub is verified; whoever got them meanwhile "
            "may have seen the last tenant's data: find the deallocation in the API server's audit log"
        )
        log.error("%s", message)
        self.engine.record_event(td, "UnattestedDeallocation", message, on_node=gone)

    def _check_holds(self, states: frozenset[State]) -> None:
        """For each teardown in `states` that no fence of ours covers: its claim is read, and fenced if its
        allocation no longer holds the devices."""
        for td in self._teardowns():
            if td.state in states and td.fenced is None:
                self._guarded(td, lambda td=td: self._check_held(td))

    def _check_held(self, td: Teardown) -> None:
        if td.state not in DIRTY_STATES:
            return
        claim, cached = self._claim_of(td)
        if not self._holds(td, claim) and cached:
            claim = self._read(td)  # an allocation taken for lost is an alarm: confirmed on the claim as it is now
        if td.state in DIRTY_STATES and not self._holds(td, claim):
            self._allocation_lost(td, claim)

    def _release_if_glass_broken(self, td: Teardown) -> None:
        """A failed teardown's claim on which an admin broke glass (scrubgate.dev/break-glass): its devices stay fenced
        (scrub-failed, until an operator's rescrub), so the agent's hold goes, and with it the claim (the webhook lets
        its deallocation through, audited)."""
        claim, cached = self._claim_of(td)
        if _glass_broken(claim) and cached:
            claim = self._read(td)  # the hold goes on the claim as it is now
        if _glass_broken(claim):
            self.engine.release_hold(td)

    def _check(self, td: Teardown) -> None:
        """What a look at its claim may change for a teardown: its release, the loss of its allocation while it may
        be dirty, break-glass on a failed one."""
        if td.state == State.ALLOCATED:
            self._submit(td, lambda: self._check_release(td), "check-release")
        elif td.state in TEARING_DOWN and td.fenced is None:
            self._guarded(td, lambda: self._check_held(td))
        elif td.state == State.FAILED and td.hold is not None:
            self._guarded(td, lambda: self._release_if_glass_broken(td))

    def _check_releases(self) -> None:
        for td in self._teardowns():
            if td.state == State.ALLOCATED:
                self._submit(td, lambda td=td: self._check_release(td), "check-release")

    def _observe_claims(self, claims: list[dict[str, Any]]) -> None:
        """A list of this node's claims (at start, at each resync, when the claim watch starts again): claims new to
        the agent are taken up, and every teardown is looked at against its claim as listed. A list from the watch
        cache may be a little behind: that is safe here, since it only prompts looks. A claim it misses was
        labelled since (its watch event follows) or is gone (read by name); what a look decides rests on a
        quorum read or a resourceVersion-tested write; and the webhook keeps a used claim allocated until its
        scrub is attested, so a late look loses nothing."""
        known = self._teardowns()
        with self._lock:
            self._seen = {uid: c for c in claims if (uid := (c.get("metadata") or {}).get("uid"))}
        self._sync_claims(claims)
        for td in known:
            self._check(td)

    def observe_claim(self, kind: str, claim: dict[str, Any]) -> None:
        """A watch event of one of this node's claims (DELETED: deleted, or its node label gone)."""
        uid = (claim.get("metadata") or {}).get("uid") or ""
        if kind == "DELETED":
            with self._lock:
                self._seen.pop(uid, None)
        else:
            self._remember(claim)
        td = self.store.teardowns.get(uid)
        if td is not None:
            self._check(td)
        elif kind != "DELETED":
            self._sync_claims([claim])

    def resync(self) -> None:
        """Periodic full look: this node's claims (first, so that a claim re-created under an old name is seen
        as new), pods (in case a watch event was lost), slices."""
        self._refresh_slices()
        claims, _ = self.cluster.list_node_claims(self.node)
        self._observe_claims(claims)
        pods, _ = self.cluster.list_node_pods(self.node)
        if self._observe_list(pods):
            self._check_releases()
        cutoff = self.clock() - FINISHED_POD_MEMORY_S
        with self._lock:
            self._ended = {uid: at for uid, at in self._ended.items() if at >= cutoff}
            self._ends_looked_at = {uid: n for uid, n in self._ends_looked_at.items() if uid in self._ended}
            self._released = {uid: r for uid, r in self._released.items() if r[1] >= cutoff}

    # ---------------------------------------------------------------- the loop

    def tick(self) -> float:
        """Advances every teardown as far as it can go now; returns seconds until work is next due."""
        self._last_tick = time.monotonic()
        if self._lanes is not None:
            self._lanes.raise_fatal()
        self._take_rescrub_requests()
        for td in self._teardowns():
            # With lanes, only what has work now: a tick comes after every batch of events.
            if self._lanes is None or not (self._lanes.busy(td.claim.uid) or self.engine.waiting(td)):
                self._submit(td, lambda td=td: self.engine.advance(td), "advance")
        with self._lock:
            self._api_retry = {uid: r for uid, r in self._api_retry.items() if uid in self.store.teardowns}
        return self._next_due()

    def _next_due(self) -> float:
        now = self.clock()
        due = [self.settings.resync_s]
        for td in self._teardowns():
            backoff = self._api_retry.get(td.claim.uid)
            if backoff is not None and backoff[0] > now:
                due.append(backoff[0] - now)  # nothing happens to it before then
            elif td.state == State.DRAINING:
                due.append(self.settings.drain_poll_s)
            elif td.state == State.ALLOCATED and (record_due := self.engine.record_due(td)) is not None:
                due.append(record_due)
            elif td.state == State.FAILED and td.retry_at is not None:
                due.append(td.retry_at - now)
            elif td.state == State.FAILED and self.settings.rescrub_dir is not None:
                due.append(RESCRUB_POLL_S)  # waiting for an operator: pick up `agent rescrub` promptly
        return max(min(due), 0.0)

    def _submit(self, td: Teardown, action: Callable[[], object], tag: str | None = None) -> None:
        """Runs `action` for `td` (guarded) in the claim's lane, after what was handed in for it before; without
        lanes, here and now. A tagged action already waiting in the lane is not handed in twice."""
        if self._lanes is None:
            self._guarded(td, action)
        else:
            self._lanes.submit(td.claim.uid, lambda: self._guarded(td, action), tag)

    def _guarded(self, td: Teardown, action: Callable[[], object]) -> None:
        """Runs `action` for `td` unless it is backing off after an API error; API errors start a backoff."""
        retry = self._api_retry.get(td.claim.uid)
        if retry is not None and retry[0] > self.clock():
            return
        try:
            action()
        except ClusterError as exc:
            self._backoff(td, exc)
        else:
            with self._lock:
                self._api_retry.pop(td.claim.uid, None)

    def _backoff(self, td: Teardown, exc: ClusterError) -> None:
        with self._lock:
            last = self._api_retry.get(td.claim.uid, (0.0, 0.0))[1]
            delay = min(last * 2 or self.settings.api_backoff_s, self.settings.api_backoff_max_s)
            self._api_retry[td.claim.uid] = (self.clock() + delay, delay)
        log.warning("claim %s (%s): API error, retrying in %.0fs: %s", td.claim, td.state.value, delay, exc)

    def _take_rescrub_requests(self) -> None:
        if self.settings.rescrub_dir is None:
            return
        for path, device in rescrub.pending(self.settings.rescrub_dir):
            matched = [
                td for td in self._teardowns() if device and td.state == State.FAILED and rescrub.matches(td, device)
            ]
            if not matched:
                log.warning(
                    "rescrub request %s (%s) matches no failed device on node %s; discarded", path, device, self.node
                )
            for td in matched:
                with self._lock:
                    self._api_retry.pop(td.claim.uid, None)
                self._submit(td, lambda td=td: self.engine.rescrub(td))
            path.unlink(missing_ok=True)

    def healthy(self) -> tuple[bool, str]:
        if self._last_tick is None:
            return False, "starting: reconciling the checkpoint and the claims on this node"
        idle = time.monotonic() - self._last_tick
        if idle > self.settings.liveness_s:
            return False, f"agent loop stuck for {idle:.0f}s"
        stuck = self.engine.stuck()
        if stuck:
            return False, "; ".join(stuck)
        unwatched = self.backend.watch_error()
        if unwatched:
            return False, f"XID watch stopped, every health check of a device fails: {unwatched}"
        fenced, failed = self.engine.fenced_devices()
        return True, f"ok: {len(self.store.teardowns)} teardown(s), {fenced} device(s) fenced, {failed} failed"

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until the lanes have nothing left to do now; False on timeout."""
        return self._lanes is None or self._lanes.wait_idle(timeout)

    def close(self, hand_over: bool = False) -> None:
        """Lets the lanes finish what they are doing (a step under way ends in a checkpointed state); with
        `hand_over`, then fences every teardown still owed (`hand_over`)."""
        if self._sight_pool is not None:
            self._sight_pool.shutdown(wait=True)
        if self._lanes is not None:
            self._lanes.close()
        if hand_over:
            self.hand_over()
        if self._fence_pool is not None:
            self._fence_pool.shutdown(wait=True)

    def hand_over(self) -> None:
        """The agent is stopping with teardowns owed: their devices are fenced, since the webhook whose guard
        keeps their allocations may be removed next (an uninstall deletes the agents first, then the webhook
        configurations). A restarted agent lifts them once their scrub is verified."""
        if self._engine is None:
            return
        for td in self._teardowns():
            if td.state in DIRTY_STATES and td.fenced is None:
                try:
                    self.engine.fence(td, FenceReason.HAND_OVER)
                except ClusterError as exc:
                    log.error(
                        "claim %s: could not fence %s before stopping (%s); its allocation keeps it from other "
                        "claims for as long as scrubgate's webhook is installed",
                        td.claim,
                        ", ".join(d.key for d in td.devices),
                        exc,
                    )

    def run(self, stop: threading.Event) -> None:
        """start(), then watch and tick until `stop` is set; on the way out, `hand_over`."""
        try:
            self._run(stop)
        finally:
            self.close(hand_over=True)

    def _run(self, stop: threading.Event) -> None:
        self.start()
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        backoff = Backoff(self.settings.watch_timeout_s, self.settings.api_backoff_s, self.settings.api_backoff_max_s)
        node = self.node
        watched = (
            ("POD", f"pods on node {node}", self.cluster.list_node_pods, self.cluster.watch_node_pods),
            ("CLAIM", f"claims of node {node}", self.cluster.list_node_claims, self.cluster.watch_node_claims),
        )
        for tag, what, lister, watcher in watched:
            threading.Thread(
                target=follow,
                args=(
                    what,
                    lambda lister=lister: lister(node),
                    lambda version, timeout_s, watcher=watcher: watcher(node, version, timeout_s),
                    lambda items, tag=tag: events.put((f"{tag}-LIST", items)),
                    lambda kind, obj, tag=tag: events.put((tag, (kind, obj))),
                    stop,
                    backoff,
                ),
                name=f"agent-watch-{tag.lower()}",
                daemon=True,
            ).start()
        # Wakes the loop from its wait as soon as `stop` is set (SIGTERM), not at the next resync.
        threading.Thread(target=lambda: (stop.wait(), events.put(("STOP", None))), daemon=True).start()
        next_resync = time.monotonic() + self.settings.resync_s
        while not stop.is_set():
            wait = min(self.tick(), max(next_resync - time.monotonic(), 0.0))
            batch: list[tuple[str, Any]] = []
            try:
                batch.append(events.get(timeout=wait))
                while True:
                    batch.append(events.get_nowait())
            except queue.Empty:
                pass
            self.observe_batch(batch)
            if time.monotonic() >= next_resync:
                try:
                    self.resync()
                except ClusterError as exc:
                    log.warning("resync of node %s failed: %s", self.node, exc)
                next_resync = time.monotonic() + self.settings.resync_s

    def observe_batch(self, batch: list[tuple[str, Any]]) -> None:
        """Watch events that came together, handled in order, after the claims of running pods among them that
        the agent has not seen yet are read and fenced side by side (with lanes): a burst of allocations is
        fenced in a few API round trips, not one claim after the other."""
        if self._sight_pool is not None:
            unseen = {
                (namespace, name): None
                for kind, payload in batch
                for pod in (
                    payload if kind == "POD-LIST" else [payload[1]] if kind == "POD" and payload[0] != "DELETED" else []
                )
                if not pod_finished(pod)
                for namespace in [(pod.get("metadata") or {}).get("namespace") or ""]
                for name in pod_claim_names(pod)
                if self._find(namespace, name) is None
            }
            if len(unseen) > 1:
                list(self._sight_pool.map(lambda key: self._first_sight(*key), unseen))
        for item in batch:
            self._handle(item)

    def _first_sight(self, namespace: str, name: str) -> None:
        """What `observe_pod` does for a running pod's claim that the agent has not seen."""
        try:
            claim = self.cluster.get_claim(namespace, name)
        except ClusterError:
            return  # the event's own handling asks again
        if claim is not None:
            self._follow(claim)

    def _handle(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "POD-LIST":
            self._observe_list(payload)
            self._check_releases()
        elif kind == "POD":
            self.observe_pod(*payload)
        elif kind == "CLAIM-LIST":
            self._observe_claims(payload)
        elif kind == "CLAIM":
            self.observe_claim(*payload)
