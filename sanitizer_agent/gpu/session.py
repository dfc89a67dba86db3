"""NVML's session: nvmlInit when the first of the operations that overlap starts, nvmlShutdown when the last ends.

NVML is open only while an operation runs, never while the agent waits (nvml.py says why).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .base import GpuError

log = logging.getLogger(__name__)

# What the backend's parts are given to open NVML for a block: an NvmlSession's `open`.
OpenNvml = Callable[[], contextlib.AbstractContextManager[None]]


class NvmlSession:
    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._sessions = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """NVML open for the block; operations that overlap (teardowns in parallel) share one session."""
        with self._lock:
            if self._sessions == 0:
                try:
                    self._nvml.nvmlInit()
                except self._nvml.NVMLError as exc:
                    raise GpuError(f"NVML could not start: {exc}; is the NVIDIA driver loaded on this node?") from exc
            self._sessions += 1
        try:
            yield
        finally:
            with self._lock:
                self._sessions -= 1
                if self._sessions == 0:
                    try:
                        self._nvml.nvmlShutdown()
                    except self._nvml.NVMLError as exc:
                        log.warning("NVML shutdown failed: %s", exc)
