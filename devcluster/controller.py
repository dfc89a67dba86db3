"""scrubgate's controller as a host process (one replica, leader-elected on its Lease as the Deployment's are):
its metrics port, readiness and metrics. Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

from collections.abc import Callable

from .commands import controller_argv
from .probes import http_get, probe
from .processes import ManagedProcess, free_port, wait_for
from .workdir import Paths


class ControllerHost:
    """The controller (``process``); ``before_start``: what each start needs first (its pod's token)."""

    def __init__(
        self,
        paths: Paths,
        namespace: str,
        env: dict[str, str],
        ready_timeout: float,
        before_start: Callable[[], None],
    ) -> None:
        self.ready_timeout = ready_timeout
        self.metrics_port = free_port()
        self.process = ManagedProcess(
            "controller",
            controller_argv(paths, namespace, self.metrics_port),
            paths.logs / "controller.log",
            env,
            before_start=before_start,
        )

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until the controller leads and has listed every claim (a follower's /healthz says "following")."""

        def leads() -> bool:
            status, body = probe(self.metrics_port, "/healthz")
            return status == 200 and "following" not in body

        wait_for(
            lambda: leads() or self.process.check_alive(),
            timeout or self.ready_timeout,
            f"the controller's /healthz on 127.0.0.1:{self.metrics_port}",
        )

    def metrics(self) -> str:
        return http_get(self.metrics_port, "/metrics")[1]
