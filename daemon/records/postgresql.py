"""The PostgreSQL record store (``records = "postgresql://..."``): several daemons share one store.

Design choices (the shared ones are in ``daemon/records/store.py``):
- Driver: psycopg 3 with psycopg_pool: the maintained PostgreSQL driver for Python (libpq underneath, binary
  wheels on PyPI), server-side prepared statements after a few runs of a query, and a pool that checks a
  connection before lending it, so reads recover by themselves when the database comes back.
- The same group commit as SQLite: one writer connection per daemon (autocommit mode, explicit BEGIN/COMMIT),
  each batch one transaction, one commit (one WAL flush) for every record in it. A receipt goes out only after
  COMMIT returned, and the server's ``synchronous_commit`` (default ``on``) makes that a flushed WAL record.
- Every write transaction first takes one transaction-scoped advisory lock (``pg_advisory_xact_lock``): writers
  of several daemons commit one at a time, so ``seq`` (an identity column, handed out at INSERT) is commit
  order, as in SQLite. Without it a reader paging with ``seq > cursor`` (the learning loop reading new reports)
  could pass over a row whose lower seq committed after a higher one. It also makes check-then-insert writes
  (a ``report_id`` retry, a scenario's creation) exact across daemons. Each daemon still commits a whole batch
  under it, so it costs one lock round trip per batch, not per record.
- Consumption and the lease do not rely on that lock: a claim is an ``INSERT ... ON CONFLICT DO NOTHING`` on the
  (scenario, receipt) key, the lease an upsert on its row, so the database's row locks decide between daemons.
- The database going away (stopped, unreachable) is ``RecordsUnavailable``, a 503, for every write in the batch
  that met it: nothing acknowledged. The writer reconnects on the next batch, the pool on the next read, so
  service resumes with the database; a commit whose connection broke may or may not have landed, and is not
  acknowledged either way (a retried request gets a new receipt).
- Columns as in SQLite (JSON stays TEXT: the request is kept as it came, byte for byte); BLOB becomes BYTEA,
  REAL DOUBLE PRECISION (``daemon/records/migrations.py``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg
import psycopg_pool
from psycopg.pq import TransactionStatus

from daemon.errors import RecordsUnavailable, StorageError
from daemon.records.conn import Conn
from daemon.records.location import redact
from daemon.records.rows import ExchangeRow
from daemon.records.store import RecordStore

_WRITE_LOCK = 0x52454546  # "REEF": the advisory lock every write transaction takes
CONNECT_TIMEOUT_S = 5  # a database that does not answer: the request fails (503) rather than hangs
READ_TIMEOUT_S = 5.0  # waiting for a pooled read connection


class Row:
    """A result row readable by column name and by position, like ``sqlite3.Row``."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values: Sequence[Any]) -> None:
        self._index = index
        self._values = values

    def __getitem__(self, key: int | str) -> Any:
        return self._values[self._index[key] if isinstance(key, str) else key]

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Callable[[Sequence[Any]], Row]:
    index = {d.name: i for i, d in enumerate(cursor.description or ())}
    return lambda values: Row(index, values)


_PLACEHOLDER = re.compile(r"\?")
_translated: dict[str, str] = {}


def _sql(sql: str) -> str:
    """SQLite's ``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled)."""
    out = _translated.get(sql)
    if out is None:
        out = _translated[sql] = _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))
    return out


class PgConn:
    """A psycopg connection with the DB-API face the shared store code uses (``?`` placeholders)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        if not params:
            return self.raw.execute(sql)
        return self.raw.execute(_sql(sql), params)

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> Any:
        cur = self.raw.cursor()
        cur.executemany(_sql(sql), list(params))
        return cur

    @property
    def in_transaction(self) -> bool:
        return bool(self.raw.info.transaction_status != TransactionStatus.IDLE)

    def close(self) -> None:
        self.raw.close()


class PostgresStore(RecordStore):
    """The record store in a PostgreSQL database, shared by every daemon that names it."""

    dialect = "postgresql"
    BEGIN = "BEGIN"
    NOW = "extract(epoch from clock_timestamp())::float8"
    FOR_UPDATE = " FOR UPDATE"
    shared = True
    DriverError = psycopg.Error
    IntegrityError = psycopg.IntegrityError

    def __init__(self, url: str, *, read_pool_size: int = 4) -> None:
        self.url = url
        try:
            super().__init__(redact(url))
        except psycopg.Error as e:
            raise self._failure(e) from None
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=read_pool_size, open=True, timeout=READ_TIMEOUT_S,
            kwargs={"autocommit": True, "row_factory": _row_factory, "connect_timeout": CONNECT_TIMEOUT_S},
            check=psycopg_pool.ConnectionPool.check_connection, name="reef-records-read",
        )

    def _open_writer(self) -> PgConn:
        raw = psycopg.connect(self.url, autocommit=True, row_factory=_row_factory,
                                    connect_timeout=CONNECT_TIMEOUT_S)
        return PgConn(raw)

    def _failure(self, exc: BaseException) -> StorageError:
        if str(getattr(exc, "sqlstate", None) or "").startswith("53"):  # the server's disk is full, out of memory
            return StorageError(f"record store write failed: {_first_line(exc)}", path=self.where)
        if isinstance(exc, psycopg.OperationalError):  # cannot connect, connection lost, server shut down
            return RecordsUnavailable(f"the record store {self.where} cannot be reached: {_first_line(exc)}",
                                      path=self.where)
        return StorageError(f"record store write failed: {_first_line(exc)}", path=self.where)

    def scrub(self, full: bool) -> str:
        # an UPDATE leaves the old row version in the table until VACUUM removes it; only VACUUM FULL rewrites the
        # table so that the old bytes are gone from its files (it locks the records table while it runs)
        try:
            with self._pool.connection() as conn:
                conn.execute("VACUUM (FULL) records" if full else "VACUUM records")
        except psycopg.Error as e:
            return f"{self.where}: deleted; VACUUM failed ({_first_line(e)}): old row versions remain until it runs"
        if full:
            return (f"{self.where}: deleted and the table rewritten (VACUUM FULL); PostgreSQL's WAL segments and "
                    "archives, and backups, keep the old bytes until they are recycled")
        return (f"{self.where}: deleted and vacuumed: no query can read them; the bytes may stay in the table's "
                "free space until reused (reef records forget --scrub rewrites the table), and in PostgreSQL's WAL "
                "segments, archives and backups until those are recycled")

    def _lock(self, conn: Conn) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (_WRITE_LOCK,))

    def _insert_exchanges(self, conn: Conn, rows: list[tuple[Any, ...]]) -> None:
        # BEGIN, the lock, the INSERT and COMMIT sent together (pipeline mode): one network round trip, not four.
        # An error skips what follows it (COMMIT included) and is raised when the pipeline syncs
        assert isinstance(conn, PgConn)
        with conn.raw.pipeline():
            conn.execute("BEGIN")
            self._lock(conn)
            ExchangeRow.insert(conn, rows)
            conn.execute("COMMIT")

    def json_field(self, column: str, key: str) -> str:
        return f"({column}::jsonb ->> '{key}')"

    def json_number(self, column: str, key: str) -> str:
        return f"({column}::jsonb ->> '{key}')::float8"

    def has_table(self, conn: Conn, name: str) -> bool:
        return conn.execute("SELECT to_regclass(?) IS NOT NULL AS found", (name,)).fetchone()["found"] is True

    async def read(self, fn: Callable[[Conn], Any]) -> Any:
        def run() -> Any:
            try:
                with self._pool.connection() as raw:
                    return fn(PgConn(raw))
            except psycopg.OperationalError as e:
                raise self._failure(e) from None

        return await asyncio.to_thread(run)

    def integrity_check(self) -> str:
        """``ok`` when the database answers (PostgreSQL checks its own pages; ``amcheck`` is the deeper tool)."""
        with self._pool.connection() as raw:
            raw.execute("SELECT 1")
        return "ok"

    def close(self) -> None:
        super().close()
        self._pool.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
