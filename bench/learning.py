"""The learning loop's speed, in one run against one fresh daemon (nothing else should run on the machine):

1. build ``tiny-demo`` (the demo model's supervised warm-up): wall time;
2. serving latency idle: short requests (``tiny``, 8 tokens) one after another for ``--seconds``: p50;
3. ``reef demo --json`` alone: wall time, reports and training steps until the head's held-out reward reaches
   0.8 (or what it reached within ``--minutes``);
3b. the same demo with ``--recipe sao`` (same seed, same daemon, a fresh scenario): the reports sao needs to reach
   the held-out reward online-rl reached, within twice online-rl's reports (the goal) or ``--sao-minutes``; both
   printed side by side (``--skip-sao`` leaves it out);
4. serving latency while training: a scenario whose one batch trains for a long time (``steps_per_batch``
   large) keeps the trainer worker busy, and the same short requests run meanwhile: p50 and the ratio to idle
   (goal <= 1.5x). Only requests that ran while the worker was training count.

Run: ``.venv/bin/python bench/learning.py [--minutes 5] [--seconds 20] [--seed 0] [--sao-minutes 90]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import cli_home  # noqa: E402

BODY = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}


def probe(c: httpx.Client, seconds: float, while_: object = None) -> list[float]:
    """Latencies (ms) of short requests one after another, for ``seconds`` or while ``while_()`` holds."""
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and (while_ is None or while_()):
        t = time.perf_counter()
        c.post("/v1/chat/completions", json=BODY, headers={"x-reef-scenario": "probe"}).raise_for_status()
        lat.append((time.perf_counter() - t) * 1e3)
        time.sleep(0.05)
    return lat


def keep_trainer_busy(c: httpx.Client) -> None:
    """A scenario on the demo model whose first batch (32 reports) trains for a long time."""
    settings = {"batch_prompts": 8, "group_size": 4, "steps_per_batch": 4000, "gate": "always"}
    c.post("/reef/scenarios", json={"name": "busy", "recipe": "online-rl", "model": "tiny-demo",
                                    "settings": settings}).raise_for_status()
    receipts = []
    for i in range(32):
        r = c.post("/v1/chat/completions", headers={"x-reef-scenario": "busy"}, json={
            "model": "tiny-demo", "max_tokens": 8, "messages": [{"role": "user", "content": f"Say w{i // 4}."}]})
        receipts.append(r.headers["x-reef-agent-record-id"])
    for i, rec in enumerate(receipts):
        c.post("/reef/report", json={"score": float(i % 2), "references": [rec]}).raise_for_status()
    deadline = time.monotonic() + 60
    while c.get("/reef/status").json()["learning"].get("busy") != "training":
        if time.monotonic() > deadline:
            raise RuntimeError("the trainer did not start")
        time.sleep(0.1)


def sao_vs_online_rl(reef: list[str], env: dict[str, str], args: argparse.Namespace, online: dict) -> None:
    """The sao demo against the online-rl one just run: the same held-out reward, in how many reports?"""
    target = min(0.8, online["held_out_after"])
    budget = 2 * online["reports"]
    out = subprocess.run([*reef, "demo", "--json", "--recipe", "sao", "--seed", str(args.seed), "--target",
                          f"{target:.4f}", "--max-reports", str(budget), "--minutes", str(args.sao_minutes)],
                         env=env, capture_output=True, text=True, timeout=args.sao_minutes * 60 + 600).stdout
    sao = json.loads(out)
    rows = [("recipe", "online-rl", "sao"), ("held-out before", f"{online['held_out_before']:.3f}",
                                               f"{sao['held_out_before']:.3f}"),
            ("held-out after", f"{online['held_out_after']:.3f}", f"{sao['held_out_after']:.3f}"),
            ("reports", str(online["reports"]), str(sao["reports"])),
            ("training steps", str(online["training_steps"]), str(sao["training_steps"])),
            ("releases", str(online["releases"]), str(sao["releases"])),
            ("seconds", f"{online['seconds']:.0f}", f"{sao['seconds']:.0f}")]
    for label, a, b in rows:
        print(f"  {label:16s} {a:>10s} {b:>10s}")
    ok = sao["held_out_after"] >= target and sao["reports"] <= budget
    print(f"sao vs online-rl (seed {args.seed}): held-out {target:.2f} "
          + (f"reached in {sao['reports']} reports = {sao['reports'] / online['reports']:.2f}x online-rl's "
             f"(goal <= 2x): {'met' if ok else 'NOT met'}" if sao["held_out_after"] >= target else
             f"NOT reached: {sao['held_out_after']:.2f} after {sao['reports']} reports "
             f"({sao['reports'] / online['reports']:.2f}x online-rl's; goal: {target:.2f} within 2x)"), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sao-minutes", type=float, default=90.0, help="time limit of the sao demo")
    ap.add_argument("--skip-sao", action="store_true", help="leave out the sao comparison")
    args = ap.parse_args()
    home, port, env, reef = cli_home("reef-bench-learn-")
    try:
        subprocess.run([*reef, "daemon", "start"], env=env, check=True, capture_output=True)
        t0 = time.monotonic()
        subprocess.run([*reef, "model", "init", "tiny-demo"], env=env, check=True, capture_output=True)
        print(f"tiny-demo built (warm-up included) in {time.monotonic() - t0:.1f} s", flush=True)
        token = (home / "token").read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=120) as c:
            probe(c, 2)  # warm
            idle = probe(c, args.seconds)
            out = subprocess.run([*reef, "demo", "--json", "--seed", str(args.seed), "--minutes", str(args.minutes)],
                                 env=env, capture_output=True, text=True, timeout=args.minutes * 60 + 300).stdout
            result = json.loads(out)
            print(f"demo: held-out reward {result['held_out_before']:.2f} -> {result['held_out_after']:.2f} in "
                  f"{result['seconds']:.0f} s and {result['reports']} reports, {result['training_steps']} training "
                  f"steps, {result['releases']} releases (target 0.8 "
                  f"{'reached' if result['reached_target'] else 'NOT reached'})", flush=True)
            if not args.skip_sao:
                sao_vs_online_rl(reef, env, args, result)
            keep_trainer_busy(c)
            busy = probe(c, args.seconds,
                         lambda: c.get("/reef/status").json()["learning"].get("busy") == "training")
        p_idle, p_busy = statistics.median(idle), statistics.median(busy)
        print(f"serving p50 idle {p_idle:.1f} ms ({len(idle)} requests), while the trainer trains {p_busy:.1f} ms "
              f"({len(busy)} requests): ratio {p_busy / p_idle:.2f}x (goal <= 1.5x)")
    finally:
        subprocess.run([*reef, "daemon", "stop"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
