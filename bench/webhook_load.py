"""Load benchmark of the admission webhook against a no-op endpoint on the same stack.

Starts two servers, one after the other, each in its own process with the same uvicorn + TLS
settings (one worker, scrubgate.webhook.server.build_server): the real webhook (default policy,
hash-chained audit log) and a no-op ASGI app that reads the body, decodes nothing and answers
`allowed`. This process drives both with the same load over loopback: N keep-alive HTTPS
connections, each sending the next request when the previous answer arrived, a round-robin mix of

  Pod CREATE -> /mutate (default grace period patch)      Pod CREATE -> /validate
  ResourceClaim CREATE (generated) -> /mutate (finalizer)  ResourceClaim CREATE -> /validate
  ResourceClaim UPDATE (allocation written) -> /validate

and prints requests/s and p50/p99/p99.9 latency of each, and the ratios. Both servers run at once
and the measured rounds alternate between them, so that other load on the machine falls on both alike.

    .venv/bin/python bench/webhook_load.py [--connections 32] [--requests 8000] [--record]

`--record` appends the table, the machine and the command to bench/RESULTS.md ("Webhook load").
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "RESULTS.md"
HEADING = "## Webhook load"


# -- the servers (child processes) ---------------------------------------------------------------------

NOOP_BODY = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"","allowed":true}}'


async def noop_app(scope: dict, receive: Any, send: Any) -> None:
    """Answers `allowed` to everything; reads the body so that the transfer costs the same."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(NOOP_BODY)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": NOOP_BODY})


def serve(kind: str, workdir: Path, port_file: Path) -> None:
    import logging

    from scrubgate.webhook.app import create_app
    from scrubgate.webhook.server import Settings, build, build_server, configure_logging

    configure_logging(logging.WARNING)
    settings = Settings(
        tls_cert=workdir / "tls.crt", tls_key=workdir / "tls.key", audit_log=workdir / f"audit-{os.getpid()}.jsonl"
    )
    state, audit = build(settings)
    app = create_app(state) if kind == "scrubgate" else noop_app
    server = build_server(app, state.tls.context, "127.0.0.1", 0)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
                raise SystemExit("server did not start")
            await asyncio.sleep(0.01)
        # The port, and the settings uvicorn really runs with, so that the report can show both servers
        # run alike. Written whole, then renamed: the parent polls for the file.
        config = server.config
        started = {
            "port": server.servers[0].sockets[0].getsockname()[1],
            "uvicorn": {
                "http": config.http_protocol_class.__name__,
                "http implementation": next(
                    c.__module__ for c in config.http_protocol_class.__mro__ if c.__module__.startswith("uvicorn.")
                ),
                "loop": type(asyncio.get_running_loop()).__name__,
                "app wrapper": type(config.loaded_app).__name__,
                "workers": config.workers,
                "access_log": config.access_log,
                "tls": config.ssl is not None,
            },
        }
        partial = port_file.with_suffix(".partial")
        partial.write_text(json.dumps(started))
        partial.replace(port_file)
        await task

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on
        pass
    finally:
        if audit is not None:
            audit.close()


# -- payloads ------------------------------------------------------------------------------------------

GPU_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "trainer-7d9f",
        "namespace": "team-a",
        "uid": "8f7e3c1a-0d7a-4c1e-9b8e-1f2d3c4b5a69",
        "labels": {"app": "trainer", "pod-template-hash": "7d9f"},
        "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "trainer-7d9f", "uid": "r5", "controller": True}
        ],
    },
    "spec": {
        "containers": [
            {
                "name": "main",
                "image": "registry.example/trainer:1.4.2",
                "args": ["--epochs", "40", "--batch-size", "512"],
                "env": [{"name": f"VAR_{i}", "value": f"value-{i}"} for i in range(12)],
                "resources": {"claims": [{"name": "gpu"}], "requests": {"cpu": "8", "memory": "64Gi"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            },
            {"name": "sidecar", "image": "registry.example/metrics:2", "resources": {"requests": {"cpu": "100m"}}},
        ],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "dataset"}}],
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}],
        "restartPolicy": "Never",
        "serviceAccountName": "trainer",
    },
}

CLAIM = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {
        "generateName": "trainer-7d9f-gpu-",
        "namespace": "team-a",
        "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Pod", "name": "trainer-7d9f", "uid": "8f7e", "controller": True}
        ],
    },
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
}


def _review(obj: dict, operation: str, group: str, resource: str, old: dict | None = None, user: str = "") -> dict:
    kind = {"group": group, "version": obj["apiVersion"].rsplit("/", 1)[-1], "kind": obj["kind"]}
    gvr = {"group": group, "version": kind["version"], "resource": resource}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "00000000-0000-4000-8000-000000000000",
            "kind": kind,
            "resource": gvr,
            "requestKind": kind,
            "requestResource": gvr,
            "name": obj["metadata"].get("name", ""),
            "namespace": "team-a",
            "operation": operation,
            "userInfo": {"username": user or "system:serviceaccount:kube-system:replicaset-controller"},
            "object": obj,
            "oldObject": old,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.capitalize()}Options"},
        },
    }


def payloads() -> list[tuple[str, bytes]]:
    pod_no_grace = copy.deepcopy(GPU_POD)
    pod = copy.deepcopy(GPU_POD)
    pod["spec"]["terminationGracePeriodSeconds"] = 60
    claim = copy.deepcopy(CLAIM)
    claim["metadata"].update(name="trainer-7d9f-gpu-x2k4q", uid="c1a1", finalizers=["scrubgate.dev/sanitize"])
    allocated = copy.deepcopy(claim)
    allocated["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}]}
        },
        "reservedFor": [{"resource": "pods", "name": "trainer-7d9f", "uid": "8f7e"}],
    }
    mix = [
        ("/mutate", _review(pod_no_grace, "CREATE", "", "pods")),
        ("/validate", _review(pod, "CREATE", "", "pods")),
        ("/mutate", _review(copy.deepcopy(CLAIM), "CREATE", "resource.k8s.io", "resourceclaims")),
        ("/validate", _review(claim, "CREATE", "resource.k8s.io", "resourceclaims")),
        (
            "/validate",
            _review(allocated, "UPDATE", "resource.k8s.io", "resourceclaims", old=claim, user="system:kube-scheduler"),
        ),
    ]
    return [(path, json.dumps(body, separators=(",", ":")).encode()) for path, body in mix]


# -- the load (this process) -----------------------------------------------------------------------------


@dataclass
class Run:
    latencies: list[float]
    seconds: float
    errors: int
    server_cpu: float = 0.0  # CPU seconds the server process spent on these requests

    @property
    def cpu_per_request_us(self) -> float:
        return self.server_cpu / len(self.latencies) * 1e6

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: scrubgate-webhook.scrubgate-system.svc\r\n"
        f"Content-Type: application/json\r\nAccept: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Load:
    """`connections` keep-alive HTTPS connections to one server, each sending its next request when
    the previous answer has arrived. Opened once, so that rounds measure requests, not handshakes."""

    def __init__(self, port: int, ca: Path, connections: int) -> None:
        self.port, self.connections = port, connections
        self.context = ssl.create_default_context(cafile=str(ca))
        self.work = [_request(path, body) for path, body in payloads()]
        self.streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self) -> None:
        self.streams = [
            await asyncio.open_connection(
                "127.0.0.1", self.port, ssl=self.context, server_hostname="scrubgate-webhook.scrubgate-system.svc"
            )
            for _ in range(self.connections)
        ]

    async def close(self) -> None:
        for _, writer in self.streams:
            writer.close()

    async def run(self, requests: int, limit_s: float) -> Run:
        result = Run([], 0.0, 0)
        counter = [0]
        deadline = time.perf_counter() + limit_s

        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while counter[0] < requests and time.perf_counter() < deadline:
                index = counter[0]
                counter[0] += 1
                started = time.perf_counter()
                writer.write(self.work[index % len(self.work)])
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                result.latencies.append(time.perf_counter() - started)
                if not head.startswith(b"HTTP/1.1 200") or b'"allowed":true' not in body:
                    result.errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(connection(reader, writer) for reader, writer in self.streams))
        result.seconds = time.perf_counter() - started
        return result


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def interleaved(
    ports: dict[str, int], pids: dict[str, int], ca: Path, args: argparse.Namespace
) -> dict[str, Run]:
    """Warms both servers up, then alternates rounds between them, so that load from elsewhere on the
    machine falls on both alike."""
    loads = {name: Load(port, ca, args.connections) for name, port in ports.items()}
    totals = {name: Run([], 0.0, 0) for name in ports}
    try:
        for load in loads.values():
            await load.open()
            await load.run(args.warmup, args.limit_seconds)
        per_round = max(args.connections, args.requests // args.rounds)
        for _ in range(args.rounds):
            for name, load in loads.items():
                cpu = cpu_seconds(pids[name])
                run = await load.run(per_round, args.limit_seconds / args.rounds)
                totals[name].server_cpu += cpu_seconds(pids[name]) - cpu
                totals[name].latencies += run.latencies
                totals[name].seconds += run.seconds
                totals[name].errors += run.errors
    finally:
        for load in loads.values():
            await load.close()
    return totals


def start_server(kind: str, workdir: Path) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Starts one server process; returns it and what it reported: its port and its uvicorn settings."""
    port_file = workdir / f"{kind}.port"
    port_file.unlink(missing_ok=True)
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--workdir", str(workdir), "--port-file", str(port_file)]
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the {kind} server did not start")
        time.sleep(0.05)
    return process, json.loads(port_file.read_text())


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def describe_uvicorn(settings: dict[str, Any]) -> str:
    return (
        f"uvicorn {settings['workers']} worker, {settings['http']} ({settings['http implementation']}) on "
        f"{settings['loop']}, app wrapped in "
        f"{settings['app wrapper']}, access log {'on' if settings['access_log'] else 'off'}, "
        f"TLS {'on' if settings['tls'] else 'off'}"
    )


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs visible, Linux {platform.release()}, Python {platform.python_version()}"


def table(noop: Run, real: Run) -> str:
    ms = 1000.0
    rows = [
        ("requests/s", f"{noop.rps:.0f}", f"{real.rps:.0f}", f"{real.rps / noop.rps:.2f}"),
        *(
            (
                label,
                f"{noop.percentile(q) * ms:.2f}",
                f"{real.percentile(q) * ms:.2f}",
                f"{real.percentile(q) / noop.percentile(q):.2f}",
            )
            for label, q in (("p50 ms", 0.50), ("p99 ms", 0.99), ("p99.9 ms", 0.999))
        ),
        (
            "server CPU µs/request",
            f"{noop.cpu_per_request_us:.0f}",
            f"{real.cpu_per_request_us:.0f}",
            f"{real.cpu_per_request_us / noop.cpu_per_request_us:.2f}",
        ),
        ("requests (errors)", f"{len(noop.latencies)} ({noop.errors})", f"{len(real.latencies)} ({real.errors})", ""),
    ]
    lines = ["| metric | no-op | scrubgate | scrubgate / no-op |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def verdict(noop: Run, real: Run) -> str:
    p99 = real.percentile(0.99) / noop.percentile(0.99)
    rps = real.rps / noop.rps
    return (
        f"goal p99 <= 1.5x no-op: {p99:.2f}x ({'met' if p99 <= 1.5 else 'NOT met'}); "
        f"goal throughput >= 70% of no-op: {rps:.0%} ({'met' if rps >= 0.7 else 'NOT met'})"
    )


def record(text: str) -> None:
    """Adds `text` at the end of the "Webhook load" section; the other sections stay as they are."""
    existing = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if HEADING not in existing:
        existing = existing.rstrip("\n") + f"\n\n{HEADING}\n"
    start = existing.index(HEADING)
    end = existing.find("\n## ", start + len(HEADING))
    end = len(existing) if end == -1 else end + 1
    section = existing[start:end].rstrip("\n") + "\n\n" + text + "\n"
    rest = existing[end:]
    RESULTS.write_text(existing[:start] + section + ("\n" + rest if rest else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8000, help="measured requests per server")
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=8, help="alternating measured rounds per server")
    parser.add_argument("--limit-seconds", type=float, default=120.0, help="cap on the measured time per server")
    parser.add_argument("--record", action="store_true", help="append the results to bench/RESULTS.md")
    parser.add_argument("--serve", choices=["scrubgate", "noop"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.workdir, args.port_file)
        return 0

    from scrubgate.certs.generate import generate_ca, issue_serving_cert, write_tls_dir

    with tempfile.TemporaryDirectory(prefix="scrubgate-bench-") as tmp:
        workdir = Path(tmp)
        ca = generate_ca()
        files = write_tls_dir(workdir, ca, issue_serving_cert(ca, ["scrubgate-webhook.scrubgate-system.svc"]))
        servers = {kind: start_server(kind, workdir) for kind in ("noop", "scrubgate")}
        try:
            settings = {kind: started["uvicorn"] for kind, (_, started) in servers.items()}
            if settings["noop"] != settings["scrubgate"]:
                raise SystemExit(f"the two servers run with different uvicorn settings, no fair comparison: {settings}")
            ports = {kind: started["port"] for kind, (_, started) in servers.items()}
            pids = {kind: process.pid for kind, (process, _) in servers.items()}
            runs = asyncio.run(interleaved(ports, pids, files.ca_cert, args))
        finally:
            for process, _ in servers.values():
                stop_server(process)
    noop, real = runs["noop"], runs["scrubgate"]
    command = "python bench/webhook_load.py " + " ".join(a for a in sys.argv[1:] if a != "--record")
    report = "\n".join(
        [
            f"{time.strftime('%Y-%m-%d')}, {args.connections} connections, {len(real.latencies)} measured requests per "
            f"server in {args.rounds} alternating rounds after {args.warmup} warm-up, TLS 1.3, loopback, load "
            "generator in its own process.",
            f"Both servers: {describe_uvicorn(settings['noop'])}.",
            f"Machine: {machine()}. Command: `{command.strip()}`.",
            "",
            table(noop, real),
            "",
            verdict(noop, real),
        ]
    )
    print(report)
    if args.record:
        record(report)
    return 0 if noop.errors == 0 and real.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
