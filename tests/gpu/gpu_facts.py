"""What the GPU check reports besides the scrub: versions, the card's settings (read, never changed), and whether
the kernel log the agent reads XIDs from is the log of the kernel the NVIDIA driver runs in.

Imported by gpu_check.py once scrubgate's GPU package is importable (installed, or from the checkout)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scrubgate.sanitizer_agent.gpu.xid import KernelRecord, parse_record, parse_xid

# Read at most this many kernel log records (a ring buffer of a few MB holds tens of thousands).
MAX_RECORDS = 200_000


def _plain(value: Any) -> Any:
    """NVML's answers as JSON: bytes decoded, ctypes numbers unwrapped, lists element by element."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return getattr(value, "value", value)


def _read(reads: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, read in reads.items():
        try:
            found[name] = _plain(read())
        except Exception as exc:  # one unreadable fact (an older driver, an unsupported query) is only that
            found[name] = f"unknown: {type(exc).__name__}: {exc}"
    return found


def _package(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions(nvml: Any) -> dict[str, Any]:
    """Driver, NVML and the CUDA version the driver supports (NVML's view; the self-test's child reports the CUDA
    driver API's own), the binding packages, Python and the kernel. NVML must be open."""
    found = _read(
        {
            "driver": nvml.nvmlSystemGetDriverVersion,
            "nvml": nvml.nvmlSystemGetNVMLVersion,
            "cudaDriverVersion": nvml.nvmlSystemGetCudaDriverVersion,
        }
    )
    found.update(
        {
            "nvidia-ml-py": _package("nvidia-ml-py"),
            "cuda-bindings": _package("cuda-bindings"),
            "python": platform.python_version(),
            "kernel": platform.release(),
        }
    )
    return found


def card(nvml: Any, gpu: Any) -> dict[str, Any]:
    """The physical GPU's settings the scrub depends on, read only: persistence mode (without it each attach
    initialises the GPU and resets its volatile ECC counters), GSP firmware, architecture, MIG and ECC modes
    (current, pending). NVML must be open, `gpu` a handle of the physical GPU."""
    return _read(
        {
            "persistenceMode": lambda: nvml.nvmlDeviceGetPersistenceMode(gpu),
            "gspFirmwareMode": lambda: nvml.nvmlDeviceGetGspFirmwareMode(gpu),
            "gspFirmwareVersion": lambda: nvml.nvmlDeviceGetGspFirmwareVersion(gpu),
            "architecture": lambda: nvml.nvmlDeviceGetArchitecture(gpu),
            "migMode": lambda: nvml.nvmlDeviceGetMigMode(gpu),
            "eccMode": lambda: nvml.nvmlDeviceGetEccMode(gpu),
        }
    )


def _records(path: Path, seconds: float) -> tuple[list[KernelRecord], int]:
    """The records /dev/kmsg holds now (and how often the ring buffer overwrote unread ones meanwhile), read
    without waiting for new ones; at most `seconds` and MAX_RECORDS."""
    records: list[KernelRecord] = []
    lost = 0
    deadline = time.monotonic() + seconds
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    pending = b""
    try:
        while len(records) < MAX_RECORDS and time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break  # all read
            except BrokenPipeError:
                lost += 1
                continue
            if not chunk:
                break  # a regular file (the fakes) at its end
            *lines, pending = (pending + chunk).split(b"\n")
            records += [r for r in (parse_record(line.decode("utf-8", "replace")) for line in lines) if r is not None]
    finally:
        os.close(fd)
    return records, lost


def kernel_log(path: Path, driver_version: Path, seconds: float) -> dict[str, Any]:
    """Is the log the agent reads the log of the kernel the NVIDIA driver runs in? The driver prints
    "NVRM: loading <its id>" when it loads (kernel-open/nvidia/nv.c) and shows the same id in
    /proc/driver/nvidia/version ("NVRM version: <id>", nv-procfs.c): equal, the log is that kernel's. A log whose
    records are newer than this kernel's clock is another kernel's. Otherwise (the load record overwritten since)
    it cannot tell: null."""
    try:
        records, lost = _records(path, seconds)
    except OSError as exc:
        return {"readable": False, "error": f"{path}: {exc}", "host": None}
    loaded = [
        r.message.removeprefix("NVRM: loading ").strip()
        for r in records
        if r.facility == 0 and r.message.startswith("NVRM: loading ")
    ]
    version = None
    with contextlib.suppress(OSError):
        first = driver_version.read_text().splitlines()[0]
        version = first.removeprefix("NVRM version:").strip() if first.startswith("NVRM version:") else None
    newest_s = max((r.usec for r in records), default=0) / 1e6
    clock_matches = newest_s <= time.monotonic() + 1
    if not clock_matches:
        host: bool | None = False
    elif loaded and version:
        host = loaded[-1] == version
    else:
        host = None
    xids = [r.message for r in records if parse_xid(r) is not None]
    return {
        "readable": True,
        "records": len(records),
        "firstSeq": records[0].seq if records else None,  # > 0: that many records were overwritten before
        "overwrittenWhileReading": lost,
        "kernelRecords": sum(1 for r in records if r.facility == 0),
        "nvrmRecords": sum(1 for r in records if r.facility == 0 and r.message.startswith("NVRM: ")),
        "driverLoaded": loaded[-1] if loaded else None,
        "driverVersionFile": version,
        "clockMatches": clock_matches,
        "xidRecords": len(xids),
        "lastXids": xids[-5:],
        "host": host,
    }
