"""What decides, for each teardown, what a look at its claim changes: whether the claim is released (its teardown
begins), whether its allocation was lost while its devices may be dirty (they are fenced), whether break-glass on a
failed teardown lets the agent's hold go.

A look starts from the claim as the node's list or watch last showed it (the API server's watch cache: cheap,
possibly a little behind); a decision that hands on, fences or releases rests on the claim as it is now, read by
name (a quorum read): before a release starts the scrub, before an allocation is taken for lost, before
break-glass releases the hold."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.attestation import claim_consumers, is_ended_pod

from .checkpoint import DIRTY_STATES, CheckpointStore, FenceReason, State, Teardown
from .claim_writes import record_event
from .claims import holds_devices, pod_finished, release_reason
from .kube import ClusterClient
from .metrics import AgentMetrics
from .node_view import NodeView
from .teardown import TeardownEngine
from .unguarded import add_missing_finalizer

log = logging.getLogger(__name__)

Claim = dict[str, Any]
# Released, not yet verified clean: a look at the claim checks that its allocation still holds the devices.
TEARING_DOWN = frozenset({State.RELEASED, State.DRAINING, State.SCRUBBING})
Submit = Callable[[Teardown, Callable[[], object], str | None], None]
Guarded = Callable[[Teardown, Callable[[], object]], None]


def _glass_broken(claim: Claim | None) -> bool:
    return bool((((claim or {}).get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_BREAK_GLASS))


class ReleaseChecks:
    def __init__(
        self,
        *,
        node: str,
        cluster: ClusterClient,
        store: CheckpointStore,
        view: NodeView,
        engine: Callable[[], TeardownEngine],
        metrics: AgentMetrics,
        clock: Callable[[], float],
        submit: Submit,
        guarded: Guarded,
    ) -> None:
        self.node = node
        self.cluster = cluster
        self.store = store
        self.view = view
        self._engine = engine
        self.metrics = metrics
        self.clock = clock
        self._submit = submit  # in the teardown's lane, after what it has queued
        self._guarded = guarded  # here and now, unless the teardown is backing off after an API error

    @property
    def engine(self) -> TeardownEngine:
        return self._engine()

    # ---------------------------------------------------------------- what to look at

    def check(self, td: Teardown) -> None:
        """What a look at its claim may change for a teardown: its release, the loss of its allocation while it may
        be dirty, break-glass on a failed one."""
        if td.state == State.ALLOCATED:
            self.check_release_later(td)
        elif td.state in TEARING_DOWN and td.fenced is None:
            self._guarded(td, lambda: self.check_held(td))
        elif td.state == State.FAILED and td.hold is not None:
            self._guarded(td, lambda: self.release_if_glass_broken(td))

    def check_release_later(self, td: Teardown) -> None:
        """Whether the teardown's claim is released, asked in its lane (which reads the claim)."""
        self._submit(td, lambda: self.check_release(td), "check-release")

    def check_releases(self) -> None:
        for td in list(self.store.teardowns.values()):
            if td.state == State.ALLOCATED:
                self.check_release_later(td)

    def check_holds(self, states: frozenset[State]) -> None:
        """For each teardown in `states` that no fence of ours covers: fenced if its claim's allocation no longer
        holds the devices."""
        for td in list(self.store.teardowns.values()):
            if td.state in states and td.fenced is None:
                self._guarded(td, lambda td=td: self.check_held(td))

    # ---------------------------------------------------------------- the decisions

    def check_release(self, td: Teardown) -> None:
        if td.state != State.ALLOCATED:
            return
        claim, cached = self._claim_of(td)
        if claim is not None and (claim.get("metadata") or {}).get("uid") == td.claim.uid:
            add_missing_finalizer(self.cluster, self.node, claim, [d.key for d in td.devices], self.clock())
        reason = self._release_reason(claim, td)
        if reason and cached:
            # A release starts the drain and the scrub: decided on the claim as it is now (a quorum read), never
            # on the watch cache's copy, which may miss a pod that the shared claim was reserved for since.
            claim = self.read(td)
            reason = self._release_reason(claim, td)
        if reason:
            if not self._holds(td, claim):
                self._allocation_lost(td, claim)
            # What the attestation names as used by: every consumer (a PodGroup too, which SG007 requires).
            consumers = [(name, uid) for _, name, uid in claim_consumers(claim)] if claim else []
            self.view.release(td.claim.uid, frozenset(uid for _, uid in consumers), self.clock())
            self.engine.release(td, reason, consumers, claim)

    def check_held(self, td: Teardown) -> None:
        if td.state not in DIRTY_STATES:
            return
        claim, cached = self._claim_of(td)
        if not self._holds(td, claim) and cached:
            claim = self.read(td)  # an allocation taken for lost is an alarm: confirmed on the claim as it is now
        if td.state in DIRTY_STATES and not self._holds(td, claim):
            self._allocation_lost(td, claim)

    def release_if_glass_broken(self, td: Teardown) -> None:
        """A failed teardown's claim on which an admin broke glass (scrubgate.dev/break-glass): its devices stay
        fenced (scrub-failed, until an operator's rescrub), so the agent's hold goes, and with it the claim (the
        webhook lets its deallocation through, audited)."""
        claim, cached = self._claim_of(td)
        if _glass_broken(claim) and cached:
            claim = self.read(td)  # the hold goes on the claim as it is now
        if _glass_broken(claim):
            self.engine.claim_writer.release_hold(td)

    # ---------------------------------------------------------------- the claim

    def _claim_of(self, td: Teardown) -> tuple[Claim | None, bool]:
        """The teardown's claim as this node's list or watch last showed it (True: from the watch cache), or, where
        they do not show it (deleted, or not labelled yet), read by name."""
        seen = self.view.seen.get(td.claim.uid)
        return (seen, True) if seen is not None else (self.read(td), False)

    def read(self, td: Teardown) -> Claim | None:
        """The teardown's claim as it is now: a GET without resourceVersion, which the API server answers from
        etcd."""
        claim = self.cluster.get_claim(td.claim.namespace, td.claim.name) if td.claim.name else None
        if claim is not None and (claim.get("metadata") or {}).get("uid") == td.claim.uid:
            self.view.remember(claim)
        return claim

    def _release_reason(self, claim: Claim | None, td: Teardown) -> str | None:
        reason = release_reason(claim, td.claim.uid, self.view.ended)
        if reason is None and claim is not None:
            self._note_ended_consumers(claim)
            reason = release_reason(claim, td.claim.uid, self.view.ended)
        return reason

    def _note_ended_consumers(self, claim: Claim) -> None:
        """Consumers the claim is reserved for that the agent has not seen end: pods it has neither seen running
        nor ending (they ended while it was down, or were bound since its last list), and consumers that are not
        pods (a PodGroup, whose pods may all be gone while the claim stays reserved for it): asks the API which
        have ended (a pod terminal or deleted, another consumer deleted). The webhook's record of an ended pod is
        looked up as that pod: whoever can write the claim's status could write one for a pod that still runs."""
        namespace = (claim.get("metadata") or {}).get("namespace") or ""
        for resource, name, uid in claim_consumers(claim):
            if not uid or uid in self.view.ended or uid in self.view.live_pods:
                continue
            if resource == "pods" or is_ended_pod(resource):
                found = self.cluster.get_pod(namespace, name)
                ended = found is None or pod_finished(found)
            else:
                plural, _, group = resource.partition(".")
                found = self.cluster.get_consumer(namespace, group, plural, name)
                ended = found is None
            if ended or (found or {}).get("metadata", {}).get("uid") != uid:
                self.view.end(uid, self.clock())

    def _holds(self, td: Teardown, claim: Claim | None) -> bool:
        return holds_devices(claim, td.claim.uid, [(d.driver, d.pool, d.device) for d in td.devices])

    def _allocation_lost(self, td: Teardown, claim: Claim | None) -> None:
        """The claim's allocation went (cleared, or the claim deleted) before the scrub of its devices was
        attested, which SG007 refuses: the guard was bypassed or removed. The devices are fenced at once."""
        if not self.engine.fences.fence(td, FenceReason.ALLOCATION_LOST):
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
        record_event(self.cluster, self.node, td, "UnattestedDeallocation", message, now=self.clock(), on_node=gone)
