"""GPU backends: real (NVML + CUDA driver API) and simulated (file-backed memory)."""

from __future__ import annotations

from typing import Any, Literal

from .base import (
    APPLICATION_XIDS,
    GpuBackend,
    GpuDevice,
    GpuError,
    GpuProcess,
    HealthSnapshot,
    MigPlacement,
    ScrubResult,
    critical_xid,
)

BackendKind = Literal["nvml", "simulated"]


def open_backend(kind: BackendKind, **options: Any) -> GpuBackend:
    """Open a backend by name; the real one imports pynvml only here, so nothing else needs a GPU."""
    if kind == "nvml":
        from .nvml import NvmlBackend

        return NvmlBackend(**options)
    if kind == "simulated":
        from .simulated import SimulatedGpu

        return SimulatedGpu(**options)
    raise ValueError(f"unknown GPU backend {kind!r}: use 'nvml' or 'simulated'")


__all__ = [
    "APPLICATION_XIDS",
    "BackendKind",
    "GpuBackend",
    "GpuDevice",
    "GpuError",
    "GpuProcess",
    "HealthSnapshot",
    "MigPlacement",
    "ScrubResult",
    "critical_xid",
    "open_backend",
]
