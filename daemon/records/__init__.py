"""The record store (see ``daemon/records/store.py``): ``open_store`` picks the backend from the config.

    records = "sqlite"                          # the default: $REEF_HOME/records.sqlite3
    records = "postgresql://user@host/db"       # shared by several daemons (psycopg; the ``postgresql`` extra)

What other modules use is re-exported here; the backends' modules are private to the package.
"""

from __future__ import annotations

from pathlib import Path

from daemon.errors import BadRequest
from daemon.records.conn import Conn
from daemon.records.exchange_record import ExchangeRecord
from daemon.records.location import is_postgres, redact
from daemon.records.rows import RecordRow, new_id
from daemon.records.scenarios import Scenario, ScenarioSummary
from daemon.records.scored import FeedbackReport, RequestSampling, ScoredExchange
from daemon.records.sqlite import SQLiteStore
from daemon.records.store import RecordStore
from daemon.records.training import Lease

__all__ = ["Conn", "ExchangeRecord", "FeedbackReport", "Lease", "RecordRow", "RecordStore", "RequestSampling",
           "SQLiteStore", "Scenario", "ScenarioSummary", "ScoredExchange", "new_id", "open_store", "is_postgres",
           "redact"]


def open_store(location: str | Path) -> RecordStore:
    """The record store at ``location``: a ``postgresql://`` URL (PostgreSQL), else a SQLite file path."""
    if is_postgres(str(location)):
        try:
            from daemon.records.postgresql import PostgresStore
        except ImportError as e:
            raise BadRequest(f"records = postgresql://... needs psycopg ({e.name} is not installed): "
                             "pip install 'reef[postgresql]'", param="records") from None
        return PostgresStore(str(location))
    return SQLiteStore(Path(location))

