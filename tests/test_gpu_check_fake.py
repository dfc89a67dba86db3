"""tests/gpu/gpu_check.py end to end against the fake pynvml and CUDA driver (no GPU needed): the same one
command a GPU machine runs, its report, its per-step limits and its partial report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHECK = Path(__file__).parent / "gpu" / "gpu_check.py"
FAKES = Path(__file__).parent / "fakes"
MiB = 1 << 20
STEPS = ["open", "selftest", "scrub", "no-scrub", "bandwidth", "health", "kernel-log", "mig"]
# What the driver prints when it loads (kernel-open/nvidia/nv.c, "NVRM: loading %s") and shows in
# /proc/driver/nvidia/version (nv-procfs.c, "NVRM version: %s").
NVRM_ID = "NVIDIA UNIX Open Kernel Module for x86_64  595.45.04  Release Build  (dvs-builder@U22)  Tue Mar 3 2026"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(FAKES))
    import fakegpu

    node = fakegpu.FakeNode(tmp_path / "node")
    driver(node)
    node.log_kernel("Linux version 6.8.0-90-generic")
    node.log_kernel(f"NVRM: loading {NVRM_ID}", 4)
    yield node
    sys.modules.pop("fakegpu", None)


def run_check(node: Any, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    # The driver's parameters say what the fake driver does: zero freed memory, or not (RMDisableScrubOnFree).
    params = out / "driver-params"
    out.mkdir(parents=True, exist_ok=True)
    scrub_on_free = node.data["cuda"].get("scrubOnFree", False)
    params.write_text("RegistryDwords: " + ('""' if scrub_on_free else '"RMDisableScrubOnFree=1"') + "\n")
    version = out / "driver-version"
    if not version.exists():
        version.write_text(f"NVRM version: {NVRM_ID}\nGCC version:  gcc version 12.3.0\n")
    done = subprocess.run(
        [
            sys.executable,
            str(CHECK),
            f"--tenant-gib={16 * MiB / (1 << 30)}",
            f"--copy-gib={4 * MiB / (1 << 30)}",
            "--iterations=2",
            f"--chunk-bytes={8 * MiB}",
            f"--min-chunk-bytes={64 << 10}",
            f"--margin-bytes={4 * MiB}",
            "--rate-goal=0",  # the fake's rates are Python's, not a GPU's
            "--step-timeout=60",
            f"--driver-params={params}",
            f"--kernel-log={node.kmsg}",
            f"--driver-version={out / 'driver-version'}",
            f"--out={out}",
            *extra,
        ],
        env={**os.environ, **node.env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    report_path = out / "gpu_check.json"
    assert report_path.exists(), done.stdout + done.stderr
    return done, json.loads(report_path.read_text())


def driver(node: Any, scrub_on_free: bool = True, **faults: Any) -> None:
    """The fake kernel driver: by default as NVIDIA's runs, zeroing freed memory before another process
    gets it; `faults` as tests/fakes/cuda/bindings/driver.py reads them."""
    node.data["cuda"] = {"scrubOnFree": scrub_on_free, **faults}
    node.save()


def test_check_passes_on_a_default_driver_and_still_sees_what_no_scrub_leaves(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    done, report = run_check(node, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = report["steps"]
    assert list(steps) == STEPS and all(s["ok"] for s in steps.values()), steps
    assert report["pass"] and steps["selftest"]["foundWords"] == steps["selftest"]["plantedWords"]
    assert steps["selftest"]["kernels"] == "cubin sm_90"
    assert report["scrubOnFreeDisabled"] is False
    scrub = steps["scrub"]
    assert scrub["scrub"]["verified"] and scrub["probe"]["canaryWords"] == 0
    assert scrub["coverage"]["unreachedShare"] < 0.1 and scrub["coverage"]["bytesScrubbed"] > 80 * MiB
    assert scrub["resident"]["canaryWords"] == 0 and scrub["resident"]["plantedWords"] > 0
    # The driver zeroed the tenant's memory: the next process finds nothing, scrub or not; the canary the
    # check's own context holds is what shows that the probe would see leftovers.
    assert steps["no-scrub"]["driverScrubsOnFree"] and steps["no-scrub"]["probe"]["canaryWords"] == 0
    resident = steps["no-scrub"]["resident"]
    assert resident["canaryWords"] == resident["plantedWords"] > 0
    assert steps["bandwidth"]["nonzeroWords"] == 0 and steps["bandwidth"]["scrubToCopy"] > 0
    assert steps["health"]["problems"] == [] and steps["health"]["xidWatch"] == "on"
    assert "skipped" in steps["mig"], "not in MIG mode: nothing to do, and nothing changed"
    assert "canary after agent scrub" in done.stdout and "PASS" in done.stdout


def test_the_check_reports_versions_card_settings_host_memory_and_every_canary(node, tmp_path):
    """What the first run on a GPU must tell: NVML and CUDA versions, persistence and GSP state (read, never
    changed), the scrub's device and wall time and its process's host memory, the time of each step, every
    canary, and whether the kernel log is the host's; in one run, under 5 minutes by default."""
    node.add_gpu(memory=96 * MiB, persistenceMode=0)
    done, report = run_check(node, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    versions, card = report["versions"], report["card"]
    assert (versions["driver"], versions["nvml"], versions["cudaDriverVersion"]) == ("595.45.04", "13.595.45.04", 13000)
    assert {"nvidia-ml-py", "cuda-bindings", "python", "kernel"} <= set(versions)
    assert (
        card["persistenceMode"] == 0 and card["gspFirmwareMode"] == [1, 1] and card["gspFirmwareVersion"] == "595.45.04"
    )
    assert card["architecture"] == 9 and card["migMode"] == [0, 0] and card["eccMode"] == [1, 1]
    assert report["steps"]["selftest"]["cudaDriverVersion"] == 13000
    assert report["steps"]["selftest"]["agentStartCheck"] is None
    scrub = report["steps"]["scrub"]["scrub"]
    assert scrub["host_rss_bytes"] > MiB and 0 < scrub["kernel_s"] <= scrub["duration_s"]
    assert all(s["seconds"] >= 0 for s in report["steps"].values())
    canaries = report["canaries"]
    assert canaries["afterAgentScrub"] == canaries["residentAfterAgentPass"] == canaries["withoutAgentScrub"] == 0
    found, planted = canaries["residentWithoutScrubFoundOfPlanted"]
    assert found == planted > 0 and canaries["selftestWordsPlantedFound"] == [6, 6]
    log = report["steps"]["kernel-log"]
    assert log["host"] is True and log["driverLoaded"] == NVRM_ID and log["firstSeq"] == 0
    assert report["limits"]["totalS"] + report["limits"]["graceS"] < 300, "under 5 minutes by default"
    assert "host memory" in done.stdout and "host's: True" in done.stdout


def test_a_kernel_log_of_another_kernel_is_reported_as_not_the_hosts(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    out = tmp_path / "out"
    out.mkdir()
    (out / "driver-version").write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.126.20\n")
    done, report = run_check(node, out)
    assert report["steps"]["kernel-log"]["host"] is False and done.returncode == 0, "reported, not failed"


def test_a_step_stuck_in_the_driver_where_no_signal_reaches_is_abandoned_with_the_others_on_record(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    node.data["nvmlHang"] = "nvmlDeviceGetRemappedRows"  # only health() reads it, in the check's own process
    node.save()
    done, report = run_check(node, tmp_path / "out", "--step-timeout=8")
    steps = report["steps"]
    assert done.returncode == 1 and not report["pass"]
    assert not steps["health"]["ok"] and "hung past its 8s limit" in steps["health"]["error"]
    assert steps["scrub"]["ok"] and steps["bandwidth"]["ok"], "the steps before it are on record"
    assert "FAIL" in done.stdout


def test_with_scrub_on_free_off_the_next_process_finds_the_canary_and_the_agent_fails_closed(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    driver(node, scrub_on_free=False)
    done, report = run_check(node, tmp_path / "out")
    steps = report["steps"]
    assert report["scrubOnFreeDisabled"] is True
    assert steps["no-scrub"]["probe"]["canaryWords"] * 4 == steps["no-scrub"]["tenantBytes"]
    assert not steps["no-scrub"]["driverScrubsOnFree"] and steps["no-scrub"]["ok"]
    # What the scrub's own CUDA context held is out of its reach and nothing zeroes it at exit: not verified.
    scrub = steps["scrub"]
    assert not scrub["scrub"]["verified"] and "RMDisableScrubOnFree" in scrub["scrub"]["reason"]
    assert scrub["probe"]["canaryWords"] == 0 and not scrub["ok"]
    assert done.returncode == 1 and not report["pass"]


def test_on_a_default_driver_a_scrub_that_writes_nothing_fails_the_check(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    # The scrub's zeroing of device memory writes nothing (an 8-byte counter reset still works). The driver
    # zeroed the tenant's memory at exit, so the agent's scrub verifies and the next process finds no canary:
    # only the canary the check's own context holds shows that this scrub would have left it.
    driver(node, memsetNoop=["cuMemsetD8"], memsetNoopFrom=1 << 20)
    done, report = run_check(node, tmp_path / "out")
    scrub = report["steps"]["scrub"]
    assert scrub["scrub"]["verified"] and scrub["probe"]["canaryWords"] == 0
    assert scrub["resident"]["canaryWords"] == scrub["resident"]["plantedWords"] > 0
    assert not scrub["ok"] and done.returncode == 1 and not report["pass"] and "FAIL" in done.stdout


def test_with_scrub_on_free_off_a_scrub_that_writes_nothing_leaves_the_canary_to_the_next(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    driver(node, scrub_on_free=False, memsetNoop=["cuMemsetD8"], memsetNoopFrom=1 << 20)
    done, report = run_check(node, tmp_path / "out")
    scrub = report["steps"]["scrub"]
    assert not scrub["scrub"]["verified"] and scrub["probe"]["canaryWords"] > 0
    assert not scrub["ok"] and done.returncode == 1 and not report["pass"]


def test_a_check_whose_canary_never_lands_cannot_pass(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    driver(node, memsetNoop=["cuMemsetD32"])  # the canary's writes
    done, report = run_check(node, tmp_path / "out")
    no_scrub = report["steps"]["no-scrub"]
    assert done.returncode == 1 and not report["pass"]
    assert not no_scrub["ok"] and no_scrub["resident"]["canaryWords"] == 0 < no_scrub["resident"]["plantedWords"]


def test_a_gpu_in_bad_health_fails_the_check(node, tmp_path):
    node.add_gpu(memory=96 * MiB, recoveryAction=2)  # the driver asks for a node reboot
    done, report = run_check(node, tmp_path / "out")
    health = report["steps"]["health"]
    assert done.returncode == 1 and not report["pass"]
    assert not health["ok"] and "recovery action 2" in health["problems"][0]
    assert all(s["ok"] for n, s in report["steps"].items() if n != "health")


def test_a_hung_step_is_cut_at_its_limit_and_the_rest_still_reported(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    driver(node, hang="cuMemcpyDtoD")  # only the bandwidth step copies device to device
    done, report = run_check(node, tmp_path / "out", "--step-timeout=8")
    steps = report["steps"]
    assert done.returncode == 1 and not report["pass"]
    assert not steps["bandwidth"]["ok"] and "timed out" in steps["bandwidth"]["error"]
    assert steps["bandwidth"]["seconds"] < 20
    assert steps["scrub"]["ok"] and steps["health"]["ok"], "the steps before and after still ran"


def test_a_host_without_a_readable_kernel_log_is_checked_without_the_xid_watch(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    done, report = run_check(node, tmp_path / "out", f"--kernel-log={tmp_path / 'no-kmsg'}")
    assert report["xidWatch"].startswith("off") and report["steps"]["health"]["ok"]
    assert done.returncode == 0 and report["pass"]


def test_the_total_limit_ends_the_check_with_a_partial_report(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    done, report = run_check(node, tmp_path / "out", "--total-timeout=0.5")
    assert done.returncode == 1 and not report["pass"]
    failed = [n for n, s in report["steps"].items() if not s["ok"]]
    assert failed and all("timed out" in report["steps"][n]["error"] for n in failed), report["steps"]


def mig_gpu(node: Any) -> dict[str, Any]:
    gpu = node.add_gpu(mig=[])
    node.create_mig(gpu, "15", start=0)
    node.create_mig(gpu, "15", start=2)
    return gpu


def placements(node: Any) -> list[tuple[int, int]]:
    gis = json.loads((node.root / "node.json").read_text())["gpus"][0]["gis"]
    return sorted((g["start"], g["size"]) for g in gis)


def test_mig_mode_is_checked_through_an_existing_placement(node, tmp_path):
    gpu = mig_gpu(node)
    # A 32 MiB fake MIG device: the scrub's 1 MiB context is 3% of it (of a real 1g slice, far less).
    _, report = run_check(node, tmp_path / "out", "--max-unreachable=0.1")
    mig = report["steps"]["mig"]
    assert mig["ok"], mig
    assert mig["placement"]["parent_uuid"] == gpu["uuid"] and mig["placement"]["start"] == 2
    assert mig["probe"]["canaryWords"] == 0 and mig["scrub"]["verified"]
    assert "skipped" in mig["scratch"]
    assert placements(node) == [(0, 2), (2, 2)], "no MIG change"


def test_mig_scratch_runs_the_agents_path_for_a_deleted_dynamic_mig_device(node, tmp_path):
    mig_gpu(node)
    done, report = run_check(node, tmp_path / "out", "--max-unreachable=0.1", "--mig-scratch=15:4:2")
    scratch = report["steps"]["mig"]["scratch"]
    assert done.returncode == 0 and report["pass"], report["steps"]["mig"]
    # The tenant's canary stayed in the placement's memory after its instance went; the agent's own
    # instance there scrubbed it, and the probe's instance found nothing.
    assert scratch["tenantBytes"] > 0 and scratch["scrub"]["verified"] and scratch["probe"]["canaryWords"] == 0
    assert scratch["scrub"]["bytes_scrubbed"] > 0 and scratch["instancesAsBefore"]
    assert placements(node) == [(0, 2), (2, 2)], "every GPU instance the check made is gone, MIG mode kept"


def test_a_mig_path_that_fails_fails_the_check(node, tmp_path):
    gpu = mig_gpu(node)
    done, report = run_check(node, tmp_path / "out", "--max-unreachable=0.1", "--mig-scratch=15:2:2")
    mig = report["steps"]["mig"]
    assert done.returncode == 1 and not report["pass"]
    assert not mig["ok"] and "memory slices in use" in mig["error"]
    node.data["nvmlErrors"] = {gpu["uuid"]: {"nvmlDeviceCreateGpuInstanceWithPlacement": "NVML_ERROR_NO_PERMISSION"}}
    node.save()
    done, report = run_check(node, tmp_path / "again", "--max-unreachable=0.1", "--mig-scratch=15:4:2")
    assert done.returncode == 1 and not report["pass"] and not report["steps"]["mig"]["ok"]
    assert placements(node) == [(0, 2), (2, 2)]
