"""The watchdog of teardown steps stuck in the GPU driver (a GPU fallen off the bus hangs NVML and CUDA calls),
and how long the oldest teardown under way has taken since its release: what /healthz and the alerts read."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from scrubgate.policies import names

from .checkpoint import CheckpointError, CheckpointStore, FenceReason, State, Teardown
from .claim_writes import ClaimWriter, record_event
from .fence_decisions import FenceDecisions
from .kube import ClusterClient, ClusterError
from .metrics import AgentMetrics

log = logging.getLogger(__name__)


@contextlib.contextmanager
def unless_done_within(delay_s: float, function: Callable[..., object], *args: Any) -> Iterator[None]:
    """Calls `function(*args)` from a timer thread if the block is still running after `delay_s` seconds (the
    block's own thread is busy in it); on the way out, a call already under way is waited for."""
    timer = threading.Timer(delay_s, function, args)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()


class Watchdog:
    def __init__(
        self,
        *,
        node: str,
        timeout_s: float,
        store: CheckpointStore,
        cluster: ClusterClient,
        claim_writer: ClaimWriter,
        fences: FenceDecisions,
        metrics: AgentMetrics,
        clock: Callable[[], float],
    ) -> None:
        """`timeout_s`: how long a drain poll or a scrub may run."""
        self.node = node
        self.timeout_s = timeout_s
        self.store = store
        self.cluster = cluster
        self.claim_writer = claim_writer
        self.fences = fences
        self.metrics = metrics
        self.clock = clock
        self._stuck: dict[str, str] = {}  # claim UID -> what of its teardown is stuck in the driver, and since when

    def stuck(self) -> list[str]:
        """What of the teardowns is stuck in the driver now (for /healthz)."""
        return list(self._stuck.values())

    @contextlib.contextmanager
    def watched(self, td: Teardown) -> Iterator[None]:
        """Around a step that calls into the GPU driver (a drain poll, a scrub): past `timeout_s`, the
        watchdog (a timer thread: the step's own thread is stuck in the call) fails the teardown closed."""
        if td.state not in (State.DRAINING, State.SCRUBBING):
            yield
            return
        try:
            with unless_done_within(self.timeout_s, self._stuck_in_driver, td, td.state, self.clock()):
                yield
        finally:
            self._stuck.pop(td.claim.uid, None)  # after the watchdog, if it fired: nothing marks it stuck later

    def _stuck_in_driver(self, td: Teardown, state: State, since: float) -> None:
        devices = ", ".join(f"{d.key} ({d.uuid})" for d in td.devices)
        at = datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds")
        what = f"{state.value} of {devices} for claim {td.claim} stuck in the GPU driver since {at}"
        log.error(
            "%s; fencing the devices and failing /healthz. Check the GPU (nvidia-smi, dmesg for Xid 79: fallen off the bus)",
            what,
        )
        self.metrics.failures.labels(reason="scrub-timeout").inc()
        status = f"{names.SCRUB_FAILED_PREFIX}scrub-timeout: {state.value} still running after {self.timeout_s:.0f}s"
        try:
            self.fences.fence(td, FenceReason.FAILED)
            self.claim_writer.write_status(td, status)
            record_event(
                self.cluster,
                self.node,
                td,
                "ScrubTimeout",
                f"{what}: the devices are fenced and the agent reports unhealthy until it ends; if the GPU fell off "
                "the bus, drain the node and reset or replace the GPU",
                now=self.clock(),
            )
        except (ClusterError, CheckpointError) as exc:
            log.error("claim %s: could not fence or mark its stuck teardown: %s", td.claim, exc)
        finally:
            self._stuck[td.claim.uid] = what  # /healthz fails from here on, fenced or not

    def oldest_release_s(self) -> float:
        """Seconds since the release of the oldest teardown still under way (not failed: that has its own
        gauge); 0 when none is. Minutes mean a stuck teardown: a drain that does not end, an attestation the
        webhook refuses (a key the policy does not know), a webhook the agent cannot reach."""
        now = self.clock()
        released = [
            td.released_at
            for td in list(self.store.teardowns.values())  # read by the /metrics thread
            if td.released_at is not None and td.state not in (State.ALLOCATED, State.FAILED)
        ]
        return max((now - at for at in released), default=0.0)
