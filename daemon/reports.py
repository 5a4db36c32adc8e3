"""Accepting a report: the one way a report enters the record store.

Four paths store reports: ``POST /reef/report`` (``daemon/app.py``), a direct instruction (``evolve``,
``daemon/harness.py``), a judge's verdict on a turn (``daemon/learning.py``) and an import of exchanges with their
scores (``POST /reef/records/import``, in bulk: ``accept_imports``). Each parses its own input and decides what
learning does next; the fields a client sends (``score``, ``feedback``, ``report_id``) are checked by the functions
here (``check_score``, ``check_feedback``, ``check_report_id``), the same for ``/reef/report`` and an import line,
so that no path stores what another refuses. Storing, counting (``reef_records_total{kind="report"}``) and
announcing (a ``report`` event) happen here, the counting and announcing in one function (``_accepted``), so that
no path can store a report the metric or the event stream misses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest

if TYPE_CHECKING:
    from daemon.config import Config
    from daemon.events import EventBus
    from daemon.metrics import Metrics
    from daemon.records import RecordRow, RecordStore

SHOWN_FEEDBACK_CHARS = 500  # feedback text longer than this is not repeated on the event stream
MAX_FEEDBACK_CHARS = 256 * 1024  # a report's feedback: text, or the JSON of an object or array
MAX_REPORT_ID = 200
IMPORT_KEY = "import:"  # report_id prefix of the reports an import stores (``import:<receipt>``): not a client's


def check_score(value: Any) -> float:
    """A report's score: a finite number. JSON's ``1e400`` parses as infinity and a JSON Lines file read by Python
    may hold ``NaN``; neither can be stored (the record's JSON would hold null) nor trained on."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"score must be a number, not {type(value).__name__}", param="score")
    try:
        f = float(value)
    except OverflowError:
        raise BadRequest("score is out of range", param="score") from None
    if not math.isfinite(f):
        raise BadRequest("score must be a finite number", param="score")
    return f


def check_score_range(score: float, scenario: str, config: Config, param: str = "score") -> None:
    """A score within its scenario's range (``score_range``, or the scenario's own in ``[score_ranges]``), both ends
    included: a ``--score 7`` meant for a 0-10 scale is refused by name, not stored and trained on as a high label."""
    low, high = config.score_ranges.get(scenario, config.score_range)
    if not low <= score <= high:
        own = f"score_ranges.{scenario}" if scenario in config.score_ranges else "score_range"
        raise BadRequest(f"score {score:g} is outside scenario {scenario!r}'s range [{low:g}, {high:g}] "
                         f"({own} in config.toml)", param=param, scenario=scenario)


def check_feedback(value: Any) -> Any:
    """A report's feedback: text, or a JSON object or array, of at most ``MAX_FEEDBACK_CHARS``."""
    if not isinstance(value, (str, dict, list)):
        raise BadRequest("feedback must be text or a JSON object/array", param="feedback")
    if isinstance(value, str):
        size = len(value)
    else:
        import orjson

        try:
            size = len(orjson.dumps(value).decode())
        except TypeError:  # what orjson refuses (integers beyond 64 bits): measured as JSON text
            import json

            size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    if size > MAX_FEEDBACK_CHARS:
        raise BadRequest(f"feedback is {size} characters; the limit is {MAX_FEEDBACK_CHARS}", param="feedback")
    return value


def check_report_id(value: Any) -> str:
    """A client's ``report_id``: 1 to ``MAX_REPORT_ID`` characters, not in the import's own ``import:`` keys (an
    imported exchange's report takes ``import:<receipt>``: a client's key there would refuse that import)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REPORT_ID:
        raise BadRequest(f"report_id must be a non-empty string of at most {MAX_REPORT_ID} characters",
                         param="report_id")
    if value.startswith(IMPORT_KEY):
        raise BadRequest(f"report_id {value[:MAX_REPORT_ID]!r}: ids starting {IMPORT_KEY!r} are the reports of imported "
                         "exchanges (POST /reef/records/import); choose another", param="report_id")
    return value


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
) -> RecordRow:
    """Store a report on ``references`` (``RecordStore.reports.append``: idempotent on ``report_id``, 404 naming
    unknown receipts), count it and publish its ``report`` event; the stored report record.

    ``shown`` is the feedback text the event carries (None: the feedback itself when it is text of at most
    ``SHOWN_FEEDBACK_CHARS``); ``event`` adds fields to the event (a judge's ``source`` and ``verdict``)."""
    stored = await store.reports.append(
        scenario=scenario, score=score, feedback=feedback, references=references, metadata=metadata,
        report_id=report_id,
    )
    _accepted(metrics, events, stored, score=score, feedback=feedback, references=references, shown=shown, **event)
    return stored


async def accept_imports(store: RecordStore, metrics: Metrics, events: EventBus,
                         items: list[dict[str, Any]]) -> dict[str, int]:
    """Store imported exchanges and their reports (``store.user_data.import_exchanges``: one transaction,
    idempotent by id; ``items`` are ``daemon/export.from_line``'s), then count and announce each report stored, as
    ``accept_report`` does (the event's ``source`` is ``import``); the counts (``imported``, ``skipped``,
    ``reports``)."""
    counts, reports = await store.user_data.import_exchanges(items)
    for rep in reports:
        _accepted(metrics, events, rep, score=rep["score"], feedback=rep["feedback"], references=rep["references"],
                  source="import")
    return counts


def _accepted(metrics: Metrics, events: EventBus, stored: Mapping[str, Any], *, score: float | None, feedback: Any,
              references: list[str], shown: str | None = None, **event: Any) -> None:
    """A stored report counted and announced: one on ``reef_records_total{kind="report"}``, one ``report``
    event."""
    metrics.records.labels("report").inc()
    if shown is None and isinstance(feedback, str) and len(feedback) <= SHOWN_FEEDBACK_CHARS:
        shown = feedback
    events.publish("report", id=stored["id"], scenario=stored["scenario"], score=score, references=references,
                   feedback=shown, **event)
