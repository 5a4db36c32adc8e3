"""Gates: does a candidate replace the current release?

A gate gets the candidate's and the base's scores on the recipe's evaluation tasks (computed by the trainer,
one score per task, same tasks for both) and the best mean published so far, and returns a verdict with its
reason. Chosen per recipe (``gate`` setting):

- ``always``: publish every candidate.
- ``floor``: publish when the candidate's mean score is at least ``floor``.
- ``compare``: both answered the same prompts; publish when wins - losses >= ``margin`` (a paired comparison).
- ``regression``: publish unless the candidate's mean falls more than ``margin`` below the best so far.
- ``review``: hold the candidate as pending until a person promotes it (harness recipes).

Noise. A gate that compares the candidate with the base on the same tasks says how sure it is: the mean paired
difference with a 95% interval (Student's t on the per-task differences: approximate for scores in [0, 1] and few
tasks, exact for none; it is there to read, not to decide), and ``p_value``, the exact one-sided sign test on the
untied pairs: how often equal candidates would do at least this well. With ``alpha`` set, ``compare`` decides on
that stated error rate instead of the margin: it publishes when ``p_value <= alpha``, so equal candidates are
published at most ``alpha`` of the time (``tests/test_gate_noise.py`` simulates it); when even a clean sweep of
the untied pairs could not reach ``alpha`` (fewer than log2(1/alpha) of them), the gate cannot decide and holds
the candidate for review, saying how many it would need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from daemon.errors import BadRequest

GATES = ("always", "floor", "compare", "regression", "review")


@dataclass(frozen=True)
class Verdict:
    publish: bool
    verdict: str  # accepted | rejected | pending
    reason: str
    metrics: dict[str, Any]


def _mean(xs: list[float] | None) -> float | None:
    return None if not xs else sum(xs) / len(xs)


# Student's t, two-sided 95%, by degrees of freedom (1..30); beyond: the normal 1.96
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_interval(candidate: list[float], base: list[float]) -> tuple[float, float, float]:
    """The mean of the per-task differences and its 95% interval (t; a single pair has no width to estimate:
    the interval is unbounded)."""
    d = [c - b for c, b in zip(candidate, base, strict=True)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return mean, -math.inf, math.inf
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def sign_test_p(wins: int, losses: int) -> float:
    """P(at least ``wins`` wins of ``wins + losses`` untied pairs | equal candidates): the exact one-sided sign
    test (1.0 when every pair tied)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def pairs_needed(alpha: float) -> int:
    """The fewest untied pairs with which a clean sweep reaches ``alpha``."""
    return max(1, math.ceil(math.log2(1 / alpha)))


def judge(gate: str, *, candidate: list[float] | None, base: list[float] | None, best: float | None,
          floor: float = 0.0, margin: float = 0.0, alpha: float | None = None) -> Verdict:
    if gate not in GATES:
        raise BadRequest(f"unknown gate {gate!r}; gates: {', '.join(GATES)}", param="gate")
    if alpha is not None and not 0 < alpha < 1:
        raise BadRequest(f"alpha (the gate's error rate) must be between 0 and 1, got {alpha}", param="alpha")
    c, b = _mean(candidate), _mean(base)
    metrics: dict[str, Any] = {"eval_reward": c, "base_reward": b}
    if candidate and base and len(candidate) == len(base):  # paired: how sure the difference is
        mean, lo, hi = paired_interval(candidate, base)
        metrics.update(diff=round(mean, 6), diff_ci95=[_finite(lo), _finite(hi)], pairs=len(candidate))
    if gate == "always":
        return Verdict(True, "accepted", "gate always", metrics)
    if gate == "review":
        return Verdict(False, "pending", "held for review: reef releases promote ID publishes it", metrics)
    if c is None:
        raise BadRequest(f"gate {gate!r} needs evaluation tasks (recipe setting eval_family)", param="gate")
    if gate == "floor":
        ok = c >= floor
        return Verdict(ok, "accepted" if ok else "rejected", f"mean {c:.3f} {'>=' if ok else '<'} floor {floor}",
                       metrics)
    if gate == "compare":
        assert candidate is not None and base is not None
        wins = sum(x > y for x, y in zip(candidate, base, strict=True))
        losses = sum(x < y for x, y in zip(candidate, base, strict=True))
        p = sign_test_p(wins, losses)
        metrics.update(wins=wins, losses=losses, p_value=round(p, 6))
        if alpha is not None:
            metrics["alpha"] = alpha
            if wins + losses < pairs_needed(alpha):
                return Verdict(False, "pending", f"cannot decide at error rate {alpha}: {wins + losses} untied "
                               f"pair(s), at least {pairs_needed(alpha)} needed (more tasks or repeats); held for "
                               "review: reef releases promote ID publishes it", metrics)
            ok = p <= alpha
            return Verdict(ok, "accepted" if ok else "rejected",
                           f"wins {wins} - losses {losses}: p = {p:.3g} {'<=' if ok else '>'} alpha {alpha}", metrics)
        ok = wins - losses >= margin
        return Verdict(ok, "accepted" if ok else "rejected",
                       f"wins {wins} - losses {losses} {'>=' if ok else '<'} margin {margin} (p = {p:.3g})", metrics)
    top = best if best is not None else b if b is not None else c
    ok = c >= top - margin
    metrics["best"] = top
    return Verdict(ok, "accepted" if ok else "rejected",
                   f"mean {c:.3f} {'within' if ok else 'more than'} {margin} of best {top:.3f}", metrics)


def _finite(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None
