"""The webhook Service's virtual IP, as kube-proxy gives it: a TCP forwarder on a fixed 127.0.0.1 port to the
webhook's current endpoint, read from a JSON file (``{"port": N}``, or ``{"port": null}`` for a Service with no
endpoints: connections are then closed at once, as kube-proxy rejects them). When the endpoint changes,
open connections are cut, as when a pod behind a Service goes away.

There is no kube-proxy and no cluster network here, so the webhook configurations reach the host process
through ``url: https://127.0.0.1:<this port>/...`` instead of ``service:`` (the harness's overlay); TLS
passes through untouched, so the API server verifies the webhook's own certificate.

    python -m devcluster.serviceproxy --port-file F --endpoints-file F

Part of the test and demo harness, not of scrubgate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import selectors
import signal
import socket
import threading
from pathlib import Path


class ServiceProxy:
    def __init__(self, endpoints_file: Path) -> None:
        self.endpoints_file = endpoints_file
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._endpoint = self._read()

    def _read(self) -> int | None:
        try:
            return json.loads(self.endpoints_file.read_text()).get("port")
        except (OSError, ValueError):
            return None

    def serve(self, stopping: threading.Event) -> None:
        threading.Thread(target=self._watch, args=(stopping,), daemon=True).start()
        self.listener.settimeout(0.5)
        while not stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            endpoint = self._endpoint
            if endpoint is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", endpoint), timeout=5)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _watch(self, stopping: threading.Event) -> None:
        """Cut open connections when the endpoint changes; then say so in ``<endpoints file>.applied``."""
        self._applied(self._endpoint)
        while not stopping.wait(0.05):
            endpoint = self._read()
            if endpoint != self._endpoint:
                self._endpoint = endpoint
                with self._lock:
                    for sock in self._open:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                self._applied(endpoint)

    def _applied(self, endpoint: int | None) -> None:
        done = applied_file(self.endpoints_file)
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": endpoint}))
        tmp.replace(done)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self._open.update((client, upstream))
        selector = selectors.DefaultSelector()
        selector.register(client, selectors.EVENT_READ, upstream)
        selector.register(upstream, selectors.EVENT_READ, client)
        try:
            while True:
                for key, _ in selector.select():
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            selector.close()
            with self._lock:
                self._open.difference_update((client, upstream))
            for sock in (client, upstream):
                sock.close()


def applied_file(endpoints_file: Path) -> Path:
    return endpoints_file.with_name(endpoints_file.name + ".applied")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster.serviceproxy")
    parser.add_argument("--port-file", required=True, type=Path, help="where to write the port it listens on")
    parser.add_argument("--endpoints-file", required=True, type=Path)
    args = parser.parse_args(argv)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    proxy = ServiceProxy(args.endpoints_file)
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(proxy.port))
    tmp.replace(args.port_file)
    proxy.serve(stopping)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
