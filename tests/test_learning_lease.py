"""The training lease as the learning loop keeps it (``daemon/learning_lease.py``), on a real record store: a lease
whose renewal gets no answer is not trusted past its term (another daemon may have taken it over meanwhile), and is
trusted again once the store answers."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path

from daemon.learning_lease import LeaseKeeper
from daemon.records import Lease, SQLiteStore


async def _until(what: str, done: Callable[[], bool], timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done():
        assert loop.time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


async def test_a_lease_whose_renewal_hangs_is_not_trusted_past_its_term(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "records.sqlite3")
    took: list[Lease] = []
    took_over = asyncio.Event()

    async def on_took_over(lease: Lease) -> None:
        took.append(lease)
        took_over.set()

    async def look_for_work() -> None:
        pass

    keeper = LeaseKeeper(store.training, 3.0, took_over=on_took_over, look_for_work=look_for_work)
    keeper.start()
    try:
        await asyncio.wait_for(took_over.wait(), 60)
        assert keeper.held() == took[0] and took[0].holder == keeper.holder
        # another connection holds the write lock: the next renewal waits on the database (busy_timeout, 10 s)
        blocker = sqlite3.connect(store.path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            await _until("the unanswered lease is no longer trusted", lambda: keeper.held() is None, 8)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        await _until("the lease is held again once the store answers", lambda: keeper.held() is not None, 60)
        assert len(took) == 1  # the same holder renewed it: no takeover in between
    finally:
        await keeper.stop()
        await keeper.release()
        store.close()
