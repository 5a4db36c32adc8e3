"""The user's data, a part of the record store (``RecordStore.user_data``): what leaves it (an export, a page at a
time), what comes in (an import), and what is forgotten, on request or by the retention settings.

Forgetting deletes the bodies and keeps a tombstone, in one transaction; then the backend clears what would still
hold the bytes (``scrub``: SQLite empties its WAL, PostgreSQL vacuums) and says what may remain where.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any, Protocol

from daemon.errors import NotFound, ReportConflict, UnknownReceipts
from daemon.records.conn import Conn, Rows
from daemon.records.reports import report_hash
from daemon.records.rows import (
    RECORD_COLUMNS,
    SIZED,
    SUMMARY_COLUMNS,
    ExchangeRow,
    RecordRow,
    chunks,
    dumps,
    marks,
    new_id,
    record,
)

# how far ahead of this clock a record's date may be (another machine's clock): an import dated later is refused
# (daemon/export.py), and retention does not judge a stored one by its date (retention_due)
CLOCK_SKEW_S = 3600.0
EXPORT_PAGE_BYTES = 4 << 20


class Scrubbing(Rows, Protocol):
    def scrub(self, full: bool) -> str:
        """After a forget: clear what still holds the deleted bytes (a WAL, free pages, old row versions) and say
        in a sentence what may remain where (``full``: PostgreSQL rewrites the table)."""
        ...


def _content_hash(request: Any, response: Any) -> str:
    h = hashlib.sha256()
    for part in (request, response):
        data = part if isinstance(part, bytes) else (part or "").encode()
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


class UserData:
    """Export, import, forgetting and retention over one record store."""

    def __init__(self, store: Scrubbing) -> None:
        self.store = store

    async def export_page(self, *, scenario: str | None, since: float | None, after: int, limit: int = 500,
                          max_bytes: int = EXPORT_PAGE_BYTES) -> tuple[list[RecordRow], int | None]:
        """Exchange records (bodies and reports) after seq ``after``, oldest first: at most ``limit``, and no more
        once they hold ``max_bytes`` of stored bodies and tokens (at least one, however big), so that a page of
        big records is as small in memory as one of small ones; and the seq to continue after (None: no more).
        Rows are taken one at a time (SQLite reads each once; its ``length()`` of TEXT reads it all)."""

        def op(conn: Conn) -> tuple[list[RecordRow], int | None]:
            clauses: list[str] = ["kind='exchange'", "seq>?"]
            args: list[Any] = [after]
            if scenario is not None:
                clauses.append("scenario=?")
                args.append(scenario)
            if since is not None:
                clauses.append("created_at>=?")
                args.append(since)
            cur = conn.execute(f"SELECT {RECORD_COLUMNS} FROM records WHERE {' AND '.join(clauses)}"
                               f" ORDER BY seq LIMIT ?", (*args, limit))
            rows, total, full = [], 0, False
            while (row := cur.fetchone()) is not None:
                rows.append(row)
                total += sum(len(row[c]) for c in SIZED if row[c] is not None)
                if total >= max_bytes:
                    full = True
                    break
            if full and hasattr(cur, "close"):
                cur.close()
            out = [record(r) for r in rows]
            by_id = {r["id"]: r for r in out}
            for r in out:
                r["reports"] = []
            if by_id:
                for r in conn.execute(
                        f"SELECT rr.receipt, {SUMMARY_COLUMNS} FROM report_refs rr JOIN records ON records.id ="
                        f" rr.report_id WHERE rr.receipt IN ({marks(by_id)}) ORDER BY records.seq",
                        list(by_id)).fetchall():
                    by_id[r["receipt"]]["reports"].append(record(r))
            more = full or len(rows) == limit
            return out, (out[-1]["seq"] if out and more else None)

        return await self.store.read(op)

    async def import_exchanges(self, items: list[dict[str, Any]]) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """Store imported exchanges (``daemon/export.from_line``'s records and reports) in one transaction:
        those whose id is stored already are skipped (a re-import changes nothing). Returns the counts
        (``imported``, ``skipped``, ``reports``) and the reports stored (``id``, ``scenario`` and the report's
        body): ``daemon.reports.accept_imports`` counts and announces them. A report key (``import:<receipt>``)
        another report holds already refuses the batch (``ReportConflict`` naming the item), nothing stored."""

        def op(conn: Conn) -> tuple[dict[str, int], list[dict[str, Any]]]:
            ids = [it["record"].id for it in items]
            have: set[str] = set()
            for chunk in chunks(ids):
                have |= {r["id"] for r in conn.execute(
                    f"SELECT id FROM records WHERE id IN ({marks(chunk)})", chunk).fetchall()}
            rows, seen = [], set(have)
            for i, it in enumerate(items):  # the same id twice in one batch: the first one
                if it["record"].id not in seen:
                    seen.add(it["record"].id)
                    rows.append((i, it))
            keys = [rep["report_id"] for _, it in rows for rep in it["reports"]]
            taken: set[str] = set()
            for chunk in chunks(keys):  # a client's report_id from before such ids were refused at /reef/report
                taken |= {r["report_key"] for r in conn.execute(
                    f"SELECT report_key FROM records WHERE report_key IN ({marks(chunk)})", chunk).fetchall()}
            for i, it in rows:
                for key in (rep["report_id"] for rep in it["reports"] if rep["report_id"] in taken):
                    raise ReportConflict(f"items[{i}]: the report of imported exchange {it['record'].id} would be "
                                         f"stored as report_id {key!r}, which another report holds: import it under "
                                         "another id", report_id=key, param=f"items[{i}].id")
            for _, it in rows:
                ExchangeRow(it["record"])(conn)
            reports: list[dict[str, Any]] = []
            for _, it in rows:
                rec = it["record"]
                for rep in it["reports"]:
                    body = {"score": rep["score"], "feedback": rep["feedback"], "references": [rec.id],
                            "metadata": {"imported": True, **({"source": rep["source"]} if rep["source"] else {})}}
                    rid = new_id("rep_")
                    conn.execute("INSERT INTO records(id, kind, scenario, created_at, status, report, report_key,"
                                 " report_hash) VALUES (?,?,?,?,?,?,?,?)",
                                 (rid, "report", rec.scenario, time.time(), "complete", dumps(body),
                                  rep["report_id"], report_hash(body, rec.scenario)))
                    conn.execute("INSERT INTO report_refs(report_id, receipt) VALUES (?,?)", (rid, rec.id))
                    reports.append({"id": rid, "scenario": rec.scenario, **body})
            return {"imported": len(rows), "skipped": len(items) - len(rows), "reports": len(reports)}, reports

        return await self.store.write(op)

    async def forget(self, *, receipts: list[str], runs: list[str], scrub: bool = False) -> dict[str, Any]:
        """Delete the bodies of these exchanges (and every exchange of these runs): request, answer, headers and
        token ids, and the feedback and metadata of the reports on them, in one transaction (all or nothing).
        What stays is a tombstone: the record's id, scenario, run, release, timings, the time it was forgotten and
        the SHA-256 of the deleted bodies (``content_hash``); a report keeps its score, references and
        ``report_hash``, so a retried report still conflicts as before. Then the backend clears what would still
        hold the bytes (``scrub``; ``scrub``: PostgreSQL rewrites the table). Returns what was forgotten
        (``forgotten``, ``already``, ``reports``, ``scenarios``, ``runs``, and what ``remains`` where)."""
        receipts, runs = list(dict.fromkeys(receipts)), list(dict.fromkeys(runs))

        def op(conn: Conn) -> dict[str, Any]:
            found: dict[str, Any] = {}
            for col, ids in (("id", receipts), ("run", runs)):
                for chunk in chunks(ids):
                    for r in conn.execute(f"SELECT id, scenario, run, forgotten_at FROM records WHERE kind='exchange'"
                                          f" AND {col} IN ({marks(chunk)})", chunk).fetchall():
                        found[r["id"]] = r
            missing = [r for r in receipts if r not in found]
            if missing:
                raise UnknownReceipts(missing)
            unknown_runs = [r for r in runs if not any(row["run"] == r for row in found.values())]
            if unknown_runs:
                raise NotFound(f"no exchanges in runs: {', '.join(unknown_runs)}", runs=unknown_runs)
            todo = [rid for rid, r in found.items() if r["forgotten_at"] is None]
            now, reports = time.time(), set()
            for chunk in chunks(todo):
                bodies = conn.execute(f"SELECT id, request, response FROM records WHERE id IN ({marks(chunk)})", chunk)
                conn.executemany(
                    "UPDATE records SET request=NULL, response=NULL, headers=NULL, prompt_token_ids=NULL,"
                    " token_ids=NULL, logprobs=NULL, forgotten_at=?, content_hash=? WHERE id=?",
                    [(now, _content_hash(b["request"], b["response"]), b["id"]) for b in bodies.fetchall()])
                for r in conn.execute(f"SELECT rep.id, rep.report FROM records rep JOIN report_refs rr"
                                      f" ON rr.report_id = rep.id WHERE rr.receipt IN ({marks(chunk)})",
                                      chunk).fetchall():
                    if r["id"] not in reports:
                        reports.add(r["id"])
                        kept = {k: v for k, v in json.loads(r["report"]).items() if k in ("score", "references")}
                        conn.execute("UPDATE records SET report=? WHERE id=?", (dumps({**kept, "forgotten": True}),
                                                                              r["id"]))
            scenarios = sorted({found[rid]["scenario"] for rid in todo})
            return {"forgotten": todo, "already": [rid for rid in found if rid not in todo], "reports": len(reports),
                    "scenarios": scenarios, "runs": sorted({r["run"] for r in found.values() if r["run"]})}

        out = await self.store.write(op)
        out["remains"] = await asyncio.to_thread(self.store.scrub, scrub)
        return out

    async def retention_due(self, *, before: float | None, max_bytes: int | None, limit: int = 10_000) -> list[str]:
        """Exchanges the retention settings forget now, oldest first: created before ``before``, and the oldest
        while the bodies kept (request and answer, newest first) add up to more than ``max_bytes``. A stream still
        open (opened, not completed, younger than an hour) is left for the next round. Under ``before``, a record
        dated more than ``CLOCK_SKEW_S`` ahead (a time in milliseconds, a clock ahead: imports refuse such dates
        now) is due too: its age cannot be told from its date, and kept by it, it would never be."""

        def op(conn: Conn) -> list[str]:
            now = time.time()
            live = ("kind='exchange' AND forgotten_at IS NULL"
                    " AND NOT (status='incomplete' AND timings IS NULL AND created_at > ? AND created_at < ?)")
            open_window = (now - 3600, now + CLOCK_SKEW_S)
            due: list[str] = []
            if before is not None:
                due += [r["id"] for r in conn.execute(
                    f"SELECT id FROM records WHERE {live} AND (created_at < ? OR created_at > ?) ORDER BY seq LIMIT ?",
                    (*open_window, before, now + CLOCK_SKEW_S, limit)).fetchall()]
            if max_bytes is not None and len(due) < limit:
                kept, over = 0, []
                for r in conn.execute(f"SELECT id, COALESCE(LENGTH(request), 0) + COALESCE(LENGTH(response), 0) AS n"
                                      f" FROM records WHERE {live} ORDER BY seq DESC", open_window):
                    kept += r["n"]
                    if kept > max_bytes:
                        over.append(r["id"])
                seen = set(due)
                due += [rid for rid in reversed(over) if rid not in seen][: limit - len(due)]
            return due

        return await self.store.read(op)

    async def forgotten(self, scenario: str) -> set[str]:
        """The receipts of a scenario that were forgotten."""
        rows = await self.store.read(lambda c: c.execute(
            "SELECT id FROM records WHERE scenario=? AND kind='exchange' AND forgotten_at IS NOT NULL",
            (scenario,)).fetchall())
        return {r["id"] for r in rows}
