"""The real backend's code paths (NVML in process, the CUDA scrub in a child) against faithful
stand-ins of pynvml and cuda.bindings.driver (tests/fakes), so misuse of either API fails here."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from scrubgate.policies.names import ATTESTATION_METHOD
from scrubgate.sanitizer_agent.gpu import GpuBackend, GpuError, MigPlacement, open_backend
from scrubgate.sanitizer_agent.gpu.cuda_scrub import NO_KERNELS
from scrubgate.sanitizer_agent.gpu.nvml import NvmlBackend

FAKES = Path(__file__).parent / "fakes"
CANARY = b"TENANT-A-SECRET!"
MiB = 1 << 20
MARGIN = 4 * MiB


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fake GPU node; ``import pynvml`` gets the fake, fresh for each test, and only here."""
    monkeypatch.syspath_prepend(str(FAKES))
    fakes = ("pynvml", "fakegpu")
    for name in fakes:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import fakegpu

    fake = fakegpu.FakeNode(tmp_path / "node")
    for key, value in fake.env.items():
        monkeypatch.setenv(key, value)
    yield fake
    for name in fakes:
        sys.modules.pop(name, None)


@pytest.fixture
def open_nvml(node: Any, tmp_path: Path) -> Any:
    opened: list[NvmlBackend] = []
    # The kernel driver's parameters as a default install has them: scrub-on-free on.
    params = tmp_path / "driver-params"
    params.write_text('RegistryDwords: ""\n')

    def make(**options: Any) -> NvmlBackend:
        # Without the XID watch unless a test needs it; with it, the fake node's kernel log.
        # The fake's CUDA context (1 MiB) and kernels are a larger share of its small devices than a real
        # context is of a GPU's memory: the coverage bound here is 10%, the default (2%) has its own test.
        options = {
            "chunk_bytes": 8 * MiB,
            "min_chunk_bytes": 64 << 10,
            "margin_bytes": MARGIN,
            "max_unreachable_fraction": 0.1,
            "child_env": node.env,
            "watch_xids": False,
            "kernel_log": node.kmsg,
            "params_path": params,
            **options,
        }
        backend = open_backend("nvml", **options)
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        backend.close()


def fake_nvml() -> Any:
    return sys.modules["pynvml"]


def wait_for(condition: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


# ---------------------------------------------------------------- inventory


def test_lists_gpus_and_mig_devices(node, open_nvml):
    plain = node.add_gpu(memory=32 * MiB, reserved=MiB)
    split = node.add_gpu(memory=32 * MiB, mig=[8 * MiB, 4 * MiB])
    backend = open_nvml()
    assert isinstance(backend, GpuBackend)
    devices = {d.uuid: d for d in backend.list_devices()}
    assert set(devices) == {plain["uuid"], split["uuid"], *(m["uuid"] for m in split["migs"])}
    assert devices[plain["uuid"]].memory_total == 33 * MiB
    assert devices[plain["uuid"]].memory_reserved == MiB
    assert devices[plain["uuid"]].memory_free == 32 * MiB
    first_mig = devices[split["migs"][0]["uuid"]]
    assert first_mig.parent_uuid == split["uuid"] and first_mig.index == 0
    assert first_mig.memory_total == 8 * MiB
    assert devices[split["migs"][1]["uuid"]].index == 1


def test_older_drivers_without_v2_memory_info_report_no_reserve(node, open_nvml):
    gpu = node.add_gpu(memoryV2=False)
    [device] = open_nvml().list_devices()
    assert device.uuid == gpu["uuid"] and device.memory_reserved == 0


def test_a_gpu_nvml_cannot_read_is_left_out(node, open_nvml):
    broken = node.add_gpu()
    fine = node.add_gpu()
    backend = open_nvml()
    node.data["nvmlErrors"] = {broken["uuid"]: {"nvmlDeviceGetUUID": "NVML_ERROR_GPU_IS_LOST"}}
    node.save()
    assert [d.uuid for d in backend.list_devices()] == [fine["uuid"]]


def test_nvml_that_cannot_count_gpus_is_an_error(node, open_nvml):
    node.add_gpu()
    backend = open_nvml()
    node.data["nvmlErrors"] = {"*": {"nvmlDeviceGetCount": "NVML_ERROR_DRIVER_NOT_LOADED"}}
    node.save()
    with pytest.raises(GpuError, match="cannot list GPUs"):
        backend.list_devices()


def test_missing_bindings_say_how_to_install_them(node, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuError, match=r"scrubgate\[gpu\]"):
        open_backend("nvml")


# ---------------------------------------------------------------- processes


def test_processes_of_every_kind(node, open_nvml):
    gpu = node.add_gpu(processes={"compute": [[101, 4 * MiB]], "graphics": [[102, None]], "mps": [[103, MiB]]})
    processes = open_nvml().processes(gpu["uuid"])
    assert {(p.pid, p.kind, p.used_memory) for p in processes} == {
        (101, "compute", 4 * MiB),
        (102, "graphics", None),
        (103, "mps", MiB),
    }


def test_processes_on_a_mig_device_skip_the_unsupported_graphics_query(node, open_nvml):
    gpu = node.add_gpu(mig=[8 * MiB])
    mig = gpu["migs"][0]
    mig["processes"] = {"compute": [[7, MiB]]}
    node.save()
    assert [p.pid for p in open_nvml().processes(mig["uuid"])] == [7]


def test_process_query_errors_name_the_device(node, open_nvml):
    gpu = node.add_gpu()
    backend = open_nvml()
    node.data["nvmlErrors"] = {gpu["uuid"]: {"nvmlDeviceGetComputeRunningProcesses": "NVML_ERROR_UNKNOWN"}}
    node.save()
    with pytest.raises(GpuError, match=gpu["uuid"]):
        backend.processes(gpu["uuid"])
    with pytest.raises(GpuError, match="GPU-nope"):
        backend.processes("GPU-nope")


# ---------------------------------------------------------------- health


def test_health_of_a_mig_device_is_read_from_its_gpu(node, open_nvml):
    gpu = node.add_gpu(mig=[8 * MiB], ecc=3, remappedRows=[1, 1, 1, 0], recoveryAction=1)
    health = open_nvml().health(gpu["migs"][0]["uuid"], 0)
    assert health.ecc_uncorrectable_volatile == 3
    assert health.remapped_rows_pending and not health.remapped_rows_failed
    assert health.recovery_action == 1
    assert not health.healthy


def test_health_without_ecc_row_remapping_or_recovery_field(node, open_nvml):
    gpu = node.add_gpu(ecc=None, remappedRows=None, recoveryAction=None)
    health = open_nvml().health(gpu["uuid"], 0)
    assert health == type(health)(0, False, False, None, ())
    assert health.healthy


def test_a_gpu_without_persistence_mode_is_named_at_start(node, open_nvml, caplog):
    node.add_gpu()
    lone = node.add_gpu(persistenceMode=0)
    open_nvml()
    warned = [r.getMessage() for r in caplog.records if "without persistence mode" in r.getMessage()]
    assert len(warned) == 1 and lone["uuid"] in warned[0]


def test_ecc_errors_count_from_the_allocation_not_from_driver_load(node, open_nvml):
    gpu = node.add_gpu(ecc=2)  # two old errors, from before any tenant of ours
    backend = open_nvml()
    allocated = time.time()
    assert backend.health(gpu["uuid"], allocated).healthy, "old errors do not fence the GPU forever"
    assert backend.health(gpu["uuid"], 0).ecc_uncorrectable_volatile == 2, "no baseline before the agent looked"
    node.data["gpus"][0]["ecc"] = 3
    node.save()
    health = backend.health(gpu["uuid"], allocated)
    assert health.ecc_uncorrectable_volatile == 1 and not health.healthy
    assert "1 uncorrectable ECC errors since the allocation" in health.problems()


def test_the_ecc_baseline_outlives_an_agent_restart(node, open_nvml, tmp_path):
    history = tmp_path / "ecc-history.json"
    gpu = node.add_gpu(ecc=2)
    open_nvml(ecc_history_path=history).close()  # the agent saw 2 old errors, then restarted
    allocated = time.time()
    node.data["gpus"][0]["ecc"] = 3  # one more while it was down
    node.save()
    health = open_nvml(ecc_history_path=history).health(gpu["uuid"], allocated)
    assert health.ecc_uncorrectable_volatile == 1, "the old two are not counted, the new one is"
    node.data["gpus"][0]["ecc"] = 0  # the driver was reloaded: volatile counters start again
    node.save()
    later = open_nvml(ecc_history_path=history)
    assert later.health(gpu["uuid"], allocated).ecc_uncorrectable_volatile == 0
    assert [c for _, c in json.loads(history.read_text())[gpu["uuid"]]] == [0], "a new history after the reload"


# ---------------------------------------------------------------- scrub


def canary_bytes(node: Any, uuid: str) -> int:
    return node.memory(uuid).count(CANARY) * len(CANARY)


def test_scrub_zeroes_and_verifies_what_it_can_reach(node, open_nvml):
    gpu = node.add_gpu(memory=32 * MiB, reserved=MiB)
    node.fill(gpu["uuid"], CANARY)
    result = open_nvml().scrub(gpu["uuid"])
    assert result.verified, result.reason
    assert result.method == ATTESTATION_METHOD
    assert (result.bytes_total, result.bytes_reserved) == (33 * MiB, MiB)
    assert 0 < result.bytes_scrubbed < 32 * MiB  # the scrubber's own context and kernels take some
    assert result.bytes_unreachable == 32 * MiB - result.bytes_scrubbed
    assert result.kernel_s is not None and result.kernel_s <= result.duration_s
    assert canary_bytes(node, gpu["uuid"]) <= result.bytes_unreachable


def test_scrub_reaches_memory_in_halving_chunks(node, open_nvml):
    gpu = node.add_gpu(memory=20 * MiB)
    # 8 MiB chunks do not fit the last 4 MiB; halving down to 64 KiB reaches all but < 64 KiB of it.
    result = open_nvml().scrub(gpu["uuid"])
    overhead = gpu["contextBytes"] + (256 << 10) + 512  # context, kernels, the counter
    assert result.verified
    assert 20 * MiB - overhead - result.bytes_scrubbed < 64 << 10


def test_scrub_of_a_static_mig_device(node, open_nvml):
    gpu = node.add_gpu(mig=[16 * MiB, 16 * MiB])
    first, second = (m["uuid"] for m in gpu["migs"])
    node.fill(first, CANARY)
    node.fill(second, CANARY)
    result = open_nvml().scrub(first)
    assert result.verified, result.reason
    assert canary_bytes(node, first) <= result.bytes_unreachable
    assert canary_bytes(node, second) == 16 * MiB


def test_a_gpu_in_mig_mode_cannot_be_scrubbed_whole(node, open_nvml):
    gpu = node.add_gpu(mig=[8 * MiB])
    result = open_nvml().scrub(gpu["uuid"])
    assert not result.verified and "MIG mode" in result.reason


def test_a_destroyed_mig_device_fails_closed(node, open_nvml):
    gpu = node.add_gpu(mig=[8 * MiB])
    mig = gpu["migs"].pop()["uuid"]
    node.save()
    result = open_nvml().scrub(mig)
    assert not result.verified and "no longer exists" in result.reason and mig in result.reason


def test_a_held_device_is_not_scrubbed(node, open_nvml):
    gpu = node.add_gpu(processes={"compute": [[4242, MiB]], "graphics": [], "mps": []})
    node.fill(gpu["uuid"], CANARY)
    result = open_nvml().scrub(gpu["uuid"])
    assert not result.verified and "4242" in result.reason
    assert canary_bytes(node, gpu["uuid"]) == gpu["memory"]


def test_memory_that_does_not_take_the_zeros_fails_verification(node, open_nvml):
    gpu = node.add_gpu()
    node.fill(gpu["uuid"], CANARY)
    node.data["cuda"] = {"memsetNoop": True}
    node.save()
    result = open_nvml().scrub(gpu["uuid"])
    assert not result.verified and "non-zero 16-byte words" in result.reason
    assert result.bytes_scrubbed > 0


def test_a_cuda_error_fails_closed_with_its_name(node, open_nvml):
    gpu = node.add_gpu()
    node.data["cuda"] = {"fail": {"cuMemsetD8": "CUDA_ERROR_ECC_UNCORRECTABLE"}}
    node.save()
    result = open_nvml().scrub(gpu["uuid"])
    assert not result.verified
    assert "cuMemsetD8" in result.reason and "CUDA_ERROR_ECC_UNCORRECTABLE" in result.reason


def test_kernels_and_memset_are_warmed_up_before_the_fill(node, open_nvml):
    gpu = node.add_gpu(memory=32 * MiB)
    node.data["cuda"] = {"lazyBytes": MiB}  # the first launch takes device memory (lazy loading)
    node.save()
    result = open_nvml(margin_bytes=0).scrub(gpu["uuid"])
    assert result.verified, result.reason


def test_the_margin_left_free_is_scrubbed_in_a_second_pass(node, open_nvml):
    gpu = node.add_gpu(memory=32 * MiB)
    node.fill(gpu["uuid"], CANARY)
    result = open_nvml(margin_bytes=8 * MiB).scrub(gpu["uuid"])
    assert result.verified, result.reason
    left = canary_bytes(node, gpu["uuid"])
    assert left <= result.bytes_unreachable < 8 * MiB, "the margin did not stay dirty"
    overhead = gpu["contextBytes"] + (256 << 10) + 512  # context, kernels, the counter
    assert result.bytes_unreachable - overhead < 64 << 10, "reached all but the allocator's granularity"


def test_the_default_coverage_bound_is_two_percent(node, open_nvml):
    gpu = node.add_gpu(memory=128 * MiB, contextBytes=256 << 10)
    # Unreached: what another party holds, plus the scrub's own context (256 KiB) and kernels (256 KiB).
    node.data["cuda"] = {"heldBytes": {gpu["uuid"]: 3 * MiB // 2}}  # 2 MiB of 128: 1.6%, within
    node.save()
    backend = open_nvml(max_unreachable_fraction=NvmlBackend.__init__.__kwdefaults__["max_unreachable_fraction"])
    assert backend._scrubber.max_unreachable_fraction == 0.02
    assert backend.scrub(gpu["uuid"]).verified
    node.data["cuda"] = {"heldBytes": {gpu["uuid"]: 3 * MiB}}  # 3.5 MiB: 2.7%, beyond
    node.save()
    result = backend.scrub(gpu["uuid"])
    assert not result.verified and "(2.0% and at most 1073741824 bytes)" in result.reason


def test_unreached_memory_is_bounded_in_bytes_too(node, open_nvml):
    """On a large GPU a share allows gigabytes: the bound in bytes (the policy's scrubCoverage) caps it."""
    gpu = node.add_gpu(memory=128 * MiB, contextBytes=256 << 10)
    node.data["cuda"] = {"heldBytes": {gpu["uuid"]: 3 * MiB}}  # 3.5 MiB of 128: within the fake's 10%
    node.save()
    assert open_nvml().scrub(gpu["uuid"]).verified
    result = open_nvml(max_unreachable_bytes=2 * MiB).scrub(gpu["uuid"])
    assert not result.verified and f"more than the {2 * MiB} allowed" in result.reason


def test_unreached_memory_with_scrub_on_free_off_fails_closed(node, open_nvml, tmp_path):
    gpu = node.add_gpu(memory=32 * MiB)
    params = tmp_path / "params"
    params.write_text('RegistryDwords: "RMDisableScrubOnFree=1"\n')
    result = open_nvml(params_path=params).scrub(gpu["uuid"])
    assert not result.verified and "RMDisableScrubOnFree" in result.reason
    assert result.bytes_unreachable > 0 and result.bytes_scrubbed > 0
    params.write_text('RegistryDwords: "RMDisableScrubOnFree=0"\n')
    assert open_nvml(params_path=params).scrub(gpu["uuid"]).verified


def test_unreached_memory_with_scrub_on_free_unknown_fails_closed(node, open_nvml, tmp_path):
    """Where the driver's parameters cannot be read, nothing says the unreached memory was zeroed when it was
    freed: the scrub does not count as verified."""
    gpu = node.add_gpu(memory=32 * MiB)
    result = open_nvml(params_path=tmp_path / "absent").scrub(gpu["uuid"])
    assert not result.verified and "cannot be read" in result.reason and result.scrub_on_free is None


def test_the_scrub_records_scrub_on_free_and_ecc_mode(node, open_nvml):
    on = node.add_gpu(memory=32 * MiB)
    off = node.add_gpu(memory=32 * MiB, eccMode=[0, 0])
    unknown = node.add_gpu(memory=32 * MiB, eccMode=None)
    backend = open_nvml()
    found = {g["uuid"]: backend.scrub(g["uuid"]) for g in (on, off, unknown)}
    assert all(r.verified and r.scrub_on_free is True for r in found.values())
    assert [found[g["uuid"]].ecc_enabled for g in (on, off, unknown)] == [True, False, None]


# ---------------------------------------------------------------- kernels: cubin, else PTX, else none


@pytest.mark.parametrize(
    ("cuda", "kernels"),
    [
        ({"noJit": True}, "cubin sm_90"),  # an H200 without the JIT: the cubin needs none
        ({"computeCapability": [6, 1]}, "ptx"),
        ({"computeCapability": [6, 1], "noJit": True}, NO_KERNELS),
    ],
)
def test_the_scrub_verifies_with_whatever_kernels_load(node, open_nvml, cuda, kernels):
    gpu = node.add_gpu(memory=32 * MiB)
    node.fill(gpu["uuid"], CANARY)
    node.data["cuda"] = cuda
    node.save()
    result = open_nvml().scrub(gpu["uuid"])
    assert result.verified, result.reason
    assert result.kernels == kernels
    assert canary_bytes(node, gpu["uuid"]) <= result.bytes_unreachable


def test_the_kernel_free_path_still_catches_memory_that_does_not_take_zeros(node, open_nvml):
    gpu = node.add_gpu(memory=32 * MiB)
    node.fill(gpu["uuid"], CANARY)
    node.data["cuda"] = {"computeCapability": [6, 1], "noJit": True, "memsetNoop": ["cuMemsetD8"]}
    node.save()
    result = open_nvml().scrub(gpu["uuid"])
    assert not result.verified and "non-zero" in result.reason


def test_memory_another_party_holds_leaves_the_scrub_unverified(node, open_nvml):
    gpu = node.add_gpu(memory=32 * MiB)
    node.data["cuda"] = {"heldBytes": {gpu["uuid"]: 8 * MiB}}
    node.save()
    result = open_nvml().scrub(gpu["uuid"])
    assert not result.verified and "could not be allocated" in result.reason
    assert result.bytes_unreachable >= 8 * MiB


def test_a_hung_scrub_is_killed(node, open_nvml):
    gpu = node.add_gpu()
    node.data["cuda"] = {"hang": "cuMemsetD8"}
    node.save()
    result = open_nvml(scrub_timeout_s=2).scrub(gpu["uuid"])
    assert not result.verified and "did not finish within 2s" in result.reason


def test_a_node_without_cuda_bindings_fails_closed(node, open_nvml, tmp_path):
    gpu = node.add_gpu()
    empty = tmp_path / "empty"
    empty.mkdir()
    # The child's Python without site-packages (the real bindings of the test extra live there) and
    # without the fakes: it finds no cuda at all. fakegpu stays importable for the fake pynvml here.
    bare = tmp_path / "python-without-site"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    result = open_nvml(python=str(bare), child_env={**node.env, "PYTHONPATH": str(empty)}).scrub(gpu["uuid"])
    assert not result.verified and "scrubgate[gpu]" in result.reason


def test_scrub_on_free_setting_comes_from_the_params_file(node, open_nvml, tmp_path):
    node.add_gpu()
    params = tmp_path / "params"
    params.write_text('RegistryDwords: "RMDisableScrubOnFree=1"\n')
    assert open_nvml(params_path=params).scrub_on_free_disabled() is True


def test_a_scrubber_that_reports_nonsense_fails_closed(node, open_nvml, tmp_path, monkeypatch):
    gpu = node.add_gpu()
    liar = tmp_path / "liar.py"
    liar.write_text('print(\'{"bytesScrubbed": "all of it", "nonzeroWords": 0}\')\n')
    backend = open_nvml()
    monkeypatch.setattr(backend._scrubber.child, "script", liar)
    result = backend.scrub(gpu["uuid"])
    assert not result.verified and "malformed report" in result.reason


def test_a_node_without_a_readable_kernel_log_says_how_to_run_without_it(node, open_nvml, tmp_path):
    node.add_gpu()
    with pytest.raises(GpuError, match=r"kernel log .*/dev/kmsg.*watch_xids=False"):
        open_nvml(watch_xids=True, kernel_log=tmp_path / "no-kmsg")
    assert open_nvml().list_devices()


def nvidias_driver_holding_nvml(node: Any) -> subprocess.Popen[str]:
    """A process with NVML open and every GPU attached until its stdin closes, as NVIDIA's DRA driver keeps them with
    DynamicMIG (k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/nvlib.go: Init once, a handle per GPU, cached)."""
    hold = (
        "import pynvml, sys; pynvml.nvmlInit(); "
        "[pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]; "
        "print('open', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold],
        env={**os.environ, **node.env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "open\n"
    return holder


def nvidias_driver_turns_mig_off(node: Any, uuid: str) -> tuple[int, int, int]:
    """NVIDIA's driver's maybeDisableMigMode (nvlib.go), in its own process, after deleting a GPU's last MIG device:
    nvmlDeviceSetMigMode(DISABLE), whose activationStatus says whether it took. (activationStatus, current mode,
    pending mode) afterwards."""
    toggle = (
        "import pynvml, sys; pynvml.nvmlInit(); gpu = pynvml.nvmlDeviceGetHandleByUUID(sys.argv[1]); "
        "print(pynvml.nvmlDeviceSetMigMode(gpu, pynvml.NVML_DEVICE_MIG_DISABLE), *pynvml.nvmlDeviceGetMigMode(gpu))"
    )
    env = {**os.environ, **node.env}
    done = subprocess.run([sys.executable, "-c", toggle, uuid], env=env, capture_output=True, text=True, check=True)
    status, current, pending = (int(n) for n in done.stdout.split())
    return status, current, pending


IN_USE = 19  # NVML_ERROR_IN_USE


def test_an_idle_backend_leaves_nvml_closed_so_nvidias_driver_can_change_mig_modes(node, open_nvml):
    """With DynamicMIG, NVIDIA's driver turns MIG on for a GPU's first MIG device and off after its last; NVML
    reports that as "in use" (in the activationStatus it returns) while another process has the GPU attached. The
    agent, idle between teardowns, holds none: not for its XID watch, not after an operation."""
    gpu = node.add_gpu(mig=[])
    backend = open_nvml(watch_xids=True)
    assert backend.list_devices() and backend.health(gpu["uuid"], 0).healthy
    assert nvidias_driver_turns_mig_off(node, gpu["uuid"]) == (0, 0, 0)
    node.data["gpus"][0].update(migMode=1, migModePending=1)  # on again; NVIDIA's driver holding NVML now
    node.save()
    holder = nvidias_driver_holding_nvml(node)
    try:
        assert nvidias_driver_turns_mig_off(node, gpu["uuid"]) == (IN_USE, 1, 1), "the call succeeds, the change not"
    finally:
        holder.communicate("")


def test_nvidias_driver_changes_a_gpus_mig_mode_while_the_agent_works_on_another(node, open_nvml, monkeypatch):
    """A teardown's NVML session attaches its own GPU only (nvmlDeviceGetHandleByPciBusId), not every GPU of the
    node: NVIDIA's driver's MIG mode change of any other GPU goes through meanwhile."""
    busy = node.add_gpu()
    other = node.add_gpu(mig=[])
    backend = open_nvml()
    pynvml = fake_nvml()
    changed: list[tuple[int, int, int]] = []
    listing = pynvml.nvmlDeviceGetComputeRunningProcesses

    def meanwhile(handle: Any) -> Any:
        changed.append(nvidias_driver_turns_mig_off(node, other["uuid"]))
        return listing(handle)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", meanwhile)
    assert backend.processes(busy["uuid"]) == []
    assert changed == [(0, 0, 0)] and gpu_record(other["uuid"])["migMode"] == 0


def test_each_operation_attaches_only_the_gpu_it_is_about(node, open_nvml, monkeypatch):
    """nvml.h: nvmlInit_v2 attaches no GPU, a handle lookup attaches its GPU (by UUID, maybe others as it searches),
    and an attached GPU stays so until nvmlShutdown. Only the inventory at start attaches every GPU (and NVML's
    own search, for a static MIG device made since)."""
    gpus = [node.add_gpu(memory=16 * MiB) for _ in range(3)]
    split = node.add_gpu(mig=[])
    mig = node.create_mig(split, "19", start=0)["uuid"]
    backend = open_nvml(watch_xids=True)
    # Dynamic MIG devices, made after the agent started: NVIDIA's driver prepares one, and deletes another.
    node.create_mig(split, "19", start=1)
    node.delete_mig(node.create_mig(split, "15", start=2)["uuid"])
    deleted = MigPlacement(split["uuid"], 15, 2, 2)
    fakegpu = sys.modules["fakegpu"]
    attached: list[str] = []
    attach = fakegpu.attach
    monkeypatch.setattr(fakegpu, "attach", lambda uuid: (attached.append(uuid), attach(uuid)))
    target = gpus[1]["uuid"]
    placement = MigPlacement(split["uuid"], 19, 1, 1)
    operations = {
        target: [
            lambda: backend.processes(target),
            lambda: backend.health(target, 0),
            lambda: backend.scrub(target),
        ],
        split["uuid"]: [
            lambda: backend.processes(mig),
            lambda: backend.health(mig, 0),
            lambda: backend.placement_processes(placement),
            lambda: backend.placement_health(placement, 0),
            lambda: backend.scrub_placement(placement),
            lambda: backend.scrub_placement(deleted),  # through the scrub's own GPU instance
        ],
    }
    for gpu_uuid, calls in operations.items():
        for call in calls:
            attached.clear()
            result = call()
            assert getattr(result, "verified", True), result.reason
            assert set(attached) == {gpu_uuid}, call


def test_the_ecc_sampler_opens_one_short_window_per_gpu(node, open_nvml, monkeypatch):
    """Each minute's ECC sample attaches one GPU at a time; a GPU without persistence mode not at all (each attach
    would initialise it again and reset the counters the sample reads)."""
    gpus = [node.add_gpu() for _ in range(3)]
    node.add_gpu(persistenceMode=0)
    backend = open_nvml()
    pynvml, fakegpu = fake_nvml(), sys.modules["fakegpu"]
    windows: list[set[str]] = []
    shutdown = pynvml.nvmlShutdown

    def closing() -> None:
        windows.append(fakegpu.attached(os.getpid()))
        shutdown()

    monkeypatch.setattr(pynvml, "nvmlShutdown", closing)
    backend._health.sample_ecc()
    assert windows == [{g["uuid"]} for g in gpus]


@pytest.mark.parametrize("way", ["whole GPU", "MIG off again", "live MIG device", "scratch instance"])
def test_nvml_is_closed_while_a_scrub_runs(node, open_nvml, monkeypatch, way):
    """NVML open while the scrub's child runs (its start, CUDA's, the allocation: seconds) would hold off the
    driver's MIG mode changes of the GPU. Each way a device or a placement is scrubbed runs it with NVML closed."""
    gpu = node.add_gpu(mig=None if way == "whole GPU" else [])
    if way == "MIG off again":
        node.data["gpus"][0]["migMode"] = 0
        node.save()
    if way == "live MIG device":
        node.create_mig(gpu, "19", start=1)
    backend = open_nvml()
    own_session = node.root / "nvml-sessions" / str(os.getpid())
    open_during: list[bool] = []
    run_child = backend._scrubber.child.run

    def watched(uuid: str, args: list[str]) -> Any:
        open_during.append(own_session.exists())
        return run_child(uuid, args)

    monkeypatch.setattr(backend._scrubber.child, "run", watched)
    if way == "whole GPU":
        result = backend.scrub(gpu["uuid"])
    else:
        result = backend.scrub_placement(MigPlacement(gpu["uuid"], 19, 1, 1))
    assert result.verified, result.reason
    assert open_during == [False] and not own_session.exists()


# ---------------------------------------------------------------- dynamic MIG: scrub through a placement


def gpu_record(uuid: str) -> dict[str, Any]:
    return next(g for g in sys.modules["fakegpu"].load()["gpus"] if g["uuid"] == uuid)


def test_a_deleted_dynamic_mig_device_is_scrubbed_through_a_gpu_instance_at_its_placement(node, open_nvml):
    gpu = node.add_gpu(mig=[])
    tenant = node.create_mig(gpu, "15", start=2)  # a 2-slice instance on memory slices 2 and 3
    neighbour = node.create_mig(gpu, "19", start=4)
    node.fill(tenant["uuid"], CANARY)
    node.fill(neighbour["uuid"], CANARY)
    node.delete_mig(tenant["uuid"])  # NVIDIA's driver unprepares the claim
    leftover = node.root / "mem" / tenant["memoryFile"]
    assert CANARY in leftover.read_bytes(), "the placement's memory still holds the tenant's bytes"

    result = open_nvml().scrub_placement(MigPlacement(gpu["uuid"], 15, 2, 2))
    assert result.verified, result.reason
    assert result.bytes_scrubbed > 0 and result.bytes_unreachable == result.bytes_total - result.bytes_scrubbed
    assert leftover.read_bytes().count(CANARY) * len(CANARY) <= result.bytes_unreachable
    after = gpu_record(gpu["uuid"])
    assert [(g["start"], g["size"]) for g in after["gis"]] == [(4, 1)], "the scrub's GPU instance is destroyed"
    assert [m["uuid"] for m in after["migs"]] == [neighbour["uuid"]]
    assert canary_bytes(node, neighbour["uuid"]) == neighbour["memory"], "the neighbour is untouched"
    assert after["migMode"] == 1, "another MIG device is there: MIG stays on"


@pytest.mark.parametrize("driver_holds_nvml", [True, False])
def test_a_scratch_instance_that_was_its_gpus_last_leaves_mig_mode_to_nvidias_driver(
    node, open_nvml, monkeypatch, caplog, driver_holds_nvml
):
    """NVIDIA's driver turns MIG off when it deletes a GPU's last MIG device; here it found the scrub's GPU instance
    (the other tenant's device went while it stood) and left MIG on. Under DynamicMIG the driver holds NVML, so
    another process's nvmlDeviceSetMigMode only reports IN_USE in its activationStatus: the agent never calls it.
    The placement is verified; the GPU stays in MIG mode, said so in the log, until the driver's next MIG deletion
    there or its restart turns it off, which nothing of the agent's holds up."""
    gpu = node.add_gpu(mig=[])
    tenant = node.create_mig(gpu, "19", start=1)
    node.fill(tenant["uuid"], CANARY)
    node.delete_mig(tenant["uuid"])
    backend = open_nvml()
    changes: list[tuple[Any, int]] = []
    monkeypatch.setattr(fake_nvml(), "nvmlDeviceSetMigMode", lambda device, mode: changes.append((device, mode)))
    holder = nvidias_driver_holding_nvml(node) if driver_holds_nvml else None
    try:
        result = backend.scrub_placement(MigPlacement(gpu["uuid"], 19, 1, 1))
    finally:
        if holder is not None:
            holder.communicate("")
    assert result.verified, result.reason
    leftover = (node.root / "mem" / tenant["memoryFile"]).read_bytes()
    assert leftover.count(CANARY) * len(CANARY) <= result.bytes_unreachable
    assert changes == [], "the agent does not change MIG modes"
    after = gpu_record(gpu["uuid"])
    assert after["migMode"] == 1 and not after["gis"]
    said = [r.getMessage() for r in caplog.records if gpu["uuid"] in r.getMessage()]
    assert any("left in MIG mode with no MIG device" in m and "NVIDIA's DRA kubelet plugin" in m for m in said)
    assert not any("MIG mode off" in m for m in said)
    assert nvidias_driver_turns_mig_off(node, gpu["uuid"]) == (0, 0, 0)


def in_a_container(node: Any) -> Any:
    """The agent's view in its container: /dev/nvidia-caps as it was at start (empty), /proc the host's."""
    from scrubgate.sanitizer_agent.gpu.mig import CapabilityNodes

    paths = node.enable_capabilities()
    return CapabilityNodes(proc=paths["proc"], dev=paths["dev"], devices=paths["devices"], mknod=fakegpu_mknod)


def fakegpu_mknod(path: Path, major: int, minor: int) -> None:
    sys.modules["fakegpu"].fake_mknod(path, major, minor)


def test_the_scrubs_own_gpu_instance_gets_the_device_nodes_cuda_needs(node, open_nvml):
    """The GPU instance the scrub creates has capability nodes no container started before it has: the agent
    makes them (mknod, major from /proc/devices, minors from the driver's access files), as NVIDIA's driver
    gives its workload containers theirs. Without them CUDA does not see the MIG device and the scrub fails."""
    gpu = node.add_gpu(mig=[])
    tenant = node.create_mig(gpu, "15", start=2)
    node.create_mig(gpu, "19", start=4)
    node.fill(tenant["uuid"], CANARY)
    node.delete_mig(tenant["uuid"])
    capabilities = in_a_container(node)
    result = open_nvml(capabilities=capabilities).scrub_placement(MigPlacement(gpu["uuid"], 15, 2, 2))
    assert result.verified, result.reason
    made = sorted(p.name for p in capabilities.dev.iterdir())
    assert len(made) == 2 and all(p.read_text().startswith("c 508:") for p in capabilities.dev.iterdir()), made

    def refused(path: Path, major: int, minor: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    leftover = node.root / "mem" / tenant["memoryFile"]
    leftover.write_bytes(CANARY * (leftover.stat().st_size // len(CANARY)))
    for made_node in capabilities.dev.iterdir():
        made_node.unlink()
    unprivileged = dataclasses.replace(capabilities, mknod=refused)
    result = open_nvml(capabilities=unprivileged).scrub_placement(MigPlacement(gpu["uuid"], 15, 2, 2))
    assert not result.verified and "CAP_MKNOD" in result.reason and "cannot open MIG device" in result.reason
    assert CANARY in leftover.read_bytes(), "not scrubbed, and said so: the device stays fenced"


def test_a_mig_device_created_after_the_agent_started_is_reached_through_nodes_it_makes(node, open_nvml):
    """NVIDIA's DRA driver creates a dynamic MIG device on prepare, after the agent's container started: the
    scrub of it, before its unprepare, needs its nodes too."""
    gpu = node.add_gpu(mig=[])
    capabilities = in_a_container(node)
    tenant = node.create_mig(gpu, "19", start=1)
    node.fill(tenant["uuid"], CANARY)
    result = open_nvml(capabilities=capabilities).scrub_placement(MigPlacement(gpu["uuid"], 19, 1, 1))
    assert result.verified and result.uuid == tenant["uuid"], result.reason
    assert canary_bytes(node, tenant["uuid"]) <= result.bytes_unreachable


def test_the_start_up_check_makes_the_mig_config_node_and_opens_it(node, open_nvml):
    node.add_gpu(mig=[])
    capabilities = in_a_container(node)
    backend = open_nvml(capabilities=capabilities)
    assert backend.mig_management_problem() is None
    assert (capabilities.dev / "nvidia-cap1").read_text() == "c 508:1\n"
    capabilities.devices.write_text("Character devices:\n195 nvidia\n")
    (capabilities.dev / "nvidia-cap1").unlink()
    assert "names no nvidia-caps device major" in (backend.mig_management_problem() or "")


def test_a_scratch_instance_nvidias_driver_tears_down_mid_scrub_is_scrubbed_again(node, open_nvml):
    """NVIDIA's DRA driver, starting, tears down every MIG device its checkpoint does not name: the scrub's own
    instance too, mid-scrub. That scrub counts for nothing; the placement (still held by the claim's
    allocation) is scrubbed again through a new instance."""
    gpu = node.add_gpu(mig=[])
    tenant = node.create_mig(gpu, "15", start=2)
    node.create_mig(gpu, "19", start=4)
    node.fill(tenant["uuid"], CANARY)
    node.delete_mig(tenant["uuid"])
    (node.root / "obliterate-next-mig").touch()
    result = open_nvml().scrub_placement(MigPlacement(gpu["uuid"], 15, 2, 2))
    assert result.verified, result.reason
    assert not (node.root / "obliterate-next-mig").exists(), "the first scratch instance was torn down"
    leftover = node.root / "mem" / tenant["memoryFile"]
    assert leftover.read_bytes().count(CANARY) * len(CANARY) <= result.bytes_unreachable
    assert [(g["start"], g["size"]) for g in gpu_record(gpu["uuid"])["gis"]] == [(4, 1)]


def test_a_scratch_instance_torn_down_at_every_attempt_leaves_the_placement_unverified(node, open_nvml):
    gpu = node.add_gpu(mig=[])
    node.create_mig(gpu, "19", start=4)
    (node.root / "obliterate-next-mig").write_text("3")  # the driver restarts at each of the three attempts
    result = open_nvml().scrub_placement(MigPlacement(gpu["uuid"], 19, 1, 1))
    assert not result.verified and "destroyed by another party during the scrub" in result.reason
    assert "3 times" in result.reason and not (node.root / "obliterate-next-mig").exists()


def test_a_mig_device_not_yet_unprepared_is_scrubbed_through_itself(node, open_nvml):
    gpu = node.add_gpu(mig=[])
    tenant = node.create_mig(gpu, "19", start=1)
    node.fill(tenant["uuid"], CANARY)
    result = open_nvml().scrub_placement(MigPlacement(gpu["uuid"], 19, 1, 1))
    assert result.verified and result.uuid == tenant["uuid"]
    assert len(gpu_record(gpu["uuid"])["gis"]) == 1, "nothing created, nothing destroyed"


def test_memory_slices_another_instance_holds_fail_closed(node, open_nvml):
    gpu = node.add_gpu(mig=[])
    other = node.create_mig(gpu, "15", start=0)
    result = open_nvml().scrub_placement(MigPlacement(gpu["uuid"], 19, 1, 1))
    assert not result.verified and other["uuid"] in result.reason and "held by" in result.reason


def test_no_permission_to_create_gpu_instances_fails_closed_and_says_so(node, open_nvml):
    gpu = node.add_gpu(mig=[], noMigPermission=True)
    result = open_nvml().scrub_placement(MigPlacement(gpu["uuid"], 19, 3, 1))
    assert not result.verified and "Insufficient Permissions" in result.reason
    assert "cannot create a GPU instance" in result.reason


def test_a_gpu_the_driver_took_out_of_mig_mode_is_scrubbed_whole(node, open_nvml):
    gpu = node.add_gpu(memory=16 * MiB)  # MIG off again after the last dynamic MIG device went
    node.fill(gpu["uuid"], CANARY)
    result = open_nvml().scrub_placement(MigPlacement(gpu["uuid"], 19, 0, 1))
    assert result.verified and result.uuid == gpu["uuid"]
    assert canary_bytes(node, gpu["uuid"]) <= result.bytes_unreachable


def test_processes_on_a_placement_are_those_of_overlapping_mig_devices(node, open_nvml):
    gpu = node.add_gpu(mig=[])
    wide = node.create_mig(gpu, "15", start=0)
    node.create_mig(gpu, "19", start=4)
    for m in gpu["migs"]:
        m["processes"] = {"compute": [[7000 + m["slot"], MiB]], "graphics": [], "mps": []}
    node.save()
    backend = open_nvml()
    assert [p.pid for p in backend.placement_processes(MigPlacement(gpu["uuid"], 19, 1, 1))] == [7000 + wide["slot"]]
    assert backend.placement_processes(MigPlacement(gpu["uuid"], 19, 6, 1)) == []


def test_scrub_processes_at_once_are_bounded(node, open_nvml, monkeypatch):
    """Sixteen teardowns may scrub at once, but each scrub is a process with a CUDA context of a few hundred MB
    of host memory: at most max_parallel_scrubs run together inside the DaemonSet's memory limit, the rest wait."""
    import threading

    from scrubgate.sanitizer_agent.gpu import child

    gpus = [node.add_gpu(memory=32 * MiB) for _ in range(6)]
    running, most, lock = 0, 0, threading.Lock()
    real_run = subprocess.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.2)
            return real_run(*args, **kwargs)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(child.subprocess, "run", counted)
    backend = open_nvml(max_parallel_scrubs=2)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda g=g: results.append(backend.scrub(g["uuid"]))) for g in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 6 and all(r.verified for r in results)
    assert most == 2


# ---------------------------------------------------------------- the start-up check of CUDA


def test_the_start_up_check_opens_a_cuda_context_once_on_an_idle_device(node, open_nvml, monkeypatch):
    """Once, at start, on a device no tenant holds: a broken CUDA setup is named before the first teardown needs
    it. The child opens the context and runs the kernels on a small buffer, nothing more."""
    node.add_gpu(processes={"compute": [[4242, MiB]], "graphics": [], "mps": []})
    split = node.add_gpu(mig=[8 * MiB])
    idle = node.add_gpu()
    backend = open_nvml()
    runs: list[tuple[str, list[str]]] = []
    run = backend._scrubber.child.run
    monkeypatch.setattr(
        backend._scrubber.child, "run", lambda uuid, args: (runs.append((uuid, args)), run(uuid, args))[1]
    )
    assert backend.cuda_problem() is None
    assert runs == [(idle["uuid"], ["--check"])], "a whole GPU no process holds, out of MIG mode"
    node.data["gpus"][2]["processes"]["compute"] = [[4343, MiB]]
    node.save()
    runs.clear()
    assert backend.cuda_problem() is None and runs == [(split["migs"][0]["uuid"], ["--check"])], "else a MIG device"
    node.data["cuda"] = {"fail": {"cuDevicePrimaryCtxRetain": "CUDA_ERROR_OUT_OF_MEMORY"}}
    node.save()
    problem = backend.cuda_problem() or ""
    assert "cuDevicePrimaryCtxRetain" in problem and "CUDA_ERROR_OUT_OF_MEMORY" in problem


def test_with_every_device_held_the_cuda_check_waits_for_the_first_scrub(node, open_nvml, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    node.add_gpu(processes={"compute": [[4242, MiB]], "graphics": [], "mps": []})
    backend = open_nvml()
    monkeypatch.setattr(backend._scrubber.child, "run", lambda uuid, args: pytest.fail("no device to check on"))
    assert backend.cuda_problem() is None
    assert any("no idle device for the CUDA check" in r.getMessage() for r in caplog.records)


def test_the_scrub_reports_its_host_memory(node, open_nvml):
    gpu = node.add_gpu(memory=16 * MiB)
    result = open_nvml().scrub(gpu["uuid"])
    assert result.verified and result.host_rss_bytes is not None and result.host_rss_bytes > MiB
