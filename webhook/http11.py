"""HTTP/1.1 on one connection (TLS or plain) for an ASGI app: httptools parses, requests are answered one at a
time and in order, and a request must arrive in full within a deadline.

The webhook serves a narrow set of callers (the API server's POSTs, kubelet probes, Prometheus scrapes), and
needs what a general server keeps private: the read deadline from a connection's first byte, and the TLS
client's identity decided once per connection (listeners.py). Each request's body is read whole, up to a
bound, before the app sees it: the app gets one `http.request` message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol, cast
from urllib.parse import unquote

import httptools

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_STATUS_LINES = {status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode() for status in HTTPStatus}


class Membership(Protocol):
    """Where a connection is counted (listeners.Budget): `add` is False when there is no room for it."""

    def add(self, member: Any) -> bool: ...

    def discard(self, member: Any) -> None: ...


@dataclass(frozen=True)
class Limits:
    read_timeout_s: float
    max_body_bytes: int
    max_header_bytes: int


class _Refused(Exception):
    """Raised from a parser callback: the request is answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Date:
    """The Date header (RFC 9110 asks an origin server with a clock for one), formatted once a second."""

    second = -1
    header = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.header = second, f"date: {formatdate(second, usegmt=True)}\r\n".encode()
        return cls.header


@dataclass(slots=True)
class _Request:
    method: str
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    http_version: str


class HTTPConnection(asyncio.Protocol):
    """One client connection. `state` becomes the ASGI scope's `state` of each request on it; `membership` is
    where the connection counts while it is open (it is closed at once when there is no room)."""

    def __init__(
        self, app: ASGIApp, limits: Limits, *, scheme: str, state: dict[str, Any], membership: Membership
    ) -> None:
        self.app, self.limits, self.scheme, self.state, self.membership = app, limits, scheme, state, membership
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int] | None = None
        self.parser = httptools.HttpRequestParser(self)
        # While a request is due: when the connection opened or the last answer went out. None while one is served.
        self.idle_since: float | None = None
        self.served = 0
        self.partial = False  # part of a request is in
        self.draining = False  # the server stops: close after the answer in progress
        self._queue: deque[_Request] = deque()
        self._busy = False
        self._task: asyncio.Task[None] | None = None  # the request being served (the loop keeps weak references)
        self._writing_paused = False
        self._closing = False  # the last answer said `connection: close`
        self._lost = False
        self._disconnected: asyncio.Future[None] | None = None
        self._reset_message()

    # -- the connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        self.transport = transport
        self.client = transport.get_extra_info("peername")
        self.server = transport.get_extra_info("sockname")
        self.idle_since = self.loop.time()
        if not self.membership.add(self):
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.membership.discard(self)
        if self._disconnected is not None and not self._disconnected.done():
            self._disconnected.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self.transport is not None and not self._lost:
            self.transport.resume_reading()
            self._next()

    def abort(self) -> None:
        """Closes at once, without flushing: for connections shed or past their deadline."""
        if self.transport is not None and not self._lost:
            self.transport.abort()

    @property
    def busy(self) -> bool:
        return self._busy or bool(self._queue)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            while True:
                try:
                    self.parser.feed_data(data)
                    return
                except httptools.HttpParserUpgrade as upgrade:
                    # An Upgrade (h2c) or CONNECT request, answered as any other: a server may ignore the header
                    # (RFC 9110, 7.8). The parser stopped where it thought the new protocol begins: read on.
                    data = data[upgrade.args[0] :]
                    if not data:
                        return
        except httptools.HttpParserError as exc:
            refused = exc.__context__ if isinstance(exc.__context__, _Refused) else None
            if refused is not None:
                self._refuse(refused.status, str(refused))
            else:
                self._refuse(400, f"malformed HTTP request: {exc}")

    def _refuse(self, status: int, message: str) -> None:
        """Answers `status` with `message` and closes: what follows on the connection cannot be parsed."""
        if self._lost or self._closing or self.transport is None:
            return
        if self._busy:  # an answer is due first, and this one cannot wait behind it: close without either
            self.abort()
            return
        log.info("refused an HTTP request from %s: %s", (self.client or ("?",))[0], message, extra={"status": status})
        self._queue.clear()
        body = (message + "\n").encode()
        self._write(status, [(b"content-type", b"text/plain; charset=utf-8")], body, keep_alive=False)

    # -- parser callbacks (httptools)

    def _reset_message(self) -> None:
        self._target = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0

    def on_message_begin(self) -> None:
        self._reset_message()
        self.partial = True
        if self.served:
            # The read deadline of a request on a kept-alive connection runs from its first byte, not from the last
            # answer: else a review that comes after a pause longer than the deadline, in more than one read, was
            # cut halfway (the API server got EOF).
            self.idle_since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        self._headers.append((name.lower(), value))

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            raise _Refused(431, f"the request line and headers exceed {self.limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.limits.max_body_bytes:
                raise _Refused(413, f"a body of {int(value)} bytes exceeds the limit of {self.limits.max_body_bytes}")
            if name == b"expect" and value.lower() == b"100-continue" and self.transport and not self.busy:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            raise _Refused(413, f"the body exceeds the limit of {self.limits.max_body_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        chunks = self._body
        self._queue.append(
            _Request(
                parser.get_method().decode("ascii"),
                self._target,
                self._headers,
                chunks[0] if len(chunks) == 1 else b"".join(chunks),
                parser.should_keep_alive(),
                parser.get_http_version(),
            )
        )
        self._reset_message()
        self.partial = False
        self.idle_since = None
        if not self._busy:
            self._next()
        elif self.transport is not None:
            self.transport.pause_reading()  # pipelined: read on once the queue is served

    # -- serving

    def _next(self) -> None:
        if self._busy or self._writing_paused or self._closing or self._lost or not self._queue:
            return
        request = self._queue.popleft()
        self._busy = True
        self._task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: _Request) -> None:
        cycle = _Cycle(self, request)
        try:
            await self.app(self._scope(request), cycle.receive, cycle.send)
        except Exception:
            log.exception("the webhook failed answering %s %s", request.method, request.target.decode("latin-1"))
            if not cycle.started:
                cycle.status, cycle.headers, cycle.chunks = 500, [(b"content-type", b"text/plain")], [b"error\n"]
                cycle.started = cycle.finished = True
        if not cycle.finished:
            if cycle.started:  # an answer begun and never ended: the client cannot find where the next one starts
                self.abort()
            else:
                log.error("the webhook gave no answer to %s %s", request.method, request.target.decode("latin-1"))
                cycle.status, cycle.headers, cycle.chunks = 500, [(b"content-type", b"text/plain")], [b"no answer\n"]
                cycle.finished = True
        if cycle.finished and not self._lost:
            chunks = cycle.chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            keep_alive = request.keep_alive and not self.draining
            self._write(cycle.status, cycle.headers, b"" if request.method == "HEAD" else body, keep_alive, len(body))
        self._busy = False
        self._task = None
        self.served += 1
        if not self._lost:
            self.idle_since = self.loop.time()  # closing, too: a client that reads nothing is aborted in time
        if not self._lost and not self._closing:
            if self.transport is not None and not self._writing_paused:
                self.transport.resume_reading()
            self._next()

    def _scope(self, request: _Request) -> Scope:
        raw_path, _, query = request.target.partition(b"?")
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        return {
            "type": "http",
            "asgi": _ASGI,
            "http_version": request.http_version,
            "method": request.method,
            "scheme": self.scheme,
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": request.headers,
            "client": self.client,
            "server": self.server,
            "state": self.state.copy(),
        }

    def _write(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        length: int | None = None,
    ) -> None:
        transport = self.transport
        if transport is None or self._lost:
            return
        head = [_STATUS_LINES.get(status) or f"HTTP/1.1 {status} \r\n".encode(), _Date.now()]
        has_length = False
        for name, value in headers:
            has_length = has_length or name.lower() == b"content-length"
            head.append(b"%s: %s\r\n" % (name, value))
        if not has_length:
            head.append(b"content-length: %d\r\n" % (len(body) if length is None else length))
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        head.append(body)
        transport.write(b"".join(head))
        if not keep_alive:
            self._closing = True
            self._queue.clear()
            transport.close()

    def disconnected(self) -> asyncio.Future[None]:
        if self._disconnected is None:
            self._disconnected = self.loop.create_future()
            if self._lost:
                self._disconnected.set_result(None)
        return self._disconnected


class _Cycle:
    """One request's ASGI `receive` and `send`: the body in one message, the answer collected and written whole."""

    __slots__ = ("chunks", "connection", "finished", "headers", "request", "started", "status", "taken")

    def __init__(self, connection: HTTPConnection, request: _Request) -> None:
        self.connection, self.request = connection, request
        self.taken = self.started = self.finished = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []

    async def receive(self) -> Message:
        if not self.taken:
            self.taken = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        await self.connection.disconnected()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self.started:
            self.started = True
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
        elif kind == "http.response.body" and self.started and not self.finished:
            self.chunks.append(message.get("body", b""))
            self.finished = not message.get("more_body", False)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} (answer started: {self.started})")
