"""The agent's attestation key, and the attestation it signs for a teardown verified clean."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from scrubgate.policies.attestation import build_payload, load_private_key, sign

from .checkpoint import Teardown


class Signer:
    """The agent's Ed25519 attestation key (mounted from a Secret) and its key id."""

    def __init__(self, key: Ed25519PrivateKey, kid: str) -> None:
        self.key = key
        self.kid = kid

    @classmethod
    def from_file(cls, path: Path | str, kid: str) -> Signer:
        try:
            pem = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the attestation signing key {path}: {exc}") from exc
        return cls(load_private_key(pem), kid)

    @property
    def public_keys(self) -> dict[str, Ed25519PublicKey]:
        return {self.kid: self.key.public_key()}

    def sign(self, payload: dict[str, Any]) -> str:
        return sign(payload, self.key, self.kid)


def attestation_payload(td: Teardown, node: str) -> dict[str, Any]:
    """What the attestation of a verified teardown on `node` says: the claim, each device's scrub, the devices'
    health, the pods it was for, and the allocation (the hold) it ends."""
    return build_payload(
        namespace=td.claim.namespace,
        name=td.claim.name,
        uid=td.claim.uid,
        node=node,
        devices=[
            {
                "driver": d.driver,
                "pool": d.pool,
                "device": d.device,
                "uuid": d.uuid,
                "bytesScrubbed": d.scrub.bytes_scrubbed if d.scrub else 0,
                "bytesTotal": d.scrub.bytes_total if d.scrub else 0,
                # Coverage, stated: what the driver reserves, and what the scrub could not reach.
                "bytesReserved": d.scrub.bytes_reserved if d.scrub else 0,
                "bytesUnreachable": d.scrub.bytes_unreachable if d.scrub else 0,
                "method": d.scrub.method if d.scrub else "",
                "verified": bool(d.scrub and d.scrub.verified),
                # Beyond the scrub's reach: the driver zeroing freed memory, and ECC (null: not readable).
                "scrubOnFree": d.scrub.scrub_on_free if d.scrub else None,
                "eccEnabled": d.scrub.ecc_enabled if d.scrub else None,
            }
            for d in td.devices
        ],
        started_at=_when(td.scrub_started_at),
        finished_at=_when(td.scrub_finished_at),
        health=td.health or {},
        consumers=td.consumers,
        allocation={"reservation": td.hold, "allocatedAt": td.allocated_stamp},
    )


def _when(ts: float | None) -> datetime:
    return datetime.fromtimestamp(ts or 0.0, UTC)
