"""Gates: does a candidate replace the current release?

A gate gets the candidate's and the base's scores on the recipe's evaluation tasks (computed by the trainer,
one score per task, same tasks for both) and the best mean published so far, and returns a verdict with its
reason. Chosen per recipe (``gate`` setting):

- ``always``: publish every candidate.
- ``floor``: publish when the candidate's mean score is at least ``floor``.
- ``compare``: both answered the same prompts; publish when wins - losses >= ``margin`` (a paired comparison).
- ``regression``: publish unless the candidate's mean falls more than ``margin`` below the best so far.
- ``review``: hold the candidate as pending until a person promotes it (harness recipes).
"""

from __future__ import annotations

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


def judge(gate: str, *, candidate: list[float] | None, base: list[float] | None, best: float | None,
          floor: float = 0.0, margin: float = 0.0) -> Verdict:
    if gate not in GATES:
        raise BadRequest(f"unknown gate {gate!r}; gates: {', '.join(GATES)}", param="gate")
    c, b = _mean(candidate), _mean(base)
    metrics: dict[str, Any] = {"eval_reward": c, "base_reward": b}
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
        metrics.update(wins=wins, losses=losses)
        ok = wins - losses >= margin
        return Verdict(ok, "accepted" if ok else "rejected",
                       f"wins {wins} - losses {losses} {'>=' if ok else '<'} margin {margin}", metrics)
    top = best if best is not None else b if b is not None else c
    ok = c >= top - margin
    metrics["best"] = top
    return Verdict(ok, "accepted" if ok else "rejected",
                   f"mean {c:.3f} {'within' if ok else 'more than'} {margin} of best {top:.3f}", metrics)
