"""List, then watch from the list's resourceVersion: what the agent does for its node's pods and claims, and the
controller for every claim."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .kube import ClusterError

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class Backoff:
    """Seconds a watch lasts before it is made again (from the last event's resourceVersion), and the wait after
    a failed list or watch (doubling up to `max_s`)."""

    watch_timeout_s: int = 300
    initial_s: float = 1.0
    max_s: float = 60.0


def follow(
    what: str,
    lister: Callable[[], tuple[list[Obj], str]],
    watcher: Callable[[str, int], Iterator[tuple[str, Obj]]],
    on_list: Callable[[list[Obj]], None],
    on_event: Callable[[str, Obj], None],
    stop: threading.Event,
    backoff: Backoff = Backoff(),
    on_alive: Callable[[], None] = lambda: None,
) -> None:
    """Until `stop`: a list (to `on_list`), then its changes (to `on_event`, bookmarks aside), watched again from the
    last resourceVersion seen when a watch ends; listed again at once on 410 Gone (the version is too old), and
    after a backoff on any other error. `on_alive` hears of every list and event, bookmarks included (the API
    server sends one about every minute on a quiet watch)."""
    delay = backoff.initial_s
    while not stop.is_set():
        try:
            items, version = lister()
            on_alive()
            on_list(items)
            delay = backoff.initial_s
            while not stop.is_set():
                for kind, obj in watcher(version, backoff.watch_timeout_s):
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    on_alive()
                    if kind != "BOOKMARK":
                        on_event(kind, obj)
                    if stop.is_set():
                        return
        except ClusterError as exc:
            if exc.status != 410:
                log.warning("watch of %s failed (%s); listing again in %.0fs", what, exc, delay)
                stop.wait(delay)
                delay = min(delay * 2, backoff.max_s)
        except Exception:
            log.exception("watch of %s crashed; listing again in %.0fs", what, delay)
            stop.wait(delay)
