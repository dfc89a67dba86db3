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
STEPS = ["open", "selftest", "scrub", "no-scrub", "bandwidth", "health", "mig"]


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(FAKES))
    import fakegpu

    yield fakegpu.FakeNode(tmp_path / "node")
    sys.modules.pop("fakegpu", None)


def run_check(node: Any, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    params = out / "driver-params"  # a default driver: scrub-on-free on
    out.mkdir(parents=True, exist_ok=True)
    params.write_text('RegistryDwords: ""\n')
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


def test_check_passes_and_shows_the_driver_leaking_without_the_agent(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    done, report = run_check(node, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = report["steps"]
    assert list(steps) == STEPS and all(s["ok"] for s in steps.values()), steps
    assert report["pass"] and steps["selftest"]["foundWords"] == steps["selftest"]["plantedWords"]
    assert steps["selftest"]["kernels"] == "cubin sm_90"
    scrub = steps["scrub"]
    assert scrub["scrub"]["verified"] and scrub["probe"]["canaryWords"] == 0
    assert scrub["coverage"]["unreachedShare"] < 0.1 and scrub["coverage"]["bytesScrubbed"] > 80 * MiB
    # The fake driver does not scrub on free: the next process finds the whole canary.
    assert steps["no-scrub"]["probe"]["canaryWords"] * 4 == steps["no-scrub"]["tenantBytes"]
    assert steps["bandwidth"]["nonzeroWords"] == 0 and steps["bandwidth"]["scrubToCopy"] > 0
    assert steps["health"]["problems"] == [] and steps["health"]["xidWatch"] == "on"
    assert "skipped" in steps["mig"], "not in MIG mode: nothing to do, and nothing changed"
    assert "canary after agent scrub" in done.stdout and "PASS" in done.stdout


def test_check_sees_a_driver_that_scrubs_on_free(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    node.data["cuda"] = {"scrubOnFree": True}
    node.save()
    _, report = run_check(node, tmp_path / "out")
    assert report["steps"]["no-scrub"]["driverScrubsOnFree"]


def test_check_fails_when_the_scrub_does_not_clean(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    node.data["cuda"] = {"memsetNoop": ["cuMemsetD8"]}  # the scrub's zeroing; the tenant uses D32
    node.save()
    done, report = run_check(node, tmp_path / "out")
    assert done.returncode == 1 and not report["pass"] and "FAIL" in done.stdout
    scrub = report["steps"]["scrub"]
    assert not scrub["ok"] and not scrub["scrub"]["verified"] and scrub["probe"]["canaryWords"] > 0


def test_a_hung_step_is_cut_at_its_limit_and_the_rest_still_reported(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    node.data["cuda"] = {"hang": "cuMemcpyDtoD"}  # only the bandwidth step copies device to device
    node.save()
    done, report = run_check(node, tmp_path / "out", "--step-timeout=8")
    steps = report["steps"]
    assert done.returncode == 1 and not report["pass"]
    assert not steps["bandwidth"]["ok"] and "timed out" in steps["bandwidth"]["error"]
    assert steps["bandwidth"]["seconds"] < 20
    assert steps["scrub"]["ok"] and steps["health"]["ok"], "the steps before and after still ran"


def test_a_gpu_without_nvml_events_is_checked_without_the_xid_watch(node, tmp_path):
    node.add_gpu(memory=96 * MiB, events=False)
    node.data["nvmlErrors"] = {"*": {"nvmlEventSetCreate": "NVML_ERROR_NOT_SUPPORTED"}}
    node.save()
    done, report = run_check(node, tmp_path / "out")
    assert report["xidWatch"].startswith("off") and report["steps"]["health"]["ok"]
    assert done.returncode == 0 and report["pass"]


def test_the_total_limit_ends_the_check_with_a_partial_report(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    done, report = run_check(node, tmp_path / "out", "--total-timeout=0.5")
    assert done.returncode == 1 and not report["pass"]
    failed = [n for n, s in report["steps"].items() if not s["ok"]]
    assert failed and all("timed out" in report["steps"][n]["error"] for n in failed), report["steps"]


def test_mig_mode_is_checked_through_an_existing_placement(node, tmp_path):
    gpu = node.add_gpu(mig=[])
    node.create_mig(gpu, "15", start=0)
    node.create_mig(gpu, "15", start=2)
    # A 32 MiB fake MIG device: the scrub's 1 MiB context is 3% of it (of a real 1g slice, far less).
    _, report = run_check(node, tmp_path / "out", "--max-unreachable=0.1")
    mig = report["steps"]["mig"]
    assert mig["ok"], mig
    assert mig["placement"]["parent_uuid"] == gpu["uuid"] and mig["placement"]["start"] == 2
    assert mig["probe"]["canaryWords"] == 0 and mig["scrub"]["verified"]
    gis = json.loads((node.root / "node.json").read_text())["gpus"][0]["gis"]
    assert [(g["start"], g["size"]) for g in gis] == [(0, 2), (2, 2)], "no MIG change"
