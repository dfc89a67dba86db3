"""GPU check for a machine with an NVIDIA GPU: does scrubgate's real backend leave nothing behind?

1. Kernel self-test: the verify kernels count planted non-zero words and canaries exactly.
2. With the agent's scrub: a tenant process fills N GiB with a canary and exits; the real backend
   scrubs the device; a probe process allocates all it can and counts canary words (must be 0).
3. Without it: the same tenant, then the probe at once. Canary words found here mean the kernel
   driver handed one process's memory to the next unscrubbed (scrub-on-free off or absent).
4. Bandwidth: scrub GB/s (zero + verify) against a device-to-device copy on the same card.

It changes no GPU setting (no reset, persistence, power or MIG change) and allocates with plain
cuMemAlloc. Prints a table; writes the JSON report to --out or $OUT when set. Exit 0 when the scrub
verified and the probe found no canary after it, 1 otherwise.

Runs from a checkout without installing scrubgate (python3 tests/gpu/gpu_check.py); needs
nvidia-ml-py and cuda-bindings. Against the fakes in tests/fakes it runs without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CANARY = 0x5CB6A7E1
GiB = 1 << 30


def import_backend() -> Any:
    """scrubgate's GPU package, installed or straight from this checkout (whose other packages and
    their dependencies a GPU machine may lack: their __init__ files are not run)."""
    try:
        from scrubgate.sanitizer_agent import gpu
    except ImportError:
        for name, folder in (
            ("scrubgate", "scrubgate"),
            ("scrubgate.policies", "policies"),
            ("scrubgate.sanitizer_agent", "sanitizer_agent"),
        ):
            package = types.ModuleType(name)
            package.__path__ = [str(REPO / folder)]
            sys.modules[name] = package
        from scrubgate.sanitizer_agent import gpu
    return gpu


# ---------------------------------------------------------------- child roles (one CUDA process each)


def role_selftest(cuda: Any, args: argparse.Namespace) -> dict[str, Any]:
    ctx = cuda.open()
    size = args.bytes
    ptr = int(cuda.call("cuMemAlloc", size))
    ctx.chunks.append((ptr, size))
    cuda.call("cuMemsetD8", ptr, 0, size)
    clean = ctx.count_nonzero_words()
    # One non-zero byte in words spread over the buffer: the first, the last byte, and words that
    # the verify kernel's unrolled loop and its tail each read.
    planted = (0, (1 << 20) + 5, size // 4 + 7, size // 2 + 9, 3 * size // 4 + 11, size - 1)
    for offset in planted:
        cuda.call("cuMemsetD8", ptr + offset, 0xA5, 1)
    found = ctx.count_nonzero_words()
    cuda.call("cuMemsetD32", ptr + 4096, CANARY, 1000)
    canaries = ctx.count_equal_u32(CANARY)
    ok = clean == 0 and found == len(planted) and canaries == 1000
    return {"ok": ok, "cleanWords": clean, "plantedWords": len(planted), "foundWords": found, "canaryWords": canaries}


def role_tenant(cuda: Any, args: argparse.Namespace) -> dict[str, Any]:
    cuda.open()
    remaining, filled = args.bytes, 0
    while remaining > 0:
        size = min(remaining, args.chunk_bytes)
        ptr = int(cuda.call("cuMemAlloc", size))
        cuda.call("cuMemsetD32", ptr, CANARY, size // 4)
        filled += size // 4 * 4
        remaining -= size
    cuda.call("cuCtxSynchronize")
    # Exit without freeing: the driver reclaims the memory as it does for any tenant that ends.
    return {"bytesFilled": filled}


def role_probe(cuda: Any, args: argparse.Namespace) -> dict[str, Any]:
    # Warmed up read-only on a buffer it keeps: the probe must not zero what it looks for.
    ctx = cuda.open(warm_up=False)
    ctx.warm_up(zero=False, keep=True)
    ctx.allocate_all(args.chunk_bytes, args.min_chunk_bytes)
    return {
        "bytesProbed": sum(size for _, size in ctx.chunks),
        "canaryWords": ctx.count_equal_u32(CANARY),
        "nonzeroWords": ctx.count_nonzero_words(),
    }


def role_bandwidth(cuda: Any, args: argparse.Namespace) -> dict[str, Any]:
    ctx = cuda.open()
    size = args.bytes
    src, dst = int(cuda.call("cuMemAlloc", size)), int(cuda.call("cuMemAlloc", size))
    cuda.call("cuMemsetD8", src, 1, size)
    cuda.call("cuMemcpyDtoD", dst, src, size)  # warm-up
    cuda.call("cuCtxSynchronize")
    started = time.perf_counter()
    for _ in range(args.iterations):
        cuda.call("cuMemcpyDtoD", dst, src, size)
    cuda.call("cuCtxSynchronize")
    copy_s = time.perf_counter() - started
    ctx.chunks.append((dst, size))
    started = time.perf_counter()
    for _ in range(args.iterations):
        cuda.call("cuMemsetD8", dst, 0, size)
        nonzero = ctx.count_nonzero_words()  # synchronises
    scrub_s = time.perf_counter() - started
    moved = size * args.iterations
    return {
        "bytes": size,
        "iterations": args.iterations,
        "copyGBps": moved / copy_s / 1e9,
        "scrubGBps": moved / scrub_s / 1e9,
        "nonzeroWords": nonzero,
    }


ROLES = {"selftest": role_selftest, "tenant": role_tenant, "probe": role_probe, "bandwidth": role_bandwidth}


def run_role(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--bytes", type=int, default=0)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    parser.add_argument("--min-chunk-bytes", type=int, required=True)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)
    import_backend()
    from scrubgate.sanitizer_agent.gpu import cuda_scrub

    try:
        report = ROLES[args.role](cuda_scrub.Cuda(cuda_scrub.load_driver()), args)
    except cuda_scrub.CudaError as exc:
        report = {"error": str(exc)}
    print(json.dumps(report))
    return 1 if "error" in report else 0


# ---------------------------------------------------------------- the check


class Check:
    def __init__(self, args: argparse.Namespace, gpu: Any) -> None:
        self.args = args
        self.gpu = gpu

    def child(self, role: str, uuid: str, **options: int) -> dict[str, Any]:
        command = [
            sys.executable,
            __file__,
            role,
            f"--chunk-bytes={self.args.chunk_bytes}",
            f"--min-chunk-bytes={self.args.min_chunk_bytes}",
            *(f"--{k.replace('_', '-')}={v}" for k, v in options.items()),
        ]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=self.args.timeout)
        lines = done.stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1])
        except (IndexError, ValueError):
            report = {"error": f"{role} exited {done.returncode}: {done.stderr.strip()[-800:]}"}
        if "error" in report:
            raise SystemExit(f"gpu_check: {role} on {uuid} failed: {report['error']}")
        return report

    def wait_idle(self, backend: Any, uuid: str) -> None:
        """The agent drains before it scrubs: wait until the driver has let go of the tenant."""
        deadline = time.monotonic() + self.args.timeout
        while backend.processes(uuid):
            if time.monotonic() > deadline:
                raise SystemExit(f"gpu_check: {uuid} still lists processes after the tenant exited")
            time.sleep(0.1)

    def pick_device(self, backend: Any) -> Any:
        devices = backend.list_devices()
        if self.args.device:
            chosen = [d for d in devices if d.uuid == self.args.device]
        else:
            # A device CUDA can address whole: a GPU without MIG devices, or a MIG device.
            parents = {d.parent_uuid for d in devices}
            chosen = [d for d in devices if d.uuid not in parents]
        if not chosen:
            raise SystemExit(f"gpu_check: no usable device among {[d.uuid for d in devices]}")
        return chosen[0]

    def run(self) -> dict[str, Any]:
        args = self.args
        backend = self.gpu.open_backend(
            "nvml", chunk_bytes=args.chunk_bytes, min_chunk_bytes=args.min_chunk_bytes, watch_xids=False
        )
        try:
            device = self.pick_device(backend)
            uuid = device.uuid
            busy = backend.processes(uuid)
            if busy:
                raise SystemExit(f"gpu_check: {uuid} is in use by pid {[p.pid for p in busy]}; pick an idle GPU")
            tenant_bytes = min(int(args.tenant_gib * GiB), device.memory_free // 2) // 4 * 4
            report: dict[str, Any] = {
                "device": asdict(device),
                "scrubOnFreeDisabled": backend.scrub_on_free_disabled(),
                "tenantBytes": tenant_bytes,
            }
            report["selftest"] = self.child("selftest", uuid, bytes=min(64 << 20, device.memory_free // 2))

            self.child("tenant", uuid, bytes=tenant_bytes)
            self.wait_idle(backend, uuid)
            scrub = backend.scrub(uuid)
            report["withScrub"] = {"scrub": asdict(scrub), "probe": self.child("probe", uuid)}

            self.child("tenant", uuid, bytes=tenant_bytes)
            self.wait_idle(backend, uuid)
            report["withoutScrub"] = {"probe": self.child("probe", uuid)}

            copy_bytes = min(int(args.copy_gib * GiB), device.memory_free // 4) // 16 * 16
            bandwidth = self.child("bandwidth", uuid, bytes=copy_bytes, iterations=args.iterations)
            whole_device = scrub.bytes_scrubbed / scrub.kernel_s / 1e9 if scrub.kernel_s else None
            bandwidth["wholeDeviceScrubGBps"] = whole_device
            bandwidth["scrubToCopy"] = bandwidth["scrubGBps"] / bandwidth["copyGBps"]
            bandwidth["meetsRateGoal"] = bandwidth["scrubToCopy"] >= 0.8
            report["bandwidth"] = bandwidth
        finally:
            backend.close()
        report["pass"] = bool(
            report["selftest"]["ok"] and scrub.verified and report["withScrub"]["probe"]["canaryWords"] == 0
        )
        return report


def table(report: dict[str, Any]) -> str:
    device, scrub = report["device"], report["withScrub"]["scrub"]
    after, without, bw = report["withScrub"]["probe"], report["withoutScrub"]["probe"], report["bandwidth"]
    leaked = without["canaryWords"] * 4
    driver = "driver did NOT scrub on free" if leaked else "driver scrubbed on free"
    reason = f" ({scrub['reason']})" if scrub["reason"] else ""
    rows = [
        ("device", f"{device['name']} {device['uuid']}"),
        ("memory total", f"{device['memory_total'] / GiB:.2f} GiB"),
        ("memory reserved", f"{device['memory_reserved'] / GiB:.3f} GiB"),
        ("RMDisableScrubOnFree", str(report["scrubOnFreeDisabled"])),
        ("kernel self-test", "ok" if report["selftest"]["ok"] else f"FAILED {report['selftest']}"),
        ("tenant canary", f"{report['tenantBytes'] / GiB:.2f} GiB"),
        ("agent scrub", f"verified={scrub['verified']}{reason}"),
        ("scrubbed", f"{scrub['bytes_scrubbed'] / GiB:.2f} GiB in {scrub['duration_s']:.2f} s wall"),
        ("unreachable by the scrub", f"{scrub['bytes_unreachable'] / GiB:.3f} GiB"),
        ("canary after agent scrub", f"{after['canaryWords'] * 4} bytes (must be 0)"),
        ("canary without agent scrub", f"{leaked} bytes ({driver})"),
        ("copy D2D", f"{bw['copyGBps']:.0f} GB/s ({bw['bytes'] / GiB:.2f} GiB x {bw['iterations']})"),
        ("scrub, same buffer", f"{bw['scrubGBps']:.0f} GB/s = {bw['scrubToCopy']:.0%} of copy (goal 80%)"),
        ("scrub, whole device", f"{bw['wholeDeviceScrubGBps'] or 0:.0f} GB/s (zero+verify, no allocation)"),
        ("result", "PASS" if report["pass"] else "FAIL"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ROLES:
        return run_role(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="GPU or MIG UUID (default: the first CUDA-addressable device)")
    parser.add_argument("--tenant-gib", type=float, default=16.0, help="canary the tenant leaves")
    parser.add_argument("--copy-gib", type=float, default=8.0, help="buffer size for the bandwidth test")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--chunk-bytes", type=int, default=4 * GiB)
    parser.add_argument("--min-chunk-bytes", type=int, default=2 << 20)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per child process")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json")
    args = parser.parse_args(argv)
    report = Check(args, import_backend()).run()
    print(table(report))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
