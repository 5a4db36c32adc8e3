"""The event bus: what happened in the daemon, for ``GET /reef/events`` (SSE), the TUI and progress bars.

Events are small dicts ``{"seq", "time", "kind", ...}``; kinds: ``record``, ``report``, ``scenario``,
``release``, ``engine.load``, ``train.step``, ``gate``. Publishing never blocks: each subscriber has a bounded
queue, and a subscriber that falls that far behind is dropped (its stream ends; it reconnects with
``Last-Event-ID`` and the recent history fills the gap).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Any

HISTORY = 1024
QUEUE_SIZE = 4096


class EventBus:
    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self._subscribers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    def publish(self, kind: str, **data: Any) -> dict[str, Any]:
        event = {"seq": next(self._seq), "time": time.time(), "kind": kind, **data}
        self._history.append(event)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                self._subscribers.discard(q)
                q.put_nowait(None) if not q.full() else None
        return event

    def subscribe(self, after: int | None = None) -> asyncio.Queue[dict[str, Any] | None]:
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(QUEUE_SIZE)
        if after is not None:
            for event in self._history:
                if event["seq"] > after:
                    q.put_nowait(event)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._subscribers.discard(q)

    def close(self) -> None:
        for q in list(self._subscribers):
            try:
                q.put_nowait(None)
            except asyncio.QueueFull:
                pass
        self._subscribers.clear()
