"""The record store's hand-off between the event loop and its writer thread (group commit, batched both ways).

Writes made during one loop iteration reach the writer as one batch and are resolved with one callback per
commit; each must still get its own result, a failing write must fail alone, nothing may resolve before its
commit, and a store that is closed must refuse writes rather than leave them waiting forever.

Every test runs against both backends (``records_at``: a SQLite file, a fresh PostgreSQL database in the
session's throwaway cluster).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from daemon.errors import StorageError
from daemon.records import Conn, RecordStore, open_store


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


def _exchange(receipt: str, scenario: str = "s") -> dict[str, object]:
    return {"id": receipt, "scenario": scenario, "status": "complete", "format": "openai-chat", "engine": "e",
            "model": "m", "release_id": "rel", "request": {}, "response": {}, "prompt_token_ids": [1, 2],
            "token_ids": [3, 4], "logprobs": [-0.5, -0.25]}


async def test_learning_reads_only_what_came_since_its_last_read(records_at: str) -> None:
    """The learning loop's reads: scored exchanges and feedback since a cursor, re-scores included, oldest
    first; a round with nothing new reads nothing."""
    store = open_store(records_at)
    try:
        for r in ("rec_a", "rec_b", "rec_other"):
            await store.append_exchange(_exchange(r, "other" if r == "rec_other" else "s"))

        async def report(refs: list[str], score: float | None, feedback: str | None = None) -> None:
            await store.append_report(scenario=None, score=score, feedback=feedback, references=refs, metadata=None,
                                      report_id=None)

        await report(["rec_a", "rec_b"], 0.5)
        await report(["rec_other"], 1.0)
        rows, seen = await store.scored_exchanges("s")
        assert [(r["id"], r["score"]) for r in rows] == [("rec_a", 0.5), ("rec_b", 0.5)]
        assert rows[0]["token_ids"] == [3, 4] and rows[0]["logprobs"] == [-0.5, -0.25]
        assert await store.scored_exchanges("s", after=seen) == ([], seen)
        await report(["rec_a"], 1.0, "better")  # scored again: comes again, with the new score
        rows, seen2 = await store.scored_exchanges("s", after=seen)
        assert [(r["id"], r["score"]) for r in rows] == [("rec_a", 1.0)] and seen2 > seen
        feedback, fseen = await store.feedback_reports("s")
        assert [f["report"]["feedback"] for f in feedback] == ["better"]
        assert await store.feedback_reports("s", after=fseen) == ([], fseen)
    finally:
        store.close()


async def test_a_failing_record_in_a_batch_of_records_fails_alone(records_at: str) -> None:
    """A batch of exchange records goes in as one statement; when that statement fails, each record is tried on
    its own: the good ones are stored, the bad one gets its own error."""
    store = open_store(records_at)
    try:
        outcomes = await asyncio.gather(
            *(store.append_exchange(_exchange(r)) for r in ("rec_1", "rec_dup", "rec_dup", "rec_2")),
            return_exceptions=True,
        )
        assert outcomes[:2] == [None, None] and outcomes[3] is None
        assert isinstance(outcomes[2], store.IntegrityError)
        for r in ("rec_1", "rec_dup", "rec_2"):
            assert (await store.get_record(r))["id"] == r
    finally:
        store.close()
