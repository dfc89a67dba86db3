"""GETs of the host processes' health and metrics endpoints: plain HTTP (the agent's and the controller's
metrics ports, the webhook's) and HTTPS as the API server dials the webhook. Part of the test and demo harness
(devcluster/harness.py)."""

from __future__ import annotations

import http.client
import socket
import ssl
from pathlib import Path


def http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def probe(port: int, path: str) -> tuple[int, str]:
    """``http_get``, or (0, reason) when the process does not answer."""
    try:
        return http_get(port, path)
    except (OSError, http.client.HTTPException) as exc:
        return 0, str(exc)


def https_get(port: int, path: str, ca_file: Path, host: str) -> tuple[int, str]:
    """GET over HTTPS as the API server connects: to 127.0.0.1, verifying the CA and the server name ``host``.
    (0, reason) when it cannot connect."""
    context = ssl.create_default_context(cafile=str(ca_file))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            resp = http.client.HTTPResponse(tls)  # type: ignore[arg-type]
            resp.begin()
            return resp.status, resp.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        return 0, str(exc)
