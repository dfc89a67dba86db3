"""Work of many claims at once, each claim's in order: one lane per key (a claim's UID), a bounded pool of
threads running the lanes. A lane runs one task at a time, in the order they were handed in; different lanes
run side by side, at most `workers` at once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

Task = Callable[[], object]


class Lanes:
    def __init__(self, workers: int, name: str = "lane") -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queued: dict[str, deque[tuple[Task, str | None]]] = {}  # key -> tasks not started, while it runs
        self._tags: dict[str, set[str]] = {}  # key -> tags of its queued tasks
        self._fatal: BaseException | None = None
        self._closing = False

    def submit(self, key: str, task: Task, tag: str | None = None) -> None:
        """Runs `task` after the tasks handed in before for `key`. A tagged task is dropped when one with the
        same tag is still waiting in the lane (it would do the same)."""
        with self._lock:
            lane = self._queued.get(key)
            if lane is None:
                self._queued[key] = deque([(task, tag)])
                self._tags[key] = {tag} if tag else set()
                self._pool.submit(self._run, key)
                return
            if tag is not None:
                if tag in self._tags[key]:
                    return
                self._tags[key].add(tag)
            lane.append((task, tag))

    def busy(self, key: str) -> bool:
        with self._lock:
            return key in self._queued

    def _run(self, key: str) -> None:
        while True:
            with self._lock:
                lane = self._queued[key]
                if not lane or self._fatal is not None or self._closing:
                    del self._queued[key]
                    del self._tags[key]
                    self._idle.notify_all()
                    return
                task, tag = lane[0]
                if tag is not None:
                    self._tags[key].discard(tag)
            try:
                task()
            except Exception:  # the task's own state is checkpointed; the next tick hands it in again
                log.exception("work on claim %s failed; it is retried at the next tick", key)
            except BaseException as exc:  # the process is going down: no further task starts
                with self._lock:
                    self._fatal = exc
            with self._lock:
                lane.popleft()

    def raise_fatal(self) -> None:
        """Re-raises, in the caller's thread, what brought a lane down (SystemExit, KeyboardInterrupt)."""
        if self._fatal is not None:
            raise self._fatal

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until no lane has work; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._queued, timeout)

    def close(self) -> None:
        """Waits for the tasks under way; those not started are dropped (the next process redoes them from the
        checkpoint)."""
        with self._lock:
            self._closing = True
        self._pool.shutdown(wait=True, cancel_futures=True)
