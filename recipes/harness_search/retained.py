"""A harness-search evaluation that survives a restart, and what it reports beside the gate's test (issue 48: the
original's retained release evaluation).

- ``Progress``: the candidate being judged (its tree, origin and parent, the serving tree it is judged against) and
  every episode that ran, written to the recipe's memory file after each episode (atomically, durably: the recipe's
  ``_save``). A step cut by a kill -9 or a restart resumes with the same candidate and the same pairs, running only
  the episodes that had not run (the proposer is not asked again). Kept only while the serving tree is the one it is
  judged against: a head that moved meanwhile starts a new evaluation.
- ``deltas``: per task, the mean paired difference (candidate - serving) over the repeats that ran, and a task-level
  bootstrap interval of their mean (tasks resampled with their repeats: the tasks, not the episodes, are what a
  user's suite samples), beside the gate's sign test over all pairs. An episode that could not run is in neither:
  it is counted apart (``episodes_not_run``), never a 0.
- ``pins``: what was run, written in the release's metrics: the suite (its tasks' ids, prompts, checks and time
  limits, hashed), the agent (adapter), the scenario's model, the serving and candidate trees' ids, the repeats.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from recipes.harness_search.episodes import Episode, Task
from recipes.harness_search.pool import file_bytes, file_text, tree_id

BOOTSTRAP = 2000  # resamples of the tasks
SEED = 0  # the bootstrap's: the same pairs give the same interval, before and after a restart


@dataclass
class Progress:
    """An evaluation under way: the candidate and the episodes that ran, by ``key``."""

    serving: str  # the serving tree's id it is judged against
    candidate: dict[str, bytes]
    origin: str
    parent: str
    details: dict[str, Any] = field(default_factory=dict)  # what the proposal said (mutations, executable paths)
    episodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @staticmethod
    def key(repeat: int, task: str, side: str) -> str:
        return f"{repeat}:{task}:{side}"

    def ran(self, repeat: int, task: str, side: str) -> Episode | None:
        raw = self.episodes.get(self.key(repeat, task, side))
        return None if raw is None else Episode(**raw)

    def record(self, episode: Episode) -> None:
        self.episodes[self.key(episode.repeat, episode.task, episode.side)] = episode.to_dict()

    def to_json(self) -> dict[str, Any]:
        return {"serving": self.serving, "candidate": {p: file_text(d) for p, d in self.candidate.items()},
                "candidate_id": tree_id(self.candidate), "origin": self.origin, "parent": self.parent,
                "details": self.details, "episodes": self.episodes}

    @classmethod
    def from_json(cls, raw: Any) -> Progress | None:
        """What ``to_json`` wrote; None for nothing, or for a damaged entry (its tree does not hash to its id, a
        field missing): the evaluation starts again."""
        if not isinstance(raw, dict):
            return None
        try:
            tree = {str(p): file_bytes(d) for p, d in raw["candidate"].items()}
            if tree_id(tree) != raw["candidate_id"]:
                return None
            episodes = {str(k): dict(v) for k, v in raw["episodes"].items()}
            for v in episodes.values():
                Episode(**v)  # each one a whole episode
            return cls(str(raw["serving"]), tree, str(raw["origin"]), str(raw["parent"]), dict(raw["details"]),
                       episodes)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def deltas(pairs: list[tuple[Episode, Episode]], *, seed: int = SEED) -> dict[str, Any]:
    """The paired differences (candidate - serving) per task, their mean over tasks, and its task-level bootstrap
    95% interval; ``pairs`` are (candidate, serving) episodes that both ran."""
    per_task: dict[str, list[float]] = {}
    for c, s in pairs:
        per_task.setdefault(c.task, []).append(c.score - s.score)
    means = {t: sum(v) / len(v) for t, v in per_task.items()}
    out: dict[str, Any] = {"task_deltas": {t: round(m, 4) for t, m in sorted(means.items())}}
    if not means:
        return out
    values = [means[t] for t in sorted(means)]
    out["delta"] = round(sum(values) / len(values), 4)
    rng = random.Random(seed)
    boot = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(BOOTSTRAP))
    out["delta_ci95"] = [round(boot[int(0.025 * BOOTSTRAP)], 4), round(boot[int(0.975 * BOOTSTRAP) - 1], 4)]
    return out


def suite_id(tasks: list[Task]) -> str:
    """What decides a suite's scores: each task's id, prompt, check, workspace and limits (hashed)."""
    raw = json.dumps([[t.id, t.prompt, t.check, str(t.workspace or ""), t.time_limit_s, t.check_timeout_s]
                      for t in tasks], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def pins(tasks: list[Task], *, adapter: str, model: str, serving: str, candidate: str, repeats: int) -> dict[str, Any]:
    """What an evaluation ran, for the release's metrics (``eval_*``)."""
    return {"eval_suite": suite_id(tasks), "eval_tasks": len(tasks), "eval_repeats": repeats,
            "eval_adapter": adapter, "eval_model": model, "eval_serving": serving, "eval_candidate": candidate}
