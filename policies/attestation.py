"""Scrub attestations: the compact JWS the agent signs and the webhook verifies (DESIGN.md, "Attestation").

Ed25519 (`alg: EdDSA`, RFC 8037) through `cryptography`; no JOSE library because the format is fixed
and small, and a general JOSE library would accept algorithms we must refuse.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Collection, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .model import as_dict, as_list, as_str
from .names import ANNOTATION_DEVICES, ATTESTATION_TYPE, ENDED_POD_RESOURCE, RESERVATION_GROUP, RESERVATION_RESOURCE

PAYLOAD_VERSION = 1


class AttestationError(ValueError):
    """The attestation cannot be trusted for this claim; the message says why."""


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise AttestationError("attestation is not base64url") from exc


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def build_payload(
    *,
    namespace: str,
    name: str,
    uid: str,
    node: str,
    devices: Iterable[Mapping[str, Any]],
    started_at: datetime,
    finished_at: datetime,
    health: Mapping[str, Any],
    consumers: Iterable[tuple[str, str]] = (),
    allocation: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """The payload of DESIGN.md; `devices` are dicts with driver, pool, device, uuid, bytesScrubbed,
    bytesTotal, method and verified. `consumers` are the (name, UID) of the pods the claim was reserved for
    when it was released: the scrub is for what they left, not for a later pod on the same claim. `allocation`
    binds it to the allocation it attests (`allocation_identity`): a claim allocated again later is not covered."""
    return {
        "v": PAYLOAD_VERSION,
        "claim": {"namespace": namespace, "name": name, "uid": uid},
        "node": node,
        "devices": [dict(d) for d in devices],
        "consumers": [{"name": name, "uid": uid} for name, uid in consumers],
        "allocation": dict(allocation or {"reservation": None, "allocatedAt": None}),
        "startedAt": rfc3339(started_at),
        "finishedAt": rfc3339(finished_at),
        "health": dict(health),
    }


def sign(payload: Mapping[str, Any], private_key: Ed25519PrivateKey, kid: str) -> str:
    header = {"alg": "EdDSA", "kid": kid, "typ": ATTESTATION_TYPE}
    signing_input = ".".join(
        _b64url(json.dumps(part, separators=(",", ":"), sort_keys=True).encode()) for part in (header, payload)
    )
    return f"{signing_input}.{_b64url(private_key.sign(signing_input.encode('ascii')))}"


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(
            "signing key is not an Ed25519 private key (generate one with `openssl genpkey -algorithm ed25519`)"
        )
    return key


def load_public_key(pem: str | bytes) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("attestation public key is not an Ed25519 key")
    return key


def public_key_pem(private_key: Ed25519PrivateKey) -> str:
    return (
        private_key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode("ascii")
    )


def verify(token: str, public_keys: Mapping[str, Ed25519PublicKey]) -> dict[str, Any]:
    """Checks the signature and the header; returns the payload."""
    parts = token.strip().split(".") if isinstance(token, str) else []
    if len(parts) != 3:
        raise AttestationError("attestation is not a compact JWS (header.payload.signature)")
    try:
        header = json.loads(_unb64url(parts[0]))
        payload = json.loads(_unb64url(parts[1]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AttestationError("attestation header or payload is not JSON") from exc
    if not isinstance(header, dict) or not isinstance(payload, dict):
        raise AttestationError("attestation header and payload must be JSON objects")
    if header.get("alg") != "EdDSA" or header.get("typ") != ATTESTATION_TYPE:
        raise AttestationError(f"attestation header must have alg EdDSA and typ {ATTESTATION_TYPE}")
    kid = header.get("kid")
    key = public_keys.get(kid) if isinstance(kid, str) else None
    if key is None:
        raise AttestationError(f"attestation key id {kid!r} is not among the policy's attestation keys")
    try:
        key.verify(_unb64url(parts[2]), f"{parts[0]}.{parts[1]}".encode("ascii"))
    except InvalidSignature as exc:
        raise AttestationError(f"attestation signature does not verify with key {kid!r}") from exc
    if payload.get("v") != PAYLOAD_VERSION:
        raise AttestationError(f"attestation payload version {payload.get('v')!r} is not {PAYLOAD_VERSION}")
    return payload


def device_key(device: Mapping[str, Any]) -> tuple[str, str, str]:
    return (str(device.get("driver", "")), str(device.get("pool", "")), str(device.get("device", "")))


def claimed_devices(claim: Mapping[str, Any], skip_requests: Collection[str] = ()) -> set[tuple[str, str, str]]:
    """The (driver, pool, device) triples this claim holds or held: the allocation in its status (but for
    results of `skip_requests`), and the agent's record in the `scrubgate.dev/devices` annotation (the
    allocation is gone after release). A field of the wrong type reads as absent; a devices annotation that
    cannot be read is an error."""
    found: set[tuple[str, str, str]] = set()
    for result in allocation_results(claim):
        # A result of a subrequest names it `request/subrequest`.
        if as_str(result.get("request")).split("/")[0] not in skip_requests:
            found.add(device_key(result))
    return found | recorded_devices(claim)


def allocation_results(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The entries of `status.allocation.devices.results` (each with request, driver, pool, device)."""
    allocation = as_dict(as_dict(claim.get("status")).get("allocation"))
    return [r for r in as_list(as_dict(allocation.get("devices")).get("results")) if isinstance(r, dict)]


def recorded_devices(claim: Mapping[str, Any]) -> set[tuple[str, str, str]]:
    """The devices on the agent's record (`scrubgate.dev/devices`); an annotation that cannot be read is an error."""
    found: set[tuple[str, str, str]] = set()
    recorded = as_dict(as_dict(claim.get("metadata")).get("annotations")).get(ANNOTATION_DEVICES)
    if recorded:
        if not isinstance(recorded, str):
            raise AttestationError(f"annotation {ANNOTATION_DEVICES} must be a JSON string")
        try:
            entries = json.loads(recorded)
        except json.JSONDecodeError as exc:
            raise AttestationError(f"annotation {ANNOTATION_DEVICES} is not JSON") from exc
        if not isinstance(entries, list):
            raise AttestationError(f"annotation {ANNOTATION_DEVICES} must be a JSON list")
        found.update(device_key(e) for e in entries if isinstance(e, dict))
    return found


def reserved_pods(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, UID) of the pods the claim is reserved for (`status.reservedFor`)."""
    found = []
    for entry in as_list(as_dict(claim.get("status")).get("reservedFor")):
        ref = as_dict(entry)
        name, uid = ref.get("name"), ref.get("uid")
        if ref.get("resource") == "pods" and not ref.get("apiGroup") and isinstance(name, str) and isinstance(uid, str):
            found.append((name, uid))
    return found


def reserved_consumers(claim: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(resource, name, UID) of every consumer in `status.reservedFor`: `pods` for a pod, `<resource>.<group>`
    for anything else (a 1.36 PodGroup: `podgroups.scheduling.k8s.io`). An entry without a UID keeps an empty one."""
    found = []
    for entry in as_list(as_dict(claim.get("status")).get("reservedFor")):
        ref = as_dict(entry)
        resource, group = as_str(ref.get("resource")), as_str(ref.get("apiGroup"))
        found.append((f"{resource}.{group}" if group else resource, as_str(ref.get("name")), as_str(ref.get("uid"))))
    return found


def claim_consumers(claim: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """`reserved_consumers` but for node agents' holds: what uses the claim's devices."""
    return [c for c in reserved_consumers(claim) if not is_agent_reservation(c[0])]


def agent_reservations(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(node, UID) of each node agent's hold on the claim: its `scrubgate.dev/nodeagents` consumer."""
    found = []
    for entry in as_list(as_dict(claim.get("status")).get("reservedFor")):
        ref = as_dict(entry)
        if ref.get("apiGroup") == RESERVATION_GROUP and ref.get("resource") == RESERVATION_RESOURCE:
            found.append((as_str(ref.get("name")), as_str(ref.get("uid"))))
    return found


def is_agent_reservation(resource: str) -> bool:
    """Whether a `reserved_consumers` resource is a node agent's hold."""
    return resource == f"{RESERVATION_RESOURCE}.{RESERVATION_GROUP}"


def is_ended_pod(resource: str) -> bool:
    """Whether a `reserved_consumers` resource is scrubgate's record of an ended pod (names.ENDED_POD_RESOURCE)."""
    return resource == f"{ENDED_POD_RESOURCE}.{RESERVATION_GROUP}"


def ended_pod_entry(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The `status.reservedFor` record of an ended pod, in place of the pod's own entry."""
    return {
        "apiGroup": RESERVATION_GROUP,
        "resource": ENDED_POD_RESOURCE,
        "name": pod.get("name"),
        "uid": pod.get("uid"),
    }


def is_ended_pod_record(entry: Mapping[str, Any]) -> bool:
    """Whether a `status.reservedFor` entry is scrubgate's record of an ended pod."""
    return entry.get("apiGroup") == RESERVATION_GROUP and entry.get("resource") == ENDED_POD_RESOURCE


def without_scrubgate(claim: Mapping[str, Any]) -> list[Any]:
    """The claim's `status.reservedFor` as it would stand without scrubgate (an uninstall): the holds out, and each
    ended pod's record the pod's own entry again, which the resourceclaim controller then drops as ended,
    deallocating the claim as it would have; on a claim being deleted, which takes no new entry, the records go
    too (the controller deallocates a claim being deleted that is reserved for nobody)."""
    deleting = bool(as_dict(claim.get("metadata")).get("deletionTimestamp"))
    return [
        {"resource": "pods", "name": entry.get("name"), "uid": entry.get("uid")}
        if is_ended_pod_record(entry)
        else entry
        for entry in map(as_dict, as_list(as_dict(claim.get("status")).get("reservedFor")))
        if not is_scrubgate_entry(entry) or (is_ended_pod_record(entry) and not deleting)
    ]


def is_scrubgate_entry(entry: Mapping[str, Any]) -> bool:
    """Whether a `status.reservedFor` entry is scrubgate's: a node agent's hold or an ended pod's record."""
    return entry.get("apiGroup") == RESERVATION_GROUP and entry.get("resource") in (
        RESERVATION_RESOURCE,
        ENDED_POD_RESOURCE,
    )


def allocation_identity(claim: Mapping[str, Any], node: str) -> dict[str, str | None]:
    """What ties an attestation to one allocation of the claim: the UID of the hold `node`'s agent put on it
    (one per allocation), and the allocation's `allocationTimestamp` where the scheduler wrote one (1.37 does,
    with its DRADeviceBindingConditions and DRAResourceClaimDeviceStatus gates on)."""
    allocation = as_dict(as_dict(claim.get("status")).get("allocation"))
    reservation = next((uid for holder, uid in agent_reservations(claim) if holder == node), None)
    return {"reservation": reservation, "allocatedAt": as_str(allocation.get("allocationTimestamp")) or None}


def deleted_before_allocation(claim: Mapping[str, Any]) -> bool:
    """A claim being deleted that holds no device and has no record of one: there is nothing to scrub, so its
    finalizer may go without an attestation (no agent would ever attest it). SG007 keeps a claim that held a
    device allocated until its attestation, so no device now means that none is owed."""
    if not as_dict(claim.get("metadata")).get("deletionTimestamp"):
        return False
    try:
        return not claimed_devices(claim)
    except AttestationError:
        return False


_FIGURES = ("bytesTotal", "bytesScrubbed", "bytesReserved", "bytesUnreachable")


def coverage_problem(
    device: Mapping[str, Any], max_unreachable_fraction: float, max_unreachable_bytes: int
) -> str | None:
    """Why an attested device's figures do not show a scrub of its memory (None when they do): a size, bytes
    scrubbed, every byte accounted for (scrubbed, reserved by the driver, or unreached), and no more unreached
    than the smaller of the two bounds."""
    # An attestation that states no reserve and nothing unreached must have scrubbed every byte.
    figures = {k: device.get(k, 0 if k in ("bytesReserved", "bytesUnreachable") else None) for k in _FIGURES}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in figures.values()):
        missing = ", ".join(k for k, v in figures.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0)
        return f"states no byte count for {missing}"
    total, scrubbed, reserved, unreachable = figures.values()
    if total <= 0 or scrubbed <= 0:
        return f"scrubbed {scrubbed} of {total} bytes"
    if scrubbed + reserved + unreachable < total:
        return f"accounts for {scrubbed + reserved + unreachable} of its {total} bytes"
    bound = min(int(max_unreachable_fraction * max(total - reserved, 0)), max_unreachable_bytes)
    if unreachable > bound:
        return f"left {unreachable} bytes unreached, more than the {bound} the policy allows"
    return None


def check_claim_attestation(
    token: str,
    claim: Mapping[str, Any],
    public_keys: Mapping[str, Ed25519PublicKey],
    required: set[tuple[str, str, str]] | None = None,
    coverage: tuple[float, int] | None = None,
) -> dict[str, Any]:
    """Verifies `token` for `claim`: signature, claim UID, and every device in `required` (default: the
    claim's own, see `claimed_devices`) verified clean; with `coverage` (the share and the bytes of a device's
    usable memory that may stay unreached), with figures that show it scrubbed. Returns the payload; raises
    AttestationError naming what does not hold."""
    payload = verify(token, public_keys)
    metadata = as_dict(claim.get("metadata"))
    attested_claim = as_dict(payload.get("claim"))
    if not metadata.get("uid") or attested_claim.get("uid") != metadata.get("uid"):
        raise AttestationError(
            f"attestation is for claim UID {attested_claim.get('uid')!r}, not this claim's {metadata.get('uid')!r}"
        )
    attested = payload.get("devices")
    if not isinstance(attested, list) or not attested:
        raise AttestationError("attestation lists no devices")
    clean = {device_key(d) for d in attested if isinstance(d, dict) and d.get("verified") is True}
    dirty = sorted("/".join(device_key(d)) for d in attested if isinstance(d, dict) and d.get("verified") is not True)
    if dirty:
        raise AttestationError(f"attestation shows devices not verified clean: {', '.join(dirty)}")
    required = claimed_devices(claim) if required is None else required
    missing = sorted("/".join(k) for k in required - clean)
    if missing:
        raise AttestationError(f"attestation does not cover the claim's devices: {', '.join(missing)}")
    if coverage is not None:
        thin = sorted(
            f"{'/'.join(device_key(d))} {problem}"
            for d in attested
            if device_key(d) in required and (problem := coverage_problem(d, *coverage))
        )
        if thin:
            raise AttestationError(f"attestation does not show a full scrub: {'; '.join(thin)}")
    # A pod that used the claim after the attested scrub (a named claim used again) left data it does not cover.
    attested_pods = {as_dict(c).get("uid") for c in as_list(payload.get("consumers"))}
    later = sorted(f"{name} ({uid})" for name, uid in reserved_pods(claim) if uid not in attested_pods)
    if later:
        raise AttestationError(f"attestation predates the claim's use by pod(s) {', '.join(later)}")
    # A claim shared through a PodGroup is used by pods the attestation cannot list: it must name the group.
    groups = sorted(
        f"{resource} {name} ({uid or 'no UID'})"
        for resource, name, uid in reserved_consumers(claim)
        if resource != "pods" and not is_agent_reservation(resource) and (not uid or uid not in attested_pods)
    )
    if groups:
        raise AttestationError(f"attestation does not cover the claim's use by {', '.join(groups)}")
    _check_allocation(payload, claim)
    return payload


def _check_allocation(payload: Mapping[str, Any], claim: Mapping[str, Any]) -> None:
    """The attestation is for the claim's allocation as it stands: the hold its node's agent has on it now (a hold
    is new with each allocation) and the scheduler's allocationTimestamp, where the claim has them."""
    if not as_dict(as_dict(claim.get("status")).get("allocation")):
        return
    attested = as_dict(payload.get("allocation"))
    current = allocation_identity(claim, as_str(payload.get("node")))
    if current["allocatedAt"] and attested.get("allocatedAt") != current["allocatedAt"]:
        raise AttestationError(
            f"attestation is for an allocation made at {attested.get('allocatedAt')!r}, not the claim's allocation "
            f"of {current['allocatedAt']}: the claim was allocated again since its scrub"
        )
    held = {uid for _, uid in agent_reservations(claim)}
    if held and attested.get("reservation") not in held:
        raise AttestationError(
            f"attestation is for the hold {attested.get('reservation')!r}, not the node agent's hold on the claim "
            f"now ({', '.join(sorted(held))}): the claim was allocated again since its scrub"
        )
