"""Build the scrub kernels' cubins (package data of scrubgate.sanitizer_agent.gpu) from kernels/scrub.ptx.

    .venv/bin/python tests/gpu/build_cubins.py        # writes sanitizer_agent/gpu/kernels/*.cubin

Needs ptxas: the `nvidia-cuda-nvcc-cu12` wheel of the test extra carries it (pinned, so that the cubins are
byte for byte what this script makes; `make test` checks that). One cubin per architecture major: a cubin
for X.y runs on every X.z with z >= y, so sm_70 covers Volta and Turing, sm_80 Ampere and Ada, sm_90
Hopper, sm_100 and sm_120 Blackwell. Built once and committed, not at install time: nodes have no ptxas,
and pip installs must not need a CUDA toolkit.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "sanitizer_agent" / "gpu" / "kernels"
ARCHITECTURES = ("sm_70", "sm_80", "sm_90", "sm_100", "sm_120")


def ptxas() -> Path:
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ptxas not found: pip install -e '.[test]' (nvidia-cuda-nvcc-cu12)")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "ptxas"


def build(out: Path = KERNELS) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    built = []
    for arch in ARCHITECTURES:
        target = out / f"scrub_{arch}.cubin"
        subprocess.run(
            [str(ptxas()), f"-arch={arch}", "-O3", str(KERNELS / "scrub.ptx"), "-o", str(target)], check=True
        )
        built.append(target)
    return built


if __name__ == "__main__":
    for path in build(Path(sys.argv[1]) if len(sys.argv) > 1 else KERNELS):
        print(f"{path} ({path.stat().st_size} bytes)")
