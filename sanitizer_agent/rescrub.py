"""Operator requests for another teardown attempt (`scrubgate agent rescrub --device ...`).

The running agent is the checkpoint's only writer, so the CLI does not touch the checkpoint: it drops a
request file into a directory next to it (`<checkpoint>.rescrub/`, on the same hostPath). The agent takes
the requests at every tick (and at start, so a request made while it was down is not lost), moves each
matching failed teardown back to `draining`, and deletes the request.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from .checkpoint import State, Teardown, write_atomic

log = logging.getLogger(__name__)


def request_dir(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".rescrub")


def submit(checkpoint: Path, device: str) -> Path:
    """Files a request for `device` (a GPU/MIG UUID or driver/pool/device); returns the request file."""
    path = request_dir(checkpoint) / f"{hashlib.sha256(device.encode()).hexdigest()[:16]}.json"
    write_atomic(path, json.dumps({"device": device}).encode())
    return path


def pending(directory: Path) -> list[tuple[Path, str | None]]:
    """(file, device) for each request; device None for an unreadable file (the caller discards it)."""
    try:
        files = sorted(p for p in directory.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except FileNotFoundError:
        return []
    found = []
    for path in files:
        try:
            device = json.loads(path.read_text()).get("device")
        except (OSError, json.JSONDecodeError, AttributeError):
            device = None
        found.append((path, device if isinstance(device, str) and device else None))
    return found


def matches(td: Teardown, device: str) -> bool:
    return any(device in (d.uuid, d.key) for d in td.devices)


def take(directory: Path, teardowns: Iterable[Teardown], node: str, again: Callable[[Teardown], None]) -> None:
    """Each pending request: `again` for every failed teardown holding its device; then the request goes."""
    failed = [td for td in teardowns if td.state == State.FAILED]
    for path, device in pending(directory):
        matched = [td for td in failed if device and matches(td, device)]
        if not matched:
            log.warning("rescrub request %s (%s) matches no failed device on node %s; discarded", path, device, node)
        for td in matched:
            again(td)
        path.unlink(missing_ok=True)
