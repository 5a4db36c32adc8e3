"""Canary decisions: reports needed to decide, for several true score differences, at the documented error rate,
by the rule the daemon uses (``daemon/betting.py``: paired differences, two betting bettors) beside the per-arm
Hoeffding confidence sequences it replaced, in the same run on the same draws; and the serve path's added cost of arm
assignment, against a bare dict look-up (goal: under 0.05 ms p50).

Each trial: reports arrive one at a time, a ``--share`` of them on the canary's arm; pass/fail scores (head pass rate
0.5, canary 0.5 + difference), or continuous ones (``--continuous``: normal around 0.5 and 0.5 + difference, sd 0.25,
clipped to [0, 1]). Each rule is checked after every report. Printed per difference: the median and 90th percentile
of canary-arm reports until a verdict, how often the verdict was right (a trial that reaches the cap undecided is
not right), and for equal arms the share of wrong verdicts (promoted or ended): the error rate, at most alpha.

Run: ``.venv/bin/python bench/canary.py [--trials 200] [--alpha 0.05] [--share 0.5] [--cap 3000] [--continuous]``
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.betting import Bettors  # noqa: E402
from daemon.canary import in_canary, radius  # noqa: E402


def trial(diff: float, alpha: float, share: float, cap: int, continuous: bool,
          rng: random.Random) -> dict[str, tuple[int, str | None]]:
    """Canary-arm reports until each rule's verdict (``better``, ``worse``, None at ``cap``)."""
    def draw(mean: float) -> float:
        if continuous:
            return min(1.0, max(0.0, rng.gauss(mean, 0.25)))
        return 1.0 if rng.random() < mean else 0.0

    heads: list[float] = []
    canaries: list[float] = []
    bettors = Bettors(alpha)
    sums = [0.0, 0.0]
    out: dict[str, tuple[int, str | None]] = {}
    while len(canaries) < cap and len(out) < 2:
        if rng.random() < share:
            canaries.append(draw(0.5 + diff))
            sums[1] += canaries[-1]
            if len(canaries) <= len(heads):
                bettors.add(canaries[-1] - heads[len(canaries) - 1])
        else:
            heads.append(draw(0.5))
            sums[0] += heads[-1]
            if len(heads) <= len(canaries):
                bettors.add(canaries[len(heads) - 1] - heads[-1])
        if "betting" not in out:
            v = bettors.evidence().verdict
            if v is not None:
                out["betting"] = (len(canaries), v)
        if "hoeffding" not in out and heads and canaries:  # the rule before: per-arm intervals, alpha / 2 each
            mh, mc = sums[0] / len(heads), sums[1] / len(canaries)
            rh, rc = radius(len(heads), alpha / 2), radius(len(canaries), alpha / 2)
            if mc - rc > mh + rh or mc + rc < mh - rh:
                out["hoeffding"] = (len(canaries), "better" if mc > mh else "worse")
    for rule in ("betting", "hoeffding"):
        out.setdefault(rule, (len(canaries), None))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--share", type=float, default=0.5, help="the canary's share of reports")
    ap.add_argument("--cap", type=int, default=3000, help="canary-arm reports after which a trial stops undecided")
    ap.add_argument("--continuous", action="store_true", help="continuous scores instead of pass/fail")
    args = ap.parse_args()
    rng = random.Random(0)
    kind = "continuous (sd 0.25)" if args.continuous else "pass/fail"
    print(f"alpha {args.alpha}; {kind} scores, head mean 0.5; canary share {args.share}; {args.trials} trials per "
          f"row; cap {args.cap} canary reports")
    print(f"{'difference':>10} | {'betting: median':>15} {'p90':>6} {'right':>6} | {'hoeffding: median':>17} "
          f"{'p90':>6} {'right':>6}")
    for diff in (0.3, 0.2, 0.1, -0.2, -0.3, 0.0):
        runs = [trial(diff, args.alpha, args.share, args.cap, args.continuous, rng) for _ in range(args.trials)]
        cells = []
        for rule in ("betting", "hoeffding"):
            ns = sorted(r[rule][0] for r in runs)
            verdicts = [r[rule][1] for r in runs]
            if diff == 0:
                wrong = sum(v is not None for v in verdicts) / len(runs)
                cells.append(f"{'-':>{15 if rule == 'betting' else 17}} {'-':>6} {'wrong ' + format(wrong, '.1%'):>6}")
            else:
                right = sum(v == ("better" if diff > 0 else "worse") for v in verdicts) / len(runs)
                med = statistics.median(ns)
                cells.append(f"{med:>{15 if rule == 'betting' else 17}.0f} {ns[int(0.9 * (len(ns) - 1))]:>6} "
                             f"{right:>6.0%}")
        print(f"{diff:>+10.1f} | {cells[0]} | {cells[1]}")
    print(f"(equal arms: wrong verdicts within the cap; bound alpha = {args.alpha:.0%}; "
          f"log-wealth to decide {math.log(2 / args.alpha):.2f})")
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
