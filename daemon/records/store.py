"""The record store: every served exchange and every report, durably; the writer both backends share, and the
parts it holds by concern.

The backends are ``daemon/records/sqlite.py`` (one file under ``$REEF_HOME``, the default) and
``daemon/records/postgresql.py`` (``records = "postgresql://..."``: several daemons share one store). Everything a
caller sees is written once, in this package: the SQL (portable, ``?`` placeholders), the write path and the
guarantees. A backend supplies connections, the few dialect fragments that differ (JSON fields, the clock) and how
its driver's errors read.

The store holds its parts as attributes, each a module of its own that reaches the database through the store's
writer and reads (``daemon.records.conn.Rows``):
- ``store.scenarios`` (``daemon/records/scenarios.py``): scenarios, their settings, switches and warnings;
- ``store.exchanges`` (``daemon/records/exchanges.py``): served exchanges, opened, completed, read, listed;
- ``store.reports`` (``daemon/records/reports.py``): reports, and the scored exchanges and feedback learning reads;
- ``store.training`` (``daemon/records/training.py``): the training lease and the consumption of receipts, so that
  several daemons sharing one store agree on who trains and on what was learned from (the lease row and the
  consumption rows are what the database locks, never a lock in one process);
- ``store.user_data`` (``daemon/records/user_data.py``): export, import, forgetting and retention;
- ``store.canaries`` (``daemon/records/canaries.py``): a scenario's running canary, and its arms' outcomes.
How a record is stored as a row and read back (``RecordRow``) is ``daemon/records/rows.py``.

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
- Records are never rewritten, with one exception: a stream's record is opened first and completed once at the
  end (``store.exchanges``). Reports are records too (kind ``report``); ``report_refs`` indexes which receipts a
  report names.
- The schema is versioned (``daemon/records/migrations.py``): an older store is migrated on open, a newer one
  refused (``StoreTooNew``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

from daemon.errors import StorageError
from daemon.records.canaries import Canaries
from daemon.records.conn import Conn
from daemon.records.exchanges import Exchanges
from daemon.records.migrations import migrate
from daemon.records.reports import Reports
from daemon.records.rows import MAX_ROWS_PER_INSERT, ExchangeRow
from daemon.records.scenarios import Scenarios
from daemon.records.training import Training
from daemon.records.user_data import UserData

T = TypeVar("T")

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



class RecordStore:
    """Durable store of scenarios, records, reports, consumption, leases and canaries, held in its parts (see
    above). Thread-safe; async methods never block the loop. Abstract: ``SQLiteStore`` and ``PostgresStore``
    are the backends (``open_store`` picks)."""

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
        self._writer_conn: Any = self._open_writer()
        try:
            self.schema_version = migrate(self, self._writer_conn)
        except BaseException:
            self._close_conn(self._writer_conn)
            raise
        self._thread = threading.Thread(target=self._writer_loop, name="reef-records-writer", daemon=True)
        self._thread.start()
        self.scenarios = Scenarios(self)
        self.exchanges = Exchanges(self)
        self.reports = Reports(self)
        self.training = Training(self)  # the training lease and the consumption of receipts
        self.user_data = UserData(self)  # export, import, forgetting and retention
        self.canaries = Canaries(self)  # a scenario's running canary and its arms' outcomes

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
        ExchangeRow.insert(conn, rows)
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
        exchanges = [w[0] for w in batch if type(w[0]) is ExchangeRow]
        if len(batch) <= MAX_ROWS_PER_INSERT and len(exchanges) == len(batch):
            # the common case, only exchange records: one statement is the whole transaction (SQLite commits it
            # on its own), so the writer takes the GIL once for the batch instead of once per BEGIN, INSERT and
            # COMMIT; a failure falls through to the general path below, which reports each write's own error
            try:
                self._insert_exchanges(conn, [e.row for e in exchanges])
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
        result: T = await self.write_soon(fn)
        return result

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

    def scrub(self, full: bool) -> str:
        """After a forget: clear what still holds the deleted bytes (a WAL, free pages, old row versions) and say
        in a sentence what may remain where (``full``: PostgreSQL rewrites the table)."""
        raise NotImplementedError
