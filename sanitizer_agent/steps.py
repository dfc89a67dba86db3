"""How a teardown's steps are run: in the claim's lane (lanes.py) or, without lanes, here and now; each one skipped
while its teardown backs off after an API error (doubling up to a bound), and the backoff cleared by a step that
goes through."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

from .checkpoint import Teardown
from .kube import ClusterError
from .lanes import Lanes

log = logging.getLogger(__name__)


class Steps:
    def __init__(self, lanes: Lanes | None, clock: Callable[[], float], backoff_s: float, backoff_max_s: float) -> None:
        self.lanes = lanes
        self.clock = clock
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._retry: dict[str, tuple[float, float]] = {}  # claim UID -> (retry at, last delay)
        self._lock = threading.Lock()  # the lanes change the backoffs too

    def submit(self, td: Teardown, action: Callable[[], object], tag: str | None = None) -> None:
        """Runs `action` for `td` (guarded) in the claim's lane, after what was handed in for it before; without
        lanes, here and now. A tagged action already waiting in the lane is not handed in twice."""
        if self.lanes is None:
            self.guarded(td, action)
        else:
            self.lanes.submit(td.claim.uid, lambda: self.guarded(td, action), tag)

    def guarded(self, td: Teardown, action: Callable[[], object]) -> None:
        """Runs `action` for `td` unless it is backing off after an API error; API errors start a backoff."""
        retry = self._retry.get(td.claim.uid)
        if retry is not None and retry[0] > self.clock():
            return
        try:
            action()
        except ClusterError as exc:
            self.backoff(td, exc)
        else:
            self.clear(td.claim.uid)

    def backoff(self, td: Teardown, exc: ClusterError) -> None:
        with self._lock:
            last = self._retry.get(td.claim.uid, (0.0, 0.0))[1]
            delay = min(last * 2 or self.backoff_s, self.backoff_max_s)
            self._retry[td.claim.uid] = (self.clock() + delay, delay)
        log.warning("claim %s (%s): API error, retrying in %.0fs: %s", td.claim, td.state.value, delay, exc)

    def retry_at(self, claim_uid: str) -> float | None:
        """When a teardown backing off may call the API again."""
        retry = self._retry.get(claim_uid)
        return None if retry is None else retry[0]

    def clear(self, claim_uid: str) -> None:
        with self._lock:
            self._retry.pop(claim_uid, None)

    def keep_only(self, claim_uids: Collection[str]) -> None:
        with self._lock:
            self._retry = {uid: r for uid, r in self._retry.items() if uid in claim_uids}
