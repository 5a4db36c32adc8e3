"""What a stream's receipt in its headers costs the first token, in front of an instant upstream and of SmolLM2.

A stream's receipt goes out in its response headers, before the answer exists, so its record must be durable
before the first byte: Reef starts that write (``RecordStore.exchanges.open``, a commit with an fsync) beside the
engine's work on its first event, and the first token waits only for what is left of the write when the engine's
first event comes in. The other placement, the receipt only in the final event, would let the first token go out at
once and make the write before the final event instead.

In one run, one daemon serving two models: ``up`` (an upstream that answers at once: ``bench/proxy_overhead.py``'s)
and ``smollm2`` (SmolLM2-135M-Instruct, made here once, no download). For each, sequential streamed requests
(concurrency 1) and, from the stream's ``Server-Timing`` header, per request: the engine's first event, the opening
record's write, and ``receipt-wait``, how long the first event waited for that write: the exact saving the
final-event placement would give. Printed: p50 / p90 of each, the client's time to its first content chunk (and for
the upstream, the same directly, so "Reef's added time to first token"), and the share of the first token's
time that is receipt wait.

Run: ``.venv/bin/python bench/first_token.py [--requests 200] [--model-dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.proxy_overhead import REQUEST, free_port, pct  # noqa: E402


def first_chunk(c: httpx.Client, url: str, body: dict, headers: dict[str, str]) -> tuple[float, dict[str, float]]:
    """Seconds to the first SSE chunk with content, and the response's Server-Timing (name -> ms)."""
    t0 = time.perf_counter()
    first = None
    with c.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        timing = {p.split(";")[0].strip(): float(p.split("dur=")[1])
                  for p in r.headers.get("Server-Timing", "").split(",") if "dur=" in p}
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - t0
    if first is None:
        raise SystemExit(f"{url}: no content chunk")
    return first, timing


def summary(name: str, values: list[float]) -> str:
    return f"{name} p50 {statistics.median(values):7.3f} ms  p90 {pct(values, 0.9):7.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--model-dir", type=Path, help="a made SmolLM2 directory (default: made here, once)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="reef-bench-first-token-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_port, port = free_port(), free_port()
        (home / "models").mkdir(parents=True)
        if args.model_dir:
            (home / "models" / "smollm2").symlink_to(args.model_dir.resolve())
        (home / "config.toml").write_text(
            f'port = {port}\n\n[models.up]\nengine = "upstream"\nurl = "http://127.0.0.1:{up_port}"\n'
            f'format = "openai-chat"\nupstream_model = "bench-upstream"\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
        env.update(REEF_HOME=str(home), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "bench" / "proxy_overhead.py"),
                                       "--serve-upstream", str(up_port)]))
        procs.append(subprocess.Popen([sys.executable, "-m", "daemon", "--log-file"], env=env, cwd=home))
        deadline = time.monotonic() + 600
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz").json()
                if "smollm2" in health.get("models", {}).get("loaded", []):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline or procs[1].poll() is not None:
                raise SystemExit(f"reef did not load SmolLM2: see {home}/logs")
            time.sleep(0.2)
        token = (home / "token").read_text().strip()
        direct_url = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        auth = {"Authorization": f"Bearer {token}"}
        for model in ("up", "smollm2"):  # a scenario serves the model it is bound to, whatever a request names
            httpx.post(f"http://127.0.0.1:{port}/reef/scenarios", headers=auth,
                       json={"name": f"ft-{model}", "model": model}).raise_for_status()
        load0 = os.getloadavg()[0]
        with httpx.Client(timeout=300) as c:
            results: dict[str, dict[str, list[float]]] = {}
            for model, n in (("up", args.requests), ("smollm2", max(20, args.requests // 4))):
                body = {**REQUEST, "model": model, "stream": True, "max_tokens": 8}
                reef_url = f"http://127.0.0.1:{port}/s/ft-{model}/v1/chat/completions"
                for _ in range(10):  # warm up: connections, the scenario's first record, the model's caches
                    first_chunk(c, reef_url, body, auth)
                    if model == "up":
                        first_chunk(c, direct_url, body, {})
                got: dict[str, list[float]] = {"client": [], "direct": [], "engine": [], "record": [],
                                               "receipt-wait": []}
                for _ in range(n):  # alternating, so that a change in the machine's load falls on both
                    if model == "up":
                        got["direct"].append(first_chunk(c, direct_url, body, {})[0] * 1e3)
                    seconds, timing = first_chunk(c, reef_url, body, auth)
                    got["client"].append(seconds * 1e3)
                    for k in ("engine", "record", "receipt-wait"):
                        got[k].append(timing[k])
                results[model] = got
        print(f"{args.requests} streamed requests to the instant upstream, {max(20, args.requests // 4)} to SmolLM2, "
              f"one at a time; load average {load0:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        for model, got in results.items():
            print(f"\n{model}:")
            if got["direct"]:
                added = statistics.median(got["client"]) - statistics.median(got["direct"])
                print(f"  time to first token, direct    {summary('', got['direct'])}")
                print(f"  time to first token, via Reef  {summary('', got['client'])}  (adds {added:+.3f} ms p50)")
            else:
                print(f"  time to first token, via Reef  {summary('', got['client'])}")
            print(f"  engine's first event           {summary('', got['engine'])}")
            print(f"  opening record's durable write {summary('', got['record'])}")
            print(f"  first event waiting for it     {summary('', got['receipt-wait'])}  "
                  f"(what the receipt only in the final event would save; "
                  f"{statistics.median(got['receipt-wait']) / statistics.median(got['client']):.1%} of the p50 "
                  f"first token)")
        print(json.dumps({m: {k: statistics.median(v) for k, v in got.items() if v} for m, got in results.items()}))
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
