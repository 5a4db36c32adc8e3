"""What the record store's SQL runs on: a DB-API connection, as both backends supply it and both the store
(``daemon/records/store.py``) and its migrations (``daemon/records/migrations.py``) use it; and ``Rows``, what
the store's parts use of the store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Conn(Protocol):
    """What a write or a read gets: a DB-API connection taking ``?`` placeholders, rows readable by column name
    and by position (``sqlite3.Connection`` with ``sqlite3.Row``; the PostgreSQL backend adapts psycopg's)."""

    @property
    def in_transaction(self) -> bool: ...  # read-only: sqlite3's attribute, psycopg's property (adapted)

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Any: ...

    def executemany(self, sql: str, params: Iterable[Sequence[Any]], /) -> Any: ...


T = TypeVar("T")


class Rows(Protocol):
    """What a part of the record store (``store.scenarios``, ``store.exchanges``, ...) uses of the store that holds
    it: its writer, its reads and the fragments of SQL its backend writes differently."""

    @property
    def NOW(self) -> str: ...  # the database's clock, seconds since the epoch

    @property
    def FOR_UPDATE(self) -> str: ...  # what locks the rows a SELECT read, until the transaction ends

    async def read(self, fn: Callable[[Conn], T]) -> T: ...

    async def write(self, fn: Callable[[Conn], T]) -> T: ...

    def write_soon(self, fn: Callable[[Conn], Any]) -> asyncio.Future[Any]: ...

    def json_field(self, column: str, key: str) -> str: ...

    def json_number(self, column: str, key: str) -> str: ...
