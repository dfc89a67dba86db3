"""XIDs from the kernel log, read by the real backend over the fake node's /dev/kmsg: records as the kernel writes
them (Linux kernel/printk/printk.c: info_print_ext_header, msg_add_ext_text, devkmsg_write), the NVIDIA driver's
XID lines as every open driver branch 535-595 prints them (open-gpu-kernel-modules
src/nvidia/src/kernel/gpu/rc/kernel_rc.c, krcReportXid), and records a tenant can make the kernel write."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import test_gpu_nvml
from scrubgate.sanitizer_agent.gpu import GpuError, MigPlacement
from scrubgate.sanitizer_agent.gpu.nvml import NvmlBackend
from test_gpu_nvml import wait_for

# The fake node and the backend over it, as the backend's other tests have them.
node = test_gpu_nvml.node
open_nvml = test_gpu_nvml.open_nvml

# A task may name itself anything up to 15 characters (prctl PR_SET_NAME; TASK_COMM_LEN is 16).
XID_LIKE_NAMES = ["NVRM: Xid ()79", "NVRM: Xid (PCI:"]


def failing_health(backend: NvmlBackend, uuid: str, since: float) -> str | None:
    """Why the health check fails (GpuError), or None when it answers."""
    try:
        backend.health(uuid, since)
    except GpuError as exc:
        return str(exc)
    return None


def crash_records(comm: str) -> list[tuple[str, int]]:
    """(message, level) of what the kernel writes when a task named `comm` (pid 4242, uid 65534) crashes or is
    killed for memory:
    - arch/x86/mm/fault.c show_signal_msg, KERN_INFO: "%s%s[%d]: segfault at %lx ip %px sp %px error %lx" with
      " in <file>[<range>]" and " likely on CPU ..." continued onto it;
    - arch/x86/kernel/traps.c (pr_fmt "traps: "), KERN_INFO: "%s[%d] general protection fault ip:%lx sp:%lx
      error:%lx" and " in <file>";
    - mm/oom_kill.c dump_header, KERN_WARNING: "%s invoked oom-killer: gfp_mask=%#x(%pGg), order=%d,
      oom_score_adj=%hd"; dump_oom_victim: "oom-kill:...,task=%s,pid=%d,uid=%d"; __oom_kill_process, KERN_ERR:
      "%s: Killed process %d (%s) total-vm:..."."""
    return [
        (
            f"{comm}[4242]: segfault at 0 ip 00000000004005b1 sp 00007ffc5b1be400 error 4 in a.out[400000+1000] "
            "likely on CPU 3 (core 3, socket 0)",
            6,
        ),
        (f"traps: {comm}[4242] general protection fault ip:4005b1 sp:7ffc5b1be400 error:0 in a.out[400000+1000]", 6),
        (f"{comm} invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0", 4),
        (
            "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/kubepods,"
            f"task_memcg=/kubepods/pod1,task={comm},pid=4242,uid=65534",
            6,
        ),
        (
            f"Memory cgroup out of memory: Killed process 4242 ({comm}) total-vm:1000kB, anon-rss:900kB, "
            "file-rss:0kB, shmem-rss:0kB, UID:65534 pgtables:40kB oom_score_adj:1000",
            3,
        ),
    ]


@pytest.mark.parametrize("comm", XID_LIKE_NAMES)
def test_a_task_named_like_an_xid_that_crashes_fences_nothing(node, open_nvml, comm):
    """The attack: a tenant's process renames itself like the driver's XID line and crashes (or writes the line
    into /dev/kmsg, where the kernel files it as LOG_USER). Neither the running watch nor a fresh one, reading it
    back from the ring buffer, may count an XID on any GPU."""
    gpu = node.add_gpu()
    other = node.add_gpu()
    for message, level in crash_records(comm):
        node.log_kernel(message, level)
    node.log_user("NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.")
    # A file name is not limited to 15 characters, and may hold a newline: the kernel escapes it (\\x0a).
    node.log_kernel(f"{comm}[4242]: segfault at 0 ip 0 sp 0 error 4 in a\nNVRM: Xid (PCI:0000:18:00): 79, b[4+1]", 6)
    running = open_nvml(watch_xids=True)  # reads them as backlog
    node.log_xid(other["uuid"], 62)  # a genuine one after them: once it is seen, so were they
    assert wait_for(lambda: running.health(other["uuid"], 0).xids) == (62,)
    assert running.health(gpu["uuid"], 0).xids == ()
    for message, level in crash_records(comm):
        node.log_kernel(message, level)  # while the watch runs
    node.log_xid(other["uuid"], 64)
    assert wait_for(lambda: running.health(other["uuid"], 0).xids == (62, 64))
    assert running.health(gpu["uuid"], 0).xids == ()
    fresh = open_nvml(watch_xids=True)  # an agent restarted later reads all of it again
    assert wait_for(lambda: fresh.health(other["uuid"], 0).xids == (62, 64))
    assert fresh.health(gpu["uuid"], 0).xids == ()


@pytest.mark.parametrize(
    ("message", "xid"),
    [
        # 535-560: pid and name always (pid='<unknown>' where none).
        ("NVRM: Xid (PCI:{pci}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", 79),
        # 570-595: without a process, no pid and name.
        ("NVRM: Xid (PCI:{pci}): 79, GPU has fallen off the bus.", 79),
        ("NVRM: Xid (PCI:{pci}): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", 154),
        # An empty message: "%d, %s%s" with both empty.
        ("NVRM: Xid (PCI:{pci}): 48, ", 48),
        # The process name the driver prints is the tenant's: only what comes first counts.
        ("NVRM: Xid (PCI:{pci}): 13, pid=7, name=NVRM: Xid (PCI:0000:28:00): 79, Graphics Exception", None),
        ("NVRM: Xid (PCI:{pci}): 45, pid=7, name=python3, Ch 00000010 caused by previous Xid 31", None),
    ],
)
def test_the_drivers_xid_lines_of_every_branch_count_against_their_gpu(node, open_nvml, message, xid):
    gpu = node.add_gpu()
    other = node.add_gpu()
    backend = open_nvml(watch_xids=True)
    node.log_kernel(message.format(pci="0000:18:00"), 4)
    node.log_xid(other["uuid"], 62)
    assert wait_for(lambda: backend.health(other["uuid"], 0).xids) == (62,), "the other GPU's is not this one's"
    assert backend.health(gpu["uuid"], 0).xids == (() if xid is None else (xid,))


def test_a_pci_domain_over_four_digits_maps_to_its_gpu(node, open_nvml):
    """%04x prints a VMD domain (0x10000 and up) with five digits."""
    gpu = node.add_gpu(pciDomain=0x10000)
    other = node.add_gpu()
    backend = open_nvml(watch_xids=True)
    node.log_xid(gpu["uuid"], 48)
    assert wait_for(lambda: backend.health(gpu["uuid"], 0).xids) == (48,)
    assert backend.health(other["uuid"], 0).xids == ()


def test_an_address_of_no_gpu_of_ours_in_the_drivers_own_record_counts_against_every_gpu(node, open_nvml, caplog):
    """Only the driver writes this record now: a GPU the agent did not map (one NVML could not read at start) is
    one it cannot tell from its own. Fail closed, and name the address."""
    gpu = node.add_gpu()
    other = node.add_gpu()
    backend = open_nvml(watch_xids=True)
    node.log_kernel("NVRM: Xid (PCI:0000:99:00): 79, GPU has fallen off the bus.", 4)
    assert wait_for(lambda: backend.health(gpu["uuid"], 0).xids) == (79,)
    assert backend.health(other["uuid"], 0).xids == (79,)
    assert any("PCI 0000:99:00 names none of this node's GPUs" in r.getMessage() for r in caplog.records)


def test_xids_are_classified_as_nvidias_driver_does(node, open_nvml):
    gpu = node.add_gpu()
    backend = open_nvml(watch_xids=True)
    for xid in (13, 31, 43, 45, 68, 109, 62, 154):  # application faults, then two that are not
        node.log_xid(gpu["uuid"], xid)
    assert wait_for(lambda: len(backend.health(gpu["uuid"], 0).xids) == 2)
    assert backend.health(gpu["uuid"], 0).xids == (62, 154)


def test_an_xid_counts_against_every_mig_device_and_placement_of_its_gpu(node, open_nvml):
    """The open driver names no GPU instance (kernel_rc.c: krcGetMigAttributionForError_KERNEL leaves it
    invalid in every branch; GSP's XIDs come through kernel_gsp.c _kgspRpcOsErrorLog without one), so one slice's
    contained error cannot be told from its siblings': it counts against every MIG device and placement of its
    GPU. A line that does name one (the only example: kern_gpu_error_cont_ga100.c's comment, "NVRM: Xid
    (PCI:0000:01:00 GPU-I:05): 94, ...") counts the same way."""
    gpu = node.add_gpu(mig=[])
    tenant = node.create_mig(gpu, "15", start=2)
    sibling = node.create_mig(gpu, "19", start=5)
    other = node.add_gpu()
    backend = open_nvml(watch_xids=True)
    node.log_xid(gpu["uuid"], 94)
    assert wait_for(lambda: backend.health(tenant["uuid"], 0).xids) == (94,)
    assert backend.health(sibling["uuid"], 0).xids == (94,)
    node.log_kernel(
        f"NVRM: Xid (PCI:0000:18:00 GPU-I:{tenant['gi']:02d} GPU-CI:00): 94, pid=7194, Contained: CE User "
        "Channel (0x9). RST: No, D-RST: No",
        4,
    )
    assert wait_for(lambda: backend.health(sibling["uuid"], 0).xids == (94, 94))
    node.delete_mig(tenant["uuid"])  # unprepared: the placement is all that is left of it
    for placement in (MigPlacement(gpu["uuid"], 15, 2, 2), MigPlacement(gpu["uuid"], 19, 7, 1)):
        assert backend.placement_health(placement, 0).xids == (94, 94)
    assert backend.health(other["uuid"], 0).xids == ()


def test_the_backlog_is_dated_by_the_kernels_clock(node, open_nvml):
    gpu = node.add_gpu()
    node.log_xid(gpu["uuid"], 79)  # before the agent started
    long_ago = int((time.monotonic() - 300) * 1e6)
    with node.kmsg.open("a") as log:
        log.write(" SUBSYSTEM=net\n")  # a record's continuation line
        log.write(f"4,1,{long_ago},c;NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error\n")
    backend = open_nvml(watch_xids=True)
    assert wait_for(lambda: backend.health(gpu["uuid"], 0).xids) == (79, 48)
    assert backend.health(gpu["uuid"], time.time() - 60).xids == (79,), "five minutes ago by the kernel's clock"
    logged = time.time()
    node.log_xid(gpu["uuid"], 62)
    assert wait_for(lambda: backend.health(gpu["uuid"], logged).xids) == (62,)


def test_records_the_kernel_overwrote_before_the_watch_started_are_named_and_fail_older_allocations(
    node, open_nvml, caplog
):
    """The kernel numbers records from 0 at boot and /dev/kmsg starts a reader at the oldest it still holds: a
    first record numbered 57 means 57 were lost before anyone here read them."""
    gpu = node.add_gpu()
    node._seq = 57
    node.log_kernel("eth0: link up")
    allocated_before = time.time() - 5
    backend = open_nvml(watch_xids=True)
    assert "overwrote records" in (wait_for(lambda: failing_health(backend, gpu["uuid"], allocated_before)) or "")
    assert backend.health(gpu["uuid"], time.time() + 1).xids == (), "allocations after the gap are checked as ever"
    named = [r.getMessage() for r in caplog.records if "overwritten its first 57 records" in r.getMessage()]
    assert named and "before the XID watch started" in named[0]


def test_a_log_read_from_its_first_record_has_no_gap(node, open_nvml):
    gpu = node.add_gpu()
    node.log_kernel("Linux version 6.8.0")
    backend = open_nvml(watch_xids=True)
    node.log_xid(gpu["uuid"], 13)  # read, and not critical: the backlog is behind it
    assert wait_for(lambda: backend.health(gpu["uuid"], 0).xids == ())
    assert backend._health.xids is not None and backend._health.xids.gap is None


class _KernelLogFault:
    """The `os` the XID watch reads through, with one read failing as given."""

    def __init__(self, error: Exception) -> None:
        self.error: Exception | None = error

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def read(self, fd: int, size: int) -> bytes:
        error, self.error = self.error, None
        if error is not None:
            raise error
        return os.read(fd, size)


def test_records_the_kernel_overwrote_unread_fail_health_checks_since_then(node, open_nvml, monkeypatch):
    gpu = node.add_gpu()
    before = time.time() - 1
    monkeypatch.setattr("scrubgate.sanitizer_agent.gpu.xid.os", _KernelLogFault(BrokenPipeError(32, "EPIPE")))
    backend = open_nvml(watch_xids=True)
    node.log_xid(gpu["uuid"], 79)
    assert wait_for(lambda: failing_health(backend, gpu["uuid"], before)), "XIDs since then are unknown"
    assert "overwrote records" in (failing_health(backend, gpu["uuid"], before) or "")
    assert backend.health(gpu["uuid"], time.time() + 1).xids == (), "later allocations are checked as ever"


def test_a_watch_that_dies_fails_health_checks_and_says_so_for_healthz(node, open_nvml, monkeypatch):
    gpu = node.add_gpu()
    monkeypatch.setattr("scrubgate.sanitizer_agent.gpu.xid.os", _KernelLogFault(RuntimeError("unexpected")))
    backend = open_nvml(watch_xids=True)
    assert "RuntimeError('unexpected')" in (wait_for(lambda: failing_health(backend, gpu["uuid"], 0)) or "")
    assert "RuntimeError('unexpected')" in (backend.watch_error() or "")
    assert open_nvml(watch_xids=False).watch_error() is None, "no watch asked for: nothing to fail"


def test_a_kernel_log_that_cannot_be_read_fails_health_checks(node, open_nvml, tmp_path):
    gpu = node.add_gpu()
    backend = open_nvml(watch_xids=True, kernel_log=tmp_path)  # opens, but every read fails (EISDIR)
    assert "Is a directory" in (wait_for(lambda: failing_health(backend, gpu["uuid"], 0)) or "")
    assert "Is a directory" in (backend.watch_error() or "")
