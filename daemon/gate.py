"""Gates: does a candidate replace the current release?

A gate gets the candidate's and the base's scores on the recipe's evaluation tasks (computed by the trainer,
one score per task, same tasks for both: the base is the serving head) and returns a verdict with its reason.
Chosen per recipe (``gate`` setting):

- ``always``: publish every candidate.
- ``floor``: publish when the candidate's mean score is at least ``floor``.
- ``compare``: published when the candidate is shown better than the serving head at error rate ``alpha``.
- ``regression``: published when the candidate is shown not worse than the serving head by more than ``margin``,
  at error rate ``alpha``.
- ``review``: hold the candidate as pending until a person promotes it (harness recipes).

Noise. The two gates that compare a candidate with the serving head decide on a stated error rate, ``alpha``
(``ALPHA = 0.05`` unless a recipe's settings say otherwise), never on a bare margin, and say how sure they are:
every paired verdict carries the mean per-task difference with a 95% interval (``diff``, ``diff_ci95``: Student's
t, to read, not to decide) and the figures its decision rests on.

- ``compare`` (superiority): the exact one-sided sign test on the untied pairs, ``p_value``: how often a candidate
  no better than the head would do at least this well. Published when ``p_value <= alpha`` and wins - losses >=
  ``margin`` (0 by default: the least lead, in pairs, a user asks for on top of the test). So an equal candidate
  is published as better at most ``alpha`` of the time, however many tasks tie (``tests/test_gate_noise.py``
  simulates it). When even a clean sweep of the untied pairs could not reach ``alpha`` (fewer than
  ``pairs_needed(alpha)``: 5 at 0.05), the gate cannot decide and holds the candidate for review, saying so.
- ``regression`` (non-inferiority, the standard form of "not worse than the head by more than margin"): H0, the
  candidate's mean is at least ``margin`` below the head's, is rejected at ``alpha``, and only then is the
  candidate published. So a candidate worse by ``margin`` or more is published at most ``alpha`` of the time; an
  equal one is published when the evaluation is large enough to show it (the power the docs tabulate). Chosen
  over "publish unless shown worse", which publishes anything when the evaluation is small: an error rate on
  that side would bound only how often a good candidate is turned away. The test: on pass/fail scores (every
  difference -1, 0 or 1, as every built-in evaluation scores), the score test for paired proportions (Tango,
  1998: the variance under H0 at its restricted maximum likelihood) with a continuity correction, whose size is
  at most ``alpha`` at every loss rate for the sizes and margins in ``tests/test_gate_noise.py`` (computed
  exactly; without the correction, 5.2% to 5.7% at 0.05); on other scores, Student's t on the differences with
  the variance at least a pass/fail candidate's under H0, ``margin * (1 - margin)``. ``margin`` must be in
  (0, 1): 0 would ask the candidate to be shown better (that is ``compare``). With fewer tasks than even no
  difference at all could clear (``tasks_needed``), the gate cannot decide and holds the candidate for review.
  The reference is the serving head, paired on the same tasks (the best score published so far, the reference
  of old, was a maximum of noisy means: biased upward, and unpaired, so no error rate could be stated for it;
  ``best`` is still reported).

One recipe gate lives here too, for its statistics: ttt-discover's ``best`` (``judge_best``), a search's gate, on
the other side. A candidate is turned away only when its attempts are shown worse than the head's at ``alpha``
(the exact one-sided sign test on the untied pairs of attempts sampled with common random numbers, mirrored from
``compare``) and its mean is more than ``margin`` below; otherwise it is published. So a candidate as good as the
head is turned away at most ``alpha`` of the time. That is the error a search must bound: a gate that turns away
equal candidates stalls it (measured on ttt-discover's demo: a head compared with a lucky draw of its own stuck at
0.37 while fresh comparisons climbed to 0.83). What it does not bound is publishing a slightly worse candidate;
the best attempt found stays in the scenario's status whatever serves, and a real drop is shown and refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from daemon.errors import BadRequest

GATES = ("always", "floor", "compare", "regression", "review")
COMPARING = ("compare", "regression")  # the gates that compare with the serving head and read alpha and margin
ALPHA = 0.05  # the comparing gates' error rate unless a recipe's settings say otherwise
MARGIN = {"compare": 0.0, "regression": 0.1}  # their margin unless the settings say otherwise


@dataclass(frozen=True)
class Verdict:
    publish: bool
    verdict: str  # accepted | rejected | pending
    reason: str
    metrics: dict[str, Any]


def _mean(xs: list[float] | None) -> float | None:
    return None if not xs else sum(xs) / len(xs)


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function with ``df`` degrees of freedom (Abramowitz & Stegun 26.7.3-4: exact
    for whole ``df``)."""
    th = math.atan(t / math.sqrt(df))
    s, c = math.sin(th), math.cos(th)
    term = acc = c if df % 2 else 1.0
    for k in range(3 if df % 2 else 2, df - 1, 2):
        term *= c * c * (k - 1) / k
        acc += term
    a = (2 / math.pi) * (th + (s * acc if df > 1 else 0.0)) if df % 2 else s * acc
    return 0.5 + a / 2


@functools.lru_cache(maxsize=1024)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (``p > 0.5``) of Student's t with ``df`` degrees of freedom, by bisection."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def paired_interval(candidate: list[float], base: list[float]) -> tuple[float, float, float]:
    """The mean of the per-task differences and its 95% interval (t; a single pair has no width to estimate:
    the interval is unbounded)."""
    d = [c - b for c, b in zip(candidate, base, strict=True)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return mean, -math.inf, math.inf
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def sign_test_p(wins: int, losses: int) -> float:
    """P(at least ``wins`` wins of ``wins + losses`` untied pairs | equal candidates): the exact one-sided sign
    test (1.0 when every pair tied)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def pairs_needed(alpha: float) -> int:
    """The fewest untied pairs with which a clean sweep reaches ``alpha`` (compare)."""
    return max(1, math.ceil(math.log2(1 / alpha)))


def noninferior(candidate: list[float], base: list[float], *, margin: float, alpha: float) -> tuple[bool, float]:
    """Whether the candidate is shown not worse than the base by ``margin`` or more at error rate ``alpha``, and
    the statistic's one-sided p-value (the module docstring says which test, and why)."""
    d = [c - b for c, b in zip(candidate, base, strict=True)]
    n = len(d)
    if n < 2:
        return False, 1.0
    if all(x in (-1.0, 0.0, 1.0) for x in d):  # pass/fail: Tango's score test with a continuity correction
        wins, losses = d.count(1.0), d.count(-1.0)
        var = 2 * _restricted_loss_rate(n, wins, losses, margin) - margin * (1 + margin)
        num = wins - losses + n * margin - 0.5
        if var <= 0:
            return num > 0, 0.0 if num > 0 else 1.0
        p = 1 - NormalDist().cdf(num / math.sqrt(n * var))
    else:
        mean = sum(d) / n
        var = max(sum((x - mean) ** 2 for x in d) / (n - 1), margin * (1 - margin))
        p = 1 - t_cdf((mean + margin) / math.sqrt(var / n), n - 1)
    return p <= alpha, p


def _restricted_loss_rate(n: int, wins: int, losses: int, margin: float) -> float:
    """The maximum-likelihood loss rate of pass/fail pairs given that wins - losses is -``margin`` per pair (H0):
    the root of the likelihood's derivative on (margin, (1 + margin) / 2), by bisection."""
    ties = n - wins - losses
    lo, hi = margin, (1 + margin) / 2

    def slope(p: float) -> float:
        return ((wins / (p - margin) if wins else 0.0) + (losses / p if losses else 0.0)
                - (2 * ties / (1 - 2 * p + margin) if ties else 0.0))

    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if slope(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


@functools.lru_cache(maxsize=256)
def tasks_needed(gate: str, *, alpha: float, margin: float) -> int:
    """The fewest paired tasks with which the gate can decide at all: for ``compare``, untied pairs a clean sweep
    needs; for ``regression``, tasks a candidate tying the head on every one needs to be shown within
    ``margin``."""
    if gate == "compare":
        return pairs_needed(alpha)
    n = 2
    while not noninferior([0.0] * n, [0.0] * n, margin=margin, alpha=alpha)[0]:
        n += 1
    return n


def check(gate: str, *, alpha: float | None, margin: float | None) -> tuple[float, float]:
    """The alpha and margin a comparing gate decides on (the defaults for ``None``); a ``BadRequest`` naming
    the setting when either is out of range."""
    a = ALPHA if alpha is None else alpha
    if not 0 < a < 1:
        raise BadRequest(f"alpha (the gate's error rate) must be between 0 and 1, got {a}", param="settings.alpha")
    m = MARGIN.get(gate, 0.0) if margin is None else margin
    if gate == "compare" and m < 0:
        raise BadRequest(f"margin (the compare gate's least lead, wins - losses) must be at least 0, got {m}",
                         param="settings.margin")
    if gate == "regression" and not 0 < m < 1:
        raise BadRequest(f"margin (the regression gate's tolerated drop, on scores in [0, 1]) must be between 0 and "
                         f"1, got {m}: 0 asks the candidate to be shown better (gate compare), 1 lets anything "
                         "through", param="settings.margin")
    return a, m


def judge(gate: str, *, candidate: list[float] | None, base: list[float] | None, best: float | None,
          floor: float = 0.0, margin: float | None = None, alpha: float | None = None) -> Verdict:
    """The gate's verdict. ``alpha`` and ``margin``: the comparing gates' (``None``: ``ALPHA``, ``MARGIN``);
    ``best``: the best evaluation mean published so far, reported by ``regression``."""
    if gate not in GATES:
        raise BadRequest(f"unknown gate {gate!r}; gates: {', '.join(GATES)}", param="gate")
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
    alpha, margin = check(gate, alpha=alpha, margin=margin)
    metrics.update(alpha=alpha, margin=margin)
    held = "held for review: reef releases promote ID publishes it"
    if base is None or len(base) != len(candidate or []):
        return Verdict(False, "pending", f"cannot decide at error rate {alpha}: no scores of the serving head on the "
                       f"same tasks to pair with; {held}", metrics)
    assert candidate is not None
    if gate == "compare":
        wins = sum(x > y for x, y in zip(candidate, base, strict=True))
        losses = sum(x < y for x, y in zip(candidate, base, strict=True))
        p = sign_test_p(wins, losses)
        metrics.update(wins=wins, losses=losses, p_value=round(p, 6))
        if wins + losses < pairs_needed(alpha):
            return Verdict(False, "pending", f"cannot decide at error rate {alpha}: {wins + losses} untied pair(s) of "
                           f"{len(candidate)}, at least {pairs_needed(alpha)} needed (more tasks or repeats); {held}",
                           metrics)
        ok = p <= alpha and wins - losses >= margin
        why = f"wins {wins} - losses {losses}: p = {p:.3g} {'<=' if p <= alpha else '>'} alpha {alpha}"
        if p <= alpha and margin:
            why += f", lead {wins - losses} {'>=' if ok else '<'} margin {margin:g}"
        return Verdict(ok, "accepted" if ok else "rejected", why, metrics)
    metrics["best"] = best
    n = len(candidate)
    need = tasks_needed("regression", alpha=alpha, margin=margin)
    if n < need:
        return Verdict(False, "pending", f"cannot decide at error rate {alpha}: {n} paired task(s), at least {need} "
                       f"needed to show a drop under margin {margin:g}; {held}", metrics)
    ok, p = noninferior(candidate, base, margin=margin, alpha=alpha)
    metrics["p_value"] = round(p, 6)
    return Verdict(ok, "accepted" if ok else "rejected",
                   f"mean {c:.3f} vs head {b:.3f}: a drop of {margin:g} or more {'ruled out' if ok else 'not ruled out'}"
                   f" (p = {p:.3g} {'<=' if ok else '>'} alpha {alpha})", metrics)


def judge_best(candidate: list[float], base: list[float], *, margin: float, alpha: float | None) -> Verdict:
    """ttt-discover's ``best`` gate on paired attempt scores (the module docstring says which test, and why)."""
    a, _ = check("best", alpha=alpha, margin=margin)
    if len(candidate) != len(base) or not candidate:
        raise ValueError("gate best pairs the candidate's attempts with the head's: as many of each, at least one")
    c, b = sum(candidate) / len(candidate), sum(base) / len(base)
    mean, lo, hi = paired_interval(candidate, base)
    wins = sum(x > y for x, y in zip(candidate, base, strict=True))
    losses = sum(x < y for x, y in zip(candidate, base, strict=True))
    p = sign_test_p(losses, wins)  # how often a candidate as good as the head loses at least this often
    worse = p <= a and c < b - margin
    metrics: dict[str, Any] = {"eval_reward": c, "base_reward": b, "eval_best": max(candidate), "diff": round(mean, 6),
                               "diff_ci95": [_finite(lo), _finite(hi)], "pairs": len(candidate), "wins": wins,
                               "losses": losses, "p_value_worse": round(p, 6), "alpha": a, "margin": margin}
    why = (f"attempts {c:.3f} vs head's {b:.3f}: wins {wins} - losses {losses}, "
           f"{'shown worse' if p <= a else 'not shown worse'} (p = {p:.3g} {'<=' if p <= a else '>'} alpha {a})")
    if p <= a and margin:
        why += f", {'more' if worse else 'no more'} than margin {margin:g} below"
    return Verdict(not worse, "rejected" if worse else "accepted", why, metrics)


def _finite(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def describe(m: Mapping[str, Any]) -> str | None:
    """What a paired gate's metrics say, for people: the difference with its 95% interval and the test the verdict
    rests on (compare: the sign test; regression: the drop of ``margin`` it ruled out or not; a retirement: the
    sign test on losses; ttt-discover's best: the sign test on the candidate's losses), or None for a gate that did not pair."""
    if "diff" not in m:
        return None
    lo, hi = (m.get("diff_ci95") or [None, None])[:2]
    span = f"{lo:+.3f} .. {hi:+.3f}" if lo is not None and hi is not None else "unbounded (one pair)"
    line = f"gate: candidate - base {m['diff']:+.3f} (95% interval {span}) over {m.get('pairs')} paired task(s)"
    if "wins" in m:
        line += f"; wins {m['wins']} - losses {m['losses']}"
    if "p_value_loss" in m:
        line += f"; p = {m['p_value_loss']:.3g} (a loss from leaving the skill out)"
    elif "p_value_worse" in m:
        line += f"; p = {m['p_value_worse']:.3g} (the candidate worse)"
    elif "p_value" in m and "wins" not in m and "margin" in m:
        line += f"; p = {m['p_value']:.3g} (a drop of {m['margin']:g} or more)"
    elif "p_value" in m:
        line += f"; p = {m['p_value']:.3g}"
    line += f" at alpha {m['alpha']}" if "alpha" in m else ""
    if "eval_suite" in m:  # harness-search's evaluation (recipes/harness_search/retained.py): per task, and pinned
        per_task = (f"; per task {m['delta']:+.3f} (tasks resampled, 95% {m['delta_lo']:+.3f} .. {m['delta_hi']:+.3f})"
                    if "delta" in m else "")
        not_run = f"; {m['episodes_not_run']} episode(s) could not run (not scored)" if m.get("episodes_not_run") else ""
        if "delta_base" in m:
            per_task += (f"; against the first release {m['delta_base']:+.3f} (95% {m['delta_base_lo']:+.3f} .. "
                         f"{m['delta_base_hi']:+.3f})")
        line += (f"{per_task}{not_run}; ran suite {m['eval_suite']} ({m.get('eval_tasks')} task(s) x "
                 f"{m.get('eval_repeats')} repeat(s)), {m.get('eval_adapter')} on {m.get('eval_model')}, serving "
                 f"{str(m.get('eval_serving'))[:12]} against candidate {str(m.get('eval_candidate'))[:12]}")
    return line
