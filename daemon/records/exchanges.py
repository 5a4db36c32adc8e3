"""Served exchanges, a part of the record store (``RecordStore.exchanges``): stored, opened and completed, read
back by receipt, listed.

Records are never rewritten, with one exception: a stream's receipt goes out in its response headers, before the
answer exists, so its record is opened first (``open``: the request, status ``incomplete``, NULL timings) and
filled in once at the end (``complete``: only a row with NULL timings can be, so twice is refused). A ``kill -9``
or a full disk mid-stream leaves the opened record, ``incomplete``: a receipt a client saw always names a record.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from daemon.errors import NotFound, ReefError
from daemon.records.conn import Conn, Rows
from daemon.records.exchange_record import ExchangeRecord
from daemon.records.rows import (
    OUTCOME,
    RECORD_COLUMNS,
    SUMMARY_COLUMNS,
    ExchangeRow,
    RecordRow,
    chunks,
    marks,
    record,
    values,
)

_COMPLETE = (f"UPDATE records SET {', '.join(f'{name}=?' for name, _, _ in OUTCOME)}"
             " WHERE id=? AND kind='exchange' AND timings IS NULL")


class Exchanges:
    """The exchange records of one record store (and, in listings and counts, its report records)."""

    def __init__(self, store: Rows) -> None:
        self.store = store

    async def append(self, rec: ExchangeRecord) -> None:
        """Store one served exchange; returns once it is durable. ``request_json`` / ``response_json``, when
        given, are the request and response already as JSON text, stored as they are (not encoded again)."""
        await self.store.write(ExchangeRow(rec))

    def open(self, rec: ExchangeRecord) -> asyncio.Future[None]:
        """Store the opening of a streamed exchange (status ``incomplete``, no timings yet) so that its receipt
        can go out in the stream's headers; the future resolves once it is durable. ``complete`` fills it in at
        the end: that is the one change a record ever gets."""
        return self.store.write_soon(ExchangeRow(replace(rec, status="incomplete", timings=None)))

    async def complete(self, rec: ExchangeRecord) -> None:
        """Fill in an exchange opened with ``open``: its outcome (the fields marked ``outcome``: status, response,
        timings, usage, tokens), once; the request and everything known at the start stay as they were written.
        Returns once it is durable."""
        if rec.timings is None:  # never NULL once complete: NULL timings mark an open record
            rec = replace(rec, timings={})
        stored = (*values(rec, OUTCOME), rec.id)

        def op(conn: Conn) -> None:
            cur = conn.execute(_COMPLETE, stored)
            if cur.rowcount != 1:
                raise ReefError(f"exchange {rec.id} is not open: it was completed already or never opened")

        await self.store.write(op)

    async def get(self, receipt: str, *, full: bool = True) -> RecordRow:
        """The record ``receipt`` names (an exchange or a report), with the reports on it as summaries; without
        its bodies and tokens unless ``full``. ``NotFound`` when there is none."""

        def op(conn: Conn) -> RecordRow | None:
            row = conn.execute(
                f"SELECT {RECORD_COLUMNS if full else SUMMARY_COLUMNS} FROM records WHERE id=?", (receipt,)
            ).fetchone()
            if row is None:
                return None
            rec = record(row)
            rec["reports"] = [
                record(r)
                for r in conn.execute(
                    f"SELECT {SUMMARY_COLUMNS} FROM records WHERE id IN "
                    "(SELECT report_id FROM report_refs WHERE receipt=?) ORDER BY seq",
                    (receipt,),
                ).fetchall()
            ]
            return rec

        rec = await self.store.read(op)
        if rec is None:
            raise NotFound(f"no record with receipt {receipt!r}", receipt=receipt)
        return rec

    async def trace_headers(self, receipts: list[str]) -> dict[str, dict[str, str]]:
        """The W3C trace headers (``traceparent``, ``tracestate``) the clients of these exchanges sent, from their
        recorded headers: receipt -> the headers it has (receipts with neither, or unknown, left out). What the
        span of a report reads to link to exchange spans that joined their clients' traces (daemon/telemetry.py)."""
        parent, state = self.store.json_field("headers", "traceparent"), self.store.json_field("headers", "tracestate")

        def op(conn: Conn) -> dict[str, dict[str, str]]:
            out: dict[str, dict[str, str]] = {}
            for chunk in chunks(receipts):
                rows = conn.execute(
                    f"SELECT id, {parent} AS traceparent, {state} AS tracestate FROM records"
                    f" WHERE kind='exchange' AND id IN ({marks(chunk)})", chunk).fetchall()
                for row in rows:
                    got = {k: row[k] for k in ("traceparent", "tracestate") if isinstance(row[k], str)}
                    if got:
                        out[row["id"]] = got
            return out

        return await self.store.read(op)

    async def listing(
        self,
        *,
        scenario: str | None = None,
        run: str | None = None,
        after: int | None = None,
        limit: int = 50,
        kind: str | None = None,
        newest_first: bool = False,
    ) -> list[RecordRow]:
        """Records as summaries, by ``seq`` (after ``after``), of a scenario, a run, a kind; an exchange that was
        reported on carries the latest report's ``score`` and ``feedback``."""
        clauses: list[str] = []
        args: list[Any] = []
        for col, val in (("scenario", scenario), ("run", run), ("kind", kind)):
            if val is not None:
                clauses.append(f"{col}=?")
                args.append(val)
        if after is not None:
            clauses.append("seq>?")
            args.append(after)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        order = "DESC" if newest_first else "ASC"
        sql = f"SELECT {SUMMARY_COLUMNS} FROM records {where} ORDER BY seq {order} LIMIT ?"
        args.append(limit)

        def op(conn: Conn) -> list[RecordRow]:
            out = [record(r) for r in conn.execute(sql, args).fetchall()]
            ids = [r["id"] for r in out if r["kind"] == "exchange"]
            if ids:
                scores: dict[str, Any] = {}
                for r in conn.execute(
                    f"SELECT rr.receipt, rec.report FROM report_refs rr JOIN records rec ON rec.id=rr.report_id "
                    f"WHERE rr.receipt IN ({marks(ids)}) ORDER BY rec.seq",
                    ids,
                ).fetchall():
                    scores[r["receipt"]] = json.loads(r["report"])
                for rec in out:
                    if rec["id"] in scores:
                        last = scores[rec["id"]]
                        rec["score"] = last.get("score")
                        rec["feedback"] = last.get("feedback")
            return out

        return await self.store.read(op)

    async def count(self) -> dict[str, int]:
        """How many records of each kind the store holds."""

        def op(conn: Conn) -> dict[str, int]:
            return {
                r["kind"]: r["n"] for r in conn.execute("SELECT kind, COUNT(*) AS n FROM records GROUP BY kind")
            }

        return await self.store.read(op)
