"""What NVIDIA's DRA kubelet plugin (k8s-dra-driver-gpu) says is prepared on this node.

Its checkpoint (`/var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json`) holds one entry per claim
the driver prepared and has not unprepared yet, in up to three versions written side by side:
`{"checksum": <v1's>, "v1": {...}, "v2": {"checksum", "preparedClaims": {<claim UID>: {"checkpointState",
"status": <ResourceClaimStatus>, "preparedDevices": [{"devices": [...], "configState"}], "name",
"namespace"}}}, "v3": {...}}`. A prepared device is `{"gpu": {"info": {"uuid"}, "device": {...}}}` or
`{"mig": {"concrete": {"migUUID", "parentUUID"}, "device": {...}}}`; in v1 and v2 `device` is the Go type
without JSON tags (`PoolName`, `DeviceName`), in v3 it has tags (`poolName`, `deviceName`).

Checksums (kubelet's checkpointmanager): FNV-32a over Go's `%#v` rendering of the JSON bytes of the
version with its checksum set to 0; v1's sits at the top level and covers `{"checksum":0,"v1":...}`.
The newest version is read when every checksum holds; otherwise (a torn or hand-edited file) every
version is read and merged, and the agent says so: more fencing, never less.

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
VERSIONS = ("v3", "v2", "v1")  # newest first


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
        raw = path.read_bytes()
        data = json.loads(raw)
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        log.warning("cannot read NVIDIA's DRA checkpoint %s (%s); relying on the cluster and our checkpoint", path, exc)
        return []
    return parse_prepared_claims(data, raw, source=str(path))


def parse_prepared_claims(data: Any, raw: bytes | None = None, source: str = "checkpoint") -> list[PreparedClaim]:
    """The claims of the newest version when every version's checksum holds (`raw`: the file's bytes); all
    versions merged when one does not, or `raw` is not given."""
    if not isinstance(data, dict):
        return []
    present = [v for v in VERSIONS if isinstance(data.get(v), dict) and isinstance(data[v].get("preparedClaims"), dict)]
    if raw is not None and present:
        broken = [v for v in present if not checksum_holds(raw, v)]
        if not broken:
            return _claims(data[present[0]]["preparedClaims"])
        log.warning(
            "NVIDIA's DRA checkpoint %s: the checksum of %s does not hold; reading every version, so that every "
            "device any of them names is fenced",
            source,
            ", ".join(broken),
        )
    merged: dict[str, PreparedClaim] = {}
    for version in present:
        for claim in _claims(data[version]["preparedClaims"]):
            known = merged.setdefault(claim.uid, claim)
            if known is not claim:
                for key, uuid in claim.devices.items():
                    known.devices[key] = known.devices.get(key) or uuid
                known.loose_uuids |= claim.loose_uuids
                known.namespace, known.name = known.namespace or claim.namespace, known.name or claim.name
    return list(merged.values())


def checksum_holds(raw: bytes, version: str) -> bool:
    """Whether `version`'s checksum in the file's bytes `raw` matches its content (see the module docstring)."""
    try:
        data = json.loads(raw)
        span = _member_span(raw, version)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return False
    if span is None:
        return False
    body = raw[span[0] : span[1]]
    if version == "v1":
        expected = data.get("checksum")
        hashed = b'{"checksum":0,"v1":' + body + b"}"
    else:
        expected = data[version].get("checksum") if isinstance(data[version], dict) else None
        prefix = b'{"checksum":'
        if not body.startswith(prefix):
            return False
        number_end = len(prefix) + len(str(expected).encode())
        hashed = prefix + b"0" + body[number_end:]
    return isinstance(expected, int) and expected == go_checksum(hashed)


def go_checksum(marshalled: bytes) -> int:
    """kubelet's checksum.New over JSON bytes: FNV-32a of spew's `%#v` of a []byte."""
    text = b"([]uint8)[" + b" ".join(str(b).encode() for b in marshalled) + b"]"
    value = 0x811C9DC5
    for byte in text:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def _member_span(raw: bytes, key: str) -> tuple[int, int] | None:
    """Byte span of the top-level member `key`'s value in the compact JSON object `raw` (Go writes no spaces)."""
    text = raw.decode()
    decoder = json.JSONDecoder()
    index = text.index("{") + 1
    while index < len(text):
        name, index = decoder.raw_decode(text, index)
        index = text.index(":", index) + 1
        start = index
        _value, index = decoder.raw_decode(text, index)
        if name == key:
            return len(text[:start].encode()), len(text[:index].encode())
        while index < len(text) and text[index] in " ,\n\t":
            index += 1
        if index < len(text) and text[index] == "}":
            break
    return None


def _claims(body: dict[str, Any]) -> list[PreparedClaim]:
    return [_claim(uid, entry) for uid, entry in body.items() if isinstance(uid, str)]


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
    pool, name = _device_ref(device)
    if pool and name:
        known = next((k for k in claim.devices if k[1:] == (pool, name)), (DRIVER, pool, name))
        claim.devices[known] = uuid or claim.devices.get(known)
        return
    if uuid:
        claim.loose_uuids.add(uuid)
    for value in node.values():
        _walk(value, claim)


def _device_ref(device: Any) -> tuple[str, str]:
    """(pool, device) of a prepared device: v3 writes JSON names, v1 and v2 Go's field names."""
    if not isinstance(device, dict):
        return "", ""
    return _str(device.get("poolName") or device.get("PoolName")), _str(
        device.get("deviceName") or device.get("DeviceName")
    )


def _uuid_of(node: dict[str, Any]) -> str | None:
    for holder, key in (("info", "uuid"), ("concrete", "migUUID"), (None, "uuid"), (None, "migUUID")):
        source = node.get(holder) if holder else node
        value = source.get(key) if isinstance(source, dict) else None
        if isinstance(value, str) and value:
            return value
    return None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""
