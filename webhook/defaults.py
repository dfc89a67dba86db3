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
# connection that sends nothing, would otherwise hold its memory and its slot forever. The API server sends a
# whole review at once.
REQUEST_READ_TIMEOUT_S: Final = 10.0
# How long the API server's connection may stay open and unused after an answer. Longer than the API server keeps an
# unused webhook connection itself (client-go's transport: Go's http.DefaultTransport, IdleConnTimeout 90 s), so
# that it is the API server that closes one: closed here first, a review it sends on it at that moment gets EOF
# (a POST, which it does not retry) and the admission fails with "failed calling webhook".
KEEP_ALIVE_IDLE_S: Final = 120.0
# A TLS handshake must be done this long after the connection was accepted (a handshake takes milliseconds).
TLS_HANDSHAKE_TIMEOUT_S: Final = 5.0
# Connections of the API server (a client certificate of --client-ca with an allowed name; every caller without
# --client-ca) at once; beyond, their requests get a 503 rather than the replica running out of memory.
MAX_CONNECTIONS: Final = 1000
# Callers who cannot be told apart from an attacker yet, each in a budget of its own so that they never take the
# API server's: connections still in their TLS handshake, connections without an allowed client certificate
# (kubelet probes, `helm test`: they may read /healthz and /readyz), and connections to the metrics port. A full
# budget closes its oldest connection for a new one: a real client is done in milliseconds, so holding the budget
# takes a new connection every few milliseconds, not a slow trickle.
MAX_PENDING_HANDSHAKES: Final = 256
MAX_UNVERIFIED_CONNECTIONS: Final = 16
MAX_METRICS_CONNECTIONS: Final = 16
# The request line and headers of one request, at most (the API server sends a few hundred bytes).
MAX_HEADER_BYTES: Final = 64 * 1024
# Plain HTTP: /metrics, /healthz and /readyz; never on the admission port, so that scrapes need no TLS client
# certificate and take none of the API server's connections.
METRICS_PORT: Final = 9401
# Seconds a stopping webhook waits for the answers under way (the Deployment's grace period is 30 s, 5 of them
# preStop).
GRACEFUL_SHUTDOWN_S: Final = 20.0
# The names (subject CN or a DNS SAN) an --client-ca certificate must carry to be the API server's: the CN that
# the client certificate for webhooks of docs/install.md and devcluster carries. Another one of the same CA is refused.
CLIENT_NAMES: Final = ("kube-apiserver",)
