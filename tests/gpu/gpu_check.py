"""GPU check for a machine with an NVIDIA GPU: does scrubgate's real backend leave nothing behind?

One command, steps in order, each under its own time limit (--step-timeout) and all within --total-timeout
(under 5 minutes by default); the JSON report is written after every step, so a step that fails or hangs still
leaves the ones before it on record. A step stuck where no signal reaches it (a driver call that never returns)
is abandoned by a watchdog past its limit: the report says so, and the check exits 1.

1. open: the backend (with its XID watch of the kernel log), the device, the versions (driver, NVML, CUDA, the
   binding packages) and the card's settings the scrub depends on, read only: persistence mode, GSP firmware,
   architecture, MIG and ECC modes.
2. selftest: the verify kernels (cubin, else PTX, else none: the report says which) count planted words; the
   CUDA driver API's version; the agent's own start-up check of CUDA.
3. scrub: a tenant process fills N GiB with a canary and exits; the backend scrubs the device (warm-up,
   margin, second pass); a probe allocates all it can and counts canary words (must be 0). Coverage:
   bytes scrubbed, unreached and reserved; the scrub's device and wall time and its process's peak host
   memory. Then "resident": a canary in memory the check's own context still holds, which no driver setting
   zeroes, through the agent's zero-and-verify pass: none may be left.
4. no-scrub: the same tenant, then the probe at once: canary words found mean the kernel driver handed one
   process's memory to the next unscrubbed (scrub-on-free off). A default driver zeroes freed memory, so
   this alone cannot tell a working scrub from none: "resident" without the scrub must find every canary
   word it planted, or nothing in this check could have failed.
5. bandwidth: scrub GB/s (zero + verify) against a device-to-device copy on the same card (--rate-goal, 80%).
6. health: health() with the XID watcher on; any problem fails it.
7. kernel-log: the log the agent reads: its records, the gap before its first one, the driver's XID records,
   and whether it is the log of the kernel the NVIDIA driver runs in (the driver's load record against
   /proc/driver/nvidia/version). Reported, never failed: a machine may not let the check read it.
8. mig: where the GPU is already in MIG mode, the same canary/scrub/probe on an idle MIG device, through
   its placement as the agent scrubs it (read-only: the device exists, nothing is created). With
   --mig-scratch PROFILE:START:SIZE also the agent's path for a dynamic MIG device NVIDIA's driver has
   deleted: a GPU instance there for the tenant, destroyed, the agent's scratch instance and scrub, another
   for the probe. That creates and destroys GPU instances (never MIG mode: another MIG device must stay),
   so only where you may reconfigure MIG.

It changes no GPU setting (no reset, persistence, power or MIG change; no GPU instance unless --mig-scratch)
and allocates with plain cuMemAlloc. Prints a table; writes gpu_check.json to --out or $OUT when set. Exit 0 on
PASS (every step ok: self-test, scrub verified with no canary after it, the resident canary found without the
scrub and gone with it, scrub rate at least --rate-goal of the copy rate, health, MIG), 1 otherwise.

Runs from a checkout without installing scrubgate (python3 tests/gpu/gpu_check.py); needs
nvidia-ml-py and cuda-bindings. Against the fakes in tests/fakes it runs without a GPU (make test does).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CANARY = 0x5CB6A7E1
GiB = 1 << 30
STEPS = ("open", "selftest", "scrub", "no-scrub", "bandwidth", "health", "kernel-log", "mig")
# How long past its limit a step stuck where no signal reaches it is waited for before the check gives up on it.
GRACE_S = 5.0


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
    return {
        "ok": ok,
        "cudaDriverVersion": cuda.call("cuDriverGetVersion"),
        "kernels": ctx.kernels,
        "kernelErrors": ctx.kernel_errors,
        "cleanWords": clean,
        "plantedWords": len(planted),
        "foundWords": found,
        "canaryWords": canaries,
    }


def plant_canary(cuda: Any, size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """`size` bytes of canary in the current context, in chunks of at most `chunk_bytes`; returns them."""
    chunks = []
    while size > 0:
        length = min(size, chunk_bytes)
        ptr = int(cuda.call("cuMemAlloc", length))
        cuda.call("cuMemsetD32", ptr, CANARY, length // 4)
        chunks.append((ptr, length))
        size -= length
    cuda.call("cuCtxSynchronize")
    return chunks


def role_tenant(cuda: Any, args: argparse.Namespace) -> dict[str, Any]:
    cuda.open()
    chunks = plant_canary(cuda, args.bytes, args.chunk_bytes)
    # Exit without freeing: the driver reclaims the memory as it does for any tenant that ends.
    return {"bytesFilled": sum(size for _, size in chunks)}


def role_resident(cuda: Any, args: argparse.Namespace) -> dict[str, Any]:
    """A canary this context keeps allocated: the driver's scrub-on-free never touches it, so counting it
    without --scrub shows what the probe sees when nothing scrubs; with --scrub, the agent's pass runs on it."""
    from scrubgate.sanitizer_agent.gpu import cuda_scrub

    ctx = cuda.open()
    ctx.chunks += plant_canary(cuda, args.bytes, args.chunk_bytes)
    report: dict[str, Any] = {"plantedWords": sum(size for _, size in ctx.chunks) // 4}
    if args.scrub:
        report["nonzeroWords"] = cuda_scrub.zero_and_verify(ctx, ctx.chunks)
    report["canaryWords"] = ctx.count_equal_u32(CANARY)
    return report


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


ROLES = {
    "selftest": role_selftest,
    "tenant": role_tenant,
    "resident": role_resident,
    "probe": role_probe,
    "bandwidth": role_bandwidth,
}


def run_role(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--bytes", type=int, default=0)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    parser.add_argument("--min-chunk-bytes", type=int, required=True)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--scrub", type=int, default=0)
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


class StepFailed(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds`: a step of this process (NVML, the backend's scrub) cannot run on."""

    def expired(*_: object) -> None:
        raise StepFailed(f"timed out: did not finish within {seconds:.1f}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Check:
    def __init__(self, args: argparse.Namespace, gpu: Any) -> None:
        self.args = args
        self.gpu = gpu
        self.deadline = time.monotonic() + args.total_timeout
        self.report: dict[str, Any] = {
            "steps": {},
            "pass": False,
            "limits": {"totalS": args.total_timeout, "stepS": args.step_timeout, "graceS": GRACE_S},
        }
        self.backend: Any = None
        self.device: Any = None
        # Beside this file; it imports scrubgate's GPU package, importable once `gpu` is.
        self.facts = importlib.import_module("gpu_facts")
        self._running: tuple[str, float, float] | None = None  # the step under way: name, start, limit
        self._done = threading.Event()

    # ------------------------------------------------------------ plumbing

    def limit(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise StepFailed(f"timed out: no time left of --total-timeout {self.args.total_timeout:.0f}s")
        return min(self.args.step_timeout, left)

    def save(self) -> None:
        if self.args.out:
            Path(self.args.out).mkdir(parents=True, exist_ok=True)
            (Path(self.args.out) / "gpu_check.json").write_text(json.dumps(self.report, indent=2))

    def watchdog(self) -> None:
        """A step past its limit by GRACE_S is stuck where SIGALRM does not reach (a driver call that does not
        return): record it as hung, with the report so far, and end the process."""
        while not self._done.wait(0.2):
            running = self._running
            if running is None or time.monotonic() < running[1] + running[2] + GRACE_S:
                continue
            name, started, limit = running
            self.report["steps"][name] = {
                "ok": False,
                "error": f"{name}: hung past its {limit:.0f}s limit where no signal reaches it (a call into the "
                "driver that does not return); abandoned with the steps after it",
                "seconds": round(time.monotonic() - started, 3),
            }
            self.report["pass"] = False
            try:
                self.save()
                print(table(self.report), flush=True)
            finally:
                os._exit(1)

    def step(self, name: str, run: Callable[[], dict[str, Any] | None]) -> bool:
        """Runs one step under its time limit; records it (and saves the report) whatever happens."""
        started = time.monotonic()
        entry: dict[str, Any] = {}
        try:
            limit = self.limit()
            self._running = (name, started, limit)
            with time_limit(limit):
                entry.update(run() or {})
            entry.setdefault("ok", True)
        except StepFailed as exc:
            entry.update(ok=False, error=f"{name}: {exc}")
        except subprocess.TimeoutExpired as exc:
            entry.update(ok=False, error=f"{name}: timed out: {exc}")
        except Exception as exc:  # a failed step must not lose the report of the others
            entry.update(ok=False, error=f"{name}: {type(exc).__name__}: {exc}")
        self._running = None
        entry["seconds"] = round(time.monotonic() - started, 3)
        self.report["steps"][name] = entry
        self.save()
        return bool(entry["ok"])

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
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=self.limit())
        lines = done.stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1])
        except (IndexError, ValueError):
            report = {"error": f"exited {done.returncode}: {done.stderr.strip()[-800:]}"}
        if "error" in report:
            raise StepFailed(f"{role} on {uuid} failed: {report['error']}")
        return report

    def wait_idle(self, uuid: str) -> None:
        """The agent drains before it scrubs: wait until the driver has let go of the tenant."""
        while self.backend.processes(uuid):
            time.sleep(0.1)

    def tenant_bytes(self, uuid: str) -> int:
        free = next(d.memory_free for d in self.backend.list_devices() if d.uuid == uuid)
        return min(int(self.args.tenant_gib * GiB), free // 2) // 4 * 4

    def pick_device(self) -> Any:
        devices = self.backend.list_devices()
        if self.args.device:
            chosen = [d for d in devices if d.uuid == self.args.device]
        else:
            # A device CUDA can address whole: a GPU without MIG devices, or a MIG device.
            parents = {d.parent_uuid for d in devices}
            chosen = [d for d in devices if d.uuid not in parents]
        if not chosen:
            raise StepFailed(f"no usable device among {[d.uuid for d in devices]}")
        busy = self.backend.processes(chosen[0].uuid)
        if busy:
            raise StepFailed(f"{chosen[0].uuid} is in use by pid {[p.pid for p in busy]}; pick an idle GPU")
        return chosen[0]

    # ------------------------------------------------------------ steps

    def open(self) -> dict[str, Any]:
        args = self.args
        options = {
            "chunk_bytes": args.chunk_bytes,
            "min_chunk_bytes": args.min_chunk_bytes,
            "margin_bytes": args.margin_bytes,
            "max_unreachable_fraction": args.max_unreachable,
            "scrub_timeout_s": args.step_timeout,
            "params_path": Path(args.driver_params),
            "kernel_log": Path(args.kernel_log),
        }
        xid_watch = "on"
        try:
            self.backend = self.gpu.open_backend("nvml", watch_xids=True, **options)
        except self.gpu.GpuError as exc:  # e.g. not root: no kernel log; the rest is still worth checking
            xid_watch = f"off: {exc}"
            self.backend = self.gpu.open_backend("nvml", watch_xids=False, **options)
        self.device = self.pick_device()
        nvml = self.backend._nvml
        with self.backend._session():
            found_versions = self.facts.versions(nvml)
            gpu = self.backend._devices.gpu(self.device.parent_uuid or self.device.uuid)
            found_card = self.facts.card(nvml, gpu)
        return {
            "device": asdict(self.device),
            "versions": found_versions,
            "card": found_card,
            "scrubOnFreeDisabled": self.backend.scrub_on_free_disabled(),
            "xidWatch": xid_watch,
        }

    def selftest(self) -> dict[str, Any]:
        report = self.child("selftest", self.device.uuid, bytes=min(64 << 20, self.device.memory_free // 2))
        # The agent's own start-up check (cuda_scrub.py --check on an idle device): None when CUDA works.
        report["agentStartCheck"] = self.backend.cuda_problem()
        report["ok"] = report["ok"] and report["agentStartCheck"] is None
        return report

    def canary_scrub_probe(
        self, device: Callable[[], contextlib.AbstractContextManager[str]], scrub: Callable[[], Any]
    ) -> dict[str, Any]:
        """A tenant's canary, the scrub, the probe; `device` gives the device for each of tenant and probe."""
        with device() as uuid:
            tenant = self.tenant_bytes(uuid)
            self.child("tenant", uuid, bytes=tenant)
            self.wait_idle(uuid)
        result = scrub()
        with device() as uuid:
            probe = self.child("probe", uuid)
        usable = max(result.bytes_total - result.bytes_reserved, 1)
        return {
            "ok": bool(result.verified and probe["canaryWords"] == 0),
            "tenantBytes": tenant,
            "scrub": asdict(result),
            "coverage": {
                "bytesScrubbed": result.bytes_scrubbed,
                "bytesUnreachable": result.bytes_unreachable,
                "bytesReserved": result.bytes_reserved,
                "unreachedShare": result.bytes_unreachable / usable,
            },
            "probe": probe,
        }

    def same_device(self, uuid: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        return lambda: contextlib.nullcontext(uuid)

    def resident(self, scrub: bool) -> dict[str, Any]:
        uuid = self.device.uuid
        return self.child("resident", uuid, bytes=self.tenant_bytes(uuid), scrub=int(scrub))

    def scrub(self) -> dict[str, Any]:
        report = self.canary_scrub_probe(
            self.same_device(self.device.uuid), lambda: self.backend.scrub(self.device.uuid)
        )
        resident = report["resident"] = self.resident(scrub=True)
        report["ok"] = report["ok"] and resident["canaryWords"] == 0 and resident["nonzeroWords"] == 0
        return report

    def no_scrub(self) -> dict[str, Any]:
        uuid = self.device.uuid
        tenant = self.tenant_bytes(uuid)
        self.child("tenant", uuid, bytes=tenant)
        self.wait_idle(uuid)
        probe = self.child("probe", uuid)
        resident = self.resident(scrub=False)
        return {
            # Without the scrub, the check must see the canary: else its PASS would prove nothing.
            "ok": resident["canaryWords"] == resident["plantedWords"] > 0,
            "tenantBytes": tenant,
            "probe": probe,
            "driverScrubsOnFree": probe["canaryWords"] == 0,
            "resident": resident,
        }

    def bandwidth(self) -> dict[str, Any]:
        copy_bytes = min(int(self.args.copy_gib * GiB), self.device.memory_free // 4) // 16 * 16
        report = self.child("bandwidth", self.device.uuid, bytes=copy_bytes, iterations=self.args.iterations)
        report["scrubToCopy"] = report["scrubGBps"] / report["copyGBps"]
        report["ok"] = report["nonzeroWords"] == 0 and report["scrubToCopy"] >= self.args.rate_goal
        scrub = self.report["steps"].get("scrub", {}).get("scrub") or {}
        if scrub.get("kernel_s"):
            report["wholeDeviceScrubGBps"] = scrub["bytes_scrubbed"] / scrub["kernel_s"] / 1e9
        return report

    def health(self) -> dict[str, Any]:
        health = self.backend.health(self.device.uuid, since=time.time() - 60)
        problems = health.problems()
        return {
            "ok": not problems,
            "snapshot": asdict(health),
            "problems": problems,
            "xidWatch": self.report.get("xidWatch"),
        }

    def kernel_log(self) -> dict[str, Any]:
        found = self.facts.kernel_log(Path(self.args.kernel_log), Path(self.args.driver_version), self.limit() / 2)
        return {"ok": True, **found}  # reported, never failed: see the module's docstring

    def mig(self) -> dict[str, Any]:
        gpu_uuid = self.device.parent_uuid
        migs = [d for d in self.backend.list_devices() if d.parent_uuid and d.parent_uuid == gpu_uuid]
        if not migs:
            return {"ok": True, "skipped": "the GPU is not in MIG mode (the check never changes that)"}
        idle = next((d for d in migs if d.uuid != self.device.uuid and not self.backend.processes(d.uuid)), None)
        target = idle or self.device
        live = self.backend.live_instances(gpu_uuid)
        here = next(m for m in live if m.uuid == target.uuid)
        placement = self.gpu.MigPlacement(gpu_uuid, here.profile_id, here.start, here.size)
        # As the agent scrubs a MIG device: through its placement (a live device there is scrubbed by UUID).
        result = self.canary_scrub_probe(self.same_device(target.uuid), lambda: self.backend.scrub_placement(placement))
        result["placement"] = asdict(placement)
        if not self.args.mig_scratch:
            result["scratch"] = {"skipped": "the deleted-device path creates GPU instances: --mig-scratch"}
            return result
        profile, start, size = (int(n) for n in self.args.mig_scratch.split(":"))
        scratch = self.gpu.MigPlacement(gpu_uuid, profile, start, size)
        if any(m.overlaps(scratch) for m in live):
            raise StepFailed(f"--mig-scratch {self.args.mig_scratch}: memory slices in use on {gpu_uuid}")
        # NVIDIA's driver creates the tenant's device on prepare and deletes it on unprepare; the agent then
        # scrubs the placement through a GPU instance of its own.
        deleted = self.canary_scrub_probe(
            lambda: self.backend.scratch_instance(scratch), lambda: self.backend.scrub_placement(scratch)
        )
        left = [(m.profile_id, m.start, m.size) for m in self.backend.live_instances(gpu_uuid)]
        deleted["instancesAsBefore"] = left == [(m.profile_id, m.start, m.size) for m in live]
        deleted["ok"] = deleted["ok"] and deleted["instancesAsBefore"]
        result["scratch"] = deleted
        result["ok"] = result["ok"] and deleted["ok"]
        return result

    # ------------------------------------------------------------ all of it

    def run(self) -> dict[str, Any]:
        threading.Thread(target=self.watchdog, name="gpu-check-watchdog", daemon=True).start()
        try:
            if self.step("open", lambda: self.report.update(self.open())):
                for name in STEPS[1:]:
                    self.step(name, getattr(self, name.replace("-", "_")))
        finally:
            self._done.set()
            if self.backend is not None:
                self.backend.close()
        steps = self.report["steps"]
        self.report["canaries"] = canaries(steps)
        self.report["pass"] = all(steps.get(n, {}).get("ok") for n in STEPS)
        self.save()
        return self.report


def canaries(steps: dict[str, Any]) -> dict[str, Any]:
    """Every canary result in one place: the self-test's planted and found words, the rest in bytes (a canary
    word is 4)."""

    def words(*path: str) -> int | None:
        value: Any = steps
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value * 4 if isinstance(value, int) else None

    return {
        "selftestWordsPlantedFound": [steps.get("selftest", {}).get(k) for k in ("plantedWords", "foundWords")],
        "afterAgentScrub": words("scrub", "probe", "canaryWords"),
        "residentAfterAgentPass": words("scrub", "resident", "canaryWords"),
        "withoutAgentScrub": words("no-scrub", "probe", "canaryWords"),
        "residentWithoutScrubFoundOfPlanted": [
            words("no-scrub", "resident", "canaryWords"),
            words("no-scrub", "resident", "plantedWords"),
        ],
        "migExistingAfterAgentScrub": words("mig", "probe", "canaryWords"),
        "migDeletedAfterAgentScrub": words("mig", "scratch", "probe", "canaryWords"),
    }


def table(report: dict[str, Any]) -> str:
    steps = report["steps"]
    rows = [
        (f"step {n}", f"{s.get('seconds', 0):7.2f} s  " + ("ok" if s["ok"] else f"FAILED {s.get('error', '')}"))
        for n, s in steps.items()
    ]
    device = report.get("device")
    if device:
        rows += [
            ("device", f"{device['name']} {device['uuid']}"),
            (
                "memory total / reserved",
                f"{device['memory_total'] / GiB:.2f} / {device['memory_reserved'] / GiB:.3f} GiB",
            ),
            ("RMDisableScrubOnFree", str(report.get("scrubOnFreeDisabled"))),
        ]
    versions, card = report.get("versions") or {}, report.get("card") or {}
    if versions:
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    if card:
        rows.append(("card", ", ".join(f"{k} {v}" for k, v in card.items())))
    if "cudaDriverVersion" in steps.get("selftest", {}):
        rows.append(("CUDA driver API", str(steps["selftest"]["cudaDriverVersion"])))
    if "selftest" in steps and "kernels" in steps["selftest"]:
        rows.append(("kernels", steps["selftest"]["kernels"]))
    scrub = steps.get("scrub", {})
    if "coverage" in scrub:
        cov, result = scrub["coverage"], scrub["scrub"]
        reason = f" ({result['reason']})" if result["reason"] else ""
        rows += [
            ("agent scrub", f"verified={result['verified']}{reason}"),
            ("scrubbed", f"{cov['bytesScrubbed'] / GiB:.2f} GiB in {result['duration_s']:.2f} s wall"),
            ("unreached by the scrub", f"{cov['bytesUnreachable'] / GiB:.3f} GiB ({cov['unreachedShare']:.2%})"),
            ("canary after agent scrub", f"{scrub['probe']['canaryWords'] * 4} bytes (must be 0)"),
            (
                "scrub process",
                f"device {result['kernel_s'] or 0:.3f} s, wall {result['duration_s']:.2f} s, host memory "
                f"{(result['host_rss_bytes'] or 0) / (1 << 20):.0f} MiB peak",
            ),
        ]
    if "resident" in scrub:
        rows.append(("resident canary, agent pass", f"{scrub['resident']['canaryWords'] * 4} bytes left (must be 0)"))
    no_scrub = steps.get("no-scrub", {})
    if "probe" in no_scrub:
        leaked = no_scrub["probe"]["canaryWords"] * 4
        rows.append(("canary without agent scrub", f"{leaked} bytes (the next process; 0: driver scrubs on free)"))
    if "resident" in no_scrub:
        found, planted = no_scrub["resident"]["canaryWords"] * 4, no_scrub["resident"]["plantedWords"] * 4
        rows.append(("resident canary, no scrub", f"{found} of {planted} bytes found (must be all)"))
    mig = steps.get("mig", {})
    for name, part in (("mig, existing device", mig), ("mig, deleted device", mig.get("scratch") or {})):
        if "skipped" in part or "probe" in part:
            rows.append(
                (name, part.get("skipped") or f"canary after agent scrub {part['probe']['canaryWords'] * 4} bytes")
            )
    bw = steps.get("bandwidth", {})
    if "copyGBps" in bw:
        rows += [
            ("copy D2D", f"{bw['copyGBps']:.0f} GB/s ({bw['bytes'] / GiB:.2f} GiB x {bw['iterations']})"),
            ("scrub, same buffer", f"{bw['scrubGBps']:.0f} GB/s = {bw['scrubToCopy']:.0%} of copy"),
            ("scrub, whole device", f"{bw.get('wholeDeviceScrubGBps') or 0:.0f} GB/s (zero+verify, no allocation)"),
        ]
    log = steps.get("kernel-log", {})
    if "readable" in log:
        rows.append(
            (
                "kernel log",
                f"host's: {log.get('host')}; {log.get('records')} records from #{log.get('firstSeq')}, "
                f"{log.get('xidRecords')} XID records; driver loaded: {log.get('driverLoaded')}"
                if log["readable"]
                else f"not readable ({log.get('error')})",
            )
        )
    rows.append(("result", "PASS" if report["pass"] else "FAIL"))
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
    parser.add_argument("--margin-bytes", type=int, default=256 << 20, help="left free by the first pass")
    parser.add_argument("--max-unreachable", type=float, default=0.02, help="as the agent's --max-unreachable")
    parser.add_argument("--rate-goal", type=float, default=0.8, help="scrub rate / copy rate needed to pass")
    parser.add_argument("--step-timeout", type=float, default=90.0, help="seconds per step (and child process)")
    parser.add_argument(
        "--driver-params",
        default="/proc/driver/nvidia/params",
        help="the kernel driver's parameters (scrub-on-free), as the agent reads them",
    )
    parser.add_argument(
        "--kernel-log", default="/dev/kmsg", help="where the agent reads XIDs (the driver's NVRM: Xid lines)"
    )
    parser.add_argument(
        "--driver-version",
        default="/proc/driver/nvidia/version",
        help="the driver's own version file, against its load record in the kernel log",
    )
    parser.add_argument(
        "--mig-scratch",
        metavar="PROFILE:START:SIZE",
        help="also the agent's path for a deleted dynamic MIG device, on this free placement (GI profile ID, "
        "first memory slice, memory slices): creates and destroys GPU instances",
    )
    parser.add_argument(
        "--total-timeout", type=float, default=280.0, help="seconds for the whole check (under 5 minutes)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json")
    args = parser.parse_args(argv)
    report = Check(args, import_backend()).run()
    print(table(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
