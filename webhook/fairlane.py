"""The one worker thread that decodes and evaluates heavy requests (bodies over HEAVY_BODY_BYTES), shared fairly.

Pending requests wait in one queue per requester (the AdmissionReview's `userInfo.username`) and the worker
takes them round-robin, so one tenant's flood of large objects (dry runs cost nothing to send) delays another
tenant's request by at most one evaluation of its own, not by the whole flood; within a requester, first in,
first out. The requester is read from the start of the body, where the API server writes `userInfo` before
`object`; a body that does not have it there shares one queue with the others like it.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# The API server encodes AdmissionRequest fields in their Go order: uid, kind, ..., operation, userInfo,
# object, oldObject: the username is within the first few KB whatever the object's size.
_USERNAME = re.compile(rb'"userInfo"\s*:\s*\{\s*"username"\s*:\s*"((?:[^"\\]|\\.){0,512})"')
_PREFIX_BYTES = 16 * 1024


def requester(body: bytes) -> str:
    """The request's username as its JSON writes it, or "" when the start of the body does not say."""
    match = _USERNAME.search(body, 0, _PREFIX_BYTES)
    return match.group(1).decode("utf-8", "replace") if match else ""


class FairLane:
    def __init__(self, name: str = "scrubgate-heavy") -> None:
        self._queues: dict[str, deque[tuple[Callable[[], Any], Future[Any]]]] = {}
        self._turns: deque[str] = deque()  # requesters with work pending, in the order they are served
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, work: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._ready:
            queue = self._queues.setdefault(key, deque())
            if not queue:
                self._turns.append(key)
            queue.append((work, future))
            self._ready.notify()
        return future

    def queued(self) -> int:
        """Requests waiting for the worker (the one it is evaluating not counted)."""
        with self._ready:
            return sum(len(queue) for queue in self._queues.values())

    def _next(self) -> tuple[Callable[[], Any], Future[Any]]:
        with self._ready:
            while not self._turns:
                self._ready.wait()
            key = self._turns.popleft()
            queue = self._queues[key]
            item = queue.popleft()
            if queue:
                self._turns.append(key)  # its next request waits for every other requester's turn
            else:
                del self._queues[key]
            return item

    def _run(self) -> None:
        while True:
            work, future = self._next()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:  # the caller gets it; the lane serves on
                future.set_exception(exc)
