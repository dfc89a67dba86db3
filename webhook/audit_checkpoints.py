"""Tamper evidence for the audit log beyond its hash chain: the stdout stream and signed checkpoints.

The hash chain shows an edit in the middle of the file, but whoever can write the file can also cut its
tail or rewrite every record from some point on and recompute the chain. So the webhook also writes each
record, and every `interval` seconds (when the head moved, and at start and stop) a checkpoint of the
chain head signed with its own Ed25519 key, to stdout, one JSON object a line:

    {"scrubgateAudit": "record", "host": POD, "record": {...}}
    {"scrubgateAudit": "checkpoint", "host": POD, "checkpoint": {"v": 1, "host": POD, "file": ..., "seq": N,
                                                                 "head": "sha256:...", "time": ..., "kid": ..., "sig": ...}}

Stdout, not a Kubernetes object: the container runtime writes the stream to node files the pod cannot
reach and log collectors ship it off the node, so the file's writer cannot rewrite what went there; and
the webhook needs no API credentials for it (it has none: it answers the API server, it never calls it).
CloudTrail digest files and transparency logs' signed tree heads work the same way. `sig` is Ed25519 over
the canonical JSON of the checkpoint without `sig`; `kid` is the first 16 hex digits of the SHA-256 of
the raw public key. `host` is the pod name: each replica writes a chain of its own. The stream's copies
of the records can be verified like the file (`scrubgate audit verify --stream`), rotated-away ones included.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from scrubgate.policies.attestation import load_private_key, load_public_key, rfc3339

STREAM_KEY = "scrubgateAudit"
K = TypeVar("K")
CHECKPOINT_VERSION = 1


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in body.items() if k != "sig"}, sort_keys=True, separators=(",", ":")).encode(
        "ascii"
    )


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def stream_line(kind: str, body: Mapping[str, Any], host: str) -> str:
    return json.dumps({STREAM_KEY: kind, "host": host, kind: body}, sort_keys=True, separators=(",", ":")) + "\n"


def stream_entries(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, entry) of the stream's lines in `path`: the webhook's stdout as `kubectl logs` or a
    log collector gives it (other lines, and any prefix before the JSON object such as `--timestamps`,
    are skipped)."""
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        start = line.find("{")
        if start < 0 or STREAM_KEY not in line:
            continue
        try:
            entry = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get(STREAM_KEY), str):
            yield number, entry


def _load(path: Path, loader: Callable[[bytes], K], what: str) -> K:
    """A key from a PEM file; ValueError naming the file and what is wrong with it."""
    try:
        return loader(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{what} {path}: {exc} (an Ed25519 key in PEM is expected)") from None


class Checkpointer:
    """Signs chain heads with the webhook's own key (`--audit-signing-key`)."""

    def __init__(self, key: Ed25519PrivateKey, *, interval: float, host: str | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"audit checkpoint interval must be positive, got {interval}")
        self.key = key
        self.kid = key_id(key.public_key())
        self.interval = interval
        self.host = host or socket.gethostname()

    @classmethod
    def from_file(cls, path: Path, *, interval: float) -> Checkpointer:
        return cls(_load(path, load_private_key, "audit signing key"), interval=interval)

    def sign(self, file: Path, seq: int, head: str, now: datetime | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "v": CHECKPOINT_VERSION,
            "host": self.host,
            "file": str(file),
            "seq": seq,
            "head": head,
            "time": rfc3339(now or datetime.now(UTC)),
            "kid": self.kid,
        }
        signature = self.key.sign(_canonical(body))
        body["sig"] = base64.urlsafe_b64encode(signature).rstrip(b"=").decode("ascii")
        return body


# -- reading and checking --------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    where: str  # file:line it was read from
    host: str
    seq: int
    head: str
    time: str
    kid: str
    body: dict[str, Any]


def load_public_keys(paths: Iterable[Path]) -> dict[str, Ed25519PublicKey]:
    keys = [_load(path, load_public_key, "public key") for path in paths]
    return {key_id(key): key for key in keys}


def read_checkpoints(path: Path) -> list[Checkpoint]:
    """The checkpoints among the stream's lines in `path`."""
    found = []
    for number, entry in stream_entries(path):
        body = entry.get("checkpoint") if entry[STREAM_KEY] == "checkpoint" else None
        if not isinstance(body, dict):
            continue
        try:
            found.append(
                Checkpoint(
                    f"{path}:{number}",
                    str(body["host"]),
                    int(body["seq"]),
                    str(body["head"]),
                    str(body["time"]),
                    str(body["kid"]),
                    body,
                )
            )
        except (KeyError, TypeError, ValueError):
            found.append(Checkpoint(f"{path}:{number}", str(body.get("host", "")), -1, "", "", "", body))
    return found


def signature_problem(checkpoint: Checkpoint, keys: Mapping[str, Ed25519PublicKey]) -> str | None:
    """None when the checkpoint is signed by one of `keys`; otherwise what is wrong with it."""
    if checkpoint.seq < 0 or checkpoint.body.get("v") != CHECKPOINT_VERSION:
        return "not a checkpoint this version of scrubgate reads (fields missing or v is not 1)"
    key = keys.get(checkpoint.kid)
    if key is None:
        return f"signed with key id {checkpoint.kid!r}, which is not among the --public-key keys"
    try:
        signature = base64.urlsafe_b64decode(str(checkpoint.body.get("sig", "")) + "==")
        key.verify(signature, _canonical(checkpoint.body))
    except (InvalidSignature, binascii.Error, ValueError):
        return "the signature does not verify: the checkpoint was forged or altered"
    return None


@dataclass(frozen=True)
class Finding:
    kind: str  # rewritten, truncated, gap, unsigned (broken); rotated, matched
    where: str
    message: str

    @property
    def broken(self) -> bool:
        return self.kind in ("rewritten", "truncated", "gap", "unsigned")


def check(
    checkpoints: Iterable[Checkpoint],
    hashes: Mapping[int, str],
    keys: Mapping[str, Ed25519PublicKey],
) -> list[Finding]:
    """Each checkpoint against the records read from the files (`hashes`: seq -> hash, whether the
    chain between them holds or not: that is the chain check's to say)."""
    first_seq, last_seq = (min(hashes), max(hashes)) if hashes else (None, None)
    findings = []
    for cp in sorted(checkpoints, key=lambda c: c.seq):
        problem = signature_problem(cp, keys)
        if problem is not None:
            findings.append(Finding("unsigned", cp.where, problem))
            continue
        at = f"the checkpoint of {cp.time} (seq {cp.seq})"
        if cp.seq == 0:
            continue  # signed before the first record: it vouches for nothing
        if last_seq is None or cp.seq > last_seq:
            ends = "hold no records" if last_seq is None else f"end at seq {last_seq}"
            start = 1 if last_seq is None else last_seq + 1
            findings.append(
                Finding(
                    "truncated",
                    cp.where,
                    f"truncated: {at} was signed after seq {cp.seq}, but the files {ends}; records "
                    f"{start}..{cp.seq} at least are missing from the end (or a newer file was not given)",
                )
            )
        elif first_seq is not None and cp.seq < first_seq:
            findings.append(
                Finding(
                    "rotated",
                    cp.where,
                    f"lost to rotation: {at} is older than the first record in the files (seq {first_seq}); "
                    f"records up to seq {first_seq - 1} existed but are not in the files; their copies are in "
                    "the same stdout stream",
                )
            )
        elif cp.seq not in hashes:
            findings.append(Finding("gap", cp.where, f"gap: {at} vouches for seq {cp.seq}, which is not in the files"))
        elif hashes[cp.seq] != cp.head:
            findings.append(
                Finding(
                    "rewritten",
                    cp.where,
                    f"rewritten: seq {cp.seq} in the files has hash {hashes[cp.seq]}, but {at} signed "
                    f"{cp.head}; the chain was rewritten from seq {cp.seq} or earlier",
                )
            )
        else:
            findings.append(Finding("matched", cp.where, f"{at} matches"))
    return findings
