"""How records are stored as rows and read back, for every part of the record store (``daemon/records/``).

Ids, JSON text, packed token ids and log-probs, the column lists of a record, the write of an exchange record
(``ExchangeRow``, which the writer batches) and ``RecordRow``: a record as a read gives it back.

Design choices:
- Token ids are stored as packed int32 and log-probs as packed float32 (a 20k-token prompt is 80 kB, not 200 kB
  of JSON text).
- A read hands a record back as ``RecordRow``, the JSON-shaped dict that ``/reef/records/{receipt}``, an export
  and a recipe's ``context.record`` give out as it is: a ``TypedDict`` names its keys for the type checker without
  a second shape to convert to.
"""

from __future__ import annotations

import json
import os
import random
import time
from array import array
from collections.abc import Callable, Iterator, Sequence, Sized
from dataclasses import fields
from typing import Any, Required, TypedDict, cast

import orjson

from daemon import jsontext
from daemon.records.conn import Conn
from daemon.records.exchange_record import ExchangeRecord
from daemon.records.exchange_record import columns as exchange_columns

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]  # 10 bits -> 2 characters
_SHIFTS = tuple(range(120, -1, -10))

# ids need to be unique, not secret (the token guards the API): a generator seeded from the OS once, and again
# in a forked child, instead of a getrandom system call per id
_random = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _random.seed(os.urandom(32)))


def new_id(prefix: str) -> str:
    """Time-sortable id: 48-bit milliseconds + 80 random bits, Crockford base32 (ULID layout)."""
    n = (int(time.time() * 1000) << 80) | _random.getrandbits(80)
    return prefix + "".join([_PAIRS[(n >> s) & 1023] for s in _SHIFTS])


def pack_ints(values: Sequence[int] | None) -> bytes | None:
    return None if values is None else array("i", values).tobytes()


def pack_floats(values: Sequence[float] | None) -> bytes | None:
    return None if values is None else array("f", values).tobytes()


def unpack(blob: bytes | None, code: str) -> list[Any] | None:
    if blob is None:
        return None
    a = array(code)
    a.frombytes(blob)
    return a.tolist()


def dumps(value: Any) -> str | None:
    """Compact JSON: orjson (a tenth of the stdlib's time on an agent's 80 kB request), the stdlib for what
    orjson refuses (integers beyond 64 bits)."""
    if value is None:
        return None
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def chunks(values: list[str], size: int = 500) -> Iterator[list[str]]:
    """``values`` in pieces small enough for one ``IN (...)`` each."""
    for i in range(0, len(values), size):
        yield values[i:i + size]


def marks(values: Sized) -> str:
    """The placeholders of an ``IN (...)`` of ``values``."""
    return ",".join("?" * len(values))


RECORD_COLUMNS = (
    "seq, id, kind, scenario, run, created_at, status, format, engine, model, release_id, content_id, "
    "runtime_load_id, request, response, headers, timings, usage, prompt_token_ids, token_ids, logprobs, report, capture,"
    " forgotten_at, content_hash"
)
SUMMARY_COLUMNS = (  # a record without its bodies and tokens
    "seq, id, kind, scenario, run, created_at, status, format, engine, model, release_id, content_id, "
    "runtime_load_id, timings, usage, report, capture, forgotten_at"
)
SIZED = ("request", "response", "prompt_token_ids", "token_ids", "logprobs")  # what an export page's size counts


class RecordRow(TypedDict, total=False):
    """A record as a read gives it back (kind ``exchange`` or ``report``), JSON-shaped. A summary
    (``full=False``, a listing) leaves out the bodies and tokens (``request`` to ``logprobs``, ``content_hash``);
    ``capture``, ``forgotten_at`` and ``content_hash`` are an exchange's only."""

    seq: Required[int]
    id: Required[str]  # the receipt (``rec_...``), or a report's id (``rep_...``)
    kind: Required[str]  # exchange | report
    scenario: Required[str | None]
    run: str | None
    created_at: float
    status: str  # complete | incomplete | error
    format: str | None
    engine: str | None
    model: str | None
    release_id: str | None
    content_id: str | None
    runtime_load_id: str | None
    request: Any
    response: Any
    headers: dict[str, str] | None
    timings: dict[str, Any] | None
    usage: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    logprobs: list[float] | None
    report: Any  # a report's body: {score, feedback, references, metadata}
    capture: bool
    forgotten_at: float | None
    content_hash: str | None
    reports: list[RecordRow]  # the reports on an exchange, as summaries (a record read by its receipt, an export)
    score: Any  # in a listing: the latest report's score and feedback on an exchange
    feedback: Any


def record(row: Any) -> RecordRow:
    """A stored row as a ``RecordRow`` (a joined ``receipt`` column, and the report hash, left out)."""
    out: dict[str, Any] = {}
    for key in row.keys():
        value = row[key]
        if key in ("request", "response", "headers", "timings", "usage", "report") and value is not None:
            value = jsontext.loads(value)  # a big body in short pieces: reads run in threads beside the loop
        elif key in ("prompt_token_ids", "token_ids"):
            value = unpack(value, "i")
        elif key == "logprobs":
            value = unpack(value, "f")
        elif key in ("report_hash", "receipt"):
            continue
        elif key in ("capture", "forgotten_at", "content_hash"):
            if row["kind"] != "exchange":
                continue
            if key == "capture":
                value = bool(value)
        out[key] = value
    return cast(RecordRow, out)


# --- writing an exchange record -------------------------------------------------------------------------------

_ENCODE: dict[str, Callable[[Any], Any]] = {
    "plain": lambda v: v, "json": dumps, "ints": pack_ints, "floats": pack_floats,
    "flag": lambda v: 0 if v is False else 1,
}
# per column of an exchange record: its name, how it is stored, and the field holding it already as JSON text
_TEXT_OF = {f.metadata["as_text_of"]: f.name for f in fields(ExchangeRecord) if "as_text_of" in f.metadata}
_Columns = tuple[tuple[str, Callable[[Any], Any], str | None], ...]
_WRITE: _Columns = tuple((f.name, _ENCODE[f.metadata["column"]], _TEXT_OF.get(f.name)) for f in exchange_columns())
OUTCOME: _Columns = tuple(w for w, f in zip(_WRITE, exchange_columns(), strict=True) if f.metadata["outcome"])
_EXCHANGE_COLUMNS = ", ".join(["kind", *(name for name, _, _ in _WRITE)])
_EXCHANGE_VALUES = "(" + ",".join("?" * (1 + len(_WRITE))) + ")"
MAX_ROWS_PER_INSERT = 256  # 21 values each: well under SQLite's limit of 32766 variables


def values(rec: ExchangeRecord, columns: _Columns) -> list[Any]:
    """The stored values of ``columns`` of ``rec`` (JSON already encoded as text is stored as it is)."""
    out = []
    for name, encode, text_of in columns:
        text = getattr(rec, text_of) if text_of is not None else None
        out.append(text if text is not None else encode(getattr(rec, name)))
    return out


class ExchangeRow:
    """The write of one exchange record: callable like any write, and insertable with the others of its batch in
    one statement (``RecordStore._run_batch``)."""

    __slots__ = ("row",)

    def __init__(self, rec: ExchangeRecord) -> None:
        self.row: tuple[Any, ...] = ("exchange", *values(rec, _WRITE))

    def __call__(self, conn: Conn) -> None:
        self.insert(conn, [self.row])

    @staticmethod
    def insert(conn: Conn, rows: list[tuple[Any, ...]]) -> None:
        values = rows[0] if len(rows) == 1 else tuple(v for row in rows for v in row)
        conn.execute(f"INSERT INTO records({_EXCHANGE_COLUMNS}) VALUES {','.join([_EXCHANGE_VALUES] * len(rows))}",
                     values)
