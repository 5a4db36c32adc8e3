"""The record store's hand-off between the event loop and its writer thread (group commit, batched both ways).

Writes made during one loop iteration reach the writer as one batch and are resolved with one callback per
commit; each must still get its own result, a failing write must fail alone, nothing may resolve before its
commit, and a store that is closed must refuse writes rather than leave them waiting forever.

Every test runs against both backends (``records_at``: a SQLite file, a fresh PostgreSQL database in the
session's throwaway cluster).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import threading
import time
import warnings
from dataclasses import replace
from typing import Any

import pytest

from daemon.errors import StorageError
from daemon.records import (
    Conn,
    ExchangeRecord,
    FeedbackReport,
    RecordStore,
    RequestSampling,
    ScoredExchange,
    open_store,
    scored,
)
from daemon.records.exchange_record import columns as exchange_columns


def _store(records_at: str) -> RecordStore:
    store = open_store(records_at)
    store.write_sync(lambda c: c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)"))
    return store


def _insert(k: int, v: str) -> Any:
    """A write that inserts one row and returns its key (from the database, not from the argument)."""
    return lambda c: c.execute("INSERT INTO t VALUES (?, ?) RETURNING k", (k, v)).fetchone()[0]


async def test_concurrent_writes_each_get_their_own_result(records_at: str) -> None:
    store = _store(records_at)
    try:
        results = await asyncio.gather(*(store.write(_insert(i, str(i))) for i in range(500)))
        assert results == list(range(500))
        # a write resolved means committed: another store on the same place (another daemon) sees every row
        fresh = open_store(records_at)
        try:
            assert await fresh.read(lambda c: c.execute("SELECT COUNT(*) FROM t").fetchone()[0]) == 500
        finally:
            fresh.close()
    finally:
        store.close()


async def test_a_failing_write_fails_alone(records_at: str) -> None:
    store = _store(records_at)
    try:
        store.write_sync(lambda c: c.execute("INSERT INTO t VALUES (1, 'taken')"))
        outcomes = await asyncio.gather(store.write(_insert(2, "x")), store.write(_insert(1, "x")),
                                        store.write(_insert(3, "x")), return_exceptions=True)
        assert outcomes[0] == 2 and outcomes[2] == 3
        assert isinstance(outcomes[1], store.IntegrityError)
        rows = await store.read(lambda c: c.execute("SELECT k FROM t ORDER BY k").fetchall())
        assert [r[0] for r in rows] == [1, 2, 3]
    finally:
        store.close()


async def test_nothing_resolves_before_the_commit(records_at: str) -> None:
    store = _store(records_at)
    gate = threading.Event()
    try:
        def slow(c: Conn) -> str:
            gate.wait(5)
            c.execute("INSERT INTO t VALUES (7, 'late')")
            return "done"

        task = asyncio.ensure_future(store.write(slow))
        await asyncio.sleep(0.05)
        assert not task.done()
        gate.set()
        assert await task == "done"
    finally:
        gate.set()
        store.close()


async def test_writes_from_two_loops_and_a_thread(records_at: str) -> None:
    store = _store(records_at)
    try:
        def other_loop() -> list[int]:
            async def run() -> list[int]:
                return list(await asyncio.gather(*(store.write(_insert(i, "b")) for i in range(1000, 1100))))
            return asyncio.run(run())

        theirs = asyncio.get_running_loop().run_in_executor(None, other_loop)
        ours = await asyncio.gather(*(store.write(_insert(i, "a")) for i in range(100)))
        sync = await asyncio.to_thread(store.write_sync, _insert(5000, "s"))
        assert ours == list(range(100)) and await theirs == list(range(1000, 1100)) and sync == 5000
    finally:
        store.close()


async def test_a_closed_store_refuses_writes(records_at: str) -> None:
    store = _store(records_at)
    store.close()
    with pytest.raises(StorageError):
        await asyncio.wait_for(store.write(lambda c: c.execute("INSERT INTO t VALUES (1, 'x')")), 5)
    with pytest.raises(StorageError):
        store.write_sync(lambda c: c.execute("INSERT INTO t VALUES (2, 'x')"))


# columns of ``records`` that are no field of an exchange record: its position, its kind, and what reports and
# forgetting write
NOT_EXCHANGE_FIELDS = {"seq", "kind", "report", "report_key", "report_hash", "forgotten_at", "content_hash"}


async def test_the_records_table_has_a_column_for_each_field_of_an_exchange_record(records_at: str) -> None:
    """The table the migrations make and ``ExchangeRecord`` agree: each of its column fields is a column, each
    column is a field or one of the known others, and a record with every field set reads back as written (the
    insert row and the outcome a stream's record is completed with are read off the same fields)."""
    store = open_store(records_at)
    try:
        table = await store.read(lambda c: [d[0] for d in c.execute("SELECT * FROM records LIMIT 0").description])
        fields = [f.name for f in exchange_columns()]
        assert sorted(set(table) - NOT_EXCHANGE_FIELDS) == sorted(fields)
        full = ExchangeRecord(
            id="rec_full", scenario="s", run="run_1", created_at=1.5, status="error", format="anthropic",
            engine="e", model="m", release_id="rel", content_id="tree", runtime_load_id="load:1", request={"q": 1},
            response={"a": 2}, headers={"x-h": "v"}, timings={"total_ms": 3.0}, usage={"input_tokens": 4},
            prompt_token_ids=[1, 2], token_ids=[3], logprobs=[-0.5], capture=False)
        opened = replace(full, id="rec_open")
        await store.exchanges.append(full)
        # a stream's record: opened with what is known at the start (as the serve path does), its outcome filled
        # in at the end
        start = ("id", "scenario", "run", "created_at", "format", "engine", "model", "release_id", "content_id",
                 "request", "headers", "capture")
        await store.exchanges.open(ExchangeRecord(**{k: getattr(opened, k) for k in start}))
        await store.exchanges.complete(opened)
        for rec in (full, opened):
            got = await store.exchanges.get(rec.id)
            assert {k: got[k] for k in fields} == {k: getattr(rec, k) for k in fields}
    finally:
        store.close()


def _exchange(receipt: str, scenario: str = "s") -> ExchangeRecord:
    return ExchangeRecord(id=receipt, scenario=scenario, status="complete", format="openai-chat", engine="e",
                          model="m", release_id="rel", request={}, response={}, prompt_token_ids=[1, 2],
                          token_ids=[3, 4], logprobs=[-0.5, -0.25])


async def test_serve_only_exchanges_and_ineligible_reports_are_never_read_for_training(records_at: str) -> None:
    """Serve-only traffic (an exchange stored with ``capture`` false) and a report marked
    ``metadata.training.eligible = false`` are stored and shown, and never in what learning reads: scored exchanges
    (weights recipes) and feedback reports (harness recipes). A report naming a captured and a serve-only exchange
    at once is feedback on serve-only traffic too: left out."""
    store = open_store(records_at)
    try:
        await store.exchanges.append(_exchange("rec_kept"))
        await store.exchanges.append(replace(_exchange("rec_serve_only"), capture=False))
        await store.exchanges.append(_exchange("rec_ineligible"))

        async def report(refs: list[str], feedback: str, metadata: dict[str, object] | None = None) -> None:
            await store.reports.append(scenario=None, score=1.0, feedback=feedback, references=refs,
                                      metadata=metadata, report_id=None)

        await report(["rec_serve_only"], "on serve-only traffic")
        await report(["rec_kept", "rec_serve_only"], "on both")
        await report(["rec_ineligible"], "not for training", {"training": {"eligible": False}})
        await report(["rec_kept"], "kept", {"training": {"eligible": True}})
        rows, _ = await store.reports.scored_exchanges("s")
        assert [r.id for r in rows] == ["rec_kept", "rec_kept"]  # from "on both", then "kept"
        feedback, _ = await store.reports.feedback("s")
        assert [f.feedback for f in feedback] == ["kept"]
        # still stored and shown as they are
        assert (await store.exchanges.get("rec_serve_only"))["capture"] is False
        assert (await store.exchanges.get("rec_kept"))["capture"] is True
        assert len((await store.exchanges.get("rec_ineligible"))["reports"]) == 1
        # no scenario row: none made
        assert [s for s in await store.scenarios.summaries() if s.scenario.name == "s"] == []
    finally:
        store.close()


async def test_scenarios_are_read_as_named_types_and_kept_once_read(records_at: str) -> None:
    """``store.scenarios``: what one store has read or made is kept (the serve path announces a scenario only when
    it made it), another store has not read it yet; the listing's counts are named fields, not string keys."""
    store = open_store(records_at)
    try:
        assert not store.scenarios.cached("b")
        for name in ("b", "a"):
            await store.scenarios.ensure(name, recipe=None, model="m", default_recipe="record")
        assert store.scenarios.cached("b") and not store.scenarios.cached("c")
        await store.exchanges.append(_exchange("rec_1", "b"))
        await store.exchanges.append(replace(_exchange("rec_2", "b"), capture=False))
        for receipt, score in (("rec_1", 1.0), ("rec_2", 0.0)):
            await store.reports.append(scenario=None, score=score, feedback=None, references=[receipt], metadata=None,
                                       report_id=None)
        assert [s.name for s in await store.scenarios.all()] == ["a", "b"]
        summaries = {s.scenario.name: s for s in await store.scenarios.summaries()}
        b = summaries["b"]
        assert (b.records, b.serve_only, b.reports, b.mean_score) == (2, 1, 2, 0.5)
        assert summaries["a"].to_dict() == {**summaries["a"].scenario.to_dict(), "records": 0, "serve_only": 0,
                                            "reports": 0, "mean_score": None}
        other = open_store(records_at)  # another daemon's store: it has read nothing yet
        try:
            assert not other.scenarios.cached("b")
            assert (await other.scenarios.get("b")).recipe == "record"
        finally:
            other.close()
    finally:
        store.close()


async def test_a_recipe_receives_named_records_built_the_same_way_on_both_backends(records_at: str) -> None:
    """What a recipe receives: a ``ScoredExchange`` (the exchange's tokens, log-probs and release, and the
    ``FeedbackReport`` that scored it as a field of its own) and, for a feedback recipe, that same report:
    one constructor, so the report read with the exchange equals the report read alone. Both pickle (a
    ``TrainJob`` carries them to the trainer worker). An exchange whose log-probs were not recorded is no
    scored exchange (a recipe would fail on the missing log-probs mid-step, in the trainer)."""
    store = open_store(records_at)
    try:
        await store.exchanges.append(_exchange("rec_a"))
        await store.exchanges.append(replace(_exchange("rec_no_logprobs"), logprobs=None))
        meta = {"source": "judge", "hint": "say less", "group": "g1"}
        stored = await store.reports.append(scenario=None, score=1, feedback="too long", references=["rec_a"],
                                           metadata=meta, report_id="mine")
        await store.reports.append(scenario=None, score=1.0, feedback=None, references=["rec_no_logprobs"],
                                  metadata=None, report_id=None)
        rows, seen = await store.reports.scored_exchanges("s")
        assert [type(r) for r in rows] == [ScoredExchange]
        ex = rows[0]
        assert (ex.id, ex.release_id, ex.prompt_token_ids, ex.token_ids, ex.logprobs) == (
            "rec_a", "rel", [1, 2], [3, 4], [-0.5, -0.25])
        assert ex.score == 1.0 and isinstance(ex.score, float)  # sent as the integer 1
        assert ex.sampling == RequestSampling()
        report = ex.report
        assert (report.id, report.seq, report.score, report.feedback, report.references, report.metadata) == (
            stored["id"], stored["seq"], 1.0, "too long", ("rec_a",), meta)
        assert (report.source, report.hint, report.scenario) == ("judge", "say less", "s")
        assert seen == report.seq
        feedback, _ = await store.reports.feedback("s")
        assert feedback == [report] and type(feedback[0]) is FeedbackReport
        assert pickle.loads(pickle.dumps(ex)) == ex
    finally:
        store.close()


def _scored(hint: str | None = "say less", score: float | None = 0.5) -> ScoredExchange:
    report = FeedbackReport(id="rep_1", seq=7, score=score, feedback="too long", references=("rec_a",),
                            metadata={"hint": hint, "group": "g1"}, hint=hint)
    return ScoredExchange(id="rec_a", release_id="rel", prompt_token_ids=[1, 2], token_ids=[3], logprobs=[-0.5],
                          report=report, sampling=RequestSampling(temperature=0.7))


def test_a_misspelt_field_is_an_error_where_a_dict_answered_none() -> None:
    """A recipe that misspells a field fails at once (a dict's ``.get("hnit")`` was None: the step went on without
    the hint, silently); the records cannot be changed by a recipe, and a scored exchange without a score cannot
    be made."""
    ex = _scored()
    with pytest.raises(AttributeError):
        ex.hnit  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(KeyError, match="no key 'hnit'.*report"):
        ex.get("hnit")
    with pytest.raises(KeyError, match="no key 'scroe'"):
        ex["scroe"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.report = FeedbackReport(id="rep_2", seq=8, score=1.0)  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):  # TypeError on Python 3.11 (a slotted frozen dataclass's bug)
        ex.score = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="rep_1 has none"):
        _scored(score=None)


def test_the_old_dict_keys_still_read_and_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A custom recipe written against the dict keys (docs/writing-a-recipe.md before the named types) still
    reads them, each with a ``DeprecationWarning`` naming the field to read instead, once per key."""
    monkeypatch.setattr(scored, "_warned", set())
    ex = _scored()
    with pytest.warns(DeprecationWarning, match=r"ScoredExchange\['hint'\].*\.report\.hint"):
        assert ex.get("hint") == "say less"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ex["hint"] == "say less"  # warned once already
    old = {"id": "rec_a", "release_id": "rel", "prompt_token_ids": [1, 2], "token_ids": [3], "logprobs": [-0.5],
           "score": 0.5, "report_seq": 7, "source": None, "hint": "say less", "metadata": {"hint": "say less",
           "group": "g1"}, "sampling": {"temperature": 0.7, "top_p": None, "top_k": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert {k: ex[k] for k in old} == old
        report = ex.report
        assert {k: report[k] for k in ("id", "seq", "kind", "status", "release_id", "report")} == {
            "id": "rep_1", "seq": 7, "kind": "report", "status": "complete", "release_id": None,
            "report": {"score": 0.5, "feedback": "too long", "references": ["rec_a"],
                       "metadata": {"hint": "say less", "group": "g1"}}}


async def test_learning_reads_only_what_came_since_its_last_read(records_at: str) -> None:
    """The learning loop's reads: scored exchanges and feedback since a cursor, re-scores included, oldest
    first; a round with nothing new reads nothing."""
    store = open_store(records_at)
    try:
        for r in ("rec_a", "rec_b", "rec_other"):
            await store.exchanges.append(_exchange(r, "other" if r == "rec_other" else "s"))

        async def report(refs: list[str], score: float | None, feedback: str | None = None) -> None:
            await store.reports.append(scenario=None, score=score, feedback=feedback, references=refs, metadata=None,
                                      report_id=None)

        await report(["rec_a", "rec_b"], 0.5)
        await report(["rec_other"], 1.0)
        rows, seen = await store.reports.scored_exchanges("s")
        assert [(r.id, r.score) for r in rows] == [("rec_a", 0.5), ("rec_b", 0.5)]
        assert rows[0].token_ids == [3, 4] and rows[0].logprobs == [-0.5, -0.25]
        assert await store.reports.scored_exchanges("s", after=seen) == ([], seen)
        await report(["rec_a"], 1.0, "better")  # scored again: comes again, with the new score
        rows, seen2 = await store.reports.scored_exchanges("s", after=seen)
        assert [(r.id, r.score) for r in rows] == [("rec_a", 1.0)] and seen2 > seen
        feedback, fseen = await store.reports.feedback("s")
        assert [f.feedback for f in feedback] == ["better"]
        assert await store.reports.feedback("s", after=fseen) == ([], fseen)
    finally:
        store.close()


async def test_a_failing_record_in_a_batch_of_records_fails_alone(records_at: str) -> None:
    """A batch of exchange records goes in as one statement; when that statement fails, each record is tried on
    its own: the good ones are stored, the bad one gets its own error."""
    store = open_store(records_at)
    try:
        outcomes = await asyncio.gather(
            *(store.exchanges.append(_exchange(r)) for r in ("rec_1", "rec_dup", "rec_dup", "rec_2")),
            return_exceptions=True,
        )
        assert outcomes[:2] == [None, None] and outcomes[3] is None
        assert isinstance(outcomes[2], store.IntegrityError)
        for r in ("rec_1", "rec_dup", "rec_2"):
            assert (await store.exchanges.get(r))["id"] == r
    finally:
        store.close()


async def test_one_report_id_sent_to_two_daemons_at_once_is_stored_once(records_at: str) -> None:
    """A client retrying a report on another daemon while its first attempt is still in flight: one report is
    stored and both answers name it. On PostgreSQL two defences give this, and the test fails only without both:
    the writers' advisory lock orders the two check-then-inserts, and without it the loser's insert hits the
    unique key and its write is retried alone (in a savepoint), where it finds the winner's report."""
    a, b = open_store(records_at), open_store(records_at)
    try:
        await a.exchanges.append(_exchange("rec_r"))
        for i in range(20):
            args: dict[str, Any] = {"scenario": None, "score": 1.0, "feedback": None, "references": ["rec_r"],
                                    "metadata": None, "report_id": f"retry-{i}"}
            first, second = await asyncio.gather(a.reports.append(**args), b.reports.append(**args))
            assert first["id"] == second["id"], i
        count = await b.read(lambda c: c.execute("SELECT COUNT(*) FROM records WHERE kind='report'").fetchone()[0])
        assert count == 20
    finally:
        a.close()
        b.close()


async def test_a_report_id_reused_for_another_scenario_is_a_conflict(records_at: str) -> None:
    """The same report id and body sent again naming another scenario is a different report: a 409, not the
    first one's answer (the scenario is part of what a retry must repeat)."""
    from daemon.errors import ReportConflict

    store = open_store(records_at)
    try:
        await store.exchanges.append(_exchange("rec_s"))
        args: dict[str, Any] = {"score": 1.0, "feedback": "ok", "references": ["rec_s"], "metadata": None,
                                "report_id": "rep-key"}
        first = await store.reports.append(scenario="s", **args)
        assert (await store.reports.append(scenario="s", **args))["id"] == first["id"]  # a true retry
        with pytest.raises(ReportConflict):
            await store.reports.append(scenario="other", **args)
    finally:
        store.close()


# --- schema versions -----------------------------------------------------------------------------------------


def _raw(records_at: str, statements: list[str]) -> None:
    """Run SQL on the store's database with the driver itself, as an older (or newer) Reef would have."""
    if records_at.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(records_at, autocommit=True) as conn:
            for s in statements:
                conn.execute(s)
    else:
        import sqlite3

        conn = sqlite3.connect(records_at, isolation_level=None)
        for s in statements:
            conn.execute(s)
        conn.close()


async def test_a_store_written_before_versioning_opens_migrated(records_at: str) -> None:
    """A store as the first Reef wrote it (its tables, no schema_version) opens: its records are there and the
    newer tables were added."""
    from daemon.records.migrations import LATEST, MIGRATIONS, ddl

    dialect = "postgresql" if records_at.startswith("postgresql://") else "sqlite"
    _raw(records_at, ddl(MIGRATIONS[1], dialect) + [
        "INSERT INTO records(id, kind, scenario, created_at, status, request) "
        "VALUES ('rec_old', 'exchange', 's', 1.0, 'complete', '{\"q\": 1}')"])
    store = open_store(records_at)
    try:
        assert store.schema_version == LATEST > 1
        assert (await store.exchanges.get("rec_old"))["request"] == {"q": 1}
        versions = await store.read(lambda c: [r[0] for r in c.execute(
            "SELECT version FROM schema_version ORDER BY version").fetchall()])
        assert versions == list(range(1, LATEST + 1))
        assert (await store.training.lease("trainer", "a", ttl_s=60)).held  # a table of a later migration, usable
    finally:
        store.close()
    again = open_store(records_at)  # opening a current store changes nothing
    try:
        assert again.schema_version == LATEST
    finally:
        again.close()


async def test_a_store_written_by_a_newer_reef_is_refused(records_at: str) -> None:
    from daemon.errors import StoreTooNew
    from daemon.records.migrations import LATEST

    open_store(records_at).close()
    _raw(records_at, [f"INSERT INTO schema_version(version, applied_at) VALUES ({LATEST + 1}, 0)"])
    with pytest.raises(StoreTooNew) as caught:
        open_store(records_at)
    assert caught.value.exit_code == 10
    assert f"schema version {LATEST + 1}" in caught.value.message and f"up to {LATEST}" in caught.value.message


def test_the_daemon_refuses_a_newer_store_with_its_exit_code(tmp_path: Any) -> None:
    """Through ``python -m daemon``: one line saying why, exit 10, before anything is served."""
    import subprocess
    import sys

    from daemon.records.migrations import LATEST
    from tests.conftest import make_home

    home, _, env = make_home(tmp_path / "no-model")
    open_store(str(home / "records.sqlite3")).close()
    _raw(str(home / "records.sqlite3"), [f"INSERT INTO schema_version(version, applied_at) VALUES ({LATEST + 7}, 0)"])
    proc = subprocess.run([sys.executable, "-m", "daemon"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 10, proc.stderr
    assert f"schema version {LATEST + 7}, newer than this Reef knows" in proc.stderr
    assert not (home / "reef.pid").exists()


# --- the training lease and consumption ----------------------------------------------------------------------


async def _until(what: str, check: Any, guard_s: float = 30) -> Any:
    """Poll ``check()`` (a coroutine function) until it gives something true; a hang guard, not a bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard_s
    while True:
        got = await check()
        if got:
            return got
        if loop.time() > deadline:
            raise AssertionError(f"{what}: still not true after {guard_s} s")
        await asyncio.sleep(0.05)


async def test_a_lease_not_renewed_is_taken_over(records_at: str) -> None:
    """Two daemons (two stores on one place): one holds the lease while it renews it; once it stops, the other
    takes it over with a new epoch, and the old holder learns it lost it (renewing and claiming fail)."""
    from daemon.errors import LeaseLost

    a, b = open_store(records_at), open_store(records_at)
    try:
        held = await a.training.lease("trainer", "daemon-a", ttl_s=0.5)
        assert held.held and held.holder == "daemon-a"
        refused = await b.training.lease("trainer", "daemon-b", ttl_s=0.5)
        assert not refused.held and refused.holder == "daemon-a"

        async def renew() -> Any:
            lease = await a.training.lease("trainer", "daemon-a", ttl_s=0.5)
            assert lease.held and lease.epoch == held.epoch, lease
            return lease if lease.expires_at > held.expires_at else None

        # a renewal moves the expiry on (SQLite's clock moves in milliseconds: one within the same one is equal)
        renewed = await _until("a renewal moves the expiry on", renew)
        # daemon-a stops renewing: daemon-b gets it once it expired
        taken = await _until("daemon-b takes the lease over", lambda: _held(b, "daemon-b", 30))
        assert taken.epoch == held.epoch + 1
        lost = await a.training.lease("trainer", "daemon-a", ttl_s=0.5)
        assert not lost.held and lost.holder == "daemon-b"
        with pytest.raises(LeaseLost):
            await a.training.claim("s", ["rec_1"], renewed)
        assert await b.training.claim("s", ["rec_1"], taken) == ["rec_1"]
    finally:
        a.close()
        b.close()


async def test_a_claim_after_the_lease_expired_is_refused_with_no_other_holder(records_at: str) -> None:
    """A holder that let its lease run out may not claim, even though no other daemon took the lease: another
    could take it at any moment and claim the same receipts. Its claim raises and claims nothing."""
    from daemon.errors import LeaseLost

    store = open_store(records_at)
    try:
        lease = await store.training.lease("trainer", "daemon-a", ttl_s=0.2)
        assert lease.held

        async def expired() -> bool:
            return bool(await store.read(lambda c: c.execute(
                f"SELECT expires_at <= {store.NOW} FROM leases WHERE name='trainer'").fetchone()[0]))

        await _until("the lease expires on the database's clock", expired)
        with pytest.raises(LeaseLost):
            await store.training.claim("s", ["rec_1"], lease)
        assert await store.training.consumed("s") == {}
        renewed = await store.training.lease("trainer", "daemon-a", ttl_s=3600)  # taking it again works, as a new lease
        assert await store.training.claim("s", ["rec_1"], renewed) == ["rec_1"]
    finally:
        store.close()


async def _held(store: RecordStore, holder: str, ttl_s: float) -> Any:
    lease = await store.training.lease("trainer", holder, ttl_s=ttl_s)
    return lease if lease.held else None


async def test_a_released_lease_is_taken_at_once(records_at: str) -> None:
    a, b = open_store(records_at), open_store(records_at)
    try:
        held = await a.training.lease("trainer", "daemon-a", ttl_s=3600)
        assert not (await b.training.lease("trainer", "daemon-b", ttl_s=3600)).held
        assert await a.training.release_lease(held)
        assert not await a.training.release_lease(held)  # once
        taken = await b.training.lease("trainer", "daemon-b", ttl_s=3600)  # long before the hour is out
        assert taken.held and taken.epoch == held.epoch + 1
    finally:
        a.close()
        b.close()


async def test_daemons_asking_at_once_get_one_holder(records_at: str) -> None:
    stores = [open_store(records_at) for _ in range(3)]
    try:
        got = await asyncio.gather(*(s.training.lease("trainer", f"daemon-{i}-{j}", ttl_s=3600)
                                     for j in range(10) for i, s in enumerate(stores)))
        winners = {lease.holder for lease in got if lease.held}
        assert len(winners) == 1 and {lease.holder for lease in got} == winners
    finally:
        for s in stores:
            s.close()


async def test_receipts_are_claimed_exactly_once_across_stores(records_at: str) -> None:
    """Two connections claiming the same receipts at once (what two daemons would do): each receipt goes to
    exactly one of them, none to both, none lost."""
    a, b = open_store(records_at), open_store(records_at)
    try:
        lease = await a.training.lease("trainer", "daemon-a", ttl_s=3600)
        receipts = [f"rec_{i}" for i in range(60)]
        chunks = [receipts[i:i + 6] for i in range(0, 60, 6)]
        got = await asyncio.gather(*(s.training.claim("s", chunk, lease) for chunk in chunks for s in (a, b)))
        claimed = [r for g in got for r in g]
        assert sorted(claimed) == sorted(receipts)
        assert await a.training.claim("s", receipts, lease) == []
    finally:
        a.close()
        b.close()


async def test_a_takeover_gives_back_what_the_old_holder_claimed_but_never_settled(records_at: str) -> None:
    """Daemon A claims three receipts, settles one (its release was published), publishes a second without
    settling it (killed right after), and dies before the third's outcome. Daemon B, taking over, cannot claim
    any of them until it recovers A's claims: the one with a written-down outcome stays consumed, the other
    comes back to be learned from."""
    a, b = open_store(records_at), open_store(records_at)
    try:
        la = await a.training.lease("trainer", "daemon-a", ttl_s=0.3)
        assert await a.training.claim("s", ["r1", "r2", "r3"], la) == ["r1", "r2", "r3"]
        assert await a.training.settle("s", ["r1"], la, "release-1") == 1
        lb = await _until("daemon-b takes over", lambda: _held(b, "daemon-b", 3600))
        assert await b.training.claim("s", ["r1", "r2", "r3", "r4"], lb) == ["r4"]
        assert await b.training.recover_claims("s", lb, consumed={"r2"}) == ["r3"]  # r2: found in the published release
        assert await b.training.claim("s", ["r1", "r2", "r3"], lb) == ["r3"]
        assert await b.training.consumed("s") == {"r1": "consumed", "r2": "consumed", "r3": "claimed", "r4": "claimed"}
        assert await a.training.settle("s", ["r3"], la, "release-2") == 0  # A's late outcome settles nothing of B's
    finally:
        a.close()
        b.close()


async def test_settings_changes_at_once_lose_none_and_a_refused_one_changes_nothing(records_at: str) -> None:
    from daemon.errors import Conflict

    store = open_store(records_at)
    try:
        await store.scenarios.ensure("s", recipe="record", model="m", default_recipe="record", settings={"k": 1})

        def add(i: int) -> Any:
            return lambda scen: {**scen.settings, "tasks": [*scen.settings.get("tasks", []), i]}

        await asyncio.gather(*(store.scenarios.change_settings("s", add(i)) for i in range(20)))

        def refuse(scen: Any) -> dict[str, Any]:
            raise Conflict("no")

        with pytest.raises(Conflict):
            await store.scenarios.change_settings("s", refuse)
        fresh = open_store(records_at)  # another daemon on the same store reads what was committed
        try:
            got = (await fresh.scenarios.get("s")).settings
        finally:
            fresh.close()
        assert got["k"] == 1 and sorted(got["tasks"]) == list(range(20)), got  # read and written in one transaction
        assert (await store.scenarios.ensure("s", recipe=None, model="m", default_recipe="record")).settings == got
    finally:
        store.close()


async def test_the_sampling_of_scored_exchanges_is_read_from_the_request(records_at: str) -> None:
    """What a recipe trained on behaviour log-probs needs to know (test_learning: off-raw answers are left out):
    each scored exchange's temperature, top_p and top_k as the client sent them (None: not sent), on both
    backends' JSON functions; an exchange nobody scored is not counted."""
    store = open_store(records_at)
    try:
        def exchange(receipt: str, request: dict[str, Any]) -> ExchangeRecord:
            return replace(_exchange(receipt), request={"model": "m", **request})

        bodies = {"rec_a": {}, "rec_b": {"temperature": 0.7}, "rec_c": {"temperature": 0.7},
                  "rec_d": {"top_p": 0.9, "top_k": 40}, "rec_e": {"temperature": 0.2}}
        for receipt, body in bodies.items():
            await store.exchanges.append(exchange(receipt, body))
        for receipt in ("rec_a", "rec_b", "rec_c", "rec_d"):  # rec_e is never scored
            await store.reports.append(scenario="s", score=1.0, feedback=None, references=[receipt], metadata=None,
                                      report_id=None)
        rows, _ = await store.reports.scored_exchanges("s")
        assert {r.id: r.sampling for r in rows} == {
            "rec_a": RequestSampling(temperature=None, top_p=None, top_k=None),
            "rec_b": RequestSampling(temperature=0.7, top_p=None, top_k=None),
            "rec_c": RequestSampling(temperature=0.7, top_p=None, top_k=None),
            "rec_d": RequestSampling(temperature=None, top_p=0.9, top_k=40),
        }
        counts = sorted((s.temperature or 1, s.top_p or 1, s.top_k or 0, n)
                        for s, n in await store.reports.scored_sampling("s"))
        assert counts == [(0.7, 1, 0, 2), (1, 0.9, 40, 1), (1, 1, 0, 1)]
    finally:
        store.close()


async def test_each_arms_exchange_times_are_read_for_the_canary(records_at: str) -> None:
    """The canary's latency bound (test_canary) reads each arm's complete exchanges' total_ms, on both backends'
    JSON functions: failed exchanges count as errors, not times, and a third release's exchanges are in neither."""
    store = open_store(records_at)
    try:
        def exchange(receipt: str, release: str, ms: float, status: str = "complete") -> ExchangeRecord:
            return ExchangeRecord(id=receipt, scenario="s", status=status, format="openai-chat", engine="e",
                                  model="m", release_id=release, request={}, response={},
                                  timings={"total_ms": ms, "ttft_ms": 1.0})

        for i, (release, ms, status) in enumerate([("head", 100, "complete"), ("head", 120, "complete"),
                                                   ("cand", 300, "complete"), ("cand", 5, "error"),
                                                   ("other", 7, "complete")]):
            await store.exchanges.append(exchange(f"rec_{i}", release, ms, status))
        got = await store.canaries.arm_outcomes("s", 0, ("head", "cand"))
        assert sorted(got["head"]["ms"]) == [100.0, 120.0] and got["cand"]["ms"] == [300.0]
        assert got["cand"]["ttft"] == [1.0] and got["cand"]["tpot"] == []  # no token count: no speed per token
        assert (got["cand"]["exchanges"], got["cand"]["errors"]) == (2, 1)
    finally:
        store.close()


async def test_a_canarys_arms_count_only_what_was_served_since_it_started(records_at: str) -> None:
    """Each arm's figures (exchanges, failures, times, answer lengths, report scores) are of the exchanges served
    since the canary started, whenever they were reported: an exchange served before it, reported after, counts in
    nothing; a cancelled exchange (the client left) is an exchange, not a failure; a report naming two exchanges of
    one arm is one score; whether each complete answer loops, where its tokens were recorded (a cancelled one's
    not). Bugs caught: the window left out of any one of the three reads, reports picked by when the report came,
    every status but ``complete`` counted as failed, an answer without tokens counted as not looping."""
    store = open_store(records_at)
    try:
        since = time.time() - 100

        said = list(range(10, 20)) * 3  # a run of ten tokens said three times: loops
        plain = list(range(100, 130))

        def exchange(receipt: str, release: str, status: str = "complete", *, before: bool = False,
                     tokens: int = 7, ids: list[int] | None = None) -> ExchangeRecord:
            return ExchangeRecord(id=receipt, scenario="s", status=status, format="openai-chat", engine="e",
                                  model="m", release_id=release, request={}, response={},
                                  created_at=since - 50 if before else since + 1,
                                  timings={"total_ms": 10.0 * tokens, "ttft_ms": 1.0},
                                  usage={"input_tokens": 1, "output_tokens": tokens}, token_ids=ids)

        for rec in (exchange("old_h", "head", before=True, tokens=1),
                    exchange("old_c", "cand", before=True, ids=said), exchange("old_e", "cand", "error", before=True),
                    exchange("h1", "head", tokens=30, ids=plain), exchange("c1", "cand", tokens=20, ids=plain),
                    exchange("c2", "cand", tokens=40, ids=said), exchange("c3", "cand", "cancelled", ids=said),
                    exchange("c4", "cand", "error"), exchange("h2", "head", tokens=2),
                    exchange("h3", "head", tokens=1, ids=said)):
            await store.exchanges.append(rec)
        for refs, score in ((["old_h"], 0.0), (["old_c"], 0.0), (["h1"], 0.25), (["c1", "c2"], 0.75)):
            await store.reports.append(scenario=None, score=score, feedback=None, references=refs, metadata=None,
                                       report_id=None)
        got = await store.canaries.arm_outcomes("s", since, ("head", "cand"))
        # speeds: time to first token, and the time after it per output token after the first (299 ms / 29; a
        # two-token answer's 19 ms / 1; a one-token answer has none)
        assert {k: sorted(v) if isinstance(v, list) else v for k, v in got["head"].items()} == {
            "scores": [0.25], "exchanges": 3, "errors": 0, "ms": [10.0, 20.0, 300.0], "tokens": [1, 2, 30],
            "ttft": [1.0, 1.0, 1.0], "tpot": sorted([299.0 / 29, 19.0]), "loops": [False, True]}, got["head"]
        assert got["cand"] == {"scores": [0.75], "exchanges": 4, "errors": 1, "ms": [200.0, 400.0],
                               "tokens": [20, 40], "ttft": [1.0, 1.0], "tpot": [199.0 / 19, 399.0 / 39],
                               "loops": [False, True]}, got["cand"]
    finally:
        store.close()
