"""What a teardown writes to its claim in the API: the hold (this node's consumer in its status.reservedFor) and
its release, the annotations (scrub-status, the record of its devices, the attestation), the removal of the
finalizer, and Events about it."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from scrubgate.policies import names
from scrubgate.policies.attestation import (
    AttestationError,
    check_claim_attestation,
    claim_consumers,
    claimed_devices,
    is_ended_pod,
)

from .checkpoint import CheckpointStore, Teardown
from .claims import (
    annotation_ops,
    devices_annotation,
    finalizer_removal_ops,
    hold_ops,
    hold_release_ops,
    node_event,
    node_hold,
    own_node_label_ops,
)
from .kube import ClusterClient, ClusterError, Conflict, NotFound
from .signing import Signer

log = logging.getLogger(__name__)

CONFLICT_RETRIES = 5
STATUS_MAX = 256


class ClaimWriter:
    def __init__(
        self,
        *,
        node: str,
        cluster: ClusterClient,
        store: CheckpointStore,
        signer: Signer,
        clock: Callable[[], float],
        save: Callable[[], None],
    ) -> None:
        """`save` writes the checkpoint (a hold's UID goes into it before it goes on the claim)."""
        self.node = node
        self.cluster = cluster
        self.store = store
        self.signer = signer
        self.clock = clock
        self._save = save
        # What this process already made sure of, and the claims as its writes left them; empty after a restart,
        # so everything is made sure of again once.
        self._status: dict[str, str] = {}  # claim UID -> scrub-status annotation written
        self._held: set[str] = set()  # claim UIDs whose hold this process has made sure of
        self._claims: dict[str, dict[str, Any]] = {}  # claim UID -> the claim as our last write left it

    def remember(self, uid: str, claim: dict[str, Any]) -> None:
        """The claim as just read: the first write patches it."""
        self._claims[uid] = claim

    def held(self, uid: str) -> bool:
        return uid in self._held

    def status_written(self, uid: str) -> bool:
        return uid in self._status

    def forget(self, uid: str) -> None:
        self._held.discard(uid)
        self._status.pop(uid, None)
        self._claims.pop(uid, None)

    # ---------------------------------------------------------------- the hold

    def ensure_hold(self, td: Teardown) -> None:
        """Holds the claim for this teardown: a `scrubgate.dev/nodeagents` consumer in its status.reservedFor, its
        UID checkpointed (at first sight) before it is written. Kubernetes' resourceclaim controller keeps consumers it does not
        know, so until the hold goes with the attested release it neither deallocates nor deletes the claim (no
        refused attempt, no retry), and the scheduler never takes the used claim for an unused one. Once per process;
        a hold the claim already carries (a restart) is adopted."""
        uid = td.claim.uid
        if uid in self._held or not td.claim.name:
            return
        # The copy last read first; where it was stale (the claim since deleted: the API server takes no new
        # consumer then, 422; or changed), fresh reads decide.
        attempts = (self._claims.pop(uid, None), None, None)
        for attempt, cached in enumerate(attempts, 1):
            claim = cached or self.cluster.get_claim(td.claim.namespace, td.claim.name)
            if claim is None or (claim.get("metadata") or {}).get("uid") != uid:
                return  # gone: the release check sees it
            try:
                self._hold(td, claim)
                break
            except NotFound:
                return
            except Conflict:
                if attempt == len(attempts):
                    raise
        self._held.add(uid)

    def _hold(self, td: Teardown, claim: dict[str, Any]) -> None:
        held = node_hold(claim, self.node)
        if held is None and td.hold is None:  # a teardown of an older checkpoint
            with self.store.lock:
                td.hold = str(uuid.uuid4())
            self._save()  # before the side effect: a restart adopts or rewrites this one
        elif held is not None and held != td.hold:
            with self.store.lock:
                td.hold = held
            self._save()
        ops = hold_ops(claim, self.node, td.hold or "")
        if ops is not None:
            self._claims[td.claim.uid] = self.cluster.patch_claim_status(td.claim.namespace, td.claim.name, ops)
            log.info("claim %s: held by node %s's agent until its attested release", td.claim, self.node)
        elif held is None:
            # Being deleted (the API server takes no new consumer then) or no longer allocated: SG007 keeps its
            # allocation until the attestation all the same; the resourceclaim controller retries meanwhile.
            log.warning(
                "claim %s: cannot be held (%s); SG007 keeps its allocation until the attestation",
                td.claim,
                "being deleted" if (claim.get("metadata") or {}).get("deletionTimestamp") else "not allocated",
            )

    def release_hold(self, td: Teardown) -> None:
        """Takes this node's hold off the claim, after its attestation is on it (SG007 lets nothing else release
        it), and where nothing else is left in its reservation, the allocation with it (`hold_release_ops`); the
        resourceclaim controller then deletes the claim where it was a pod's. A claim a later pod uses (a shared
        claim) keeps it: that use is not attested, and the agent's next teardown of the claim adopts the hold."""
        if not td.claim.name:
            return
        # The copy the attestation's write returned first (the patch's tests catch a stale one), then a fresh read.
        for cached in (self._claims.pop(td.claim.uid, None), None):
            claim = cached or self.cluster.get_claim(td.claim.namespace, td.claim.name)
            if claim is None or (claim.get("metadata") or {}).get("uid") != td.claim.uid:
                return
            ops = hold_release_ops(claim, self.node)
            if ops is None:
                return
            try:
                self.cluster.patch_claim_status(td.claim.namespace, td.claim.name, ops)
                return
            except NotFound:
                return
            except Conflict:
                continue
            except ClusterError as exc:
                if exc.status != 403:
                    raise
                log.warning(
                    "claim %s: admission kept node %s's hold on it (%s): a later use of the claim is not covered by "
                    "this attestation; the hold stays for the teardown of that use",
                    td.claim,
                    self.node,
                    exc,
                )
                return
        raise Conflict(f"claim {td.claim} kept changing while the agent released its hold; will retry", 409)

    def controller_releases(self, td: Teardown) -> bool:
        """Whether the resourceclaim controller makes the release itself: the claim, as the attestation's write
        left it, is reserved for ended pods the controller has yet to drop beside this node's hold (and records of
        ended pods), and for nothing else. That write sends the controller the claim; it drops the pods, and the
        webhook's /mutate makes its drop the release (holds, records and allocation out:
        policies/release_guard.kept_consumers_patch). Then the agent writes nothing more, so no write of its races
        the controller's (a conflict, a retry in its rate-limited queue). Anything else (only records left, which
        the controller does not drop; a PodGroup, a claim read afresh, no hold) the agent releases itself."""
        claim = self._claims.get(td.claim.uid)
        if claim is None or node_hold(claim, self.node) is None:
            return False
        resources = [resource for resource, _, _ in claim_consumers(claim)]
        return "pods" in resources and all(resource == "pods" or is_ended_pod(resource) for resource in resources)

    # ---------------------------------------------------------------- annotations, and the finalizer

    def write(self, td: Teardown, updates: dict[str, str], *, release: bool = False) -> bool:
        """Sets annotations on the claim; False when the claim is gone (nothing left to annotate). `release`:
        the same patch removes the finalizer where the attestation among `updates` holds for the claim and the
        claim outlives that patch, so that the resource claim controller sees one change, attested and
        released, instead of two, the second of which would fail its deallocation with a conflict and put it
        into its backoff.

        The first try patches the copy the last write returned, saving a GET on the teardown's path; the
        patch's `test` ops make a stale copy fail (Conflict), and then the claim is read afresh."""
        if not td.claim.name:
            return False
        for attempt in range(CONFLICT_RETRIES):
            claim = self._claims.pop(td.claim.uid, None) if attempt == 0 else None
            if claim is None:
                claim = self.cluster.get_claim(td.claim.namespace, td.claim.name)
                if claim is None or (claim.get("metadata") or {}).get("uid") != td.claim.uid:
                    return False
                current = (claim.get("metadata") or {}).get("annotations") or {}
                if all(current.get(k) == v for k, v in updates.items()):
                    self._claims[td.claim.uid] = claim
                    return True
            # The node label (by which this agent lists and watches its claims) goes with the first annotation
            # write (the record of an allocation that lasts, or the attestation of one released sooner) instead of
            # a write of its own: until then the checkpoint and the pod watch lead the agent to the claim, and
            # scrubgate's controller labels a claim that no agent labelled within its --label-after.
            ops = annotation_ops(claim, updates) + (own_node_label_ops(claim, self.node) or [])
            releasing = (
                release
                and _outlives_the_write(claim)
                and attestation_problem(td, claim, self.signer.public_keys) is None
            )
            if releasing:
                ops += finalizer_removal_ops(claim, None) or []  # the attestation is written by this patch
            try:
                self._claims[td.claim.uid] = self.cluster.patch_claim(td.claim.namespace, td.claim.name, ops)
                return True
            except NotFound:
                return False
            except Conflict:
                continue
            except ClusterError as exc:
                if not releasing or exc.status != 403:
                    raise
                # Admission refused the release (a webhook that does not trust this agent's key, say): the
                # attestation and `verified` still go on the claim, for the operator to see; `done` retries.
                log.warning(
                    "claim %s: admission refused the removal of finalizer %s (%s); writing the attestation alone, "
                    "the removal is retried. The denial says why; where it names the key, add this agent's public "
                    "key to the webhook's policy (attestationKeys, kid %r)",
                    td.claim,
                    names.FINALIZER,
                    exc,
                    self.signer.kid,
                )
                return self.write(td, updates)
        raise Conflict(f"claim {td.claim} kept changing while the agent annotated it; will retry", 409)

    def write_status(self, td: Teardown, status: str) -> None:
        """Sets the claim's scrub-status (cut to STATUS_MAX)."""
        status = status[:STATUS_MAX]
        self.write(td, {names.ANNOTATION_SCRUB_STATUS: status})
        self._status[td.claim.uid] = status

    def report_failure(self, td: Teardown) -> None:
        """Says on the claim that its teardown failed (`failed:`, which lets break-glass deallocate it), and in
        an Event what comes next."""
        self.write_status(td, f"{names.SCRUB_FAILED_PREFIX}{td.reason}")
        next_step = (
            f"retrying at {datetime.fromtimestamp(td.retry_at, UTC).isoformat(timespec='seconds')}"
            if td.retry_at is not None
            else f"waiting for an operator: fix the GPU, then `scrubgate agent rescrub --device {td.devices[0].uuid or td.devices[0].key}`"
        )
        record_event(
            self.cluster,
            self.node,
            td,
            "ScrubFailed",
            f"teardown of {', '.join(d.key for d in td.devices)} on node {self.node} failed "
            f"(attempt {td.attempts}): {td.reason}; devices stay fenced, {next_step}",
            now=self.clock(),
        )

    def announce(self, td: Teardown, status: str) -> None:
        """Sets the claim's scrub-status, once per status; the first write carries the record of the claim's
        devices. An API error is raised: the record's step backs off (steps.py), a scrub's progress goes on."""
        if self._status.get(td.claim.uid) == status:
            return
        record = {} if td.claim.uid in self._status else {names.ANNOTATION_DEVICES: _devices_annotation(td)}
        self.write(td, {**record, names.ANNOTATION_SCRUB_STATUS: status})
        self._status[td.claim.uid] = status

    def publish_attestation(self, td: Teardown) -> None:
        """Puts the attestation on the claim, `verified`, and with it where it can the release of the finalizer;
        where the claim is gone, into an Event on the node."""
        written = self.write(
            td,
            {
                names.ANNOTATION_DEVICES: _devices_annotation(td),
                names.ANNOTATION_ATTESTATION: td.attestation or "",
                names.ANNOTATION_SCRUB_STATUS: names.SCRUB_VERIFIED,
            },
            release=True,
        )
        if not written:
            self._keep_orphan_attestation(td)

    def _keep_orphan_attestation(self, td: Teardown) -> None:
        """The claim went before its attestation could land on it (break-glass): the attestation goes into
        an Event on the Node instead, so that the scrub of its devices stays on record."""
        devices = ", ".join(f"{d.key} ({d.uuid})" for d in td.devices)
        record_event(
            self.cluster,
            self.node,
            td,
            "ScrubAttested",
            f"claim {td.claim} was deleted before its teardown ended (break-glass?); {devices} verified clean on "
            f"node {self.node}; the signed attestation is in this Event's annotation {names.ANNOTATION_ATTESTATION}",
            now=self.clock(),
            kind="Normal",
            annotations={names.ANNOTATION_ATTESTATION: td.attestation or ""},
            on_node=True,
        )
        log.info("claim %s: gone before its attestation landed; recorded it in an Event: %s", td.claim, td.attestation)

    def remove_finalizer(self, td: Teardown) -> None:
        if not td.claim.name or not td.attestation:
            return
        for attempt in range(CONFLICT_RETRIES):
            # As in `write`: first the copy the attestation's write returned; a stale one fails the tests.
            claim = self._claims.pop(td.claim.uid, None) if attempt == 0 else None
            if claim is None:
                claim = self.cluster.get_claim(td.claim.namespace, td.claim.name)
            if claim is None or (claim.get("metadata") or {}).get("uid") != td.claim.uid:
                return  # gone after the attestation was published (on it, or in an Event on the node)
            annotations = (claim.get("metadata") or {}).get("annotations") or {}
            if annotations.get(names.ANNOTATION_ATTESTATION) != td.attestation:
                self.write(td, {names.ANNOTATION_ATTESTATION: td.attestation})
                continue
            problem = attestation_problem(td, claim, self.signer.public_keys)
            if problem is not None:
                # The devices are verified clean; only the claim object stays. Say why.
                log.error("claim %s: keeping finalizer %s: %s", td.claim, names.FINALIZER, problem)
                message = f"finalizer {names.FINALIZER} kept: {problem}"
                record_event(self.cluster, self.node, td, "AttestationMismatch", message, now=self.clock())
                return
            ops = finalizer_removal_ops(claim, td.attestation)
            if ops is None:
                self._claims[td.claim.uid] = claim  # for the hold's release, next
                return
            try:
                self._claims[td.claim.uid] = self.cluster.patch_claim(td.claim.namespace, td.claim.name, ops)
                return
            except NotFound:
                return
            except Conflict:
                continue
        raise Conflict(f"claim {td.claim} kept changing while the agent removed its finalizer; will retry", 409)


def record_event(
    cluster: ClusterClient,
    node: str,
    td: Teardown,
    reason: str,
    message: str,
    *,
    now: float,
    kind: str = "Warning",
    annotations: dict[str, str] | None = None,
    on_node: bool = False,
) -> None:
    """An Event about the teardown's claim, or about the Node when the claim has no name or `on_node`."""
    if td.claim.name and not on_node:
        namespace = td.claim.namespace
        involved = {
            "apiVersion": f"{names.RESOURCE_GROUP}/v1",
            "kind": "ResourceClaim",
            "namespace": td.claim.namespace,
            "name": td.claim.name,
            "uid": td.claim.uid,
        }
    else:
        namespace, involved = "default", {"apiVersion": "v1", "kind": "Node", "name": node}
    try:
        event = node_event(
            node=node,
            namespace=namespace,
            involved=involved,
            reason=reason,
            message=message,
            now=now,
            kind=kind,
            annotations=annotations,
        )
        cluster.create_event(namespace, event)
    except ClusterError as exc:
        log.warning("could not record %s event %s for claim %s: %s", kind, reason, td.claim, exc)


def attestation_problem(
    td: Teardown, claim: dict[str, Any], public_keys: Mapping[str, Ed25519PublicKey]
) -> AttestationError | None:
    """Why the teardown's attestation does not let the claim go (None when it does). Devices of other
    drivers in the claim (a NIC, say) are not the agent's to scrub or attest."""
    drivers = {d.driver for d in td.devices}
    try:
        required = {key for key in claimed_devices(claim) if key[0] in drivers}
        check_claim_attestation(td.attestation or "", claim, public_keys, required)
    except AttestationError as exc:
        return exc
    return None


def _devices_annotation(td: Teardown) -> str:
    return devices_annotation(((d.driver, d.pool, d.device), d.uuid) for d in td.devices)


def _outlives_the_write(claim: dict[str, Any]) -> bool:
    """Whether the claim stays after a write that removes our finalizer: it is not being deleted, or another
    finalizer holds it (Kubernetes' delete-protection, until the deallocation). One that would vanish with the
    write would take the attestation with it, unseen: its finalizer goes in a write of its own, after."""
    meta = claim.get("metadata") or {}
    return not meta.get("deletionTimestamp") or any(f != names.FINALIZER for f in meta.get("finalizers") or [])
