"""The scrub's shipped cubins: which one each architecture gets, and that they are what
tests/gpu/build_cubins.py makes (the scrub with each kind of kernel: test_gpu_nvml.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from scrubgate.sanitizer_agent.gpu import cuda_scrub

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import build_cubins


@pytest.mark.parametrize(
    ("capability", "cubin"),
    [
        ((9, 0), "scrub_sm_90"),
        ((8, 0), "scrub_sm_80"),
        ((8, 9), "scrub_sm_80"),  # Ada runs Ampere's cubin
        ((7, 5), "scrub_sm_70"),
        ((10, 3), "scrub_sm_100"),
        ((12, 1), "scrub_sm_120"),
        ((6, 1), None),  # Pascal: only the PTX
    ],
)
def test_the_cubin_for_each_architecture(capability, cubin):
    found = cuda_scrub.cubin_for(capability)
    assert [p.stem for p in found] == ([cubin] if cubin else [])


def test_shipped_cubins_are_what_the_build_script_makes(tmp_path):
    for built in build_cubins.build(tmp_path):
        shipped = cuda_scrub.KERNELS / built.name
        assert shipped.read_bytes() == built.read_bytes(), f"{shipped.name} is stale: run tests/gpu/build_cubins.py"
    assert {p.name for p in cuda_scrub.KERNELS.glob("*.cubin")} == {p.name for p in tmp_path.glob("*.cubin")}
