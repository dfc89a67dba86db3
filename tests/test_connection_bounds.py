"""Connections cannot pile up: the webhook closes a connection whose request does not arrive in full in time
(a slow body, or nothing sent at all: opening one needs no client certificate) or whose TLS handshake does not
finish in time; callers without the API server's client certificate never take the API server's connections
(issue 28 item 5); the agent's /metrics server closes idle connections and serves a bounded number at once (each
holds a thread)."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
from scrubgate.policies import names
from scrubgate.sanitizer_agent.metrics import AgentMetrics, serve
from scrubgate.webhook import defaults
from webhook_support import gpu_claim, review, serving, serving_api_server_only


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


def answered(sock: socket.socket, request: bytes) -> bool:
    """Whether the peer answers `request` with anything before closing the connection."""
    try:
        sock.sendall(request)
    except (BrokenPipeError, ConnectionResetError):
        return False
    sock.settimeout(5)
    try:
        return bool(sock.recv(4096))
    except ConnectionResetError:
        return False


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


def test_a_served_connection_of_the_api_server_stays_open_past_the_read_deadline(webhook):
    """kube-apiserver keeps an unused webhook connection up to 90 s and may send a review on it at any moment:
    closed here first, that review gets EOF (a POST, which it does not retry) and its admission fails ("failed
    calling webhook ... EOF", seen once in the 200-claim load test). So once it has been answered, the API server's
    connection is kept alive longer than the API server keeps it, not cut at the read deadline."""
    assert defaults.KEEP_ALIVE_IDLE_S > 90
    request = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
    with tls_connection(webhook) as conn:
        assert answered(conn, request)
        time.sleep(2.0)  # four read deadlines of this webhook
        assert answered(conn, request), "closed at the read deadline: the API server's next review would get EOF"


def test_an_unused_connection_of_the_api_server_stays_open_past_the_read_deadline(tmp_path: Path):
    """kube-apiserver's Go transport dials ahead of need and parks a connection it did not use in its idle pool,
    where it may send a review on it any time within 90 s: cut at the read deadline because nothing came yet, that
    review got EOF (seen once in the differential test of DeviceClasses). A connection with the API server's
    client certificate is kept alive before its first request too; one without it is still closed."""
    with serving_api_server_only(tmp_path, read_timeout_s=0.5) as running:
        context = ssl.create_default_context(cafile=str(running.ca_file))
        context.load_cert_chain(*running.api_server_cert)
        request = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
        raw = socket.create_connection(("127.0.0.1", running.port), timeout=5)
        with context.wrap_socket(raw, server_hostname="scrubgate-webhook.scrubgate-system.svc") as api_server:
            with tls_connection(running) as stranger:
                assert closed_within(stranger, 5.0), "a caller without the certificate held an unused connection"
            assert answered(api_server, request), "closed at the read deadline: the API server's review would get EOF"


def test_a_review_after_a_pause_has_the_whole_read_deadline(tmp_path: Path):
    """On a kept-alive connection of the API server, a review that comes after a pause longer than the read deadline
    and arrives in more than one read is not cut halfway: its deadline runs from its first byte."""
    # A deadline of 1 s, swept every 0.25 s: the second half comes 0.5 s after the first (two sweeps), so a machine
    # busy for half a second does not cut it either.
    with serving_api_server_only(tmp_path, read_timeout_s=1.0) as running:
        context = ssl.create_default_context(cafile=str(running.ca_file))
        context.load_cert_chain(*running.api_server_cert)
        raw = socket.create_connection(("127.0.0.1", running.port), timeout=5)
        with context.wrap_socket(raw, server_hostname="scrubgate-webhook.scrubgate-system.svc") as api_server:
            assert answered(api_server, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(2.5)  # past two read deadlines, well within the keep-alive
            api_server.sendall(b"GET /readyz HTTP/1.1\r\n")
            time.sleep(0.5)  # two sweeps of the deadline while the request is half in
            assert answered(api_server, b"Host: x\r\n\r\n"), "cut halfway: the API server's review would get EOF"


@pytest.fixture
def guarded(tmp_path: Path):
    """With --client-ca, as the shipped Deployment runs; handshakes must be done within half a second."""
    with serving_api_server_only(tmp_path, handshake_timeout_s=0.5) as running:
        yield running


def test_callers_without_the_api_servers_certificate_cannot_take_its_connections(guarded):
    """More connections without a client certificate than the API server's cap (all done with their handshake),
    and more that never start one than the handshake budget, all held open: the API server still gets its
    decision, and a probe its answer (once, ~1,100 such connections made the webhook answer the API server 503)."""
    held: list[socket.socket] = []
    try:
        for _ in range(defaults.MAX_CONNECTIONS + 100):
            held.append(tls_connection(guarded))
        for _ in range(defaults.MAX_PENDING_HANDSHAKES + 50):
            held.append(socket.create_connection(("127.0.0.1", guarded.port), timeout=5))
        retain = gpu_claim(annotations={names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN})
        with guarded.client(cert=guarded.api_server_cert) as api_server:
            response = api_server.post("/validate", json=review(retain))
        assert response.status_code == 200, response.text
        assert response.json()["response"]["allowed"] is False, "a decision"
        with guarded.client() as probe:
            assert probe.get("/readyz").status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_a_connection_that_never_finishes_its_handshake_is_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as raw:
        assert closed_within(raw, 5.0), "a connection without a handshake was left open"


def test_the_metrics_port_closes_idle_connections(webhook):
    with socket.create_connection(("127.0.0.1", webhook.metrics_port), timeout=5) as idle:
        assert closed_within(idle, 5.0), "an idle connection to the metrics port was left open"


def test_held_connections_to_the_metrics_port_do_not_keep_a_scrape_out(tmp_path: Path):
    with serving(tmp_path) as webhook:  # the read deadline (10 s) does not free them within the test
        held = [
            socket.create_connection(("127.0.0.1", webhook.metrics_port), timeout=5)
            for _ in range(defaults.MAX_METRICS_CONNECTIONS + 4)
        ]
        try:
            # A scrape with a connection of its own while the budget is full: the oldest makes room.
            scraped = httpx.get(f"http://127.0.0.1:{webhook.metrics_port}/metrics", timeout=5)
            assert scraped.status_code == 200 and "scrubgate_webhook_connections" in scraped.text
        finally:
            for sock in held:
                sock.close()


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
        # The server takes connections in the order they were made: the four hold every slot when the fifth
        # comes, which gets no answer (a served one would, long before its idle deadline closes it).
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert not answered(extra, b"GET /metrics HTTP/1.1\r\nHost: agent\r\n\r\n"), "a fifth connection was served"
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
