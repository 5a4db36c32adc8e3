"""harness-search's retained evaluation (``recipes/harness_search/retained.py``): a step cut by a kill resumes with the
same candidate and the same pairs, running only what had not run; the paired deltas per task with a task-level
bootstrap interval; what it ran pinned in the metrics; an episode that could not run never a 0.

In-process: the episodes are a stand-in (``run_episode`` replaced: the real agent in its sandbox is
test_harness_search.py's, a minute a step), the "kill" an exception no recipe code catches, raised inside an
episode, and the restart a new recipe object reading the same memory file, as a new daemon process would."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from recipes.harness_search import HarnessSearch
from recipes.harness_search import recipe as hs
from recipes.harness_search.episodes import Episode, Task
from recipes.harness_search.pool import tree_id
from recipes.harness_search.retained import Progress, deltas, pins, suite_id

TASKS = [{"id": "a", "prompt": "greet", "check": "true"}, {"id": "b", "prompt": "sum", "check": "true"}]
PROPOSAL = json.dumps({"mutations": [{"op": "create", "kind": "rule", "id": "greet-in-french",
                                      "text": "Write greetings in French.", "reason": "the runs wanted French"}]})


class Killed(BaseException):
    """The process dying mid-episode: nothing in the recipe catches it."""


class Ctx:
    """The daemon's episode context, as the recipe uses it; ``answers`` counts the proposer's calls."""

    def __init__(self, home: Path) -> None:
        self.config = SimpleNamespace(home=home, scoped_socket_path=home / "scoped.sock", port=1, agents_path=home)
        self.scenario, self.model, self.answers = "s", "tiny", 0

    async def answer(self, model: Any, system: str, user: str, max_tokens: int, temperature: float = 0.0, *,
                     proposal: bool = False) -> str:
        self.answers += 1
        return PROPOSAL

    async def episode_release(self, name: str, tree: dict[str, bytes]) -> str:
        return "rel_" + tree_id(tree)[:8]

    def scoped_token(self, name: str, ttl_s: float) -> str:
        return "tok"

    def revoke_token(self, token: str) -> None:
        pass


def episodes(monkeypatch: pytest.MonkeyPatch, *, kill_at: int | None = None,
             not_run: set[tuple[int, str, str]] = frozenset()) -> list[tuple[int, str, str]]:  # type: ignore[assignment]
    """Replace ``run_episode``: the candidate (French in its rules) passes task a, the serving tree fails it; both
    pass b on even repeats. Returns the episodes run, in order; ``kill_at``: the episode (counted from 0) that dies;
    ``not_run``: (repeat, task, side) that cannot run (a sandbox error)."""
    ran: list[tuple[int, str, str]] = []

    async def run(task: Task, files: dict[str, str], env: Any, *, side: str, repeat: int, release_id: str) -> Episode:
        if kill_at is not None and len(ran) == kill_at:
            raise Killed()
        ran.append((repeat, task.id, side))
        if (repeat, task.id, side) in not_run:
            return Episode(task.id, side, repeat, 0.0, "error", output="the sandbox could not start")
        french = any("French" in text for text in files.values())
        score = float(french) if task.id == "a" else float(repeat % 2 == 0)
        return Episode(task.id, side, repeat, score, "passed" if score else "failed", run=f"run_{len(ran)}")

    monkeypatch.setattr(hs, "run_episode", run)
    return ran


def recipe() -> HarnessSearch:
    return HarnessSearch(HarnessSearch.parse_settings({"tasks": TASKS, "repeats": 3, "max_episodes": 12,
                                                       "retire_skills": False}))


TREE: dict[str, bytes] = {}


def test_a_step_killed_mid_evaluation_resumes_with_the_same_candidate_and_pairs(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    whole = episodes(monkeypatch)
    straight = asyncio.run(recipe().edit(TREE, [], Ctx(tmp_path / "straight")))  # type: ignore[arg-type]
    assert len(whole) == 12 and straight.eval is not None
    ran = episodes(monkeypatch, kill_at=5)
    ctx = Ctx(tmp_path / "killed")
    with pytest.raises(Killed):
        asyncio.run(recipe().edit(TREE, [], ctx))  # type: ignore[arg-type]
    assert len(ran) == 5 and ctx.answers == 1
    saved = json.loads((tmp_path / "killed" / "scenarios" / "s" / "harness-search.json").read_text())
    assert len(saved["progress"]["episodes"]) == 5  # each episode written down as it ended
    after = episodes(monkeypatch)
    again = recipe()  # a new process: the memory file is all it has
    resumed = asyncio.run(again.edit(TREE, [], ctx))  # type: ignore[arg-type]
    assert ctx.answers == 1  # the proposer is not asked again: the same candidate
    assert len(after) == 7 and not set(after) & set(ran)  # only what had not run
    assert resumed.tree == straight.tree and resumed.eval == straight.eval  # the same pairs, the same scores
    assert resumed.metrics["episodes_resumed"] == 5 and resumed.metrics["episodes"] == 7
    assert resumed.details["mutations"] == straight.details["mutations"]
    assert again.progress is None and json.loads(
        (tmp_path / "killed" / "scenarios" / "s" / "harness-search.json").read_text())["progress"] is None
    # each pair counted once in the pool, resumed or not
    assert again.pool.members[tree_id(resumed.tree or {})].scores == {"a": [1.0] * 3, "b": [1.0, 0.0, 1.0]}


def test_an_evaluation_against_another_head_or_a_damaged_one_starts_again(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    episodes(monkeypatch, kill_at=3)
    ctx = Ctx(tmp_path)
    with pytest.raises(Killed):
        asyncio.run(recipe().edit(TREE, [], ctx))  # type: ignore[arg-type]
    ran = episodes(monkeypatch)
    moved = {"AGENTS.md": b"# Rules\n\n## Lessons\n\n- Be brief.\n"}  # the head moved meanwhile
    out = asyncio.run(recipe().edit(moved, [], ctx))  # type: ignore[arg-type]
    assert ctx.answers == 2 and len(ran) == 12 and out.metrics.get("episodes_resumed") is None
    ctx = Ctx(tmp_path / "damaged")
    path = tmp_path / "damaged" / "scenarios" / "s" / "harness-search.json"
    episodes(monkeypatch, kill_at=3)
    with pytest.raises(Killed):
        asyncio.run(recipe().edit(TREE, [], ctx))  # type: ignore[arg-type]
    raw = json.loads(path.read_text())
    raw["progress"]["candidate"]["AGENTS.md"] = "tampered"
    path.write_text(json.dumps(raw))
    ran = episodes(monkeypatch)
    asyncio.run(recipe().edit(TREE, [], ctx))  # type: ignore[arg-type]
    assert ctx.answers == 2 and len(ran) == 12  # proposed and run again: a damaged entry is not trusted


def test_deltas_pins_and_episodes_that_could_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    episodes(monkeypatch, not_run={(1, "a", "candidate")})
    out = asyncio.run(recipe().edit(TREE, [], Ctx(tmp_path)))  # type: ignore[arg-type]
    m = out.metrics
    assert m["episodes_not_run"] == 1 and out.eval is not None and len(out.eval.candidate) == 5  # apart, not a 0
    assert out.details["task_deltas"] == {"a": 1.0, "b": 0.0} and m["delta"] == 0.5  # a: 2 pairs ran, both won
    assert m["delta_lo"] == 0.0 and m["delta_hi"] == 1.0  # two tasks: the bootstrap's mean is 0, 0.5 or 1
    assert (m["eval_suite"], m["eval_tasks"], m["eval_repeats"], m["eval_adapter"], m["eval_model"]) == (
        suite_id(hs.parse_tasks(TASKS)), 2, 3, "pi", "tiny")
    assert m["eval_serving"] == tree_id(TREE) and m["eval_candidate"] == tree_id(out.tree or {})


def test_the_bootstrap_resamples_tasks_and_the_suite_id_names_what_scores() -> None:
    def pair(task: str, c: float, s: float) -> tuple[Episode, Episode]:
        return Episode(task, "candidate", 0, c, "passed"), Episode(task, "serving", 0, s, "passed")

    many = [pair(t, 1.0, 0.0) for t in "abcd"] + [pair("e", 0.0, 1.0)] + [pair("a", 0.0, 0.0)] * 3
    got = deltas(many)
    assert got["task_deltas"] == {"a": 0.25, "b": 1.0, "c": 1.0, "d": 1.0, "e": -1.0}
    assert got["delta"] == 0.45 and got["delta_ci95"][0] < 0.45 < got["delta_ci95"][1] <= 1.0
    assert deltas(many) == got and deltas([]) == {"task_deltas": {}}  # the same pairs, the same interval
    assert deltas([pair("a", 1.0, 1.0)] * 4)["delta_ci95"] == [0.0, 0.0]
    base = [Task("a", "p", "true")]
    for other in ([Task("a", "p2", "true")], [Task("a", "p", "false")], [Task("b", "p", "true")],
                  [Task("a", "p", "true", time_limit_s=5)], [Task("a", "p", "true", workspace="/w")]):
        assert suite_id(other) != suite_id(base)
    assert suite_id([Task("a", "p", "true")]) == suite_id(base)
    assert pins(base, adapter="pi", model="m", serving="s1", candidate="c1", repeats=2)["eval_suite"] == suite_id(base)
    assert Progress.from_json(None) is None and Progress.from_json({"serving": "x"}) is None


def test_releases_show_and_the_release_page_read_the_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon.gate import describe

    episodes(monkeypatch, not_run={(1, "a", "candidate")})
    out = asyncio.run(recipe().edit(TREE, [], Ctx(tmp_path)))  # type: ignore[arg-type]
    verdict = recipe().judge(out, best=None)
    line = describe({**out.metrics, **verdict.metrics})
    assert line is not None and "per task +0.500 (tasks resampled, 95% +0.000 .. +1.000)" in line
    assert "1 episode(s) could not run (not scored)" in line and f"ran suite {out.metrics['eval_suite']} (2 task(s) x 3 " \
        "repeat(s)), pi on tiny" in line
    assert "per task" not in (describe({**verdict.metrics}) or "")  # a gate's figures alone: no evaluation line


class BaseCtx(Ctx):
    """A chain whose first release holds a rule the serving tree lost: task b passes under it."""

    async def first_tree(self) -> dict[str, bytes]:
        return {"AGENTS.md": b"# Rules\n\n## Lessons\n\n- [sum-first] Sum before you answer.\n"}


def test_the_base_arm_interleaves_the_first_release_and_reports_the_deltas_against_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[int, str, str]] = []

    async def run(task: Task, files: dict[str, str], env: Any, *, side: str, repeat: int, release_id: str) -> Episode:
        ran.append((repeat, task.id, side))
        text = " ".join(files.values())
        score = float("French" in text) if task.id == "a" else float("Sum before" in text)
        return Episode(task.id, side, repeat, score, "passed" if score else "failed")

    monkeypatch.setattr(hs, "run_episode", run)
    on = HarnessSearch(HarnessSearch.parse_settings({"tasks": TASKS, "max_episodes": 30, "base_arm": True,
                                                     "retire_skills": False}))
    out = asyncio.run(on.edit(TREE, [], BaseCtx(tmp_path / "on")))  # type: ignore[arg-type]
    assert out.metrics["eval_repeats"] == 5 and len(ran) == 30  # 30 episodes: 2 tasks x 5 repeats x 3 sides
    assert {side for _, _, side in ran} == {"serving", "candidate", "base"}
    firsts = [ran[k][2] for k in range(0, 30, 3)]  # each (repeat, task)'s first side turns
    assert len(set(firsts)) == 3
    assert out.details["task_deltas"] == {"a": 1.0, "b": 0.0}  # against the serving tree: French helps a
    assert out.details["base"]["task_deltas"] == {"a": 1.0, "b": -1.0}  # against the base: b was lost since
    assert out.metrics["delta_base"] == 0.0 and out.metrics["eval_base"] == out.details["base"]["release"]
    assert out.eval is not None and len(out.eval.candidate) == 10  # the gate still pairs candidate and serving
    ran.clear()
    off = asyncio.run(recipe().edit(TREE, [], BaseCtx(tmp_path / "off")))  # type: ignore[arg-type]
    assert {side for _, _, side in ran} == {"serving", "candidate"} and "base" not in off.details
    assert "delta_base" not in off.metrics
    ran.clear()
    same = asyncio.run(HarnessSearch(on.settings).edit(TREE, [], Ctx(tmp_path / "same")))  # type: ignore[arg-type]
    assert "base" not in same.details and {side for _, _, side in ran} == {"serving", "candidate"}  # no first tree

    class ServingIsBase(Ctx):
        async def first_tree(self) -> dict[str, bytes]:
            return dict(TREE)  # the head is the first release: a base arm would run the serving tree twice

    ran.clear()
    again = asyncio.run(HarnessSearch(on.settings).edit(TREE, [], ServingIsBase(tmp_path / "b")))  # type: ignore[arg-type]
    assert "base" not in again.details and {side for _, _, side in ran} == {"serving", "candidate"}
    assert again.metrics["eval_repeats"] == 7 and len(ran) == 28  # no distinct base: its share goes to the pairs


def test_a_base_arm_the_budget_cannot_pair_enough_is_refused() -> None:
    from daemon.errors import BadRequest

    HarnessSearch.parse_settings({"tasks": TASKS, "max_episodes": 12})  # 2 sides: 3 repeats, 6 pairs
    with pytest.raises(BadRequest, match="2 task\\(s\\) x 2 repeat\\(s\\)"):
        HarnessSearch.parse_settings({"tasks": TASKS, "max_episodes": 12, "base_arm": True})  # 3 sides: 4 pairs


def test_the_daemons_context_reads_the_first_releases_tree_and_the_page_line_says_it() -> None:
    from daemon.gate import describe
    from daemon.recipe_context import RecipeContext

    first, head = SimpleNamespace(tree={"AGENTS.md": b"first"}), SimpleNamespace(tree={"AGENTS.md": b"head"})
    chains = SimpleNamespace(history=None, harness_tree=None)

    async def history(name: str) -> list[Any]:
        assert name == "s"
        return chain

    async def harness_tree(rel: Any) -> dict[str, bytes]:
        return dict(rel.tree)

    chains.history, chains.harness_tree = history, harness_tree
    ctx = RecipeContext(None, "tiny", scenario="s", chains=chains)  # type: ignore[arg-type]
    chain = [head, first]  # newest first
    assert asyncio.run(ctx.first_tree()) == {"AGENTS.md": b"first"}
    chain = []
    assert asyncio.run(ctx.first_tree()) is None
    line = describe({"diff": 0.5, "diff_ci95": [0.0, 1.0], "pairs": 10, "eval_suite": "abc", "delta": 0.5,
                     "delta_lo": 0.0, "delta_hi": 1.0, "delta_base": -0.25, "delta_base_lo": -0.5,
                     "delta_base_hi": 0.0})
    assert line is not None and "against the first release -0.250 (95% -0.500 .. +0.000)" in line


def test_a_steps_episodes_are_said_before_it_starts() -> None:
    from recipes.online_rl import OnlineRL

    assert recipe().planned() == {"episodes": 12, "tasks": 2, "repeats": 3, "max_episodes": 12}
    unset = HarnessSearch(HarnessSearch.parse_settings({"tasks": TASKS, "max_episodes": 30, "base_arm": True}))
    assert unset.planned() == {"episodes": 30, "tasks": 2, "repeats": 5, "max_episodes": 30}  # three sides
    assert OnlineRL().planned() == {}
