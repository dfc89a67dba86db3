"""The Kubernetes API stand-in's HTTP front: plain HTTP/1.1 + JSON on 127.0.0.1, routing by path.

Run it as its own process::

    python -m devcluster.apiserver --port 0 --port-file /tmp/port --state-dir .demo/api \\
        --token-file tokens.csv --service scrubgate-system/scrubgate-webhook=8443 --control-plane

or in-process (tests)::

    with ApiServer().start() as server:
        client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=server.url))
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from . import resources
from .admission import Admission, ServiceMap
from .api import Api, Call
from .auth import ADMIN, ANONYMOUS, Authenticator, UserInfo, load_token_file
from .errors import ApiError, bad_request, path_not_found
from .gc import GarbageCollector, NamespaceController
from .resources import NAMESPACES, Surface, surface_from_args
from .store import Store

log = logging.getLogger("devcluster.apiserver")

BOOTSTRAP_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class ApiServer:
    """The stand-in: store, admission, API semantics, garbage collector, HTTP listener."""

    def __init__(
        self,
        *,
        port: int = 0,
        state_dir: Path | None = None,
        surface: Surface | None = None,
        tokens: dict[str, UserInfo] | None = None,
        default_user: UserInfo = ANONYMOUS,
        services: ServiceMap | None = None,
        control_plane: bool = False,
        nodes: dict[str, Path] | None = None,
        history_limit: int = 50_000,
    ) -> None:
        self.surface = surface or Surface()
        journal = state_dir / "objects.jsonl" if state_dir is not None else None
        self.store = Store(journal, history_limit=history_limit)
        self.services = services or ServiceMap()
        self.admission = Admission(self.store, self.surface, self.services)
        self.api = Api(self.store, self.surface, self.admission)
        self.auth = Authenticator(tokens, default_user)
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._background: list = [GarbageCollector(self.api), NamespaceController(self.api)]
        if control_plane:
            from .controllers import ControlPlane

            self._background.append(ControlPlane(self.api))
        self.nodes: list = []
        if nodes:
            from .kubelet import SimulatedNode  # needs scrubgate's simulated GPU backend

            self.nodes = [SimulatedNode(self.api, name, root) for name, root in nodes.items()]

    @property
    def port(self) -> int:
        assert self._httpd is not None, "ApiServer.start() first"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiServer:
        self._bootstrap()
        handler = type("Handler", (_Handler,), {"app": self})
        self._httpd = _HttpServer(("127.0.0.1", self._port), handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="devcluster-http", daemon=True
        )
        self._thread.start()
        for worker in [*self._background, *self.nodes]:
            worker.start()
        return self

    def stop(self, keep_containers: bool = False) -> None:
        """Stop serving. Simulated nodes kill their containers unless ``keep_containers`` (a crash,
        as far as the workloads can tell: a restarted stand-in with the same state adopts them)."""
        self._stopping.set()
        for worker in [*self._background, *self.nodes]:
            worker.signal_stop()
        self.store.close()  # wakes the workers and ends open watches
        for worker in self._background:
            worker.stop()
        for node in self.nodes:
            node.stop(keep_containers=keep_containers)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _bootstrap(self) -> None:
        version = NAMESPACES.versions[0]
        for name in BOOTSTRAP_NAMESPACES:
            if self.store.get(("", "namespaces", "", name)) is None:
                self.api.create(Call(ADMIN, NAMESPACES, version), {"metadata": {"name": name}})

    # ------------------------------------------------------------------ request handling

    def handle(self, req: _Handler) -> None:
        url = urlsplit(req.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        parts = [p for p in url.path.split("/") if p]
        try:
            user = self.auth.authenticate(req.headers.get("Authorization"))
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            discovery = self._discovery(parts)
            if discovery is not None:
                if req.command != "GET":
                    raise ApiError(
                        405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
                    )
                req.send_json(200, discovery)
                return
            self._resource_request(req, user, parts, query)
        except ApiError as e:
            req.discard_body()  # an error before the body was read must not leave it in a kept-alive stream
            req.send_json(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug in the stand-in: say so instead of dropping the connection
            log.exception("devcluster: %s %s failed", req.command, req.path)
            req.send_json(500, ApiError(500, "InternalError", f"devcluster internal error: {e!r}").status())

    def _discovery(self, parts: list[str]) -> dict | None:
        match parts:
            case ["version"]:
                return resources.VERSION_INFO
            case ["api"]:
                return resources.api_versions(f"127.0.0.1:{self.port}")
            case ["api", "v1"]:
                return resources.api_resource_list(self.surface, "", "v1")
            case ["apis"]:
                return resources.api_group_list(self.surface)
            case ["apis", group]:
                return resources.api_group(self.surface, group) or _raise(path_not_found())
            case ["apis", group, version]:
                return resources.api_resource_list(self.surface, group, version) or _raise(path_not_found())
        return None

    def _resource_request(self, req: _Handler, user: UserInfo, parts: list[str], query: dict[str, str]) -> None:
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise path_not_found()
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            rt = self.surface.lookup(group, version, rest[2])
            if rt is not None and rt.namespaced:
                namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise path_not_found()
        rt = self.surface.lookup(group, version, rest[0])
        if rt is None:
            raise path_not_found()
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        if sub and not resources.subresource_allowed(rt, sub):
            raise path_not_found()
        dry_run = query.get("dryRun") == "All"
        if query.get("dryRun") not in (None, "", "All"):
            raise bad_request(f"unsupported dryRun value {query['dryRun']!r}; only All is valid")
        call = Call(user, rt, version, namespace, name, sub, dry_run)
        method = req.command
        if method == "GET" and not name:
            if query.get("watch") in ("1", "true"):
                self._watch(req, call, query)
            else:
                req.send_json(
                    200,
                    self.api.list(
                        call,
                        query.get("labelSelector", ""),
                        query.get("fieldSelector", ""),
                        int(query.get("limit") or 0),
                        query.get("continue", ""),
                    ),
                )
            return
        if method == "GET":
            req.send_json(200, self.api.get(call))
            return
        if method == "POST" and (not name or sub == "binding"):
            obj, warnings = self.api.create(call, req.json_body())
            req.send_json(201, obj, warnings)
            return
        if not name:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
        if method == "PUT":
            obj, warnings = self.api.update(call, req.json_body())
        elif method == "PATCH":
            obj, warnings = self.api.patch(call, req.headers.get("Content-Type", ""), req.json_body())
        elif method == "DELETE":
            options = req.json_body(optional=True) or {}
            if not isinstance(options, dict):
                raise bad_request("DeleteOptions must be a JSON object")
            for param in ("gracePeriodSeconds", "propagationPolicy"):
                if param in query:
                    options[param] = int(query[param]) if param == "gracePeriodSeconds" else query[param]
            obj, warnings = self.api.delete(call, options)
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")
        req.send_json(200, obj, warnings)

    def _watch(self, req: _Handler, call: Call, query: dict[str, str]) -> None:
        events = self.api.watch(
            call,
            query.get("labelSelector", ""),
            query.get("fieldSelector", ""),
            query.get("resourceVersion", ""),
            float(query.get("timeoutSeconds") or 1800),
            query.get("allowWatchBookmarks") in ("1", "true"),
            lambda: self._stopping.is_set() or req.client_gone(),
        )
        req.start_chunked()
        try:
            for event in events:
                req.write_chunk(event)
            req.end_chunked()
        except (BrokenPipeError, ConnectionResetError, OSError):
            req.close_connection = True


def _raise(error: ApiError) -> dict:
    raise error


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle's algorithm the body waits for the client's
    # delayed ACK of the headers (~40 ms on every kept-alive request). Go's net/http sets TCP_NODELAY too.
    disable_nagle_algorithm = True
    app: ApiServer
    _body_read = False

    def do_GET(self) -> None:
        self._body_read = False  # one handler serves every request of a kept-alive connection
        self.app.handle(self)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def json_body(self, optional: bool = False) -> object:
        raw = self._read_body()
        if not raw.strip():
            if optional:
                return None
            raise bad_request("the request has no body")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise bad_request(f"the request body is not JSON: {e}") from e

    def _read_body(self) -> bytes:
        if self._body_read:
            return b""
        self._body_read = True
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def discard_body(self) -> None:
        self._read_body()

    def send_json(self, code: int, body: object, warnings: list[str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for warning in warnings or []:
            self.send_header("Warning", '299 - "{}"'.format(warning.replace("\\", "\\\\").replace('"', '\\"')))
        self.end_headers()
        self.wfile.write(data)

    def client_gone(self) -> bool:
        """The client closed its end (a watch that was stopped while no event came)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def start_chunked(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def write_chunk(self, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


# ---------------------------------------------------------------------- command line


def _parse_user(text: str) -> UserInfo:
    name, _, groups = text.partition(":")
    if text.startswith("system:"):  # a username that itself contains colons: no groups given
        name, groups = text, ""
    return UserInfo(name, groups=tuple(g for g in groups.split(",") if g))


def _parse_service(text: str) -> tuple[tuple[str, str], int]:
    target, _, port = text.partition("=")
    namespace, _, name = target.partition("/")
    if not namespace or not name or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--service wants NAMESPACE/NAME=PORT, got {text!r}")
    return (namespace, name), int(port)


def _parse_node(text: str) -> tuple[str, Path]:
    name, _, root = text.partition("=")
    if not name or not root:
        raise argparse.ArgumentTypeError(f"--node wants NAME=GPU_DIR, got {text!r}")
    return name, Path(root)


def _versions(text: str) -> list[str]:
    return [] if text in ("", "none") else [v.strip() for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster.apiserver",
        description="Kubernetes API stand-in for scrubgate's tests and demo "
        "(a test harness, not a Kubernetes API server).",
    )
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: pick one, see --port-file)")
    parser.add_argument("--port-file", type=Path, help="write the port here once listening")
    parser.add_argument("--state-dir", type=Path, help="keep objects here across restarts")
    parser.add_argument("--token-file", type=Path, help='static tokens: token,user,uid,"group1,group2" per line')
    parser.add_argument(
        "--default-user",
        type=_parse_user,
        default=ANONYMOUS,
        help="user for requests without a token, NAME[:GROUP,GROUP] (default system:anonymous)",
    )
    parser.add_argument(
        "--service",
        type=_parse_service,
        action="append",
        default=[],
        help="webhook service NAMESPACE/NAME=PORT on 127.0.0.1 (repeatable)",
    )
    parser.add_argument("--services-file", type=Path, help='JSON {"namespace/name": port}, re-read when it changes')
    parser.add_argument(
        "--resource-versions",
        type=_versions,
        default=None,
        help="resource.k8s.io versions to serve, comma-separated (default v1,v1beta2,v1beta1,v1alpha3)",
    )
    parser.add_argument(
        "--taint-rule-versions",
        type=_versions,
        default=None,
        help="versions that serve DeviceTaintRule, or 'none' (default v1,v1beta2,v1alpha3)",
    )
    parser.add_argument(
        "--control-plane", action="store_true", help="also run the simulated scheduler and resourceclaim controller"
    )
    parser.add_argument(
        "--node",
        type=_parse_node,
        action="append",
        default=[],
        help="run a simulated node NAME (kubelet + DRA driver) over the simulated GPUs in "
        "DIR, NAME=DIR (repeatable; DIR from sanitizer_agent.gpu.simulated.create_inventory)",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    server = ApiServer(
        port=args.port,
        state_dir=args.state_dir,
        surface=surface_from_args(args.resource_versions, args.taint_rule_versions),
        tokens=load_token_file(args.token_file) if args.token_file else None,
        default_user=args.default_user,
        services=ServiceMap(dict(args.service), args.services_file),
        control_plane=args.control_plane,
        nodes=dict(args.node),
    ).start()
    if args.port_file:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(server.port))
        tmp.replace(args.port_file)
    print(f"devcluster: serving the Kubernetes API stand-in on {server.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
