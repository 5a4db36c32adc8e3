"""The GEPA-style candidate pool: trees with per-task scores, parents drawn from the Pareto front.

A tree is on the front when no other tree in the pool scores at least as well on every task and better on one
(so a tree that is best on some task survives even when its mean is lower). Parents are drawn from the front
with a seeded generator, weighted by the number of tasks each is best on (GEPA's selection), so a crash and
retry of the same step draws the same parent. The pool is bounded by ``capacity`` (off-front trees leave first)
and goes to and from JSON (``to_json``, ``from_json``): the recipe keeps it in a file beside its other memory, so a
restart keeps the front.
"""

from __future__ import annotations

import base64
import hashlib
import random
from dataclasses import dataclass, field
from typing import Any


def tree_id(tree: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for path in sorted(tree):
        h.update(path.encode() + b"\0" + tree[path] + b"\0")
    return h.hexdigest()[:16]


@dataclass
class Member:
    id: str
    tree: dict[str, bytes]
    scores: dict[str, list[float]] = field(default_factory=dict)  # task -> every episode's score
    parent: str | None = None
    origin: str = "serving"  # serving | proposal | retire

    def mean(self, task: str) -> float | None:
        xs = self.scores.get(task)
        return None if not xs else sum(xs) / len(xs)

    def task_means(self) -> dict[str, float]:
        return {t: m for t in self.scores if (m := self.mean(t)) is not None}


@dataclass
class Pool:
    capacity: int = 16
    members: dict[str, Member] = field(default_factory=dict)

    def add(self, tree: dict[str, bytes], *, parent: str | None = None, origin: str = "proposal") -> Member:
        tid = tree_id(tree)
        member = self.members.get(tid)
        if member is None:
            member = self.members[tid] = Member(tid, dict(tree), parent=parent, origin=origin)
        return member

    def record(self, tree: dict[str, bytes], task: str, score: float) -> None:
        self.add(tree).scores.setdefault(task, []).append(score)

    def front(self, tasks: list[str]) -> list[Member]:
        """The members no other member dominates on ``tasks`` (members with no scores yet are left out)."""
        scored = [m for m in self.members.values() if any(m.mean(t) is not None for t in tasks)]

        def vec(m: Member) -> list[float]:
            return [mean if (mean := m.mean(t)) is not None else 0.0 for t in tasks]

        out = []
        for m in scored:
            a = vec(m)
            if not any(all(x >= y for x, y in zip(vec(o), a, strict=True)) and vec(o) != a
                       for o in scored if o is not m):
                out.append(m)
        return out

    def sample(self, tasks: list[str], seed: str, fallback: Member) -> Member:
        """A parent from the front, weighted by the tasks it is best on; ``fallback`` when nothing is scored."""
        front = self.front(tasks)
        if not front:
            return fallback
        best = {t: max((m.mean(t) or 0.0) for m in front) for t in tasks}
        weights = [1 + sum((m.mean(t) or 0.0) >= best[t] for t in tasks) for m in front]
        front_sorted = sorted(zip(front, weights, strict=True), key=lambda x: x[0].id)
        rng = random.Random(seed)
        return rng.choices([m for m, _ in front_sorted], weights=[w for _, w in front_sorted])[0]

    def to_json(self) -> list[dict[str, Any]]:
        return [{"id": m.id, "parent": m.parent, "origin": m.origin, "scores": m.scores,
                 "tree": {p: file_text(d) for p, d in m.tree.items()}} for m in self.members.values()]

    @classmethod
    def from_json(cls, raw: list[dict[str, Any]], capacity: int) -> Pool:
        """The pool ``to_json`` wrote; a member whose tree does not hash to its id is left out (a damaged file)."""
        pool = cls(capacity=capacity)
        for m in raw:
            tree = {p: file_bytes(d) for p, d in m["tree"].items()}
            if tree_id(tree) != m["id"]:
                continue
            scores = {str(t): [float(x) for x in xs] for t, xs in m.get("scores", {}).items()}
            pool.members[m["id"]] = Member(m["id"], tree, scores, parent=m.get("parent"),
                                           origin=str(m.get("origin", "proposal")))
        return pool

    def prune(self, tasks: list[str], keep: set[str]) -> None:
        """Keep at most ``capacity`` members: off-front ones go first, oldest first; ``keep`` always stays."""
        if len(self.members) <= self.capacity:
            return
        on_front = {m.id for m in self.front(tasks)} | keep
        for mid in list(self.members):
            if len(self.members) <= self.capacity:
                break
            if mid not in on_front:
                del self.members[mid]
        for mid in list(self.members):
            if len(self.members) <= self.capacity:
                break
            if mid not in keep:
                del self.members[mid]


def file_text(data: bytes) -> str | dict[str, str]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode()}


def file_bytes(value: str | dict[str, str]) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else base64.b64decode(value["base64"])
