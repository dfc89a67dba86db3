"""Defaults shared by the CLI and the server, in a module light enough for `scrubgate check`'s startup."""

from typing import Final

PORT: Final = 8443
HOST: Final = "0.0.0.0"
AUDIT_MAX_BYTES: Final = 16 * 1024 * 1024
AUDIT_BACKUPS: Final = 10
# Seconds between signed checkpoints of the audit chain head: what a truncation can hide at most.
AUDIT_CHECKPOINT_INTERVAL: Final = 60.0
# Same bound as controller-runtime: an object may be up to ~3 MiB and an UPDATE carries two.
MAX_BODY_BYTES: Final = 7 * 1024 * 1024
# Bodies above this size are decoded and evaluated on one worker thread, off the event loop, so that a flood of
# heavy requests (a 2 MB pod with 25,000 tolerations) does not hold up small ones; tenants (a namespace, whoever
# in it sends) take turns there (fairlane.py), so that one tenant's flood does not hold up another's large objects.
HEAVY_BODY_BYTES: Final = 64 * 1024
# What one answer and one audit record carry of a request's findings: the first ones, and the count of the rest.
MAX_FINDINGS_SHOWN: Final = 20
# An identical refusal of the same object for the same user (the resourceclaim controller retrying a deallocation
# that awaits its attestation), or a dry run refused by the same rules for the same user, kind and namespace
# (repeats.py), is recorded once in this window, and counted every time.
REPEAT_WINDOW_S: Final = 3600.0
REPEAT_KEYS: Final = 8192
# A request must arrive in full this long after its connection opens or the last answer: a slow body, or a
# connection that sends nothing (no client certificate needed to open one), would otherwise hold its memory
# and its slot forever. The API server sends a whole review at once.
REQUEST_READ_TIMEOUT_S: Final = 10.0
# Connections and requests in flight at once; beyond, new requests get a 503 (the API server retries within its
# webhook timeout) rather than the replica running out of memory.
MAX_CONNECTIONS: Final = 1000
