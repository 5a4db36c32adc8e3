"""Accepting a report: the one way a report enters the record store.

Four paths store reports: ``POST /reef/report`` (``daemon/app.py``), a direct instruction (``evolve``,
``daemon/harness.py``), a judge's verdict on a turn (``daemon/learning.py``) and an import of exchanges with their
scores (``POST /reef/records/import``, in bulk: ``accept_imports``). Each parses and checks its own input and
decides what learning does next; storing, counting (``reef_records_total{kind="report"}``) and announcing (a
``report`` event) happen here, the counting and announcing in one function (``_accepted``), so that no path can
store a report the metric or the event stream misses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.events import EventBus
    from daemon.metrics import Metrics
    from daemon.records import RecordStore

SHOWN_FEEDBACK_CHARS = 500  # feedback text longer than this is not repeated on the event stream


async def accept_report(
    store: RecordStore,
    metrics: Metrics,
    events: EventBus,
    *,
    scenario: str | None,
    score: float | None,
    feedback: Any,
    references: list[str],
    metadata: dict[str, Any] | None,
    report_id: str | None = None,
    shown: str | None = None,
    **event: Any,
) -> dict[str, Any]:
    """Store a report on ``references`` (``RecordStore.append_report``: idempotent on ``report_id``, 404 naming
    unknown receipts), count it and publish its ``report`` event; the stored report record.

    ``shown`` is the feedback text the event carries (None: the feedback itself when it is text of at most
    ``SHOWN_FEEDBACK_CHARS``); ``event`` adds fields to the event (a judge's ``source`` and ``verdict``)."""
    stored = await store.append_report(
        scenario=scenario, score=score, feedback=feedback, references=references, metadata=metadata,
        report_id=report_id,
    )
    _accepted(metrics, events, stored, score=score, feedback=feedback, references=references, shown=shown, **event)
    return stored


async def accept_imports(store: RecordStore, metrics: Metrics, events: EventBus,
                         items: list[dict[str, Any]]) -> dict[str, int]:
    """Store imported exchanges and their reports (``RecordStore.import_exchanges``: one transaction, idempotent
    by id; ``items`` are ``daemon/export.from_line``'s), then count and announce each report stored, as
    ``accept_report`` does (the event's ``source`` is ``import``); the counts (``imported``, ``skipped``,
    ``reports``)."""
    counts, reports = await store.import_exchanges(items)
    for rep in reports:
        _accepted(metrics, events, rep, score=rep["score"], feedback=rep["feedback"], references=rep["references"],
                  source="import")
    return counts


def _accepted(metrics: Metrics, events: EventBus, stored: dict[str, Any], *, score: float | None, feedback: Any,
              references: list[str], shown: str | None = None, **event: Any) -> None:
    """A stored report counted and announced: one on ``reef_records_total{kind="report"}``, one ``report``
    event."""
    metrics.records.labels("report").inc()
    if shown is None and isinstance(feedback, str) and len(feedback) <= SHOWN_FEEDBACK_CHARS:
        shown = feedback
    events.publish("report", id=stored["id"], scenario=stored["scenario"], score=score, references=references,
                   feedback=shown, **event)
