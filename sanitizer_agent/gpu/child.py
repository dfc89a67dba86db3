"""Runs ``cuda_scrub.py`` in a process of its own, one device at a time, and reads its one-line JSON report.

A crashed or hung scrub is killed without taking the agent along, and the driver releases everything the
child held when it exits. Each child is a Python with the CUDA driver and a context of its own, a few hundred MB
of host memory (its report says how much): at most `max_parallel` run at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import cuda_scrub

SCRUB_SCRIPT = Path(cuda_scrub.__file__)


class ScrubChild:
    def __init__(
        self,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        max_parallel: int = 4,
        script: Path = SCRUB_SCRIPT,
    ) -> None:
        self.python = python
        self.env = dict(env or {})
        self.timeout_s = timeout_s
        self.script = script
        self._slots = threading.BoundedSemaphore(max_parallel)

    def run(self, uuid: str, args: list[str]) -> tuple[dict[str, Any], str | None]:
        """Runs the script with `args` on device `uuid` (CUDA_VISIBLE_DEVICES); (its report, None) or ({}, why
        it failed)."""
        env = {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": uuid}
        try:
            with self._slots:
                done = subprocess.run(
                    [self.python, str(self.script), *args],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=self.timeout_s,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            return {}, f"scrub of {uuid} did not finish within {self.timeout_s:.0f}s and was killed"
        except OSError as exc:
            return {}, f"scrub of {uuid} could not start {self.python}: {exc}"
        report = _last_json_line(done.stdout)
        if report is None:
            tail = (done.stderr or done.stdout).strip()[-500:]
            return {}, f"scrub of {uuid} exited {done.returncode} without a report: {tail}"
        if "error" in report:
            return {}, f"scrub of {uuid} failed: {report['error']}"
        if done.returncode != 0:
            return {}, f"scrub of {uuid} exited {done.returncode}"
        return report, None


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None
