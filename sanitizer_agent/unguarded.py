"""The agent's first write of a GPU claim of its node: the node label (`scrubgate.dev/node`), by which the agent
lists and watches its own claims (claims cannot be field-selected by node), and, where the webhook left it without
`scrubgate.dev/sanitize`, that finalizer. A claim lacks the finalizer when its device class is not among the
policy's `gpuDeviceClasses` (a class per GPU model, say), or it was created while the webhook was down under
`failurePolicy: Ignore`. Without the finalizer the claim, and with it the attestation, may be gone before the
scrub; so the agent, which knows from the ResourceSlice that the device is a GPU, adds it and tells the
operator what to fix."""

from __future__ import annotations

import logging
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.model import device_requests

from .claims import finalizer_addition_ops, node_event, node_label_ops
from .kube import ClusterClient, ClusterError, Conflict

log = logging.getLogger(__name__)

REASON = "MissingScrubFinalizer"


def _classes(claim: dict[str, Any]) -> list[str]:
    return sorted({c for request in device_requests(claim) for c in request.device_classes()})


def _ops(claim: dict[str, Any], node: str) -> list[dict[str, Any]] | None:
    finalizer, label = finalizer_addition_ops(claim), node_label_ops(claim, node)
    return None if finalizer is None and label is None else [*(finalizer or []), *(label or [])]


def mark_claim(cluster: ClusterClient, node: str, claim: dict[str, Any], devices: list[str], now: float) -> bool:
    """Labels `claim`, which holds the GPUs `devices` of this node, with the node, and adds the finalizer where it
    has none, with a Warning Event on it; returns whether the finalizer was added. False too when the write
    failed (the next look at the claim retries)."""
    meta = claim.get("metadata") or {}
    namespace, name = meta.get("namespace") or "", meta.get("name") or ""
    ops = _ops(claim, node)
    if ops is None:
        return False
    missing = finalizer_addition_ops(claim) is not None
    try:
        try:
            claim = cluster.patch_claim(namespace, name, ops)
        except Conflict:  # our own annotation write since the read, most often: read it again, once
            fresh = cluster.get_claim(namespace, name)
            if fresh is None or (fresh.get("metadata") or {}).get("uid") != meta.get("uid"):
                return False
            ops = _ops(fresh, node)
            if ops is None:
                return False
            missing = finalizer_addition_ops(fresh) is not None
            claim = cluster.patch_claim(namespace, name, ops)
    except ClusterError as exc:
        log.warning(
            "claim %s/%s holds GPU %s of node %s; labelling it %s=%s%s failed (retried at the next look): %s",
            namespace,
            name,
            ", ".join(devices),
            node,
            names.LABEL_NODE,
            node,
            f" and adding {names.FINALIZER}" if missing else "",
            exc,
        )
        return False
    if not missing:
        return False
    classes = ", ".join(_classes(claim)) or "(none named)"
    message = (
        f"claim {namespace}/{name} holds GPU {', '.join(devices)} but had no {names.FINALIZER} finalizer; the scrubgate "
        f"agent on {node} added it. Its device class(es) {classes}: add them to gpuDeviceClasses in the scrubgate "
        "policy; where they are there already, the webhook configurations' claim-requests-a-gpu-class condition "
        "does not match them (with the kustomize base, add them to it in manifests/webhook-settings.yaml and "
        "webhook-configurations.yaml; the chart writes it from the policy); else check that the scrubgate webhook "
        "was reachable when the claim was created."
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
    return True
