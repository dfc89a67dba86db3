"""The processes of a local installation, and waiting on them: start, stop (SIGTERM), kill -9, restart,
logs to a file. Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("devcluster.processes")

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]


class HarnessError(RuntimeError):
    """The harness could not bring something up, or a wait ran out; the message says what and shows logs."""


def wait_for(check: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.05) -> T:
    """Polls ``check`` until it returns something truthy and returns that; HarnessError after ``timeout`` s.
    A bounded wait, not a timing assertion: it only says how long to keep looking."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what} (last value {result!r})")
        time.sleep(interval)


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_range() -> range:
    """Below the kernel's ephemeral range: an ephemeral port can go to any outgoing connection between the
    check and the server's bind (etcd failed so: "address already in use"). Each of pytest-xdist's workers
    (PYTEST_XDIST_WORKER gw0, gw1, ...) takes its own slice, as a port handed out but not yet bound in one
    worker is free to the others' checks."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if not worker.startswith("gw") or count < 2:
        return range(low, high)
    size = (high - low) // count
    start = low + int(worker[2:]) % count * size
    return range(start, start + size)


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for servers that cannot report theirs), never one this
    process handed out before (see _port_range for where it is taken)."""
    ports = _port_range()
    low, high = ports.start, ports.stop
    for port in random.sample(ports, min(500, len(ports))):
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise HarnessError(f"no free port on 127.0.0.1 between {low} and {high} after 500 tries")


# ---------------------------------------------------------------------- processes


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a child that gets SIGTERM when the harness dies (even by kill -9), so nothing outlives it.
    The libc function is looked up here, in the parent, so the child only makes one call before exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


_PDEATHSIG = _parent_death_signal()


class ManagedProcess:
    """One process of the installation: start, stop (SIGTERM, then SIGKILL), kill (-9), restart.

    Output goes to ``log_path`` (appended across restarts, each start marked), so a failure can show
    what the process said. The process gets SIGTERM if the harness itself dies.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        before_start: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.before_start = before_start  # what each start needs first (an agent: its pod's fresh token)
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        if self.running:
            raise HarnessError(f"{self.name} is already running (pid {self.pid})")
        if self.before_start is not None:
            self.before_start()
        with open(self.log_path, "ab") as out:
            out.write(f"--- harness: start {self.name}: {shlex.join(self.argv)}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO_ROOT,  # python -m devcluster.* finds the harness here
                start_new_session=True,  # a Ctrl-C in the terminal reaches the harness, which stops us in order
                preexec_fn=_PDEATHSIG,
            )
        self.starts += 1
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait; SIGKILL after ``timeout`` s. Returns the exit status (None if never started)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs of SIGTERM; killing it\n%s", self.name, timeout, self.tail())
                self._proc.kill()
                self._proc.wait()
        return self._proc.returncode

    def terminate(self) -> None:
        """SIGTERM without waiting for the exit (``stop`` waits)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> int | None:
        """kill -9: no shutdown code runs (a crash, as far as the process can tell)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        return self._proc.returncode

    def restart(self, timeout: float = 10.0) -> ManagedProcess:
        self.stop(timeout)
        return self.start()

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return f"({self.log_path} does not exist)"
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if not self.running:
            raise HarnessError(
                f"{self.name} exited with status {self.returncode}; last lines of {self.log_path}:\n{self.tail()}"
            )
