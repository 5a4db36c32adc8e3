"""The reward-hacking watchdog: a weights candidate whose training reward keeps rising while its held-out score
falls is held for review instead of published.

Over the last ``WINDOW`` published train releases and the candidate, the training reward (``batch_reward``: the
mean score of the reports each step trained on) rose by at least ``RISE`` while the held-out score
(``eval_reward``: the gate's evaluation on tasks the recipe never trains on) fell by at least ``FALL``: the policy is
learning what the scores reward, not what they were meant to measure. Both figures are in the hold's reason and on
``/reef/events`` (``watchdog``); ``reef releases promote ID`` publishes the candidate anyway. A recipe without
held-out evaluation gives the watchdog nothing to compare: it never holds there. Nor does one whose gate scores
the very problem it trains on (``Recipe.held_out_eval`` False: ttt-discover, whose gate samples fresh attempts at
the problem each step; a fall there is the sampling's noise or the search's, and holding for it stalled the search
with nobody asked: its rise test waited forever on a step held at round 20 or so).

Drift: a LoRA policy's ``kl_from_base`` (``recipes/online_rl.kl_from_base``: the mean per-token KL from the model
its adapter applies to, on the step's own answers) above the recipe's ``max_kl`` holds the candidate too: a policy
far from where it started has likely found something the scores reward that nobody meant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

WINDOW = 3  # published steps before the candidate
RISE = 0.1  # training reward, first to last
FALL = 0.05  # held-out score, first to last


def _num(m: Mapping[str, Any], key: str) -> float | None:
    v = m.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def check(published: Sequence[Mapping[str, Any]], candidate: Mapping[str, Any],
          max_kl: float | None = None, *, held_out: bool = True) -> dict[str, Any] | None:
    """``published``: the metrics of the chain's train releases, newest first; ``candidate``: the candidate's;
    ``max_kl``: the recipe's bound on its policy's drift from the model its adapter applies to; ``held_out``:
    whether the recipe's ``eval_reward`` is held out (``Recipe.held_out_eval``; when not, only the drift is
    watched). The figures and reason when the candidate must be held, else None."""
    kl = _num(candidate, "kl_from_base")
    if max_kl is not None and kl is not None and kl > max_kl:
        return {"kl_from_base": kl, "max_kl": max_kl,
                "reason": f"watchdog: the policy moved {kl:.4f} nats per token from its base model (KL on the "
                          f"step's answers), more than max_kl {max_kl:g}; held for review (reef releases promote ID "
                          "publishes it)"}
    if not held_out:
        return None
    series = [candidate, *published[:WINDOW]][::-1]  # oldest first, the candidate last
    points = [(_num(m, "batch_reward"), _num(m, "eval_reward")) for m in series]
    known = [(t, h) for t, h in points if t is not None and h is not None]
    if len(points) < WINDOW + 1 or len(known) < len(points):  # pragma: no mutate (never more than WINDOW + 1 points, nor more known than points: != is <)
        return None
    train = [t for t, _ in known]
    held = [h for _, h in known]
    rose, fell = train[-1] - train[0], held[0] - held[-1]
    if rose >= RISE and fell >= FALL:
        return {"train_from": train[0], "train_to": train[-1], "held_from": held[0], "held_to": held[-1],
                "steps": WINDOW + 1,
                "reason": f"watchdog: training reward rose {train[0]:.3f} -> {train[-1]:.3f} over {WINDOW + 1} "
                          f"steps while held-out fell {held[0]:.3f} -> {held[-1]:.3f}; held for review "
                          "(reef releases promote ID publishes it)"}
    return None
