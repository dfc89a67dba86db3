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
