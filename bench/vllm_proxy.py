"""Reef in front of vLLM vs the same vLLM server called directly, and adapter releases going live, in one run.

1. Throughput and latency at concurrency 8 on non-trivial generations (``--tokens``, default 128): the same
   requests (same prompt, ``max_tokens``, temperature 1 and per-request seed; output tokens as each answer's
   ``usage`` counts them) sent to Reef's ``/v1/chat/completions`` (which renders the template, calls vLLM's
   token-id generate endpoint with log-probs, detokenises and records durably) and to the vLLM server's own
   ``/v1/chat/completions``, in alternating rounds, collected and then streamed. Printed: output tokens/s of each
   and the ratio (goal: at least 0.9 of direct), and p50 latency per request with the difference (what Reef
   adds), and the load average (the machine is shared).
2. Adapter releases: publish -> first answer from the new release (LoRA loaded into vLLM, selected per request),
   and p99 latency with an adapter release published every ``--every`` seconds vs none.

vLLM is the one ``./install.sh --vllm`` installed (``--vllm-python``); the model is a random Llama built here
(head size 32, ``--model`` for another local HF directory). On the CPU build; ``bench/gpu_server.py`` does the
same on a lent GPU.

Run: ``.venv/bin/python bench/vllm_proxy.py [--rounds N] [--tokens N] [--seconds N]``
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
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_reef(home: Path, port: int, timeout: float = 1200) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """The daemon, and (once healthy) the vLLM server it started."""
    env = dict(os.environ, REEF_HOME=str(home), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--log-file"], env=env)
    deadline = time.monotonic() + timeout
    token = None
    while time.monotonic() < deadline:
        try:
            token = token or (home / "token").read_text().strip()
            s = httpx.get(f"http://127.0.0.1:{port}/reef/status", headers={"x-api-key": token}).json()
            server = s["models"]["m"].get("server") or {}
            if server.get("healthy"):
                return proc, server
        except (httpx.HTTPError, OSError, KeyError, ValueError):
            pass
        if proc.poll() is not None:
            raise SystemExit("the daemon exited")
        time.sleep(0.5)
    raise SystemExit("vLLM did not become healthy")


async def load(url: str, headers: dict[str, str], model: str, n: int, conc: int, tokens: int,
               stream: bool = False) -> tuple[float, list[float], int]:
    """``n`` chat requests, ``conc`` at a time, streamed or not: (wall seconds, latencies ms, output tokens as the
    answers' usage counts them)."""
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []
    out = 0

    async def one(c: httpx.AsyncClient, i: int) -> None:
        nonlocal out
        body: dict[str, Any] = {"model": model, "max_tokens": tokens, "temperature": 1.0, "seed": i,
                                "messages": [{"role": "user", "content": f"write about caches, part {i}"}]}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        async with sem:
            t = time.perf_counter()
            if stream:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise SystemExit(f"{url}: {r.status_code} {(await r.aread())[:500]!r}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"usage"' in line:
                            usage = json.loads(line[6:]).get("usage")
                            out += usage["completion_tokens"] if usage else 0
            else:
                r = await c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise SystemExit(f"{url}: {r.status_code} {r.text[:500]}")
                out += r.json()["usage"]["completion_tokens"]
            lat.append((time.perf_counter() - t) * 1e3)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=conc)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, i) for i in range(n)))
        return time.perf_counter() - t0, lat, out


def run(args: argparse.Namespace, work: Path, model: Path) -> None:
    from bench.lora_models import adapter_variant, random_adapter
    from daemon.lora import AdapterManifest
    from daemon.releases import ReleaseStore, files_from_dir

    home = work / "home"
    (home / "logs").mkdir(parents=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'port = {port}\ndefault_model = "m"\n[models.m]\nengine = "vllm"\npath = "{model}"\n'
        f'server = "{args.vllm_python}"\nmax_model_len = 2048\nmax_new_tokens = {args.tokens}\n'
        f'server_log = "{work}/vllm.log"\nserver_args = ["--dtype", "float32"]\n')
    t0 = time.perf_counter()
    proc, server = start_reef(home, port)
    print(f"vLLM {server.get('version')} healthy {time.perf_counter() - t0:.1f} s after the daemon started "
          f"({server['url']})", flush=True)
    token = (home / "token").read_text().strip()
    reef = (f"http://127.0.0.1:{port}", {"x-api-key": token})
    direct = (server["url"], {})
    try:
        asyncio.run(load(*reef, "m", 8, 8, 4))  # warm both paths
        asyncio.run(load(*direct, "m", 8, 8, 4))
        for stream in (False, True):
            rates: dict[str, list[float]] = {"direct": [], "reef": []}
            lats: dict[str, list[float]] = {"direct": [], "reef": []}
            for _ in range(args.rounds):
                for name, (url, headers) in (("direct", direct), ("reef", reef)):
                    wall, lat, out = asyncio.run(load(url, headers, "m", args.requests, 8, args.tokens, stream))
                    rates[name].append(out / wall)
                    lats[name] += lat
            d, r = statistics.median(rates["direct"]), statistics.median(rates["reef"])
            pd, pr = statistics.median(lats["direct"]), statistics.median(lats["reef"])
            print(f"concurrency 8, {args.tokens} tokens, {'streamed' if stream else 'collected'}: direct {d:.0f} "
                  f"tok/s, through Reef {r:.0f} tok/s: ratio {r / d:.2f} (goal >= 0.9); latency p50 direct {pd:.0f} "
                  f"ms, through Reef {pr:.0f} ms ({pr - pd:+.0f} ms per request)", flush=True)
        print(f"load average {os.getloadavg()[0]:.1f} (2 cores: other work on the machine shares them)")

        store = ReleaseStore(home / "artifacts.git")
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=reef[0], headers=reef[1], timeout=600) as c:
            c.post("/s/up/v1/chat/completions", json=body).raise_for_status()
            init = store.get(store.head("up"))
            first = random_adapter(model, work / "ad-0", AdapterManifest(init.content_id, init.release_id), rank=8)
            adapters = [first] + [adapter_variant(first, work / f"ad-{i}", i) for i in range(1, 40)]
            fresh = iter(adapters)
            live = []
            for _ in range(3):
                rel = store.publish("up", files_from_dir(next(fresh)), expected_head=store.head("up"),
                                    operation="train", kind="weights", recipe="record")
                t1 = time.perf_counter()
                while c.post("/s/up/v1/chat/completions", json=body).headers["x-reef-release-id"] != rel.release_id:
                    pass
                live.append(time.perf_counter() - t1)
            print(f"adapter publish -> first answer from it: median {statistics.median(live):.2f} s, "
                  f"max {max(live):.2f} s")

            def timed(seconds: float, every: float | None) -> list[float]:
                lat: list[float] = []
                stop = threading.Event()

                def client() -> None:
                    with httpx.Client(base_url=reef[0], headers=reef[1], timeout=600) as cc:
                        while not stop.is_set():
                            t = time.perf_counter()
                            cc.post("/s/up/v1/chat/completions", json=body).raise_for_status()
                            lat.append((time.perf_counter() - t) * 1e3)

                threads = [threading.Thread(target=client) for _ in range(4)]
                for t in threads:
                    t.start()
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    time.sleep(every or 0.5)
                    if every:
                        store.publish("up", files_from_dir(next(fresh)), expected_head=store.head("up"),
                                      operation="train", kind="weights", recipe="record")
                stop.set()
                for t in threads:
                    t.join()
                return lat

            still = timed(args.seconds, None)
            moving = timed(args.seconds, args.every)
            print(f"p99 without updates {pct(still, 0.99):.0f} ms ({len(still)} requests), with an adapter release "
                  f"every {args.every:g} s {pct(moving, 0.99):.0f} ms ({len(moving)}): "
                  f"ratio {pct(moving, 0.99) / pct(still, 0.99):.2f}x")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--model", type=Path, help="a local HF model directory (default: a random Llama, head size 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32, help="requests per round and side")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between adapter releases")
    args = ap.parse_args()
    from daemon.models import TinyConfig, init_tiny

    work = Path(tempfile.mkdtemp(prefix="reef-bench-vllm-"))
    try:
        model = args.model.resolve() if args.model else init_tiny(
            work / "tiny32", config=TinyConfig(num_attention_heads=2))
        run(args, work, model)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
