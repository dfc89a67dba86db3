"""scrubgate's controller: the one cluster-wide view of ResourceClaims, so that no node agent needs one.

Each node agent lists and watches only the claims labelled with its node (`scrubgate.dev/node`; claims cannot be
field-selected by node), and labels a GPU claim of its node itself with its first annotation write of it (the
record of an allocation that lasts, or the attestation). The controller (a Deployment,
leader-elected on a coordination.k8s.io Lease, so that one replica acts) holds one informer over every claim and:

- labels with its node a GPU claim allocated there that no agent labelled within `label_after_s` (the node's agent
  was down, or never saw a pod of it): that agent's list finds it, however long its pods are gone;
- removes `scrubgate.dev/sanitize` from a claim deleted before it ever held a device: nothing to scrub, no agent
  would attest it, and no agent's view need show it (kube-controller-manager makes such claims from a template
  for pods that have ended, and deletes them after the pod's last event).

It fails closed. While it is down, a claim no agent labelled is seen only by an agent that sees one of its pods;
SG007 keeps such a claim allocated, and its devices out of every other claim's reach, until an agent attests their
scrub, which it does once the label is there. A claim deleted before allocation waits in Terminating meanwhile,
holding no device.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from scrubgate.policies import names
from scrubgate.policies.attestation import deleted_before_allocation
from scrubgate.policies.release_guard import claim_nodes

from .claims import allocated_devices, finalizer_removal_ops, node_label_ops
from .informer import Backoff, follow
from .kube import ClusterError, Conflict, NotFound

log = logging.getLogger(__name__)

Claim = dict[str, Any]


class ClaimClient(Protocol):
    def list_all_claims(self) -> tuple[list[Claim], str]: ...

    def watch_all_claims(self, resource_version: str, timeout_s: int) -> Iterator[tuple[str, Claim]]: ...

    def patch_claim(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> Claim: ...


@dataclass(frozen=True)
class ControllerSettings:
    gpu_drivers: tuple[str, ...] = ("gpu.nvidia.com",)
    # The node's agent labels a claim with its first annotation write, within seconds of its allocation (the record,
    # 2 s; the attestation of one released sooner): the controller writes only where it has not by then, so that
    # the normal path costs no second write of the claim.
    label_after_s: float = 10.0
    backoff: Backoff = field(default_factory=Backoff)
    # /healthz fails when the informer has had no good list or watch for this long.
    stale_after_s: float = 300.0


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.labelled = Counter(
            "scrubgate_controller_claims_labelled",
            "Claims the controller labelled with their node, no agent having done so.",
            registry=self.registry,
        )
        self.finalizers_removed = Counter(
            "scrubgate_controller_finalizers_removed",
            "scrubgate.dev/sanitize finalizers removed from claims deleted before they held a device.",
            registry=self.registry,
        )
        self.claims = Gauge("scrubgate_controller_claims", "Claims in the informer.", registry=self.registry)
        self.leader = Gauge("scrubgate_controller_leader", "1 while this replica leads.", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ClaimController:
    def __init__(
        self,
        client: ClaimClient,
        settings: ControllerSettings = ControllerSettings(),
        metrics: ControllerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics or ControllerMetrics()
        self.clock = clock
        self._claims: dict[str, Claim] = {}  # UID -> the claim as the informer last showed it
        self._due: dict[str, float] = {}  # UID -> when to act on it (a label, a finalizer), as `_work` then says
        self._synced_at: float | None = None  # when the informer last listed, or heard from its watch

    # ---------------------------------------------------------------- the informer

    def relist(self, claims: list[Claim]) -> None:
        self._claims = {}
        self._due = {}
        for claim in claims:
            self.observe("SYNC", claim)
        self._alive()

    def observe(self, kind: str, claim: Claim) -> None:
        uid = (claim.get("metadata") or {}).get("uid") or ""
        if kind == "DELETED":
            self._claims.pop(uid, None)
            self._due.pop(uid, None)
        else:
            self._claims[uid] = claim
            work = self._work(claim)
            if work is None:
                self._due.pop(uid, None)
            elif work[0] == "finalizer":
                self._due[uid] = self.clock()
            else:
                self._due.setdefault(uid, self.clock() + self.settings.label_after_s)
        self.metrics.claims.set(len(self._claims))

    def _work(self, claim: Claim) -> tuple[str, list[dict[str, Any]]] | None:
        """What the claim needs of the controller: ("finalizer", ops) or ("label", ops), or None."""
        if deleted_before_allocation(claim):
            ops = finalizer_removal_ops(claim, None)
            return None if ops is None else ("finalizer", ops)
        node = self._node(claim)
        ops = node_label_ops(claim, node) if node else None
        return None if ops is None else ("label", ops)

    def _node(self, claim: Claim) -> str | None:
        """The node whose agent scrubs the claim's devices: that of its allocation, where it holds a device of a
        GPU driver and is on one node (a node-local device's allocation names its node)."""
        if not any(driver in self.settings.gpu_drivers for driver, _, _ in allocated_devices(claim)):
            return None
        nodes = claim_nodes(claim)
        return next(iter(nodes)) if len(nodes) == 1 else None

    # ---------------------------------------------------------------- the writes

    def act(self) -> float:
        """Does what is due; returns the seconds until the next is."""
        now = self.clock()
        for uid, at in list(self._due.items()):
            if at > now:
                continue
            del self._due[uid]
            claim = self._claims.get(uid)
            work = self._work(claim) if claim is not None else None
            if work is not None:
                self._write(uid, claim or {}, *work)
        pending = [at - now for at in self._due.values()]
        return max(min(pending, default=self.settings.label_after_s), 0.0)

    def _write(self, uid: str, claim: Claim, what: str, ops: list[dict[str, Any]]) -> None:
        meta = claim.get("metadata") or {}
        namespace, name = meta.get("namespace") or "", meta.get("name") or ""
        try:
            self.client.patch_claim(namespace, name, ops)
        except (Conflict, NotFound):
            return  # it changed or went: its next event says what is left to do
        except ClusterError as exc:
            delay = self.settings.backoff.initial_s
            log.warning("claim %s/%s: cannot write its %s (%s); retrying in %.0fs", namespace, name, what, exc, delay)
            self._due[uid] = self.clock() + delay
            return
        if what == "finalizer":
            self.metrics.finalizers_removed.inc()
            log.info("claim %s/%s: deleted before it held a device; removed %s", namespace, name, names.FINALIZER)
        else:
            self.metrics.labelled.inc()
            log.info(
                "claim %s/%s: allocated on node %s, no agent labelled it; labelled %s",
                namespace,
                name,
                self._node(claim),
                names.LABEL_NODE,
            )

    # ---------------------------------------------------------------- the loop

    def run(self, stop: threading.Event) -> None:
        """The informer in a thread of its own; events handled, and writes made, here, until `stop`."""
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        threading.Thread(
            target=follow,
            args=(
                "every ResourceClaim",
                self.client.list_all_claims,
                self.client.watch_all_claims,
                lambda items: events.put(("LIST", items)),
                lambda kind, claim: events.put((kind, claim)),
                stop,
                self.settings.backoff,
                self._alive,
            ),
            name="controller-informer",
            daemon=True,
        ).start()
        threading.Thread(target=lambda: (stop.wait(), events.put(("STOP", None))), daemon=True).start()
        wait = self.settings.label_after_s
        while not stop.is_set():
            try:
                kind, payload = events.get(timeout=wait)
                if kind == "LIST":
                    self.relist(payload)
                elif kind != "STOP":
                    self.observe(kind, payload)
            except queue.Empty:
                pass
            wait = self.act()

    def _alive(self) -> None:
        self._synced_at = self.clock()

    def healthy(self) -> tuple[bool, str]:
        if self._synced_at is None:
            return False, "starting: listing every ResourceClaim"
        quiet = self.clock() - self._synced_at
        if quiet > self.settings.stale_after_s:
            return False, f"no list or watch event of ResourceClaims for {quiet:.0f}s: check the API server's reach"
        return True, f"ok: {len(self._claims)} claim(s), {len(self._due)} to act on"
