"""One exchange being served (``Served``): what the serve path (``daemon/serving.py``) knows of a request from the
moment its release is chosen, what the HTTP layer needs to answer it and what its record is made of; and how an
exchange that failed is told (``reef_error``), recorded on its release whatever failed, before the engine started as
after.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from daemon.engines import Engine
from daemon.errors import ReefError
from daemon.exchange import EngineEvent, Exchange
from daemon.records import Scenario

log = logging.getLogger("reef")


@dataclass
class Served:
    """One exchange being served: what the HTTP layer needs to answer and to record."""

    exchange: Exchange
    scenario: Scenario
    run: str | None
    engine: Engine
    receipt: str
    release_id: str | None
    content_id: str | None
    started: float
    events: AsyncIterator[EngineEvent]
    first: EngineEvent | None  # None until the engine's first event is in
    headers: dict[str, str] = field(default_factory=dict)
    first_token_at: float | None = None
    engine_started: float = 0.0
    finished_at: float | None = None
    record_ms: float | None = None
    request_text: str | None = None  # the client's body as received (valid JSON): stored without re-encoding
    opened: bool = False  # a stream's record was opened (``RecordStore.exchanges.open``): recording completes it
    first_event_at: float | None = None  # when the engine's first event came in
    opening_ms: float | None = None  # a stream: how long its opening record's durable write took
    receipt_wait_ms: float | None = None  # a stream: how long its first event waited for that write
    capture: bool = True  # False: serve-only (``x-reef-capture: false`` or the scenario's switch), never trained on

    @property
    def engine_ms(self) -> float | None:
        """Time spent in the engine's generate call, from the call to its ``Finish``."""
        if self.finished_at is None:
            return None
        return (self.finished_at - self.engine_started) * 1e3


def reef_error(exc: Exception) -> ReefError:
    """The error an exchange that failed is recorded and answered with: a ``ReefError`` as it is; anything else
    (a bug, an engine that broke its contract) logged here with its traceback and recorded as the 500 that
    ``daemon/app.py`` answers for it, its message left out of the record and the answer as there."""
    if isinstance(exc, ReefError):
        return exc
    log.error("an exchange failed unexpectedly", exc_info=exc)
    return ReefError(f"internal error: {type(exc).__name__}")


async def no_events() -> AsyncIterator[EngineEvent]:
    """The events of an exchange the engine was not asked for yet: none."""
    return
    yield
