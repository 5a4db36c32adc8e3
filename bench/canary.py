"""Canary decisions: reports needed to decide, for several true score differences, at the documented error rate;
and the serve path's added cost of arm assignment, against a bare dict look-up in the same run (goal: under
0.05 ms p50).

Scores are pass/fail draws (head pass rate 0.5, canary 0.5 + difference), runs split evenly; the rule is
``daemon.canary.decide`` checked after every report, as the daemon does. Prints, per difference, the median and
90th percentile of reports (both arms) until a verdict, and how often the verdict was right.

Run: ``.venv/bin/python bench/canary.py [--trials N] [--alpha A]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.canary import decide, in_canary  # noqa: E402


def reports_to_decide(diff: float, alpha: float, rng: random.Random, cap: int = 20_000) -> tuple[int, str | None]:
    head: list[float] = []
    canary: list[float] = []
    for n in range(1, cap + 1):
        if rng.random() < 0.5:
            head.append(1.0 if rng.random() < 0.5 else 0.0)
        else:
            canary.append(1.0 if rng.random() < 0.5 + diff else 0.0)
        if n % 5 == 0:  # every fifth report: the same verdicts, a fifth of the bench's time
            d = decide(head, canary, alpha=alpha, max_reports=cap)
            if d.verdict is not None:
                return n, d.verdict
    return cap, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--alpha", type=float, default=0.05)
    args = ap.parse_args()
    rng = random.Random(0)
    print(f"alpha {args.alpha}; head pass rate 0.5; {args.trials} canaries per row")
    print(f"{'difference':>10} {'median':>8} {'p90':>8} {'right':>7}")
    for diff in (0.4, 0.3, 0.2, 0.1, -0.2):
        runs = [reports_to_decide(diff, args.alpha, rng) for _ in range(args.trials)]
        ns = sorted(n for n, _ in runs)
        right = sum(v == ("promoted" if diff > 0 else "ended") for _, v in runs) / len(runs)
        print(f"{diff:>+10.1f} {statistics.median(ns):>8.0f} {ns[int(0.9 * (len(ns) - 1))]:>8} {right:>7.0%}")
    keys = [f"run=run_{i:024x}" for i in range(100_000)]
    table = {"pi": {"release_id": "r" * 40, "share": 0.2}}
    t0 = time.perf_counter()
    for _ in keys:
        table.get("pi")
    base = (time.perf_counter() - t0) / len(keys)
    t0 = time.perf_counter()
    for k in keys:
        row = table.get("pi")
        in_canary(row["release_id"], k, row["share"])
    arm = (time.perf_counter() - t0) / len(keys)
    print(f"arm assignment: {arm * 1e6:.2f} us per request (a dict look-up alone: {base * 1e6:.2f} us; "
          f"{arm / base:.1f}x); goal under 50 us")


if __name__ == "__main__":
    main()
