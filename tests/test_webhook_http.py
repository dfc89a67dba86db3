"""The webhook's HTTP/1.1 server (webhook/http11.py) as a client on the wire sees it: keep-alive and pipelining in
order, `Expect: 100-continue`, HEAD, HTTP/1.0, and the answers to what it will not read (a header section or a
body over its bound, a malformed request, an app that fails); a stop lets the answer under way go out.

An app of the test's own answers on the metrics port (plain HTTP, the same server code as the admission port's
connections past TLS), so that raw bytes show what the server writes."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from scrubgate.webhook import defaults
from scrubgate.webhook.server import Settings
from webhook_support import make_tls_dir, running_webhook

release = threading.Event()


async def echo_app(scope, receive, send) -> None:
    """Answers with the method, path, query and body length it got; /fail raises; /hold waits for `release`."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/fail":
        raise RuntimeError("the app failed")
    if scope["path"] == "/hold":
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
    answer = json.dumps(
        {"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(), "body": len(body)}
    ).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture
def server(tmp_path: Path) -> Iterator:
    tls = make_tls_dir(tmp_path / "tls")
    settings = Settings(tls_cert=tls.tls_cert, tls_key=tls.tls_key, audit_log=tmp_path / "audit.jsonl")
    release.clear()
    with running_webhook(settings, tls.ca_cert, metrics_app=echo_app) as running:
        yield running
    release.set()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10)
    return sock


def read_answer(sock: socket.socket, buffer: bytearray, *, head_only: bool = False) -> tuple[int, dict, bytes]:
    """One answer from `sock` (bytes beyond it stay in `buffer`): status, headers, body."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer; got {bytes(buffer)!r}"
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = 0 if head_only else int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside an answer"
        rest += chunk
    buffer[:] = rest[length:]
    return int(status_line.split()[1]), headers, rest[:length]


def closed(sock: socket.socket, buffer: bytearray) -> bool:
    sock.settimeout(5)
    try:
        return not buffer and sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_kept_alive_and_pipelined_requests_are_answered_in_order(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /first?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /second HTTP/1.1\r\nHost: h\r\n\r\n"
            b"POST /third HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
        )
        buffer = bytearray()
        answers = [read_answer(sock, buffer) for _ in range(3)]
        assert [json.loads(body) for _, _, body in answers] == [
            {"method": "POST", "path": "/first", "query": "x=1", "body": 3},
            {"method": "GET", "path": "/second", "query": "", "body": 0},
            {"method": "POST", "path": "/third", "query": "", "body": 5},
        ]
        status, headers, _ = answers[0]
        assert status == 200 and headers["content-length"] and "connection" not in headers
        assert re.fullmatch(r"\w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT", headers["date"])


def test_expect_100_continue_is_answered_before_the_body_is_sent(server):
    with connect(server) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        buffer = bytearray()
        assert read_answer(sock, buffer, head_only=True)[0] == 100
        sock.sendall(b"body")
        status, _, body = read_answer(sock, buffer)
        assert status == 200 and json.loads(body)["body"] == 4


def test_head_gets_the_headers_without_the_body(server):
    with connect(server) as sock:
        sock.sendall(b"HEAD /x HTTP/1.1\r\nHost: h\r\n\r\nGET /y HTTP/1.1\r\nHost: h\r\n\r\n")
        buffer = bytearray()
        status, headers, _ = read_answer(sock, buffer, head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        assert json.loads(read_answer(sock, buffer)[2])["path"] == "/y", "nothing of HEAD's body came first"


def test_an_upgrade_is_ignored_and_the_request_answered(server):
    with connect(server) as sock:
        sock.sendall(
            b"GET /x HTTP/1.1\r\nHost: h\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\nGET /y HTTP/1.1\r\nHost: h\r\n\r\n"
        )
        buffer = bytearray()
        assert [json.loads(read_answer(sock, buffer)[2])["path"] for _ in range(2)] == ["/x", "/y"]


def test_http_1_0_without_keep_alive_is_closed_after_its_answer(server):
    with connect(server) as sock:
        sock.sendall(b"GET /x HTTP/1.0\r\n\r\n")
        buffer = bytearray()
        status, headers, _ = read_answer(sock, buffer)
        assert status == 200 and headers["connection"] == "close"
        assert closed(sock, buffer)


@pytest.mark.parametrize(
    ("request_bytes", "status", "fragment"),
    [
        (
            b"GET /x HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * (defaults.MAX_HEADER_BYTES + 1) + b"\r\n\r\n",
            431,
            b"headers exceed",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % (defaults.MAX_BODY_BYTES + 1),
            413,
            b"exceeds the limit",
        ),
        (b"NOT A REQUEST\r\n\r\n", 400, b"malformed HTTP request"),
    ],
)
def test_what_the_server_will_not_read_is_refused_and_the_connection_closed(server, request_bytes, status, fragment):
    with connect(server) as sock:
        sock.sendall(request_bytes)  # a body announced over the bound is never sent: it is refused first
        buffer = bytearray()
        got, headers, body = read_answer(sock, buffer)
        assert (got, headers["connection"]) == (status, "close") and fragment in body, body
        assert closed(sock, buffer)


def test_an_app_that_fails_gives_a_500_and_the_server_serves_on(server):
    with connect(server) as sock:
        sock.sendall(b"GET /fail HTTP/1.1\r\nHost: h\r\n\r\n")
        assert read_answer(sock, bytearray())[0] == 500
    with connect(server) as sock:
        sock.sendall(b"GET /after HTTP/1.1\r\nHost: h\r\n\r\n")
        assert read_answer(sock, bytearray())[0] == 200


def test_a_stop_lets_the_answer_under_way_go_out_and_takes_no_new_connection(server):
    with connect(server) as held, connect(server) as idle:
        held.sendall(b"GET /hold HTTP/1.1\r\nHost: h\r\n\r\n")
        idle.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        assert read_answer(idle, bytearray())[0] == 200  # so the held request is surely in by now
        server.server.stop()
        assert closed(idle, bytearray()), "an idle connection is closed at once"
        with pytest.raises(OSError):
            connect(server).close()
        release.set()
        buffer = bytearray()
        status, headers, _ = read_answer(held, buffer)
        assert status == 200 and headers["connection"] == "close"
