"""Learning spend: the trainer time a weights scenario has used, its cap (the ``max_trainer_hours`` setting every
weights recipe takes, ``recipes/base.SpendSettings``), and the cost per point of reward gained; the provider tokens a
harness scenario's proposer calls used and their cap (``max_proposer_tokens``, ``recipes/base.ProposerSpendSettings``,
taken by ``lessons`` and ``harness-search``); what ``reef status`` and ``GET /reef/status`` show under ``spend``.

Design choices:
- The cap is trainer hours per UTC day, not a total: a daemon kept for months would otherwise stop learning for good
  once a total was spent and wait for a person to raise it, while a daily budget is how machine time is paid for
  and lets learning resume by itself. A calendar day, not a rolling 24 hours: a rolling window frees a few seconds
  at a time as old steps age out, so steps would start and be cut again and again, each consuming its batch as
  failed; a day boundary frees the whole budget at once.
- Trainer time is the daemon's wall-clock time waiting on the trainer for one step (a worker's start and the model's
  load included: the machine is held all the same). Each step writes it in its manifest's metrics
  (``trainer_seconds``) on every outcome, published, held, rejected, skipped or failed; the chain is the one
  account (the learner reads it again after each step and when the head moves), so a restart never gives a day's
  budget back and no step is counted twice.
- A step whose trainer time reaches the day's cap is cut there (the worker stopped) and written down as failed with
  "cap reached"; the scenario then takes no step until the next UTC day or a higher cap, and its state says
  ``capped`` (``Learner.step``).
- What is counted: releases of operation ``train`` or ``promote``, held candidates and rejections. A trained
  candidate is exactly one of those at any time (a held one is later promoted, or discarded as a rejection that
  names it); rollbacks copy an old release's metrics and are not counted.
- Proposer tokens are counted the same way: each harness step writes its proposer calls' tokens (prompt and answer,
  as the model reports them: ``usage``) in its metrics (``proposer_tokens``) on every outcome, and a call made once
  the day's tokens are spent ends the step as failed "cap reached" (``daemon/recipe_context.py``). The check is
  before a call, so the last call of a day may pass the cap by one answer's tokens; a proposer is never cut off
  mid-answer (its tokens are paid for all the same).
- Cost per point of reward: every trainer second spent on the scenario (failed and rejected steps included: they
  are the cost too) divided by the gain, in hundredths, from the batch reward of the first released step to that
  of the latest (``batch_reward``: the mean score of the batch a step trained on, i.e. of the traffic the release
  before it served). None until two released steps carry a batch reward and the latest is higher.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import BadRequest

DAY_S = 86400.0
KEY = "trainer_seconds"  # the metric each step's manifest carries
TOKENS = "proposer_tokens"  # and a harness step's: its proposer calls' provider tokens (prompt and answer)
POINT = 0.01  # a point of reward: the cost is trainer seconds per +0.01 of released batch reward


def check(settings: Any) -> None:
    """``max_trainer_hours`` is None (no cap) or a positive finite number of hours, ``max_proposer_tokens`` None or
    a positive whole number; else a ``BadRequest`` naming it."""
    cap = getattr(settings, "max_trainer_hours", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or not (math.isfinite(cap) and cap > 0)):
        raise BadRequest(f"max_trainer_hours must be a positive finite number of trainer hours per UTC day, "
                         f"not {cap!r}", param="settings.max_trainer_hours")
    tokens = getattr(settings, "max_proposer_tokens", None)
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise BadRequest(f"max_proposer_tokens must be a positive whole number of provider tokens per UTC day, "
                         f"not {tokens!r}", param="settings.max_proposer_tokens")


def cap_seconds(settings: Any) -> float | None:
    cap = getattr(settings, "max_trainer_hours", None)
    return None if cap is None else float(cap) * 3600.0


def day_start(now: float) -> float:
    """The start of the UTC day holding ``now`` (unix seconds: days are whole multiples of 86400 from the epoch)."""
    return now - now % DAY_S


@dataclass
class Spend:
    """One scenario's trainer time and released rewards, as the chain (and the steps since it was read) says."""

    head: str | None = None  # the head when the chain was read: a head moved elsewhere means read it again
    steps: list[tuple[float, float]] = field(default_factory=list)  # (written down at, trainer seconds)
    rewards: list[tuple[float, float]] = field(default_factory=list)  # (released at, batch reward), oldest first
    tokens: list[tuple[float, float]] = field(default_factory=list)  # (written down at, proposer tokens)

    def add(self, when: float, seconds: float) -> None:
        self.steps.append((when, seconds))

    def today(self, now: float, of: str = KEY) -> float:
        """Trainer seconds (``of`` ``TOKENS``: proposer tokens) of the steps written down since the start of
        ``now``'s UTC day."""
        start = day_start(now)
        return sum(s for when, s in (self.tokens if of == TOKENS else self.steps) if start <= when < start + DAY_S)

    def total(self) -> float:
        return sum(s for _, s in self.steps)

    def gained(self) -> float | None:
        """The released batch reward's change from the first released step to the latest (None: fewer than two)."""
        if len(self.rewards) < 2:
            return None
        return self.rewards[-1][1] - self.rewards[0][1]

    def cost_per_point(self) -> float | None:
        """Trainer seconds per +0.01 of released batch reward; None while nothing is gained."""
        gain = self.gained()
        if gain is None or gain <= 0:
            return None
        return self.total() / (gain / POINT)

    def remaining(self, settings: Any, now: float) -> float | None:
        """Trainer seconds left today under the cap (None: no cap; 0 or less: the cap is reached)."""
        cap = cap_seconds(settings)
        return None if cap is None else cap - self.today(now)

    def tokens_left(self, settings: Any, now: float) -> float | None:
        """Proposer tokens left today under ``max_proposer_tokens`` (None: no cap; 0 or less: the cap is reached)."""
        cap = getattr(settings, "max_proposer_tokens", None)
        return None if cap is None else cap - self.today(now, TOKENS)

    def reached(self, settings: Any, now: float) -> bool:
        """Whether either cap is reached today."""
        return any(left is not None and left <= 0
                   for left in (self.remaining(settings, now), self.tokens_left(settings, now)))

    def view(self, settings: Any, now: float) -> dict[str, Any]:
        """What ``GET /reef/status`` shows of the scenario's spend."""
        capped = self.reached(settings, now)
        cost, gain = self.cost_per_point(), self.gained()
        return {
            "trainer_seconds_today": round(self.today(now), 3),
            "trainer_seconds_total": round(self.total(), 3),
            "max_trainer_hours": getattr(settings, "max_trainer_hours", None),
            "proposer_tokens_today": int(self.today(now, TOKENS)),
            "proposer_tokens_total": int(sum(n for _, n in self.tokens)),
            "max_proposer_tokens": getattr(settings, "max_proposer_tokens", None),
            "capped": capped,
            "resumes_at": (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(day_start(now) + DAY_S))
                           if capped else None),
            "reward_gained": None if gain is None else round(gain, 4),
            "seconds_per_point": None if cost is None else round(cost, 3),
        }


def read(history: list[Any], pending: list[Any], rejections: list[Any], head: str | None) -> Spend:
    """A scenario's spend from its chain: ``history`` (newest first), held candidates and rejections."""
    out = Spend(head=head)
    counted = [r for r in history if r.operation in ("train", "promote")] + list(pending) + list(rejections)
    for entry in counted:
        for key, into in ((KEY, out.steps), (TOKENS, out.tokens)):
            n = (entry.metrics or {}).get(key)
            if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0:
                into.append((entry.created_at, float(n)))
    for rel in reversed(history):
        reward = (rel.metrics or {}).get("batch_reward")
        if rel.operation in ("train", "promote") and isinstance(reward, (int, float)) and not isinstance(reward, bool):
            out.rewards.append((rel.created_at, float(reward)))
    return out

