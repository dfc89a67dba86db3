"""Defaults shared by the CLI and the server, in a module light enough for `scrubgate check`'s startup."""

from typing import Final

PORT: Final = 8443
HOST: Final = "0.0.0.0"
AUDIT_MAX_BYTES: Final = 16 * 1024 * 1024
AUDIT_BACKUPS: Final = 10
# Same bound as controller-runtime: an object may be up to ~3 MiB and an UPDATE carries two.
MAX_BODY_BYTES: Final = 7 * 1024 * 1024
# Bodies above this size are decoded and evaluated on a small thread pool, off the event loop, so that a
# flood of heavy requests (a 2 MB pod with 25,000 tolerations) does not hold up small ones.
HEAVY_BODY_BYTES: Final = 64 * 1024
HEAVY_WORKERS: Final = 1
# What one answer and one audit record carry of a request's findings: the first ones, and the count of the rest.
MAX_FINDINGS_SHOWN: Final = 20
# An identical refusal of the same object for the same user (the resourceclaim controller retrying a deallocation
# that awaits its attestation) is recorded once in this window, and counted every time.
REPEAT_WINDOW_S: Final = 3600.0
REPEAT_KEYS: Final = 8192
