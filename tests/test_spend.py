"""Learning spend (issue 49, daemon/spend.py): a weights scenario's ``max_trainer_hours`` (trainer hours per UTC
day) cuts the step that reaches it, written down as failed "cap reached", and holds the scenario's steps (state
``capped``, a ``train.capped`` event) until the next UTC day or a higher cap; the trainer time spent and the cost
per point of reward gained show in ``GET /reef/status`` and ``reef status``, and survive a restart (read from the
chain); a cap that is not a positive finite number is refused naming the setting. A real daemon on the tiny model
and online-rl over real sockets; the day's arithmetic and the chain's counting on their own."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from daemon import spend
from daemon.errors import BadRequest
from recipes import load_recipe
from tests.conftest import Daemon, assert_canonical_error
from tests.test_learning import releases, serve_and_report, settings_toml, wait_for

DAY = spend.DAY_S
MIDNIGHT = 20_000 * DAY  # a UTC midnight (2024-10-04T00:00:00Z)


def test_the_days_spend_counts_only_steps_since_utc_midnight() -> None:
    """A step written down a second before midnight counts for its day only; the cap applies per day, so a new day
    gives the whole budget back, and the total keeps every second. Bugs caught: a budget never given back (every
    step counted against today), or a day that starts anywhere but at UTC midnight."""
    s = spend.Spend()
    s.add(MIDNIGHT - 1, 100.0)  # yesterday, 23:59:59
    s.add(MIDNIGHT + 1, 30.0)  # today, 00:00:01
    s.add(MIDNIGHT + 3600, 20.0)
    settings = SimpleNamespace(max_trainer_hours=50 / 3600)  # 50 s a day
    now = MIDNIGHT + 7200
    assert s.today(now) == 50.0 and s.total() == 150.0
    assert s.remaining(settings, now) == 0.0
    assert s.view(settings, now)["capped"] and s.view(settings, now)["resumes_at"] == "2024-10-05T00:00:00Z"
    assert s.today(MIDNIGHT - 1) == 100.0  # yesterday, seen from yesterday
    assert s.remaining(settings, MIDNIGHT + DAY) == 50.0  # the next day: the whole budget back
    assert not s.view(settings, MIDNIGHT + DAY)["capped"]
    assert s.remaining(SimpleNamespace(max_trainer_hours=None), now) is None
    assert spend.day_start(MIDNIGHT + DAY - 0.5) == MIDNIGHT


def _entry(op: str, seconds: float | None, reward: float | None = None, at: float = MIDNIGHT) -> Any:
    metrics = {**({spend.KEY: seconds} if seconds is not None else {}),
               **({"batch_reward": reward} if reward is not None else {})}
    return SimpleNamespace(operation=op, metrics=metrics, created_at=at)


def test_the_chain_counts_each_trained_candidate_once_and_the_cost_per_point() -> None:
    """Trained releases, promoted held candidates, held ones and rejections each count their trainer seconds; a
    rollback (which copies an old release's metrics) does not. The cost per point: every trainer second over the
    gain, in hundredths, from the first released batch reward to the latest; none while nothing is gained."""
    history = [_entry("rollback", 40.0, 0.9, MIDNIGHT + 5), _entry("promote", 10.0, 0.6, MIDNIGHT + 4),
               _entry("train", 20.0, 0.5, MIDNIGHT + 3), _entry("init", None, None, MIDNIGHT)]  # newest first
    pending = [_entry("train", 5.0)]
    rejections = [_entry("failed", 7.0), _entry("rejected", 8.0), _entry("skipped", None)]
    s = spend.read(history, pending, rejections, "rel_x")
    assert s.total() == 50.0 and s.head == "rel_x"
    assert s.gained() == pytest.approx(0.1)
    assert s.cost_per_point() == pytest.approx(5.0)  # 50 s over +0.10: 5 s per +0.01
    flat = spend.read([_entry("train", 20.0, 0.5), _entry("train", 20.0, 0.5)], [], [], None)
    assert flat.cost_per_point() is None and flat.view(SimpleNamespace(), MIDNIGHT)["seconds_per_point"] is None
    worse = spend.read([_entry("train", 20.0, 0.4), _entry("train", 20.0, 0.5)], [], [], None)
    assert worse.gained() == pytest.approx(-0.1) and worse.cost_per_point() is None


@pytest.mark.parametrize("recipe", ["online-rl", "sao", "ttt-discover", "openclaw-rl"])
@pytest.mark.parametrize("bad", [0, -1, 0.0, float("inf"), float("nan"), "2", True])
def test_a_cap_that_is_not_a_positive_finite_number_is_refused_naming_it(recipe: str, bad: Any) -> None:
    with pytest.raises(BadRequest) as e:
        load_recipe(recipe).parse_settings({"max_trainer_hours": bad})
    assert e.value.data["param"] == "settings.max_trainer_hours" and "max_trainer_hours" in e.value.message


def test_every_weights_recipe_takes_the_cap_and_a_harness_recipe_does_not() -> None:
    for recipe in ("online-rl", "sao", "ttt-discover", "openclaw-rl"):
        assert load_recipe(recipe).parse_settings({"max_trainer_hours": 0.5}).max_trainer_hours == 0.5
        assert load_recipe(recipe).parse_settings({}).max_trainer_hours is None  # no cap by default
    with pytest.raises(BadRequest):
        load_recipe("lessons").parse_settings({"max_trainer_hours": 1})


def test_a_bad_cap_is_refused_at_create_and_update(daemon: Daemon) -> None:
    with daemon.http() as c:
        for bad in (0, -3, "1", True):
            r = c.post("/reef/scenarios", json={"name": "capbad", "recipe": "online-rl",
                                                "settings": {"max_trainer_hours": bad}})
            error = assert_canonical_error(r, 400)
            assert "max_trainer_hours" in error["message"] and error["param"] == "settings.max_trainer_hours", error
        assert c.get("/reef/scenarios/capbad").status_code == 404  # nothing was created
        assert c.post("/reef/scenarios", json={"name": "capok", "recipe": "online-rl",
                                               "settings": {"max_trainer_hours": 2}}).status_code == 201
        r = c.post("/reef/scenarios/capok/settings", json={"settings": {"max_trainer_hours": 0}})
        assert "max_trainer_hours" in assert_canonical_error(r, 400)["message"]
        assert c.get("/reef/scenarios/capok").json()["settings"]["max_trainer_hours"] == 2  # unchanged


def _events_until(c: httpx.Client, scenario: str, kind: str, n: int) -> list[dict[str, Any]]:
    """Every event on ``scenario`` from the daemon's history on, up to its ``n``-th of ``kind`` (or its second
    ``train.start``, which the caller's assertion then shows)."""
    out: list[dict[str, Any]] = []
    with c.stream("GET", "/reef/events", params={"after": 0}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("scenario") == scenario:
                    out.append(event)
                    if sum(e["kind"] == kind for e in out) == n or sum(e["kind"] == "train.start" for e in out) > 1:
                        return out
    raise AssertionError(f"the event stream ended before {n} {kind} events")


def test_a_cap_below_one_step_ends_it_as_failed_and_holds_the_scenario_until_raised(daemon_factory: Any) -> None:
    """A cap of 3.6 ms a day, far below one step: the first step is cut and written down as failed "cap reached"
    with its trainer seconds; the scenario is ``capped`` and a second batch starts no step (a ``train.capped`` event
    after its reports, and still one ``train.start``); a restart keeps the day's spend (read from the chain); a cap
    raised to 10 hours lets the held batch train and publish. Bugs caught: no cap check before a step, the cap's
    comparison flipped (here or in the trainer), a spend kept in memory only, a step never cut."""
    d: Daemon = daemon_factory(settings_toml())
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "capped", "recipe": "online-rl",
                                               "settings": {"max_trainer_hours": 1e-6}}).status_code == 201
        first = serve_and_report(c, "capped", 4)
        def first_step() -> dict[str, Any] | None:  # written down, or (a step never cut) published
            chain = releases(c, "capped", True)
            return chain if chain["rejected"] or len(chain["releases"]) > 1 else None

        chain = wait_for(first_step, what="the capped step written down")
        assert [r["operation"] for r in chain["releases"]] == ["init"], chain["releases"]
        failed = chain["rejected"][0]
        assert failed["verdict"] == "failed" and "cap reached" in failed["reason"], failed
        assert sorted(failed["receipts"]) == sorted(first) and failed["metrics"][spend.KEY] > 0.0036
        serve_and_report(c, "capped", 4)
        events = _events_until(c, "capped", "train.capped", 2)  # the second batch's reports woke it: held
        assert [e["kind"] for e in events].count("train.start") == 1, [e["kind"] for e in events]
        status = c.get("/reef/status").json()
        assert status["learning"]["capped"] == "capped"
        view = status["spend"]["capped"]
        assert view["capped"] and view["resumes_at"] and view["max_trainer_hours"] == 1e-6
        assert view["trainer_seconds_today"] == view["trainer_seconds_total"] == failed["metrics"][spend.KEY]
        assert [r["operation"] for r in releases(c, "capped")["releases"]] == ["init"]
    shown = d.cli("status").stdout
    assert "spend    capped:" in shown and "cap reached" in shown, shown
    d.stop()
    d.start()
    with d.http() as c:
        view = c.get("/reef/status").json()["spend"]["capped"]
        assert view["capped"] and view["trainer_seconds_today"] == failed["metrics"][spend.KEY], view
        assert c.post("/reef/scenarios/capped/settings",
                      json={"settings": {"max_trainer_hours": 10}}).status_code == 200
        chain = wait_for(lambda: (r := releases(c, "capped"))["releases"][0]["operation"] == "train" and r,
                         what="the held batch trained under the higher cap")
        head = chain["releases"][0]
        assert head["metrics"][spend.KEY] > 0 and len(releases(c, "capped", True)["rejected"]) == 1
        status = c.get("/reef/status").json()
        view = status["spend"]["capped"]
        assert not view["capped"] and status["learning"]["capped"] != "capped"
        assert view["trainer_seconds_total"] == pytest.approx(failed["metrics"][spend.KEY] + head["metrics"][spend.KEY])
    assert "spend    capped:" in d.cli("status").stdout


def test_without_a_cap_the_step_publishes_and_its_time_shows(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(settings_toml())
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "free", "recipe": "online-rl"}).status_code == 201
        serve_and_report(c, "free", 4)
        head = wait_for(lambda: (r := releases(c, "free"))["releases"][0]["operation"] == "train" and r,
                        what="a trained release")["releases"][0]
        view = c.get("/reef/status").json()["spend"]["free"]
        assert view["trainer_seconds_total"] == view["trainer_seconds_today"] == head["metrics"][spend.KEY] > 0
        assert view["max_trainer_hours"] is None and not view["capped"] and view["resumes_at"] is None
    assert "(no cap)" in d.cli("status").stdout


def test_the_trainer_stops_a_job_past_its_limit_once_and_never_retries_it(tiny_model: Path, tmp_path: Path) -> None:
    """``TrainerClient.run``'s limit (the cap's seconds left today): a job past it is stopped (its worker killed),
    fails with the limit's message, is not retried (no worker restarted for it) and leaves no candidate; its seconds
    are kept for the daemon. The next job, without a limit or under a generous one, trains on a fresh worker. Bugs
    caught: the limit's comparison flipped, a stopped job retried like a dead worker's."""
    from daemon.errors import StepFailed
    from daemon.trainer.worker import TrainerClient
    from tests.test_trainer_memory import job, records

    trainer = TrainerClient(threads=1)
    try:
        stopped = job(tiny_model, records(8, 8, 4), 1024, 1)
        with pytest.raises(StepFailed) as e:
            trainer._run(stopped, tmp_path / "stopped", (0.01, "cap reached: a test's limit"))
        assert e.value.message == "cap reached: a test's limit" and trainer.restarts == 0
        assert not (tmp_path / "stopped").exists() and trainer.seconds.pop(stopped.id) >= 0.01
        for n, limit in ((2, None), (3, (600.0, "never reached"))):
            made = trainer._run(job(tiny_model, records(8, 8, 4), 1024, n), tmp_path / f"job{n}", limit)
            assert made.path == str(tmp_path / f"job{n}") and (tmp_path / f"job{n}").is_dir()
        assert trainer.restarts == 1  # the stopped job's worker, replaced once for the next job
    finally:
        trainer.close()


# --- a harness scenario's proposer tokens (max_proposer_tokens) --------------------------------------------------


@pytest.mark.parametrize("recipe", ["lessons", "harness-search"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, "100", True])
def test_a_token_cap_that_is_not_a_positive_whole_number_is_refused_naming_it(recipe: str, bad: Any) -> None:
    base = ({"tasks": [{"id": "t1", "prompt": "Say hi.", "check": "true"}]} if recipe == "harness-search" else
            {"proposer": "tiny"})
    with pytest.raises(BadRequest) as e:
        load_recipe(recipe).parse_settings({**base, "max_proposer_tokens": bad})
    assert e.value.data["param"] == "settings.max_proposer_tokens" and "max_proposer_tokens" in e.value.message
    assert load_recipe(recipe).parse_settings({**base, "max_proposer_tokens": 1}).max_proposer_tokens == 1
    assert load_recipe(recipe).parse_settings(base).max_proposer_tokens is None  # no cap by default


def test_a_token_cap_on_lessons_without_a_proposer_is_refused_as_it_would_cap_nothing() -> None:
    """lessons calls a model only when ``proposer`` names one; a cap without it would be accepted and do nothing."""
    with pytest.raises(BadRequest) as e:
        load_recipe("lessons").parse_settings({"max_proposer_tokens": 1000})
    assert e.value.data["param"] == "settings.max_proposer_tokens" and "set proposer" in e.value.message
    assert load_recipe("lessons").parse_settings({"max_proposer_tokens": 1000, "proposer": "m"}).proposer == "m"


def test_the_days_proposer_tokens_come_from_every_outcome_on_the_chain() -> None:
    """Tokens count like trainer seconds: each outcome's own, today's only, a rollback's copy never; either cap
    reached holds the scenario. Bugs caught: tokens read from the trainer's key, a rollback counted twice, the
    token cap ignored by ``reached``."""
    def entry(op: str, tokens: int, at: float) -> Any:
        return SimpleNamespace(operation=op, metrics={spend.TOKENS: tokens}, created_at=at)

    s = spend.read([entry("rollback", 500, MIDNIGHT + 9), entry("train", 40, MIDNIGHT + 2),
                    entry("train", 7, MIDNIGHT - 1)], [], [entry("failed", 30, MIDNIGHT + 3)], None)
    settings = SimpleNamespace(max_proposer_tokens=70, max_trainer_hours=None)
    now = MIDNIGHT + 60
    assert s.today(now, spend.TOKENS) == 70 and s.today(now) == 0 and s.total() == 0
    assert s.tokens_left(settings, now) == 0 and s.reached(settings, now)
    view = s.view(settings, now)
    assert (view["proposer_tokens_today"], view["proposer_tokens_total"], view["capped"]) == (70, 77, True)
    assert not s.reached(SimpleNamespace(max_proposer_tokens=71, max_trainer_hours=None), now)
    assert not s.reached(settings, MIDNIGHT + DAY)  # a new day gives the tokens back
    assert s.tokens_left(SimpleNamespace(), now) is None


def test_a_proposer_call_past_the_days_tokens_ends_the_step_as_failed_and_holds_the_scenario(
        daemon_factory: Any) -> None:
    """A lessons scenario whose proposer is the served tiny model, with a cap of one token a day: in a batch of two
    lessons the first call runs (a call is refused only once the day's tokens are spent) and the second ends the
    step as failed "cap reached", its tokens written down; the scenario is then ``capped`` (a third report starts
    no step), its status counts the tokens, and a raised cap lets the next report learn. Bugs caught: a cap
    error swallowed as a failed proposal (the plain edit published), tokens not written down on failure, no cap
    check before a harness step."""
    d: Daemon = daemon_factory()
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "tok", "recipe": "lessons", "settings": {
            "proposer": "tiny", "max_proposer_tokens": 1}}).status_code == 201
        c.post("/reef/scenarios/tok/pause").raise_for_status()  # both reports in one batch
        first = serve_and_report(c, "tok", 2, score=lambda i: 0.0)
        for rec, text in zip(first, ("Always run the tests first.", "Keep every diff small."), strict=True):
            assert c.post("/reef/report", json={"score": 0.0, "feedback": text, "references": [rec]}).status_code \
                == 201
        c.post("/reef/scenarios/tok/resume").raise_for_status()
        chain = wait_for(lambda: ((x := releases(c, "tok", True))["rejected"] or len(x["releases"]) > 1) and x,
                         what="the capped step written down")
        assert [r["operation"] for r in chain["releases"]] == ["init"], chain["releases"]
        failed = chain["rejected"][0]
        assert failed["verdict"] == "failed" and "cap reached" in failed["reason"], failed
        assert "max_proposer_tokens 1" in failed["reason"]
        used = failed["metrics"][spend.TOKENS]
        assert used > 1
        status = c.get("/reef/status").json()
        view = status["spend"]["tok"]
        assert (view["proposer_tokens_today"], view["max_proposer_tokens"], view["capped"]) == (used, 1, True)
        third = serve_and_report(c, "tok", 1, score=lambda i: 0.0)
        c.post("/reef/report", json={"score": 0.0, "feedback": "Name the file you changed.", "references": third})
        events = _events_until(c, "tok", "train.capped", 1)
        assert [e["kind"] for e in events].count("train.start") == 1, [e["kind"] for e in events]
        assert c.get("/reef/status").json()["learning"]["tok"] == "capped"
        r = c.post("/reef/scenarios/tok/settings", json={"settings": {"proposer": "tiny",
                                                                      "max_proposer_tokens": 1_000_000}})
        assert r.status_code == 200, r.text
        published = wait_for(lambda: len((x := releases(c, "tok"))["releases"]) > 1 and x,
                             what="a step under the raised cap")
        head = published["releases"][0]
        assert head["metrics"][spend.TOKENS] > 0 and head["step"] == 1
        today = c.get("/reef/status").json()["spend"]["tok"]["proposer_tokens_today"]
        assert today == used + head["metrics"][spend.TOKENS]


def test_reef_status_and_the_tui_say_each_kind_of_spend() -> None:
    """``reef status`` prints a weights scenario's trainer time and a harness scenario's proposer tokens (a harness
    scenario that used none and has no cap: no line), and the TUI's scenarios table a cell for each; both say when a
    cap holds. Bugs caught: a harness scenario shown as 0 s of trainer time, a capped scenario not marked."""
    from reef_cli.status import _spend_lines
    from reef_cli.tui.format import spent

    weights = {"kind": "weights", "trainer_seconds_today": 12.0, "trainer_seconds_total": 40.0,
               "max_trainer_hours": None, "seconds_per_point": 3.5, "capped": False}
    harness = {"kind": "harness", "proposer_tokens_today": 1234, "proposer_tokens_total": 5000,
               "max_proposer_tokens": 2000, "capped": True, "resumes_at": "2026-12-08T00:00:00Z"}
    idle = {"kind": "harness", "proposer_tokens_today": 0, "proposer_tokens_total": 0, "max_proposer_tokens": None}
    lines = _spend_lines({"w": weights, "h": harness, "pi": idle})
    assert lines == [
        "spend    h: 1234 proposer tokens today of max_proposer_tokens 2000, 5000 in all; cap reached: no step until "
        "2026-12-08T00:00:00Z or a higher cap",
        "spend    w: 12.0 s trainer time today (no cap), 40.0 s in all; 3.5 s per +0.01 batch reward"]
    assert (spent(weights), spent(harness), spent(idle), spent(None)) == ("12 s, 4 s/+0.01", "1,234 tok capped", "-",
                                                                          "-")


async def test_a_proposer_call_is_refused_once_the_days_tokens_are_spent_and_others_never() -> None:
    """The context the learning loop lends a harness step: a proposer call runs while the step's tokens are under
    what the day has left, each call's prompt and answer tokens counted and handed to the loop; a call made at the
    limit exactly is refused with the cap's message; a call that is not a proposal (a task scored for the gate)
    is neither refused nor counted. Bugs caught: ``>`` for ``>=`` (one call too many), answer tokens left out, the
    gate's own calls charged to the proposer."""
    from daemon.errors import CapReached
    from daemon.exchange import Completion, Finish, Usage
    from daemon.recipe_context import RecipeContext

    class Engine:
        async def generate(self, exchange: Any, release: Any) -> Any:
            yield Finish(Completion(text="Keep diffs small.", usage=Usage(input_tokens=7, output_tokens=3)))

    async def engine(name: str) -> Any:
        return Engine()

    told: list[int] = []
    ctx = RecipeContext(engine, "tiny", tokens_left=(20.0, "cap reached: a test's"), spent=told.append)
    assert await ctx.answer(None, "sys", "a lesson", 16, proposal=True) == "Keep diffs small."
    assert await ctx.answer(None, "rules", "a task", 16) == "Keep diffs small."  # the gate's: not counted
    assert await ctx.answer(None, "sys", "a lesson", 16, proposal=True) == "Keep diffs small."
    assert (ctx.proposer_tokens, told) == (20, [10, 10])
    with pytest.raises(CapReached, match="cap reached: a test's"):
        await ctx.answer(None, "sys", "a third lesson", 16, proposal=True)
    assert await ctx.answer(None, "rules", "a task", 16) == "Keep diffs small."  # never refused
    free = RecipeContext(engine, "tiny")  # no cap
    for _ in range(5):
        await free.answer(None, "sys", "a lesson", 16, proposal=True)
    assert free.proposer_tokens == 50


async def test_harness_search_lets_the_cap_end_its_step_where_a_failing_proposer_is_only_a_refused_proposal() -> None:
    """harness-search asks its proposer up to ``max_proposer_calls`` times, a proposer that fails being a refused
    proposal and the next call tried; the cap is not such a failure: it ends the step at once. Bug caught: the
    cap's error swallowed by the proposer's ``except Exception`` (a step that goes on calling past the cap)."""
    from daemon.errors import CapReached
    from recipes.harness_search.recipe import HarnessSearch

    recipe = HarnessSearch(HarnessSearch.parse_settings({"tasks": [{"id": "t1", "prompt": "Say hi.", "check": "true"}],
                                                         "max_proposer_calls": 3}))
    calls: list[bool] = []

    class Ctx:
        async def answer(self, model: Any, system: str, user: str, max_tokens: int, temperature: float = 0.0, *,
                         proposal: bool = False) -> str:
            calls.append(proposal)
            raise CapReached("cap reached: a test's") if len(calls) > 1 else RuntimeError("the proposer is down")

    serving = recipe.pool.add({"AGENTS.md": b"# Rules\n"}, origin="serving")
    spent: dict[str, Any] = {"proposer_calls": 0, "episodes": 0, "proposer_s": 0.0, "episode_s": 0.0}
    details: dict[str, Any] = {"proposals_refused": [], "mutations": []}
    with pytest.raises(CapReached):
        await recipe._propose(serving, [], Ctx(), spent, details)  # type: ignore[arg-type]
    assert calls == [True, True] and len(details["proposals_refused"]) == 1


async def test_an_edit_redone_on_a_moved_head_gets_only_what_its_first_attempt_left() -> None:
    """A harness edit is redone when the head moved under it (``Learner.step``); its first attempt's tokens are not
    on the chain yet, so what the redo may spend is the day's tokens left less them. Bug caught: the redo given the
    whole day's remainder again (a step that spends past its cap once per redo)."""
    import time

    from daemon import learning_spend

    st = SimpleNamespace(name="h", recipe=SimpleNamespace(settings=SimpleNamespace(max_proposer_tokens=100)),
                         spend=spend.Spend(head="r1", tokens=[(time.time(), 30.0)]), spend_gen=0, proposer_tokens=50)

    class Chains:
        async def head_id(self, name: str) -> str:
            return "r1"

    left = await learning_spend.tokens_left(SimpleNamespace(chains=Chains()), st)  # type: ignore[arg-type]
    assert left is not None and left[0] == 20 and "max_proposer_tokens 100" in left[1]
    st.proposer_tokens = 90
    assert (await learning_spend.tokens_left(SimpleNamespace(chains=Chains()), st))[0] == 0  # type: ignore[arg-type,index]
    st.recipe.settings = SimpleNamespace()
    assert await learning_spend.tokens_left(SimpleNamespace(chains=Chains()), st) is None  # type: ignore[arg-type]
