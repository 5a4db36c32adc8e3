"""Serving speed of the embedded engine on the tiny model, and what the daemon's own path adds.

Measured in one run:
1. baseline: the engine's generate call in-process (no HTTP, no record), tokens/s at concurrency 1 and 8;
2. the same requests through a real daemon over TCP (HTTP, durable record, receipt), tokens/s at 1 and 8;
3. the daemon's added latency at concurrency 1: client-observed latency minus the engine time the daemon
   reports in ``Server-Timing`` for each request, p50 and p99 (goal: at most 2 ms p50).

Run: ``.venv/bin/python bench/serve_tiny.py [--requests N] [--max-tokens N]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import start  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def body(i: int, max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "max_tokens": max_tokens, "seed": i, "temperature": 1.0,
            "messages": [{"role": "user", "content": f"write a function number {i}"}]}


async def engine_baseline(model: Path, n: int, conc: int, max_tokens: int) -> float:
    from daemon.config import ModelEntry
    from daemon.engines.transformers import TransformersEngine
    from daemon.exchange import Finish
    from daemon.protocols import openai_chat

    engine = TransformersEngine(ModelEntry(name="tiny", path=model, threads=1, max_batch=8))
    await engine.start()
    sem = asyncio.Semaphore(conc)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            async for ev in engine.generate(openai_chat.parse_request(body(i, max_tokens))):
                if isinstance(ev, Finish):
                    tokens += ev.completion.usage.output_tokens

    await one(-1)  # warm-up
    tokens = 0
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    await engine.close()
    return tokens / wall


def server_timing(header: str) -> dict[str, float]:
    return {p.split(";")[0].strip(): float(p.split("dur=")[1]) for p in header.split(",")}


async def through_daemon(url: str, token: str, n: int, conc: int, max_tokens: int) -> tuple[float, list[dict[str, float]]]:
    """Requests through the daemon with a lean client (aiohttp, keep-alive), so the client adds little."""
    import aiohttp

    sem = asyncio.Semaphore(conc)
    tokens = 0
    rows: list[dict[str, float]] = []
    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(url, headers={"x-api-key": token}, connector=conn) as c:

        async def one(i: int) -> None:
            nonlocal tokens
            async with sem:
                t0 = time.perf_counter()
                async with c.post("/v1/chat/completions", json=body(i, max_tokens)) as resp:
                    data = await resp.json()
                    timing = server_timing(resp.headers["server-timing"])
                elapsed = (time.perf_counter() - t0) * 1e3
                tokens += data["usage"]["completion_tokens"]
                rows.append({"added": elapsed - timing["engine"], "record": timing["record"],
                             "server": timing["total"] - timing["engine"]})

        for i in range(3):
            await one(-1 - i)  # warm-up: connection, first load
        tokens, rows = 0, []
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return tokens / wall, rows


def raw_latency(port: int, token: str, n: int, max_tokens: int) -> list[dict[str, float]]:
    """Concurrency 1 over one keep-alive socket with pre-encoded requests: the client adds next to nothing, so
    client-observed minus engine time is the daemon's own path (HTTP parse, JSON, record, receipt, reply)."""
    import json

    rows: list[dict[str, float]] = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        for i in range(-5, n):
            payload = json.dumps(body(i, max_tokens)).encode()
            req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nx-api-key: {token}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
            t0 = time.perf_counter()
            s.sendall(req)
            while b"\r\n\r\n" not in buf:
                buf += s.recv(65536)
            head, _, buf = buf.partition(b"\r\n\r\n")
            headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
            headers = {k.lower(): v for k, v in headers.items()}
            length = int(headers["content-length"])
            while len(buf) < length:
                buf += s.recv(65536)
            buf = buf[length:]
            elapsed = (time.perf_counter() - t0) * 1e3
            if i >= 0:
                timing = server_timing(headers["server-timing"])
                rows.append({"added": elapsed - timing["engine"], "record": timing["record"],
                             "server": timing["total"] - timing["engine"]})
    return rows



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    from daemon.models import init_tiny

    home = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    try:
        model = init_tiny(home / "models" / "tiny")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        (home / "config.toml").write_text(f"port = {port}\n")
        print(f"tiny model, {args.requests} requests of up to {args.max_tokens} tokens, torch threads 1")
        base = {c: asyncio.run(engine_baseline(model, args.requests, c, args.max_tokens)) for c in (1, 8)}
        proc = start(home, port)
        token = (home / "token").read_text().strip()
        try:
            served = {c: asyncio.run(through_daemon(f"http://127.0.0.1:{port}", token, args.requests, c,
                                                    args.max_tokens)) for c in (1, 8)}
            print(f"{'concurrency':>12} {'engine tok/s':>13} {'daemon tok/s':>13} {'ratio':>6}")
            for c in (1, 8):
                print(f"{c:>12} {base[c]:>13.0f} {served[c][0]:>13.0f} {served[c][0] / base[c]:>6.2f}")
            rows = raw_latency(port, token, args.requests * 2, args.max_tokens)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        added = [r["added"] for r in rows]
        print(f"daemon's added latency at concurrency 1 (HTTP + durable record + receipt, client-observed minus "
              f"engine time): p50 {statistics.median(added):.2f} ms, p99 {pct(added, 0.99):.2f} ms "
              f"(goal p50 <= 2 ms)")
        for key, what in (("server", "inside the daemon, outside the engine"), ("record", "durable record write")):
            vals = [r[key] for r in rows]
            print(f"  of which {what}: p50 {statistics.median(vals):.2f} ms, p99 {pct(vals, 0.99):.2f} ms")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
