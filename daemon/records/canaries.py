"""Canaries, a part of the record store (``RecordStore.canaries``): a scenario's running canary (its candidate, the
head it is compared with, its share and settings; one at a time), and what each arm's exchanges and reports say.

A canary's row is all of it that is kept: its arms' counts are read back from the records every time (every record
names the release that served it), so a restart resumes a canary with the same arms and counts. The decision on
them is ``daemon/canary.py``'s.
"""

from __future__ import annotations

import json
import time
from typing import Any

from daemon.errors import Conflict
from daemon.loops import loops
from daemon.records.conn import Conn, Rows
from daemon.records.rows import dumps, unpack

LOOPS_KEPT = 50_000  # answers whose loop flag is remembered (by record id): a canary is judged every half second


class Canaries:
    """The canaries rows of one record store, and the arms' outcomes read from its records."""

    def __init__(self, store: Rows) -> None:
        self.store = store
        self._loops: dict[str, bool] = {}  # record id -> whether its answer loops (``daemon/loops.py``)

    def _looped(self, record_id: str, blob: bytes) -> bool:
        flag = self._loops.get(record_id)
        if flag is None:
            if len(self._loops) >= LOOPS_KEPT:
                self._loops.clear()
            flag = self._loops[record_id] = loops(unpack(blob, "i") or [])
        return flag

    async def start(self, scenario: str, release_id: str, base_id: str, share: float,
                    settings: dict[str, Any]) -> dict[str, Any]:
        """Store a scenario's canary (one at a time: a second is a ``Conflict``)."""

        def op(conn: Conn) -> dict[str, Any]:
            if conn.execute("SELECT 1 FROM canaries WHERE scenario=?", (scenario,)).fetchone():
                raise Conflict(f"scenario {scenario!r} already has a canary; end it first "
                               "(reef releases canary-end)", scenario=scenario)
            conn.execute("INSERT INTO canaries(scenario, release_id, base_id, share, started_at, settings)"
                         " VALUES (?,?,?,?,?,?)", (scenario, release_id, base_id, share, time.time(),
                                                    dumps(settings)))
            return _canary(conn.execute("SELECT * FROM canaries WHERE scenario=?", (scenario,)).fetchone())

        return await self.store.write(op)

    async def running(self) -> list[dict[str, Any]]:
        """Every running canary, by scenario."""
        rows = await self.store.read(lambda c: c.execute("SELECT * FROM canaries ORDER BY scenario").fetchall())
        return [_canary(r) for r in rows]

    async def end(self, scenario: str, release_id: str) -> None:
        """Forget the scenario's canary of ``release_id`` (its verdict is on the release chain)."""
        await self.store.write(lambda c: c.execute("DELETE FROM canaries WHERE scenario=? AND release_id=?",
                                                   (scenario, release_id)))

    async def arm_outcomes(self, scenario: str, since: float, arms: tuple[str, str]) -> dict[str, Any]:
        """For each arm (a release id): the scores of the reports on its exchanges since ``since`` (one per report),
        its exchanges, how many of them failed, and of the complete ones their times (``ms``), answer lengths in
        tokens (``tokens``), times to the first token (``ttft``, ms) and times per output token after the first
        (``tpot``, ms; answers of two tokens or more): the last two say how fast an arm serves whatever its answers'
        lengths; and whether each complete answer with its tokens recorded loops (``loops``, ``daemon/loops.py``:
        a local engine's answers; an upstream's carry no tokens and are not counted)."""
        total_ms = self.store.json_number("timings", "total_ms")
        ttft_ms = self.store.json_number("timings", "ttft_ms")
        out_tokens = self.store.json_number("usage", "output_tokens")

        def op(conn: Conn) -> dict[str, Any]:
            out: dict[str, Any] = {a: {"scores": [], "exchanges": 0, "errors": 0, "ms": [], "tokens": [],
                                       "ttft": [], "tpot": [], "loops": []} for a in arms}
            for r in conn.execute(
                    f"SELECT id, release_id, {total_ms} AS ms, {ttft_ms} AS ttft, {out_tokens} AS tokens, token_ids"
                    " FROM records"
                    " WHERE scenario=? AND kind='exchange' AND created_at>=? AND release_id IN (?,?)"
                    " AND status='complete'", (scenario, since, *arms)).fetchall():
                arm = out[r["release_id"]]
                if r["ms"] is not None:
                    arm["ms"].append(float(r["ms"]))
                if r["tokens"] is not None:
                    arm["tokens"].append(int(r["tokens"]))
                if r["ttft"] is not None:
                    arm["ttft"].append(float(r["ttft"]))
                    if r["ms"] is not None and r["tokens"] is not None and r["tokens"] >= 2:
                        arm["tpot"].append(max(0.0, float(r["ms"]) - float(r["ttft"])) / (int(r["tokens"]) - 1))
                if r["token_ids"] is not None:
                    arm["loops"].append(self._looped(r["id"], bytes(r["token_ids"])))
            for r in conn.execute(
                    "SELECT release_id, status, COUNT(*) AS n FROM records WHERE scenario=? AND kind='exchange'"
                    " AND created_at>=? AND release_id IN (?,?) GROUP BY release_id, status",
                    (scenario, since, *arms)).fetchall():
                out[r["release_id"]]["exchanges"] += r["n"]
                if r["status"] == "error":
                    out[r["release_id"]]["errors"] += r["n"]
            for r in conn.execute(  # one score per report and arm: a run's report names all its exchanges
                    "SELECT DISTINCT e.release_id, rep.id, rep.seq, rep.report FROM records e JOIN report_refs rr"
                    " ON rr.receipt = e.id JOIN records rep ON rep.id = rr.report_id WHERE e.scenario=?"
                    " AND e.kind='exchange' AND e.created_at>=? AND e.release_id IN (?,?) ORDER BY rep.seq",
                    (scenario, since, *arms)).fetchall():
                score = json.loads(r["report"]).get("score")
                if isinstance(score, (int, float)) and not isinstance(score, bool):
                    out[r["release_id"]]["scores"].append(float(score))
            return out

        return await self.store.read(op)


def _canary(row: Any) -> dict[str, Any]:
    return {"scenario": row["scenario"], "release_id": row["release_id"], "base_id": row["base_id"],
            "share": row["share"], "started_at": row["started_at"], "settings": json.loads(row["settings"])}
