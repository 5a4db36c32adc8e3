"""What the record store's SQL runs on: a DB-API connection, as both backends supply it and both the store
(``daemon/records/store.py``) and its migrations (``daemon/records/migrations.py``) use it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Conn(Protocol):
    """What a write or a read gets: a DB-API connection taking ``?`` placeholders, rows readable by column name
    and by position (``sqlite3.Connection`` with ``sqlite3.Row``; the PostgreSQL backend adapts psycopg's)."""

    in_transaction: bool

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Any: ...

    def executemany(self, sql: str, params: Iterable[Sequence[Any]], /) -> Any: ...
