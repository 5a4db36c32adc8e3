"""The SQLite record store: one file under ``$REEF_HOME`` (``records.sqlite3``), the single-machine default.

Design choices (the shared ones are in ``daemon/records/store.py``):
- WAL with ``synchronous=FULL``: a committed record survives ``kill -9`` and power loss.
- A batch of only exchange records is one multi-row INSERT with no BEGIN/COMMIT around it: SQLite commits a
  statement on its own, so the writer takes the GIL once for the batch.
- Reads use short-lived per-thread connections off the event loop.
- WAL checkpoints run in their own thread (``PASSIVE``, every half second after writes), not inside a commit:
  with SQLite's automatic checkpoint the request whose commit crossed the threshold paid for copying the WAL
  into the database (a 10 ms p99 spike).
- One process writes: the writer thread is the only writer, so ``seq`` order is commit order, and the lease and
  consumption rows need no locks beyond SQLite's own (``BEGIN IMMEDIATE`` takes the write lock).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.errors import StorageError
from daemon.records.conn import Conn
from daemon.records.rows import ExchangeRow
from daemon.records.store import RecordStore

# FULL: a commit fsyncs the WAL before it returns, so a receipt survives a power cut. Only the power-loss test
# changes it (to OFF, in a daemon process, to show that its double catches a commit that was not fsynced).
SYNCHRONOUS = "FULL"


class SQLiteStore(RecordStore):
    """The record store in one SQLite file."""

    dialect = "sqlite"
    BEGIN = "BEGIN IMMEDIATE"
    NOW = "((julianday('now') - 2440587.5) * 86400.0)"
    DriverError = sqlite3.Error
    IntegrityError = sqlite3.IntegrityError

    def __init__(self, path: Path, *, connect: Callable[[str], sqlite3.Connection] | None = None) -> None:
        self.path = Path(path)
        self._connect_fn = connect or (lambda p: sqlite3.connect(p, check_same_thread=False, isolation_level=None))
        self._local = threading.local()
        self._dirty = threading.Event()
        self._closed = threading.Event()
        super().__init__(str(self.path))
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="reef-records-checkpoint",
                                              daemon=True)
        self._checkpointer.start()

    # --- connections ---------------------------------------------------------------------------------------

    def _open(self, *, write: bool) -> sqlite3.Connection:
        conn = self._connect_fn(str(self.path))
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout=10000")
        # every connection, not only the writer: the checkpointer's checkpoints write the database file, and a
        # build's default may be NORMAL (no fsync per commit in WAL mode)
        conn.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
        if write:
            # what a write frees (an exchange forgotten, a row updated) is overwritten with zeros, not left in
            # free space in the file for anyone reading its bytes
            conn.execute("PRAGMA secure_delete=ON")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpoint thread does it
        return conn

    def _open_writer(self) -> sqlite3.Connection:
        return self._open(write=True)

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._open(write=False)
            self._local.conn = conn
        return conn

    def _failure(self, exc: BaseException) -> StorageError:
        return StorageError(f"record store write failed: {exc}", path=str(self.path))

    def _insert_exchanges(self, conn: Conn, rows: list[tuple[Any, ...]]) -> None:
        ExchangeRow.insert(conn, rows)  # one statement: SQLite's own transaction

    def _committed(self) -> None:
        self._dirty.set()

    def json_field(self, column: str, key: str) -> str:
        return f"json_extract({column}, '$.{key}')"

    def has_table(self, conn: Conn, name: str) -> bool:
        return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None

    async def read(self, fn: Callable[[Conn], Any]) -> Any:
        return await asyncio.to_thread(lambda: fn(self._reader()))

    def integrity_check(self) -> str:
        return str(self._reader().execute("PRAGMA integrity_check").fetchone()[0])

    def scrub(self, full: bool) -> str:
        # the writer zeroes freed space (secure_delete); the WAL still holds the pages as they were before, until
        # a checkpoint copies the new ones into the file and TRUNCATE empties the WAL (a reader holding an old
        # snapshot makes it wait: try again, then say so)
        conn = self._open(write=False)
        try:
            for _ in range(100):
                busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
                if not busy:
                    return (f"{self.path}: deleted in the file and its WAL (freed space zeroed); copies made "
                            "earlier (backups, file-system snapshots) are untouched")
                self._closed.wait(0.1)
        finally:
            conn.close()
        return (f"{self.path}: deleted in the file; its WAL could not be emptied now (a reader held it) and may "
                "hold the old bytes until the next checkpoint")

    def close(self) -> None:
        super().close()
        self._closed.set()
        self._dirty.set()
        self._checkpointer.join(timeout=30)

    def _checkpoint_loop(self) -> None:
        conn = self._open(write=False)
        try:
            while not self._closed.is_set():
                self._dirty.wait()
                if self._closed.wait(0.5):
                    break
                self._dirty.clear()
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:
                    pass  # busy or failing disk: the next round tries again; nothing acknowledged depends on it
            try:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:
                pass  # a full or failing disk at shutdown: the WAL keeps every record; the next start checkpoints it
        finally:
            conn.close()
