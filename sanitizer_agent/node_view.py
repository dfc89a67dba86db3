"""What the agent knows of its node between reads of the API: which consumers have ended, which pods run, which
claims it has released, and each of its node's claims as a list, a watch event or a read last showed it. What
watches (intake.py) writes it, what decides releases (release.py) reads it; the lanes change it too, hence the
lock."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from scrubgate.policies.model import metadata
from scrubgate.policies.node_label import node_label

Claim = dict[str, Any]


@dataclass
class NodeView:
    # consumer UID -> when seen ended (a pod terminal or deleted, another consumer such as a PodGroup deleted)
    ended: dict[str, float] = field(default_factory=dict)
    live_pods: set[str] = field(default_factory=set)  # UIDs of this node's running pods, as of the last list and watch
    # Claim UID -> (pod UIDs it was released by, when): a released claim stays allocated until the resourceclaim
    # controller deallocates it after the attestation; a pod event meanwhile must not start it again.
    released: dict[str, tuple[frozenset[str], float]] = field(default_factory=dict)
    ends_looked_at: dict[str, set[str]] = field(default_factory=dict)  # ended pod uid -> its claims looked at since
    # Claim UID -> the claim as this node's last list, watch event or read by name showed it (from the watch cache:
    # what prompts a look, never what a decision rests on)
    seen: dict[str, Claim] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def end(self, uid: str, at: float) -> None:
        with self.lock:
            self.ended[uid] = at

    def release(self, claim_uid: str, consumers: frozenset[str], at: float) -> None:
        with self.lock:
            self.released[claim_uid] = (consumers, at)

    def released_for(self, claim_uid: str) -> frozenset[str] | None:
        """The consumers the claim was released for, if the agent released it."""
        with self.lock:
            found = self.released.get(claim_uid)
        return None if found is None else found[0]

    def first_look_at_end(self, pod_uid: str, claim_name: str) -> bool:
        with self.lock:
            looked = self.ends_looked_at.setdefault(pod_uid, set())
            first = claim_name not in looked
            looked.add(claim_name)
        return first

    def look_again_at_end(self, pod_uid: str, claim_name: str) -> None:
        """At the pod's next event."""
        with self.lock:
            self.ends_looked_at.get(pod_uid, set()).discard(claim_name)

    def remember(self, claim: Claim) -> None:
        uid = (claim.get("metadata") or {}).get("uid")
        if isinstance(uid, str) and uid:
            with self.lock:
                self.seen[uid] = claim

    def forget(self, claim_uid: str) -> None:
        with self.lock:
            self.seen.pop(claim_uid, None)

    def listed(self, claims: list[Claim], node: str, tracked: set[str]) -> None:
        """A full list of this node's claims, those labelled with it: what it holds is all there is of them, as of
        the list. A claim the agent tracks (`tracked`) but has not labelled yet (the label goes with its first
        annotation write) is not in it: kept as last seen, so that the next look needs no read of it."""
        with self.lock:
            kept = {uid: c for uid, c in self.seen.items() if uid in tracked and node_label(metadata(c)) != node}
            self.seen = kept | {uid: c for c in claims if (uid := (c.get("metadata") or {}).get("uid"))}

    def prune(self, cutoff: float) -> None:
        """Forgets ends and releases older than `cutoff`."""
        with self.lock:
            self.ended = {uid: at for uid, at in self.ended.items() if at >= cutoff}
            self.ends_looked_at = {uid: n for uid, n in self.ends_looked_at.items() if uid in self.ended}
            self.released = {uid: r for uid, r in self.released.items() if r[1] >= cutoff}
