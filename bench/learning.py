"""The learning loop's speed, in one run against one fresh daemon:

1. ``reef demo --json``: wall time and number of reports until the head reaches held-out reward 0.8 on the
   demo task (or what it reached within ``--minutes``);
2. serving latency while training runs against idle: short requests on another scenario for ``--seconds``
   with the daemon idle, then for the same time while the demo trains; p50 of both and the ratio (goal <= 1.5x).

Run: ``.venv/bin/python bench/learning.py [--minutes 5] [--seconds 20] [--seed 0]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}


def probe(url: str, token: str, seconds: float) -> list[float]:
    lat = []
    with httpx.Client(base_url=url, headers={"x-api-key": token, "x-reef-scenario": "probe"}, timeout=60) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            c.post("/v1/chat/completions", json=BODY).raise_for_status()
            lat.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.05)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="reef-bench-learn-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (home / "config.toml").write_text(f"port = {port}\n")
    env = dict(os.environ, REEF_HOME=str(home), PYTHONPATH=str(ROOT))
    reef = [sys.executable, "-m", "reef_cli.main"]
    try:
        subprocess.run([*reef, "daemon", "start"], env=env, check=True, capture_output=True)
        subprocess.run([*reef, "model", "init", "tiny-demo"], env=env, check=True, capture_output=True)
        token = (home / "token").read_text().strip()
        url = f"http://127.0.0.1:{port}"
        probe(url, token, 2)  # warm
        idle = probe(url, token, args.seconds)
        demo = subprocess.Popen([*reef, "demo", "--json", "--seed", str(args.seed), "--minutes", str(args.minutes)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(15)  # scenario created, first batches in, training under way
        busy = probe(url, token, args.seconds)
        out, _ = demo.communicate(timeout=args.minutes * 60 + 300)
        result = json.loads(out)
        print(f"demo: held-out reward {result['held_out_before']:.2f} -> {result['held_out_after']:.2f} in "
              f"{result['seconds']:.0f} s and {result['reports']} reports, {result['training_steps']} training steps, "
              f"{result['releases']} releases (target 0.8 {'reached' if result['reached_target'] else 'NOT reached'})")
        p_idle, p_busy = statistics.median(idle), statistics.median(busy)
        print(f"serving p50 idle {p_idle:.1f} ms ({len(idle)} requests), while training {p_busy:.1f} ms "
              f"({len(busy)} requests): ratio {p_busy / p_idle:.2f}x (goal <= 1.5x)")
    finally:
        subprocess.run([*reef, "daemon", "stop"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
