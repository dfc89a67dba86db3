"""Telling NVML's errors apart: an NVMLError's return code against the bindings' ``NVML_ERROR_*`` constants."""

from __future__ import annotations

from typing import Any


def nvml_error_is(nvml: Any, exc: Exception, name: str) -> bool:
    """Whether `exc` is NVML's NVML_ERROR_`name` (e.g. "NOT_SUPPORTED"); `nvml` is the pynvml module."""
    return getattr(exc, "value", None) == getattr(nvml, f"NVML_ERROR_{name}")
