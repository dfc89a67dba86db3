"""The node agent: sees allocations on its node, fences them, and tears them down when they are released.

Inputs: this node's pods (list + watch, field selector `spec.nodeName`), their claims (by name), this node's
claims (list + watch, label selector `scrubgate.dev/node=<node>`: the agent labels a claim with its first annotation
write of it, and scrubgate's controller labels those allocated here while no agent looked, whose pods may be long gone: the
webhook keeps a GPU claim allocated until its scrub is attested), this node's ResourceSlices (to map DRA
devices to GPU UUIDs), NVIDIA's driver checkpoint (claims prepared while the agent was away), the
agent's own checkpoint, and operator rescrub requests. Everything that
changes state goes through the TeardownEngine; this module runs the loop that decides *when*: intake.py takes
up what the watches show, release.py decides what a look at a claim changes, node_view.py holds what they know.

What it reads grows with its node, not with the cluster: no list of every claim, no list of a namespace, and
no periodic read of each claim it tracks. The lists and the watch of its claims come from the API server's
watch cache and only prompt a look; a decision that needs the claim as it is now reads it by name (a quorum
read): before a release starts a scrub, before an allocation is taken for lost, before break-glass releases a
hold (release.py); the TeardownEngine attests and releases its hold with resourceVersion-tested patches of a
claim it read itself.

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

from . import nvidia, rescrub
from .checkpoint import DIRTY_STATES, OWED_STATES, CheckpointStore, FenceReason, State, Teardown
from .claims import pod_claim_names, pod_finished
from .device_access import require_device_access
from .fences import Fencer
from .gpu import GpuBackend
from .informer import Backoff, follow
from .intake import Intake
from .kube import ClusterClient, ClusterError, with_retries
from .lanes import Lanes
from .metrics import AgentMetrics
from .node_view import NodeView
from .release import ReleaseChecks
from .signing import Signer
from .steps import Steps
from .teardown import TeardownEngine, TeardownSettings, TransitionHook

log = logging.getLogger(__name__)

FINISHED_POD_MEMORY_S = 3600.0
RESCRUB_POLL_S = 1.0  # how often a failed device waiting for an operator looks for a rescrub request
# A teardown whose lane is at work is looked at again this soon, not at once: what it owes now (a record due,
# say) is in the lane already, and a loop that waited 0 s would spin on it until the lane is done.
LANE_POLL_S = 0.05


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
        self.view = NodeView()
        self._last_tick: float | None = None
        workers = settings.max_concurrent_teardowns
        self._lanes = Lanes(workers, f"teardown-{self.node}") if workers > 0 else None
        self._sight_pool = ThreadPoolExecutor(workers, f"first-sight-{self.node}") if workers > 0 else None
        # The fences of one claim's devices (a whole GPU and its MIG slices: eight) go up and down at once.
        self._fence_pool = ThreadPoolExecutor(workers, f"fence-{self.node}") if workers > 0 else None
        self.steps = Steps(self._lanes, clock, settings.api_backoff_s, settings.api_backoff_max_s)
        self.releases = ReleaseChecks(
            node=self.node,
            cluster=cluster,
            store=store,
            view=self.view,
            engine=lambda: self.engine,
            metrics=self.metrics,
            clock=clock,
            submit=self.steps.submit,
            guarded=self.steps.guarded,
        )
        self.intake = Intake(
            node=self.node,
            cluster=cluster,
            store=store,
            view=self.view,
            releases=self.releases,
            engine=lambda: self.engine,
            clock=clock,
            finish=self._finish,
            backoff=self.steps.backoff,
        )

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
        for uid, td in self.store.teardowns.items():
            if td.released_at is not None:
                self.view.release(uid, frozenset(pod for _, pod in td.consumers), self.clock())
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
            schedule=(lambda td: self.steps.submit(td, lambda: self.engine.advance(td), "advance"))
            if self._lanes
            else None,
        )
        self.metrics.oldest_release.set_function(self._engine.watchdog.oldest_release_s)  # at each scrape
        if version:
            log.info("node %s: fencing with DeviceTaintRule %s/%s", self.node, "resource.k8s.io", version)
        self.intake.refresh_slices()
        require_device_access(self.node, self.intake.slices, self.backend)
        owed = [td for td in self.store.teardowns.values() if td.state in OWED_STATES]
        if owed:
            log.info("node %s: checkpoint owes %d teardown(s); making sure they are out of reach", self.node, len(owed))
        for td in owed:
            self.steps.guarded(td, lambda td=td: self.engine.fences.ensure_fenced(td))
        self.releases.check_holds(DIRTY_STATES)
        if self.settings.nvidia_checkpoint is not None:
            for prepared in nvidia.read_prepared_claims(self.settings.nvidia_checkpoint):
                self.intake.adopt_prepared(prepared)
        pods, _ = with_retries(f"list pods on {self.node}", lambda: self.cluster.list_node_pods(self.node))
        self.intake.observe_pod_list(pods)
        claims, _ = with_retries(f"list the claims of {self.node}", lambda: self.cluster.list_node_claims(self.node))
        self.intake.observe_claims(claims)

    # ---------------------------------------------------------------- events

    def observe_pod(self, kind: str, pod: dict[str, Any]) -> None:
        """A pod on this node was listed, added, modified or deleted."""
        self.intake.observe_pod(kind, pod)

    def observe_claim(self, kind: str, claim: dict[str, Any]) -> None:
        """A watch event of one of this node's claims (DELETED: deleted, or its node label gone)."""
        self.intake.observe_claim(kind, claim)

    def resync(self) -> None:
        """Periodic full look: this node's claims (first, so that a claim re-created under an old name is seen
        as new), pods (in case a watch event was lost), slices."""
        self.intake.refresh_slices()
        claims, _ = self.cluster.list_node_claims(self.node)
        self.intake.observe_claims(claims)
        pods, _ = self.cluster.list_node_pods(self.node)
        if self.intake.observe_pod_list(pods):
            self.releases.check_releases()
        self.view.prune(self.clock() - FINISHED_POD_MEMORY_S)

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
                self.steps.submit(td, lambda td=td: self.engine.advance(td), "advance")
        self.steps.keep_only(self.store.teardowns.keys())
        return self._next_due()

    def _next_due(self) -> float:
        now = self.clock()
        due = [self.settings.resync_s]
        for td in self._teardowns():
            retry_at = self.steps.retry_at(td.claim.uid)
            if self._lanes is not None and self._lanes.busy(td.claim.uid):
                due.append(LANE_POLL_S)
            elif retry_at is not None and retry_at > now:
                due.append(retry_at - now)  # nothing happens to it before then
            elif td.state == State.DRAINING:
                due.append(self.settings.drain_poll_s)
            elif td.state == State.ALLOCATED and (record_due := self.engine.record_due(td)) is not None:
                due.append(record_due)
            elif td.state == State.FAILED and td.retry_at is not None:
                due.append(td.retry_at - now)
            elif td.state == State.FAILED and self.settings.rescrub_dir is not None:
                due.append(RESCRUB_POLL_S)  # waiting for an operator: pick up `agent rescrub` promptly
        return max(min(due), 0.0)

    def _teardowns(self) -> list[Teardown]:
        """The teardowns now (a copy: lanes add and drop teardowns while the loop looks)."""
        return list(self.store.teardowns.values())

    def _finish(self, td: Teardown) -> None:
        """Advances a teardown past its verified scrub here and now; queued instead when its lane is at work on
        it."""
        if self._lanes is not None and self._lanes.busy(td.claim.uid):
            self.steps.submit(td, lambda: self.engine.advance(td), "advance")
        else:
            self.steps.guarded(td, lambda: self.engine.advance(td))

    def _take_rescrub_requests(self) -> None:
        if self.settings.rescrub_dir is not None:
            rescrub.take(self.settings.rescrub_dir, self._teardowns(), self.node, self._rescrub)

    def _rescrub(self, td: Teardown) -> None:
        self.steps.clear(td.claim.uid)
        self.steps.submit(td, lambda: self.engine.rescrub(td))

    def healthy(self) -> tuple[bool, str]:
        if self._last_tick is None:
            return False, "starting: reconciling the checkpoint and the claims on this node"
        idle = time.monotonic() - self._last_tick
        if idle > self.settings.liveness_s:
            return False, f"agent loop stuck for {idle:.0f}s"
        stuck = self.engine.watchdog.stuck()
        if stuck:
            return False, "; ".join(stuck)
        unwatched = self.backend.watch_error()
        if unwatched:
            return False, f"XID watch stopped, every health check of a device fails: {unwatched}"
        fenced, failed = self.engine.fences.fenced_devices()
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
                    self.engine.fences.fence(td, FenceReason.HAND_OVER)
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
                (namespace, name): (pod.get("metadata") or {}).get("resourceVersion") or ""
                for kind, payload in batch
                for pod in (
                    payload if kind == "POD-LIST" else [payload[1]] if kind == "POD" and payload[0] != "DELETED" else []
                )
                if not pod_finished(pod)
                for namespace in [(pod.get("metadata") or {}).get("namespace") or ""]
                for name in pod_claim_names(pod)
                if self.intake.find(namespace, name) is None
            }
            if len(unseen) > 1:
                list(self._sight_pool.map(lambda key: self.intake.first_sight(*key, unseen[key]), unseen))
        for item in batch:
            self._handle(item)

    def _handle(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "POD-LIST":
            self.intake.observe_pod_list(payload)
            self.releases.check_releases()
        elif kind == "POD":
            self.intake.observe_pod(*payload)
        elif kind == "CLAIM-LIST":
            self.intake.observe_claims(payload)
        elif kind == "CLAIM":
            self.intake.observe_claim(*payload)
