"""The canary's decision rule (``daemon/betting.py`` through ``daemon.canary.decide``) and its settings, without a
daemon: the test decides at the documented error rate with the reports users have, never inflates that rate by
looking after every report, and the latency and settings bounds hold exactly where they are stated."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from daemon import betting
from daemon.canary import _duration, _median, decide, describe, in_canary, radius, settings_of
from daemon.errors import BadRequest

KW = {"alpha": 0.05, "max_reports": 10_000}


def _run(diff: float, rng: random.Random, cap: int = 2000) -> tuple[int, str | None]:
    """Pass/fail reports, half on each arm, judged after every report as the daemon does: canary-arm reports until
    the verdict."""
    head: list[float] = []
    canary: list[float] = []
    bettors = betting.Bettors(0.05)
    while len(canary) < cap:
        if rng.random() < 0.5:
            canary.append(1.0 if rng.random() < 0.5 + diff else 0.0)
            if len(canary) <= len(head):
                bettors.add(canary[-1] - head[len(canary) - 1])
        else:
            head.append(1.0 if rng.random() < 0.5 else 0.0)
            if len(head) <= len(canary):
                bettors.add(canary[len(head) - 1] - head[-1])
        v = bettors.evidence().verdict
        if v is not None:
            return len(canary), v
    return len(canary), None


def test_a_better_candidate_is_promoted_and_a_worse_one_ended_with_the_reports_users_have() -> None:
    """The issue's bounds at alpha 0.05 on pass/fail scores: +0.2 promoted with a median of at most 300 canary
    reports, -0.3 ended within a median of 100, every verdict the right one (seeded). Bugs caught: the per-arm
    Hoeffding rule it replaced (about 2,000 reports for +0.2), a stake that never grows (a flipped clip)."""
    rng = random.Random(7)
    better = [_run(0.2, rng) for _ in range(40)]
    worse = [_run(-0.3, rng) for _ in range(40)]
    assert all(v == "better" for _, v in better) and all(v == "worse" for _, v in worse)
    assert sorted(n for n, _ in better)[20] <= 300
    assert sorted(n for n, _ in worse)[20] <= 100


def test_equal_arms_are_rarely_decided_however_often_the_test_looks() -> None:
    """Checked after every report up to 600 canary reports: equal arms end in a verdict in at most alpha of the
    trials (seeded; the bound holds for any number of looks). Bugs caught: a stake fixed after seeing its own
    difference (wealth grows under the null), the threshold at 1 / alpha or alpha spent on each side in full."""
    rng = random.Random(11)
    wrong = sum(_run(0.0, rng, cap=600)[1] is not None for _ in range(200))
    assert wrong <= 10, wrong  # 5% of 200


def test_the_threshold_splits_alpha_over_both_sides() -> None:
    """A bettor whose wealth is past 1 / alpha but short of 2 / alpha decides nothing, through ``decide``: found
    on a run of wins, the first step where the wealth is past 20 (it grows by at most 1.5x a step, so it is then
    short of 40). Bug caught: all of alpha spent on each side (twice the stated error rate)."""
    assert betting.threshold(0.05) == pytest.approx(math.log(40))
    for k in range(1, 200):
        ev = betting.evidence([0.0] * k, [1.0] * k, alpha=0.05)
        if ev.better >= math.log(20):
            break
    assert math.log(20) <= ev.better < math.log(40), ev
    assert decide([0.0] * k, [1.0] * k, **KW).verdict is None
    decided = next(j for j in range(k, k + 10) if decide([0.0] * j, [1.0] * j, **KW).verdict is not None)
    assert decide([0.0] * decided, [1.0] * decided, **KW).verdict == "promoted"
    assert decide([1.0] * decided, [0.0] * decided, **KW).verdict == "ended"


def test_the_stake_is_fixed_before_each_difference() -> None:
    """The first difference is bet on with the prior's stake (0: nothing seen), so one win moves no wealth; and a
    bettor stakes only on its own side. Bug caught: the stake computed after adding the difference it bets on."""
    one = betting.evidence([0.0], [1.0], alpha=0.05)
    assert one.better == 0.0 and one.worse == 0.0 and one.pairs == 1
    ev = betting.evidence([0.0] * 5, [1.0] * 5, alpha=0.05)
    assert ev.better > 0 and ev.worse == 0.0


def test_pairs_are_taken_in_order_and_scores_clipped() -> None:
    """The surplus reports of the larger arm wait for a partner; scores outside [0, 1] count as its ends."""
    assert betting.pairs([0.5, 1.0, 0.0], [2.0, -1.0]) == [0.5, -1.0]
    figures = decide([1.0] * 30 + [0.0] * 50, [1.0] * 30, **KW).figures
    assert figures["pairs"] == 30 and figures["difference"] == 0.0


def test_a_tie_needs_both_arms_at_max_reports() -> None:
    same = [1.0, 0.0] * 50
    assert decide(same, same, alpha=0.05, max_reports=100).verdict == "tie"
    assert decide(same[:99], same, alpha=0.05, max_reports=100).verdict is None
    assert decide(same, same[:99], alpha=0.05, max_reports=100).verdict is None
    more = [0.0, 1.0] * 51  # past the bound on either arm (reports go on coming while it is judged): a tie too
    assert decide(same, more, alpha=0.05, max_reports=100).verdict == "tie"
    assert decide(more, same, alpha=0.05, max_reports=100).verdict == "tie"


def test_the_latency_median_of_an_even_count_is_the_mean_of_its_middle_two() -> None:
    """Through the bound: the canary's 20 times, half 10 ms and half 30 ms, have the median 20, exactly twice the
    head's 10: not past the bound of 2; 22 ms is past it. Bug caught: the upper (or lower) middle taken alone."""
    assert _median([1.0, 2.0, 3.0, 100.0]) == 2.5 and _median([3.0, 1.0, 2.0]) == 2.0
    assert _median([1.0, 1.2345]) == 1.117 and _median([]) is None  # to the millisecond
    head = [10.0] * 20
    kw = {**KW, "min_exchanges": 20, "max_latency_ratio": 2.0}
    assert decide([0.5], [0.5], head_ms=head, canary_ms=[10.0] * 10 + [30.0] * 10, **kw).verdict is None
    assert decide([0.5], [0.5], head_ms=head, canary_ms=[14.0] * 10 + [30.0] * 10, **kw).verdict == "latency"
    assert decide([0.5], [0.5], head_ms=head + head, canary_ms=[30.0] * 25, **kw).verdict == "latency"  # past min


@pytest.mark.parametrize(("key", "value"), [
    ("max_reports", 1e999), ("min_exchanges", float("inf")), ("max_reports", float("nan")), ("alpha", float("nan")),
    ("max_latency_ratio", float("inf")), ("max_reports", 10 ** 30), ("max_error_rate", 1.0), ("alpha", 0),
    ("max_reports", 2.5), ("min_exchanges", True), ("alpha", "0.05"), ("max_latency_ratio", 0.5),
])
def test_settings_out_of_range_or_not_finite_are_refused_by_name(key: str, value: object) -> None:
    """Bug caught: ``int(1e999)`` raised OverflowError (a 500) before the range check."""
    with pytest.raises(BadRequest) as e:
        settings_of({"release_id": "x", key: value})
    assert e.value.data["param"] == key


def test_unknown_settings_are_refused_and_defaults_fill_the_rest() -> None:
    with pytest.raises(BadRequest) as e:
        settings_of({"release_id": "x", "max_report": 10})
    assert e.value.data["param"] == "max_report"
    with pytest.raises(BadRequest) as e:
        settings_of({"zeta": 1, "max_report": 10})
    assert e.value.data["param"] == "max_report" and "unknown keys max_report, zeta" in e.value.message
    got = settings_of({"release_id": "x", "max_reports": 50.0})
    assert got["max_reports"] == 50 and isinstance(got["max_reports"], int) and got["alpha"] == 0.05
    assert settings_of({}) == {"alpha": 0.05, "max_reports": 400, "max_error_rate": 0.2, "min_exchanges": 20,
                               "max_latency_ratio": 2.0, "max_empty_excess": 0.3, "min_length_ratio": 0.25,
                               "max_loop_excess": 0.3, "guard_answers": 10, "max_answers": None, "max_hours": None}  # docs/releases.md's


@pytest.mark.parametrize(("key", "value", "says"), [
    ("alpha", 1.5, "alpha must be a fraction in (0, 1), got 1.5"),
    ("max_latency_ratio", 0.9, "max_latency_ratio must be a finite ratio of at least 1, got 0.9"),
    ("max_hours", 0, "max_hours must be a positive number of hours up to 1000000, or null, got 0"),
    ("max_reports", 0, "max_reports must be a positive whole number up to 1000000000, got 0"),
    ("max_answers", 0, "max_answers must be a positive whole number up to 1000000000, got 0"),
    ("guard_answers", 0, "guard_answers must be a positive whole number up to 1000000000, got 0"),
])
def test_a_setting_out_of_range_is_refused_saying_what_it_must_be(key: str, value: object, says: str) -> None:
    with pytest.raises(BadRequest) as e:
        settings_of({key: value})
    assert e.value.message == says


def test_a_latency_ratio_of_one_or_more_is_taken() -> None:
    assert settings_of({"max_latency_ratio": 1})["max_latency_ratio"] == 1
    assert settings_of({"max_latency_ratio": 1.5})["max_latency_ratio"] == 1.5


GUARD = {**KW, "max_empty_excess": 0.3, "min_length_ratio": 0.25, "guard_answers": 10}


def test_a_canary_that_stops_answering_ends_without_a_score() -> None:
    """Half its answers empty (one token at most) against none of the head's: ended at the 10th answer, before any
    report. Bugs caught: the guard waiting for scores, comparing with nothing (the head's rate ignored), counting
    from the wrong arm."""
    head = [40] * 10
    half = [0, 30] * 5
    d = decide([], [], head_tokens=head, canary_tokens=half, **GUARD)
    assert d.verdict == "empty" and d.figures["canary_empty_rate"] == 0.5 and d.figures["head_empty_rate"] == 0.0
    assert decide([], [], head_tokens=head, canary_tokens=half[:9], **GUARD).verdict is None  # 9 answers: not yet
    assert decide([], [], head_tokens=head[:9], canary_tokens=half, **GUARD).verdict is None  # nor 9 on the head
    assert decide([], [], head_tokens=half, canary_tokens=head, **GUARD).verdict is None  # the head is the empty one
    # the head's own empty answers count: 10% and 35% differ by less than the bound
    ten = [1] + [40] * 9
    some = [1] * 7 + [40] * 13
    assert decide([], [], head_tokens=ten, canary_tokens=some, **GUARD).verdict is None
    assert decide([], [], head_tokens=ten, canary_tokens=[1] * 9 + [40] * 11, **GUARD).verdict == "empty"
    # the bound is "more than": exactly 0.3 above the head's is not past it (0.4 - 0.1 is 0.30000000000000004 in
    # floating point), 0.4 above is
    assert decide([], [], head_tokens=ten, canary_tokens=[1] * 4 + [40] * 6, **GUARD).verdict is None
    assert decide([], [], head_tokens=[40] * 10, canary_tokens=[1] * 3 + [40] * 7, **GUARD).verdict is None
    assert decide([], [], head_tokens=ten, canary_tokens=[1] * 5 + [40] * 5, **GUARD).verdict == "empty"
    # empty is at most one token (the end of text alone): two tokens are an answer; rates to 4 places
    seven = decide([], [], head_tokens=[2] * 7, canary_tokens=[1] + [2] * 6, **GUARD).figures
    assert (seven["head_empty_rate"], seven["canary_empty_rate"]) == (0.0, 0.1429)


def test_a_canary_whose_answers_collapse_in_length_ends() -> None:
    head = [40] * 12
    assert decide([], [], head_tokens=head, canary_tokens=[9] * 12, **GUARD).verdict == "short"
    assert decide([], [], head_tokens=head, canary_tokens=[10] * 12, **GUARD).verdict is None  # exactly a quarter
    # exactly the ratio is not shorter than it, in floating point too (0.55 * 100 is 55.00000000000001)
    ratio = {**GUARD, "min_length_ratio": 0.55}
    assert decide([], [], head_tokens=[100] * 12, canary_tokens=[55] * 12, **ratio).verdict is None
    assert decide([], [], head_tokens=[100] * 12, canary_tokens=[54] * 12, **ratio).verdict == "short"
    d = decide([1.0] * 3, [1.0] * 3, head_tokens=head, canary_tokens=[40] * 12, **GUARD)
    assert d.verdict is None and d.figures["canary_p50_tokens"] == 40.0


def test_a_canary_whose_answers_loop_ends_without_a_score() -> None:
    """A candidate that says a sentence again and again (past the held-out check's first tokens) is ended on the
    answers its arm served: 4 of 10 looping against none of the head's. Bugs caught: the guard off by default,
    reading before guard_answers on either arm, the head's own loops ignored, "more than" read as "at least", the
    arms swapped, answers without tokens counted as not looping."""
    head, cand = [40] * 10, [40] * 10
    loop4 = [True] * 4 + [False] * 6
    on = {**GUARD, "max_loop_excess": 0.3}
    d = decide([], [], head_tokens=head, canary_tokens=cand, head_loops=[False] * 10, canary_loops=loop4, **on)
    assert d.verdict == "loops" and (d.figures["canary_loop_rate"], d.figures["head_loop_rate"]) == (0.4, 0.0)
    assert "40% of the canary's 10 answers loop" in d.reason and "0% of the head's 10" in d.reason
    assert decide([], [], head_tokens=head, canary_tokens=cand, head_loops=loop4, canary_loops=[False] * 10,
                  **on).verdict is None  # the head is the looping one
    assert decide([], [], head_tokens=head, canary_tokens=cand, head_loops=[False] * 10, canary_loops=loop4[:9],
                  **on).verdict is None  # 9 answers with tokens: not yet
    assert decide([], [], head_tokens=head, canary_tokens=cand, head_loops=[False] * 9, canary_loops=loop4,
                  **on).verdict is None  # nor 9 on the head
    # the head's own loops count, and the bound is "more than": 0.4 - 0.1 is not past 0.3, 0.5 - 0.1 is
    ten = [True] + [False] * 9
    assert decide([], [], head_tokens=head, canary_tokens=cand, head_loops=ten, canary_loops=loop4,
                  **on).verdict is None
    assert decide([], [], head_tokens=head, canary_tokens=cand, head_loops=ten,
                  canary_loops=[True] * 5 + [False] * 5, **on).verdict == "loops"
    # past guard_answers on either arm too (20 and 30 answers), not only at exactly 10
    assert decide([], [], head_tokens=head * 3, canary_tokens=cand * 2, head_loops=[False] * 30,
                  canary_loops=loop4 * 2, **on).verdict == "loops"
    assert decide([], [], head_tokens=head * 3, canary_tokens=cand * 3, head_loops=[False] * 30,
                  canary_loops=loop4 * 3, **on).verdict == "loops"
    # rates to 4 places (1 of 7 is 0.1429), and their difference too: 4 of 13 (0.3077) against 1 of 137 (0.0073)
    # is 0.3004, past the bound (to 3 places it would be 0.3, not past it)
    seven = decide([], [], head_tokens=[40] * 7, canary_tokens=[40] * 7, head_loops=[False] * 7,
                   canary_loops=[True] + [False] * 6, **on).figures
    assert (seven["canary_loop_rate"], seven["head_loop_rate"]) == (0.1429, 0.0)
    d = decide([], [], head_tokens=[40] * 137, canary_tokens=[40] * 13, head_loops=[True] + [False] * 136,
               canary_loops=[True] * 4 + [False] * 9, **on)
    assert (d.figures["canary_loop_rate"], d.figures["head_loop_rate"], d.verdict) == (0.3077, 0.0073, "loops")
    # off unless given to decide (a canary row from before the guard); on at the defaults a canary starts with
    assert decide([], [], head_tokens=head, canary_tokens=cand, head_loops=[False] * 10, canary_loops=[True] * 10,
                  **GUARD).verdict is None
    assert settings_of({})["max_loop_excess"] == 0.3


@pytest.mark.parametrize(("key", "value"), [("max_empty_excess", 1.0), ("min_length_ratio", 0), ("guard_answers", 0),
                                            ("guard_answers", 2.5), ("max_loop_excess", 0), ("max_loop_excess", 1)])
def test_guard_settings_out_of_range_are_refused(key: str, value: object) -> None:
    with pytest.raises(BadRequest) as e:
        settings_of({"release_id": "x", key: value})
    assert e.value.data["param"] == key


def _draw(rng: random.Random, mean: float, graded: bool) -> float:
    """A pass/fail score of that rate, or a graded one around it (sd 0.25, clipped to [0, 1])."""
    return min(1.0, max(0.0, rng.gauss(mean, 0.25))) if graded else float(rng.random() < mean)


def test_the_difference_interval_is_the_decisions_own() -> None:
    """Seeded canaries (pass/fail and graded scores, differences -0.3 to +0.5), one pair of reports at a time up to
    120 pairs: after every pair the difference's interval by betting lies above 0 exactly when ``decide`` promotes on
    the scores, below 0 exactly when it ends, and holds 0 while it decides nothing; ``intervals`` (what people read)
    gives the same. Bugs caught: the interval's bettors at another threshold (1 / alpha) or stake cap than the
    decision's, anchored at the mean difference rather than at 0, the bisection's sides swapped."""
    from daemon.canary import intervals

    rng = random.Random(5)
    verdicts = set()
    for trial in range(24):
        diff, graded = (-0.3, -0.15, 0.0, 0.15, 0.3, 0.5)[trial % 6], trial % 4 >= 2
        head: list[float] = []
        canary: list[float] = []
        for _ in range(120):
            head.append(_draw(rng, 0.5 - diff / 2, graded))
            canary.append(_draw(rng, 0.5 + diff / 2, graded))
            verdict = decide(head, canary, **KW).verdict
            iv = betting.interval(betting.pairs(head, canary), 0.05, lo=-1.0, hi=1.0, at=0.0)
            assert iv is not None
            lo, hi = iv
            assert (verdict == "promoted") == (lo > 0) and (verdict == "ended") == (hi < 0), (verdict, lo, hi)
            assert lo <= hi
            if verdict is not None:
                verdicts.add(verdict)
                shown = intervals(tuple(head), tuple(canary), 0.05)["difference_interval"]
                assert shown is not None and (shown[0] > 0 if verdict == "promoted" else shown[1] < 0), shown
                break
    assert verdicts == {"promoted", "ended"}


def _hedged_wealth(xs: list[float], m: float, alpha: float) -> float:
    """Waudby-Smith and Ramdas's hedged capital process at ``m`` (predictable plug-in stakes, capped at 1/2 of the
    most a factor can lose), written out from the paper: the larger log-wealth of its two one-sided bettors."""
    up = down = 0.0
    mean, var = 0.5, 0.25  # the prior as one observation
    for i, x in enumerate(xs, start=1):
        stake = math.sqrt(2 * math.log(2 / alpha) / (var * i * math.log(1 + i)))
        up += math.log(1 + min(stake, 0.5 / m) * (x - m))
        down += math.log(1 - min(stake, 0.5 / (1 - m)) * (x - m))
        mean = (mean * i + x) / (i + 1)
        var = (var * i + (x - mean) ** 2) / (i + 1)
    return max(up, down)


def test_each_arms_interval_by_betting_holds_at_every_look_and_is_narrower_than_hoeffding() -> None:
    """100 seeded arms of 150 pass/fail scores (rates 0.3 and 0.8), each arm's interval at alpha 0.2 read after
    every 10th score: it misses the true rate at some look in at most alpha of the arms (anytime-valid); from 20
    scores on it is no wider than the Hoeffding sequence it replaced at the same alpha, and at 150 narrower by a
    third; its edges are where the hedged capital process (written out here from the paper) reaches ``2 / alpha``:
    0.01 inside it does not, 0.01 outside it does. Bugs caught: a fixed-n interval (it misses at some look far more
    often), the stakes' variance or cap off (wider, or not at the stated wealth), a threshold of ``1 / alpha``."""

    rng = random.Random(3)
    missed = 0
    for trial in range(100):
        rate = (0.3, 0.8)[trial % 2]
        xs = [float(rng.random() < rate) for _ in range(150)]
        looks = {n: betting.mean_interval(xs[:n], 0.2) for n in range(10, 151, 10)}
        missed += any(iv is not None and not iv[0] <= rate <= iv[1] for iv in looks.values())
        for n, iv in looks.items():
            assert iv is not None and iv[0] <= sum(xs[:n]) / n <= iv[1]
            width = min(1.0, sum(xs[:n]) / n + radius(n, 0.2)) - max(0.0, sum(xs[:n]) / n - radius(n, 0.2))
            assert n < 20 or iv[1] - iv[0] <= width + 1e-9, (n, iv, width)
        lo, hi = looks[150]  # type: ignore[misc]
        assert hi - lo < 2 / 3 * 2 * radius(150, 0.2), (lo, hi)
        if trial < 6:
            for m, out in ((lo - 0.01, True), (lo + 0.01, False), (hi - 0.01, False), (hi + 0.01, True)):
                if 0.0 < m < 1.0:
                    assert (_hedged_wealth(xs, m, 0.2) >= math.log(2 / 0.2)) == out, (m, lo, hi)
    assert missed <= 20, missed


def test_a_running_canary_is_described_with_its_figures_bounds_and_durations() -> None:
    """``describe``'s lines, exactly (``reef status``, the TUI and the release page show them): each arm's figures
    on its own line (the canary's failures only on its own), the bounds in hours and answers, the difference's
    interval and the evidence. Bugs caught: the arms' figures swapped or misnamed, a bound shown when off, hours
    read as seconds, the age counted from the wrong end, a duration named in the wrong unit at its edge."""
    status = {"release_id": "abcdef1234567890", "base_id": "0123456789abcdef", "share": 0.25, "started_at": 1000.0,
              "settings": {"alpha": 0.05, "max_hours": 2, "max_answers": 300},
              "figures": {"alpha": 0.01, "canary_reports": 12, "canary_mean": 0.75, "canary_interval": [0.5, 0.9],
                          "canary_answers": 40, "canary_empty_rate": 0.05, "canary_p50_tokens": 57.0,
                          "canary_loop_rate": 0.125, "head_loop_rate": 0.0,
                          "canary_errors": 2, "canary_exchanges": 41, "canary_p50_ms": 812.4, "head_reports": 30,
                          "head_mean": 0.6, "head_answers": 120, "head_empty_rate": 0.0, "head_p50_tokens": 60.5,
                          "head_p50_ms": 640.0, "difference": 0.125, "difference_interval": [-0.1, 0.35],
                          "pairs": 12, "detectable": 0.18, "pairs_by_end": 140.4, "evidence_better": 1.234,
                          "evidence_worse": 0.01, "evidence_needed": 3.689}}
    assert describe(status, now=1000.0 + 5400) == [
        "canary abcdef123456 serves 25% of new runs beside 0123456789ab (alpha 0.01; running 1.5 h, promoted "
        "undecided at 2 h, promoted on its guards at 300 answers if no report comes)",
        "  canary arm: 12 reports, mean 0.750 [0.50, 0.90]; 40 answers, 5% empty, 12% looping, median 57 tokens, 2 of "
        "41 failed, median 812 ms",
        "  head arm:   30 reports, mean 0.600; 120 answers, 0% empty, 0% looping, median 60.5 tokens, median 640 ms",
        "  difference canary - head +0.125 [-0.10, +0.35] over 12 paired reports: promoted once it lies above 0, "
        "ended once below",
        "  decides a difference of 0.18 or more by its end (about 140 paired reports, 12 so far); evidence better "
        "1.23, worse 0.01 of 3.69 needed"]
    bare = describe({"release_id": "r" * 20, "base_id": "b" * 20, "share": 0.5, "started_at": 100.0,
                     "settings": {"alpha": 0.05, "max_hours": None, "max_answers": None}}, now=90.0)
    assert bare == [
        f"canary {'r' * 12} serves 50% of new runs beside {'b' * 12} (alpha 0.05; running 0 s)",
        "  canary arm: 0 reports, mean -; 0 answers, - empty, - looping, median - tokens, 0 of 0 failed, median - ms",
        "  head arm:   0 reports, mean -; 0 answers, - empty, - looping, median - tokens, median - ms",
        "  difference canary - head - over 0 paired reports: promoted once it lies above 0, ended once below",
        "  can decide no difference by its end at its reports' rate (about - paired reports, 0 so far); evidence "
        "better -, worse - of - needed"]
    assert [_duration(s) for s in (59.9, 60, 3599, 3600, 0.5 * 3600 * 24)] == ["59.9 s", "1 min", "60 min", "1 h",
                                                                              "12 h"]
    assert describe({"started_at": 0, "settings": {"max_hours": 0.5}}, now=61.0)[0] == (
        "canary None serves 0% of new runs beside None (alpha None; running 1.02 min, promoted undecided at 30 min)")
    assert _duration(3618) == "1 h" and _duration(61.2) == "1.02 min"  # 1.005 h and 1.02 min to 3 digits


def test_a_request_keeps_its_arm_by_its_run_else_its_session_and_the_hash_is_stable() -> None:
    """The key a request's arm is drawn by: its run (a wrapped agent's), else its session header, else none (drawn
    on its own); the same key always lands on the same arm of a canary, and a different canary draws afresh."""
    from daemon.canary import arm_key

    assert arm_key({"x-session-id": "s1"}, "run_1") == "run=run_1"  # the run wins over the session
    assert arm_key({"x-session-id": "s1"}, None) == "x-session-id=s1"
    assert arm_key({}, None) is None and arm_key({}, "") is None
    keys = [f"run=run_{i}" for i in range(400)]
    first = [in_canary("rel_a", k, 0.3) for k in keys]
    assert first == [in_canary("rel_a", k, 0.3) for k in keys]  # stable
    assert 0.2 < sum(first) / 400 < 0.4
    other = [in_canary("rel_b", k, 0.3) for k in keys]
    assert other != first and 0.2 < sum(other) / 400 < 0.4  # another canary: another draw
    assert all(in_canary("rel_a", k, 0.6) for k, on in zip(keys, first, strict=True) if on)  # a larger share keeps


def test_the_pairs_a_canary_may_still_see_are_its_rate_until_its_time_bound() -> None:
    """``pairs_by_end`` (what ``describe`` words as "decides a difference of D or more by its end"): the paired
    reports so far plus their rate times the time left, within ``max_reports``; with no time bound, or no time
    gone yet, ``max_reports``; past its bound, the pairs it has. ``detectable`` is the betting test's smallest
    difference in that many pairs at the stake's variance."""
    arm = [0.0, 1.0] * 5  # 10 reports an arm, equal: undecided
    kw: dict[str, Any] = {"alpha": 0.05, "max_reports": 400}

    def by_end(**more: Any) -> float:
        return decide(arm, arm, **{**kw, **more}).figures["pairs_by_end"]

    assert by_end(age_s=100.0, max_age_s=400.0) == 40.0  # 10 pairs in 100 s: 30 more in the 300 s left
    assert by_end(age_s=100.0, max_age_s=400.0, max_reports=25) == 25.0
    assert by_end(age_s=500.0, max_age_s=400.0) == 10.0
    assert by_end(age_s=0.0, max_age_s=400.0) == 400.0 and by_end(age_s=100.0) == 400.0
    assert by_end(age_s=0.5, max_age_s=100.0, max_reports=10_000) == 2000.0  # 20 a second, from half a second on
    assert by_end(age_s=20.0, max_age_s=10.0) == 10.0  # past the bound: no time left, not less than none
    assert by_end(max_age_s=400.0, max_reports=10_000) == 10_000.0  # no age given: no time gone, no rate yet
    d = decide(arm, arm, **kw, age_s=100.0, max_age_s=400.0)
    var = betting.evidence(arm, arm, alpha=0.05).var
    assert d.figures["detectable"] == round(betting.detectable(40.0, var, 0.05), 3)  # type: ignore[arg-type]


def test_the_intervals_people_read_are_each_arms_at_half_alpha_and_the_decisions_difference() -> None:
    """``intervals``: each arm's mean interval at ``alpha / 2`` (both hold at once at ``1 - alpha``) and the
    difference canary - head over the decision's pairs at ``alpha``, rounded to 4 places; None for an arm without
    reports."""
    from daemon.canary import intervals

    head, canary = (0.2, 0.5, 0.4, 0.6, 0.1, 0.3) * 4, (0.9, 0.7, 1.0, 0.8, 0.6) * 4

    def shown(iv: tuple[float, float] | None) -> list[float] | None:
        return None if iv is None else [round(iv[0], 4), round(iv[1], 4)]

    got = intervals(head, canary, 0.1)
    assert got == {"canary_interval": shown(betting.mean_interval(canary, 0.05)),
                   "head_interval": shown(betting.mean_interval(head, 0.05)),
                   # from 0, the decision's null: the interval lies above 0 exactly when the decision promotes
                   "difference_interval": shown(betting.interval(betting.pairs(head, canary), 0.1, at=0.0))}
    assert got["canary_interval"] != shown(betting.mean_interval(canary, 0.1))  # half alpha: wider
    assert got["difference_interval"] != shown(betting.interval(betting.pairs(canary, head), 0.1))  # canary - head
    assert intervals((), canary, 0.1) == {"canary_interval": got["canary_interval"], "head_interval": None,
                                          "difference_interval": None}


# --- moved from test_canary.py and test_canary_learning.py: pure, and those files take 25 s to import ---


def test_the_radii_spend_at_most_delta_over_every_sample_size() -> None:
    """Anytime validity is a union bound: Hoeffding's two-sided miss probability at the radius for n scores,
    2 exp(-2 n r^2), summed over every n the canary may look at, stays within delta. A fixed-n radius (delta at
    every n) passes the simulation above, since Hoeffding is loose for these scores, but spends delta at each look:
    this sum catches it."""
    import math

    for delta in (0.05, 0.01):
        spent = sum(2 * math.exp(-2 * n * radius(n, delta) ** 2) for n in range(1, 200_000))
        assert spent <= delta, (delta, spent)
        assert spent > 0.9 * delta  # and is not needlessly wide: most of delta is used


def test_a_canary_that_fails_too_often_ends_before_its_scores_decide() -> None:
    d = decide([1.0] * 3, [1.0] * 3, alpha=0.05, max_reports=400, errors=6, exchanges=20, max_error_rate=0.2)
    assert d.verdict == "errors" and "6 of 20" in d.reason
    assert decide([1.0] * 3, [1.0] * 3, alpha=0.05, max_reports=400, errors=4, exchanges=20,
                  max_error_rate=0.2).verdict is None
    assert decide([1.0] * 3, [1.0] * 3, alpha=0.05, max_reports=400, errors=9, exchanges=25,
                  max_error_rate=0.2).verdict == "errors"  # past min_exchanges, not only at it
    assert decide([1.0] * 3, [1.0] * 3, alpha=0.05, max_reports=400, errors=9, exchanges=19,
                  max_error_rate=0.2).verdict is None  # before it: too few to judge
    assert decide([1.0] * 3, [1.0] * 3, alpha=0.05, max_reports=400, errors=2, exchanges=20,
                  max_error_rate=0.2).verdict is None  # below the rate
    assert decide([1.0] * 3, [1.0] * 3, alpha=0.05, max_reports=400, errors=1,
                  exchanges=20).verdict is None  # no rate given: errors end nothing


def test_a_canary_slower_than_its_bound_ends_before_its_scores_decide() -> None:
    """Equal scores, the canary's median exchange 3x the head's: ended for latency once each arm has
    min_exchanges complete exchanges, not before, and not within the bound (1.9x)."""
    fast, slow, ok = [100.0] * 20, [300.0] * 20, [190.0] * 20
    kw: dict[str, Any] = {"alpha": 0.05, "max_reports": 400, "max_latency_ratio": 2.0, "min_exchanges": 20}
    d = decide([0.5] * 3, [0.5] * 3, head_ms=fast, canary_ms=slow, **kw)
    assert d.verdict == "latency" and "300 ms" in d.reason and "100 ms" in d.reason
    assert d.figures["canary_p50_ms"] == 300.0 and d.figures["head_p50_ms"] == 100.0
    assert decide([0.5] * 3, [0.5] * 3, head_ms=fast, canary_ms=ok, **kw).verdict is None
    assert decide([0.5] * 3, [0.5] * 3, head_ms=fast[:19], canary_ms=slow, **kw).verdict is None
    assert decide([0.5] * 3, [0.5] * 3, head_ms=fast, canary_ms=slow[:19], **kw).verdict is None


def test_a_canary_that_answers_longer_at_the_same_speed_is_not_slower() -> None:
    """With the arms' speeds known (as the daemon passes them), the latency guard reads the median time to first
    token and time per output token, not whole exchanges: a candidate whose answers run three times longer at the
    head's speed serves on (whole exchanges alone would end it), one three times slower to its first token or per
    token is ended, naming which, and neither before ``min_exchanges`` on each arm or within the bound. Bugs caught:
    whole exchanges compared when speeds are given (a candidate that learned longer answers ended for latency, its
    learning thrown away), one of the two speeds not read, the bound or the count not applied to them."""
    kw: dict[str, Any] = {"alpha": 0.05, "max_reports": 400, "max_latency_ratio": 2.0, "min_exchanges": 20}
    same = {"ttft": [100.0] * 20, "tpot": [50.0] * 20}
    longer = {"head_ms": [1_100.0] * 20, "canary_ms": [3_100.0] * 20}
    assert decide([0.5], [0.5], **longer, **kw).verdict == "latency"  # whole exchanges: ended
    d = decide([0.5], [0.5], **longer, head_speed=same, canary_speed=same, **kw)
    assert d.verdict is None and d.figures["canary_p50_tpot_ms"] == d.figures["head_p50_tpot_ms"] == 50.0, d
    for key, what in (("ttft", "time to first token"), ("tpot", "time per output token")):
        slow = {**same, key: [3 * x for x in same[key]]}
        d = decide([0.5], [0.5], head_speed=same, canary_speed=slow, **kw)
        assert d.verdict == "latency" and what in d.reason, (key, d)
        assert decide([0.5], [0.5], head_speed=same, canary_speed={**same, key: [2 * x for x in same[key]]},
                      **kw).verdict is None, key  # at the bound: not past it
        assert decide([0.5], [0.5], head_speed={k: v[:19] for k, v in same.items()}, canary_speed=slow,
                      **kw).verdict is None, key  # too few on the head's arm
        assert decide([0.5], [0.5], head_speed=slow, canary_speed=same, **kw).verdict is None, key  # faster
        more = {k: v * 2 for k, v in same.items()}  # past min_exchanges, not only at it
        assert decide([0.5], [0.5], head_speed=more, canary_speed={k: v * 2 for k, v in slow.items()},
                      **kw).verdict == "latency", key
        # a head that took no time (an upstream that sends whole answers: all of it before the first token)
        none = {**same, key: [0.0] * 20}
        assert decide([0.5], [0.5], head_speed=none, canary_speed={**same, key: [0.001] * 20}, **kw).verdict is None
        assert decide([0.5], [0.5], head_speed=none, canary_speed={**same, key: [1.0] * 20},
                      **kw).verdict == "latency", key
    # one arm's speeds unknown: whole exchanges decide
    assert decide([0.5], [0.5], **longer, head_speed=same, **kw).verdict == "latency"
    assert decide([0.5], [0.5], **longer, canary_speed=same, **kw).verdict == "latency"


@pytest.mark.parametrize("share", [0.1, 0.5])
def test_arms_split_runs_by_the_share(share: float) -> None:
    hits = sum(in_canary("rel", f"run=run_{i}", share) for i in range(20_000))
    assert abs(hits / 20_000 - share) < 0.02


def test_requests_with_neither_run_nor_session_go_to_the_canary_at_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn on their own: with the draws spread evenly over [0, 1), exactly the share of them go to the canary (a
    flipped comparison sends 90% at share 0.1, a constant key all or none)."""
    import daemon.canary as canary

    for share in (0.1, 0.3):
        draws = iter([(i + 0.5) / 1000 for i in range(1000)])
        monkeypatch.setattr(canary.random, "random", draws.__next__)
        assert sum(in_canary("rel", None, share) for _ in range(1000)) == round(1000 * share)
        assert next(draws, None) is None  # every request drew once: none went by a hash


def test_the_bounds_decide_only_when_nothing_else_does() -> None:
    """At ``max_answers`` answers (and the head enough for its guards to have looked) a canary is decided on what
    its scores say so far: promoted (``quiet``) with no paired report or a paired difference not below 0 at the 5%
    level (1.645 standard errors), ended (``lower``) with one further below; ``max_age_s`` promotes whatever the
    reports; a tripped guard ends it first; off (None), neither fires. Bugs caught: the bound never firing, firing
    one answer early, promoting a candidate its scores put lower, ending an equal one or one lower by less than the
    level (the comparison flipped, strict, against 0, or at 1 or 2 standard errors), the time bound's comparison
    flipped, a guard read after the bound."""
    ok = [30] * 49
    kw: dict[str, Any] = {"alpha": 0.05, "max_reports": 400, "guard_answers": 10, "max_empty_excess": 0.3}
    assert decide([], [], head_tokens=ok, canary_tokens=ok, max_answers=50, **kw).verdict is None
    assert decide([], [], head_tokens=ok, canary_tokens=ok + [30], max_answers=50, **kw).verdict == "quiet"
    assert decide([], [], head_tokens=ok[:9], canary_tokens=ok + [30], max_answers=50, **kw).verdict is None
    assert decide([], [], head_tokens=ok, canary_tokens=ok + [30], max_answers=None, **kw).verdict is None
    low_h, low_c = [1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]
    lower = decide(low_h, low_c, head_tokens=ok, canary_tokens=ok + [30], max_answers=50, **kw)
    assert lower.verdict == "lower" and "-0.600" in lower.reason and "over 5 pairs" in lower.reason, lower.reason
    assert decide(low_h, low_c, head_tokens=ok, canary_tokens=ok, max_answers=50, **kw).verdict is None
    # the 5% level is 1.645 standard errors: -0.5 with an error of 0.441 is within it (1 error would end it)...
    assert decide([1.0, 1.0], [0.0, 1.0], head_tokens=ok, canary_tokens=ok + [30], max_answers=50,
                  **kw).verdict == "quiet"
    assert decide([0.0, 1.0], [1.0, 1.0], head_tokens=ok, canary_tokens=ok + [30], max_answers=50,
                  **kw).verdict == "quiet"
    # lower, but by less than the difference's standard error (0.274 here): noise, promoted; by more: ended
    near = decide([1, 0, 1, 0, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0, 0, 0], head_tokens=ok, canary_tokens=ok + [30],
                  max_answers=50, **kw)
    assert near.verdict == "quiet" and "-0.125" in near.reason, near.reason
    # ... and -0.5 with an error of 0.292 is past it (2 errors would keep it)
    assert decide([1, 1, 1, 0], [0, 1, 0, 0], head_tokens=ok, canary_tokens=ok + [30], max_answers=50,
                  **kw).verdict == "lower"
    equal = decide([0.4, 0.6], [0.6, 0.4], head_tokens=ok, canary_tokens=ok + [30], max_answers=50, **kw)
    assert equal.verdict == "quiet" and "+0.000" in equal.reason
    # reports on one arm only make no pair: promoted on its guards
    assert decide([], [0.0], head_tokens=ok, canary_tokens=ok + [30], max_answers=50, **kw).verdict == "quiet"
    empty = [1] * 50  # every canary answer empty: the guard ends it, the bound does not promote it
    assert decide([], [], head_tokens=ok, canary_tokens=empty, max_answers=50, **kw).verdict == "empty"
    assert decide([1.0], [0.0], age_s=99.0, max_age_s=100.0, **kw).verdict is None
    expired = decide([1.0], [0.0], age_s=100.0, max_age_s=100.0, **kw)
    assert expired.verdict == "expired" and "did not show it worse" in expired.reason
    assert decide([], [], age_s=1e9, max_age_s=None, **kw).verdict is None
    assert decide([], [], head_tokens=ok, canary_tokens=empty, age_s=100.0, max_age_s=100.0, **kw).verdict == "empty"


def test_bound_settings_are_checked_and_off_unless_given() -> None:
    """A canary started by hand has no bounds (it runs until its scores, guards, max_reports or a person decide, as
    before); the learning loop passes the recipe's; a bound out of range is refused naming it."""
    s = settings_of({})
    assert s["max_answers"] is None and s["max_hours"] is None
    assert settings_of({"max_answers": 12, "max_hours": 0.5}) == {**s, "max_answers": 12, "max_hours": 0.5}
    for key, value in (("max_answers", 0), ("max_answers", 1.5), ("max_hours", -1), ("max_hours", 1e999),
                       ("max_hours", 1e7), ("max_answers", True)):
        with pytest.raises(BadRequest) as e:
            settings_of({key: value})
        assert e.value.data["param"] == key and key in e.value.message


def test_a_decisions_figures_are_the_clipped_means_and_the_evidence_to_their_stated_places() -> None:
    """The figures on the chain and in ``describe``: each arm's mean of its scores clipped to [0, 1], the
    bettors' evidence to 4 places, the pairs by the end to 1 and the detectable difference to 3. Bugs caught: a
    score above 1 counted as more, the means miscomputed, another rounding."""
    head, canary = [1.5, 0.0, 0.25, -2.0, 1.0], [1.0, 0.5, 0.75, 1.0]
    d = decide(head, canary, alpha=0.05, max_reports=400, age_s=30.0, max_age_s=130.0)
    f = d.figures
    assert (f["head_mean"], f["canary_mean"], f["head_reports"], f["canary_reports"]) == (0.45, 0.8125, 5, 4)
    assert (f["canary_exchanges"], f["canary_errors"]) == (0, 0)  # none given: none counted
    assert decide([0.5], [1.5, 0.5], alpha=0.05, max_reports=400).figures["canary_mean"] == 0.75  # clipped at 1
    ev = betting.evidence([1.0, 0.0, 0.25, 0.0, 1.0], canary, alpha=0.05)
    assert (f["evidence_better"], f["evidence_worse"], f["evidence_needed"]) == (
        round(ev.better, 4), round(ev.worse, 4), round(ev.threshold, 4))
    assert f["evidence_better"] != round(ev.better, 3) and f["evidence_needed"] == 3.6889
    assert f["pairs_by_end"] == 17.3  # 4 pairs in 30 s, 100 s left: 4 + 13.33
    assert f["detectable"] == round(betting.detectable(4 + 4 / 30 * 100, ev.var, 0.05), 3)  # type: ignore[arg-type]
    assert decide(head, canary, alpha=0.05, max_reports=400).figures["head_mean"] == 0.45  # clipped either way
    ok = [30] * 50  # at its answer bound: the difference's standard error, to 4 places
    bound = decide([1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.5, 1.0], alpha=0.05, max_reports=400,
                   head_tokens=ok, canary_tokens=ok, max_answers=50)
    ev = betting.evidence([1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.5, 1.0], alpha=0.05)
    se = math.sqrt(ev.var / ev.pairs)
    assert bound.figures["difference_se"] == round(se, 4) not in (round(se, 3), round(se, 5))
    assert decide([0.5], [-0.5, 0.5], alpha=0.05, max_reports=400).figures["canary_mean"] == 0.25  # 0 at least
    with pytest.raises(dataclasses.FrozenInstanceError):  # a decision is a record of what was seen
        bound.verdict = "promoted"  # type: ignore[misc]


def test_the_hoeffding_radius_of_no_scores_is_unbounded() -> None:
    assert radius(0, 0.05) == math.inf and 0 < radius(1, 0.05) < math.inf


def test_a_time_bound_of_a_month_is_taken_and_of_the_maximum_too() -> None:
    assert settings_of({"max_hours": 24 * 31})["max_hours"] == 744
    assert settings_of({"max_hours": 10 ** 6})["max_hours"] == 10 ** 6


def test_the_guards_look_from_ten_answers_on_each_arm_by_default() -> None:
    kw: dict[str, Any] = {"alpha": 0.05, "max_reports": 400, "max_empty_excess": 0.3}
    assert decide([], [], head_tokens=[40] * 9, canary_tokens=[0] * 9, **kw).verdict is None
    assert decide([], [], head_tokens=[40] * 10, canary_tokens=[0] * 10, **kw).verdict == "empty"


def test_whole_number_settings_go_up_to_a_billion() -> None:
    assert settings_of({"max_reports": 10 ** 9})["max_reports"] == 10 ** 9
    assert settings_of({"max_answers": 2_000_000})["max_answers"] == 2_000_000  # not held to the hours' bound
    with pytest.raises(BadRequest):
        settings_of({"max_reports": 10 ** 9 + 1})


def test_the_bounds_and_guards_at_and_past_their_edges() -> None:
    """Each bound past its edge as well as at it (small whole numbers compare alike by ``is`` and ``==``: a count
    past the bound shows ``is`` for ``>=``), the empty excess to the rates' 4 places, a head measured at 0 ms, and
    the difference to 4 places."""
    ok = [30] * 50
    kw: dict[str, Any] = {"alpha": 0.05, "max_reports": 400, "guard_answers": 10, "max_empty_excess": 0.3}
    assert decide([], [], head_tokens=ok, canary_tokens=ok + [30, 30], max_answers=50, **kw).verdict == "quiet"
    assert decide([], [], head_tokens=ok[:10], canary_tokens=ok, max_answers=50, **kw).verdict == "quiet"
    assert decide([1.0], [0.0], age_s=150.0, max_age_s=100.0, **kw).verdict == "expired"
    # 100 of 333 answers empty is 0.3003, past 0.3 by the rates' 4 places (to 3 it would be 0.3, within)
    assert decide([], [], head_tokens=[40] * 10, canary_tokens=[0] * 100 + [40] * 233, **kw).verdict == "empty"
    # a head whose median exchange took 0 ms: a canary of 0.001 ms is within any ratio (the head's time is taken
    # as at least 1 microsecond), 1 ms is not
    lat: dict[str, Any] = {"alpha": 0.05, "max_reports": 400, "min_exchanges": 20, "max_latency_ratio": 2.0}
    assert decide([0.5], [0.5], head_ms=[0.0] * 20, canary_ms=[0.001] * 20, **lat).verdict is None
    assert decide([0.5], [0.5], head_ms=[0.0] * 20, canary_ms=[1.0] * 20, **lat).verdict == "latency"
    third = decide([0.0, 0.0, 0.0], [1.0, 0.0, 0.0], alpha=0.05, max_reports=400).figures
    assert third["difference"] == 0.3333
    assert describe({"started_at": 0, "settings": {"max_hours": 9.995}}, now=0)[0].endswith(
        "promoted undecided at 9.99 h)")  # hours as 3,600 s: 9.995 h to 3 digits
    assert describe({"started_at": 0, "settings": {"max_hours": 9.9955}}, now=0)[0].endswith(
        "promoted undecided at 10 h)")
    worse = decide([1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0, 0.0], alpha=0.05, max_reports=400).figures
    ev = betting.evidence([1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0, 0.0], alpha=0.05)
    assert worse["evidence_worse"] == round(ev.worse, 4) not in (round(ev.worse, 3), round(ev.worse, 5))
