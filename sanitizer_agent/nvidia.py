"""What NVIDIA's DRA kubelet plugin (k8s-dra-driver-gpu) says is prepared on this node.

Its checkpoint (`/var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json`) holds one entry per claim
the driver prepared and has not unprepared yet: `{"checksum": ..., "v1"|"v2"|"v3": {"preparedClaims":
{<claim UID>: {"checkpointState", "status": <ResourceClaimStatus>, "preparedDevices": [...], "name",
"namespace"}}}}`, where prepared devices carry `{"gpu": {"info": {"uuid"}, "device": {"poolName",
"deviceName"}}}` or `{"mig": {"concrete": {"migUUID", "parentUUID"}, "device": {...}}}`.

The format is the driver's private business and changes between releases, so it is read defensively:
anything recognisable counts as "used", nothing unrecognisable is an error that stops the agent, and a
claim is never dropped because one of its fields looks odd.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .claims import DeviceKey, allocated_devices

log = logging.getLogger(__name__)

DEFAULT_PATH = Path("/var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json")
DRIVER = "gpu.nvidia.com"


@dataclass
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    # (driver, pool, device) -> GPU/MIG UUID where the checkpoint says
    devices: dict[DeviceKey, str | None] = field(default_factory=dict)
    # UUIDs seen that could not be tied to a (pool, device)
    loose_uuids: set[str] = field(default_factory=set)


def read_prepared_claims(path: Path) -> list[PreparedClaim]:
    """Claims the driver's checkpoint shows as prepared; [] when the file is absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        log.warning("cannot read NVIDIA's DRA checkpoint %s (%s); relying on the cluster and our checkpoint", path, exc)
        return []
    return parse_prepared_claims(data)


def parse_prepared_claims(data: Any) -> list[PreparedClaim]:
    if not isinstance(data, dict):
        return []
    # Newest version first; the driver writes all of them with the same content.
    for version in ("v3", "v2", "v1"):
        body = data.get(version)
        if isinstance(body, dict) and isinstance(body.get("preparedClaims"), dict):
            return [_claim(uid, entry) for uid, entry in body["preparedClaims"].items() if isinstance(uid, str)]
    return []


def _claim(uid: str, entry: Any) -> PreparedClaim:
    entry = entry if isinstance(entry, dict) else {}
    claim = PreparedClaim(uid=uid, namespace=_str(entry.get("namespace")), name=_str(entry.get("name")))
    status = entry.get("status")
    if isinstance(status, dict):
        for key in allocated_devices({"status": status}):
            claim.devices[key] = None
    _walk(entry.get("preparedDevices"), claim)
    claim.loose_uuids -= {u for u in claim.devices.values() if u}
    return claim


def _walk(node: Any, claim: PreparedClaim) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item, claim)
        return
    if not isinstance(node, dict):
        return
    device = node.get("device")
    uuid = _uuid_of(node)
    if isinstance(device, dict) and device.get("poolName") and device.get("deviceName"):
        pool, name = _str(device["poolName"]), _str(device["deviceName"])
        known = next((k for k in claim.devices if k[1:] == (pool, name)), (DRIVER, pool, name))
        claim.devices[known] = uuid or claim.devices.get(known)
        return
    if uuid:
        claim.loose_uuids.add(uuid)
    for value in node.values():
        _walk(value, claim)


def _uuid_of(node: dict[str, Any]) -> str | None:
    for holder, key in (("info", "uuid"), ("concrete", "migUUID"), (None, "uuid"), (None, "migUUID")):
        source = node.get(holder) if holder else node
        value = source.get(key) if isinstance(source, dict) else None
        if isinstance(value, str) and value:
            return value
    return None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""
