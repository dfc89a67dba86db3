"""Which refusals go into the audit log: the first of identical ones, not each retry.

The resourceclaim controller retries a refused deallocation (a status write) with backoff (5 ms doubling)
until the agent's attestation is on the claim: a dozen identical refusals per released claim, expected, and
nothing an auditor learns from beyond the first. A refused status write is a repeat when the same user made the
same request (apiVersion, kind, operation) on the same object (its UID) with the same findings, within the
window; a repeat is counted, not recorded, and the next record of that refusal says how many were left out.

So is a refused dry run (which changes nothing) when the same user was refused the same kind of write in the
same namespace by the same rules: what was refused, not how the message words it. The words are the
requester's to vary (a toleration key, an object name, how many tolerations), and keying on them let one
tenant's flood of dry runs, each a little different, roll the audit log over; the rule IDs are a handful.
Refusals of anything else are all recorded. The table is bounded: the oldest entries go first, after which
their refusal is recorded again (more records, never fewer).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from scrubgate.policies.findings import Finding

from .defaults import MAX_FINDINGS_SHOWN
from .review import AdmissionRequest


def refusal_key(request: AdmissionRequest, findings: Sequence[Finding]) -> bytes | None:
    """What makes two refusals of a status write, or two refused dry runs, the same, as a digest; None for any
    other request, which is always recorded: a person's attempts on the object itself are each worth a record."""
    meta = (request.old_object or {}).get("metadata") or {}
    uid = meta.get("uid")
    if request.dry_run:
        rules = sorted({finding.rule for finding in findings})
        key = ["dry-run", request.username, request.namespace, request.kind.get("group", ""), request.kind_name]
        key += [request.operation, request.sub_resource, rules]
    elif uid and request.sub_resource == "status":
        key = [uid, request.api_version, request.kind_name, request.operation, request.sub_resource]
        key += [request.username, request.groups]
        # The controller's retries are word for word the same; what a record shows of them is part of the key.
        key += [[(f.rule, f.action, f.path, f.message) for f in findings[:MAX_FINDINGS_SHOWN]], len(findings)]
    else:
        return None
    return hashlib.blake2b(repr(key).encode(), digest_size=16).digest()


class RepeatedRefusals:
    def __init__(self, window_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.max_keys, self.clock = window_s, max_keys, clock
        self._seen: OrderedDict[bytes, list[float]] = OrderedDict()  # key -> [recorded at, repeats since]

    def record(self, key: bytes | None) -> int | None:
        """None when this refusal is a repeat not to record; else how many repeats of it went unrecorded
        since its last record (0 for a first)."""
        if key is None:
            return 0
        now = self.clock()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return None
        left_out = int(entry[1]) if entry is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return left_out
