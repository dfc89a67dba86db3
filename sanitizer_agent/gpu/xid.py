"""XID events from the kernel log, kept so that health() can answer "which critical XIDs hit this device since t".

NVIDIA's kernel driver writes every XID to the kernel log (open-gpu-kernel-modules, kernel_rc.c):
``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., <message>``, and on a GPU in MIG mode the parenthesis also names
the GPU instance (`` GPU-I:05``). The agent reads them there, from ``/dev/kmsg``, rather than from an NVML
event set: an event set keeps an NVML session open on every GPU for the agent's lifetime, and with
DynamicMIG NVIDIA's DRA driver cannot change a GPU's MIG mode while another process holds one ("in use by
another client", as its nvlib.go says of mig-parted). The kernel log also keeps history: XIDs from before
the agent started are seen while the ring buffer holds them.

As NVIDIA's DRA driver does: every XID counts except the application ones (a tenant's own faults), and an
XID with a GPU instance belongs to that MIG device (and to the GPU it is carved from), not to its siblings.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .base import GpuError, critical_xid

log = logging.getLogger(__name__)

KERNEL_LOG = Path("/dev/kmsg")
# XID events kept; a node sees a handful a day, this is weeks of them.
HISTORY = 4096
# The GPU instance of an event of the whole GPU (as nvmlEventData_t.gpuInstanceId has it).
WHOLE_GPU = 0xFFFFFFFF
UNKNOWN_GPU = "?"
# The driver's XID line: an address in parentheses (PCI domain:bus:device in hex, the domain %04x so possibly
# longer, then " GPU-I:nn GPU-CI:nn" on a GPU in MIG mode), then the XID.
_XID_LINE = re.compile(r"NVRM: Xid \((?P<address>[^)]*)\):?\s*(?P<xid>\d+)")
_PCI = re.compile(r"(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")
_GPU_INSTANCE = re.compile(r"GPU-I:(?P<gi>\d+)")


@dataclass(frozen=True)
class XidEvent:
    at: float
    gpu_uuid: str  # UNKNOWN_GPU when the address names no GPU of ours: it then counts against every GPU
    gpu_instance: int  # WHOLE_GPU, or the MIG device's GPU instance ID
    xid: int
    # The memory slices of that GPU instance when the event came (a dynamic MIG device may be gone by the
    # time its teardown asks); None for the whole GPU, or when they could not be read.
    slices: frozenset[int] | None = None

    def hits(self, gpu_instance: int | None, slices: frozenset[int] | None) -> bool:
        """Whether the event concerns a MIG device (by GPU instance ID, or by memory slices)."""
        if self.gpu_instance == WHOLE_GPU:
            return True
        if gpu_instance is not None and self.gpu_instance == gpu_instance:
            return True
        if slices is not None:
            return self.slices is None or bool(self.slices & slices)
        return gpu_instance is None


def pci_address(domain: int, bus: int, device: int) -> str:
    """A GPU's PCI address as the kernel driver prints it in an XID line."""
    return f"{domain:04x}:{bus:02x}:{device:02x}"


class XidWatcher:
    """Collects critical XID events from the kernel log in a thread.

    `gpus` maps each GPU's PCI address (pci_address) to its UUID; `slices_of(gpu_uuid, gpu_instance)` reads
    the memory slices of a GPU instance when its event comes (None when it cannot).

    Times: a record read as it comes counts from when it was read (at most a poll later than it happened, so
    never before an allocation it followed). The kernel's own timestamps are used only for the backlog read at
    start: its clock is not corrected by NTP as the wall clock is, and drifts from it over a long uptime."""

    def __init__(
        self,
        gpus: Mapping[str, str],
        slices_of: Callable[[str, int], frozenset[int] | None],
        kernel_log: Path = KERNEL_LOG,
        poll_s: float = 0.5,
    ) -> None:
        self._gpus = dict(gpus)
        self._slices_of = slices_of
        self._poll_s = poll_s
        self._events: collections.deque[XidEvent] = collections.deque(maxlen=HISTORY)
        self._overruns: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._backlog = True  # until the first read that finds nothing new
        self.error: str | None = None  # set when the log cannot be read any more: the watch is over
        self._log = kernel_log
        # Raises OSError: the caller says what to do about it.
        self._fd = os.open(kernel_log, os.O_RDONLY | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="scrubgate-xid-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # whatever ends the watch must fail health checks, not vanish
            self.error = f"reading {self._log}: {exc!r}"
            log.exception("XID watch stopped; health checks now fail until the agent restarts")
        finally:
            os.close(self._fd)

    def _watch(self) -> None:
        pending = b""
        while not self._stop.is_set():
            try:
                chunk = os.read(self._fd, 8192)  # /dev/kmsg: one record per read
            except BlockingIOError:
                chunk = b""
            except BrokenPipeError:
                # EPIPE: the ring buffer wrapped past records not yet read; the next read goes on after them.
                # XIDs among them are unknown: health checks of allocations older than now fail (closed).
                with self._lock:
                    self._overruns.append(time.time())
                log.error("the kernel log overwrote records before they were read; XIDs among them are unknown")
                continue
            except OSError as exc:
                self.error = f"reading {self._log}: {exc}"
                log.error("XID watch stopped (%s); health checks now fail until the agent restarts", self.error)
                return
            if chunk:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._record(line.decode("utf-8", "replace"))
                continue
            self._backlog = False
            self._stop.wait(self._poll_s)

    def _record(self, line: str) -> None:
        if line.startswith(" "):  # a record's continuation (KEY=value)
            return
        header, sep, message = line.partition(";")
        if not sep:
            message = header
        found = _XID_LINE.search(message)
        if found is None:
            return
        xid = int(found["xid"])
        at = time.time()
        if self._backlog and sep:  # "priority,sequence,microseconds since boot,flags;message"
            with contextlib.suppress(IndexError, ValueError):
                at -= time.monotonic() - int(header.split(",")[2]) / 1e6
        pci = _PCI.search(found["address"])
        uuid = self._gpus.get(pci["pci"].lower(), UNKNOWN_GPU) if pci else UNKNOWN_GPU
        instance = _GPU_INSTANCE.search(found["address"])
        gpu_instance = WHOLE_GPU if instance is None else int(instance["gi"])
        if not critical_xid(xid):
            # A tenant's own fault: not kept, so that many of them cannot push a critical one out of the history.
            log.info("XID %d (an application's own fault) on GPU %s: %s", xid, uuid, message.strip())
            return
        if uuid == UNKNOWN_GPU:
            log.warning("XID %d at %r names none of this node's GPUs: it counts against all", xid, found["address"])
        log.warning("XID %d on GPU %s: %s", xid, uuid, message.strip())
        slices = None
        # A GPU instance ID is reused: only a live event's ID still names the instance it happened in.
        if gpu_instance != WHOLE_GPU and uuid != UNKNOWN_GPU and not self._backlog:
            slices = self._slices_of(uuid, gpu_instance)
        with self._lock:
            self._events.append(XidEvent(at, uuid, gpu_instance, xid, slices))

    def since(
        self, gpu_uuid: str, since: float, gpu_instance: int | None = None, slices: frozenset[int] | None = None
    ) -> tuple[int, ...]:
        """Critical XIDs since `since` on the GPU; with `gpu_instance` or `slices`, on that MIG device or
        placement (and the whole GPU's) only. An event that names no GPU of ours counts everywhere, and XIDs that
        may have been lost since `since` fail the question: fail closed."""
        if self.error is None and not self._thread.is_alive() and not self._stop.is_set():
            self.error = "the watch thread ended"
        if self.error is not None:
            raise GpuError(f"XID events of {gpu_uuid} unknown: the XID watch stopped ({self.error})", gpu_uuid)
        with self._lock:
            lost = [t for t in self._overruns if t >= since]
            if lost:
                raise GpuError(
                    f"XID events of {gpu_uuid} unknown: the kernel log overwrote records before they were read "
                    f"({len(lost)} times since the allocation)",
                    gpu_uuid,
                )
            return tuple(
                e.xid
                for e in self._events
                if e.at >= since and e.gpu_uuid in (gpu_uuid, UNKNOWN_GPU) and e.hits(gpu_instance, slices)
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._poll_s * 4)


class EccBaseline:
    """Each GPU's volatile uncorrectable ECC count over time, so that health counts only the errors since a
    device was allocated: one old error must not fence a GPU forever.

    Sampled every minute, each time in a short NVML session (NVML is not held open between operations: see
    the module's docstring); kept as the first sample and every change (a few entries per GPU, however long
    a claim runs), and in `path` (the agent's state directory) so that a restarted agent still knows the
    count at allocations made before it. A count that went down means the driver was reloaded: the history
    starts again. Where no history reaches back to the allocation, the baseline is 0: every error since
    driver load counts (fail closed)."""

    def __init__(self, path: Path | None = None, sample_every_s: float = 60.0) -> None:
        self.path = path
        self.sample_every_s = sample_every_s
        self._changes: dict[str, list[tuple[float, int]]] = {}  # GPU -> [(first sample), (each change)...]
        self._lock = threading.Lock()
        if path is not None:
            try:
                loaded = json.loads(path.read_text())
                self._changes = {uuid: [(float(t), int(c)) for t, c in changes] for uuid, changes in loaded.items()}
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("ignoring the ECC history %s (%s): baselines start now", path, exc)

    def record(self, gpu_uuid: str, at: float, count: int) -> None:
        with self._lock:
            changes = self._changes.get(gpu_uuid)
            if changes and count == changes[-1][1]:
                return
            if not changes or count < changes[-1][1]:  # a first sample, or a driver reload
                self._changes[gpu_uuid] = [(at, count)]
            else:
                changes.append((at, count))
                del changes[1:-HISTORY]
            self._save()

    def at(self, gpu_uuid: str, since: float) -> int:
        with self._lock:
            changes = self._changes.get(gpu_uuid, [])
            older = [count for at, count in changes if at <= since]
        return older[-1] if older else 0

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(self._changes))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot keep the ECC history in %s: %s", self.path, exc)
