"""Fences: DeviceTaintRules that keep a device that may hold a tenant's data from the scheduler, where the
claim's own allocation cannot.

Normally nothing needs them: SG007 keeps a released GPU claim allocated until the agent's attestation lands,
and an allocated device goes to no other claim. kube-scheduler retries every pending DRA pod whenever a
DeviceTaintRule comes or goes (its ResourceSlice tracker reports each as a slice update), so a fence per
allocation would cost the whole cluster's scheduling; the agent fences only where the allocation cannot
hold (`checkpoint.FenceReason`). A fence is `scrubgate.dev/unsanitized:NoSchedule`, one rule per claim and
device (a device two claims share stays fenced until both are torn down); `scrubgate.dev/scrub-failed`
marks a failed teardown's own devices. Rule names derive from the claim UID and the device, so creating and
deleting are idempotent and a restarted agent finds its own rules again.

A fence also covers the devices whose memory overlaps the claim's (a MIG device's parent GPU, a GPU's MIG
devices; see `OverlapRecord`).

Where no DeviceTaintRule API is served the fence is a node taint: weaker, since it blocks the whole node,
and the agent says so loudly and counts it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from scrubgate.policies import names

from .checkpoint import OWED_STATES, FencedDevice, OverlapRecord, State, Teardown
from .kube import ClusterClient, Conflict
from .metrics import AgentMetrics

log = logging.getLogger(__name__)

CONFLICT_RETRIES = 5
# On a rule fencing a device for the memory it shares with the claim's: which of the claim's devices.
SHARES_MEMORY_ANNOTATION = "scrubgate.dev/shares-memory-with"


def rule_name(taint_key: str, claim_uid: str, device_key: str) -> str:
    digest = hashlib.sha256(f"{claim_uid}/{device_key}".encode()).hexdigest()[:20]
    return f"scrubgate-{taint_key.rpartition('/')[2]}-{digest}"


def label_value(text: str) -> str:
    """`text` squeezed into a label value (taint values must be one): 63 characters of [A-Za-z0-9-_.]."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)[:63]
    return cleaned.strip("-_.")


class Fencer:
    def __init__(
        self,
        cluster: ClusterClient,
        node: str,
        rule_version: str | None,
        metrics: AgentMetrics,
        each: Callable[[Callable[[Any], object], Iterable[Any]], object] | None = None,
    ) -> None:
        """`each(call, items)` makes the API call for every fenced device; by default one after the other (the
        agent's lanes pass one that makes them side by side)."""
        self.cluster = cluster
        self._each = each or _one_after_the_other
        self.node = node
        self.rule_version = rule_version
        self.metrics = metrics
        # Weak mode: whether the node taint may go is decided from the other teardowns' states; teardowns
        # running side by side decide and taint one at a time, so that none lifts a taint another just needed.
        self._node_taint = threading.RLock()
        metrics.weak_fence.set(0 if rule_version else 1)
        if rule_version is None:
            log.error(
                "WEAK FENCE on node %s: the API server serves no DeviceTaintRule (resource.k8s.io v1, v1beta2 or "
                "v1alpha3). Where a device must be fenced (a failed scrub, a deallocation that bypassed the "
                "webhook, admin access, a shutdown with teardowns owed) the agent taints the whole node with %s "
                "instead, and cannot fence a device whose allocation is gone before it sees that. Enable the "
                "DRADeviceTaints feature (and DRADeviceTaintRules where needed) to get per-device fences.",
                node,
                names.TAINT_UNSANITIZED,
            )

    @property
    def weak(self) -> bool:
        return self.rule_version is None

    def _rule(self, td: Teardown, name: str, device: FencedDevice, taint_key: str, value: str) -> dict[str, Any]:
        annotations = {
            names.ANNOTATION_FENCE_NODE: self.node,
            names.ANNOTATION_FENCE_CLAIM: f"{td.claim.namespace}/{td.claim.name}",
        }
        if isinstance(device, OverlapRecord):
            annotations[SHARES_MEMORY_ANNOTATION] = ", ".join(device.shares_memory_with)
        return {
            "metadata": {
                "name": name,
                "labels": {"app.kubernetes.io/managed-by": "scrubgate-agent", "scrubgate.dev/claim-uid": td.claim.uid},
                "annotations": annotations,
            },
            "spec": {
                "deviceSelector": {"driver": device.driver, "pool": device.pool, "device": device.device},
                "taint": {"key": taint_key, "value": label_value(value), "effect": "NoSchedule"},
            },
        }

    def fence(self, td: Teardown) -> None:
        """Ensures the unsanitized fence of every device the teardown covers: a rule each, or the node taint."""
        if self.rule_version:
            self._each(
                lambda device: self.cluster.create_device_taint_rule(
                    self.rule_version, self._rule(td, device.fence_rule, device, names.TAINT_UNSANITIZED, td.claim.uid)
                ),
                td.fence_targets(),
            )
        else:
            with self._node_taint:
                self._ensure_node_taint(names.TAINT_UNSANITIZED)

    def mark_failed(self, td: Teardown, reason: str) -> None:
        """Adds the scrub-failed taint next to the unsanitized one (which stays)."""
        self.fence(td)
        if self.rule_version:
            for device in td.devices:
                body = self._rule(td, device.failed_rule, device, names.TAINT_SCRUB_FAILED, reason)
                self.cluster.create_device_taint_rule(self.rule_version, body)
        else:
            with self._node_taint:
                self._ensure_node_taint(names.TAINT_SCRUB_FAILED)

    def lift(self, td: Teardown, others: Iterable[Teardown]) -> None:
        """Deletes this teardown's fences, and only those: call it only after a verified scrub.
        In weak mode the node taints go only when no other teardown still needs them."""
        if self.rule_version:
            if td.attempts:  # it failed at some point: scrub-failed rules may exist
                for device in td.devices:
                    self.cluster.delete_device_taint_rule(self.rule_version, device.failed_rule)
            self._each(
                lambda fenced: self.cluster.delete_device_taint_rule(self.rule_version, fenced.fence_rule),
                td.fence_targets(),
            )
            return
        with self._node_taint:
            others = [o for o in others if o.claim.uid != td.claim.uid]
            if not any(o.state == State.FAILED for o in others):
                self._remove_node_taint(names.TAINT_SCRUB_FAILED)
            if not any(o.fenced and o.state in OWED_STATES for o in others):
                self._remove_node_taint(names.TAINT_UNSANITIZED)

    # ---------------------------------------------------------------- node taint (weak fence)

    def _ensure_node_taint(self, key: str) -> None:
        for _ in range(CONFLICT_RETRIES):
            node = self.cluster.get_node(self.node)
            meta, spec = node.get("metadata") or {}, node.get("spec") or {}
            taints = spec.get("taints") if isinstance(spec.get("taints"), list) else None
            if any(isinstance(t, dict) and t.get("key") == key for t in taints or []):
                return
            taint = {"key": key, "effect": "NoSchedule"}
            ops: list[dict[str, Any]] = [
                {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")}
            ]
            ops.append(
                {"op": "add", "path": "/spec/taints/-", "value": taint}
                if taints is not None
                else {"op": "add", "path": "/spec/taints", "value": [taint]}
            )
            try:
                self.cluster.patch_node(self.node, ops)
            except Conflict:
                continue
            self.metrics.node_taint_fences.inc()
            log.warning("WEAK FENCE: tainted node %s with %s:NoSchedule (no DeviceTaintRule API)", self.node, key)
            return
        raise Conflict(f"node {self.node} kept changing while adding taint {key}; will retry", 409)

    def _remove_node_taint(self, key: str) -> None:
        for _ in range(CONFLICT_RETRIES):
            node = self.cluster.get_node(self.node)
            meta, spec = node.get("metadata") or {}, node.get("spec") or {}
            taints = spec.get("taints") if isinstance(spec.get("taints"), list) else []
            kept = [t for t in taints if not (isinstance(t, dict) and t.get("key") == key)]
            if len(kept) == len(taints):
                return
            ops = [
                {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
                {"op": "replace", "path": "/spec/taints", "value": kept},
            ]
            try:
                self.cluster.patch_node(self.node, ops)
            except Conflict:
                continue
            log.info("removed taint %s from node %s", key, self.node)
            return
        raise Conflict(f"node {self.node} kept changing while removing taint {key}; will retry", 409)


def _one_after_the_other(call: Callable[[Any], object], items: Iterable[Any]) -> None:
    for item in items:
        call(item)
