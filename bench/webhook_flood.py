"""Small requests under a flood of heavy ones: the latency of a small `/mutate` while heavy requests are in flight.

Starts `scrubgate webhook` as its own process (TLS, default policy, hash-chained audit log), then over loopback:

  1. baseline: one connection sends small ResourceClaim CREATEs to /mutate, one after another (from a process
     of its own, so that the flood's client does not delay them);
  2. flood: the same, while `--heavy` connections (48) each send, one after another, a dry-run Pod CREATE of
     about 2 MB with 25,000 tolerations of scrubgate's fence to /validate (legal to send; denied by SG005).

Every request carries `?timeout=5s`, as the API server sends the webhooks' timeoutSeconds. Prints p50/p99/max
of the small requests in each phase, how many heavy requests were answered (and their p50) or refused (503:
their timeout passed before the worker got to them), and the audit log's size.

    .venv/bin/python bench/webhook_flood.py [--heavy 48] [--seconds 20]

With `--refusals N` it measures the audit log instead: one tenant (64 ServiceAccounts of one namespace) sends N
refused dry runs, each worded differently (a new name, 1 to 20 tolerations of scrubgate's taints with keys never
used before, a pod or a claim), over 16 connections, to a webhook with the shipped audit log settings (16 MiB,
10 backups); prints the records written, their bytes and the files rotated.

    .venv/bin/python bench/webhook_flood.py --refusals 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scrubgate.certs.generate import generate_ca, issue_serving_cert, write_tls_dir

HOST = "scrubgate-webhook.scrubgate-system.svc"
TOLERATION = {"key": "scrubgate.dev/unsanitized", "operator": "Exists", "effect": "NoSchedule"}


def review(obj: dict, group: str, resource: str, dry_run: bool = False, username: str = "alice") -> bytes:
    version = obj["apiVersion"].split("/")[-1]
    gvk = {"group": group, "version": version, "kind": obj["kind"]}
    gvr = {"group": group, "version": version, "resource": resource}
    request = {
        "uid": str(uuid.uuid4()),
        "kind": gvk,
        "resource": gvr,
        "requestKind": gvk,
        "requestResource": gvr,
        "namespace": "team-a",
        "operation": "CREATE",
        "userInfo": {"username": username, "groups": ["system:authenticated"]},
        "object": obj,
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
    }
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def small_claim() -> bytes:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"generateName": "trainer-gpu-", "namespace": "team-a"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }
    return review(claim, "resource.k8s.io", "resourceclaims")


def gpu_pod(tolerations: list[dict]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "heavy", "namespace": "team-a"},
        "spec": {
            "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            "terminationGracePeriodSeconds": 30,
            "tolerations": tolerations,
        },
    }


def heavy_pod(tolerations: int) -> bytes:
    pod = gpu_pod([dict(TOLERATION, value=f"tenant-{i:06d}") for i in range(tolerations)])
    return review(pod, "", "pods", dry_run=True)


def varied_refusal(i: int) -> bytes:
    """The i-th of one tenant's refused dry runs: its namespace's ServiceAccounts in turn, a pod or a claim, and
    every message new (toleration keys never used before, 1 to 20 of them)."""
    tolerations = [{"key": f"scrubgate.dev/probe-{i}-{j}", "operator": "Exists"} for j in range(1 + i % 20)]
    username = f"system:serviceaccount:team-a:probe-{i % 64}"
    meta = {"name": f"probe-{i}", "namespace": "team-a"}
    if (i // 64) % 2:
        request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "tolerations": tolerations}}
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta}
        claim["spec"] = {"devices": {"requests": [request]}}
        return review(claim, "resource.k8s.io", "resourceclaims", dry_run=True, username=username)
    pod = gpu_pod(tolerations)
    pod["metadata"] = meta
    return review(pod, "", "pods", dry_run=True, username=username)


def http_request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> float:
    started = time.perf_counter()
    ok, _ = await answer(reader, writer, request)
    # Any other answer (a 503 for a request whose timeout passed before its turn) is a refusal: infinitely slow.
    return time.perf_counter() - started if ok else math.inf


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[bool, bytes]:
    """Whether the answer was a 200, and its body."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    return head.startswith(b"HTTP/1.1 200"), await reader.readexactly(length)


async def connect(port: int, context: ssl.SSLContext) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=HOST, limit=1 << 24)


async def loop_requests(port: int, context: ssl.SSLContext, request: bytes, until: float, out: list[float]) -> None:
    """Sends `request` again and again until `until`; a request the server refuses or drops (its connection
    closed, as uvicorn does when its event loop was held past the keep-alive timeout) counts as infinitely slow."""
    while time.perf_counter() < until:
        reader, writer = await connect(port, context)
        try:
            while time.perf_counter() < until:
                out.append(await exchange(reader, writer, request))
        except (asyncio.IncompleteReadError, ConnectionError):
            out.append(math.inf)
        finally:
            writer.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def probe(port: int, ca: str, seconds: float, results: multiprocessing.Queue) -> None:
    """The small requests, from a process of their own, so that the flood's client does not delay them."""
    context = ssl.create_default_context(cafile=ca)
    latencies: list[float] = []
    asyncio.run(
        loop_requests(
            port, context, http_request("/mutate?timeout=5s", small_claim()), time.perf_counter() + seconds, latencies
        )
    )
    results.put(latencies)


def probed(port: int, ca: str, seconds: float) -> tuple[multiprocessing.Process, multiprocessing.Queue]:
    results: multiprocessing.Queue = multiprocessing.Queue()
    process = multiprocessing.Process(target=probe, args=(port, ca, seconds, results))
    process.start()
    return process, results


async def flood(port: int, context: ssl.SSLContext, args: argparse.Namespace, out: list[float]) -> None:
    heavy = http_request("/validate?timeout=5s", heavy_pod(args.tolerations))
    print(f"heavy request {len(heavy)} bytes", file=sys.stderr)
    until = time.perf_counter() + args.seconds + 2.0
    await asyncio.gather(*(loop_requests(port, context, heavy, until, out) for _ in range(args.heavy)))


def measure(port: int, ca: Path, args: argparse.Namespace) -> list[tuple[str, list[float], list[float]]]:
    process, results = probed(port, str(ca), args.seconds / 4)
    baseline = results.get()
    process.join()
    heavy: list[float] = []
    context = ssl.create_default_context(cafile=str(ca))

    async def both() -> list[float]:
        flooding = asyncio.create_task(flood(port, context, args, heavy))
        await asyncio.sleep(1.0)  # let the heavy requests pile up first
        process, results = probed(port, str(ca), args.seconds)
        small = await asyncio.get_running_loop().run_in_executor(None, results.get)
        process.join()
        await flooding
        return small

    small = asyncio.run(both())
    return [("baseline", baseline, []), (f"{args.heavy} heavy in flight", small, heavy)]


async def send_refusals(port: int, context: ssl.SSLContext, count: int, connections: int = 16) -> int:
    """Sends the `count` varied refused dry runs over `connections` connections; how many were refused."""
    requests = iter(range(count))
    refused = 0

    async def worker() -> None:
        nonlocal refused
        reader, writer = await connect(port, context)
        try:
            for i in requests:
                ok, body = await answer(reader, writer, http_request("/validate?timeout=5s", varied_refusal(i)))
                refused += ok and json.loads(body)["response"]["allowed"] is False
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return refused


def audit_files(audit: Path) -> list[Path]:
    return [path for path in [audit, *audit.parent.glob(audit.name + ".*")] if path.exists()]


def measure_refusals(port: int, ca: Path, audit: Path, count: int) -> None:
    refused = asyncio.run(send_refusals(port, ssl.create_default_context(cafile=str(ca)), count))
    files = audit_files(audit)
    records = sum(len(path.read_bytes().splitlines()) for path in files)
    size = sum(path.stat().st_size for path in files)
    print("| dry runs sent | refused | audit records | audit bytes | files rotated |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| {count:,} | {refused:,} | {records:,} | {size:,} | {len(files) - 1} |")


@contextmanager
def webhook(work: Path, audit_max_bytes: int | None) -> Iterator[tuple[int, Path, Path]]:
    """`scrubgate webhook` as its own process, TLS on a free loopback port: the port, its CA and its audit log."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devcluster: the harness at the repo root
    from devcluster.processes import free_port

    scrubgate = shutil.which("scrubgate", path=str(Path(sys.executable).parent)) or "scrubgate"
    ca = generate_ca()
    tls = write_tls_dir(work / "tls", ca, issue_serving_cert(ca, [HOST, "127.0.0.1"]))
    port = free_port()
    audit = work / "audit.jsonl"
    command = [scrubgate, "webhook", "--tls-cert", str(tls.tls_cert), "--tls-key", str(tls.tls_key),
               "--host", "127.0.0.1", "--port", str(port), "--audit-log", str(audit)]  # fmt: skip
    if audit_max_bytes is not None:
        command += ["--audit-max-bytes", str(audit_max_bytes)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the webhook did not start") from None
                time.sleep(0.1)
        yield port, tls.ca_cert, audit
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still working through the flood
            server.kill()
            server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heavy", type=int, default=48, help="heavy requests in flight (default 48)")
    parser.add_argument("--tolerations", type=int, default=25_000, help="tolerations per heavy pod (default 25000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the flood (default 20)")
    parser.add_argument("--refusals", type=int, default=0, help="measure the audit log under N varied refused dry runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scrubgate-flood-") as tmp:
        if args.refusals:
            with webhook(Path(tmp), None) as (port, ca, audit):  # the shipped rotation: 16 MiB, 10 backups
                measure_refusals(port, ca, audit, args.refusals)
            return 0
        with webhook(Path(tmp), 1 << 30) as (port, ca, audit):
            phases = measure(port, ca, args)
        audit_bytes = audit.stat().st_size if audit.exists() else 0
    print(
        "| phase | small /mutate | refused | p50 ms | p99 ms | max ms | heavy answered | heavy refused | answered p50 s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, small, heavy in phases:
        answered = [h for h in heavy if h != math.inf]
        heavy_cells = (
            f"{len(answered)} | {len(heavy) - len(answered)} | {percentile(answered, 0.5):.2f}"
            if heavy
            else "- | - | -"
        )
        print(
            f"| {name} | {len(small)} | {small.count(math.inf)} | {percentile(small, 0.5) * 1e3:.1f} | "
            f"{percentile(small, 0.99) * 1e3:.1f} | {max(small) * 1e3:.1f} | {heavy_cells} |"
        )
    print(f"\naudit log: {audit_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
