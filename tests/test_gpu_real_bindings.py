"""scrubgate's CUDA calls through the REAL cuda-bindings package, against a stub libcuda.so.1
(tests/fakes/libcuda_stub.c): catches a wrong argument or return shape that the Python fake could
share with our code. cuda-bindings comes with the test extra; cc is the build machine's."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUB = REPO / "tests" / "fakes" / "libcuda_stub.c"
SCRUB = REPO / "sanitizer_agent" / "gpu" / "cuda_scrub.py"
CHECK = REPO / "tests" / "gpu" / "gpu_check.py"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cuda") is None or shutil.which("cc") is None,
    reason="needs cuda-bindings (pip install 'scrubgate[gpu]') and a C compiler",
)


@pytest.fixture(scope="module")
def stub_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("libcuda")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", folder / "libcuda.so.1", STUB, "-ldl"], check=True)
    return {**os.environ, "LD_LIBRARY_PATH": str(folder), "FAKE_CUDA_LOG": str(folder / "calls.log")}


def run(env: dict[str, str], *command: object) -> dict[str, object]:
    done = subprocess.run([sys.executable, *map(str, command)], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_scrub_through_the_real_bindings(stub_env):
    report = run(stub_env, SCRUB, f"--chunk-bytes={16 * MiB}", f"--min-chunk-bytes={MiB}")
    assert "error" not in report, report
    assert report["nonzeroWords"] == 0
    assert 60 * MiB < report["bytesScrubbed"] <= 64 * MiB
    assert report["kernels"] == "cubin sm_90" and report["kernelErrors"] == []


def test_verification_through_the_real_bindings_sees_unzeroed_memory(stub_env):
    env = {**stub_env, "STUB_MEMSET_NOOP": "1"}
    report = run(env, SCRUB, f"--chunk-bytes={16 * MiB}", f"--min-chunk-bytes={MiB}")
    # Every word of both passes is counted (with the counter's own reset a no-op too, the warm-up's count
    # stays in it: at least that many).
    assert report["nonzeroWords"] >= (report["bytesFirstPass"] + report["bytesSecondPass"]) // 16 > 0


def test_gpu_check_kernels_through_the_real_bindings(stub_env):
    report = run(
        stub_env, CHECK, "selftest", f"--bytes={32 * MiB}", f"--chunk-bytes={16 * MiB}", f"--min-chunk-bytes={MiB}"
    )
    assert report["ok"], report
