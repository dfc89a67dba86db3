"""The one worker thread that decodes and evaluates heavy requests (bodies over HEAVY_BODY_BYTES), shared fairly.

Pending requests wait in one queue per tenant (`tenant(body)`) and the worker takes them round-robin, so one
tenant's flood of large objects (dry runs cost nothing to send) delays another tenant's request by at most one
evaluation of its own, not by the whole flood; within a tenant, first in, first out.

A tenant is who can be told apart by what they may do, not by their credentials: a namespace's users and its
ServiceAccounts share one queue, since anyone with `create serviceaccounts/token` there can make as many
requesters as they like (64 ServiceAccounts would otherwise take 64 turns to another tenant's one). So the
tenant of a namespaced request is its namespace, whoever sends it; of a cluster-scoped request (no namespace),
its user, a ServiceAccount counting as its namespace. It is read from the start of the body, where the API
server writes `namespace`, `operation` and `userInfo` before `object` (Go field order of AdmissionRequest,
k8s.io/api admission/v1 types.go); a body whose start does not show which tenant sent it shares one queue
(UNREAD) with every other such body, so that leaving the namespace out buys nobody a lane of their own.
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from json.decoder import scanstring
from typing import Any

# The API server encodes AdmissionRequest fields in their Go order: uid, kind, resource, ..., name, namespace
# (left out when empty: a cluster-scoped object), operation, userInfo, object, oldObject, ...: all of them before
# the objects are within the first few KB whatever the objects' size.
_PREFIX_BYTES = 16 * 1024
_REQUEST = frozenset({"request"})
_OBJECTS = frozenset({"object", "oldObject"})
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_SERVICE_ACCOUNT = "system:serviceaccount:"
UNREAD = ""  # the queue of requests whose tenant the start of the body does not show


def tenant(body: bytes) -> str:
    """The request's tenant as a queue key (`namespace:<ns>` or `user:<username>`), or UNREAD."""
    text = body[:_PREFIX_BYTES].decode("utf-8", "replace")
    _, at = _members(text, 0, _REQUEST)
    request = _members(text, at, _OBJECTS)[0] if at is not None else {}
    namespace = request.get("namespace", "")
    if not isinstance(namespace, str):
        return UNREAD
    if namespace:
        return f"namespace:{namespace}"
    # No namespace means a cluster-scoped request only once `operation`, which the API server writes after it,
    # was read: a start cut short or unreadable before that says nothing, and its sender gets no lane of its own.
    # (The key is as trustworthy as the sender: with --client-ca only the API server sends.)
    user = request.get("userInfo")
    username = user.get("username") if isinstance(user, dict) else None
    if "operation" not in request or not isinstance(username, str) or not username:
        return UNREAD
    if username.startswith(_SERVICE_ACCOUNT) and ":" in username[len(_SERVICE_ACCOUNT) :]:
        return f"namespace:{username[len(_SERVICE_ACCOUNT) :].split(':', 1)[0]}"
    return f"user:{username}"


def _members(text: str, at: int, stop: frozenset[str]) -> tuple[dict[str, Any], int | None]:
    """The members of the JSON object that starts at `at`, in order, up to the first key in `stop`: those read,
    and where that key's value starts (None when the object ended, or the text stops being readable JSON)."""
    members: dict[str, Any] = {}
    at, separator = _skip(text, at), "{"
    try:
        while text[at : at + 1] == separator:
            at = _skip(text, at + 1)
            if text[at : at + 1] != '"':
                break
            key, at = scanstring(text, at + 1)
            at = _skip(text, at)
            if text[at : at + 1] != ":":
                break
            at = _skip(text, at + 1)
            if key in stop:
                return members, at
            members[key], at = _DECODER.raw_decode(text, at)
            at, separator = _skip(text, at), ","
    except (ValueError, RecursionError):  # cut short, not JSON, or nested too deep: what was read stands
        pass
    return members, None


class FairLane:
    def __init__(self, name: str = "scrubgate-heavy") -> None:
        self._queues: dict[str, deque[tuple[Callable[[], Any], Future[Any]]]] = {}
        self._turns: deque[str] = deque()  # tenants with work pending, in the order they are served
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
                self._turns.append(key)  # its next request waits for every other tenant's turn
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


def _skip(text: str, at: int) -> int:
    """Past the JSON whitespace at `at`."""
    space = _SPACE.match(text, at)
    return space.end() if space else at
