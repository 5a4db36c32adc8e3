"""A receipt handed out is a record that survives ``kill -9`` (shared/TESTING.md item 1).

Clients note each receipt only after its response completed; the daemon is killed at a random moment while
requests are in flight, restarted, and killed again, over repeated cycles. Afterwards every noted receipt is
present exactly once and the store passes ``PRAGMA integrity_check``."""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from typing import Any

import httpx

from tests.conftest import Daemon, sse_events

CYCLES = 8


def _drive(d: Daemon, stop: threading.Event, noted: list[str], seed: int) -> None:
    rng = random.Random(seed)
    token = d.token
    with httpx.Client(base_url=d.url, headers={"x-api-key": token}, timeout=30) as c:
        while not stop.is_set():
            stream = rng.random() < 0.5
            body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(1, 6), "stream": stream,
                                    "messages": [{"role": "user", "content": f"n {rng.random()}"}]}
            try:
                resp = c.post("/v1/chat/completions", json=body, headers={"x-reef-scenario": "durable"})
                if resp.status_code != 200:
                    continue
                if stream:
                    events = sse_events(resp.text)
                    if not events or events[-1][1] != "[DONE]":
                        continue  # cut off by the kill: no receipt was handed out
                    receipt = next(e["reef"]["record_id"] for _, e in events if isinstance(e, dict) and "reef" in e)
                else:
                    receipt = resp.headers["x-reef-agent-record-id"]
                noted.append(receipt)
            except (httpx.HTTPError, OSError):
                time.sleep(0.02)


def test_receipts_survive_kill_9(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().wait_loaded()
    noted: list[str] = []
    rng = random.Random(7)
    for cycle in range(CYCLES):
        stop = threading.Event()
        threads = [threading.Thread(target=_drive, args=(d, stop, noted, cycle * 10 + i)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.3, 1.2))
        d.kill9()
        stop.set()
        for t in threads:
            t.join()
        d.start().wait_loaded()  # the clients measure durability, not the model's load after each start
    assert len(noted) > CYCLES * 3, "the clients should have completed requests between kills"
    d.stop()
    db = sqlite3.connect(d.home / "records.sqlite3")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    counts = dict(db.execute(
        f"SELECT id, COUNT(*) FROM records WHERE id IN ({','.join('?' * len(noted))}) GROUP BY id", noted
    ).fetchall())
    missing = [r for r in noted if r not in counts]
    assert not missing, f"{len(missing)} acknowledged receipts lost: {missing[:5]}"
    assert all(n == 1 for n in counts.values())
    assert len(set(noted)) == len(noted)


def test_a_streams_headers_say_what_its_receipt_cost_the_first_token(daemon_factory: Any) -> None:
    """A stream's receipt goes out in its headers, so its record is opened durably before the first byte, beside
    the engine's work on its first event; ``Server-Timing`` says how long each took and how long the first event
    waited for the write (bench/first_token.py reads them). Catches the split dropped, or a wait measured from the
    wrong instant (more than the write itself: they run side by side)."""
    d: Daemon = daemon_factory().wait_loaded()
    with d.http() as c:
        for stream in (True, False):
            r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "stream": stream,
                                                     "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            timing = {p.split(";")[0].strip(): float(p.split("dur=")[1]) for p in r.headers["Server-Timing"].split(",")}
            if stream:
                assert set(timing) == {"engine", "record", "receipt-wait"}, timing
                assert timing["record"] > 0 and timing["engine"] > 0, timing
                assert 0 <= timing["receipt-wait"] <= timing["record"], timing
            else:
                assert set(timing) == {"engine", "record", "total"}, timing
