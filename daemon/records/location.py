"""Where a record store lives: a SQLite file path, or a ``postgresql://`` URL (whose password never reaches a
message or a log). The package's ``__init__`` and the PostgreSQL backend both read these."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def is_postgres(location: str | None) -> bool:
    return bool(location) and str(location).startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))
