"""The record store (see ``daemon/records/store.py``): ``open_store`` picks the backend from the config.

    records = "sqlite"                          # the default: $REEF_HOME/records.sqlite3
    records = "postgresql://user@host/db"       # shared by several daemons (psycopg; the ``postgresql`` extra)

What other modules use is re-exported here; the backends' modules are private to the package.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from daemon.errors import BadRequest
from daemon.records.exchange_record import ExchangeRecord
from daemon.records.sqlite import SQLiteStore
from daemon.records.store import Conn, Lease, RecordStore, Scenario, new_id

__all__ = ["Conn", "ExchangeRecord", "Lease", "RecordStore", "SQLiteStore", "Scenario", "new_id", "open_store", "is_postgres", "redact"]


def is_postgres(location: str | None) -> bool:
    return bool(location) and str(location).startswith(("postgresql://", "postgres://"))


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


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))
