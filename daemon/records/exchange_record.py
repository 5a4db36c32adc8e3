"""What one served exchange is, as the record store keeps it: ``ExchangeRecord``.

The serve path (``daemon/serving.py``) makes one, an import (``daemon/export.py``) makes one from a line, and the
record store writes it (``daemon/records/store.py``, for both backends): its column list, its insert row and the
outcome that completes a stream's opened record are all read off this class's fields, so a field added here is
written everywhere, and a column cannot be written by one path and forgotten by another.

Each field that is a column of ``records`` says in its metadata how it is stored (``column``: ``plain`` as it is,
``json`` as JSON text, ``ints`` packed int32, ``floats`` packed float32, ``flag`` 0 or 1) and whether it is part
of the outcome (``outcome``: what ``complete_exchange`` fills in; the rest is known when the request arrives).
``tests/test_records.py`` checks these columns against the table that the migrations make, on both backends.
"""

from __future__ import annotations

import time
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any


def _column(encoding: str = "plain", *, outcome: bool = False, default: Any = None, required: bool = False) -> Any:
    return field(default=MISSING if required else default, metadata={"column": encoding, "outcome": outcome})


@dataclass(frozen=True, slots=True)
class ExchangeRecord:
    """One served exchange (kind ``exchange``): the request, the answer, what served it, timing and tokens."""

    id: str = _column(required=True)  # the receipt
    scenario: str = _column(required=True)
    run: str | None = _column()
    created_at: float = field(default_factory=time.time, metadata={"column": "plain", "outcome": False})
    status: str = _column(outcome=True, default="complete")  # complete | incomplete | error
    format: str | None = _column()  # openai-chat | openai-responses | anthropic
    engine: str | None = _column()
    model: str | None = _column()
    release_id: str | None = _column()  # the release that served it
    content_id: str | None = _column()
    runtime_load_id: str | None = _column(outcome=True)
    request: Any = _column("json")  # the body as received
    response: Any = _column("json", outcome=True)  # the full answer (assembled from a stream); or the error
    headers: dict[str, str] | None = _column("json")  # client headers without credentials
    timings: dict[str, float | None] | None = _column("json", outcome=True)  # ttft_ms, total_ms, engine_ms
    usage: dict[str, Any] | None = _column("json", outcome=True)  # input_tokens, output_tokens (, upstream)
    prompt_token_ids: list[int] | None = _column("ints", outcome=True)  # local engines: the exact tokens
    token_ids: list[int] | None = _column("ints", outcome=True)
    logprobs: list[float] | None = _column("floats", outcome=True)  # of token_ids, as sampled
    capture: bool = _column("flag", default=True)  # False: serve-only, never trained on
    # not columns: ``request`` and ``response`` already as JSON text (what the client sent and got), stored as they
    # are instead of encoded again
    request_json: str | None = field(default=None, metadata={"as_text_of": "request"})
    response_json: str | None = field(default=None, metadata={"as_text_of": "response"})


def columns() -> list[Field[Any]]:
    """The fields of ``ExchangeRecord`` that are columns of ``records``, in order."""
    return [f for f in fields(ExchangeRecord) if "column" in f.metadata]
