"""A GPU claim of the agent's node that the webhook left without `scrubgate.dev/sanitize`: the agent adds that
finalizer at first sight, and with it the node label (`scrubgate.dev/node`, which otherwise goes with the agent's
first annotation write: claim_writes.py). A claim lacks the finalizer when it was created while the webhook was
down under `failurePolicy: Ignore`, or before scrubgate was installed. Without the finalizer the claim, and with
it the attestation, may be gone before the scrub; so the agent, which knows from the ResourceSlice that the device
is a GPU, adds it and tells the operator what to fix."""

from __future__ import annotations

import logging
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.model import device_requests

from .claims import finalizer_addition_ops, node_event, own_node_label_ops
from .kube import ClusterClient, ClusterError, Conflict

log = logging.getLogger(__name__)

REASON = "MissingScrubFinalizer"


def _classes(claim: dict[str, Any]) -> list[str]:
    return sorted({c for request in device_requests(claim) for c in request.device_classes()})


def _ops(claim: dict[str, Any], node: str) -> list[dict[str, Any]] | None:
    finalizer = finalizer_addition_ops(claim)
    return None if finalizer is None else [*finalizer, *(own_node_label_ops(claim, node) or [])]


def add_missing_finalizer(
    cluster: ClusterClient, node: str, claim: dict[str, Any], devices: list[str], now: float
) -> None:
    """Adds the finalizer to `claim`, which holds the GPUs `devices` of this node, where it has none, in one write
    with the node label, and a Warning Event on it. A failed write is retried at the next look at the claim."""
    meta = claim.get("metadata") or {}
    namespace, name = meta.get("namespace") or "", meta.get("name") or ""
    ops = _ops(claim, node)
    if ops is None:
        return
    try:
        try:
            claim = cluster.patch_claim(namespace, name, ops)
        except Conflict:  # our own annotation write since the read, most often: read it again, once
            fresh = cluster.get_claim(namespace, name)
            if fresh is None or (fresh.get("metadata") or {}).get("uid") != meta.get("uid"):
                return
            ops = _ops(fresh, node)
            if ops is None:
                return
            claim = cluster.patch_claim(namespace, name, ops)
    except ClusterError as exc:
        log.warning(
            "claim %s/%s holds GPU %s of node %s but has no %s finalizer; adding it failed (retried at the next "
            "look): %s",
            namespace,
            name,
            ", ".join(devices),
            node,
            names.FINALIZER,
            exc,
        )
        return
    classes = ", ".join(_classes(claim)) or "(none named)"
    message = (
        f"claim {namespace}/{name} holds GPU {', '.join(devices)} but had no {names.FINALIZER} finalizer; the scrubgate "
        f"agent on {node} added it. The webhook did not see the claim's creation: check that it was reachable then "
        "(failurePolicy Ignore lets a claim through while it is down) and that the claim was not created before "
        f"scrubgate was installed; its device class(es) {classes} must not be in the policy's excludeDeviceClasses, "
        "which is for classes that hand out no GPU."
    )
    log.warning("%s", message)
    involved = {
        "apiVersion": f"{names.RESOURCE_GROUP}/v1",
        "kind": "ResourceClaim",
        "namespace": namespace,
        "name": name,
        "uid": meta.get("uid") or "",
    }
    try:
        cluster.create_event(
            namespace,
            node_event(node=node, namespace=namespace, involved=involved, reason=REASON, message=message, now=now),
        )
    except ClusterError as exc:
        log.warning("could not record Warning event %s for claim %s/%s: %s", REASON, namespace, name, exc)
