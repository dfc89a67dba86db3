"""Runs gpu_check.py on a real NVIDIA GPU (marker ``gpu``); skipped where there is none."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("gpu_check.py")


def real_gpu() -> bool:
    """A GPU NVML can see, and both real binding packages (not the fakes in tests/fakes)."""
    probe = (
        "import pynvml, cuda.bindings.driver; pynvml.nvmlInit();"
        "assert 'fakes' not in pynvml.__file__; print(pynvml.nvmlDeviceGetCount())"
    )
    if importlib.util.find_spec("pynvml") is None:
        return False
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    return done.returncode == 0 and done.stdout.strip() not in ("", "0")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not real_gpu(), reason="needs an NVIDIA GPU and scrubgate[gpu]")]


@pytest.mark.timeout(600)  # the check's own limit is 8 minutes
def test_scrub_leaves_no_canary_on_a_real_gpu(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, str(CHECK), "--tenant-gib=4", "--copy-gib=4", f"--out={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    print(done.stdout, done.stderr)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    assert steps["selftest"]["ok"], steps["selftest"]
    assert steps["scrub"]["scrub"]["verified"], steps["scrub"]["scrub"]["reason"]
    assert steps["scrub"]["probe"]["canaryWords"] == 0
    assert steps["scrub"]["coverage"]["unreachedShare"] <= 0.02
    assert done.returncode == 0
