"""XID events from the kernel log, kept so that health() can answer "which critical XIDs hit this GPU since t".

The agent reads them from ``/dev/kmsg`` rather than from an NVML event set: an event set keeps an NVML session
open on every GPU for the agent's lifetime, and with DynamicMIG NVIDIA's DRA driver cannot change a GPU's MIG
mode while another process holds one ("in use by another client", as its nvlib.go says of mig-parted). The
kernel log also keeps history: XIDs from before the agent started are seen while the ring buffer holds them.

Which records count, and why a tenant cannot write one:

- Each read of /dev/kmsg returns one record, ``<facility << 3 | level>,<seq>,<usec since boot>,<flags>[,caller=..];
  <message>`` and then `` KEY=value`` lines; bytes of the message below 0x20 or above 0x7e are escaped as ``\\xNN``,
  so a record is one line (Linux kernel/printk/printk.c, info_print_ext_header and msg_add_ext_text). What a
  process writes into /dev/kmsg is stored with facility LOG_USER (1) or another it names, never LOG_KERN (0)
  (devkmsg_write: "to be able to reliably distinguish kernel-generated messages from userspace-injected ones").
  Only facility 0 counts.
- The kernel itself puts a task's name first in some records: ``<comm>[<pid>]: segfault at ...`` (arch/x86/mm/
  fault.c, show_signal_msg), ``<comm> invoked oom-killer: ...`` (mm/oom_kill.c, dump_header); any process sets
  its own name (prctl PR_SET_NAME), at most 15 characters. So a record counts only when its message *starts*
  with the driver's own format, which no task name can carry: ``NVRM: Xid (PCI:`` alone is 15 characters, and the
  format needs the PCI address's hex digits, ``): ``, the XID and a comma after it.
- The driver's format, every branch 535-595 (open-gpu-kernel-modules src/nvidia/src/kernel/gpu/rc/kernel_rc.c,
  krcReportXid; XIDs from GSP firmware come through the same function, kernel_gsp.c _kgspRpcOsErrorLog):
  ``NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u[ GPU-CI:%02u]]): %d, [pid=%s, name=%s, ]<message>``. The process
  name it may print (a tenant's) comes after the XID. It prints through nv_printf (kernel-open/nvidia/
  os-interface.c), always with KERN_CONT: the kernel then appends it to the previous record only where that
  record came from the same task or CPU and did not end its line, which the driver's own lines do.

An address that names none of this node's GPUs is the driver's word about a GPU the agent did not map: it counts
against every GPU (fail closed). A record that starts like an XID but is not in the driver's format is no XID
(logged, counted nowhere): a tenant may have written it.

Attribution: the open kernel driver never names a GPU instance (krcGetMigAttributionForError_KERNEL leaves it
invalid in every branch, and the GSP's XIDs carry none), so an XID counts against its whole GPU: every MIG device
and placement on it, not only the one whose tenant caused it. A ``GPU-I`` the line may carry is not used.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .base import GpuError, critical_xid

log = logging.getLogger(__name__)

KERNEL_LOG = Path("/dev/kmsg")
# XID events kept; a node sees a handful a day, this is weeks of them.
HISTORY = 4096
UNKNOWN_GPU = "?"
LOG_KERN = 0
# The driver's XID line (kernel_rc.c), anchored at the start of the record's message.
_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<domain>[0-9a-f]{4,8}):(?P<bus>[0-9a-f]{2}):(?P<device>[0-9a-f]{2})"
    r"(?: GPU-I:\d+)?(?: GPU-CI:\d+)?\): (?P<xid>\d+),"
)

PciAddress = tuple[int, int, int]  # PCI domain, bus, device


@dataclass(frozen=True)
class KernelRecord:
    facility: int
    seq: int
    usec: int  # since boot, the kernel's clock
    message: str


def parse_record(line: str) -> KernelRecord | None:
    """One /dev/kmsg record's first line; None for a continuation line or anything not in that format."""
    header, sep, message = line.partition(";")
    fields = header.split(",")
    if not sep or len(fields) < 4:
        return None
    try:
        prival, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    return KernelRecord(prival >> 3, seq, usec, message)


def parse_xid(record: KernelRecord) -> tuple[PciAddress, int] | None:
    """(the GPU's PCI address, the XID) of a record the NVIDIA kernel driver wrote; None for any other record."""
    if record.facility != LOG_KERN:
        return None
    found = _XID.match(record.message)
    if found is None:
        return None
    return (int(found["domain"], 16), int(found["bus"], 16), int(found["device"], 16)), int(found["xid"])


@dataclass(frozen=True)
class XidEvent:
    at: float
    gpu_uuid: str  # UNKNOWN_GPU when the address names no GPU of ours: it then counts against every GPU
    xid: int


class XidWatcher:
    """Collects critical XID events from the kernel log in a thread.

    `gpus` maps each GPU's PCI address (domain, bus, device) to its UUID.

    Times: a record read as it comes counts from when it was read (at most a poll later than it happened, so
    never before an allocation it followed). The kernel's own timestamps are used only for the backlog read at
    start: its clock is not corrected by NTP as the wall clock is, and drifts from it over a long uptime.

    Records lost unread fail the health checks of allocations older than the loss: those the ring buffer
    overwrote while the watch ran (EPIPE), and, at start, those it had overwritten before (the first record
    read is not the boot's first)."""

    def __init__(self, gpus: Mapping[PciAddress, str], kernel_log: Path = KERNEL_LOG, poll_s: float = 0.5) -> None:
        self._gpus = dict(gpus)
        self._poll_s = poll_s
        self._events: collections.deque[XidEvent] = collections.deque(maxlen=HISTORY)
        self._losses: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._backlog = True  # until the first read that finds nothing new
        self._first = True  # the first record not read yet
        self.error: str | None = None  # set when the log cannot be read any more: the watch is over
        self.gap: str | None = None  # records the kernel overwrote before the watch started, named
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
                    self._losses.append(time.time())
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

    def _when(self, record: KernelRecord) -> float:
        """Wall time of a record: when it was read, or for the backlog, by the kernel's clock."""
        now = time.time()
        return now - (time.monotonic() - record.usec / 1e6) if self._backlog else now

    def _record(self, line: str) -> None:
        record = parse_record(line)
        if record is None:
            return  # a record's continuation (" KEY=value"), or not the kernel's format
        if self._first:
            self._first = False
            self._name_gap(record)
        found = parse_xid(record)
        if found is None:
            if record.message.startswith("NVRM: Xid"):
                # Not the driver's format: a task named like an XID that crashed, or a process writing to the log.
                log.warning("ignoring a kernel log record that is not the driver's XID format: %r", record.message)
            return
        pci, xid = found
        uuid = self._gpus.get(pci, UNKNOWN_GPU)
        if not critical_xid(xid):
            # A tenant's own fault: not kept, so that many of them cannot push a critical one out of the history.
            log.info("XID %d (an application's own fault) on GPU %s: %s", xid, uuid, record.message)
            return
        if uuid == UNKNOWN_GPU:
            address = "{:04x}:{:02x}:{:02x}".format(*pci)
            log.warning("XID %d at PCI %s names none of this node's GPUs: it counts against all", xid, address)
        log.warning("XID %d on GPU %s: %s", xid, uuid, record.message)
        with self._lock:
            self._events.append(XidEvent(self._when(record), uuid, xid))

    def _name_gap(self, first: KernelRecord) -> None:
        """The kernel numbers records from 0 at boot: a first record read with a higher number means the ones
        before it were overwritten before anyone here read them."""
        if first.seq == 0:
            return
        lost_until = self._when(first)
        self.gap = (
            f"the kernel log had overwritten its first {first.seq} records (from boot until "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S%z', time.localtime(lost_until))}) before the XID watch started: "
            "XIDs among them are unknown, so health checks of allocations made before then fail"
        )
        log.warning("%s; the node's persistent log (journalctl -k) may still hold them", self.gap)
        with self._lock:
            self._losses.append(lost_until)

    def problem(self) -> str | None:
        """Why the watch is over (the log cannot be read, the thread died), or None while it runs."""
        if self.error is None and not self._thread.is_alive() and not self._stop.is_set():
            self.error = "the watch thread ended"
        return self.error

    def since(self, gpu_uuid: str, since: float) -> tuple[int, ...]:
        """Critical XIDs since `since` on the GPU (and on any of its MIG devices). An event that names no GPU of
        ours counts everywhere, and XIDs that may have been lost since `since` fail the question: fail closed."""
        problem = self.problem()
        if problem is not None:
            raise GpuError(f"XID events of {gpu_uuid} unknown: the XID watch stopped ({problem})", gpu_uuid)
        with self._lock:
            lost = [t for t in self._losses if t >= since]
            if lost:
                raise GpuError(
                    f"XID events of {gpu_uuid} unknown: the kernel log overwrote records before they were read "
                    f"({len(lost)} times since the allocation)",
                    gpu_uuid,
                )
            return tuple(e.xid for e in self._events if e.at >= since and e.gpu_uuid in (gpu_uuid, UNKNOWN_GPU))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._poll_s * 4)


class EccBaseline:
    """Each GPU's volatile uncorrectable ECC count over time, so that health counts only the errors since a
    device was allocated: one old error must not fence a GPU forever.

    Sampled every minute, each GPU in a short NVML session of its own (NVML is not held open between operations:
    see nvml.py); kept as the first sample and every change (a few entries per GPU, however long a claim runs),
    and in `path` (the agent's state directory) so that a restarted agent still knows the count at allocations
    made before it. A count that went down means the driver was reloaded: the history starts again. Where no
    history reaches back to the allocation, the baseline is 0: every error since driver load counts (fail
    closed)."""

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
