"""A simulated GPU backend whose device memory is real bytes in files, shared between processes.

State lives in one directory so that a simulated tenant, the agent and the cluster stand-in's kubelet
(separate processes) all see the same devices, memory, processes and faults:

- ``inventory.json``: the devices (full GPUs and MIG slices, with their parent UUID);
- ``mem/<uuid>``: each device's usable memory, read and written through ``mmap``;
- ``procs/<uuid>.json``: processes attached to a device (listed while their pid lives, or until detach);
- ``faults.json``: injected faults, per device UUID or ``"*"`` for every device.

The scrub really zeroes the mapped bytes and verifies them by reading them back, so a canary a tenant
wrote is observably gone after a verified scrub and observably present after a failed one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import time
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args

from .base import (
    GpuDevice,
    GpuError,
    GpuProcess,
    HealthSnapshot,
    MigPlacement,
    ProcessKind,
    ScrubResult,
    critical_xid,
)

METHOD = "simulated-memset-verify"
INVENTORY_VERSION = 1
ALL_DEVICES = "*"
# Above the kernel's largest pid_max (2^22), so it never names a real process: the pid reported for a
# process that never exits when fault "linger" is set on a device nobody attached to.
LINGERING_PID = 4_194_304
# Memory slices of a simulated GPU: a dynamic MIG placement's memory is its share of the GPU's file.
MEMORY_SLICES = 8
# Bytes a "verify_mismatch" fault leaves non-zero after the memset (cells that do not hold a write).
STUCK_BYTES = 64

FaultKind = Literal[
    "scrub_error",  # str: the scrub fails before touching memory, as a CUDA error would
    "verify_mismatch",  # bool: the memset leaves STUCK_BYTES non-zero; verification must catch it
    "nvml_error",  # str: every management call for the device raises GpuError ("*": list_devices too)
    "ecc_error",  # int: volatile uncorrectable ECC count
    "remap_pending",  # bool
    "remap_failed",  # bool
    "recovery_action",  # int: NVML GPU recovery action
    "xid",  # int: appends one XID event (at the time given, default now)
    "linger",  # bool: attached processes never go away (a pid stuck in the driver)
    "slow_scrub",  # float: seconds a scrub takes before it touches memory (a big GPU, a busy one)
]
FAULT_KINDS: frozenset[str] = frozenset(get_args(FaultKind))


# ---------------------------------------------------------------- shared state on disk


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    """Serialise read-modify-write of the shared JSON files across processes."""
    with open(root / ".lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


def _write_json(path: Path, data: Any) -> None:
    # Readers in other processes must never see half a file: write aside, then rename.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _memory_path(root: Path, uuid: str) -> Path:
    return root / "mem" / uuid


def _procs_path(root: Path, uuid: str) -> Path:
    return root / "procs" / f"{uuid}.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # An exited child that nobody reaped yet still answers kill(0); its GPU context is gone though.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def create_inventory(
    root: Path | str,
    gpus: int = 1,
    mig_per_gpu: int = 0,
    memory_bytes: int = 4 << 20,
    mig_memory_bytes: int | None = None,
    reserved_bytes: int | None = None,
    name: str = "Simulated H200",
) -> list[GpuDevice]:
    """Create a fresh simulated node in ``root``: ``gpus`` GPUs, each with ``mig_per_gpu`` MIG slices.

    ``memory_bytes`` is each GPU's usable memory (a sparse file); MIG slices get ``mig_memory_bytes``
    (default an eighth of it). ``reserved_bytes`` (default 1/64) is memory the "driver" keeps: counted
    in ``memory_total``, never reachable by a tenant or the scrub.
    """
    root = Path(root)
    if (root / "inventory.json").exists():
        raise FileExistsError(f"{root} already holds a simulated GPU inventory; use a fresh directory")
    if gpus < 0 or mig_per_gpu < 0 or memory_bytes <= 0:
        raise ValueError("gpus and mig_per_gpu must be >= 0 and memory_bytes > 0")
    mig_memory = mig_memory_bytes if mig_memory_bytes is not None else max(memory_bytes // 8, 4096)
    (root / "mem").mkdir(parents=True, exist_ok=True)
    (root / "procs").mkdir(exist_ok=True)
    devices: list[GpuDevice] = []

    def add(dev_uuid: str, index: int, dev_name: str, parent: str | None, usable: int) -> None:
        reserved = reserved_bytes if reserved_bytes is not None else usable // 64
        with open(_memory_path(root, dev_uuid), "wb") as f:
            f.truncate(usable)
        devices.append(GpuDevice(dev_uuid, index, dev_name, parent, usable + reserved, reserved, usable))

    for i in range(gpus):
        gpu_uuid = f"GPU-{uuidlib.uuid4()}"
        add(gpu_uuid, i, name, None, memory_bytes)
        for m in range(mig_per_gpu):
            add(f"MIG-{uuidlib.uuid4()}", m, f"{name} MIG slice", gpu_uuid, mig_memory)
    with _lock(root):
        _write_json(
            root / "inventory.json",
            {
                "version": INVENTORY_VERSION,
                "devices": [
                    {
                        "uuid": d.uuid,
                        "index": d.index,
                        "name": d.name,
                        "parentUuid": d.parent_uuid,
                        "memoryTotal": d.memory_total,
                        "memoryReserved": d.memory_reserved,
                    }
                    for d in devices
                ],
            },
        )
    return devices


def _inventory(root: Path) -> list[dict[str, Any]]:
    data = _read_json(root / "inventory.json", None)
    if data is None:
        raise GpuError(f"no simulated GPU inventory in {root}: run create_inventory first")
    if data.get("version") != INVENTORY_VERSION:
        version = data.get("version")
        raise GpuError(f"simulated GPU inventory {root}/inventory.json has unknown version {version}")
    return list(data["devices"])


def _device_record(root: Path, uuid: str) -> dict[str, Any] | None:
    return next((d for d in _inventory(root) if d["uuid"] == uuid), None)


def remove_device(root: Path | str, uuid: str) -> None:
    """Make a device vanish, as a dynamically created MIG slice does after the driver's unprepare.

    Its memory file stays behind (the physical memory still holds whatever was there).
    """
    root = Path(root)
    with _lock(root):
        data = _read_json(root / "inventory.json", None)
        if data is None:
            raise GpuError(f"no simulated GPU inventory in {root}")
        data["devices"] = [d for d in data["devices"] if d["uuid"] != uuid]
        _write_json(root / "inventory.json", data)


# ---------------------------------------------------------------- tenant side (any process)


@contextlib.contextmanager
def _mapped(root: Path, uuid: str) -> Iterator[mmap.mmap]:
    try:
        fd = os.open(_memory_path(root, uuid), os.O_RDWR)
    except FileNotFoundError:
        raise GpuError(f"simulated device {uuid} has no memory in {root}") from None
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED) as mm:
            yield mm
    finally:
        os.close(fd)


def attach(
    root: Path | str,
    uuid: str,
    pid: int | None = None,
    kind: ProcessKind = "compute",
    used_memory: int | None = None,
) -> int:
    """Register a process (default: the caller) on a device; listed while it lives or until detach."""
    root = Path(root)
    if _device_record(root, uuid) is None:
        raise GpuError(f"cannot attach to simulated device {uuid}: not in {root}/inventory.json")
    pid = os.getpid() if pid is None else pid
    with _lock(root):
        entries = [e for e in _read_json(_procs_path(root, uuid), []) if e["pid"] != pid]
        entries.append({"pid": pid, "kind": kind, "usedMemory": used_memory})
        _write_json(_procs_path(root, uuid), entries)
    return pid


def detach(root: Path | str, uuid: str, pid: int | None = None) -> None:
    root = Path(root)
    pid = os.getpid() if pid is None else pid
    with _lock(root):
        entries = _read_json(_procs_path(root, uuid), [])
        _write_json(_procs_path(root, uuid), [e for e in entries if e["pid"] != pid])


def write(root: Path | str, uuid: str, offset: int, data: bytes) -> None:
    """Write ``data`` into the device's memory at ``offset`` (as a tenant's kernel would)."""
    with _mapped(Path(root), uuid) as mm:
        if offset < 0 or offset + len(data) > len(mm):
            raise ValueError(f"write of {len(data)} bytes at {offset} is outside {uuid}'s {len(mm)} bytes")
        mm[offset : offset + len(data)] = data


def read(root: Path | str, uuid: str, offset: int = 0, length: int | None = None) -> bytes:
    """Read the device's memory (all of it by default), as the next tenant could."""
    with _mapped(Path(root), uuid) as mm:
        end = len(mm) if length is None else offset + length
        if offset < 0 or end > len(mm):
            raise ValueError(f"read of {offset}..{end} is outside {uuid}'s {len(mm)} bytes")
        return mm[offset:end]


def fill(root: Path | str, uuid: str, pattern: bytes) -> int:
    """Fill all of the device's memory with a repeated pattern (a canary); returns the bytes written."""
    if not pattern:
        raise ValueError("pattern must not be empty")
    with _mapped(Path(root), uuid) as mm:
        size = len(mm)
        mm[:] = (pattern * (size // len(pattern) + 1))[:size]
        return size


def memory_size(root: Path | str, uuid: str) -> int:
    return _memory_path(Path(root), uuid).stat().st_size


# ---------------------------------------------------------------- fault injection (any process)


def inject_fault(root: Path | str, uuid: str, kind: FaultKind, value: Any = True, at: float | None = None) -> None:
    """Set a fault on a device (``"*"``: every device). See FaultKind for what each value means;
    ``at`` is when an XID happened (default now)."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(sorted(FAULT_KINDS))}")
    root = Path(root)
    with _lock(root):
        faults = _read_json(root / "faults.json", {})
        device = faults.setdefault(uuid, {})
        if kind == "xid":
            device.setdefault("xid", []).append([time.time() if at is None else at, int(value)])
        else:
            device[kind] = value
        _write_json(root / "faults.json", faults)


def clear_faults(root: Path | str, uuid: str | None = None, kind: FaultKind | None = None) -> None:
    """Clear one fault, all faults of a device, or (no arguments) every fault."""
    root = Path(root)
    with _lock(root):
        faults = _read_json(root / "faults.json", {})
        for key in [uuid] if uuid is not None else list(faults):
            if kind is None:
                faults.pop(key, None)
            else:
                faults.get(key, {}).pop(kind, None)
        _write_json(root / "faults.json", faults)


# ---------------------------------------------------------------- the backend


class SimulatedGpu:
    """GpuBackend over a simulated node directory (see create_inventory)."""

    def __init__(self, root: Path | str, scrub_on_free_disabled: bool | None = True) -> None:
        self.root = Path(root)
        # Simulated memory is never scrubbed by a "driver": report what a node with scrub-on-free
        # switched off would, so the agent's own scrub is what keeps it clean.
        self._scrub_on_free_disabled = scrub_on_free_disabled

    def close(self) -> None:
        """Nothing to release; present so both backends can be used the same way."""

    def __enter__(self) -> SimulatedGpu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slow(self, uuid: str, faults: dict[str, Any]) -> None:
        """Fault slow_scrub: the scrub takes that long, or until the fault is cleared (a GPU back on the bus)."""
        until = time.monotonic() + float(faults.get("slow_scrub") or 0)
        while time.monotonic() < until and self._faults(uuid).get("slow_scrub"):
            time.sleep(0.05)

    def _faults(self, uuid: str) -> dict[str, Any]:
        faults = _read_json(self.root / "faults.json", {})
        merged: dict[str, Any] = dict(faults.get(ALL_DEVICES, {}))
        for key, value in faults.get(uuid, {}).items():
            merged[key] = merged.get(key, []) + value if key == "xid" else value
        return merged

    def _check_nvml(self, uuid: str, faults: dict[str, Any]) -> None:
        if faults.get("nvml_error"):
            raise GpuError(f"NVML error on simulated device {uuid}: {_message(faults['nvml_error'])}", uuid)

    def _known(self, uuid: str) -> dict[str, Any]:
        record = _device_record(self.root, uuid)
        if record is None:
            raise GpuError(f"simulated device {uuid} not found (gone, or never on this node)", uuid)
        return record

    def list_devices(self) -> list[GpuDevice]:
        global_faults = _read_json(self.root / "faults.json", {}).get(ALL_DEVICES, {})
        if global_faults.get("nvml_error"):
            raise GpuError(f"NVML error listing simulated devices: {_message(global_faults['nvml_error'])}")
        devices = []
        for record in _inventory(self.root):
            # A device whose queries fail is left out, as the real backend does; the agent keeps it fenced.
            if self._faults(record["uuid"]).get("nvml_error"):
                continue
            usable = memory_size(self.root, record["uuid"])
            used = sum(p.used_memory or 0 for p in self._live_processes(record["uuid"]))
            devices.append(
                GpuDevice(
                    uuid=record["uuid"],
                    index=record["index"],
                    name=record["name"],
                    parent_uuid=record["parentUuid"],
                    memory_total=record["memoryTotal"],
                    memory_reserved=record["memoryReserved"],
                    memory_free=max(usable - used, 0),
                )
            )
        return devices

    def _live_processes(self, uuid: str) -> list[GpuProcess]:
        entries = _read_json(_procs_path(self.root, uuid), [])
        linger = bool(self._faults(uuid).get("linger"))
        found = [
            GpuProcess(pid=e["pid"], kind=e["kind"], used_memory=e["usedMemory"])
            for e in entries
            if linger or _pid_alive(e["pid"])
        ]
        if linger and not found:
            found.append(GpuProcess(pid=LINGERING_PID, kind="compute", used_memory=None))
        return found

    def processes(self, uuid: str) -> list[GpuProcess]:
        self._known(uuid)
        self._check_nvml(uuid, self._faults(uuid))
        return self._live_processes(uuid)

    def health(self, uuid: str, since: float) -> HealthSnapshot:
        self._known(uuid)
        faults = self._faults(uuid)
        self._check_nvml(uuid, faults)
        xids = tuple(int(x) for at, x in faults.get("xid", []) if at >= since and critical_xid(int(x)))
        return HealthSnapshot(
            ecc_uncorrectable_volatile=int(faults.get("ecc_error", 0)),
            remapped_rows_pending=bool(faults.get("remap_pending", False)),
            remapped_rows_failed=bool(faults.get("remap_failed", False)),
            recovery_action=faults.get("recovery_action"),
            xids=xids,
        )

    def scrub(self, uuid: str) -> ScrubResult:
        started = time.perf_counter()
        record = _device_record(self.root, uuid)
        total, reserved = (record["memoryTotal"], record["memoryReserved"]) if record else (0, 0)

        def failed(reason: str, scrubbed: int = 0, unreachable: int = total - reserved) -> ScrubResult:
            return ScrubResult(
                uuid=uuid,
                bytes_scrubbed=scrubbed,
                bytes_total=total,
                bytes_reserved=reserved,
                bytes_unreachable=unreachable,
                duration_s=time.perf_counter() - started,
                verified=False,
                method=METHOD,
                reason=reason,
            )

        if record is None:
            return failed(f"device {uuid} no longer exists; its memory cannot be reached to verify it")
        faults = self._faults(uuid)
        self._check_nvml(uuid, faults)

        holders = self._live_processes(uuid)
        if holders:
            pids = ", ".join(str(p.pid) for p in holders)
            return failed(f"device {uuid} is still held by pid {pids}; their memory cannot be scrubbed")
        if faults.get("scrub_error"):
            return failed(f"simulated CUDA error during scrub of {uuid}: {_message(faults['scrub_error'])}")
        self._slow(uuid, faults)
        with _mapped(self.root, uuid) as mm:
            size = len(mm)
            zero_memory(mm)
            if faults.get("verify_mismatch"):
                mm[size - STUCK_BYTES :] = b"\xa5" * STUCK_BYTES
            nonzero, first = count_nonzero(mm)
        if nonzero:
            return failed(
                f"verification found {nonzero} non-zero bytes on {uuid} after the memset (first at offset {first})",
                scrubbed=size,
                unreachable=0,
            )
        return ScrubResult(
            uuid=uuid,
            bytes_scrubbed=size,
            bytes_total=total,
            bytes_reserved=reserved,
            bytes_unreachable=0,
            duration_s=time.perf_counter() - started,
            verified=True,
            method=METHOD,
            scrub_on_free=self._scrub_on_free(),
            ecc_enabled=True,  # the simulated GPUs count ECC errors (health)
        )

    def placement_health(self, placement: MigPlacement, since: float) -> HealthSnapshot:
        return self.health(placement.parent_uuid, since)  # simulated XIDs are per GPU

    def placement_processes(self, placement: MigPlacement) -> list[GpuProcess]:
        # A simulated dynamic MIG device is gone once unprepared; what runs on the GPU still counts.
        return self.processes(placement.parent_uuid)

    def scrub_placement(self, placement: MigPlacement) -> ScrubResult:
        """Zeroes and verifies the placement's memory slices: their share of the GPU's memory file."""
        started = time.perf_counter()
        parent = placement.parent_uuid
        self._known(parent)
        faults = self._faults(parent)
        self._check_nvml(parent, faults)
        self._slow(parent, faults)
        with _mapped(self.root, parent) as mm:
            step = len(mm) // MEMORY_SLICES
            begin, end = placement.start * step, (placement.start + placement.size) * step
            if faults.get("scrub_error") or end > len(mm) or self._live_processes(parent):
                reason = (
                    _message(faults.get("scrub_error"))
                    if faults.get("scrub_error")
                    else "placement busy or out of range"
                )
                return ScrubResult(
                    parent, 0, end - begin, 0, end - begin, time.perf_counter() - started, False, METHOD, reason
                )
            mm[begin:end] = bytes(end - begin)
            if faults.get("verify_mismatch"):
                mm[end - STUCK_BYTES : end] = b"\xa5" * STUCK_BYTES
            nonzero = (end - begin) - mm[begin:end].count(0)
        return ScrubResult(
            uuid=parent,
            bytes_scrubbed=end - begin,
            bytes_total=end - begin,
            bytes_reserved=0,
            bytes_unreachable=0,
            duration_s=time.perf_counter() - started,
            scrub_on_free=self._scrub_on_free(),
            ecc_enabled=True,
            verified=not nonzero,
            method=METHOD,
            reason=f"verification found {nonzero} non-zero bytes in {parent} slices {placement.start}+{placement.size}"
            if nonzero
            else None,
        )

    def scrub_on_free_disabled(self) -> bool | None:
        return self._scrub_on_free_disabled

    def watch_error(self) -> str | None:
        return None  # simulated XIDs are injected, not watched

    def _scrub_on_free(self) -> bool | None:
        return None if self._scrub_on_free_disabled is None else not self._scrub_on_free_disabled


_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)


def zero_memory(mm: mmap.mmap) -> None:
    for start in range(0, len(mm), _CHUNK):
        end = min(start + _CHUNK, len(mm))
        mm[start:end] = _ZEROS[: end - start]


def count_nonzero(mm: mmap.mmap) -> tuple[int, int | None]:
    """Read every byte back: (number of non-zero bytes, offset of the first one)."""
    nonzero, first = 0, None
    for start in range(0, len(mm), _CHUNK):
        chunk = mm[start : start + _CHUNK]
        if chunk == _ZEROS[: len(chunk)]:
            continue
        nonzero += len(chunk) - chunk.count(0)
        if first is None:
            first = start + len(chunk) - len(chunk.lstrip(b"\0"))
    return nonzero, first


def _message(value: Any) -> str:
    return value if isinstance(value, str) else "injected fault"
