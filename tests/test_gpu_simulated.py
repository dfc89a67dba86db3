"""The simulated GPU backend: real bytes, shared between processes, faults that fail closed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from scrubgate.sanitizer_agent.gpu import GpuBackend, GpuError, open_backend
from scrubgate.sanitizer_agent.gpu import simulated as sim

CANARY = b"TENANT-A-SECRET!"


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, list[sim.GpuDevice], sim.SimulatedGpu]:
    devices = sim.create_inventory(tmp_path, gpus=2, mig_per_gpu=2, memory_bytes=1 << 20)
    return tmp_path, devices, sim.SimulatedGpu(tmp_path)


def gpu(devices: list[sim.GpuDevice], mig: bool = False) -> sim.GpuDevice:
    return next(d for d in devices if d.is_mig == mig)


def test_inventory_lists_gpus_and_mig_slices_with_parents(node):
    root, devices, backend = node
    listed = backend.list_devices()
    assert listed == devices
    gpus = [d for d in listed if not d.is_mig]
    migs = [d for d in listed if d.is_mig]
    assert len(gpus) == 2 and len(migs) == 4
    assert all(d.uuid.startswith("GPU-") for d in gpus) and all(d.uuid.startswith("MIG-") for d in migs)
    assert {m.parent_uuid for m in migs} == {g.uuid for g in gpus}
    for d in listed:
        assert d.memory_total == d.memory_reserved + d.memory_free == d.memory_reserved + sim.memory_size(root, d.uuid)


def test_inventory_refuses_to_overwrite_a_node(node):
    root, _, _ = node
    with pytest.raises(FileExistsError):
        sim.create_inventory(root)


def test_open_backend_gives_a_gpu_backend(node):
    root, devices, _ = node
    backend = open_backend("simulated", root=root)
    assert isinstance(backend, GpuBackend)
    assert backend.list_devices() == devices


def test_verified_scrub_removes_a_tenants_canary(node):
    root, devices, backend = node
    device = gpu(devices)
    sim.fill(root, device.uuid, CANARY)
    result = backend.scrub(device.uuid)
    assert result.verified and result.reason is None
    assert result.method == sim.METHOD
    assert result.bytes_scrubbed == sim.memory_size(root, device.uuid)
    assert (result.bytes_total, result.bytes_reserved, result.bytes_unreachable) == (
        device.memory_total,
        device.memory_reserved,
        0,
    )
    memory = sim.read(root, device.uuid)
    assert CANARY not in memory and memory.count(0) == len(memory)


def test_scrubbing_a_mig_slice_leaves_its_siblings_alone(node):
    root, devices, backend = node
    first, second = [d for d in devices if d.is_mig][:2]
    sim.fill(root, first.uuid, CANARY)
    sim.fill(root, second.uuid, CANARY)
    assert backend.scrub(first.uuid).verified
    assert CANARY not in sim.read(root, first.uuid)
    assert CANARY in sim.read(root, second.uuid)


def test_another_process_writes_what_the_agent_reads(node):
    root, devices, _ = node
    device = gpu(devices)
    code = (
        "import sys; from scrubgate.sanitizer_agent.gpu import simulated as s;"
        f"s.write(sys.argv[1], sys.argv[2], 4096, {CANARY!r})"
    )
    subprocess.run([sys.executable, "-c", code, str(root), device.uuid], check=True)
    assert sim.read(root, device.uuid, 4096, len(CANARY)) == CANARY


def test_writes_outside_device_memory_are_refused(node):
    root, devices, _ = node
    device = gpu(devices)
    with pytest.raises(ValueError, match=device.uuid):
        sim.write(root, device.uuid, sim.memory_size(root, device.uuid) - 1, b"xx")


def test_a_live_process_holds_the_device_and_blocks_the_scrub(node):
    root, devices, backend = node
    device = gpu(devices)
    sim.fill(root, device.uuid, CANARY)
    tenant = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        sim.attach(root, device.uuid, pid=tenant.pid, used_memory=4096)
        assert [p.pid for p in backend.processes(device.uuid)] == [tenant.pid]
        result = backend.scrub(device.uuid)
        assert not result.verified and str(tenant.pid) in result.reason
        assert CANARY in sim.read(root, device.uuid)  # nothing of a running tenant is touched
    finally:
        tenant.communicate(b"")
    assert backend.processes(device.uuid) == []
    assert backend.scrub(device.uuid).verified


def test_detach_releases_the_device(node):
    root, devices, backend = node
    device = gpu(devices)
    pid = sim.attach(root, device.uuid, kind="mps")
    assert [(p.pid, p.kind) for p in backend.processes(device.uuid)] == [(pid, "mps")]
    sim.detach(root, device.uuid)
    assert backend.processes(device.uuid) == []


def test_a_lingering_process_never_goes_away(node):
    root, devices, backend = node
    device, other = [d for d in devices if not d.is_mig]
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(exited.stdout)
    sim.attach(root, device.uuid, pid=dead_pid)
    sim.inject_fault(root, device.uuid, "linger")
    assert [p.pid for p in backend.processes(device.uuid)] == [dead_pid]
    assert not backend.scrub(device.uuid).verified
    sim.inject_fault(root, other.uuid, "linger")
    assert [p.pid for p in backend.processes(other.uuid)] == [sim.LINGERING_PID]
    sim.clear_faults(root, device.uuid)
    assert backend.processes(device.uuid) == []


def test_scrub_error_fails_closed_and_leaves_memory_dirty(node):
    root, devices, backend = node
    device = gpu(devices)
    sim.fill(root, device.uuid, CANARY)
    sim.inject_fault(root, device.uuid, "scrub_error", "CUDA_ERROR_LAUNCH_FAILED")
    result = backend.scrub(device.uuid)
    assert not result.verified and "CUDA_ERROR_LAUNCH_FAILED" in result.reason and device.uuid in result.reason
    assert result.bytes_scrubbed == 0
    assert CANARY in sim.read(root, device.uuid)


def test_verification_catches_bytes_the_memset_left_behind(node):
    root, devices, backend = node
    device = gpu(devices)
    sim.inject_fault(root, device.uuid, "verify_mismatch")
    result = backend.scrub(device.uuid)
    assert not result.verified
    assert f"{sim.STUCK_BYTES} non-zero bytes" in result.reason
    assert sim.read(root, device.uuid).count(0) == sim.memory_size(root, device.uuid) - sim.STUCK_BYTES


def test_nvml_error_on_a_device(node):
    root, devices, backend = node
    device = gpu(devices)
    sim.inject_fault(root, device.uuid, "nvml_error", "GPU is lost")
    for call in (backend.processes, lambda u: backend.health(u, 0), backend.scrub):
        with pytest.raises(GpuError, match=device.uuid):
            call(device.uuid)
    assert device.uuid not in [d.uuid for d in backend.list_devices()]


def test_nvml_error_everywhere_fails_the_listing(node):
    root, _, backend = node
    sim.inject_fault(root, sim.ALL_DEVICES, "nvml_error")
    with pytest.raises(GpuError):
        backend.list_devices()


def test_health_reports_injected_faults(node):
    root, devices, backend = node
    device = gpu(devices)
    assert backend.health(device.uuid, 0).healthy
    sim.inject_fault(root, device.uuid, "ecc_error", 2)
    sim.inject_fault(root, device.uuid, "remap_pending")
    sim.inject_fault(root, device.uuid, "recovery_action", 1)
    health = backend.health(device.uuid, 0)
    assert not health.healthy
    assert health.ecc_uncorrectable_volatile == 2 and health.remapped_rows_pending
    assert any("2 uncorrectable ECC" in p for p in health.problems())
    assert health.to_attestation() == {"eccUncorrectable": 2, "remapPending": True, "xids": []}


def test_only_critical_xids_since_the_given_time_count(node):
    root, devices, backend = node
    device, other = [d for d in devices if not d.is_mig]
    sim.inject_fault(root, device.uuid, "xid", 79, at=100.0)
    sim.inject_fault(root, device.uuid, "xid", 13, at=200.0)  # an application fault, not the GPU's
    sim.inject_fault(root, device.uuid, "xid", 48, at=200.0)
    assert backend.health(device.uuid, 0).xids == (79, 48)
    assert backend.health(device.uuid, 150.0).xids == (48,)
    assert backend.health(other.uuid, 0).xids == ()


def test_a_vanished_mig_device_fails_closed(node):
    root, devices, backend = node
    mig = gpu(devices, mig=True)
    sim.remove_device(root, mig.uuid)
    result = backend.scrub(mig.uuid)
    assert not result.verified and "no longer exists" in result.reason
    with pytest.raises(GpuError, match=mig.uuid):
        backend.processes(mig.uuid)


def test_unknown_fault_kind_is_refused(node):
    root, devices, _ = node
    with pytest.raises(ValueError, match="unknown fault"):
        sim.inject_fault(root, devices[0].uuid, "melt")  # type: ignore[arg-type]


def test_a_full_node_scrubs_every_device(tmp_path):
    devices = sim.create_inventory(tmp_path, gpus=8, mig_per_gpu=7, memory_bytes=2 << 20)
    backend = sim.SimulatedGpu(tmp_path)
    for device in devices:
        sim.write(tmp_path, device.uuid, 0, CANARY)
    results = [backend.scrub(d.uuid) for d in devices]
    assert len(results) == 64 and all(r.verified for r in results)
    assert all(sim.read(tmp_path, d.uuid, 0, len(CANARY)) == bytes(len(CANARY)) for d in devices)
