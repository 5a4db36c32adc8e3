"""The record store: every served exchange and every report, durably; the logic both backends share.

The backends are ``daemon/records/sqlite.py`` (one file under ``$REEF_HOME``, the default) and
``daemon/records/postgresql.py`` (``records = "postgresql://..."``: several daemons share one store). Everything a
caller sees is written once, here: the SQL (portable, ``?`` placeholders), the write path and the guarantees. A
backend supplies connections, the few dialect fragments that differ (JSON fields, the clock) and how its driver's
errors read.

Design choices:
- A receipt is handed out only after the transaction holding its record has committed (SQLite: WAL with
  ``synchronous=FULL``; PostgreSQL: a commit with ``synchronous_commit`` on, the server's default).
- One writer thread owns the only write connection. Callers enqueue writes and await a future; the writer drains
  everything queued, runs it in one transaction (retried with a SAVEPOINT per write if one fails, so one bad
  write cannot sink the others) and commits once: group commit, so concurrent requests share an fsync instead of
  queueing behind each other, and the event loop never blocks on disk or network.
- The hand-off between the event loop and the writer is batched both ways: writes made during one iteration of
  a loop are collected in a list and handed to the writer in one queue put (one thread wake-up), and the writer
  resolves all of a commit's futures on that loop with one ``call_soon_threadsafe`` (one loop wake-up), not one
  per write. Under load the per-record cross-thread cost was most of what recording cost.
- Reads run off the event loop (``asyncio.to_thread``) on connections of their own.
- A commit that fails (disk full, I/O error, the database gone) fails every write in it with ``StorageError``
  (``RecordsUnavailable``, a 503, when the database cannot be reached); nothing is acknowledged that was not
  stored. After a failed commit the writer reopens its connection rather than retrying the same transaction
  blindly.
- Token ids are stored as packed int32 and log-probs as packed float32 (a 20k-token prompt is 80 kB, not 200 kB
  of JSON text).
- Records are never rewritten, with one exception: a stream's receipt goes out in its response headers, before
  the answer exists, so its record is opened first (``open_exchange``: the request, status ``incomplete``, NULL
  timings) and filled in once at the end (``complete_exchange``: only a row with NULL timings can be, so twice is
  refused). A ``kill -9`` or a full disk mid-stream leaves the opened record, ``incomplete``: a receipt a client
  saw always names a record. Reports are records too (kind ``report``); ``report_refs`` indexes which receipts a
  report names.
- A training lease and the consumption of receipts (``store.training``: ``daemon/records/training.py``) live in
  the store too, so
  that several daemons sharing one store agree on who trains and on what was learned from: the lease row and the
  consumption rows are what the database locks, never a lock in one process.
- The schema is versioned (``daemon/records/migrations.py``): an older store is migrated on open, a newer one
  refused (``StoreTooNew``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import random
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import orjson

from daemon import jsontext
from daemon.errors import (
    BadRequest,
    Forgotten,
    NotFound,
    RecipeConflict,
    ReefError,
    ReportConflict,
    StorageError,
    UnknownReceipts,
)
from daemon.records.conn import Conn
from daemon.records.exchange_record import ExchangeRecord
from daemon.records.exchange_record import columns as exchange_columns
from daemon.records.migrations import migrate
from daemon.records.scored import FeedbackReport, RequestSampling, ScoredExchange
from daemon.records.training import Training

T = TypeVar("T")
SAMPLING = ("temperature", "top_p", "top_k")  # the request fields that shape the sampled distribution
# how far ahead of this clock a record's date may be (another machine's clock): an import dated later is refused
# (daemon/export.py), and retention does not judge a stored one by its date (retention_due)
CLOCK_SKEW_S = 3600.0

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


def _pack_ints(values: Sequence[int] | None) -> bytes | None:
    return None if values is None else array("i", values).tobytes()


def _pack_floats(values: Sequence[float] | None) -> bytes | None:
    return None if values is None else array("f", values).tobytes()


def _unpack(blob: bytes | None, code: str) -> list[Any] | None:
    if blob is None:
        return None
    a = array(code)
    a.frombytes(blob)
    return a.tolist()


def _dumps(value: Any) -> str | None:
    """Compact JSON: orjson (a tenth of the stdlib's time on an agent's 80 kB request), the stdlib for what
    orjson refuses (integers beyond 64 bits)."""
    if value is None:
        return None
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Scenario:
    name: str
    recipe: str
    model: str
    created_at: float
    settings: dict[str, Any]
    capture: bool = True  # False: serve-only, its exchanges are never trained on
    paused: bool = False  # True: its recipe takes no step until resumed (the binding stays)
    archived: bool = False  # True: neither served nor trained; its records and chain stay readable
    # the early warning's state (daemon/gating/warning.py): None, or {state: warned | accepted | cleared, since, ...}
    warning: dict[str, Any] | None = None

    @property
    def warned(self) -> bool:
        """Whether its early warning stands: no step runs, nothing publishes, until the user acts."""
        return self.warning is not None and self.warning.get("state") == "warned"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "recipe": self.recipe,
            "model": self.model,
            "created_at": self.created_at,
            "settings": self.settings,
            "capture": self.capture,
            "paused": self.paused,
            "archived": self.archived,
            "warning": self.warning if self.warned else None,
        }


# one queued write: the function, its future (an asyncio one with its loop, or a concurrent one with None)
_Write = tuple[Callable[[Conn], Any], Any, "asyncio.AbstractEventLoop | None"]


def _resolve(group: list[tuple[Any, Any, BaseException | None]]) -> None:
    """On a loop: resolve the futures of one commit's writes (a waiter that was cancelled is skipped)."""
    for fut, value, exc in group:
        if not fut.done():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)


_RECORD_COLUMNS = (
    "seq, id, kind, scenario, run, created_at, status, format, engine, model, release_id, content_id, "
    "runtime_load_id, request, response, headers, timings, usage, prompt_token_ids, token_ids, logprobs, report, capture,"
    " forgotten_at, content_hash"
)
# what a record's bodies and tokens take stored: what an export page's size is counted in
_SIZED = ("request", "response", "prompt_token_ids", "token_ids", "logprobs")
EXPORT_PAGE_BYTES = 4 << 20
_SUMMARY_COLUMNS = (
    "seq, id, kind, scenario, run, created_at, status, format, engine, model, release_id, content_id, "
    "runtime_load_id, timings, usage, report, capture, forgotten_at"
)


_ENCODE: dict[str, Callable[[Any], Any]] = {
    "plain": lambda v: v, "json": _dumps, "ints": _pack_ints, "floats": _pack_floats,
    "flag": lambda v: 0 if v is False else 1,
}
# per column of an exchange record: its name, how it is stored, and the field holding it already as JSON text
_TEXT_OF = {f.metadata["as_text_of"]: f.name for f in fields(ExchangeRecord) if "as_text_of" in f.metadata}
_WRITE = tuple((f.name, _ENCODE[f.metadata["column"]], _TEXT_OF.get(f.name)) for f in exchange_columns())
_OUTCOME = tuple(w for w, f in zip(_WRITE, exchange_columns(), strict=True) if f.metadata["outcome"])
_EXCHANGE_COLUMNS = ", ".join(["kind", *(name for name, _, _ in _WRITE)])
_EXCHANGE_VALUES = "(" + ",".join("?" * (1 + len(_WRITE))) + ")"
_COMPLETE = (f"UPDATE records SET {', '.join(f'{name}=?' for name, _, _ in _OUTCOME)}"
             " WHERE id=? AND kind='exchange' AND timings IS NULL")
_MAX_ROWS_PER_INSERT = 256  # 21 values each: well under SQLite's limit of 32766 variables


def _values(rec: ExchangeRecord, columns: tuple[tuple[str, Callable[[Any], Any], str | None], ...]) -> list[Any]:
    """The stored values of ``columns`` of ``rec`` (JSON already encoded as text is stored as it is)."""
    out = []
    for name, encode, text_of in columns:
        text = getattr(rec, text_of) if text_of is not None else None
        out.append(text if text is not None else encode(getattr(rec, name)))
    return out


class _ExchangeRow:
    """The write of one exchange record: callable like any write, and insertable with the others of its batch in
    one statement (``RecordStore._run_batch``)."""

    __slots__ = ("row",)

    def __init__(self, row: tuple[Any, ...]) -> None:
        self.row = row

    def __call__(self, conn: Conn) -> None:
        self.insert(conn, [self.row])

    @staticmethod
    def insert(conn: Conn, rows: list[tuple[Any, ...]]) -> None:
        values = rows[0] if len(rows) == 1 else tuple(v for row in rows for v in row)
        conn.execute(f"INSERT INTO records({_EXCHANGE_COLUMNS}) VALUES {','.join([_EXCHANGE_VALUES] * len(rows))}",
                     values)


class RecordStore:
    """Durable store of scenarios, records, reports, consumption and leases. Thread-safe; async methods never
    block the loop. Abstract: ``SQLiteStore`` and ``PostgresStore`` are the backends (``open_store`` picks)."""

    dialect: ClassVar[str]
    BEGIN: ClassVar[str] = "BEGIN"
    NOW: ClassVar[str]  # SQL: the database's clock, seconds since the epoch (one clock for every daemon)
    FOR_UPDATE: ClassVar[str] = ""  # SQL: what locks the rows a SELECT read, until the transaction ends
    shared: ClassVar[bool] = False  # whether several daemons may use this store at once (then: lease to train)
    DriverError: ClassVar[type[BaseException] | tuple[type[BaseException], ...]]
    IntegrityError: ClassVar[type[BaseException]]  # what a write that breaks a constraint raises

    def __init__(self, where: str) -> None:
        self.where = where  # for messages: a path, or a URL without its password
        self._queue: queue.SimpleQueue[list[_Write] | None] = queue.SimpleQueue()
        self._queue_lock = threading.Lock()
        self._stopping = False
        self._pending: dict[asyncio.AbstractEventLoop, list[_Write]] = {}  # per loop: writes not yet handed over
        self._loops: dict[int, asyncio.AbstractEventLoop] = {}  # per thread: the loop it last wrote from
        self._scenario_cache: dict[str, Scenario] = {}
        self._writer_conn: Any = self._open_writer()
        try:
            self.schema_version = migrate(self, self._writer_conn)
        except BaseException:
            self._close_conn(self._writer_conn)
            raise
        self._thread = threading.Thread(target=self._writer_loop, name="reef-records-writer", daemon=True)
        self._thread.start()
        self.training = Training(self)  # the training lease and the consumption of receipts

    # --- what a backend supplies ---------------------------------------------------------------------------

    def _open_writer(self) -> Conn:
        """A new write connection (raises the driver's error when it cannot)."""
        raise NotImplementedError

    def _close_conn(self, conn: Any) -> None:
        try:
            conn.close()
        except Exception:  # closing a broken connection: nothing to keep
            pass

    def _failure(self, exc: BaseException) -> StorageError:
        """The ``StorageError`` that a failed commit gives every write in it."""
        return StorageError(f"record store write failed: {exc}", path=self.where)

    def _lock(self, conn: Conn) -> None:
        """Run first in every write transaction (PostgreSQL: serialises writers across daemons, see there)."""

    def _committed(self) -> None:
        """Called after each commit (SQLite: wakes the checkpointer)."""

    def _insert_exchanges(self, conn: Conn, rows: list[tuple[Any, ...]]) -> None:
        """Commit a batch made only of exchange records, the common case."""
        conn.execute(self.BEGIN)
        self._lock(conn)
        _ExchangeRow.insert(conn, rows)
        conn.execute("COMMIT")

    def json_field(self, column: str, key: str) -> str:
        """SQL: the top-level ``key`` of a JSON text column, as SQL text/number (NULL when absent or null)."""
        raise NotImplementedError

    def json_number(self, column: str, key: str) -> str:
        return self.json_field(column, key)

    def has_table(self, conn: Conn, name: str) -> bool:
        raise NotImplementedError

    async def read(self, fn: Callable[[Conn], T]) -> T:
        """Run ``fn(conn)`` on a read connection, off the event loop."""
        raise NotImplementedError

    def integrity_check(self) -> str:
        """``ok``, or what the backend's own check found wrong."""
        raise NotImplementedError

    def close(self) -> None:
        with self._queue_lock:
            self._stopping = True
            self._queue.put(None)
        self._thread.join(timeout=30)
        if self._writer_conn is not None:
            self._close_conn(self._writer_conn)

    # --- the writer ----------------------------------------------------------------------------------------

    def _writer_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = list(item)
            stop = False
            while len(batch) < 256:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.extend(nxt)
            self._run_batch(batch)
            if stop:
                return

    def _run_batch(self, batch: list[_Write]) -> None:
        conn = self._writer_conn
        if conn is None:  # the last reconnect failed (the database is away): try again, once per batch
            self._reopen_writer()
            conn = self._writer_conn
            if conn is None:
                err = self._failure(self._reopen_error or StorageError("no connection"))
                self._deliver([(fut, loop, None, err) for _, fut, loop in batch])
                return
        if len(batch) <= _MAX_ROWS_PER_INSERT and all(type(w[0]) is _ExchangeRow for w in batch):
            # the common case, only exchange records: one statement is the whole transaction (SQLite commits it
            # on its own), so the writer takes the GIL once for the batch instead of once per BEGIN, INSERT and
            # COMMIT; a failure falls through to the general path below, which reports each write's own error
            try:
                self._insert_exchanges(conn, [w[0].row for w in batch])  # type: ignore[attr-defined]
            except self.DriverError:
                self._rollback(conn)
            else:
                self._committed()
                self._deliver([(fut, loop, None, None) for _, fut, loop in batch])
                return
        try:
            results = self._apply(conn, batch, savepoints=False)
            if results is None:  # a write failed: again, each in its own savepoint, so that the others commit
                results = self._apply(conn, batch, savepoints=True)
            assert results is not None
            conn.execute("COMMIT")
            self._committed()
        except self.DriverError as e:
            err = self._failure(e)
            self._reopen_writer()
            results = [(fut, loop, None, err) for _, fut, loop in batch]
        # nothing below runs before the COMMIT above returned: a future resolves only once its write is durable
        self._deliver(results)

    def _rollback(self, conn: Conn) -> None:
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        except self.DriverError:
            pass  # a broken connection: the general path fails and reopens it

    @staticmethod
    def _deliver(results: list[tuple[Any, Any, Any, BaseException | None]]) -> None:
        """Resolve the futures of committed (or failed) writes: one ``call_soon_threadsafe`` per event loop; a
        concurrent future (``write_sync``) at once."""
        on_loops: dict[asyncio.AbstractEventLoop | None, list[tuple[Any, Any, BaseException | None]]] = {}
        for fut, loop, value, exc in results:
            on_loops.setdefault(loop, []).append((fut, value, exc))
        for loop, group in on_loops.items():
            if loop is None:
                _resolve(group)
                continue
            try:
                loop.call_soon_threadsafe(_resolve, group)
            except RuntimeError:  # that loop is closed: nobody is waiting any more
                pass

    def _apply(self, conn: Conn, batch: list[_Write], *,
               savepoints: bool) -> list[tuple[Any, Any, Any, BaseException | None]] | None:
        """Run a batch's writes in one open transaction. Without savepoints (the common case: two statements
        fewer per write) a failing write rolls everything back and gives ``None``; with them, a failing write is
        undone alone and its exception kept for its caller."""
        results: list[tuple[Any, Any, Any, BaseException | None]] = []
        conn.execute(self.BEGIN)
        self._lock(conn)
        for i, (fn, fut, loop) in enumerate(batch):
            if not savepoints:
                try:
                    results.append((fut, loop, fn(conn), None))
                except Exception:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    return None
                continue
            conn.execute(f"SAVEPOINT w{i}")
            try:
                results.append((fut, loop, fn(conn), None))
                conn.execute(f"RELEASE w{i}")
            except Exception as e:  # one bad write must not sink the batch
                conn.execute(f"ROLLBACK TO w{i}")
                conn.execute(f"RELEASE w{i}")
                results.append((fut, loop, None, e))
        return results

    _reopen_error: BaseException | None = None

    def _reopen_writer(self) -> None:
        # After a failed commit (ENOSPC, EIO, a lost connection) the state of the connection is unknown; reopen
        # instead of retrying the same transaction (SQLite recovers from the WAL/journal on open; PostgreSQL rolled
        # back whatever did not commit)
        if self._writer_conn is not None:
            self._close_conn(self._writer_conn)
            self._writer_conn = None
        try:
            self._writer_conn = self._open_writer()
            self._reopen_error = None
        except self.DriverError as e:
            self._reopen_error = e

    def _enqueue(self, writes: list[_Write]) -> bool:
        with self._queue_lock:
            if self._stopping:
                return False
            self._queue.put(writes)
            return True

    def _submit(self, fn: Callable[[Conn], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        if not self._enqueue([(fn, fut, None)]):
            fut.set_exception(StorageError("record store is closed", path=self.where))
        return fut

    async def write(self, fn: Callable[[Conn], T]) -> T:
        """Run ``fn(conn)`` inside a committed transaction; resolves once it is durable."""
        return await self.write_soon(fn)

    def write_soon(self, fn: Callable[[Conn], Any]) -> asyncio.Future[Any]:
        """``write`` without waiting for it: queued now (called on the event loop), the future resolves once the
        write is durable. Await it, or cancel it, so that a failure is not left unread."""
        loop = self._loops.get(threading.get_ident())
        if loop is None or not loop.is_running():  # a thread runs one loop at a time: a running one is this one
            loop = self._loops[threading.get_ident()] = asyncio.get_running_loop()  # (a getpid() call on 3.11)
        fut = loop.create_future()
        pending = self._pending.get(loop)
        if pending is None:  # the first write of this loop iteration: hand the batch over at the next one
            pending = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        pending.append((fn, fut, loop))
        return fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        writes = self._pending.pop(loop, None)
        if writes and not self._enqueue(writes):
            _resolve([(fut, None, StorageError("record store is closed", path=self.where))
                      for _, fut, _ in writes])

    def write_sync(self, fn: Callable[[Conn], Any]) -> Any:
        """``write`` from a thread that runs no event loop: blocks until durable."""
        return self._submit(fn).result()

    # --- scenarios -----------------------------------------------------------------------------------------

    async def ensure_scenario(self, name: str, *, recipe: str | None, model: str, default_recipe: str,
                              settings: dict[str, Any] | None = None) -> Scenario:
        """Return the scenario, creating it on first use; a different recipe for an existing one is a 409."""
        cached = self._scenario_cache.get(name)
        if cached is not None and (recipe is None or recipe == cached.recipe):
            return cached

        def op(conn: Conn) -> Scenario:
            row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO scenarios(name, recipe, model, created_at, settings) VALUES (?,?,?,?,?)",
                    (name, recipe or default_recipe, model, time.time(), _dumps(settings or {})),
                )
                row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
            return _scenario(row)

        scenario = await self.write(op)
        if recipe is not None and recipe != scenario.recipe:
            raise RecipeConflict(name, scenario.recipe, recipe)
        self._scenario_cache[name] = scenario
        return scenario

    async def change_settings(self, name: str, change: Callable[[Scenario], dict[str, Any]]) -> Scenario:
        """Replace a scenario's settings by ``change(scenario)`` (which may raise to refuse), read and written in one
        transaction, so two changes at once never lose one. The recipe binding never changes."""

        def op(conn: Conn) -> Scenario:
            row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no scenario named {name!r}", scenario=name)
            conn.execute("UPDATE scenarios SET settings=? WHERE name=?", (_dumps(change(_scenario(row))), name))
            return _scenario(conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone())

        scenario = await self.write(op)
        self._scenario_cache[name] = scenario
        return scenario

    async def change_model(self, name: str, model: str) -> Scenario:
        """Bind a scenario to another model (the caller checks that its chain holds no weights)."""

        def op(conn: Conn) -> Scenario:
            row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no scenario named {name!r}", scenario=name)
            conn.execute("UPDATE scenarios SET model=? WHERE name=?", (model, name))
            return _scenario(conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone())

        scenario = await self.write(op)
        self._scenario_cache[name] = scenario
        return scenario

    async def set_switches(self, name: str, *, capture: bool | None = None, paused: bool | None = None,
                           archived: bool | None = None) -> Scenario:
        """Turn a scenario's capture (False: serve-only from now on), its learning (paused) or its being served at
        all (archived) on or off."""

        def op(conn: Conn) -> Scenario:
            row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no scenario named {name!r}", scenario=name)
            if capture is not None:
                conn.execute("UPDATE scenarios SET capture=? WHERE name=?", (int(capture), name))
            if paused is not None:
                conn.execute("UPDATE scenarios SET paused=? WHERE name=?", (int(paused), name))
            if archived is not None:
                conn.execute("UPDATE scenarios SET archived=? WHERE name=?", (int(archived), name))
            return _scenario(conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone())

        scenario = await self.write(op)
        self._scenario_cache[name] = scenario
        return scenario

    async def set_warning(self, name: str, warning: dict[str, Any] | None) -> Scenario:
        """Write a scenario's early-warning state (``daemon/gating/warning.py``), durably: it outlives a restart."""

        def op(conn: Conn) -> Scenario:
            if conn.execute("UPDATE scenarios SET warning=? WHERE name=?",
                            (None if warning is None else _dumps(warning), name)).rowcount == 0:
                raise NotFound(f"no scenario named {name!r}", scenario=name)
            return _scenario(conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone())

        scenario = await self.write(op)
        self._scenario_cache[name] = scenario
        return scenario

    async def warned_scenarios(self) -> list[Scenario]:
        """The scenarios with an early-warning state written (standing, accepted or cleared)."""
        rows = await self.read(lambda c: c.execute("SELECT * FROM scenarios WHERE warning IS NOT NULL").fetchall())
        return [_scenario(row) for row in rows]

    async def get_scenario(self, name: str) -> Scenario:
        row = await self.read(lambda c: c.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone())
        if row is None:
            raise NotFound(f"no scenario named {name!r}", scenario=name)
        return _scenario(row)

    async def list_scenarios(self) -> list[dict[str, Any]]:
        def op(conn: Conn) -> list[dict[str, Any]]:
            rows = conn.execute(
                """SELECT s.*,
                     (SELECT COUNT(*) FROM records r WHERE r.scenario=s.name AND r.kind='exchange') AS records,
                     (SELECT COUNT(*) FROM records r WHERE r.scenario=s.name AND r.kind='exchange'
                        AND r.capture=0) AS serve_only,
                     (SELECT COUNT(*) FROM records r WHERE r.scenario=s.name AND r.kind='report') AS reports,
                     (SELECT AVG(r.score) FROM
                        (SELECT {score} AS score FROM records WHERE scenario=s.name AND kind='report'
                         AND {score} IS NOT NULL ORDER BY seq DESC LIMIT 50) r) AS mean_score
                   FROM scenarios s ORDER BY s.name""".format(score=self.json_number("report", "score"))
            ).fetchall()
            out = []
            for row in rows:
                d = _scenario(row).to_dict()
                d.update(records=row["records"], serve_only=row["serve_only"], reports=row["reports"],
                         mean_score=row["mean_score"])
                out.append(d)
            return out

        return await self.read(op)

    # --- records -------------------------------------------------------------------------------------------

    async def append_exchange(self, rec: ExchangeRecord) -> None:
        """Store one served exchange; returns once it is durable. ``request_json`` / ``response_json``, when
        given, are the request and response already as JSON text, stored as they are (not encoded again)."""
        await self.write(_ExchangeRow(self._exchange_row(rec)))

    def open_exchange(self, rec: ExchangeRecord) -> asyncio.Future[None]:
        """Store the opening of a streamed exchange (status ``incomplete``, no timings yet) so that its receipt
        can go out in the stream's headers; the future resolves once it is durable. ``complete_exchange`` fills
        it in at the end: that is the one change a record ever gets."""
        return self.write_soon(_ExchangeRow(self._exchange_row(replace(rec, status="incomplete", timings=None))))

    async def complete_exchange(self, rec: ExchangeRecord) -> None:
        """Fill in an exchange opened with ``open_exchange``: its outcome (the fields marked ``outcome``: status,
        response, timings, usage, tokens), once; the request and everything known at the start stay as they were
        written. Returns once it is durable."""
        if rec.timings is None:  # never NULL once complete: NULL timings mark an open record
            rec = replace(rec, timings={})
        values = (*_values(rec, _OUTCOME), rec.id)

        def op(conn: Conn) -> None:
            cur = conn.execute(_COMPLETE, values)
            if cur.rowcount != 1:
                raise ReefError(f"exchange {rec.id} is not open: it was completed already or never opened")

        await self.write(op)

    @staticmethod
    def _exchange_row(rec: ExchangeRecord) -> tuple[Any, ...]:
        return ("exchange", *_values(rec, _WRITE))

    async def get_record(self, receipt: str, *, full: bool = True) -> dict[str, Any]:
        def op(conn: Conn) -> dict[str, Any] | None:
            row = conn.execute(
                f"SELECT {_RECORD_COLUMNS if full else _SUMMARY_COLUMNS} FROM records WHERE id=?", (receipt,)
            ).fetchone()
            if row is None:
                return None
            rec = _record(row)
            rec["reports"] = [
                _record(r)
                for r in conn.execute(
                    f"SELECT {_SUMMARY_COLUMNS} FROM records WHERE id IN "
                    "(SELECT report_id FROM report_refs WHERE receipt=?) ORDER BY seq",
                    (receipt,),
                ).fetchall()
            ]
            return rec

        rec = await self.read(op)
        if rec is None:
            raise NotFound(f"no record with receipt {receipt!r}", receipt=receipt)
        return rec

    async def trace_headers(self, receipts: list[str]) -> dict[str, dict[str, str]]:
        """The W3C trace headers (``traceparent``, ``tracestate``) the clients of these exchanges sent, from their
        recorded headers: receipt -> the headers it has (receipts with neither, or unknown, left out). What the
        span of a report reads to link to exchange spans that joined their clients' traces (daemon/telemetry.py)."""
        parent, state = self.json_field("headers", "traceparent"), self.json_field("headers", "tracestate")

        def op(conn: Conn) -> dict[str, dict[str, str]]:
            out: dict[str, dict[str, str]] = {}
            for i in range(0, len(receipts), 500):
                chunk = receipts[i:i + 500]
                rows = conn.execute(
                    f"SELECT id, {parent} AS traceparent, {state} AS tracestate FROM records"
                    f" WHERE kind='exchange' AND id IN ({','.join('?' * len(chunk))})", chunk).fetchall()
                for row in rows:
                    got = {k: row[k] for k in ("traceparent", "tracestate") if isinstance(row[k], str)}
                    if got:
                        out[row["id"]] = got
            return out

        return await self.read(op)

    async def list_records(
        self,
        *,
        scenario: str | None = None,
        run: str | None = None,
        after: int | None = None,
        limit: int = 50,
        kind: str | None = None,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]:
        clauses, args = [], []
        for col, val in (("scenario", scenario), ("run", run), ("kind", kind)):
            if val is not None:
                clauses.append(f"{col}=?")
                args.append(val)
        if after is not None:
            clauses.append("seq>?")
            args.append(after)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        order = "DESC" if newest_first else "ASC"
        sql = f"SELECT {_SUMMARY_COLUMNS} FROM records {where} ORDER BY seq {order} LIMIT ?"
        args.append(limit)

        def op(conn: Conn) -> list[dict[str, Any]]:
            out = [_record(r) for r in conn.execute(sql, args).fetchall()]
            ids = [r["id"] for r in out if r["kind"] == "exchange"]
            if ids:
                marks = ",".join("?" * len(ids))
                scores: dict[str, Any] = {}
                for r in conn.execute(
                    f"SELECT rr.receipt, rec.report FROM report_refs rr JOIN records rec ON rec.id=rr.report_id "
                    f"WHERE rr.receipt IN ({marks}) ORDER BY rec.seq",
                    ids,
                ).fetchall():
                    scores[r["receipt"]] = json.loads(r["report"])
                for rec in out:
                    if rec["id"] in scores:
                        last = scores[rec["id"]]
                        rec["score"] = last.get("score")
                        rec["feedback"] = last.get("feedback")
            return out

        return await self.read(op)

    async def count(self) -> dict[str, int]:
        def op(conn: Conn) -> dict[str, int]:
            return {
                r["kind"]: r["n"] for r in conn.execute("SELECT kind, COUNT(*) AS n FROM records GROUP BY kind")
            }

        return await self.read(op)

    # --- reports -------------------------------------------------------------------------------------------

    async def append_report(
        self,
        *,
        scenario: str | None,
        score: float | None,
        feedback: Any,
        references: list[str],
        metadata: Any,
        report_id: str | None,
    ) -> dict[str, Any]:
        """Store a report on receipts; idempotent on ``report_id``. Returns the stored report record."""
        body = {"score": score, "feedback": feedback, "references": references, "metadata": metadata}
        digest = hashlib.sha256(
            json.dumps({**body, "scenario": scenario}, sort_keys=True, ensure_ascii=False).encode()
        ).hexdigest()

        def op(conn: Conn) -> dict[str, Any]:
            if report_id is not None:
                prior = conn.execute(
                    f"SELECT {_SUMMARY_COLUMNS}, report_hash FROM records WHERE report_key=?", (report_id,)
                ).fetchone()
                if prior is not None:
                    if prior["report_hash"] != digest:
                        raise ReportConflict(
                            f"report_id {report_id!r} was already used with a different body", report_id=report_id
                        )
                    return _record(prior)
            marks = ",".join("?" * len(references))
            rows = [] if not references else conn.execute(
                f"SELECT id, scenario, forgotten_at FROM records WHERE kind='exchange' AND id IN ({marks})", references
            ).fetchall()
            found = {r["id"]: r["scenario"] for r in rows}
            missing = [r for r in references if r not in found]
            scen = scenario or (found[references[0]] if found else None)
            foreign = [r for r, s in found.items() if s != scen]
            if missing or foreign:
                raise UnknownReceipts(missing + foreign, scen)
            forgotten = [r["id"] for r in rows if r["forgotten_at"] is not None]
            if forgotten:
                raise Forgotten(forgotten)
            rid = new_id("rep_")
            now = time.time()
            conn.execute(
                "INSERT INTO records(id, kind, scenario, created_at, status, report, report_key, report_hash)"
                " VALUES (?,?,?,?,?,?,?,?)",
                (rid, "report", scen, now, "complete", _dumps(body), report_id, digest),
            )
            conn.executemany(
                "INSERT INTO report_refs(report_id, receipt) VALUES (?,?) ON CONFLICT DO NOTHING", [(rid, r) for r in references]
            )
            row = conn.execute(f"SELECT {_SUMMARY_COLUMNS} FROM records WHERE id=?", (rid,)).fetchone()
            return _record(row)

        if not references and not (scenario and isinstance(metadata, dict) and metadata.get("kind") == "instruction"):
            raise BadRequest("references must name at least one receipt", param="references")
        return await self.write(op)

    async def scored_exchanges(self, scenario: str, *, after: int = 0) -> tuple[list[ScoredExchange], int]:
        """Exchanges of a scenario scored by reports newer than report seq ``after``, in report order (an exchange
        scored again comes again, with its new report), and the seq of the last report read (``after`` when there
        is none): what learning recipes train on, read a little at a time. Only captured, complete exchanges whose
        prompt tokens, answer tokens and log-probs were all recorded (local engines) are scored exchanges."""

        score = self.json_number("rep.report", "score")
        sampling = self._sampling_columns("r.request")

        def op(conn: Conn) -> tuple[list[ScoredExchange], int]:
            rows = conn.execute(
                f"""SELECT r.id, r.release_id, r.prompt_token_ids, r.token_ids, r.logprobs, {sampling},
                          rep.id AS report_id, rep.report, rep.seq AS report_seq, rep.created_at AS report_created_at
                   FROM records rep
                   JOIN report_refs rr ON rr.report_id = rep.id
                   JOIN records r ON r.id = rr.receipt
                   WHERE rep.kind = 'report' AND rep.seq > ? AND r.scenario = ? AND r.kind = 'exchange'
                     AND r.status = 'complete' AND r.capture = 1 AND r.token_ids IS NOT NULL
                     AND r.prompt_token_ids IS NOT NULL AND r.logprobs IS NOT NULL
                     AND {score} IS NOT NULL
                   ORDER BY rep.seq""",
                (after, scenario),
            ).fetchall()
            out = []
            for row in rows:
                report = json.loads(row["report"])
                if not training_eligible(report):
                    continue
                out.append(ScoredExchange(
                    id=row["id"],
                    release_id=row["release_id"],
                    prompt_token_ids=_unpack(row["prompt_token_ids"], "i") or [],
                    token_ids=_unpack(row["token_ids"], "i") or [],
                    logprobs=_unpack(row["logprobs"], "f") or [],
                    report=FeedbackReport.from_stored(id=row["report_id"], seq=row["report_seq"], body=report,
                                                      scenario=scenario, created_at=row["report_created_at"]),
                    sampling=RequestSampling.from_mapping({k: row[k] for k in SAMPLING}),
                ))
            return out, (rows[-1]["report_seq"] if rows else after)

        return await self.read(op)

    def _sampling_columns(self, request: str) -> str:
        return ", ".join(f"{self.json_number(request, k)} AS {k}" for k in SAMPLING)

    async def scored_sampling(self, scenario: str) -> list[dict[str, Any]]:
        """The sampling settings of a scenario's scored, captured exchanges, with how many were served with each
        (what a recipe trained on behaviour log-probs can use, and what it leaves out)."""
        sampling = self._sampling_columns("r.request")

        def op(conn: Conn) -> list[dict[str, Any]]:
            rows = conn.execute(
                f"""SELECT {", ".join(SAMPLING)}, COUNT(*) AS n FROM (
                      SELECT {sampling} FROM records r
                      WHERE r.scenario = ? AND r.kind = 'exchange' AND r.status = 'complete' AND r.capture = 1
                        AND r.token_ids IS NOT NULL AND r.prompt_token_ids IS NOT NULL AND r.logprobs IS NOT NULL
                        AND EXISTS (SELECT 1 FROM report_refs rr WHERE rr.receipt = r.id)) s
                   GROUP BY {", ".join(SAMPLING)}""",
                (scenario,),
            ).fetchall()
            return [{**{k: row[k] for k in SAMPLING}, "n": int(row["n"])} for row in rows]

        return await self.read(op)

    # --- canaries ------------------------------------------------------------------------------------------

    async def start_canary(self, scenario: str, release_id: str, base_id: str, share: float,
                           settings: dict[str, Any]) -> dict[str, Any]:
        """Store a scenario's canary (one at a time: a second is a ``Conflict``)."""
        from daemon.errors import Conflict

        def op(conn: Conn) -> dict[str, Any]:
            if conn.execute("SELECT 1 FROM canaries WHERE scenario=?", (scenario,)).fetchone():
                raise Conflict(f"scenario {scenario!r} already has a canary; end it first "
                               "(reef releases canary-end)", scenario=scenario)
            conn.execute("INSERT INTO canaries(scenario, release_id, base_id, share, started_at, settings)"
                         " VALUES (?,?,?,?,?,?)", (scenario, release_id, base_id, share, time.time(),
                                                    _dumps(settings)))
            return _canary(conn.execute("SELECT * FROM canaries WHERE scenario=?", (scenario,)).fetchone())

        return await self.write(op)

    async def canaries(self) -> list[dict[str, Any]]:
        rows = await self.read(lambda c: c.execute("SELECT * FROM canaries ORDER BY scenario").fetchall())
        return [_canary(r) for r in rows]

    async def end_canary(self, scenario: str, release_id: str) -> None:
        await self.write(lambda c: c.execute("DELETE FROM canaries WHERE scenario=? AND release_id=?",
                                             (scenario, release_id)))

    async def arm_outcomes(self, scenario: str, since: float, arms: tuple[str, str]) -> dict[str, Any]:
        """For each arm (a release id): the scores of the reports on its exchanges since ``since`` (one per report),
        its exchanges, how many of them failed, and the times (``ms``) and answer lengths in tokens (``tokens``) of
        the complete ones."""
        total_ms = self.json_number("timings", "total_ms")
        out_tokens = self.json_number("usage", "output_tokens")

        def op(conn: Conn) -> dict[str, Any]:
            out: dict[str, Any] = {a: {"scores": [], "exchanges": 0, "errors": 0, "ms": [], "tokens": []}
                                   for a in arms}
            for r in conn.execute(
                    f"SELECT release_id, {total_ms} AS ms, {out_tokens} AS tokens FROM records WHERE scenario=?"
                    " AND kind='exchange' AND created_at>=? AND release_id IN (?,?) AND status='complete'",
                    (scenario, since, *arms)).fetchall():
                if r["ms"] is not None:
                    out[r["release_id"]]["ms"].append(float(r["ms"]))
                if r["tokens"] is not None:
                    out[r["release_id"]]["tokens"].append(int(r["tokens"]))
            for r in conn.execute(
                    "SELECT release_id, status, COUNT(*) AS n FROM records WHERE scenario=? AND kind='exchange'"
                    " AND created_at>=? AND release_id IN (?,?) GROUP BY release_id, status",
                    (scenario, since, *arms)).fetchall():
                out[r["release_id"]]["exchanges"] += r["n"]
                if r["status"] == "error":
                    out[r["release_id"]]["errors"] += r["n"]
            for r in conn.execute(  # one score per report and arm: a run's report names all its exchanges
                    "SELECT DISTINCT e.release_id, rep.id, rep.seq, rep.report FROM records e JOIN report_refs rr"
                    " ON rr.receipt = e.id JOIN records rep ON rep.id = rr.report_id WHERE e.scenario=?"
                    " AND e.kind='exchange' AND e.created_at>=? AND e.release_id IN (?,?) ORDER BY rep.seq",
                    (scenario, since, *arms)).fetchall():
                score = json.loads(r["report"]).get("score")
                if isinstance(score, (int, float)) and not isinstance(score, bool):
                    out[r["release_id"]]["scores"].append(float(score))
            return out

        return await self.read(op)

    # --- export and import ---------------------------------------------------------------------------------

    async def export_page(self, *, scenario: str | None, since: float | None, after: int, limit: int = 500,
                          max_bytes: int = EXPORT_PAGE_BYTES) -> tuple[list[dict[str, Any]], int | None]:
        """Exchange records (bodies and reports) after seq ``after``, oldest first: at most ``limit``, and no more
        once they hold ``max_bytes`` of stored bodies and tokens (at least one, however big), so that a page of
        big records is as small in memory as one of small ones; and the seq to continue after (None: no more).
        Rows are taken one at a time (SQLite reads each once; its ``length()`` of TEXT reads it all)."""

        def op(conn: Conn) -> tuple[list[dict[str, Any]], int | None]:
            clauses, args = ["kind='exchange'", "seq>?"], [after]
            if scenario is not None:
                clauses.append("scenario=?")
                args.append(scenario)
            if since is not None:
                clauses.append("created_at>=?")
                args.append(since)
            cur = conn.execute(f"SELECT {_RECORD_COLUMNS} FROM records WHERE {' AND '.join(clauses)}"
                               f" ORDER BY seq LIMIT ?", (*args, limit))
            rows, total, full = [], 0, False
            while (row := cur.fetchone()) is not None:
                rows.append(row)
                total += sum(len(row[c]) for c in _SIZED if row[c] is not None)
                if total >= max_bytes:
                    full = True
                    break
            if full and hasattr(cur, "close"):
                cur.close()
            out = [_record(r) for r in rows]
            by_id = {r["id"]: r for r in out}
            for r in out:
                r["reports"] = []
            if by_id:
                for r in conn.execute(
                        f"SELECT rr.receipt, {_SUMMARY_COLUMNS} FROM report_refs rr JOIN records ON records.id ="
                        f" rr.report_id WHERE rr.receipt IN ({','.join('?' * len(by_id))}) ORDER BY records.seq",
                        list(by_id)).fetchall():
                    rep = _record(r)
                    by_id[rep.pop("receipt")]["reports"].append(rep)
            more = full or len(rows) == limit
            return out, (out[-1]["seq"] if out and more else None)

        return await self.read(op)

    async def import_exchanges(self, items: list[dict[str, Any]]) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """Store imported exchanges (``daemon/export.from_line``'s records and reports) in one transaction:
        those whose id is stored already are skipped (a re-import changes nothing). Returns the counts
        (``imported``, ``skipped``, ``reports``) and the reports stored (``id``, ``scenario`` and the report's
        body): ``daemon.reports.accept_imports`` counts and announces them. A report key (``import:<receipt>``)
        another report holds already refuses the batch (``ReportConflict`` naming the item), nothing stored."""

        def op(conn: Conn) -> tuple[dict[str, int], list[dict[str, Any]]]:
            ids = [it["record"].id for it in items]
            have: set[str] = set()
            for chunk in _chunks(ids):
                have |= {r["id"] for r in conn.execute(
                    f"SELECT id FROM records WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall()}
            rows, seen = [], set(have)
            for i, it in enumerate(items):  # the same id twice in one batch: the first one
                if it["record"].id not in seen:
                    seen.add(it["record"].id)
                    rows.append((i, it))
            keys = [rep["report_id"] for _, it in rows for rep in it["reports"]]
            taken: set[str] = set()
            for chunk in _chunks(keys):  # a client's report_id from before such ids were refused at /reef/report
                taken |= {r["report_key"] for r in conn.execute(
                    f"SELECT report_key FROM records WHERE report_key IN ({','.join('?' * len(chunk))})",
                    chunk).fetchall()}
            for i, it in rows:
                for key in (rep["report_id"] for rep in it["reports"] if rep["report_id"] in taken):
                    raise ReportConflict(f"items[{i}]: the report of imported exchange {it['record'].id} would be "
                                         f"stored as report_id {key!r}, which another report holds: import it under "
                                         "another id", report_id=key, param=f"items[{i}].id")
            for _, it in rows:
                _ExchangeRow(self._exchange_row(it["record"]))(conn)
            reports: list[dict[str, Any]] = []
            for _, it in rows:
                rec = it["record"]
                for rep in it["reports"]:
                    body = {"score": rep["score"], "feedback": rep["feedback"], "references": [rec.id],
                            "metadata": {"imported": True, **({"source": rep["source"]} if rep["source"] else {})}}
                    digest = hashlib.sha256(json.dumps({**body, "scenario": rec.scenario}, sort_keys=True,
                                                       ensure_ascii=False).encode()).hexdigest()
                    rid = new_id("rep_")
                    conn.execute("INSERT INTO records(id, kind, scenario, created_at, status, report, report_key,"
                                 " report_hash) VALUES (?,?,?,?,?,?,?,?)",
                                 (rid, "report", rec.scenario, time.time(), "complete", _dumps(body),
                                  rep["report_id"], digest))
                    conn.execute("INSERT INTO report_refs(report_id, receipt) VALUES (?,?)", (rid, rec.id))
                    reports.append({"id": rid, "scenario": rec.scenario, **body})
            return {"imported": len(rows), "skipped": len(items) - len(rows), "reports": len(reports)}, reports

        return await self.write(op)

    # --- forgetting ----------------------------------------------------------------------------------------

    async def forget(self, *, receipts: list[str], runs: list[str], scrub: bool = False) -> dict[str, Any]:
        """Delete the bodies of these exchanges (and every exchange of these runs): request, answer, headers and
        token ids, and the feedback and metadata of the reports on them, in one transaction (all or nothing).
        What stays is a tombstone: the record's id, scenario, run, release, timings, the time it was forgotten and
        the SHA-256 of the deleted bodies (``content_hash``); a report keeps its score, references and
        ``report_hash``, so a retried report still conflicts as before. Then the backend clears what would still
        hold the bytes (``_scrub``; ``scrub``: PostgreSQL rewrites the table). Returns what was forgotten."""
        receipts, runs = list(dict.fromkeys(receipts)), list(dict.fromkeys(runs))

        def op(conn: Conn) -> dict[str, Any]:
            found: dict[str, Any] = {}
            for col, values in (("id", receipts), ("run", runs)):
                for chunk in _chunks(values):
                    for r in conn.execute(f"SELECT id, scenario, run, forgotten_at FROM records WHERE kind='exchange'"
                                          f" AND {col} IN ({','.join('?' * len(chunk))})", chunk).fetchall():
                        found[r["id"]] = r
            missing = [r for r in receipts if r not in found]
            if missing:
                raise UnknownReceipts(missing)
            unknown_runs = [r for r in runs if not any(row["run"] == r for row in found.values())]
            if unknown_runs:
                raise NotFound(f"no exchanges in runs: {', '.join(unknown_runs)}", runs=unknown_runs)
            todo = [rid for rid, r in found.items() if r["forgotten_at"] is None]
            now, reports = time.time(), set()
            for chunk in _chunks(todo):
                marks = ",".join("?" * len(chunk))
                bodies = conn.execute(f"SELECT id, request, response FROM records WHERE id IN ({marks})", chunk)
                conn.executemany(
                    "UPDATE records SET request=NULL, response=NULL, headers=NULL, prompt_token_ids=NULL,"
                    " token_ids=NULL, logprobs=NULL, forgotten_at=?, content_hash=? WHERE id=?",
                    [(now, _content_hash(b["request"], b["response"]), b["id"]) for b in bodies.fetchall()])
                for r in conn.execute(f"SELECT rep.id, rep.report FROM records rep JOIN report_refs rr"
                                      f" ON rr.report_id = rep.id WHERE rr.receipt IN ({marks})", chunk).fetchall():
                    if r["id"] not in reports:
                        reports.add(r["id"])
                        kept = {k: v for k, v in json.loads(r["report"]).items() if k in ("score", "references")}
                        conn.execute("UPDATE records SET report=? WHERE id=?", (_dumps({**kept, "forgotten": True}),
                                                                              r["id"]))
            scenarios = sorted({found[rid]["scenario"] for rid in todo})
            return {"forgotten": todo, "already": [rid for rid in found if rid not in todo], "reports": len(reports),
                    "scenarios": scenarios, "runs": sorted({r["run"] for r in found.values() if r["run"]})}

        out = await self.write(op)
        out["remains"] = await asyncio.to_thread(self._scrub, scrub)
        return out

    def _scrub(self, full: bool) -> str:
        """After a forget: clear what still holds the deleted bytes (a WAL, free pages, old row versions) and say
        in a sentence what may remain where."""
        raise NotImplementedError

    async def retention_due(self, *, before: float | None, max_bytes: int | None, limit: int = 10_000) -> list[str]:
        """Exchanges the retention settings forget now, oldest first: created before ``before``, and the oldest
        while the bodies kept (request and answer, newest first) add up to more than ``max_bytes``. A stream still
        open (opened, not completed, younger than an hour) is left for the next round. Under ``before``, a record
        dated more than ``CLOCK_SKEW_S`` ahead (a time in milliseconds, a clock ahead: imports refuse such dates
        now) is due too: its age cannot be told from its date, and kept by it, it would never be."""

        def op(conn: Conn) -> list[str]:
            now = time.time()
            live = ("kind='exchange' AND forgotten_at IS NULL"
                    " AND NOT (status='incomplete' AND timings IS NULL AND created_at > ? AND created_at < ?)")
            open_window = (now - 3600, now + CLOCK_SKEW_S)
            due: list[str] = []
            if before is not None:
                due += [r["id"] for r in conn.execute(
                    f"SELECT id FROM records WHERE {live} AND (created_at < ? OR created_at > ?) ORDER BY seq LIMIT ?",
                    (*open_window, before, now + CLOCK_SKEW_S, limit)).fetchall()]
            if max_bytes is not None and len(due) < limit:
                kept, over = 0, []
                for r in conn.execute(f"SELECT id, COALESCE(LENGTH(request), 0) + COALESCE(LENGTH(response), 0) AS n"
                                      f" FROM records WHERE {live} ORDER BY seq DESC", open_window):
                    kept += r["n"]
                    if kept > max_bytes:
                        over.append(r["id"])
                seen = set(due)
                due += [rid for rid in reversed(over) if rid not in seen][: limit - len(due)]
            return due

        return await self.read(op)

    async def forgotten(self, scenario: str) -> set[str]:
        """The receipts of a scenario that were forgotten."""
        rows = await self.read(lambda c: c.execute(
            "SELECT id FROM records WHERE scenario=? AND kind='exchange' AND forgotten_at IS NOT NULL",
            (scenario,)).fetchall())
        return {r["id"] for r in rows}

    async def feedback_reports(self, scenario: str, *, after: int = 0) -> tuple[list[FeedbackReport], int]:
        """Reports on a scenario that carry written feedback, newer than seq ``after``, oldest first, and the seq
        of the last one (``after`` when there is none): what harness recipes learn from."""

        feedback = self.json_field("report", "feedback")

        def op(conn: Conn) -> tuple[list[FeedbackReport], int]:
            rows = conn.execute(
                f"""SELECT seq, id, scenario, created_at, report FROM records rep
                    WHERE kind = 'report' AND scenario = ? AND seq > ? AND {feedback} IS NOT NULL
                      AND NOT EXISTS (SELECT 1 FROM report_refs rr JOIN records r ON r.id = rr.receipt
                                      WHERE rr.report_id = rep.id AND r.capture = 0)
                    ORDER BY seq""",
                (scenario, after),
            ).fetchall()
            out = []
            for row in rows:
                body = json.loads(row["report"])
                if training_eligible(body):
                    out.append(FeedbackReport.from_stored(id=row["id"], seq=row["seq"], body=body,
                                                          scenario=row["scenario"], created_at=row["created_at"]))
            return out, (rows[-1]["seq"] if rows else after)

        return await self.read(op)


def _canary(row: Any) -> dict[str, Any]:
    return {"scenario": row["scenario"], "release_id": row["release_id"], "base_id": row["base_id"],
            "share": row["share"], "started_at": row["started_at"], "settings": json.loads(row["settings"])}


def _chunks(values: list[str], size: int = 500) -> Iterator[list[str]]:
    for i in range(0, len(values), size):
        yield values[i:i + size]


def _content_hash(request: Any, response: Any) -> str:
    h = hashlib.sha256()
    for part in (request, response):
        data = part if isinstance(part, bytes) else (part or "").encode()
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def training_eligible(report: Any) -> bool:
    """Whether a stored report may be trained on: not when its ``metadata.training.eligible`` is false."""
    metadata = report.get("metadata") if isinstance(report, dict) else None
    training = metadata.get("training") if isinstance(metadata, dict) else None
    return not (isinstance(training, dict) and training.get("eligible") is False)


def _scenario(row: Any) -> Scenario:
    return Scenario(
        name=row["name"],
        recipe=row["recipe"],
        model=row["model"],
        created_at=row["created_at"],
        settings=json.loads(row["settings"] or "{}"),
        capture=bool(row["capture"]),
        paused=bool(row["paused"]),
        archived=bool(row["archived"]),
        warning=json.loads(row["warning"]) if row["warning"] else None,
    )


def _record(row: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in row.keys():
        value = row[key]
        if key in ("request", "response", "headers", "timings", "usage", "report") and value is not None:
            value = jsontext.loads(value)  # a big body in short pieces: reads run in threads beside the loop
        elif key in ("prompt_token_ids", "token_ids"):
            value = _unpack(value, "i")
        elif key == "logprobs":
            value = _unpack(value, "f")
        elif key == "report_hash":
            continue
        elif key in ("capture", "forgotten_at", "content_hash"):
            if row["kind"] != "exchange":
                continue
            if key == "capture":
                value = bool(value)
        out[key] = value
    return out


def ensure_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
