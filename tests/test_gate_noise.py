"""Gates that know their noise (``daemon/gate.py``): the compare gate's stated error rate holds over many
simulated comparisons of equal candidates, it still finds a better one, it says when it cannot decide, and the
paired difference comes with an interval that covers the truth about as often as it says."""

from __future__ import annotations

import random

import pytest

from daemon.errors import BadRequest
from daemon.gate import judge, paired_interval, sign_test_p
from recipes import load_recipe


def _scores(rng: random.Random, p: float, n: int) -> list[float]:
    return [1.0 if rng.random() < p else 0.0 for _ in range(n)]


def test_equal_candidates_are_published_at_most_at_the_stated_error_rate() -> None:
    """2,000 comparisons of two equal candidates (pass rate 0.5 each, 128 tasks): published as better in at most
    alpha of them (plus three standard errors of the simulation). Catches the wrong tail of the sign test, or a
    two-sided p halved the wrong way; the margin rule of old (wins - losses >= 1) published about 45%."""
    rng = random.Random(0)
    trials, alpha = 2000, 0.05
    published = margin_published = 0
    for _ in range(trials):
        cand, base = _scores(rng, 0.5, 128), _scores(rng, 0.5, 128)
        published += judge("compare", candidate=cand, base=base, best=None, alpha=alpha).publish
        margin_published += judge("compare", candidate=cand, base=base, best=None, margin=1).publish
    sem = (alpha * (1 - alpha) / trials) ** 0.5
    assert published / trials <= alpha + 3 * sem, published / trials
    assert margin_published / trials > 0.3  # what the bare margin did: mostly noise


def test_a_better_candidate_is_still_found() -> None:
    rng = random.Random(1)
    wins = sum(judge("compare", candidate=_scores(rng, 0.8, 32), base=_scores(rng, 0.4, 32), best=None,
                     alpha=0.05).publish for _ in range(200))
    assert wins / 200 > 0.8


def test_too_few_pairs_to_decide_is_held_for_review_not_rejected() -> None:
    v = judge("compare", candidate=[1.0, 1.0, 1.0], base=[0.0, 0.0, 0.0], best=None, alpha=0.05)
    assert not v.publish and v.verdict == "pending" and "at least 5 needed" in v.reason
    v = judge("compare", candidate=[1.0] * 5, base=[0.0] * 5, best=None, alpha=0.05)
    assert v.publish and v.metrics["p_value"] == pytest.approx(1 / 32)
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(3, 0) == pytest.approx(1 / 8)
    assert sign_test_p(1, 2) == pytest.approx(7 / 8)


def test_the_interval_covers_the_true_difference_about_as_often_as_it_says() -> None:
    rng = random.Random(2)
    covered = 0
    for _ in range(1000):
        cand = [rng.gauss(0.6, 0.2) for _ in range(30)]
        base = [rng.gauss(0.5, 0.2) for _ in range(30)]
        _, lo, hi = paired_interval(cand, base)
        covered += lo <= 0.1 <= hi
    assert 0.92 <= covered / 1000 <= 0.98
    v = judge("compare", candidate=[0.9, 0.8, 0.7], base=[0.5, 0.5, 0.5], best=None, margin=1)
    assert v.metrics["diff"] == pytest.approx(0.3) and v.metrics["diff_ci95"][0] < 0.3 < v.metrics["diff_ci95"][1]
    assert "(p = 0.125)" in v.reason


def test_alpha_is_refused_where_it_would_do_nothing_or_is_not_a_rate() -> None:
    online = load_recipe("online-rl")
    for bad in ({"gate": "always", "alpha": 0.05}, {"gate": "compare", "alpha": 1.5}, {"gate": "compare",
                                                                                          "alpha": 0}):
        with pytest.raises(BadRequest, match="alpha"):
            online.parse_settings(bad)
    assert online.parse_settings({"gate": "compare", "alpha": 0.05, "eval_family": "say"}).alpha == 0.05
