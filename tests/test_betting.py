"""The betting test itself (``daemon/betting.py``), number by number, against a second implementation written
from its docstring: the stake from the earlier differences only, each bettor on its own side, the clip at
``MAX_STAKE``, the prior, the variance floor, the thresholds at their exact edges, and the planning helpers
(``pairs_needed``, ``detectable``) that ``reef releases canary`` words. The statistical behaviour (error rates,
reports needed) is in tests/test_canary_decision.py; these run in milliseconds, so every mutant of the module meets
them (``bench/mutation.py betting``)."""

from __future__ import annotations

import math

import pytest

from daemon import betting
from daemon.betting import MAX_STAKE, PRIOR_N, Bettors, Evidence


def test_the_documented_constants() -> None:
    assert (MAX_STAKE, PRIOR_N) == (0.5, 1.0)


def reference(diffs: list[float]) -> tuple[float, float, float]:
    """(better, worse, variance) log-wealth, recomputed from the list for every step (the constants written out)."""
    better = worse = 0.0
    for i, d in enumerate(diffs):
        seen = diffs[:i]
        n = 1 + len(seen)
        mean = sum(seen) / n  # the prior adds one pseudo-observation of 0 ...
        var = max((0.5 + sum(x * x for x in seen)) / n - mean**2, 1e-6)  # ... of second moment 1/2
        stake = mean / (var + mean**2)
        if stake > 0:
            better += math.log(1 + min(stake, 0.5) * d)
        else:
            worse += math.log(1 - min(-stake, 0.5) * d)
    n = 1 + len(diffs)
    mean = sum(diffs) / n
    return better, worse, max((0.5 + sum(x * x for x in diffs)) / n - mean**2, 1e-6)


@pytest.mark.parametrize("diffs", [
    [1.0, 1.0, 0.0, 1.0, -1.0, 0.5, 1.0, 1.0],
    [-1.0, -0.5, -1.0, 0.0, -1.0, -1.0],
    [0.2, -0.1, 0.3, 0.3, -0.2, 0.1, 0.25, 0.0, 0.4],
    [1.0] * 12,  # the stake clipped at MAX_STAKE
    [0.0] * 5,  # no signal: the variance floor
])
def test_the_bettors_wealth_is_the_documented_arithmetic(diffs: list[float]) -> None:
    better, worse, var = reference(diffs)
    ev = betting.evidence([0.0] * len(diffs), diffs, alpha=0.05) if min(diffs) >= 0 else None
    b = Bettors(0.05)
    for d in diffs:
        b.add(d)
    got = b.evidence()
    assert got.better == pytest.approx(better, abs=1e-12) and got.worse == pytest.approx(worse, abs=1e-12)
    assert got.var == pytest.approx(var, abs=1e-12) and got.pairs == len(diffs)
    assert got.mean == pytest.approx(sum(diffs) / len(diffs))
    assert got.threshold == math.log(40)
    if ev is not None:  # through the scores: head 0, canary d
        assert (ev.better, ev.worse, ev.pairs) == pytest.approx((got.better, got.worse, got.pairs))


def test_the_stake_is_clipped_at_max_stake_and_never_bets_against_its_side() -> None:
    b = Bettors(0.05)
    for _ in range(6):
        b.add(1.0)
    before = b.better
    b.add(1.0)  # mean ~ 6/7, variance small: the Kelly stake is above 1, clipped to MAX_STAKE
    assert b.better - before == pytest.approx(math.log1p(MAX_STAKE)) and b.worse == 0.0
    b.add(-1.0)  # a loss at the clipped stake: log(1 - 0.5)
    assert b.better - before == pytest.approx(math.log1p(MAX_STAKE) + math.log1p(-MAX_STAKE))
    w = Bettors(0.05)
    for _ in range(8):
        w.add(-1.0)
    assert w.better == 0.0 and w.worse == pytest.approx(7 * math.log1p(MAX_STAKE))  # the first: stake 0


def test_no_pairs_is_evidence_of_nothing() -> None:
    ev = Bettors(0.1).evidence()
    assert (ev.pairs, ev.mean, ev.better, ev.worse, ev.var) == (0, None, 0.0, 0.0, 0.5)
    assert ev.threshold == pytest.approx(math.log(20)) and ev.verdict is None
    assert betting.evidence([], [0.3], alpha=0.1) == ev  # an unpaired report counts for nothing yet
    assert Evidence(0, None, 0.0, 0.0, 1.0).var == 0.5  # the prior's, when none is given
    with pytest.raises(TypeError):  # alpha is named, never a third number that could be taken for a score
        betting.evidence([], [], 0.05)  # type: ignore[misc]


def test_verdicts_at_the_exact_threshold() -> None:
    t = betting.threshold(0.05)
    with pytest.raises(AttributeError):  # evidence is a record of what was seen, never changed after
        Evidence(5, 0.1, t, 0.0, t).better = 0.0  # type: ignore[misc]
    assert Evidence(5, 0.1, t, 0.0, t).verdict == "better"
    assert Evidence(5, 0.1, math.nextafter(t, 0), 0.0, t).verdict is None
    assert Evidence(5, -0.1, 0.0, t, t).verdict == "worse"
    assert Evidence(5, -0.1, 0.0, math.nextafter(t, 0), t).verdict is None
    assert Evidence(5, 0.0, t, t, t).verdict == "better"  # both past it (never with real data): better first


def test_pairs_clip_each_score_into_the_unit_interval() -> None:
    assert betting.pairs([0.25, 1.5, -2.0, 0.5], [0.75, 0.5, 0.5, 3.0]) == [0.5, -0.5, 0.5, 0.5]
    assert betting.pairs([-0.5], [1.5]) == [1.0] and betting.pairs([1.5], [-0.5]) == [-1.0]
    assert betting.pairs([0.2, 0.3], []) == []


def test_growth_and_pairs_needed_follow_the_second_order_kelly_formula() -> None:
    # stake |d| / (v + d^2), unclipped here: 0.2 / 0.54 = 0.370...
    m2 = 0.5 + 0.04
    stake = 0.2 / m2
    assert betting.growth(0.2, 0.5) == pytest.approx(stake * 0.2 - stake**2 * m2 / 2)
    assert betting.growth(-0.2, 0.5) == betting.growth(0.2, 0.5)
    # clipped: |d| / m2 = 0.9 / 0.82 > MAX_STAKE
    m2 = 0.01 + 0.81
    assert betting.growth(0.9, 0.01) == pytest.approx(MAX_STAKE * 0.9 - MAX_STAKE**2 * m2 / 2)
    assert betting.growth(0.0, 0.5) == 0.0
    assert betting.growth(0.0, 0.0) == 0.0  # no difference and no variance: nothing to gain, never 0 / 0
    assert betting.pairs_needed(0.2, 0.5, 0.05) == pytest.approx(math.log(40) / betting.growth(0.2, 0.5))
    assert round(betting.pairs_needed(0.2, 0.5, 0.05)) == 100 and round(betting.pairs_needed(0.3, 0.5, 0.05)) == 48
    assert betting.pairs_needed(0.0, 0.5, 0.05) == math.inf


def test_detectable_is_the_difference_decided_within_the_pairs() -> None:
    for pairs in (42, 100, 400):
        d = betting.detectable(pairs, 0.5, 0.05)
        assert d is not None and 0 < d < 1
        assert betting.pairs_needed(d, 0.5, 0.05) <= pairs < betting.pairs_needed(d - 1e-6, 0.5, 0.05)
    assert betting.detectable(100, 0.5, 0.05) == pytest.approx(0.2, abs=0.005)
    assert betting.detectable(400, 0.5, 0.05) < betting.detectable(100, 0.5, 0.05)  # type: ignore[operator]
    assert betting.detectable(0, 0.5, 0.05) is None and betting.detectable(-3, 0.5, 0.05) is None
    few = betting.pairs_needed(1.0, 0.5, 0.05)
    assert betting.detectable(few, 0.5, 0.05) is not None  # exactly as many as a difference of 1 needs
    assert betting.detectable(few - 0.3, 0.5, 0.05) is None  # a little fewer: not even 1 (however large 2 is)
    assert betting.detectable(math.floor(few), 0.5, 0.05) is None  # not even a difference of 1 in that many
    d = betting.detectable(math.ceil(few), 0.5, 0.05)
    assert d is not None and betting.pairs_needed(d, 0.5, 0.05) <= math.ceil(few)


def wealth(xs: list[float], m: float, up: bool, lo: float = -1.0, hi: float = 1.0) -> float:
    """One bettor's log-wealth against the mean ``m``, written out from ``Bettors``' docstring: it stakes on
    ``x - m`` (each x clipped to [lo, hi]) the Kelly stake of the earlier ones (with the prior), on its own side
    only, capped so that a factor stays at least ``1 - MAX_STAKE``: ``MAX_STAKE / (m - lo)`` above, ``MAX_STAKE /
    (hi - m)`` below, never more than ``MAX_STAKE``."""
    cap = MAX_STAKE / max(1.0, (m - lo) if up else (hi - m))
    total, total_sq, n, w = 0.0, 0.5, 1.0, 0.0
    for x in xs:
        y = min(hi, max(lo, x)) - m
        mean = total / n
        stake = mean / (max(total_sq / n - mean**2, 1e-6) + mean**2)
        w += math.log1p(min(cap, max(0.0, stake if up else -stake)) * (y if up else -y))
        total, total_sq, n = total + y, total_sq + y * y, n + 1
    return w


SKEWED = {"high": [1.0, 1.0, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.75] * 3,  # an interval well above 0
          "low": [-1.0, -1.0, -0.5, -1.0, 0.25, -1.0, -1.0, -1.0, -0.75, -1.0] * 3}


@pytest.mark.parametrize("null", [-0.6, 0.0, 0.5, 0.8])
def test_bettors_against_another_mean_cap_their_stake_by_the_most_a_factor_can_lose(null: float) -> None:
    """Against a mean other than 0 (an interval's edge) the worst difference is further away on one side: the
    stake there is capped at ``MAX_STAKE / (null - lo)`` (above) or ``MAX_STAKE / (hi - null)`` (below), so a factor
    never drops under ``1 - MAX_STAKE``. Bugs caught: the cap of the decision's null 0 used at every null, the
    distance to the edge miscomputed."""
    for xs in SKEWED.values():
        b = Bettors(0.05, null=null)
        for x in xs:
            b.add(x)
        assert b.better == pytest.approx(wealth(xs, null, True), abs=1e-12)
        assert b.worse == pytest.approx(wealth(xs, null, False), abs=1e-12)
        assert b.evidence().mean == pytest.approx(sum(xs) / len(xs))


@pytest.mark.parametrize("name", SKEWED)
def test_the_intervals_edges_are_where_the_bettors_at_that_mean_reach_the_threshold(name: str) -> None:
    """``interval``'s edges (its bettors inlined for speed) against ``wealth`` at each edge's mean: just outside
    an edge the bettor on that side has reached ``log(2 / alpha)``, just inside it has not (to the bisection's
    1/4096 of the range). Bugs caught: the inlined caps differing from ``Bettors``' (one side, or away from 0)."""
    xs, limit = SKEWED[name], betting.threshold(0.05)
    iv = betting.interval(xs, 0.05)
    assert iv is not None
    lo, hi = iv
    assert (lo > 0.3) if name == "high" else (hi < -0.3)  # the caps away from 0 are the ones that bind
    step = 2 / 4096 * 1.01
    if lo > -1 + step:  # (an edge at the range's end is one no bettor reaches)
        assert wealth(xs, lo - step, True) >= limit > wealth(xs, lo + step, True)
    if hi < 1 - step:
        assert wealth(xs, hi + step, False) >= limit > wealth(xs, hi - step, False)


@pytest.mark.parametrize("alpha", [0.05, 0.3])
@pytest.mark.parametrize("xs", [[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], [0.5, 0.75, 0.25, 0.5, 1.0, 0.5] * 4,
                                [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0] * 3])
def test_each_arms_interval_edges_are_the_papers_hedged_process_at_the_bisections_resolution(xs: list[float],
                                                                                            alpha: float) -> None:
    """``mean_interval``'s edges against the hedged capital process written out from the paper (its stakes from
    the running variance, the prior of one score of 1/2): just outside each edge the process has reached
    ``log(2 / alpha)``, just inside it has not, to 1/4096. Bugs caught: the stakes' constant or the running mean
    the variance is taken about off by a little (the interval a few hundredths off, still covering)."""
    from tests.test_canary_decision import _hedged_wealth

    iv = betting.mean_interval(xs, alpha)
    assert iv is not None
    lo, hi = iv
    limit, step = betting.threshold(alpha), 1 / 4096 * 1.01
    if lo > step:
        assert _hedged_wealth(xs, lo - step, alpha) >= limit > _hedged_wealth(xs, lo + step, alpha)
    if hi < 1 - step:
        assert _hedged_wealth(xs, hi + step, alpha) >= limit > _hedged_wealth(xs, hi - step, alpha)
    assert lo > step or hi < 1 - step


def test_each_arms_scores_are_clipped_into_the_unit_interval() -> None:
    """A report's score is any number: an arm's interval is over scores clipped to [0, 1], as the decision's."""
    xs = [1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0]
    wild = [{1.0: 7.5, 0.0: -3.0}.get(x, x) for x in xs]
    assert betting.mean_interval(wild, 0.05) == betting.mean_interval(xs, 0.05)
    assert betting.interval([2 * x - 1 for x in wild], 0.05) == betting.interval([2 * x - 1 for x in xs], 0.05)
