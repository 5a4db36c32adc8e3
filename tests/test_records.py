"""The record store's hand-off between the event loop and its writer thread (group commit, batched both ways).

Writes made during one loop iteration reach the writer as one batch and are resolved with one callback per
commit; each must still get its own result, a failing write must fail alone, nothing may resolve before its
commit, and a store that is closed must refuse writes rather than leave them waiting forever.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from daemon.errors import StorageError
from daemon.records import RecordStore


def _store(tmp_path: Path) -> RecordStore:
    store = RecordStore(tmp_path / "records.sqlite3")
    store.write_sync(lambda c: c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)"))
    return store


async def test_concurrent_writes_each_get_their_own_result(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        results = await asyncio.gather(*(
            store.write(lambda c, i=i: c.execute("INSERT INTO t VALUES (?, ?)", (i, str(i))).lastrowid)
            for i in range(500)
        ))
        assert results == list(range(500))
        # a write resolved means committed: a fresh connection sees every row
        fresh = sqlite3.connect(tmp_path / "records.sqlite3")
        assert fresh.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 500
        fresh.close()
    finally:
        store.close()


async def test_a_failing_write_fails_alone(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        store.write_sync(lambda c: c.execute("INSERT INTO t VALUES (1, 'taken')"))

        def insert(k: int):
            return lambda c: c.execute("INSERT INTO t VALUES (?, 'x')", (k,)).lastrowid

        outcomes = await asyncio.gather(store.write(insert(2)), store.write(insert(1)), store.write(insert(3)),
                                        return_exceptions=True)
        assert outcomes[0] == 2 and outcomes[2] == 3
        assert isinstance(outcomes[1], sqlite3.IntegrityError)
        rows = await store.read(lambda c: c.execute("SELECT k FROM t ORDER BY k").fetchall())
        assert [r[0] for r in rows] == [1, 2, 3]
    finally:
        store.close()


async def test_nothing_resolves_before_the_commit(tmp_path: Path) -> None:
    store = _store(tmp_path)
    gate = threading.Event()
    try:
        def slow(c: sqlite3.Connection) -> str:
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


async def test_writes_from_two_loops_and_a_thread(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        def other_loop() -> list[int]:
            async def run() -> list[int]:
                return list(await asyncio.gather(*(
                    store.write(lambda c, i=i: c.execute("INSERT INTO t VALUES (?, 'b')", (i,)).lastrowid)
                    for i in range(1000, 1100)
                )))
            return asyncio.run(run())

        theirs = asyncio.get_running_loop().run_in_executor(None, other_loop)
        ours = await asyncio.gather(*(
            store.write(lambda c, i=i: c.execute("INSERT INTO t VALUES (?, 'a')", (i,)).lastrowid) for i in range(100)
        ))
        sync = await asyncio.to_thread(store.write_sync,
                                       lambda c: c.execute("INSERT INTO t VALUES (5000, 's')").lastrowid)
        assert ours == list(range(100)) and await theirs == list(range(1000, 1100)) and sync == 5000
    finally:
        store.close()


async def test_a_closed_store_refuses_writes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.close()
    with pytest.raises(StorageError):
        await asyncio.wait_for(store.write(lambda c: c.execute("INSERT INTO t VALUES (1, 'x')")), 5)
    with pytest.raises(StorageError):
        store.write_sync(lambda c: c.execute("INSERT INTO t VALUES (2, 'x')"))
