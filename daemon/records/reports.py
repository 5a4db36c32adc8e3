"""Reports, a part of the record store (``RecordStore.reports``): a report on receipts stored (kind ``report``;
``report_refs`` indexes which receipts it names), and what learning reads of them: scored exchanges and written
feedback, newer than a cursor.

Both reads give the named types of ``daemon/records/scored.py``, built the same way on both backends. Only
captured exchanges, and reports not marked ineligible (``metadata.training.eligible`` false), are ever read for
training.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from daemon.errors import BadRequest, Forgotten, ReportConflict, UnknownReceipts
from daemon.records.conn import Conn, Rows
from daemon.records.rows import SUMMARY_COLUMNS, RecordRow, dumps, marks, new_id, record, unpack
from daemon.records.scored import FeedbackReport, RequestSampling, ScoredExchange

SAMPLING = ("temperature", "top_p", "top_k")  # the request fields that shape the sampled distribution


def training_eligible(report: Any) -> bool:
    """Whether a stored report may be trained on: not when its ``metadata.training.eligible`` is false."""
    metadata = report.get("metadata") if isinstance(report, dict) else None
    training = metadata.get("training") if isinstance(metadata, dict) else None
    return not (isinstance(training, dict) and training.get("eligible") is False)


def report_hash(body: dict[str, Any], scenario: str | None) -> str:
    """What a report is compared by when its ``report_id`` comes again: its body and its scenario."""
    return hashlib.sha256(json.dumps({**body, "scenario": scenario}, sort_keys=True,
                                     ensure_ascii=False).encode()).hexdigest()


class Reports:
    """The report records of one record store, and the reads that learning makes of them."""

    def __init__(self, store: Rows) -> None:
        self.store = store

    async def append(
        self,
        *,
        scenario: str | None,
        score: float | None,
        feedback: Any,
        references: list[str],
        metadata: Any,
        report_id: str | None,
    ) -> RecordRow:
        """Store a report on receipts; idempotent on ``report_id``. Returns the stored report record."""
        body = {"score": score, "feedback": feedback, "references": references, "metadata": metadata}
        digest = report_hash(body, scenario)

        def op(conn: Conn) -> RecordRow:
            if report_id is not None:
                prior = conn.execute(
                    f"SELECT {SUMMARY_COLUMNS}, report_hash FROM records WHERE report_key=?", (report_id,)
                ).fetchone()
                if prior is not None:
                    if prior["report_hash"] != digest:
                        raise ReportConflict(
                            f"report_id {report_id!r} was already used with a different body", report_id=report_id
                        )
                    return record(prior)
            rows = [] if not references else conn.execute(
                f"SELECT id, scenario, forgotten_at FROM records WHERE kind='exchange' AND id IN ({marks(references)})",
                references,
            ).fetchall()
            found = {r["id"]: r["scenario"] for r in rows}
            missing = [r for r in references if r not in found]
            scen = scenario or (found[references[0]] if found else None)
            foreign = [r for r, s in found.items() if s != scen]
            if missing or foreign:
                raise UnknownReceipts(missing + foreign, scen)
            forgotten = [r["id"] for r in rows if r["forgotten_at"] is not None]
            if forgotten:
                raise Forgotten(forgotten)
            rid = new_id("rep_")
            now = time.time()
            conn.execute(
                "INSERT INTO records(id, kind, scenario, created_at, status, report, report_key, report_hash)"
                " VALUES (?,?,?,?,?,?,?,?)",
                (rid, "report", scen, now, "complete", dumps(body), report_id, digest),
            )
            conn.executemany(
                "INSERT INTO report_refs(report_id, receipt) VALUES (?,?) ON CONFLICT DO NOTHING",
                [(rid, r) for r in references],
            )
            return record(conn.execute(f"SELECT {SUMMARY_COLUMNS} FROM records WHERE id=?", (rid,)).fetchone())

        if not references and not (scenario and isinstance(metadata, dict) and metadata.get("kind") == "instruction"):
            raise BadRequest("references must name at least one receipt", param="references")
        return await self.store.write(op)

    def _sampling_columns(self, request: str) -> str:
        return ", ".join(f"{self.store.json_number(request, k)} AS {k}" for k in SAMPLING)

    async def scored_exchanges(self, scenario: str, *, after: int = 0) -> tuple[list[ScoredExchange], int]:
        """Exchanges of a scenario scored by reports newer than report seq ``after``, in report order (an exchange
        scored again comes again, with its new report), and the seq of the last report read (``after`` when there
        is none): what learning recipes train on, read a little at a time. Only captured, complete exchanges whose
        prompt tokens, answer tokens and log-probs were all recorded (local engines) are scored exchanges."""

        score = self.store.json_number("rep.report", "score")
        sampling = self._sampling_columns("r.request")

        def op(conn: Conn) -> tuple[list[ScoredExchange], int]:
            rows = conn.execute(
                f"""SELECT r.id, r.release_id, r.prompt_token_ids, r.token_ids, r.logprobs, {sampling},
                          rep.id AS report_id, rep.report, rep.seq AS report_seq, rep.created_at AS report_created_at
                   FROM records rep
                   JOIN report_refs rr ON rr.report_id = rep.id
                   JOIN records r ON r.id = rr.receipt
                   WHERE rep.kind = 'report' AND rep.seq > ? AND r.scenario = ? AND r.kind = 'exchange'
                     AND r.status = 'complete' AND r.capture = 1 AND r.token_ids IS NOT NULL
                     AND r.prompt_token_ids IS NOT NULL AND r.logprobs IS NOT NULL
                     AND {score} IS NOT NULL
                   ORDER BY rep.seq""",
                (after, scenario),
            ).fetchall()
            out = []
            for row in rows:
                report = json.loads(row["report"])
                if not training_eligible(report):
                    continue
                out.append(ScoredExchange(
                    id=row["id"],
                    release_id=row["release_id"],
                    prompt_token_ids=unpack(row["prompt_token_ids"], "i") or [],
                    token_ids=unpack(row["token_ids"], "i") or [],
                    logprobs=unpack(row["logprobs"], "f") or [],
                    report=FeedbackReport.from_stored(id=row["report_id"], seq=row["report_seq"], body=report,
                                                      scenario=scenario, created_at=row["report_created_at"]),
                    sampling=RequestSampling.from_mapping({k: row[k] for k in SAMPLING}),
                ))
            return out, (rows[-1]["report_seq"] if rows else after)

        return await self.store.read(op)

    async def scored_sampling(self, scenario: str) -> list[tuple[RequestSampling, int]]:
        """The sampling settings of a scenario's scored, captured exchanges, with how many were served with each
        (what a recipe trained on behaviour log-probs can use, and what it leaves out)."""
        sampling = self._sampling_columns("r.request")

        def op(conn: Conn) -> list[tuple[RequestSampling, int]]:
            rows = conn.execute(
                f"""SELECT {", ".join(SAMPLING)}, COUNT(*) AS n FROM (
                      SELECT {sampling} FROM records r
                      WHERE r.scenario = ? AND r.kind = 'exchange' AND r.status = 'complete' AND r.capture = 1
                        AND r.token_ids IS NOT NULL AND r.prompt_token_ids IS NOT NULL AND r.logprobs IS NOT NULL
                        AND EXISTS (SELECT 1 FROM report_refs rr WHERE rr.receipt = r.id)) s
                   GROUP BY {", ".join(SAMPLING)}""",
                (scenario,),
            ).fetchall()
            return [(RequestSampling.from_mapping({k: row[k] for k in SAMPLING}), int(row["n"])) for row in rows]

        return await self.store.read(op)

    async def feedback(self, scenario: str, *, after: int = 0) -> tuple[list[FeedbackReport], int]:
        """Reports on a scenario that carry written feedback, newer than seq ``after``, oldest first, and the seq
        of the last one (``after`` when there is none): what harness recipes learn from."""

        feedback = self.store.json_field("report", "feedback")

        def op(conn: Conn) -> tuple[list[FeedbackReport], int]:
            rows = conn.execute(
                f"""SELECT seq, id, scenario, created_at, report FROM records rep
                    WHERE kind = 'report' AND scenario = ? AND seq > ? AND {feedback} IS NOT NULL
                      AND NOT EXISTS (SELECT 1 FROM report_refs rr JOIN records r ON r.id = rr.receipt
                                      WHERE rr.report_id = rep.id AND r.capture = 0)
                    ORDER BY seq""",
                (scenario, after),
            ).fetchall()
            out = []
            for row in rows:
                body = json.loads(row["report"])
                if training_eligible(body):
                    out.append(FeedbackReport.from_stored(id=row["id"], seq=row["seq"], body=body,
                                                          scenario=row["scenario"], created_at=row["created_at"]))
            return out, (rows[-1]["seq"] if rows else after)

        return await self.store.read(op)
