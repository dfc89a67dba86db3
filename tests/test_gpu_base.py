"""The backend-neutral types, backend selection and the driver's scrub-on-free setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from scrubgate.sanitizer_agent.gpu import GpuDevice, HealthSnapshot, ScrubResult, open_backend
from scrubgate.sanitizer_agent.gpu.driver_params import scrub_on_free_disabled

HEALTHY = HealthSnapshot(0, False, False, None, ())


def test_a_clean_snapshot_is_healthy():
    assert HEALTHY.healthy and HEALTHY.problems() == []
    assert HealthSnapshot(0, False, False, 0, ()).healthy  # recovery action 0 is "none"


@pytest.mark.parametrize(
    ("snapshot", "problem"),
    [
        (HealthSnapshot(2, False, False, None, ()), "2 uncorrectable ECC errors"),
        (HealthSnapshot(0, True, False, None, ()), "row remapping pending"),
        (HealthSnapshot(0, False, True, None, ()), "row remapping failed"),
        (HealthSnapshot(0, False, False, 2, ()), "recovery action 2 (node reboot)"),
        (HealthSnapshot(0, False, False, None, (79, 48)), "critical XID events: 79, 48"),
    ],
)
def test_each_problem_makes_a_snapshot_unhealthy(snapshot, problem):
    assert not snapshot.healthy
    assert any(problem in p for p in snapshot.problems())


def test_attestation_health_matches_the_design():
    snapshot = HealthSnapshot(1, True, False, 1, (94,))
    assert snapshot.to_attestation() == {"eccUncorrectable": 1, "remapPending": True, "xids": [94]}


def test_scrub_rate_in_gigabytes_per_second():
    result = ScrubResult("GPU-x", 4_000_000_000, 5, 0, 0, 2.0, True, "m")
    assert result.gbps == pytest.approx(2.0)
    assert ScrubResult("GPU-x", 0, 0, 0, 0, 0.0, False, "m", "gone").gbps == 0.0


def test_mig_devices_have_a_parent():
    assert GpuDevice("MIG-1", 0, "n", "GPU-1", 1, 0, 1).is_mig
    assert not GpuDevice("GPU-1", 0, "n", None, 1, 0, 1).is_mig


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown GPU backend"):
        open_backend("opencl")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ('ResmanDebugLevel: 4294967295\nRegistryDwords: ""\nRegistryDwordsPerDevice: ""\n', False),
        ('RegistryDwords: "RMDisableScrubOnFree=1"\n', True),
        ('RegistryDwords: "PeerMappingOverride=1;RMDisableScrubOnFree=0x1;"\n', True),
        ('RegistryDwords: "RMDisableScrubOnFree=0"\n', False),
        ('RegistryDwords: ""\nRegistryDwordsPerDevice: "pci=0000:3b:00.0;RMDisableScrubOnFree=1"\n', True),
        ('RegistryDwords: "RMDisableScrubOnFree=yes"\n', None),
    ],
)
def test_scrub_on_free_setting_is_read_from_the_driver_params(tmp_path: Path, params, expected):
    path = tmp_path / "params"
    path.write_text(params)
    assert scrub_on_free_disabled(path) is expected


def test_scrub_on_free_setting_is_unknown_without_a_driver(tmp_path: Path):
    assert scrub_on_free_disabled(tmp_path / "missing") is None
