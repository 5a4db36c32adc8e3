"""The record store's schema, as numbered migrations, for both backends.

Each migration is SQL written once in SQLite's words and translated for PostgreSQL by ``ddl`` (a handful of type
names). ``schema_version`` holds one row per applied migration; a store's version is the highest. A store made
before versioning (the tables, no ``schema_version``) is version 1. Opening a store applies what it lacks, in one
transaction (PostgreSQL: under the writers' lock, so two daemons starting at once migrate it once); a store
whose version is newer than ``LATEST`` is refused with ``StoreTooNew`` rather than read by code that does not
know its shape.

To change the schema: append a migration (never edit one that shipped) and the code that uses it.
"""

from __future__ import annotations

import re
import time
from typing import ClassVar, Protocol

from daemon.errors import StoreTooNew
from daemon.records.conn import Conn


class Migratable(Protocol):
    """What migrating asks of a store (``RecordStore`` is one): its dialect, how it begins, locks and rolls back a
    transaction, and whether a table exists."""

    dialect: ClassVar[str]
    BEGIN: ClassVar[str]
    where: str

    def has_table(self, conn: Conn, name: str) -> bool: ...

    def _lock(self, conn: Conn) -> None: ...

    def _rollback(self, conn: Conn) -> None: ...

MIGRATIONS: dict[int, str] = {
    # 1: the schema as it was before versioning
    1: """
CREATE TABLE IF NOT EXISTS scenarios (
    name        TEXT PRIMARY KEY,
    recipe      TEXT NOT NULL,
    model       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    settings    TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS records (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT NOT NULL UNIQUE,
    kind            TEXT NOT NULL,              -- exchange | report
    scenario        TEXT NOT NULL,
    run             TEXT,
    created_at      REAL NOT NULL,
    status          TEXT NOT NULL,              -- complete | incomplete | error
    format          TEXT,                       -- openai-chat | openai-responses | anthropic
    engine          TEXT,
    model           TEXT,
    release_id      TEXT,
    content_id      TEXT,
    runtime_load_id TEXT,
    request         TEXT,                       -- JSON: the body as received
    response        TEXT,                       -- JSON: the full answer (assembled from the stream)
    headers         TEXT,                       -- JSON: client headers without credentials
    timings         TEXT,                       -- JSON: ttft_ms, total_ms, engine_ms
    usage           TEXT,                       -- JSON
    prompt_token_ids BLOB,                      -- packed int32
    token_ids       BLOB,                       -- packed int32
    logprobs        BLOB,                       -- packed float32
    report          TEXT,                       -- JSON (kind=report): score, feedback, metadata, references
    report_key      TEXT UNIQUE,                -- client report_id, for idempotent retries
    report_hash     TEXT
);
CREATE INDEX IF NOT EXISTS records_scenario ON records(scenario, seq);
CREATE INDEX IF NOT EXISTS records_run ON records(run, seq);
CREATE TABLE IF NOT EXISTS report_refs (
    report_id   TEXT NOT NULL,
    receipt     TEXT NOT NULL,
    PRIMARY KEY (receipt, report_id)
);
CREATE INDEX IF NOT EXISTS report_refs_report ON report_refs(report_id);
""",
    # 2: the training lease, and the consumption of receipts (what several daemons sharing a store agree on)
    2: """
CREATE TABLE leases (
    name        TEXT PRIMARY KEY,
    holder      TEXT,                           -- NULL: released
    epoch       INTEGER NOT NULL,               -- grows by one each time the lease changes hands
    expires_at  REAL NOT NULL,                  -- the database's clock, seconds since the epoch
    acquired_at REAL NOT NULL
);
CREATE TABLE consumption (
    scenario    TEXT NOT NULL,
    receipt     TEXT NOT NULL,
    holder      TEXT NOT NULL,                  -- the lease holder that claimed it for a step
    epoch       INTEGER NOT NULL,               -- and its lease epoch
    state       TEXT NOT NULL,                  -- claimed | consumed
    outcome     TEXT,                           -- the release or rejection that consumed it
    claimed_at  REAL NOT NULL,
    PRIMARY KEY (scenario, receipt)
);
""",
    # 3: serve-only traffic (an exchange's capture: 0 = never trained on), a scenario's own switches, and the
    # tombstone of a forgotten exchange (when, and the hash of the bodies that were deleted)
    3: """
ALTER TABLE records ADD COLUMN capture INTEGER NOT NULL DEFAULT 1;
ALTER TABLE records ADD COLUMN forgotten_at REAL;
ALTER TABLE records ADD COLUMN content_hash TEXT;
ALTER TABLE scenarios ADD COLUMN capture INTEGER NOT NULL DEFAULT 1;
ALTER TABLE scenarios ADD COLUMN paused INTEGER NOT NULL DEFAULT 0;
ALTER TABLE scenarios ADD COLUMN archived INTEGER NOT NULL DEFAULT 0;
CREATE TABLE canaries (
    scenario    TEXT PRIMARY KEY,
    release_id  TEXT NOT NULL,                  -- the candidate served to a share of new runs (held as pending)
    base_id     TEXT NOT NULL,                  -- the head it is compared with
    share       REAL NOT NULL,
    started_at  REAL NOT NULL,
    settings    TEXT NOT NULL                   -- JSON: alpha, max_reports, max_error_rate, min_exchanges
)
""",
    # 4: a scenario's early warning (daemon/gating/warning.py): JSON {state: warned | accepted | cleared, since,
    # and when warned: reason, signals, figures, release_id, at}; NULL: never warned
    4: """
ALTER TABLE scenarios ADD COLUMN warning TEXT
""",
}
LATEST = max(MIGRATIONS)

_PG_TYPES = [
    (re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"), "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bBLOB\b"), "BYTEA"),
]


def ddl(sql: str, dialect: str) -> list[str]:
    """A migration's statements in ``dialect`` (``sqlite`` or ``postgresql``)."""
    if dialect == "postgresql":
        for pattern, replacement in _PG_TYPES:
            sql = pattern.sub(replacement, sql)
    return [s.strip() for s in sql.split(";\n") if s.strip()]


def current_version(store: Migratable, conn: Conn) -> int:
    """The store's schema version: 0 for an empty one, 1 for one made before versioning."""
    if store.has_table(conn, "schema_version"):
        row = conn.execute("SELECT MAX(version) AS v FROM schema_version").fetchone()
        if row["v"] is not None:
            return int(row["v"])
    return 1 if store.has_table(conn, "records") else 0


def migrate(store: Migratable, conn: Conn) -> int:
    """Bring the store to ``LATEST``; returns the version it is at. Raises ``StoreTooNew``."""
    version = current_version(store, conn)
    if version > LATEST:
        raise StoreTooNew(store.where, version, LATEST)
    if version == LATEST:
        return version
    conn.execute(store.BEGIN)
    try:
        store._lock(conn)
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL PRIMARY KEY,"
                     " applied_at REAL NOT NULL)")
        version = current_version(store, conn)  # again, under the lock: another daemon may have migrated it
        if version > LATEST:
            raise StoreTooNew(store.where, version, LATEST)
        if version == 1 and not conn.execute("SELECT 1 FROM schema_version").fetchone():
            conn.execute("INSERT INTO schema_version(version, applied_at) VALUES (1, ?)", (time.time(),))
        for v in range(version + 1, LATEST + 1):
            for statement in ddl(MIGRATIONS[v], store.dialect):
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version(version, applied_at) VALUES (?, ?)", (v, time.time()))
        conn.execute("COMMIT")
    except BaseException:
        store._rollback(conn)
        raise
    return LATEST
