"""Receipt cost: the record store on PostgreSQL vs SQLite, in one run.

A receipt goes out once its record's transaction committed, so the time of ``append_exchange`` (a record of an
agent's size: a 4 kB request, a short answer, 64 token ids and log-probs) is what recording adds to a request.
Both stores are durable as configured for real use: SQLite in WAL with ``synchronous=FULL``; PostgreSQL a fresh
throwaway cluster (``tests/pg.py``, fsync on, ``synchronous_commit`` on) on loopback TCP. Rounds alternate
(sqlite, postgresql, postgresql, sqlite, ...) so that a change in the machine's load falls on both alike.

A third store, PostgreSQL with fsync off (not durable, never for real use), separates what the protocol and
Reef's code cost from what the disk's flush costs: on a virtual disk whose flush takes milliseconds, that flush
is most of a PostgreSQL commit. ``pg_test_fsync`` (printed first) says what one flush costs on this disk, and two
rows that are no store measure it in the same rounds, at concurrency 1: one 8 kB ``pwrite`` and ``fdatasync`` of a
preallocated file per record, in a worker thread, either over the same page each time (``flush-rewrite``: what
PostgreSQL does for a small commit, which rewrites the WAL's last, partly filled page) or at the next page each
time (``flush-append``: what SQLite's WAL does, appending frames).

Figures:
1. concurrency 1: p50 / p99 of one durable write; goal: PostgreSQL adds <= 1 ms p50;
2. concurrency 16: records/s, p50 / p99, and records per commit (group commit: one transaction and one WAL flush
   for every record queued while the previous commit ran).

Run: ``.venv/bin/python bench/records_pg.py [--requests N] [--rounds R]`` (under a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from daemon.records import ExchangeRecord, RecordStore, new_id, open_store  # noqa: E402
from tests.pg import PgCluster  # noqa: E402

REQUEST = {"model": "bench", "messages": [{"role": "user", "content": "x" * 4000}]}
RESPONSE = {"choices": [{"message": {"role": "assistant", "content": "a short answer"}}]}


def _record() -> ExchangeRecord:
    return ExchangeRecord(id=new_id("rec_"), scenario="bench", format="openai-chat", engine="bench", model="bench",
                          release_id="rel", request=REQUEST, response=RESPONSE, timings={"total_ms": 1.0},
                          prompt_token_ids=list(range(64)), token_ids=list(range(64)), logprobs=[-0.5] * 64)


async def _round(store: RecordStore | _FlushFloor, requests: int, concurrency: int) -> dict[str, float]:
    commits = 0
    committed = store._committed

    def count() -> None:
        nonlocal commits
        commits += 1
        committed()

    store._committed = count  # type: ignore[method-assign,assignment]
    latencies: list[float] = []
    todo = iter(range(requests))

    async def worker() -> None:
        for _ in todo:
            t0 = time.perf_counter()
            await store.exchanges.append(_record())
            latencies.append((time.perf_counter() - t0) * 1e3)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    store._committed = committed  # type: ignore[method-assign]
    latencies.sort()
    return {"p50": statistics.median(latencies), "p99": latencies[int(len(latencies) * 0.99) - 1],
            "rps": requests / wall, "per_commit": requests / max(commits, 1)}


class _FlushFloor:
    """Not a record store: per record, one 8 kB write and ``fdatasync`` of a preallocated file (what PostgreSQL's
    WAL flush does, without the server), off the event loop as the stores' writers are."""

    def __init__(self, path: Path, *, advance: bool) -> None:
        self._advance = advance
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.write(self._fd, b"\0" * (16 << 20))  # like a WAL segment: overwritten, never grown
        os.fsync(self._fd)
        self._page = b"r" * 8192
        self._offset = 0

    def _committed(self) -> None:
        pass

    def _flush(self) -> None:
        os.pwrite(self._fd, self._page, self._offset)
        if self._advance:
            self._offset = (self._offset + 8192) % (16 << 20)
        os.fdatasync(self._fd)
        self._committed()

    async def append_exchange(self, rec: ExchangeRecord) -> None:
        await asyncio.to_thread(self._flush)

    def close(self) -> None:
        os.close(self._fd)


def _fsync_cost(cluster: PgCluster) -> None:
    import subprocess

    out = subprocess.run([str(cluster.bindir / "pg_test_fsync"), "-s", "1", "-f", str(cluster.root / "probe")],
                         capture_output=True, text=True, timeout=120).stdout
    line = next((ln.strip() for ln in out.splitlines() if ln.strip().startswith("fdatasync")), "?")
    print(f"pg_test_fsync on this disk, one 8 kB write: {' '.join(line.split())}")


def _summary(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


async def main(requests: int, rounds: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    cluster, unsynced = PgCluster(durable=True), PgCluster(durable=False)
    _fsync_cost(cluster)
    stores = {"sqlite": open_store(str(tmp / "records.sqlite3")), "postgresql": open_store(cluster.create_database()),
              "pg-nofsync": open_store(unsynced.create_database()), "flush-rewrite": _FlushFloor(tmp / "rewrite", advance=False),
              "flush-append": _FlushFloor(tmp / "append", advance=True)}
    try:
        for store in stores.values():  # warm up: connections, prepared statements, the page cache
            await _round(store, 200, 4)
        for concurrency in (1, 16):
            # the floor only at concurrency 1: it has no group commit, so at 16 it would measure the thread pool
            names = [n for n in stores if concurrency == 1 or not n.startswith("flush-")]
            got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            for i in range(rounds):  # each round every store once, the order turning, so load drifts fall alike
                for name in names[i % len(names):] + names[:i % len(names)]:
                    got[name].append(await _round(stores[name], requests, concurrency))
            s = _summary(got["sqlite"])
            print(f"concurrency {concurrency} ({requests} records x {rounds} rounds each, medians of rounds):")
            for name in names:
                r = _summary(got[name])
                print(f"  {name:<13} p50 {r['p50']:6.3f} ms  p99 {r['p99']:6.3f} ms  {r['rps']:8.0f} records/s"
                      f"  {r['per_commit']:5.1f} records per commit"
                      + ("" if name == "sqlite" or name.startswith("flush-") else
                         f"  (vs sqlite: {r['p50'] - s['p50']:+.3f} ms p50, x{r['rps'] / s['rps']:.2f} throughput)"))
    finally:
        for store in stores.values():
            store.close()
        cluster.close()
        unsynced.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    asyncio.run(main(args.requests, args.rounds))
