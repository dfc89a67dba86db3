"""Who holds the webhook's connections: the API server's are counted apart from everyone else's.

The admission port is reachable from every pod that the network lets through, and opening a connection there
needs no certificate. So a connection is counted, in turn, in one budget of its own:

- `handshake`: accepted, TLS handshake under way (it must be done within TLS_HANDSHAKE_TIMEOUT_S);
- `apiserver`: the handshake gave a client certificate of --client-ca with an allowed name (or there is no
  --client-ca): the API server's; when full, a new one is closed (the limit guards memory, nobody else gets in);
- `unverified`: no such certificate: kubelet probes and `helm test` (/healthz, /readyz), or an attacker;
- `metrics`: the plain HTTP port of /metrics and the probes.

Every budget but `apiserver` closes its oldest connection to make room for a new one: a real client is done
within milliseconds, so keeping one of them out takes a flood of new connections, not a slow trickle of held
ones. Every connection must bring a whole request within the read deadline of its opening or its last answer; one
of the API server's (its client certificate verified), between requests, within its keep-alive
(defaults.KEEP_ALIVE_IDLE_S), used yet or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from typing import Protocol

from . import defaults
from .http11 import ASGIApp, HTTPConnection, Limits
from .metrics import Metrics
from .tls import CLIENT_VERDICT, ClientVerdict, ServingTLS

log = logging.getLogger(__name__)

# accept() failing for want of resources, not because of the one connection (asyncio's servers wait a second too).
_OUT_OF_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


class Member(Protocol):
    def abort(self) -> None: ...


class Budget:
    """At most `limit` connections; `shed_oldest`: a new one closes the oldest, else the new one is refused."""

    def __init__(
        self, name: str, limit: int, metrics: Metrics, *, shed_oldest: bool, idle_timeout_s: float | None = None
    ) -> None:
        self.name, self.limit, self.shed_oldest, self.metrics = name, limit, shed_oldest, metrics
        self.idle_timeout_s = idle_timeout_s  # a served connection's keep-alive; None: the read deadline
        self.members: dict[Member, None] = {}  # insertion order: the oldest first
        metrics.connections.labels(name).set_function(lambda: len(self.members))

    def add(self, member: Member) -> bool:
        if len(self.members) >= self.limit:
            if not self.shed_oldest:
                self.closed("refused")
                log.warning(
                    "%s connections at their limit (%d): closed a new one; see scrubgate_webhook_connections",
                    self.name,
                    self.limit,
                )
                return False
            oldest = next(iter(self.members))
            del self.members[oldest]
            oldest.abort()
            self.closed("shed")
        self.members[member] = None
        return True

    def discard(self, member: Member) -> None:
        self.members.pop(member, None)

    def closed(self, reason: str) -> None:
        self.metrics.connections_closed.labels(self.name, reason).inc()


class _Accepted:
    """A connection in its TLS handshake. Shed by shutting its socket down: the handshake then fails, and the
    transport that owns the socket closes it."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # closed meanwhile: its file descriptor is detached (-1)
            self.sock.shutdown(socket.SHUT_RDWR)


class TLSListener:
    """The admission port: TLS with the serving certificate in force, each connection in its budget. It accepts
    connections itself (loop.sock_accept, loop.connect_accepted_socket), so that it holds each one from its
    first moment: a server's own accept hands a connection over only once its handshake is done."""

    def __init__(
        self, app: ASGIApp, tls: ServingTLS, limits: Limits, metrics: Metrics, *, handshake_timeout_s: float
    ) -> None:
        self.app, self.tls, self.limits, self.handshake_timeout_s = app, tls, limits, handshake_timeout_s
        self.pending = Budget("handshake", defaults.MAX_PENDING_HANDSHAKES, metrics, shed_oldest=True)
        self.apiserver = Budget(
            "apiserver", defaults.MAX_CONNECTIONS, metrics, shed_oldest=False, idle_timeout_s=defaults.KEEP_ALIVE_IDLE_S
        )
        self.unverified = Budget("unverified", defaults.MAX_UNVERIFIED_CONNECTIONS, metrics, shed_oldest=True)
        self._handshakes: set[asyncio.Task[None]] = set()

    @property
    def budgets(self) -> tuple[Budget, ...]:
        """The budgets of connections past their handshake (the read deadline's)."""
        return self.apiserver, self.unverified

    async def accept(self, listening: socket.socket) -> None:
        """Accepts connections on `listening` until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listening)
            except ConnectionError:
                continue  # the client gave up before it was accepted
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                log.error(
                    "cannot accept connections on the admission port: %s; retrying in a second (raise the open "
                    "files limit, or look for a connection flood: scrubgate_webhook_connections)",
                    exc,
                )
                await asyncio.sleep(1.0)
                continue
            accepted = _Accepted(sock)
            self.pending.add(accepted)
            task = loop.create_task(self._handshake(accepted))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, accepted: _Accepted) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(
                self._connection,
                accepted.sock,
                ssl=self.tls.context,
                ssl_handshake_timeout=self.handshake_timeout_s,
            )
        except Exception as exc:  # whatever it died of (a timeout, an alert, a reset, shed): the caller is gone
            if accepted in self.pending.members:  # not shed (counted as such)
                self.pending.closed("handshake")
            log.debug("a TLS handshake failed: %s", exc)
            accepted.sock.close()  # a no-op where the transport closed it
        finally:
            self.pending.discard(accepted)

    def abort_handshakes(self) -> None:
        for accepted in list(self.pending.members):
            accepted.abort()

    def _connection(self) -> HTTPConnection:
        return HTTPConnection(self.app, self.limits, scheme="https", state={}, membership=self)

    # Membership of the connections past their handshake: the client certificate decides the budget.

    def add(self, connection: HTTPConnection) -> bool:
        assert connection.transport is not None
        verdict = self.tls.client_verdict(connection.transport.get_extra_info("peercert"))
        connection.state = {CLIENT_VERDICT: verdict}
        if verdict.allowed:
            return self.apiserver.add(connection)
        if verdict.subject:
            # A certificate of the client CA, of another name: a misconfigured API server, or someone else's.
            log.warning(
                "a caller from %s presented a client certificate of %s: %s; it may read /healthz and /readyz only",
                (connection.client or ("?",))[0],
                self.tls.client_ca,
                verdict.refusal,
            )
        return self.unverified.add(connection)

    def discard(self, connection: HTTPConnection) -> None:
        self.apiserver.discard(connection)
        self.unverified.discard(connection)


class PlainListener:
    """The metrics port: plain HTTP, its connections in a budget of their own."""

    def __init__(self, app: ASGIApp, limits: Limits, metrics: Metrics) -> None:
        self.app, self.limits = app, limits
        self.connections = Budget("metrics", defaults.MAX_METRICS_CONNECTIONS, metrics, shed_oldest=True)

    @property
    def budgets(self) -> tuple[Budget, ...]:
        return (self.connections,)

    def protocol(self) -> asyncio.Protocol:
        return HTTPConnection(self.app, self.limits, scheme="http", state={}, membership=self.connections)


async def enforce_read_deadline(budgets: tuple[Budget, ...], read_timeout_s: float) -> None:
    """Closes every connection that has not brought a whole request within `read_timeout_s` of its opening or
    its last answer, or, in a budget with a keep-alive of its own, within that of its last answer. One sweep for
    all, a few times per deadline: nothing to arm or cancel on each request."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(1.0, read_timeout_s / 4))
        now = loop.time()
        for budget in budgets:
            late = [
                c for c in budget.members if isinstance(c, HTTPConnection) and _late(c, budget, now, read_timeout_s)
            ]
            for connection in late:
                _expire(budget, connection, read_timeout_s)


def _late(connection: HTTPConnection, budget: Budget, now: float, read_timeout_s: float) -> bool:
    if connection.idle_since is None:
        return False
    kept_alive = budget.idle_timeout_s is not None and not _waiting(connection)
    return connection.idle_since < now - (budget.idle_timeout_s if kept_alive else read_timeout_s)


def _waiting(connection: HTTPConnection) -> bool:
    """Part of a request read, or none served yet on a connection whose caller did not prove to be the API
    server: the read deadline applies. kube-apiserver's Go transport dials ahead of need and parks a connection it
    did not use in its idle pool, to send a review on it any time within 90 s: cut at the read deadline, that
    review got EOF ("failed calling webhook ... EOF", a POST it does not retry). So the API server's own
    connection is kept alive, answered or not."""
    if connection.partial:
        return True
    verdict = connection.state.get(CLIENT_VERDICT)
    proven = isinstance(verdict, ClientVerdict) and verdict.allowed and bool(verdict.subject)
    return connection.served == 0 and not proven


def _expire(budget: Budget, connection: HTTPConnection, read_timeout_s: float) -> None:
    if not _waiting(connection):
        budget.closed("idle")  # kept alive and unused: the client opens another when it needs one
    else:
        budget.closed("deadline")
        if budget.name == "apiserver":
            log.warning(
                "closing a connection from %s: no complete request within %.0fs",
                (connection.client or ("?",))[0],
                read_timeout_s,
            )
    connection.abort()
