"""Anytime-valid tests by betting: is one arm's mean score above (or below) the other's?

The canary (``daemon/canary.py``) compares a candidate with the head on live scores, checked after every report, so
its test must stay valid however often it looks. Testing by betting (Shafer; Waudby-Smith and Ramdas, "Estimating
means of bounded random variables by betting", 2023) gives that: a bettor starts with wealth 1 and stakes a
fraction of it on each new observation; under the null hypothesis its wealth is a nonnegative supermartingale, so by
Ville's inequality it ever reaches ``1 / a`` with probability at most ``a``. Reject when it does, at any moment.

Design choices:
- The observation is a **paired difference** ``d = canary score - head score`` in [-1, 1]: the i-th report of each
  arm, in the order they came (reports on the head's arm usually outnumber the canary's; the surplus waits for a
  partner). Each arm's scores are taken as independent draws from its own distribution; pairing by arrival also
  cancels slow drift that touches both arms alike (the tasks of a week changing).
- **Two one-sided bettors**, ``1 + l*d`` (the canary is better) and ``1 - l*d`` (worse), each against threshold
  ``2 / alpha``: with equal arms a wrong verdict either way has probability at most ``alpha`` in all.
- **The stake** ``l`` is aGRAPA's (approximate growth-rate adaptive to the particular alternative): the Kelly stake
  for the differences seen so far, ``mean / (variance + mean^2)`` of the earlier ones (never of the current one: the
  stake must be fixed before the observation), clipped to [0, ``MAX_STAKE``]. A bettor on the wrong side stakes 0
  and keeps its wealth; ``MAX_STAKE`` < 1 keeps every factor at least ``1 - MAX_STAKE``.
- Scores outside [0, 1] are clipped (a report's score is any number; the test is about bounded ones).

``bench/canary.py`` measures the reports each rule needs, beside the per-arm Hoeffding test it replaced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_STAKE = 0.5  # the largest fraction of wealth staked on one difference
PRIOR_N = 1.0  # the stake's estimates start from one pseudo-observation of mean 0 and variance 1/2


@dataclass(frozen=True)
class Evidence:
    """Two bettors' log-wealth after ``pairs`` paired differences: ``better`` (the canary is better), ``worse``;
    ``mean``: the mean difference; ``threshold``: the log-wealth that decides, ``log(2 / alpha)``."""

    pairs: int
    mean: float | None
    better: float
    worse: float
    threshold: float
    var: float = 0.5  # the differences' variance as the stake estimates it (the prior's 1/2 before any)

    @property
    def verdict(self) -> str | None:
        """``better``, ``worse``, or None (undecided)."""
        if self.better >= self.threshold:
            return "better"
        if self.worse >= self.threshold:
            return "worse"
        return None


def threshold(alpha: float) -> float:
    """The log-wealth at which either one-sided bettor decides: ``log(2 / alpha)`` (alpha split over both sides)."""
    return math.log(2.0 / alpha)


def pairs(head: Sequence[float], canary: Sequence[float]) -> list[float]:
    """The paired differences canary - head, by order of arrival, each score clipped to [0, 1]."""
    return [min(1.0, max(0.0, c)) - min(1.0, max(0.0, h)) for h, c in zip(head, canary, strict=False)]


class Bettors:
    """The two bettors, fed one paired difference at a time (``add``): what ``evidence`` computes at once, for a
    caller that sees the differences arrive (``bench/canary.py``).

    ``null``: the mean they bet against (0: the decision's; another value for an interval's edge, ``interval``),
    for observations in [``lo``, ``hi``]. Each stakes on ``x - null``; a stake is capped so that a factor stays at
    least ``1 - MAX_STAKE`` (``MAX_STAKE`` itself for differences against 0, as the decision bets)."""

    def __init__(self, alpha: float, null: float = 0.0, lo: float = -1.0, hi: float = 1.0) -> None:
        self.threshold = threshold(alpha)
        self.null = null
        self.better = self.worse = 0.0
        self._up_cap = MAX_STAKE / max(1.0, null - lo)  # the largest loss of the bettor on "above": x = lo
        self._down_cap = MAX_STAKE / max(1.0, hi - null)
        self._total, self._total_sq, self._n = 0.0, PRIOR_N * 0.5, PRIOR_N  # mean 0, variance 1/2  # pragma: no mutate (PRIOR_N is 1: PRIOR_N - 0.5 is the same half)

    def add(self, d: float) -> None:
        y = d - self.null
        mean = self._total / self._n
        var = max(self._total_sq / self._n - mean * mean, 1e-6)  # pragma: no mutate (the prior keeps it above 1/(2n), as in evidence)
        stake = mean / (var + mean * mean)  # the Kelly stake of the differences so far (negative: bet on worse)
        up, down = min(self._up_cap, max(0.0, stake)), min(self._down_cap, max(0.0, -stake))
        self.better += math.log1p(up * y)
        self.worse += math.log1p(-down * y)
        self._total += y
        self._total_sq += y * y
        self._n += 1

    def evidence(self) -> Evidence:
        k = int(self._n - PRIOR_N)
        mean = self._total / self._n
        var = max(self._total_sq / self._n - mean * mean, 1e-6)  # pragma: no mutate (the prior keeps it above 1/(2n): the floor binds past 500,000 pairs)
        return Evidence(k, (self._total / k + self.null) if k else None, self.better, self.worse, self.threshold,
                        var)


def growth(diff: float, var: float) -> float:
    """A bettor's expected log-wealth gain per paired difference of mean ``diff`` and variance ``var``, staking the
    Kelly fraction ``|diff| / (var + diff^2)`` (at most ``MAX_STAKE``), to second order in the stake:
    ``l*|diff| - l^2 (var + diff^2) / 2``."""
    m2 = max(var + diff * diff, 1e-12)
    stake = min(MAX_STAKE, abs(diff) / m2)
    return stake * abs(diff) - stake * stake * m2 / 2


def pairs_needed(diff: float, var: float, alpha: float) -> float:
    """The expected paired differences until a bettor decides a true difference ``diff``: ``log(2/alpha)`` over
    its growth per pair. Ignores the stake's learning of the first few pairs, so it is a slight underestimate:
    pass/fail scores around 0.5 (variance 0.5) give 100 pairs for 0.2 and 48 for 0.3, where ``bench/canary.py``
    measured medians of 105 and 48."""
    g = growth(diff, var)
    return math.inf if g <= 0 else threshold(alpha) / g  # pragma: no mutate (growth is never below 0: == is the same)


def detectable(pairs: float, var: float, alpha: float) -> float | None:
    """The smallest difference (either way) the bettors are expected to decide within ``pairs`` paired
    differences (``pairs_needed`` equals it); None when not even a difference of 1 is."""
    if pairs <= 0 or pairs_needed(1.0, var, alpha) > pairs:  # pragma: no mutate (a difference of 1 needs 2 pairs or more at any alpha: the second test covers the first)
        return None
    lo, hi = 0.0, 1.0  # pragma: no mutate (a wider start: one more halving, the same root within 40 steps)
    for _ in range(40):  # pairs_needed falls as the difference grows: bisect  # pragma: no mutate (a step more or less: the root to within 1e-12 either way)
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pairs_needed(mid, var, alpha) <= pairs else (mid, hi)  # pragma: no mutate (equality to the last bit: no input gives it)
    return hi


def evidence(head: Sequence[float], canary: Sequence[float], *, alpha: float) -> Evidence:
    """Both bettors' log-wealth over the paired differences of ``head`` and ``canary`` scores."""
    b = Bettors(alpha)
    for d in pairs(head, canary):
        b.add(d)
    return b.evidence()


EDGE_STEPS = 12  # bisection steps for an interval's edge: 1/4096 of its range  # pragma: no mutate (a finer bisection is as right)


def interval(xs: Sequence[float], alpha: float, *, lo: float = -1.0, hi: float = 1.0,
             at: float = 0.0) -> tuple[float, float] | None:
    """The decision's interval for the mean of paired differences ``xs`` (each clipped to [``lo``, ``hi``]): the
    means the two bettors (``Bettors`` with that ``null``) do not reject at ``2 / alpha`` after all of ``xs``, at
    least ``1 - alpha`` at every moment at once. Its edges are found by bisection from ``at``, whose own verdict
    decides on which side each edge lies: with ``at = 0`` (the decision's null) it lies above 0 exactly when the
    bettors decide "better", below 0 exactly when "worse", as ``evidence`` does. None without observations."""
    if not xs:
        return None
    ys = [min(hi, max(lo, x)) for x in xs]
    limit = threshold(alpha)

    def rejects(m: float, up: bool) -> bool:  # Bettors(alpha, m, lo, hi) fed ys, one side, inlined (the hot loop)
        cap = MAX_STAKE / max(1.0, m - lo if up else hi - m)
        sign = 1.0 if up else -1.0
        wealth, total, total_sq, n = 0.0, 0.0, PRIOR_N * 0.5, PRIOR_N  # pragma: no mutate (PRIOR_N is 1, as in Bettors)
        for x in ys:
            y = x - m
            mean = total / n
            var = max(total_sq / n - mean * mean, 1e-6)  # pragma: no mutate (the prior keeps it above 1/(2n), as in Bettors)
            stake = min(cap, max(0.0, sign * mean / (var + mean * mean)))
            wealth += math.log1p(sign * stake * y)
            total += y
            total_sq += y * y
            n += 1  # pragma: no mutate (the stake is mean / (var + mean^2) = total / total_sq: n cancels)
        return wealth >= limit  # pragma: no mutate (wealth equal to the limit to the last bit: no data gives it)

    return _edges(rejects, lo, hi, at)


def mean_interval(xs: Sequence[float], alpha: float) -> tuple[float, float] | None:
    """The confidence sequence for the mean of scores ``xs`` in [0, 1] (each clipped) that people read for each arm:
    Waudby-Smith and Ramdas's hedged capital process with predictable plug-in stakes (their Theorem 3), ``l_i =
    sqrt(2 log(2/alpha) / (s_{i-1}^2 i log(1 + i)))`` with ``s^2`` the running variance (from a prior of mean 1/2
    and variance 1/4), at most ``MAX_STAKE / m`` on "above m" and ``MAX_STAKE / (1 - m)`` on "below"; a mean ``m``
    is out when either bettor's wealth reaches ``2 / alpha``. Its stakes do not depend on ``m``, so it is tight from
    the first reports (12 pass/fail scores of mean 2/3 at alpha 0.025: [0.24, 1], where the decision's bettors give
    [0, 1] and Hoeffding's sequence [0.03, 1]). None without scores."""
    if not xs:
        return None
    ys = [min(1.0, max(0.0, x)) for x in xs]
    stakes, total, spread = [], 0.5, 0.25  # the prior: one score of 1/2, variance 1/4
    for i, y in enumerate(ys, start=1):
        stakes.append(math.sqrt(2 * math.log(2 / alpha) / (max(spread / i, 1e-6) * i * math.log(1 + i))))
        total += y
        spread += (y - total / (i + 1)) ** 2  # about the mean with this score (the paper's)
    limit = threshold(alpha)

    def rejects(m: float, up: bool) -> bool:
        loss = m if up else 1.0 - m  # the most a score can fall short of m (up) or exceed it (down)
        cap = MAX_STAKE / loss if loss > 0 else math.inf  # a factor never below 1 - MAX_STAKE  # pragma: no mutate (loss is m or 1 - m, never below 0: != is the same)
        sign = 1.0 if up else -1.0
        return sum(math.log1p(sign * min(stake, cap) * (y - m)) for stake, y in zip(stakes, ys, strict=True)) >= limit  # pragma: no mutate (one stake per score by construction; equality as above)

    return _edges(rejects, 0.0, 1.0, sum(ys) / len(ys))


def _edges(rejects: Callable[[float, bool], bool], lo: float, hi: float, at: float) -> tuple[float, float]:
    """The interval of the means in [lo, hi] that ``rejects(m, up)`` keeps, by bisection from ``at``: ``up`` (the
    lower edge) is the bettor on "the mean is above m", which rejects every m well below the mean and none at
    ``hi``; the edge lies above ``at`` when it rejects ``at`` itself, below it otherwise (and the other way round
    for the upper edge)."""
    def edge(up: bool) -> float:
        far = lo if up else hi
        if rejects(at, up):
            keep, drop = (hi, at) if up else (lo, at)  # keep: not rejected; drop: rejected
        elif not rejects(far, up):
            return far
        else:
            keep, drop = at, far
        for _ in range(EDGE_STEPS):  # keep is never rejected, drop always is
            mid = (keep + drop) / 2
            if rejects(mid, up):
                drop = mid
            else:
                keep = mid
        return keep

    return edge(True), edge(False)
