"""What a learning recipe receives from the record store: ``ScoredExchange`` and ``FeedbackReport``.

A recipe's ``source`` says which: ``scores`` recipes get scored exchanges (``RecordStore.reports.scored_exchanges``: an
exchange with its tokens, and the report that scored it), ``feedback`` recipes get reports that carry written
feedback (``RecordStore.reports.feedback``). Both backends (SQLite, PostgreSQL) build these through the one
constructor each has here, the daemon's loop (``daemon/learning.py``) hands them to ``eligible``, ``batch``,
``edit`` and, inside ``TrainJob.batch``, pickled to the trainer worker's ``train``.

Design choices:
- Frozen, slotted dataclasses: a recipe reads named fields, and a misspelt one is an ``AttributeError`` at once,
  where the dicts these replace answered ``.get("hnit")`` with None and the step went on without its signal.
- The report is a field of the scored exchange (``ScoredExchange.report``), not merged into it: the row the store
  reads joins two records, the exchange and the report on it, and an exchange scored twice comes twice, each time
  with the report that scored it. Its ``metadata``, ``source`` and ``hint`` are the report's, never the
  exchange's, and ``FeedbackReport`` is the same type a ``feedback`` recipe receives. ``ScoredExchange.score`` is
  the report's score, never None (only reports with a score make a scored exchange).
- The dict keys these replaced (documented in ``docs/writing-a-recipe.md`` before) still read, through
  ``record["key"]`` and ``record.get("key")``, with a ``DeprecationWarning`` (and a log line) the first time each
  key is read in a process; a key the dicts never had is a ``KeyError`` naming the fields, not None.
- This module imports nothing of the daemon: a recipe (and the trainer worker) can import it alone.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("reef.recipes")

_warned: set[tuple[str, str]] = set()  # (class, key): each old key warns once per process


@dataclass(frozen=True, slots=True)
class RequestSampling:
    """The sampling settings the client's request asked for (None: not given, the engine's default: temperature 1,
    no top-p or top-k truncation). Recipes trained on behaviour log-probs use only answers sampled at temperature 1
    without truncation (``recipes.base.off_policy_sampling``)."""

    temperature: float | None = None
    top_p: float | None = None  # a probability mass in (0, 1]; 1 truncates nothing
    top_k: float | None = None  # a count of tokens; 0 truncates nothing (a number as JSON gave it)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RequestSampling:
        """From the request's fields (numbers or None; anything else counts as not given)."""

        def number(key: str) -> float | None:
            v = values.get(key)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        return cls(temperature=number("temperature"), top_p=number("top_p"), top_k=number("top_k"))


@dataclass(frozen=True, slots=True)
class FeedbackReport:
    """One report as a recipe receives it: a score, written feedback, or both, on one or more receipts."""

    id: str  # the report's own record id (``rep_...``), not a receipt
    seq: int  # the store's sequence number of the report's record: reports are read in this order
    score: float | None = None  # as the client (or a judge: 1 good, 0 bad) sent it; None: no score
    feedback: Any = None  # text, or the structured value (an object) the client sent; None: no feedback
    references: tuple[str, ...] = ()  # the receipts it reports on, as sent
    metadata: dict[str, Any] | None = None  # as sent (a recipe's ``Report`` fields live here); None: none
    # ``metadata.source`` when it is text: "judge" (a judge's verdict on a turn, daemon/learning.py), "outcome"
    # (a wrapped run's outcome, reef_cli/outcomes.py); None: an explicit report, which takes precedence
    source: str | None = None
    hint: str | None = None  # ``metadata.hint`` when it is text: what a judge said the turn got wrong
    scenario: str | None = None
    created_at: float | None = None  # when it was stored, seconds since the epoch

    @classmethod
    def from_stored(cls, *, id: str, seq: int, body: Mapping[str, Any], scenario: str | None = None,
                    created_at: float | None = None) -> FeedbackReport:
        """The one constructor from what the store keeps: a report record's id, seq and JSON ``body``
        (``{score, feedback, references, metadata}``, as ``RecordStore.reports.append`` wrote it)."""
        metadata = body.get("metadata")
        meta = metadata if isinstance(metadata, dict) else None
        source = meta.get("source") if meta else None
        hint = meta.get("hint") if meta else None
        score = body.get("score")
        refs = body.get("references")
        return cls(
            id=id,
            seq=int(seq),
            score=float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else None,
            feedback=body.get("feedback"),
            references=tuple(r for r in refs if isinstance(r, str)) if isinstance(refs, list) else (),
            metadata=meta,
            source=source if isinstance(source, str) else None,
            hint=hint if isinstance(hint, str) else None,
            scenario=scenario,
            created_at=created_at,
        )

    def body(self) -> dict[str, Any]:
        """The report as it was sent: ``{score, feedback, references, metadata}``."""
        return {"score": self.score, "feedback": self.feedback, "references": list(self.references),
                "metadata": self.metadata}

    # --- the old record dict's keys (deprecated) ------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        return _old_key(self, key, _REPORT_KEYS)

    def get(self, key: str, default: Any = None) -> Any:
        return _old_key(self, key, _REPORT_KEYS)  # every old key has a value: ``default`` is never it


@dataclass(frozen=True, slots=True)
class ScoredExchange:
    """One served exchange with the report that scored it, as a ``scores`` recipe receives it: the exact tokens
    the engine saw and sampled, their behaviour log-probs, the release that served it and the score."""

    id: str  # the exchange's receipt (``x-reef-agent-record-id``): what a step consumes
    release_id: str | None  # the release that served it; None: the record names none (served before any)
    prompt_token_ids: list[int]  # the prompt as the engine tokenised it
    token_ids: list[int]  # the sampled answer, EOS included when the model stopped
    # natural-log probability of each of ``token_ids`` under the raw logits (temperature 1, before top-p / top-k),
    # as sampled: len(logprobs) == len(token_ids)
    logprobs: list[float]
    report: FeedbackReport  # the report that scored it (its score is never None)
    sampling: RequestSampling = field(default_factory=RequestSampling)  # what the request asked for

    def __post_init__(self) -> None:
        if self.report.score is None:
            raise ValueError(f"a scored exchange needs a report with a score (report {self.report.id} has none)")

    @property
    def score(self) -> float:
        """The report's score."""
        score = self.report.score
        assert score is not None  # __post_init__
        return score

    # --- the old dict's keys (deprecated) -------------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        return _old_key(self, key, _SCORED_KEYS)

    def get(self, key: str, default: Any = None) -> Any:
        return _old_key(self, key, _SCORED_KEYS)  # every old key has a value: ``default`` is never it


# the keys of the dicts recipes received before these types, and where each now lives
_SCORED_KEYS: dict[str, tuple[str, Callable[[ScoredExchange], Any]]] = {
    "id": ("id", lambda r: r.id),
    "release_id": ("release_id", lambda r: r.release_id),
    "prompt_token_ids": ("prompt_token_ids", lambda r: r.prompt_token_ids),
    "token_ids": ("token_ids", lambda r: r.token_ids),
    "logprobs": ("logprobs", lambda r: r.logprobs),
    "score": ("score", lambda r: r.score),
    "report_seq": ("report.seq", lambda r: r.report.seq),
    "source": ("report.source", lambda r: r.report.source),
    "hint": ("report.hint", lambda r: r.report.hint),
    "metadata": ("report.metadata", lambda r: r.report.metadata),
    "sampling": ("sampling", lambda r: asdict(r.sampling)),
}
_REPORT_KEYS: dict[str, tuple[str, Callable[[FeedbackReport], Any]]] = {
    "id": ("id", lambda r: r.id),
    "seq": ("seq", lambda r: r.seq),
    "kind": ("(always 'report')", lambda r: "report"),
    "scenario": ("scenario", lambda r: r.scenario),
    "created_at": ("created_at", lambda r: r.created_at),
    "report": ("score, feedback, references, metadata (or body())", lambda r: r.body()),
    "status": ("(always 'complete')", lambda r: "complete"),
    # columns of the records table that a report's row always had empty
    **{k: ("(nothing: a report has none)", lambda r: None) for k in (
        "run", "format", "engine", "model", "release_id", "content_id", "runtime_load_id", "timings", "usage")},
}


def _old_key(record: Any, key: str, keys: Mapping[str, tuple[str, Callable[[Any], Any]]]) -> Any:
    kind = type(record).__name__
    if key not in keys:
        # a dict answered .get() of a misspelt key with None and the recipe went on without it: not any more
        raise KeyError(f"{kind} has no key {key!r}: read its fields ({', '.join(_field_names(record))}) "
                       "as attributes (docs/writing-a-recipe.md)")
    name, read = keys[key]
    if (kind, key) not in _warned:
        _warned.add((kind, key))
        message = (f"reading a {kind} as a dict ({kind}[{key!r}]) is deprecated: read .{name} "
                   "(docs/writing-a-recipe.md)")
        log.warning("%s", message)
        warnings.warn(message, DeprecationWarning, stacklevel=3)
    return read(record)


def _field_names(record: Any) -> list[str]:
    names = [n for n in type(record).__slots__ if not n.startswith("_")]
    return names + (["score"] if isinstance(record, ScoredExchange) else [])
