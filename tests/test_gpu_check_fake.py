"""tests/gpu/gpu_check.py end to end against the fake pynvml and CUDA driver (no GPU needed)."""

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


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(FAKES))
    import fakegpu

    yield fakegpu.FakeNode(tmp_path / "node")
    sys.modules.pop("fakegpu", None)


def run_check(node: Any, out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = subprocess.run(
        [
            sys.executable,
            str(CHECK),
            f"--tenant-gib={16 * MiB / (1 << 30)}",
            f"--copy-gib={4 * MiB / (1 << 30)}",
            "--iterations=2",
            f"--chunk-bytes={8 * MiB}",
            f"--min-chunk-bytes={64 << 10}",
            "--timeout=60",
            f"--out={out}",
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
    assert report["pass"] and report["selftest"]["ok"]
    assert report["selftest"]["foundWords"] == report["selftest"]["plantedWords"]
    assert report["withScrub"]["scrub"]["verified"]
    assert report["withScrub"]["probe"]["canaryWords"] == 0
    # The fake driver does not scrub on free: the next process finds the whole canary.
    assert report["withoutScrub"]["probe"]["canaryWords"] * 4 == report["tenantBytes"]
    assert report["bandwidth"]["nonzeroWords"] == 0
    assert "canary after agent scrub" in done.stdout and "PASS" in done.stdout


def test_check_sees_a_driver_that_scrubs_on_free(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    node.data["cuda"] = {"scrubOnFree": True}
    node.save()
    _, report = run_check(node, tmp_path / "out")
    assert report["withoutScrub"]["probe"]["canaryWords"] == 0


def test_check_fails_when_the_scrub_does_not_clean(node, tmp_path):
    node.add_gpu(memory=96 * MiB)
    node.data["cuda"] = {"memsetNoop": ["cuMemsetD8"]}  # the scrub's zeroing; the tenant uses D32
    node.save()
    done, report = run_check(node, tmp_path / "out")
    assert done.returncode == 1 and not report["pass"]
    assert not report["withScrub"]["scrub"]["verified"]
    assert report["withScrub"]["probe"]["canaryWords"] > 0
