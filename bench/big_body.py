"""One big request body against a real daemon: how long the event loop stalls and what memory it keeps.

Starts ``python -m daemon`` with the tiny model in a throwaway ``REEF_HOME``, sends one valid request body of
``--mb`` megabytes (a chat request whose one user message is that long, ``--shape many`` short messages, or ``--shape blocks``: one
Anthropic message of many short text blocks, for ``--route /v1/messages``),
and meanwhile asks ``/healthz`` every 20 ms on another connection. Prints the big request's status and time,
the longest ``/healthz`` wait while it was in flight (the loop's stall, as a client sees it), the longest loop lag
the daemon itself saw meanwhile (``reef_event_loop_lag_seconds``: the bucket it fell in) and the part its own work
explains (``reef_event_loop_held_seconds``: less its waits for a CPU), and the daemon's RSS
before, at its peak and a few seconds after.

Run: ``.venv/bin/python bench/big_body.py [--mb 10] [--shape one|many] [--route /v1/chat/completions]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def healthz(port: int) -> float:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=600) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        while s.recv(65536):
            pass
    return time.perf_counter() - t0


def loop_lag_buckets(port: int, token: str, name: str = "lag") -> dict[float, float]:
    """The daemon's loop-lag histogram (``lag`` or ``held``): bucket bound -> observations at or under it."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
                  "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    out = {}
    for line in data.decode().splitlines():
        if line.startswith(f"reef_event_loop_{name}_seconds_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def worst_lag(before: dict[float, float], after: dict[float, float]) -> float:
    """The bucket bound the longest lag observed between two readings falls under (inf: over the last bound)."""
    if not after:  # a daemon without the histogram (before it was added)
        return float("nan")
    total = after[float("inf")] - before[float("inf")]
    return min(le for le in after if after[le] - before[le] >= total)


def body_of(mb: float, shape: str) -> bytes:
    n = int(mb * 1024 * 1024)
    if shape == "one":
        msgs = [{"role": "user", "content": "hello world " * (n // 12)}]
    elif shape == "blocks":  # one Anthropic message of many short text blocks (route /v1/messages)
        msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}] * (n // 29)}]
    else:
        msgs = [{"role": "user", "content": "hello world " * 8} for _ in range(n // 130)]
    return json.dumps({"model": "tiny", "max_tokens": 4, "messages": msgs}).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10)
    ap.add_argument("--shape", choices=("one", "many", "blocks"), default="one")
    ap.add_argument("--route", default="/v1/chat/completions")
    ap.add_argument("--profile", help="run the daemon under cProfile, writing here")
    args = ap.parse_args()
    from bench.reef_proc import free_port, start
    from daemon.models import init_tiny

    models = Path(tempfile.gettempdir()) / "reef-bench-models"
    tiny = init_tiny(models / "tiny", seed=0)
    home, port = Path(tempfile.mkdtemp(prefix="reef-bench-", dir="/tmp")), free_port()
    (home / "config.toml").write_text(
        f'port = {port}\nmax_body_bytes = {256 * 1024 * 1024}\n\n[models.tiny]\nengine = "transformers"\npath = "{tiny}"\n')
    proc = start(home, port, profile=args.profile)
    try:
        token = (home / "token").read_text().strip()
        warm = body_of(0.001, "one")
        for _ in range(2):  # the engine's first load is not what is measured
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(f"POST {args.route} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
                          f"Content-Length: {len(warm)}\r\nConnection: close\r\n\r\n".encode() + warm)
                while s.recv(65536):
                    pass
        body = body_of(args.mb, args.shape)
        lag_before, held_before = loop_lag_buckets(port, token), loop_lag_buckets(port, token, "held")
        before = rss_mb(proc.pid)
        peak = before
        waits: list[float] = []
        done = threading.Event()
        result: dict[str, object] = {}

        def big() -> None:
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port), timeout=900) as s:
                s.sendall(f"POST {args.route} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
                          f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            result["status"] = data.split(b"\r\n", 1)[0].decode()
            result["answer"] = data.partition(b"\r\n\r\n")[2][:160].decode("utf-8", "replace")
            result["s"] = time.perf_counter() - t0
            done.set()

        threading.Thread(target=big, daemon=True).start()
        while not done.is_set():
            waits.append(healthz(port))
            peak = max(peak, rss_mb(proc.pid))
            time.sleep(0.02)
        time.sleep(3)
        after = rss_mb(proc.pid)
        lag = worst_lag(lag_before, loop_lag_buckets(port, token))
        held = worst_lag(held_before, loop_lag_buckets(port, token, "held"))
        print(f"body {len(body) / 1e6:.1f} MB ({args.shape}) -> {result['status']} in {result['s']:.2f} s"
              f"  {result['answer']!r}")
        print(f"/healthz during it: {len(waits)} answers, longest {max(waits) * 1e3:.0f} ms;"
              f" the daemon's own loop lag: at most {lag * 1e3:.0f} ms, of it held by its work: at most"
              f" {held * 1e3:.0f} ms (to 3 s after)")
        print(f"RSS MB: before {before:.0f}  peak {peak:.0f}  3 s after {after:.0f}")
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
