"""Connections cannot pile up: the webhook closes a connection whose request does not arrive in full in time
(a slow body, or nothing sent at all: opening one needs no client certificate), and the agent's /metrics
server closes idle connections and serves a bounded number at once (each holds a thread)."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request
from pathlib import Path

import pytest
from scrubgate.sanitizer_agent.metrics import AgentMetrics, serve
from webhook_support import serving


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The peer closed the connection within `seconds` (reads give EOF)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except (ConnectionResetError, ssl.SSLError):
        return True
    return True


@pytest.fixture
def webhook(tmp_path: Path):
    with serving(tmp_path, read_timeout_s=0.5) as running:
        yield running


def tls_connection(webhook) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    raw = socket.create_connection(("127.0.0.1", webhook.port), timeout=5)
    return context.wrap_socket(raw, server_hostname="scrubgate-webhook.scrubgate-system.svc")


@pytest.mark.parametrize("sent", [b"", b'POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"kind"'])
def test_the_webhook_closes_a_connection_whose_request_does_not_arrive(webhook, sent: bytes):
    with tls_connection(webhook) as conn:
        conn.sendall(sent)
        assert closed_within(conn, 5.0), "the connection was left open"
    assert webhook.http.get("/readyz").status_code == 200, "and it still serves"


def test_a_kept_alive_connection_serves_requests_that_arrive_in_time(webhook):
    for _ in range(3):
        assert webhook.http.get("/healthz").status_code == 200
        time.sleep(0.2)


def test_the_agents_metrics_close_idle_connections_and_are_bounded():
    server = serve(AgentMetrics(), lambda: (True, "ok"), "127.0.0.1", 0, idle_timeout_s=0.5, max_connections=4)
    port = server.server_address[1]
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert closed_within(idle, 5.0), "an idle connection held its thread"
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert closed_within(extra, 0.3), "a fifth connection at once was served"
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                    assert answer.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "slots not given back"
                time.sleep(0.1)
    finally:
        server.shutdown()
