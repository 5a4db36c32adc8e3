"""The event bus: what happened in the daemon, for ``GET /reef/events`` (SSE), the TUI and progress bars.

Events are small dicts ``{"seq", "time", "kind", ...}``; kinds: ``record``, ``report``, ``scenario``,
``release``, ``engine.load``, ``train.step``, ``gate``, ``watchdog``, ``heldout`` (the held-out check's verdict:
passed, held, failed, with its figures), ``eval`` (``reef eval``'s progress:
started, measuring a release, done). Publishing never blocks: each subscriber has a bounded
queue, and a subscriber that falls that far behind is dropped: its backlog is thrown away (it is stale, and its
memory is the point of the bound) and it gets one last event, ``dropped``, after which its stream ends. The
``dropped`` event's ``resume_after`` (also its SSE ``id``) is the seq just before the first event it missed: a
client reconnects with ``Last-Event-ID`` (or ``?after=``) of it, the recent history replays from there, and it
reloads what it shows, since the events between the last one it read and the drop are gone.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

HISTORY = 1024
QUEUE_SIZE = 4096
DROPPED = "dropped"  # the kind of a dropped subscriber's last event


class EventBus:
    """Publish events to every subscriber's queue; ``None`` in a queue ends that subscriber's stream."""

    def __init__(self, queue_size: int = QUEUE_SIZE) -> None:
        self._seq = itertools.count(1)
        self._queue_size = queue_size
        self._subscribers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._on_drop: dict[asyncio.Queue[dict[str, Any] | None], Callable[[], None]] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.dropped = 0  # subscribers dropped for falling behind, since start

    def publish(self, kind: str, **data: Any) -> dict[str, Any]:
        event = {"seq": next(self._seq), "time": time.time(), "kind": kind, **data}
        self._history.append(event)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                self._drop(q, event["seq"])
        return event

    def _drop(self, q: asyncio.Queue[dict[str, Any] | None], missed: int) -> None:
        self._subscribers.discard(q)
        on_drop = self._on_drop.pop(q, None)
        if on_drop is not None:
            on_drop()
        self.dropped += 1
        while not q.empty():  # the backlog is stale: the subscriber reloads instead
            q.get_nowait()
        q.put_nowait({
            "seq": None, "time": time.time(), "kind": DROPPED, "resume_after": missed - 1,
            "message": f"this subscriber fell {self._queue_size} events behind and was dropped; reconnect with"
                       f" Last-Event-ID {missed - 1} and reload what you show",
        })
        q.put_nowait(None)

    def subscribe(self, after: int | None = None, *,
                  on_drop: Callable[[], None] | None = None) -> asyncio.Queue[dict[str, Any] | None]:
        """A new subscriber's queue, holding the recent events after seq ``after`` (if given) first; ``on_drop``
        is called when it is dropped for falling behind (its reader may be stuck writing to a client that stopped
        reading: the caller ends that)."""
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(max(self._queue_size, 2))  # room for the end
        if after is not None:
            for event in self._history:
                if event["seq"] > after and not q.full():
                    q.put_nowait(event)
        self._subscribers.add(q)
        if on_drop is not None:
            self._on_drop[q] = on_drop
        return q

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._subscribers.discard(q)
        self._on_drop.pop(q, None)

    def close(self) -> None:
        """End every subscriber's stream (the daemon is stopping)."""
        for q in list(self._subscribers):
            if q.full():  # its end must get in: what it has not read yet is dropped
                q.get_nowait()
            q.put_nowait(None)
        self._subscribers.clear()
