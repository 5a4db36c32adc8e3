"""The event loop stays free while big bodies are parsed and big exports stream (issue 42).

Measured the way the daemon measures itself: ``reef_event_loop_held_seconds`` (``daemon/metrics.py``) is how late
the loop ran a 20 ms timer, less the time the loop's thread waited for a CPU and at most the CPU time the process
used meanwhile: the stall its own work caused, which a 2-core machine busy with other tests does not inflate. The
bound is the issue's 0.1 s: no tick may be held past the 0.08 s bucket (a stall shows at least 20 ms short).
Bodies here are a few MB, not the 64 MiB limit, so the suite stays quick: every step that grows with a body is cut
into pieces of bounded size, so the lag does not grow with it (bench/big_body.py measures up to the limit; the
figures are in docs/durability.md)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, assert_canonical_error

BOUND_BUCKET = 0.08  # + the 20 ms tick: no stall of 0.1 s or more


def held_buckets(c: httpx.Client, name: str = "held") -> dict[float, float]:
    """The daemon's ``reef_event_loop_<name>_seconds`` histogram: bucket bound -> observations at or under it."""
    out: dict[float, float] = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f"reef_event_loop_{name}_seconds_bucket{{"):
            out[float(line.split('le="', 1)[1].split('"', 1)[0])] = float(line.rsplit(" ", 1)[1])
    assert out, "the daemon has no loop-lag histogram"
    return out


def gc_off(c: httpx.Client) -> float:
    """The daemon's ``reef_gc_off`` gauge: 1 while its cyclic garbage collector is off."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("reef_gc_off "):
            return float(line.split()[1])
    raise AssertionError("the daemon has no reef_gc_off gauge")


def worst(before: dict[float, float], after: dict[float, float]) -> float:
    """The smallest bucket bound that holds every observation made between two readings."""
    total = after[float("inf")] - before[float("inf")]
    return min(le for le in after if after[le] - before[le] >= total)


def settled(c: httpx.Client, before: dict[float, float]) -> dict[float, float]:
    """The histogram once the loop's watch has run twice since ``before`` was taken after the work: its last
    stall, if any, is in it."""
    while True:
        now = held_buckets(c)
        if now[float("inf")] - before[float("inf")] >= 2:
            return now


def chat_many(mb: float) -> tuple[str, bytes]:
    msgs = [{"role": "user", "content": "hello world " * 8} for _ in range(int(mb * 2**20) // 130)]
    return "/v1/chat/completions", json.dumps({"model": "tiny", "max_tokens": 4, "messages": msgs}).encode()


def anthropic_blocks(mb: float) -> tuple[str, bytes]:
    blocks = [{"type": "text", "text": "hi"}] * (int(mb * 2**20) // 29)
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]}
    return "/v1/messages", json.dumps(body).encode()


def one_string(mb: float) -> tuple[str, bytes]:
    msgs = [{"role": "user", "content": "hello world " * (int(mb * 2**20) // 12)}]
    return "/v1/chat/completions", json.dumps({"model": "tiny", "max_tokens": 4, "messages": msgs}).encode()


@pytest.mark.parametrize("make", [chat_many, anthropic_blocks, one_string],
                         ids=["80k chat messages", "290k anthropic blocks", "one 40 MB string"])
def test_a_big_body_never_holds_the_loop(daemon: Daemon, make: Any) -> None:
    """The issue's bodies (many short messages, many Anthropic text blocks) and one long string: decoded, parsed,
    refused (longer than the tiny model's context) and freed without the loop held 0.1 s at any moment; meanwhile
    ``/healthz`` answers (a client sees the loop turn), and the daemon serves on afterwards."""
    path, body = make(40 if make is one_string else 9)
    daemon.wait_loaded()
    with daemon.http() as c:
        before = held_buckets(c)
        answered: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answered.append(c.post(path, content=body, timeout=600, headers={
            "content-type": "application/json"})))
        t.start()
        probes = 0
        with daemon.http() as probe:
            while t.is_alive():
                assert probe.get("/healthz").status_code == 200
                probes += 1
                t.join(0.02)
        after = settled(c, held_buckets(c))
        shape = "anthropic" if path == "/v1/messages" else "openai"
        err = assert_canonical_error(answered[0], 400, shape)
        assert "prompt is too long" in err["message"], err
        # the collector, held off while the parse lived, is on again once it is freed (before the answer went)
        assert gc_off(c) == 0.0, "the garbage collector stays off after a big body"
        assert probes > 3, probes
        assert worst(before, after) <= BOUND_BUCKET, (worst(before, after), after)
        ok = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text


async def test_the_watch_counts_the_loop_held_not_a_thread_asleep() -> None:
    """The measure itself, against something different: a callback that holds the loop 0.3 s is seen as held (and
    as lag); a thread that sleeps 0.3 s (no GIL held) is seen as neither; the CPU-time bound keeps a loop that
    waits, without working, from counting as held."""
    import asyncio

    from prometheus_client import CollectorRegistry, Histogram

    from daemon.metrics import _LAG_BUCKETS, watch_loop_lag

    r = CollectorRegistry()
    lag = Histogram("lag", "", buckets=_LAG_BUCKETS, registry=r)
    held = Histogram("held", "", buckets=_LAG_BUCKETS, registry=r)

    def over(h: Histogram, bound: float) -> float:
        total = r.get_sample_value(f"{h._name}_count") or 0.0
        return total - (r.get_sample_value(f"{h._name}_bucket", {"le": str(bound)}) or 0.0)

    watch = asyncio.create_task(watch_loop_lag(lag, held))
    try:
        await asyncio.sleep(0.1)
        await asyncio.to_thread(time.sleep, 0.3)  # a thread asleep: the loop turns meanwhile
        await asyncio.sleep(0.05)
        assert over(held, 0.1) == 0  # (the lag may not be 0: this machine's queue for a CPU)
        lagged = over(lag, 0.1)
        end = time.process_time() + 0.3
        while time.process_time() < end:  # the loop's own thread busy 0.3 s of CPU
            pass
        await asyncio.sleep(0.05)
        assert over(held, 0.1) == 1 and over(lag, 0.1) >= lagged + 1
        lagged = over(lag, 0.1)
        time.sleep(0.3)  # the loop blocked, but working on nothing: lag, not held
        await asyncio.sleep(0.05)
        assert over(lag, 0.1) >= lagged + 1 and over(held, 0.1) == 1
    finally:
        watch.cancel()


def build_export(c: httpx.Client, records: int, size: int) -> int:
    """``records`` exchanges of ``size`` bytes of prompt each, imported in batches; returns the stored bytes."""
    batch = max(1, (32 << 20) // size)
    for start in range(0, records, batch):
        items = [{"id": f"rec_big{i:05d}", "scenario": "big",
                  "prompt": [{"role": "user", "content": f"{i:05d} " + "x" * size}],
                  "completion": [{"role": "assistant", "content": "ok"}]}
                 for i in range(start, min(records, start + batch))]
        r = c.post("/reef/records/import", json={"items": items}, timeout=600)
        assert r.status_code == 201, r.text
    return records * size


def import_many_messages(c: httpx.Client, n: int) -> None:
    """One exchange whose prompt is ``n`` short messages: one record that is a lot of work to render."""
    prompt = [{"role": "user", "content": f"m{i}"} for i in range(n)]
    r = c.post("/reef/records/import", timeout=600, json={"items": [
        {"id": "rec_many", "scenario": "many", "prompt": prompt, "completion": [{"role": "assistant", "content": "ok"}]}]})
    assert r.status_code == 201, r.text


def peak_reset(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS (VmHWM) starts again from the RSS now


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(key)


def test_a_big_export_streams_with_bounded_memory_and_a_free_loop(daemon_factory: Any) -> None:
    """Exporting 160 MB of records (records of 1 MB: a page of 500 would be the whole export) and one record of
    200,000 messages holds the daemon's memory to a page's worth, far below the export's size, and never holds the
    loop 0.1 s; every record arrives, oldest first, whole."""
    d: Daemon = daemon_factory().wait_loaded()  # the model's load is not what is measured
    records, size = 160, 1 << 20
    with d.http() as c:
        stored = build_export(c, records, size)
        import_many_messages(c, 200_000)
        pid = d.proc.pid if d.proc is not None else 0
        rss = status_kb(pid, "VmRSS")
        peak_reset(pid)
        before = held_buckets(c)
        seen, got = [], 0
        with c.stream("GET", "/reef/records/export", params={"scenario": "big"}, timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                row = json.loads(line)
                got += len(line)
                seen.append(row["id"])
                content = row["prompt"][0]["content"]
                assert len(content) == size + 6 and content.startswith(row["id"][-5:]), row["id"]
        grew_mb = (status_kb(pid, "VmHWM") - rss) / 1024
        # one record of 200,000 messages: a lot of work for one line (its memory is the record's, not the page's)
        many = c.get("/reef/records/export", params={"scenario": "many"}, timeout=600)
        prompt = json.loads(many.text)["prompt"]
        assert len(prompt) == 200_000 and prompt[-1]["content"] == "m199999"
        after = settled(c, held_buckets(c))
    assert seen == [f"rec_big{i:05d}" for i in range(records)]
    assert got > stored
    # a page is 4 MB of stored bodies: its decode, its lines and the send buffer stay within tens of MB (16-20 MB
    # here; 44 once in CI, where pages rendered on several pool threads each kept glibc heap of their own); the
    # export held whole, or pages of 500 records, would be 160 MB
    assert grew_mb < stored / 2**20 / 3, f"RSS grew {grew_mb:.0f} MB exporting {stored / 2**20:.0f} MB"
    assert worst(before, after) <= BOUND_BUCKET, (worst(before, after), after)


async def test_export_pages_are_bounded_in_bytes_and_go_on_where_they_stopped(records_at: str) -> None:
    """The store's page: records until they hold the byte budget (at least one, however big), and the seq to go on
    after; the next page starts there, so nothing is skipped or repeated, on either backend."""
    from daemon.records import ExchangeRecord, open_store

    store = open_store(records_at)
    ids = [f"rec_{i}" for i in range(7)]
    try:
        for rid in ids:
            await store.exchanges.append(ExchangeRecord(id=rid, scenario="s", request={"p": "x" * 300_000},
                                                       response={}))
        await store.exchanges.append(ExchangeRecord(id="rec_other", scenario="t", request={}, response={}))

        async def pages(max_bytes: int, limit: int = 500) -> list[list[str]]:
            out: list[list[str]] = []
            after: int | None = 0
            while after is not None:
                page, after = await store.user_data.export_page(scenario="s", since=None, after=after, limit=limit,
                                                      max_bytes=max_bytes)
                out.append([r["id"] for r in page])
            return out

        assert await pages(700_000) == [ids[0:3], ids[3:6], ids[6:7]]  # until a page holds the budget
        # one record over the budget still makes a page; a full page may have more after it (here: none)
        assert await pages(1) == [[rid] for rid in ids] + [[]]
        assert await pages(10 << 20) == [ids]
        assert await pages(10 << 20, limit=3) == [ids[0:3], ids[3:6], ids[6:7]]
        assert await pages(10 << 20, limit=7) == [ids, []]  # a full page by count: maybe more
    finally:
        store.close()
