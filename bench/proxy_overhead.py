"""What Reef adds as a recording proxy in front of an upstream that answers at once.

In one run: a minimal OpenAI-chat upstream (aiohttp + uvloop, its own process, answers from memory), a real Reef
daemon (its own process) with one ``upstream`` model pointing at it, and one lean aiohttp client that sends the
same requests directly and through Reef (keep-alive connections on both paths; every Reef answer is a durable
record with a receipt). Figures:

1. latency at concurrency 1, non-streaming: p50 / p99 direct and through Reef; goal: Reef adds <= 2 ms p50;
2. throughput at concurrency 16, non-streaming: req/s direct and through Reef; goal: Reef keeps >= 1/2. Measured
   in two arrangements, each in alternating rounds (direct, reef, relay, relay, reef, direct, ...) so that a change
   in the machine's load falls on every side alike:
   a. "own core": Reef on one CPU, the client and the upstream on the other, for the direct rounds too. This is
      what the goal asks: does a proxy with a core of its own keep up with what client and upstream produce?
   b. "shared": every process on every CPU. On a 2-core machine this mostly measures how much CPU Reef takes
      from the client and the upstream: even the do-nothing relay keeps only about 0.5-0.7 of direct here.
   Printed with each: the per-round ratios, the do-nothing relay's figure (the floor any proxy built like Reef
   has), and CPU per request of each process and of Reef's threads (event loop; record writer, checkpointer);
3. time to first token of a stream at concurrency 1 (first content chunk): p50 direct and through Reef;
   goal: Reef adds <= 2 ms.

Also printed: Reef's own ``Server-Timing`` split (engine = upstream round trip, record = durable write) at
concurrency 1, to show where Reef's time goes.

Run: ``.venv/bin/python bench/proxy_overhead.py [--requests N]`` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import daemon_command  # noqa: E402

REQUEST = {
    "model": "bench",
    "max_tokens": 64,
    "messages": [
        {"role": "system", "content": "You are a helpful coding assistant."},
        {"role": "user", "content": "Write a haiku about keep-alive connections."},
    ],
}
TEXT = "Sockets stay open / requests flow without a pause / the pool remembers"
ANSWER = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1,
    "model": "bench-upstream",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT}, "finish_reason": "stop",
                 "logprobs": None}],
    "usage": {"prompt_tokens": 31, "completion_tokens": 17, "total_tokens": 48},
}


def _chunk(delta: dict, finish: str | None = None, **extra: object) -> bytes:
    body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "bench-upstream",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else [], **extra}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    *(_chunk({"content": w + " "}) for w in TEXT.split()),
    _chunk({}, "stop"),
    _chunk(None, usage=ANSWER["usage"]),  # type: ignore[arg-type]
    b"data: [DONE]\n\n",
]


# --- the upstream process -------------------------------------------------------------------------------------


def serve_upstream(port: int) -> None:
    import uvloop
    from aiohttp import web

    answer = json.dumps(ANSWER).encode()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=answer, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(STREAM))  # all at once: an upstream that answers instantly
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_relay(port: int, up_port: int) -> None:
    """A do-nothing relay: Reef's own HTTP server (``daemon/web.py``) and upstream client (``daemon/engines/http.py``),
    the body passed through as bytes: no parsing, no auth, no record. What any proxy built like Reef costs at least."""
    import uvloop

    from daemon import web
    from daemon.engines import http

    async def main() -> None:
        pool = http.Pool("http", "127.0.0.1", up_port, connect_timeout=5)

        async def chat(request: web.Request) -> web.Response:
            if request.method != "POST":
                return web.Response(b"", status=404)
            raw = await request.read()
            head = http.request_head("POST", "/v1/chat/completions", pool.host_header,
                                     "Content-Type: application/json\r\n", len(raw))
            resp, _ = await pool.request(head, raw, timeout=30)
            data = await resp.read(30)
            resp.release()
            return web.Response(data)

        server = web.Server(chat, ctx=None, max_body=1 << 20, refusal=lambda status, msg: b"{}",
                            log_exception=lambda request: None)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1024)
        sock.setblocking(False)
        await server.listen(sock)
        await asyncio.Event().wait()

    uvloop.run(main())


# --- measuring ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def wait_up(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode})")
        try:
            async with session.get(url) as r:
                if r.status in (200, 404, 405):
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise SystemExit(f"{what} did not come up")


class Target:
    def __init__(self, name: str, url: str, headers: dict[str, str]) -> None:
        self.name, self.url, self.headers = name, url, headers
        self.server_timing: list[str] = []

    async def once(self, session: aiohttp.ClientSession, body: bytes) -> float:
        t0 = time.perf_counter()
        async with session.post(self.url, data=body, headers=self.headers) as r:
            data = await r.read()
            if r.status != 200:
                raise SystemExit(f"{self.name}: HTTP {r.status}: {data[:300]!r}")
            timing = r.headers.get("Server-Timing")
        dt = time.perf_counter() - t0
        if timing:  # parsed after the run (``timings``): the client's CPU per request is part of what is measured
            self.server_timing.append(timing)
        return dt

    @staticmethod
    def timings(headers: list[str]) -> list[dict[str, float]]:
        """``Server-Timing`` header values as ``{name: ms}``."""
        return [{p.split(";")[0].strip(): float(p.split("dur=")[1]) for p in h.split(",") if "dur=" in p}
                for h in headers]

    async def first_token(self, session: aiohttp.ClientSession, body: bytes) -> float:
        """Seconds to the first SSE chunk that carries content."""
        t0 = time.perf_counter()
        first = None
        async with session.post(self.url, data=body, headers=self.headers) as r:
            if r.status != 200:
                raise SystemExit(f"{self.name}: HTTP {r.status}")
            async for line in r.content:
                if first is None and line.startswith(b"data: {") and b'"content":"' in line and \
                        b'"content":""' not in line:
                    first = time.perf_counter() - t0
        assert first is not None, f"{self.name}: no content chunk"
        return first


ROUNDS = 4


def thread_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of a process's main thread (the event loop) and of its other threads (the record
    writer, the checkpointer, to_thread workers)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = "main thread" if task.name == str(pid) else "other threads"
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def latency(t: Target, session: aiohttp.ClientSession, n: int) -> list[float]:
    body = json.dumps(REQUEST).encode()
    return [await t.once(session, body) for _ in range(n)]


async def throughput(t: Target, session: aiohttp.ClientSession, n: int, conc: int) -> float:
    body = json.dumps(REQUEST).encode()
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await t.once(session, body)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return n / (time.perf_counter() - t0)


async def ttft(t: Target, session: aiohttp.ClientSession, n: int) -> list[float]:
    body = json.dumps({**REQUEST, "stream": True}).encode()
    return [await t.first_token(session, body) for _ in range(n)]


async def bench(n: int, up_port: int, reef_port: int, relay_port: int, token: str,
                procs: list[subprocess.Popen[bytes]]) -> None:
    direct = Target("direct", f"http://127.0.0.1:{up_port}/v1/chat/completions", {"Content-Type": "application/json"})
    reef = Target("reef", f"http://127.0.0.1:{reef_port}/v1/chat/completions",
                  {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    relay = Target("relay", f"http://127.0.0.1:{relay_port}/v1/chat/completions", {"Content-Type": "application/json"})
    load0 = os.getloadavg()[0]
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_up(session, f"http://127.0.0.1:{up_port}/", procs[0], "upstream")
        await wait_up(session, f"http://127.0.0.1:{reef_port}/healthz", procs[1], "reef")
        await wait_up(session, f"http://127.0.0.1:{relay_port}/", procs[2], "relay")
        await latency(relay, session, 50)
        for t in (direct, reef):  # warm up: connections, caches, the scenario's first record
            await latency(t, session, 50)
            await ttft(t, session, 20)
        reef.server_timing.clear()

        lat = {t.name: await latency(t, session, n) for t in (direct, reef)}
        split = Target.timings(reef.server_timing)
        per_round = max(n, 250)
        arrangements = [a for a in ("own core", "shared") if a == "shared" or len(CPUS) >= 2]
        tput = {a: await throughput_rounds(a, (direct, reef, relay), session, per_round, procs) for a in arrangements}
        conc_split = Target.timings(reef.server_timing[len(split):])
        pin(procs, None)
        first = {t.name: await ttft(t, session, max(n // 2, 100)) for t in (direct, reef)}

    d50, r50 = statistics.median(lat["direct"]) * 1e3, statistics.median(lat["reef"]) * 1e3
    d99, r99 = pct(lat["direct"], 0.99) * 1e3, pct(lat["reef"], 0.99) * 1e3
    f50d, f50r = statistics.median(first["direct"]) * 1e3, statistics.median(first["reef"]) * 1e3

    def ok(flag: bool) -> str:
        return "ok" if flag else "MISSED"

    print(f"requests per figure: {n} (latency), {ROUNDS * per_round} per side and arrangement (throughput),"
          f" {max(n // 2, 100)} (ttft); load average {load0:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
          " (above the client, Reef and upstream's own share, other processes took CPU from the run)")
    print(f"1. latency c=1, non-streaming   direct p50 {d50:6.3f} ms  p99 {d99:6.3f} ms")
    print(f"                                reef   p50 {r50:6.3f} ms  p99 {r99:6.3f} ms")
    print(f"   reef adds                    p50 {r50 - d50:+6.3f} ms  p99 {r99 - d99:+6.3f} ms"
          f"  (ratio {r50 / d50:.2f}x)  goal <= +2 ms p50: {ok(r50 - d50 <= 2)}")
    for a, (rate, ratios, cpu, threads_ms) in tput.items():
        ratio = rate["reef"] / rate["direct"]
        where = ("Reef (and the relay) on CPU 0; client and upstream on CPU 1, for the direct runs too"
                 if a == "own core" else "client, upstream and Reef all share every CPU")
        label = "2a" if a == "own core" else "2b"
        print(f"{label}. throughput c=16, {a + ':':9} direct {rate['direct']:7.0f} req/s   reef {rate['reef']:7.0f} req/s"
              f"  ratio {ratio:.2f}  goal >= 0.50: {ok(ratio >= 0.5)}")
        print(f"    ({where}; {ROUNDS} alternating rounds of {per_round} requests each side; ratio per round "
              f"{' '.join(f'{x:.2f}' for x in ratios)})")
        print(f"    floor: a do-nothing relay (Reef's HTTP server and upstream client, no parsing, no record) "
              f"{rate['relay']:7.0f} req/s  ratio {rate['relay'] / rate['direct']:.2f}; Reef keeps "
              f"{rate['reef'] / rate['relay']:.2f} of the relay's throughput")
        for name in ("direct", "reef", "relay"):
            up, daemon, relay_cpu, client = cpu[name]
            middle = {"direct": "", "reef": f"  reef {daemon:.3f} ms", "relay": f"  relay {relay_cpu:.3f} ms"}[name]
            print(f"    CPU per request, {name:6}: upstream {up:.3f} ms{middle}  client {client:.3f} ms")
        busy = sorted(((ms, name) for name, ms in threads_ms.items() if ms >= 0.0005), reverse=True)
        print("    reef CPU per request: " + "  ".join(f"{name} {ms:.3f} ms" for ms, name in busy))
    print(f"3. time to first token c=1      direct p50 {f50d:6.3f} ms   reef p50 {f50r:6.3f} ms"
          f"  adds {f50r - f50d:+6.3f} ms (ratio {f50r / f50d:.2f}x)  goal <= +2 ms: {ok(f50r - f50d <= 2)}")
    for name, rows in (("c=1", split), ("c=16", conc_split)):
        if rows:
            keys = sorted({k for s in rows for k in s})
            parts = "  ".join(f"{k} {statistics.median(s.get(k, 0.0) for s in rows):.3f} ms" for k in keys)
            print(f"   reef Server-Timing p50 ({name}): {parts}")


CPUS = sorted(os.sched_getaffinity(0))


def pin(procs: list[subprocess.Popen[bytes]], arrangement: str | None) -> None:
    """``own core``: Reef and the relay on the first CPU, upstream and client (this process) on the second; else
    every process on every CPU. Every thread of each process is moved (the record writer too)."""
    everything = set(CPUS)
    mine, others = ({CPUS[0]}, set(CPUS[1:])) if arrangement == "own core" else (everything, everything)
    for i, p in enumerate(procs):  # upstream, reef, relay
        cpus = mine if i in (1, 2) else others
        for task in Path(f"/proc/{p.pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except OSError:
                pass
    os.sched_setaffinity(0, others)


async def throughput_rounds(arrangement: str, sides: tuple[Target, ...], session: aiohttp.ClientSession,
                            per_round: int, procs: list[subprocess.Popen[bytes]]) -> tuple[Any, ...]:
    """Throughput at concurrency 16 of each side in alternating rounds (direct, reef, relay, relay, reef, ...): a
    drift in the machine's load during the run falls on every side alike instead of on whichever ran last."""
    pin(procs, arrangement)
    await throughput(sides[0], session, 200, 16)  # settle after the move
    tput_n = {t.name: 0 for t in sides}
    tput_s = {t.name: 0.0 for t in sides}
    cpu_sum = {t.name: [0.0] * (len(procs) + 1) for t in sides}
    threads_sum: dict[str, float] = {}
    round_ratios = []
    reef_pid = procs[1].pid
    for r in range(ROUNDS):
        rate = {}
        for t in sides if r % 2 == 0 else sides[::-1]:
            before = [cpu_s(p.pid) for p in procs] + [time.process_time()]
            threads0 = thread_cpu_s(reef_pid) if t.name == "reef" else {}
            t0 = time.perf_counter()
            rate[t.name] = await throughput(t, session, per_round, 16)
            tput_s[t.name] += time.perf_counter() - t0
            tput_n[t.name] += per_round
            after = [cpu_s(p.pid) for p in procs] + [time.process_time()]
            cpu_sum[t.name] = [c + a - b for c, a, b in zip(cpu_sum[t.name], after, before, strict=True)]
            for name, secs in thread_cpu_s(reef_pid).items() if t.name == "reef" else ():
                threads_sum[name] = threads_sum.get(name, 0.0) + secs - threads0.get(name, 0.0)
        round_ratios.append(rate["reef"] / rate["direct"])
    rates = {k: tput_n[k] / tput_s[k] for k in tput_n}
    cpu = {k: [c * 1e3 / tput_n[k] for c in v] for k, v in cpu_sum.items()}
    threads_ms = {k: v * 1e3 / tput_n["reef"] for k, v in threads_sum.items()}
    return rates, round_ratios, cpu, threads_ms


def start_reef(home: Path, port: int, up_port: int, profile: str | None = None) -> subprocess.Popen[bytes]:
    """A real Reef daemon (its own process) under ``home`` on ``port``, with one ``upstream`` model pointing at the
    upstream on ``up_port``; ``reef_token`` waits for it to be ready. ``profile``: run it under cProfile, stats there."""
    (home / "logs").mkdir()
    (home / "config.toml").write_text(
        f'port = {port}\n\n[models.up]\nengine = "upstream"\nurl = "http://127.0.0.1:{up_port}"\n'
        f'format = "openai-chat"\nupstream_model = "bench-upstream"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    env.update(REEF_HOME=str(home), REEF_MODEL="up", PYTHONPATH=str(ROOT))
    with open(home / "logs" / "daemon.log", "ab") as log:  # the child keeps its own copy
        return subprocess.Popen(daemon_command(profile), env=env, stdout=log, stderr=log, cwd=home)


def reef_token(home: Path, proc: subprocess.Popen[bytes]) -> str:
    """The token of the daemon ``start_reef`` started, once it has written it (it listens by then)."""
    deadline = time.monotonic() + 60
    while not (home / "token").exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("reef did not start: " + (home / "logs" / "daemon.log").read_text()[-2000:])
        time.sleep(0.05)
    time.sleep(0.1)
    return (home / "token").read_text().strip()


def bare_commit_ms(where: Path, n: int = 500) -> float:
    """p50 of a bare SQLite commit as the record store makes them (WAL, ``synchronous=FULL``, a 4 kB row), on the
    disk the daemon writes to: the floor under the record write in Server-Timing, which moves with the machine."""
    import sqlite3

    path = where / "bare.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT)")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            conn.execute("INSERT INTO t(body) VALUES (?)", ("x" * 4000,))
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--profile", metavar="FILE", help="run the daemon under cProfile and write its stats here")
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-relay", type=int, nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return
    if args.serve_relay:
        sys.path.insert(0, str(ROOT))
        serve_relay(*args.serve_relay)
        return
    up_port, reef_port, relay_port = free_port(), free_port(), free_port()
    home = Path(tempfile.mkdtemp(prefix="reef-bench-", dir="/tmp"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up_port)]))
        procs.append(start_reef(home, reef_port, up_port, args.profile))
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-relay", str(relay_port), str(up_port)]))
        token = reef_token(home, procs[1])
        import uvloop

        uvloop.run(bench(args.requests, up_port, reef_port, relay_port, token, procs))
        print(f"   the disk: a bare SQLite commit (WAL, synchronous=FULL, 4 kB row) p50 {bare_commit_ms(home):.3f} ms"
              " (the floor under 'record' above)")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
