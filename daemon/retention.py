"""Keeping weights for months: which releases keep their weights in the store (a scenario's ``keep_releases``), and
the pass that prunes the others.

The chain grows with weights: every published step of a full-weights scenario adds a model's worth of LFS objects,
every adapter step a few MB, every candidate a canary ended a copy on the rejected log. Records and run copies
already go by age and size (``daemon/forgetting.py``); this module does the same for weights, on the same chain:

- **The policy.** ``keep_releases`` (every weights recipe's setting, ``recipes/base.RetentionSettings``; 20 by
  default, None keeps all) is how many of the chain's releases keep their weights, the head among them: the newest
  (``keep_policy = "latest"``, the default) or the head and the best by the gate's score (``"best"``: ``eval_reward``,
  newest first among equals; releases without one rank last). Kept
  too, whatever their age: the chain's first release (the model the scenario started from: ``reef eval`` compares
  with it, ``reef demo`` asks it, a rollback to the base is the usual way back); the releases that serve or may
  serve without anyone asking (``protected``: each chain's head, a running canary's two arms, every pending
  candidate, the releases the engines keep for requests that pinned them lately or are served on now,
  ``daemon/residency.py``); and the release ``reef releases list`` offers to roll back to when the head was trained
  on forgotten data (``forgetting.chain_view``). Rejected candidates with
  weights (a canary's ended candidate) keep theirs for the newest ``keep_releases`` of them and while protected.
  The base model an adapter release applies to is kept with every kept adapter (the store sees to it).
- **What pruning does** (``daemon/releases/pruning.py``): it removes the LFS objects only let-go releases name; the
  chain stays append-only, a pruned release stays listed and says so (``reef releases list`` / ``show``), and
  loading, rolling back to or promoting one is refused (``WeightsPruned``, 409, exit 5) naming the newest release
  before the head whose weights are kept. Its checkout under ``cache/releases`` goes with it (hard links would keep the bytes).
- **When.** A pass runs at start and after each ``release`` and ``canary.end`` event and each change of a
  scenario's settings; passes never overlap, and a burst of events makes one pass. Trainer checkpoints and
  optimizer state need no policy of their own: a scenario keeps one lineage candidate under ``candidates/`` (the
  one its next step continues) and the trainer keeps its optimizer in memory; both are dropped when the lineage
  ends (``daemon/learning.py``).
- **Storage short**: a weights step waits while the disk is short of its need (``daemon/learning_storage.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from daemon.errors import ReefError
from daemon.releases import Release

if TYPE_CHECKING:
    from daemon.records import Scenario

log = logging.getLogger("reef.retention")

KINDS = frozenset({"release", "canary.end", "scenario"})  # events after which a pass runs


def score(release: Release) -> float:
    """A release's gate score (``eval_reward``) for ``keep_policy = "best"``; one without a finite score ranks last."""
    value = release.metrics.get("eval_reward")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return -math.inf


def plan(chain: Sequence[Release], keep: int | None, protected: Collection[str], *, base: bool = True,
         policy: str = "latest") -> list[str]:
    """The releases of one chain (newest first) whose weights go: all but ``keep`` of them (``latest``: the newest;
    ``best``: the head and the ``keep - 1`` others of the highest gate score, newest first among equals), among those
    that hold weights as LFS objects, are not ``protected`` (by release id or content id) and are not (``base``) the
    chain's first release, the model the scenario started from. ``keep`` None: none go."""
    if keep is None:
        return []
    last = len(chain) - 1 if base else len(chain)
    keep = max(keep, 1)
    if policy == "best":
        ranked = sorted(range(1, last), key=lambda i: (-score(chain[i]), i))
        kept = {0, *ranked[:keep - 1]}
        older = [r for i, r in enumerate(chain[:last]) if i not in kept]
    else:
        older = list(chain[keep:last])
    return [r.release_id for r in older if r.lfs and r.release_id not in protected and r.content_id not in protected]


def protected_of(canaries: Mapping[str, Mapping[str, Any]], residency: Any, targets: Iterable[str | None]) -> set[str]:
    """What keeps its weights whatever its age, as release or content ids: both arms of each running canary (rows
    of ``Canaries.active``), what the engines keep (``Residency``: the heads, the arms, releases served lately
    unpinned, the ones requests pinned lately), and ``targets`` (the forgetting rollback target of each chain)."""
    out = {str(row[k]) for row in list(canaries.values()) for k in ("release_id", "base_id") if row.get(k)}
    out.update(residency.heads.values())
    out.update(residency.arms)
    for contents in list(residency.served.values()):
        out.update(contents)
    for pins in list(residency.pins.values()):
        out.update(pins)
    out.update(t for t in targets if t)
    return out


class _Reef(Protocol):
    """What a pass reads of the daemon (``daemon.serving.Reef``; ``daemon.services.Daemon`` and its canaries and
    residency), typed loosely: importing those types here would close an import circle through the learner."""

    config: Any
    store: Any
    chains: Any
    events: Any
    metrics: Any
    learner: Any
    canaries: Any
    residency: Any

    async def engine(self, model: str) -> Any: ...


class Retention:
    """The daemon's retention passes, and what the last one found per scenario (``GET /reef/status``)."""

    def __init__(self, reef: _Reef) -> None:
        self.reef = reef
        self.figures: dict[str, dict[str, Any]] = {}  # scenario -> what the last pass found
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="reef-weights-retention")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def keep_of(self, scenario: Scenario) -> tuple[int, str] | None:
        """The scenario's ``keep_releases`` and ``keep_policy``; None for one whose recipe takes none (a harness, a
        recipe that never trains) or that keeps all: nothing of theirs is pruned."""
        from recipes import load_recipe

        if load_recipe(scenario.recipe).kind != "weights":
            return None
        settings = self.reef.learner.make_recipe(scenario.recipe, scenario.settings).settings
        keep = getattr(settings, "keep_releases", None)
        return None if keep is None else (int(keep), str(getattr(settings, "keep_policy", "latest")))

    async def protected(self, names: Iterable[str]) -> set[str]:
        """Release and content ids whose weights stay whatever their age (``protected_of``), with the forgetting
        rollback target of each of ``names``; heads and pending candidates the store protects itself as well."""
        from daemon import forgetting

        targets = []
        for name in names:
            with contextlib.suppress(ReefError):
                targets.append((await forgetting.chain_view(self.reef, name)).get("rollback_to"))
        return protected_of(self.reef.canaries.active, self.reef.residency, targets)

    async def run(self) -> dict[str, Any]:
        """One pass over every scenario: prune the weights its policy lets go. Returns what went."""
        async with self._lock:
            chains = self.reef.chains
            policies: dict[str, tuple[int, str]] = {}
            for scenario in await self.reef.store.scenarios.all():
                try:
                    kept = await self.keep_of(scenario)
                except ReefError as e:  # a recipe that no longer loads: nothing of its chain is pruned
                    log.warning("retention: scenario %s keeps every release's weights: %s", scenario.name, e.message)
                    continue
                if kept is not None:
                    policies[scenario.name] = kept
            protected = await self.protected(policies)
            drop: list[str] = []
            figures: dict[str, dict[str, Any]] = {}
            for name, (keep, policy) in policies.items():
                history = await chains.history(name)
                if not history:
                    continue
                candidates = [c for c in await chains.rejected_candidates(name) if c.lfs]
                pruned = await chains.pruned_of(history + candidates)
                drop += [r for r in plan(history, keep, protected, policy=policy)
                         + plan(candidates, keep, protected, base=False) if not pruned.get(r)]
                figures[name] = {"keep_releases": keep, "keep_policy": policy, "releases": len(history)}
            out: dict[str, Any] = await chains.prune(drop) if drop else {"objects": 0, "bytes": 0, "releases": []}
            for name in figures:
                history = await chains.history(name)
                pruned = await chains.pruned_of(history)
                here = {e["oid"]: int(e["size"]) for r in history if not pruned.get(r.release_id)
                        for e in r.lfs.values()}
                figures[name].update(pruned=sum(bool(v) for v in pruned.values()), weights_bytes=sum(here.values()))
            self.figures = figures
            if out["objects"]:
                log.info("retention: pruned the weights of %d releases (%d objects, %.1f MB)", len(out["releases"]),
                         out["objects"], out["bytes"] / 1e6)
                self.reef.events.publish("retention", releases=out["releases"], objects=out["objects"],
                                         bytes=out["bytes"])
            return out

    async def _watch(self) -> None:
        queue = self.reef.events.subscribe(internal=True)
        while True:
            try:
                await self.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a torn read while another process writes: the next event runs it again
                log.warning("retention: a pass failed; the next event runs it again", exc_info=True)
            while True:
                event = await queue.get()
                if event is None:  # dropped for falling behind: a pass now covers what it missed
                    queue = self.reef.events.subscribe(internal=True)
                    break
                if event["kind"] in KINDS:
                    while not queue.empty():  # a burst: one pass for all of it
                        if queue.get_nowait() is None:
                            queue = self.reef.events.subscribe(internal=True)
                    break
