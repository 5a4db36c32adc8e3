"""The ``harness-search`` recipe: a proposer rewrites the harness tree from the runs that went badly, and paired
episodes of the real agent on the scenario's tasks decide what is published.

One step (woken by each written feedback; never inline, since episodes take seconds to minutes):

1. Experience: the batch's reports that went badly (a score below ``bad_below``, or feedback without a score)
   with their runs' recorded exchanges, and the ``evolve`` instructions, join a bounded memory the proposer sees.
2. Candidate: a parent drawn from the pool's Pareto front (``pool.py``), mutated by the proposer (``proposer.py``;
   up to ``max_proposer_calls`` tries, each malformed or refused answer written down with its reason). When the
   serving tree holds a skill no step has tested yet, the step's candidate is instead the serving tree without it
   (a retirement): a skill whose removal is not shown to lose does not help, and goes (below).
3. Gate: every task under the serving tree and the candidate, ``repeats`` times (by default as many as
   ``max_episodes`` allows), interleaved (the order of the pair alternates); each (task, repeat) pair is a win, a
   loss or a tie, and the candidate is published when the compare gate (``daemon/gate.py``) shows it better at
   error rate ``alpha`` (0.05): the exact sign test on the untied pairs, valid over repeats of one task too, since
   under equal harnesses each untied pair of independent episodes is a win or a loss alike. A clean sweep needs
   5 untied pairs at 0.05, so the budget is ``max_episodes = 32`` (16 pairs: ties are common, since most tasks pass
   or fail under both trees) and settings whose pairs could never reach 5 are refused; fewer untied pairs than 5 in
   a step hold the candidate for review (cannot decide). Power (exact, 16 pairs of independent episodes, serving
   pass rate 0.3): a candidate passing 0.8 is published 80% of the time (36% at the old 16 episodes), one passing
   0.6 35%, an equal one 2% (at most 5% whatever the pass rate).
   A retirement is judged the other way round, since it makes the harness smaller, not better: rejected when
   the removal is shown to lose at ``alpha`` (the sign test on losses), held when too few pairs ran to show a
   loss (fewer than 5), published otherwise; so a skill that does not matter is kept at most ``alpha`` of the
   time (a helpful skill whose effect the pairs are too few to show may go: the proposer may add it back). Both trees'
   scores join the pool, published or not, so a tree best on one task stays a parent. A pair with an episode that
   did not run (``error``: the sandbox, the wrapper or the agent could not start or crashed; ``timeout``: killed
   at its limit) is no result: it is left out of the gate and the pool, and a step with no pair left fails with
   the reasons (a failed step is written down as such, never as a tie).
4. Written down: per-task means of both sides, the spend (episodes, proposer calls, seconds), the mutations and
   refusals, in the step's metrics (release or rejection) and in the step's answer.

Memory: the pool, the bad runs and instructions the proposer sees, the skills tested for retirement and the step
count are written after every step to ``$REEF_HOME/scenarios/<scenario>/harness-search.json`` (temp file, fsync,
rename), and read back by the first step after a restart, so the Pareto front survives one. The file is the
machine's own: daemons sharing a record store each keep theirs (only the training lease holder steps).

Executable content is refused unless ``allow_executable``; a candidate holding some is never published by the gate
alone: it is held for review (``reef releases promote``). ``gate = "review"`` holds every candidate that passes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.errors import BadRequest, CapReached, StepFailed
from daemon.gate import Verdict, paired_interval, pairs_needed, sign_test_p
from daemon.gate import check as gate_check
from daemon.gate import judge as gate_judge
from recipes.base import (
    Candidate,
    EpisodeContext,
    FeedbackReport,
    HarnessContext,
    HeldoutSettings,
    ProposerSpendSettings,
    Recipe,
    Scores,
)
from recipes.harness_search.episodes import Episode, EpisodeEnv, Task, parse_tasks, run_episode
from recipes.harness_search.mutations import Limits, Refused, apply, parse, skills
from recipes.harness_search.pool import Member, Pool, tree_id
from recipes.harness_search.proposer import PROPOSER_SYSTEM, proposer_prompt, render_exchange
from recipes.harness_search.retained import Progress, deltas, pins

log = logging.getLogger("reef.learning")


NOT_RUN = ("error", "timeout")  # episode statuses that are no result: the sandbox, the agent or the check did not run


def _why_not_run(pairs: list[tuple[Episode, Episode]]) -> str:
    eps = [e for pair in pairs for e in pair if e.status in NOT_RUN]
    shown = "; ".join(f"{e.task}/{e.side}#{e.repeat} {e.status}: {' '.join(e.output.split())[-240:]}" for e in eps[:4])
    return shown + (f"; and {len(eps) - 4} more" if len(eps) > 4 else "")


HIDE = ("~/.ssh", "~/.aws", "~/.gnupg", "~/.netrc", "~/.git-credentials", "~/.docker", "~/.kube", "~/.npmrc",
        "~/.pypirc", "~/.config/gh")


@dataclass
class HarnessSearchSettings(ProposerSpendSettings, HeldoutSettings):
    gate: str = "compare"  # compare: paired episodes decide | review: a candidate that passes is held for review
    margin: float = 0.0  # the least lead (wins - losses over task x repeat pairs) on top of the gate's test
    alpha: float | None = None  # the gate's error rate (the sign test over the pairs); None: 0.05
    tasks: list[dict[str, Any]] = field(default_factory=list)  # see episodes.py: {id, prompt, check, workspace?}
    repeats: int | None = None  # episodes per task and side; None: as many as max_episodes allows
    adapter: str = "pi"  # the wrapped agent the episodes run
    proposer: str | None = None  # a configured model name; None: the scenario's own model
    proposer_max_tokens: int = 2048
    max_episodes: int = 32  # budget per step (the gate's repeats are cut to fit): 16 pairs (module docstring)
    # also run each task under the chain's first release, interleaved with the serving tree and the candidate: the
    # candidate's paired deltas against the base too (retained.py); a third of max_episodes goes to it, so the gate
    # has fewer pairs (at the defaults 10 instead of 16): off by default
    base_arm: bool = False
    max_proposer_calls: int = 3  # budget per step (malformed or refused answers count)
    bad_below: float = 0.5  # a report scoring below this is a run that went badly
    max_runs_in_prompt: int = 4  # bad runs the proposer sees (the newest)
    max_prompt_chars: int = 24_000
    allow_executable: bool = False  # scripts in skills: refused, or (true) allowed but only held for review
    max_file_bytes: int = 16 * 1024
    max_tree_bytes: int = 128 * 1024
    max_mutations: int = 8  # per proposal
    similarity: float = 0.6  # a new rule or skill this similar (word overlap) to an existing one merges into it
    retire_skills: bool = True  # test each skill of the serving tree once by leaving it out
    pool_size: int = 16
    seed: int = 0
    # host paths hidden even where the sandbox binds a directory above them (it binds an allow-list only:
    # sandbox.allowed(); REEF_HOME is always hidden)
    hide: list[str] = field(default_factory=lambda: list(HIDE))


class HarnessSearch(Recipe):
    """``harness-search``: proposer mutations of the harness, judged by paired episodes of the real agent."""

    name = "harness-search"
    kind = "harness"
    source = "feedback"
    inline = False
    episode_tasks = True
    Settings = HarnessSearchSettings

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings)
        s: HarnessSearchSettings = self.settings
        self.pool = Pool(capacity=s.pool_size)
        self.bad_runs: deque[dict[str, Any]] = deque(maxlen=s.max_runs_in_prompt)
        self.instructions: deque[str] = deque(maxlen=10)
        self.retire_tested: set[tuple[str, str]] = set()
        self.steps = 0
        self.progress: Progress | None = None  # an evaluation under way (retained.py): resumed after a restart
        self._loaded = False  # the memory file read (once, at the first step)

    @classmethod
    def check_settings(cls, settings: Any) -> None:
        s: HarnessSearchSettings = settings
        if s.gate not in ("compare", "review"):
            raise BadRequest(f"harness-search gate must be compare or review, not {s.gate!r}", param="settings.gate")
        alpha, _ = gate_check("compare", alpha=s.alpha, margin=s.margin)  # both gates compare the pairs first
        tasks = parse_tasks(s.tasks)
        if not tasks:
            raise BadRequest("harness-search needs tasks: [{id, prompt, check, workspace?}, ...] (the gate runs "
                             "the agent on them)", param="settings.tasks")
        for key in ("repeats", "max_episodes", "max_proposer_calls", "max_runs_in_prompt", "pool_size",
                    "max_mutations"):
            if getattr(s, key) is not None and getattr(s, key) < 1:
                raise BadRequest(f"harness-search {key} must be at least 1", param=f"settings.{key}")
        if s.max_episodes < 2 * len(tasks):
            raise BadRequest(f"max_episodes {s.max_episodes} cannot pair {len(tasks)} task(s) once "
                             f"(needs {2 * len(tasks)})", param="settings.max_episodes")
        pairs, need = len(tasks) * repeats_of(s, len(tasks), arms(s)), pairs_needed(alpha)
        if pairs < need:
            raise BadRequest(f"the gate cannot decide at error rate {alpha} on {pairs} episode pair(s) ({len(tasks)} "
                             f"task(s) x {repeats_of(s, len(tasks), arms(s))} repeat(s)): a clean sweep needs at least {need} "
                             f"untied pairs; raise repeats or max_episodes (2 episodes a pair), add tasks, or state a "
                             "higher alpha", param="settings.max_episodes")
        from adapters import ADAPTERS

        if s.adapter not in ADAPTERS:
            raise BadRequest(f"unknown adapter {s.adapter!r} ({', '.join(ADAPTERS)})", param="settings.adapter")

    def models_used(self) -> list[str]:
        return [self.settings.proposer] if self.settings.proposer else []

    def planned(self) -> dict[str, int]:
        s: HarnessSearchSettings = self.settings
        tasks = len(parse_tasks(s.tasks))
        repeats = repeats_of(s, tasks, arms(s))
        return {"episodes": tasks * repeats * arms(s), "tasks": tasks, "repeats": repeats,
                "max_episodes": s.max_episodes}

    def limits(self) -> Limits:
        s: HarnessSearchSettings = self.settings
        return Limits(max_mutations=s.max_mutations, max_file_bytes=s.max_file_bytes, max_tree_bytes=s.max_tree_bytes,
                      allow_executable=s.allow_executable, similarity=s.similarity)

    # --- the step -----------------------------------------------------------------------------------------

    async def edit(self, tree: dict[str, bytes], batch: list[FeedbackReport], ctx: HarnessContext) -> Candidate:
        s: HarnessSearchSettings = self.settings
        tasks = parse_tasks(s.tasks)
        self._load(ctx)
        self.steps += 1
        spend: dict[str, Any] = {"proposer_calls": 0, "episodes": 0, "proposer_s": 0.0, "episode_s": 0.0}
        await self._remember(batch, ctx)
        serving = self.pool.add(tree, origin="serving")
        details: dict[str, Any] = {"proposals_refused": [], "mutations": [], "spend": spend}

        progress = self.progress if self.progress is not None and self.progress.serving == serving.id else None
        if progress is not None:  # a step cut by a restart: the same candidate, the episodes that ran kept
            details.update(progress.details)
            parent_member = self.pool.members.get(progress.parent) or serving
            return await self._judged(ctx, tree, progress.candidate, progress.origin, parent_member, serving, spend,
                                      details, progress)
        self.progress = None  # judged against another head: it starts again
        made = self._retirement(serving)
        if made is None:
            made = await self._propose(serving, tasks, ctx, spend, details)
        if made is None:
            summary = f"no usable proposal in {spend['proposer_calls']} call(s): " + \
                "; ".join(r["reason"] for r in details["proposals_refused"])
            details["summary"] = summary
            self._save(ctx)
            return Candidate(skipped=summary, consume=False, metrics=self._metrics(spend, details), details=details)
        candidate, origin, parent = made
        progress = Progress(serving.id, candidate, origin, parent.id,
                            {k: details[k] for k in ("mutations", "executable") if details.get(k)})
        return await self._judged(ctx, tree, candidate, origin, parent, serving, spend, details, progress)

    async def assess(self, tree: dict[str, bytes], candidate: Candidate, ctx: HarnessContext) -> Candidate:
        """An agent's proposal: judged by the same paired episodes as the proposer's candidates (a retired skill as a
        retirement), and, judged, in the pool like them."""
        assert candidate.tree is not None
        self._load(ctx)
        spend: dict[str, Any] = {"proposer_calls": 0, "episodes": 0, "proposer_s": 0.0, "episode_s": 0.0}
        serving = self.pool.add(tree, origin="serving")
        details: dict[str, Any] = {"proposals_refused": [], "mutations": candidate.details.get("mutations") or [],
                                   "spend": spend}
        if candidate.details.get("executable"):
            details["executable"] = candidate.details["executable"]
        origin = "retire" if candidate.details.get("origin") == "retire" else "agent-proposal"
        judged = await self._judged(ctx, tree, candidate.tree, origin, serving, serving, spend, details)
        judged.metrics.update({k: v for k, v in candidate.metrics.items() if k not in judged.metrics})
        return judged

    async def _judged(self, ctx: HarnessContext, tree: dict[str, bytes], candidate: dict[str, bytes], origin: str,
                      parent: Member, serving: Member, spend: dict[str, Any], details: dict[str, Any],
                      progress: Progress | None = None) -> Candidate:
        """``candidate`` against the serving ``tree`` in paired episodes: the Candidate its gate judges. With
        ``progress`` (the loop's own steps), each episode is written down as it ends and one that ran before a
        restart is not run again (``retained.py``)."""
        s: HarnessSearchSettings = self.settings
        tasks = parse_tasks(s.tasks)
        details.update(origin=origin, parent=parent.id, candidate=tree_id(candidate), serving=serving.id)

        env = await self._env(ctx)
        if not isinstance(ctx, EpisodeContext):
            raise BadRequest("harness-search needs the daemon's harness context (episode releases, scoped tokens) "
                             "to run episodes")
        trees = {"serving": tree, "candidate": candidate}
        base = await _first_tree(ctx) if s.base_arm else None
        if base is not None and tree_id(base) not in (tree_id(tree), tree_id(candidate)):
            trees["base"] = base  # the chain's first release, a third side
        files = {side: self._render(t) for side, t in trees.items()}
        pinned = {side: await ctx.episode_release(env.scenario, t) for side, t in trees.items()}
        repeats = repeats_of(s, len(tasks), len(trees))  # no distinct base: its share of the budget goes to the pairs
        pairs: list[tuple[Episode, Episode]] = []  # both sides ran: what the gate and the pool judge
        base_pairs: list[tuple[Episode, Episode]] = []  # (candidate, base), both ran: the deltas against the base
        not_run: list[tuple[Episode, Episode]] = []  # a side could not run (sandbox, crash, time limit): neither
        for r in range(repeats):
            for i, task in enumerate(tasks):
                sides = list(trees)
                turn = (r + i) % len(sides)  # interleaved: drift (a warming cache, a busy machine) falls on each side
                sides = sides[turn:] + sides[:turn]
                got = {}
                for side in sides:
                    ep = progress.ran(r, task.id, side) if progress is not None else None
                    if ep is not None:
                        spend["episodes_resumed"] = spend.get("episodes_resumed", 0) + 1
                    else:
                        ep = await self._episode(ctx, task, files[side], env, side=side, repeat=r,
                                                 release_id=pinned[side])
                        spend["episodes"] += 1
                        spend["episode_s"] = round(spend["episode_s"] + ep.seconds + ep.check_seconds, 3)
                        if progress is not None:
                            progress.record(ep)
                            self.progress = progress
                            self._save(ctx)  # a restart from here on resumes with this episode
                    got[side] = ep
                if "base" in got and not {got["candidate"].status, got["base"].status} & set(NOT_RUN):
                    base_pairs.append((got["candidate"], got["base"]))
                pair = (got["candidate"], got["serving"])
                if any(e.status in NOT_RUN for e in pair):  # a failure is not a result: not a loss, not a tie
                    not_run.append(pair)
                    continue
                pairs.append(pair)
        spend["episodes_not_run"] = sum(e.status in NOT_RUN for pair in not_run for e in pair)
        self.progress = None  # judged (or failed for good below): the next step starts a new one
        for c, b in pairs:  # into the pool once judged (a pair resumed after a restart is not counted twice)
            self.pool.record(tree, c.task, b.score)
            self.pool.record(candidate, c.task, c.score)
        if not pairs:  # nothing was judged: the step failed, with the reasons, and nothing joins the pool
            self._save(ctx)
            raise StepFailed(f"no episode pair could run ({spend['episodes_not_run']} of {spend['episodes']} episodes "
                             "did not run): " + _why_not_run(not_run))
        self.pool.add(candidate, parent=parent.id, origin=origin)
        self.pool.prune([t.id for t in tasks], keep={serving.id, tree_id(candidate)})
        details["episodes"] = [e.to_dict() for pair in [*pairs, *not_run] for e in pair]
        if not_run:
            details["not_run"] = _why_not_run(not_run)
        details["tasks"] = self._per_task([t for t in tasks if any(c.task == t.id for c, _ in pairs)], pairs)
        details["summary"] = (f"{origin} candidate: " + ", ".join(
            f"{t}: candidate {v['candidate']:.2f} vs serving {v['serving']:.2f}" for t, v in details["tasks"].items()))
        details.update(deltas(pairs))
        if "base" in trees:
            details["base"] = {"release": tree_id(trees["base"]), **deltas(base_pairs)}
        metrics = self._metrics(spend, details)
        metrics.update(pins(tasks, adapter=s.adapter, model=str(getattr(ctx, "model", "")), serving=serving.id,
                            candidate=tree_id(candidate), repeats=repeats))
        if "delta" in details:
            metrics.update(delta=details["delta"], delta_lo=details["delta_ci95"][0], delta_hi=details["delta_ci95"][1])
        if "delta" in details.get("base", {}):
            b = details["base"]
            metrics.update(eval_base=b["release"], delta_base=b["delta"], delta_base_lo=b["delta_ci95"][0],
                           delta_base_hi=b["delta_ci95"][1])
        self._save(ctx)
        return Candidate(tree=candidate, metrics=metrics, details=details,
                         eval=Scores(candidate=[c.score for c, _ in pairs], base=[b.score for _, b in pairs]))

    def judge(self, candidate: Candidate, *, best: float | None) -> Verdict:
        s: HarnessSearchSettings = self.settings
        ev = candidate.eval
        assert ev is not None
        if candidate.details.get("origin") == "retire":
            return retirement(ev.candidate, ev.base or [], alpha=s.alpha)
        v = gate_judge("compare", candidate=ev.candidate, base=ev.base, best=best, margin=s.margin, alpha=s.alpha)
        if v.publish and (s.gate == "review" or candidate.details.get("executable")):
            why = "it holds executable content" if candidate.details.get("executable") else "gate review"
            return Verdict(False, "pending", f"{v.reason}; held for review ({why}): reef releases promote ID "
                           "publishes it", v.metrics)
        return v

    # --- memory (survives a restart) ---------------------------------------------------------------------------

    @staticmethod
    def _memory_path(ctx: HarnessContext) -> Path | None:
        config, scenario = getattr(ctx, "config", None), getattr(ctx, "scenario", None)
        if config is None or not isinstance(scenario, str):
            return None
        return Path(config.home) / "scenarios" / scenario / "harness-search.json"

    def _load(self, ctx: HarnessContext) -> None:
        if self._loaded:
            return
        self._loaded = True
        path = self._memory_path(ctx)
        if path is None or not path.exists():
            return
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != 1:
                raise ValueError(f"version {raw.get('version')!r}, not 1")
            pool = Pool.from_json(raw["pool"], self.settings.pool_size)
            bad_runs, instructions = list(raw["bad_runs"]), [str(x) for x in raw["instructions"]]
            tested = {(str(a), str(b)) for a, b in raw["retire_tested"]}
            steps = int(raw["steps"])
            progress = Progress.from_json(raw.get("progress"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # damaged: start again, say so
            log.warning("harness-search: could not read %s (%s); the pool starts again from the serving tree", path, e)
            return
        self.pool, self.retire_tested, self.steps, self.progress = pool, tested, steps, progress
        self.bad_runs.extend(bad_runs)
        self.instructions.extend(instructions)

    def _save(self, ctx: HarnessContext) -> None:
        from daemon import durable

        path = self._memory_path(ctx)
        if path is None:
            return
        data = {"version": 1, "steps": self.steps, "pool": self.pool.to_json(), "bad_runs": list(self.bad_runs),
                "instructions": list(self.instructions), "retire_tested": sorted(self.retire_tested),
                "progress": None if self.progress is None else self.progress.to_json()}
        try:
            durable.mkdirs(path.parent)
            durable.write_atomic(path, json.dumps(data).encode(), mode=0o600)
        except OSError as e:  # the step's outcome still stands; only a restart would lose this step's memory
            log.warning("harness-search: could not write %s: %s", path, e)

    def forget(self, ids: set[str], ctx: HarnessContext) -> None:
        """A forgotten report's bad run (its feedback and the run's rendered exchange) leaves the memory, here and
        in the memory file."""
        self._load(ctx)
        kept = [r for r in self.bad_runs if r.get("report") not in ids]
        if len(kept) != len(self.bad_runs):
            self.bad_runs.clear()
            self.bad_runs.extend(kept)
            self._save(ctx)

    # --- parts ---------------------------------------------------------------------------------------------

    async def _remember(self, batch: list[FeedbackReport], ctx: HarnessContext) -> None:
        s: HarnessSearchSettings = self.settings
        reader = getattr(ctx, "record", None)
        known = {r["report"] for r in self.bad_runs}
        for rep in batch:
            if rep.id in known:  # a batch kept by a step that found no usable proposal comes again
                continue
            meta = rep.metadata or {}
            feedback = rep.feedback
            if not isinstance(feedback, str):
                feedback = json.dumps(feedback)
            if meta.get("kind") == "instruction":
                if feedback[:2000] not in self.instructions:
                    self.instructions.append(feedback[:2000])
                continue
            score = rep.score
            if score is not None and score >= s.bad_below:
                continue
            exchanges = []
            refs = rep.references
            if reader is not None and refs:  # the last exchange's request holds the run's conversation
                try:
                    exchanges.append(render_exchange(await reader(refs[-1]), s.max_prompt_chars // 4))
                except Exception as e:  # a record that cannot be read: the feedback alone still helps
                    exchanges.append(f"(the run's record could not be read: {e})")
            self.bad_runs.append({"report": rep.id, "score": score, "feedback": feedback[:2000],
                                  "exchanges": exchanges})

    def _retirement(self, serving: Member) -> tuple[dict[str, bytes], str, Member] | None:
        if not self.settings.retire_skills:
            return None
        for name in sorted(skills(serving.tree)):
            if (serving.id, name) not in self.retire_tested:
                self.retire_tested.add((serving.id, name))
                tree = {p: d for p, d in serving.tree.items() if not p.startswith(f"skills/{name}/")}
                return tree, "retire", serving
        return None

    async def _propose(self, serving: Member, tasks: list[Task], ctx: HarnessContext, spend: dict[str, Any],
                       details: dict[str, Any]) -> tuple[dict[str, bytes], str, Member] | None:
        s: HarnessSearchSettings = self.settings
        ids = [t.id for t in tasks]
        parent = self.pool.sample(ids, seed=f"{s.seed}:{self.steps}", fallback=serving)
        task_view = [{"id": t.id, "prompt": t.prompt,
                      **({"score": round(m, 3)} if (m := parent.mean(t.id)) is not None else {})} for t in tasks]
        prompt = proposer_prompt(parent.tree, list(self.bad_runs), list(self.instructions), task_view,
                                 s.max_prompt_chars)
        limits = self.limits()
        for attempt in range(s.max_proposer_calls):
            t0 = time.perf_counter()
            error: str | None
            try:
                answer = await ctx.answer(s.proposer, PROPOSER_SYSTEM, prompt, s.proposer_max_tokens, proposal=True)
            except CapReached:  # the day's proposer tokens are spent: the step ends failed, "cap reached"
                raise
            except Exception as e:  # a proposer that fails is a refused proposal; the next step tries again
                answer, error = "", f"the proposer failed: {type(e).__name__}: {e}"
            else:
                error = None
            spend["proposer_calls"] += 1
            spend["proposer_s"] = round(spend["proposer_s"] + time.perf_counter() - t0, 3)
            try:
                if error is not None:
                    raise Refused(error)
                applied = apply(parent.tree, parse(answer, limits), limits)
                if applied.tree == parent.tree or tree_id(applied.tree) == serving.id:
                    raise Refused("the mutations change nothing")
            except Refused as e:
                details["proposals_refused"].append({"attempt": attempt, "reason": e.reason, "answer": answer[:500]})
                log.info("harness-search proposal refused: %s", e.reason)
                continue
            details["mutations"] = applied.mutations
            if applied.executable:
                details["executable"] = applied.executable
            return applied.tree, "proposal", parent
        return None

    @staticmethod
    async def _episode(ctx: EpisodeContext, task: Task, files: dict[str, str], env: EpisodeEnv, **kw: Any) -> Episode:
        """One episode with its own scoped token: valid for the episode's time limit (and a margin for the sandbox's
        start), revoked when it ends, whatever the outcome."""
        token = ctx.scoped_token(env.scenario, task.time_limit_s + 60.0)
        try:
            return await run_episode(task, files, dataclasses.replace(env, token=token), **kw)
        finally:
            ctx.revoke_token(token)

    def _render(self, tree: dict[str, bytes]) -> dict[str, str]:
        from adapters import get_adapter

        return {p: d.decode("utf-8") for p, d in get_adapter(self.settings.adapter).render(tree).items()}

    async def _env(self, ctx: HarnessContext) -> EpisodeEnv:
        config = getattr(ctx, "config", None)
        scenario = getattr(ctx, "scenario", None)
        if config is None or scenario is None:
            raise BadRequest("harness-search needs the daemon's harness context (config, scenario) to run episodes")
        episodes = episodes_scenario(scenario)
        return EpisodeEnv(socket=config.scoped_socket_path, port=config.port, scenario=episodes,
                          agents_dir=config.agents_path, home=config.home, adapter=self.settings.adapter,
                          hide=tuple(self.settings.hide))

    @staticmethod
    def _per_task(tasks: list[Task], pairs: list[tuple[Episode, Episode]]) -> dict[str, dict[str, Any]]:
        out = {}
        for t in tasks:
            mine = [(c, b) for c, b in pairs if c.task == t.id]
            out[t.id] = {"candidate": sum(c.score for c, _ in mine) / len(mine),
                         "serving": sum(b.score for _, b in mine) / len(mine),
                         "wins": sum(c.score > b.score for c, b in mine),
                         "losses": sum(c.score < b.score for c, b in mine),
                         "candidate_status": [c.status for c, _ in mine], "serving_status": [b.status for _, b in mine],
                         "runs": {"candidate": [c.run for c, _ in mine], "serving": [b.run for _, b in mine]}}
        return out

    def _metrics(self, spend: dict[str, Any], details: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {**spend, "refused_proposals": len(details["proposals_refused"]),
                               "pool": len(self.pool.members)}
        for tid, v in (details.get("tasks") or {}).items():
            out[f"task.{tid}.candidate"] = round(v["candidate"], 4)
            out[f"task.{tid}.serving"] = round(v["serving"], 4)
        if details.get("mutations"):
            out["mutations"] = json.dumps(details["mutations"])[:2000]
        if details.get("proposals_refused"):
            out["refusals"] = json.dumps([r["reason"] for r in details["proposals_refused"]])[:2000]
        if details.get("origin"):
            out.update(origin=details["origin"], parent=details["parent"], candidate_id=details["candidate"],
                       serving_id=details["serving"])
        if details.get("not_run"):
            out["not_run"] = details["not_run"][:2000]
        if details.get("episodes"):
            out["episode_runs"] = json.dumps([
                {**{k: e[k] for k in ("task", "side", "repeat", "status", "run")},
                 **({"why": (e["check_output"] or e["output"])[-200:]} if e["status"] != "passed" else {})}
                for e in details["episodes"]])
        return out

    def status(self, releases: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The pool's Pareto front as the chain wrote it down (every judged tree's per-task means), and the spend."""
        tasks = [t.id for t in parse_tasks(self.settings.tasks)]
        pool = Pool(capacity=10_000)
        spent = {"episodes": 0, "proposer_calls": 0}
        for out in [*releases, *rejected]:
            m = out.get("metrics") or {}
            for k in spent:
                spent[k] += int(m.get(k) or 0)
            if "candidate_id" not in m:
                continue
            for side, mid, origin in (("serving", m["serving_id"], "serving"),
                                      ("candidate", m["candidate_id"], m.get("origin", "proposal"))):
                member = pool.members.setdefault(mid, Member(mid, {}, origin=origin))
                for t in tasks:
                    if isinstance(m.get(f"task.{t}.{side}"), (int, float)):
                        member.scores.setdefault(t, []).append(float(m[f"task.{t}.{side}"]))
        front = [{"id": f.id, "origin": f.origin, "tasks": f.task_means()} for f in pool.front(tasks)]
        return {"front": front, "judged": len(pool.members), "spent": spent}


def arms(s: HarnessSearchSettings) -> int:
    """The sides each task runs under: the serving tree and the candidate, and the base with ``base_arm``."""
    return 3 if s.base_arm else 2


def repeats_of(s: HarnessSearchSettings, tasks: int, sides: int = 2) -> int:
    """Episodes per task and side: ``repeats`` (all that ``max_episodes`` allows when unset), cut to fit it."""
    fit = max(1, s.max_episodes // (sides * tasks))
    return fit if s.repeats is None else max(1, min(s.repeats, fit))


def retirement(candidate: list[float], base: list[float], *, alpha: float | None) -> Verdict:
    """A retirement's verdict (the serving tree without one skill, ``candidate``, against the serving tree):
    rejected when its losses show the skill helps at error rate ``alpha`` (the sign test on losses), held when
    too few pairs ran to show a loss, published otherwise (the module docstring says why this way round)."""
    a, _ = gate_check("compare", alpha=alpha, margin=None)
    wins = sum(x > y for x, y in zip(candidate, base, strict=True))
    losses = sum(x < y for x, y in zip(candidate, base, strict=True))
    p = sign_test_p(losses, wins)
    metrics: dict[str, Any] = {
        "eval_reward": sum(candidate) / len(candidate), "base_reward": sum(base) / len(base), "wins": wins,
        "losses": losses, "p_value_loss": round(p, 6), "alpha": a, "pairs": len(candidate)}
    mean, lo, hi = paired_interval(candidate, base)
    metrics.update(diff=round(mean, 6), diff_ci95=[None if not math.isfinite(x) else round(x, 6) for x in (lo, hi)])
    if p <= a:
        return Verdict(False, "rejected", f"retirement: wins {wins} - losses {losses}: the skill helps (p = {p:.3g} "
                       f"<= alpha {a})", metrics)
    if len(candidate) < pairs_needed(a):
        return Verdict(False, "pending", f"retirement: cannot decide at error rate {a}: {len(candidate)} pair(s), at "
                       f"least {pairs_needed(a)} needed to show a loss; held for review: reef releases promote ID "
                       "publishes it", metrics)
    return Verdict(True, "accepted", f"retirement: wins {wins} - losses {losses}: no loss shown (p = {p:.3g} > alpha "
                   f"{a}), so the skill goes", metrics)


async def _first_tree(ctx: HarnessContext) -> dict[str, bytes] | None:
    """The chain's first release's tree (the base), where the context can say (the daemon's can)."""
    first = getattr(ctx, "first_tree", None)
    return None if first is None else await first()


def episodes_scenario(scenario: str) -> str:
    """The scenario an episode's requests are recorded in (recipe ``record``, the same model)."""
    import hashlib

    name = f"{scenario}-episodes"
    return name if len(name) <= 64 else f"{scenario[:40]}-episodes-{hashlib.sha1(scenario.encode()).hexdigest()[:8]}"
