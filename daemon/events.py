"""The event bus: what happened in the daemon, for ``GET /reef/events`` (SSE), the TUI and progress bars.

Events are small dicts ``{"seq", "time", "kind", ...}``; what each kind carries is declared here, one
``TypedDict`` per kind (``KINDS``: ``record``, ``report``, ``scenario``, ``release``, ``engine.load``,
``train.step``, ``gate``, ``heldout`` (the held-out check's verdict), ``eval`` (``reef eval``'s progress), ...).
Publishers name a kind and its fields; readers (the TUI, ``/reef/events``, OpenTelemetry) read those fields;
``tests/test_events.py`` holds every ``publish`` call and every reader to these declarations, so what is read
cannot drift from what is published. Publishing never blocks: each subscriber has a bounded
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
from typing import Any, TypedDict

HISTORY = 1024
QUEUE_SIZE = 4096
DROPPED = "dropped"  # the kind of a dropped subscriber's last event


class Event(TypedDict):
    """What every event carries: its place in the bus's order (None: the ``dropped`` notice), when, and its kind."""

    seq: int | None
    time: float
    kind: str


class RecordEvent(Event, total=False):
    """An exchange was served and recorded (its receipt: ``id``)."""

    id: str
    scenario: str
    run: str | None
    status: str  # complete | incomplete | error
    model: str | None
    release_id: str | None
    runtime_load_id: str | None
    timings: dict[str, float | None]  # ttft_ms, total_ms, engine_ms
    usage: dict[str, Any] | None
    started_at: float  # what traces read (daemon/telemetry.py): when it began, what was asked, how it ended
    format: str
    engine: str | None
    request_model: str | None
    response_model: str | None
    sampling: dict[str, Any]  # max_tokens, temperature, top_p: those the request gave
    finish_reason: str | None
    error: dict[str, str] | None  # type, message
    traceparent: str | None
    tracestate: str | None


class ReportEvent(Event, total=False):
    """A report was stored (``id``: the report; ``feedback``: its text when short, else None)."""

    id: str
    scenario: str | None
    score: float | None
    references: list[str]
    feedback: str | None
    source: str  # judge | import (a client's report: absent)
    verdict: str  # a judge's


class ScenarioEvent(Event):
    """A scenario was made or changed: the scenario as ``GET /reef/scenarios/{s}`` shows it."""

    scenario: dict[str, Any]


class ScenarioTaskEvent(Event):
    """A task was promoted from a run into a scenario's settings."""

    scenario: str
    task: str
    receipt: str | None


class ReleaseEvent(Event, total=False):
    """A release was published (``external``: by another daemon sharing the chain)."""

    scenario: str
    release_id: str
    content_id: str
    step: int
    operation: str
    source: str | None
    metrics: dict[str, Any]
    external: bool


class ReleasePendingEvent(Event):
    """A candidate is held for review (``reef releases promote``)."""

    scenario: str
    release_id: str
    step: int
    metrics: dict[str, Any]


class EngineLoadEvent(Event, total=False):
    """An engine loaded a model, or a release on it."""

    model: str
    scenario: str
    release_id: str
    content_id: str
    runtime_load_id: str | None


class TrainStartEvent(Event, total=False):
    """A step began: from ``base`` (the head), on ``samples`` records (or an agent's ``proposal``)."""

    scenario: str
    job: str
    base: str
    samples: int
    from_head: bool  # weights: not continuing the lineage's last candidate
    proposal: str
    episodes: int  # harness-search: the episodes it will run at most (tasks x repeats x sides), said before it starts
    tasks: int
    repeats: int
    max_episodes: int  # the setting that caps them


class TrainStepEvent(Event):
    """A candidate was made, before the gate."""

    scenario: str
    job: str
    step: int
    seconds: float
    metrics: dict[str, Any]


class TrainErrorEvent(Event):
    """Learning on a scenario failed; it waits for the next report."""

    scenario: str
    error: str


class TrainCappedEvent(Event):
    """A scenario's trainer-time or proposer-token cap is reached for today: no step starts (``daemon/spend.py``'s
    view)."""

    scenario: str
    summary: str
    trainer_seconds_today: float
    trainer_seconds_total: float
    max_trainer_hours: float | None
    proposer_tokens_today: int
    proposer_tokens_total: int
    max_proposer_tokens: int | None
    capped: bool
    resumes_at: str | None
    reward_gained: float | None
    seconds_per_point: float | None


class TrainDeferredEvent(Event):
    """A scenario's weights step waits: the disk under the Reef home has less free space than the step needs
    (``daemon/retention.py``); it runs once space returns."""

    scenario: str
    summary: str
    free_bytes: int
    need_bytes: int


class RetentionEvent(Event):
    """A retention pass pruned the weights of releases its scenarios' policies let go (``daemon/retention.py``)."""

    releases: list[str]
    objects: int
    bytes: int


class GateEvent(Event, total=False):
    """A step's outcome: published, held, rejected, skipped or failed."""

    scenario: str
    job: str
    verdict: str
    reason: str | None
    metrics: dict[str, Any]
    release_id: str | None
    proposal: str


class HeldoutEvent(Event, total=False):
    """The held-out check's verdict on a candidate: passed, held or failed."""

    scenario: str
    job: str
    verdict: str
    reason: str
    metrics: dict[str, Any]
    release_id: str | None


class WatchdogEvent(Event, total=False):
    """The reward-hacking watchdog held a candidate (``daemon/watchdog.py``'s figures and reason)."""

    scenario: str
    release_id: str | None
    reason: str
    kl_from_base: float
    max_kl: float
    train_from: float
    train_to: float
    held_from: float
    held_to: float
    steps: int


class WarningEvent(Event, total=False):
    """A scenario's early warning was raised (``warned``) or lifted (``how``: resumed, updated, accepted)."""

    scenario: str
    state: str
    release_id: str | None
    says: str
    reason: str
    signals: Any
    figures: Any
    how: str


class EvalEvent(Event, total=False):
    """``reef eval``'s progress: started, measuring a release, done."""

    scenario: str
    state: str
    releases: int
    transfer: str | None
    release_id: str
    step: int
    done: int
    total: int
    figures: list[str]
    measured: int
    cached: int
    seconds: float


class ForgetEvent(Event, total=False):
    """Exchanges were forgotten (``retention``: by the retention settings)."""

    receipts: int
    scenarios: list[str]
    retention: bool


class CanaryStartEvent(Event):
    """A candidate began serving a share of a scenario's runs."""

    scenario: str
    release_id: str
    base_id: str
    share: float
    settings: dict[str, Any]


class CanaryEndEvent(Event, total=False):
    """A canary ended: promoted or ended, why, and its figures."""

    scenario: str
    candidate: str
    figures: dict[str, Any]
    verdict: str
    reason: str
    release_id: str | None
    step: int


class DroppedEvent(Event):
    """A subscriber fell too far behind: its last event (``seq`` None); resume after ``resume_after``."""

    resume_after: int
    message: str


KINDS: dict[str, type[Event]] = {
    "record": RecordEvent, "report": ReportEvent, "scenario": ScenarioEvent, "scenario.task": ScenarioTaskEvent,
    "release": ReleaseEvent, "release.pending": ReleasePendingEvent, "engine.load": EngineLoadEvent,
    "train.start": TrainStartEvent, "train.step": TrainStepEvent, "train.error": TrainErrorEvent,
    "train.capped": TrainCappedEvent, "train.deferred": TrainDeferredEvent, "retention": RetentionEvent,
    "gate": GateEvent, "heldout": HeldoutEvent, "watchdog": WatchdogEvent, "warning": WarningEvent,
    "eval": EvalEvent, "forget": ForgetEvent, "canary.start": CanaryStartEvent, "canary.end": CanaryEndEvent,
    "dropped": DroppedEvent,
}


class EventBus:
    """Publish events to every subscriber's queue; ``None`` in a queue ends that subscriber's stream."""

    def __init__(self, queue_size: int = QUEUE_SIZE) -> None:
        self._seq = itertools.count(1)
        self._queue_size = queue_size
        self._subscribers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._on_drop: dict[asyncio.Queue[dict[str, Any] | None], Callable[[], None]] = {}
        self._internal: set[asyncio.Queue[dict[str, Any] | None]] = set()  # the daemon's own readers
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
        if q in self._internal:  # the daemon's own reader: it subscribes again and reloads, not a client dropped
            self._internal.discard(q)
        else:
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
                  on_drop: Callable[[], None] | None = None,
                  internal: bool = False) -> asyncio.Queue[dict[str, Any] | None]:
        """A new subscriber's queue, holding the recent events after seq ``after`` (if given) first; ``on_drop``
        is called when it is dropped for falling behind (its reader may be stuck writing to a client that stopped
        reading: the caller ends that). An ``internal`` subscriber is one of the daemon's own readers: it is not
        counted among the clients that ``subscribers`` and ``dropped`` (the status page's) tell of."""
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(max(self._queue_size, 2))  # room for the end
        if after is not None:
            for event in self._history:
                if event["seq"] > after and not q.full():
                    q.put_nowait(event)
        self._subscribers.add(q)
        if internal:
            self._internal.add(q)
        if on_drop is not None:
            self._on_drop[q] = on_drop
        return q

    @property
    def subscribers(self) -> int:
        """The clients subscribed now (the daemon's own readers are not counted)."""
        return len(self._subscribers) - len(self._internal)

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._subscribers.discard(q)
        self._internal.discard(q)
        self._on_drop.pop(q, None)

    def close(self) -> None:
        """End every subscriber's stream (the daemon is stopping)."""
        for q in list(self._subscribers):
            if q.full():  # its end must get in: what it has not read yet is dropped
                q.get_nowait()
            q.put_nowait(None)
        self._subscribers.clear()
        self._internal.clear()
