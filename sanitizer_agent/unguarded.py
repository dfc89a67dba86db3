"""A GPU claim the webhook left without `scrubgate.dev/sanitize`: its device class is not among the policy's
`gpuDeviceClasses` (a class per GPU model, say), or it was created while the webhook was down under
`failurePolicy: Ignore`. Without the finalizer the claim, and with it the attestation, may be gone before the
scrub; so the agent, which knows from the ResourceSlice that the device is a GPU, adds it and tells the
operator what to fix."""

from __future__ import annotations

import logging
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.model import device_requests

from .claims import finalizer_addition_ops, node_event
from .kube import ClusterClient, ClusterError, Conflict

log = logging.getLogger(__name__)

REASON = "MissingScrubFinalizer"


def _classes(claim: dict[str, Any]) -> list[str]:
    return sorted({c for request in device_requests(claim) for c in request.device_classes()})


def _add(cluster: ClusterClient, claim: dict[str, Any]) -> dict[str, Any]:
    ops = finalizer_addition_ops(claim)
    if ops is None:
        return claim
    meta = claim.get("metadata") or {}
    return cluster.patch_claim(meta.get("namespace") or "", meta.get("name") or "", ops)


def add_missing_finalizer(
    cluster: ClusterClient, node: str, claim: dict[str, Any], devices: list[str], now: float
) -> bool:
    """Adds the finalizer to `claim`, which holds the GPUs `devices` of this node, and records a Warning Event
    on it; False when it had one, is being deleted, or the write failed (the next look at the claim retries)."""
    meta = claim.get("metadata") or {}
    namespace, name = meta.get("namespace") or "", meta.get("name") or ""
    if finalizer_addition_ops(claim) is None:
        return False
    try:
        try:
            claim = _add(cluster, claim)
        except Conflict:  # our own annotation write since the read, most often: read it again, once
            fresh = cluster.get_claim(namespace, name)
            if (
                fresh is None
                or (fresh.get("metadata") or {}).get("uid") != meta.get("uid")
                or finalizer_addition_ops(fresh) is None
            ):
                return False
            claim = _add(cluster, fresh)
    except ClusterError as exc:
        log.warning(
            "claim %s/%s holds GPU %s but has no %s; adding it failed (retried at the next look): %s",
            namespace,
            name,
            ", ".join(devices),
            names.FINALIZER,
            exc,
        )
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
