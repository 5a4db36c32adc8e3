"""``reef eval`` (``daemon/evaluation.py``, ``reef_cli/evaluation.py``): per release, the held-out reward (the
learning curve), probe accuracy against the base (forgetting) and transfer.

In-process, against a stand-in engine whose answers depend on the release asked (so a figure read from the wrong
release is a wrong number): the curve rises and falls at the right rows, a figure the gate recorded is read and
one recorded under other settings is measured again, a second eval measures nothing (the cache), a failing engine
gives ``failed: reason`` (never a number, never cached). Through a real daemon and the tiny model: the reported
reward on reserved prompts per release, a release that answers nothing (crafted weights, promoted past the
held-out check) loses probe accuracy and transfer against the base, ``--json``'s shape, the table, the release
page's section, and unknown scenarios refused with their exit codes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.engines.base import Engine
from daemon.errors import BadRequest, EngineError, NotFound
from daemon.evaluation import Evaluations, cell
from daemon.gating.heldout import shipped_probes
from recipes import load_recipe
from recipes.tasks import get_family

FAMILY = get_family("say")
TASKS = FAMILY.validation(8, seed=0)
SETTINGS = {"eval_family": "say", "eval_n": 8}


def _make_recipe(recipe: str, settings: dict[str, Any]) -> Any:
    cls = load_recipe(recipe)
    return cls(cls.parse_settings(settings))


def _today() -> dict[str, Any]:
    from dataclasses import asdict

    return {"recipe": "online-rl", **asdict(_make_recipe("online-rl", SETTINGS).settings)}


class _Engine:
    """Answers by the content asked: ``good`` every task and probe right, ``half`` the first half of the tasks and
    every probe, ``silent`` nothing at all. What it was asked, by content."""

    answer_many = Engine.answer_many  # the default path: each answer a request

    def __init__(self, behaviour: dict[str, str], fail: str | None = None) -> None:
        self.behaviour, self.fail = behaviour, fail
        self.asked: list[tuple[str, str]] = []
        self.unloaded: list[str] = []
        self.resident: dict[str, str] = {}
        self.answers = {t.prompt: t.answer for t in TASKS} | {p.prompt: p.accept[0] for p in shipped_probes()}
        self.index = {t.prompt: i for i, t in enumerate(TASKS)}

    async def generate(self, exchange: Any, release: Any) -> Any:
        from daemon.exchange import Completion, Finish

        if self.fail:
            raise EngineError(self.fail)
        prompt = exchange.messages[-1].text
        content = release.content_id.removeprefix("eval:")
        self.asked.append((content, prompt))
        how = self.behaviour[content]
        right = how == "good" or (how == "half" and self.index.get(prompt, 0) < len(TASKS) // 2)
        text = "" if how == "silent" else self.answers[prompt] if right else "something else entirely"
        yield Finish(Completion(text=text, prompt_token_ids=[1], token_ids=[5, 6, 2] if text else [2],
                                logprobs=[-0.1] * (3 if text else 1)))

    async def unload(self, release: Any) -> None:
        self.unloaded.append(release.release_id)


def _rel(step: int, content: str, parent: str | None, metrics: dict[str, Any] | None = None,
         settings: dict[str, Any] | None = None, operation: str = "train") -> Any:
    return SimpleNamespace(release_id=f"rel_{step}", content_id=content, step=step, parent=parent,
                           operation=operation if step else "init", kind="weights", metrics=metrics or {},
                           settings=settings or {}, created_at=float(step))


def _evaluations(tmp_path: Path, engine: Any, chain: list[Any], recipe: str = "online-rl",
                 settings: dict[str, Any] | None = None) -> tuple[Evaluations, list[Any]]:
    scenario = SimpleNamespace(name="s", recipe=recipe, model="tiny", settings=SETTINGS if settings is None else settings)
    events: list[Any] = []

    async def get_scenario(name: str) -> Any:
        if name != "s":
            raise NotFound(f"no scenario named {name!r}")
        return scenario

    async def history(name: str, limit: int | None = None) -> list[Any]:
        return chain[::-1]

    async def head_id(name: str) -> str:
        return str(chain[-1].release_id)

    async def head(scen: Any) -> Any:
        return chain[-1]

    async def ref(scen: Any, rel: Any) -> Any:
        from daemon.engines.base import ReleaseRef

        return ReleaseRef(rel.release_id, rel.content_id, tmp_path / rel.content_id)

    async def scored(name: str, after: int = 0) -> Any:
        return [], 0

    async def get_engine(model: str) -> Any:
        return engine

    store = SimpleNamespace(scenarios=SimpleNamespace(get=get_scenario),
                            reports=SimpleNamespace(scored_exchanges=scored))
    chains = SimpleNamespace(history=history, head_id=head_id, head=head, ref=ref)
    bus = SimpleNamespace(publish=lambda kind, **data: events.append((kind, data)))
    return Evaluations(tmp_path, store, chains, bus, get_engine, _make_recipe), events


def _chain() -> list[Any]:
    """base (half the tasks) -> step 1 (all: its gate recorded 1.0) -> step 2 (half again; its gate's figure was
    made under other settings: measured again) -> step 3 (answers nothing) -> step 4, a rollback to step 1's
    content, carrying step 1's metrics (whose base_reward is the base's, not step 3's)."""
    today = _today()
    n = len(shipped_probes())
    # its check passed step 1 on half the probes (0.5 there): not its accuracy on all of them; step 2's on all stands
    good = {"eval_reward": 1.0, "base_reward": 0.5, "heldout_probe_accuracy": 0.5, "heldout_probes": n // 2}
    return [_rel(0, "c_base", None),
            _rel(1, "c_good", "rel_0", good, today),
            _rel(2, "c_half", "rel_1", {"eval_reward": 0.9, "heldout_probe_accuracy": 1.0, "heldout_probes": n},
                 {**today, "eval_n": 64}),
            _rel(3, "c_silent", "rel_2"),
            _rel(4, "c_good", "rel_3", good, today, operation="rollback")]


BEHAVIOUR = {"c_base": "half", "c_good": "good", "c_half": "half", "c_silent": "silent"}


def test_the_curve_rises_and_falls_at_the_right_rows_and_gate_figures_are_read(tmp_path: Path) -> None:
    engine = _Engine(BEHAVIOUR)
    ev, events = _evaluations(tmp_path, engine, _chain())
    progress: list[dict[str, Any]] = []

    async def note(p: dict[str, Any]) -> None:
        progress.append(p)

    out = asyncio.run(ev.evaluate("s", progress=note))
    rows = out["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["reward"]["value"] for r in rows] == [0.5, 1.0, 0.5, 0.0, 1.0]  # up, down, down, back up
    # the base's and step 1's reward are the gate's (step 1's own, the base's from step 1's base_reward); step 2's
    # gate figure (0.9) was made on 64 tasks, not today's 8: measured again; step 3's child is a rollback whose
    # base_reward is not step 3's: measured; the rollback's own (its content's) is read
    assert [r["reward"]["source"] for r in rows] == ["gate", "gate", "measured", "measured", "gate"]
    assert not [p for c, p in engine.asked if c == "c_good" and p in engine.index]  # its reward was not asked
    assert [r["probes"]["value"] for r in rows] == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert [r["probes"]["source"] for r in rows] == ["measured", "measured", "gate", "measured", "cached"]
    assert [r["forgetting"]["value"] for r in rows] == [0.0, 0.0, 0.0, -1.0, 0.0]
    assert rows[3]["transfer"] == {"status": "n/a", "reason": "no transfer scenario asked (--transfer OTHER)"}
    assert rows[4]["head"] and not rows[3]["head"] and out["base"]["release_id"] == "rel_0"
    # c_good is measured once (its probes), for step 1; the rollback to it reads that figure from the cache
    assert sorted(engine.unloaded) == ["eval:c_base", "eval:c_good", "eval:c_half", "eval:c_silent"]  # c_half: reward
    assert rows[4]["probes"]["source"] == "cached" and out["cached"] == 1
    assert [p["step"] for p in progress] == [0, 1, 2, 3] and progress[0]["measuring"] == ["probes"]
    states = [e[1]["state"] for e in events if e[0] == "eval"]
    assert states == ["started", *["measuring"] * 4, "done"]
    # --last 2: two rows, against the same base
    last = asyncio.run(ev.evaluate("s", last=2))
    assert [r["step"] for r in last["rows"]] == [3, 4] and last["rows"][0]["forgetting"]["value"] == -1.0


def test_a_second_eval_measures_nothing(tmp_path: Path) -> None:
    engine = _Engine(BEHAVIOUR)
    ev, _ = _evaluations(tmp_path, engine, _chain())
    first = asyncio.run(ev.evaluate("s"))
    asked = len(engine.asked)
    ev2, _ = _evaluations(tmp_path, engine, _chain())  # a restarted daemon: the cache is the file's
    again = asyncio.run(ev2.evaluate("s"))
    assert len(engine.asked) == asked and again["measured"] == 0 and again["cached"] == first["measured"] + first["cached"] > 1
    assert [r["reward"]["value"] for r in again["rows"]] == [r["reward"]["value"] for r in first["rows"]]
    assert [r["probes"]["source"] for r in again["rows"]] == ["cached", "cached", "gate", "cached", "cached"]
    known = asyncio.run(ev2.evaluate("s", measure=False))  # GET: what is known, the cache included
    assert known["rows"] == again["rows"]


def test_what_is_not_known_says_so_without_measuring(tmp_path: Path) -> None:
    engine = _Engine(BEHAVIOUR)
    ev, _ = _evaluations(tmp_path, engine, _chain())
    out = asyncio.run(ev.evaluate("s", measure=False))
    assert engine.asked == [] and out["measured"] == 0
    assert out["rows"][1]["reward"]["value"] == 1.0  # recorded at the gate
    assert out["rows"][3]["probes"] == {"status": "n/a", "reason": "not measured yet (reef eval measures it)"}
    assert cell(out["rows"][3]["probes"]) == "n/a"


def test_a_failing_engine_gives_failed_with_the_reason_never_a_number(tmp_path: Path) -> None:
    engine = _Engine(BEHAVIOUR, fail="model tiny is not loaded")
    ev, _ = _evaluations(tmp_path, engine, _chain())
    out = asyncio.run(ev.evaluate("s"))
    step3 = out["rows"][3]
    assert step3["probes"] == {"status": "failed", "reason": "model tiny is not loaded"}
    assert step3["reward"] == {"status": "failed", "reason": "model tiny is not loaded"}
    assert step3["forgetting"]["status"] == "failed" and "value" not in step3["forgetting"]
    assert cell(step3["probes"]) == "failed: model tiny is not loaded"
    assert out["rows"][1]["reward"] == {"status": "ok", "value": 1.0, "n": 8, "source": "gate"}  # recorded: stands
    assert out["measured"] == 0 and not (tmp_path / "eval" / "cache.json").exists()  # nothing cached: tried again
    engine.fail = None
    again = asyncio.run(ev.evaluate("s"))["rows"]
    assert [r["probes"]["value"] for r in again] == [1.0, 1.0, 1.0, 0.0, 1.0]


class _RulesEngine:
    """The scenario's model as a harness release's probes ask it: every probe right, unless the system prompt (the
    release's rules) says ``say nothing``. What it was asked: (release, system prompt)."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, str]] = []
        self.resident: dict[str, str] = {}
        self.answers = {p.prompt: p.accept[0] for p in shipped_probes()}

    async def answer_many(self, exchanges: list[Any], release: Any = None) -> list[Any]:
        from daemon.exchange import Completion

        out = []
        for e in exchanges:
            system = e.messages[0].text if e.messages[0].role == "system" else ""
            self.asked.append((release, system))
            text = "" if "say nothing" in system else self.answers[e.messages[-1].text]
            out.append(Completion(text=text, prompt_token_ids=[1], token_ids=[5, 2] if text else [2]))
        return out

    async def unload(self, release: Any) -> None:
        raise AssertionError("a harness release loads no weights")


def test_a_harness_chains_probes_are_asked_under_each_releases_rules(tmp_path: Path) -> None:
    """A harness release's probes: the scenario's model under its rules file, read from the held-out check where it
    asked every probe, measured where not; forgetting against the base's; its reward the gate's recorded score."""
    n = len(shipped_probes())
    harness = [SimpleNamespace(**{**vars(_rel(0, "h0", None)), "kind": "harness"}),
               SimpleNamespace(**{**vars(_rel(1, "h1", "rel_0", {"eval_reward": 0.75, "heldout_probes": n,
                                                                 "heldout_probe_accuracy": 0.5},
                                              settings={"recipe": "lessons", **vars(_make_recipe("lessons", {}).settings)})),
                                  "kind": "harness"}),
               SimpleNamespace(**{**vars(_rel(2, "h2", "rel_1")), "kind": "harness"})]
    trees = {"h0": {}, "h1": {"AGENTS.md": b"- be kind"}, "h2": {"AGENTS.md": b"- say nothing at all"}}
    engine = _RulesEngine()
    ev, _ = _evaluations(tmp_path, engine, harness, recipe="lessons", settings={})

    async def harness_tree(rel: Any) -> dict[str, bytes]:
        return trees[rel.content_id]

    ev.chains.harness_tree = harness_tree
    out = asyncio.run(ev.evaluate("s"))
    rows = out["rows"]
    assert out["kind"] == "harness" and rows[1]["reward"] == {"status": "ok", "value": 0.75, "n": 0, "source": "gate"}
    assert rows[0]["reward"] == {"status": "n/a", "reason": "no gate score recorded for it"}
    assert [(r["probes"]["value"], r["probes"]["source"]) for r in rows] == [(1.0, "measured"), (0.5, "gate"),
                                                                            (0.0, "measured")]
    assert [r["forgetting"]["value"] for r in rows] == [0.0, -0.5, -1.0]
    assert {s for _, s in engine.asked} == {"", "- say nothing at all"} and {r for r, _ in engine.asked} == {None}
    assert len(engine.asked) == 2 * n and rows[2]["transfer"]["reason"] == "a harness release: transfer asks weights"
    engine.asked.clear()
    assert [r["probes"]["source"] for r in asyncio.run(ev.evaluate("s"))["rows"]] == ["cached", "gate", "cached"]
    assert engine.asked == []
    # the same rules asked of another model are another figure: the cache is keyed by the model too
    plan = asyncio.run(ev._plan(SimpleNamespace(name="s", recipe="lessons", model="tiny", settings={}), None))
    other = asyncio.run(ev._plan(SimpleNamespace(name="s", recipe="lessons", model="big", settings={}), None))
    assert plan.probes is not None and other.probes is not None and plan.probes.key("h2") != other.probes.key("h2")


def test_what_cannot_be_had_says_why(tmp_path: Path) -> None:
    """Weights without a scorer and with nothing held out: no reward; a recipe that does not learn: none."""
    ev, _ = _evaluations(tmp_path / "w", _Engine(BEHAVIOUR), _chain(), settings={"heldout_check": False})
    out = asyncio.run(ev.evaluate("s", last=1))
    assert out["rows"][0]["reward"] == {"status": "n/a", "reason": "nothing is held out (heldout_check is off), "
                                                                   "and the recipe has no scorer"}
    assert out["rows"][0]["probes"]["value"] == 1.0  # the probes need no held-out share
    ev, events = _evaluations(tmp_path / "r", _Engine(BEHAVIOUR), _chain()[:2], recipe="record", settings={})
    out = asyncio.run(ev.evaluate("s", measure=False))  # a look: no event
    assert out["kind"] == "weights" and out["rows"][1]["reward"]["reason"] == "recipe record does not learn: no reward"
    assert out["rows"][1]["probes"]["reason"] == "not measured yet (reef eval measures it)" and events == []


def test_unknown_scenarios_and_bad_arguments_are_refused(tmp_path: Path) -> None:
    ev, _ = _evaluations(tmp_path, _Engine(BEHAVIOUR), _chain())
    with pytest.raises(NotFound):
        asyncio.run(ev.evaluate("nope"))
    for transfer in ("elsewhere", "s"):
        with pytest.raises(BadRequest) as e:
            asyncio.run(ev.evaluate("s", transfer=transfer))
        assert e.value.data["param"] == "transfer"
    with pytest.raises(BadRequest):
        asyncio.run(ev.evaluate("s", last=0))


def test_cells() -> None:
    assert cell({"status": "ok", "value": 0.25, "n": 3, "source": "gate"}) == "0.25"
    assert cell({"status": "ok", "value": -0.5, "n": 3, "source": "x"}, signed=True) == "-0.50"
    assert cell({"status": "failed", "reason": "boom"}) == "failed: boom"
    assert cell({"status": "n/a", "reason": "why"}) == cell(None) == "n/a"
    assert json.loads(json.dumps({"status": "n/a"}))  # figures are plain JSON


# --- through a daemon -------------------------------------------------------------------------------------------

from daemon.gating.heldout import reserved  # noqa: E402
from tests.test_heldout import _crafted  # noqa: E402
from tests.test_learning import releases, wait_for  # noqa: E402
from tests.test_recipes import recipe_dir  # noqa: E402,F401 - the fixture, used by name


def _ask(c: Any, name: str, text: str, max_tokens: int = 2) -> tuple[str, list[int]]:
    """Serve ``text`` on scenario ``name`` (greedy): its receipt and prompt tokens."""
    r = c.post(f"/s/{name}/v1/chat/completions", json={"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
                                                       "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    receipt = r.headers["x-reef-agent-record-id"]
    return receipt, c.get(f"/reef/records/{receipt}").json()["prompt_token_ids"]


def _split(c: Any, name: str, share: float, n: int, start: int = 0) -> tuple[list[str], list[str]]:
    """Asked until ``n`` prompts of each kind: receipts of reserved prompts (held out), and of the others."""
    held: list[str] = []
    trained: list[str] = []
    i = start
    while len(held) < n or len(trained) < n:
        receipt, ids = _ask(c, name, f"Tell me about item {i}.")
        (held if reserved(ids, share) else trained).append(receipt)
        i += 1
    return held[:n], trained[:n]


def _score(c: Any, receipts: list[str], score: float) -> None:
    for rec in receipts:
        assert c.post("/reef/report", json={"references": [rec], "score": score}).status_code == 201


def test_the_reported_reward_per_release_rises_and_falls_and_the_page_shows_it(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _crafted(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "curve", "recipe": "crafted:Crafted",
                                               "settings": {"silent": False, "heldout_share": 0.5}})
        assert made.status_code == 201, made.text
        at = 0
        for step, score in ((1, 0.2), (2, 0.9), (3, 0.4)):
            held, trained = _split(c, "curve", 0.5, 2, at)
            at += 40
            _score(c, held, score)  # what the user's scorer said of this release's answers to held-out prompts
            if step < 3:
                _score(c, trained, 1.0)  # a batch: the next release
                wait_for(lambda s=step: releases(c, "curve")["releases"][0]["step"] == s, what=f"release {step}")
        chain = releases(c, "curve")["releases"][::-1]
        assert [r["operation"] for r in chain] == ["init", "train", "train"]
    out = json.loads(d.cli("eval", "-s", "curve", "--json").stdout)
    assert set(out) >= {"scenario", "recipe", "kind", "head", "base", "rows", "reward_how", "probes_how",
                        "transfer", "measured", "cached", "seconds"}
    rows = out["rows"]
    assert [r["release_id"] for r in rows] == [r["release_id"] for r in chain]
    assert [r["reward"] for r in rows] == [{"status": "ok", "value": v, "n": 2, "source": "reports"}
                                           for v in (0.2, 0.9, 0.4)]
    for r in rows:
        assert set(r) >= {"release_id", "step", "operation", "head", "reward", "probes", "forgetting", "transfer"}
        # the check's figure where it asked every probe; where it passed a release on half of them: measured
        assert r["probes"]["status"] == "ok" and r["probes"]["n"] == len(shipped_probes()), r
        assert r["transfer"]["status"] == "n/a"
    assert rows[0]["forgetting"]["value"] == 0 and rows[2]["head"]
    table = d.cli("eval", "-s", "curve").stdout
    lines = [line for line in table.splitlines() if line.strip()[:1] in ("*", "b") or " train " in line]
    assert [("0.20" in lines[0]), ("0.90" in lines[1]), ("0.40" in lines[2])] == [True] * 3, table
    assert "scores reported on the reserved recorded prompts" in table, table
    known = json.loads(d.cli("eval", "-s", "curve", "--known", "--json").stdout)  # measured before: cached now
    assert [(r["reward"], r["probes"]["value"]) for r in known["rows"]] == [(r["reward"], r["probes"]["value"])
                                                                             for r in rows]
    assert known["measured"] == 0
    page = d.cli("releases", "open", chain[1]["release_id"], "--no-browser").stdout.strip().split()[-1]
    html = Path(page).read_text(encoding="utf-8")
    assert 'id="eval"' in html and "0.90" in html and "held-out reward" in html


def test_a_release_that_answers_nothing_forgets_against_the_base(daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _crafted(daemon_factory, recipe_dir)
    with d.http() as c:
        # probes the base answers right: its own greedy answers (at 32 tokens the tiny model says something)
        assert c.post("/reef/scenarios", json={"name": "src"}).status_code == 201
        probes = []
        for i in range(16):
            text = f"Name thing number {i}."
            answer = c.post("/s/src/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "user", "content": text}]}).json()["choices"][0]["message"]["content"]
            words = sorted({w for w in answer.split() if any(ch.isalnum() for ch in w)})
            if words:
                probes.append({"prompt": text, "accept": words})
        assert len(probes) >= 8, probes
        # the transfer scenario: recorded prompts, half of them reserved (batches of 32: never trains here)
        assert c.post("/reef/scenarios", json={"name": "other", "recipe": "online-rl",
                                               "settings": {"heldout_share": 0.5}}).status_code == 201
        held, _ = _split(c, "other", 0.5, 3)
        _score(c, held, 1.0)
        made = c.post("/reef/scenarios", json={"name": "forgets", "recipe": "crafted:Crafted", "settings": {
            "heldout_max_tokens": 32, "heldout_probes": probes}})
        assert made.status_code == 201, made.text
        base = made.json()["head"]
        _score(c, [_ask(c, "forgets", "hi")[0] for _ in range(2)], 1.0)
        silent = wait_for(lambda: releases(c, "forgets", True)["pending"], what="the silent candidate held")[0]
    d.cli("releases", "promote", "-s", "forgets", silent["release_id"], "--yes")  # served anyway, by hand
    known = json.loads(d.cli("eval", "-s", "forgets", "--known", "--json").stdout)  # measures nothing
    assert known["rows"][0]["probes"] == {"status": "n/a", "reason": "not measured yet (reef eval measures it)"}
    assert known["measured"] == 0 and known["rows"][1]["probes"]["source"] == "gate"
    first = json.loads(d.cli("eval", "-s", "forgets", "--transfer", "other", "--json").stdout)
    rows = first["rows"]
    assert [r["operation"] for r in rows] == ["init", "promote"] and rows[0]["release_id"] == base
    assert rows[0]["probes"]["source"] == "measured" and rows[0]["probes"]["value"] >= 0.5, rows[0]
    assert rows[1]["probes"]["value"] == 0.0 and rows[1]["forgetting"]["value"] <= -0.5, rows[1]
    assert rows[0]["transfer"]["n"] == 3 and rows[1]["transfer"] == {"status": "ok", "value": 0.0, "n": 3,
                                                                     "source": "measured"}
    assert rows[0]["transfer"]["value"] > 0, rows[0]
    assert rows[1]["reward"]["status"] == "n/a" and "no reported answer" in rows[1]["reward"]["reason"]
    again = json.loads(d.cli("eval", "-s", "forgets", "--transfer", "other", "--json").stdout)
    assert again["measured"] == 0 and again["cached"] == first["measured"] >= 3
    assert [r["probes"]["value"] for r in again["rows"]] == [r["probes"]["value"] for r in rows]
    missing = d.cli("eval", "-s", "nope", check=False)
    assert missing.returncode == 4 and "no scenario named 'nope'" in missing.stderr, missing.stderr
    other = d.cli("eval", "-s", "forgets", "--transfer", "nope", check=False)
    assert other.returncode == 2 and "transfer" in other.stderr and "Traceback" not in other.stderr
    with d.http() as c:
        r = c.post("/reef/scenarios/forgets/eval", params={"transfer": "forgets"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "transfer"


# --- the TUI ----------------------------------------------------------------------------------------------------


async def test_the_tui_shows_the_curve_as_bars_and_measures_on_m() -> None:
    from reef_cli.tui.app import ReefApp
    from reef_cli.tui.evaluation import EvalScreen
    from reef_cli.tui.screens import ChainScreen
    from tests.test_tui import SIZE, loaded, plain, until
    from tests.tui_fixture import NOW, R0, R4, FixedSource

    app = ReefApp(FixedSource(), scenario="alpha", clock=lambda: NOW, follow_events=False)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, ChainScreen)
        await pilot.press("v")
        screen = await loaded(pilot, EvalScreen)
        table = screen.query_one("#eval")
        assert [str(table.get_row(k)[1]) for k in (R0, R4)] == ["0", "4"]
        rewards = [table.get_row(r["release_id"])[4] for r in screen.data["rows"]]
        assert [str(t).count("█") for t in rewards] == [2, 2, 4, 3, 4]  # the curve: up, down, back up
        assert str(table.get_row(R0)[5]) == "n/a" and "m measures them" in plain(screen.query_one("#how"))
        await pilot.press("m")
        await until(pilot, lambda: screen.measured, what="the measurement")
        assert str(table.get_row(R0)[5]).endswith("0.75") and str(table.get_row(R4)[6]) == "-0.04"
        assert "1 figure(s) measured" in plain(screen.query_one("#note"))
        assert "not measured" not in plain(screen.query_one("#how"))


def test_a_look_never_waits_behind_a_measurement(tmp_path: Path) -> None:
    """A release page or the TUI's first look reads what is known while a measurement of the scenario runs."""

    class _Slow(_Engine):
        def __init__(self) -> None:
            super().__init__(BEHAVIOUR)
            self.started, self.go = asyncio.Event(), asyncio.Event()

        async def generate(self, exchange: Any, release: Any) -> Any:
            self.started.set()
            await self.go.wait()
            async for event in super().generate(exchange, release):
                yield event

    async def both() -> None:
        engine = _Slow()
        ev, _ = _evaluations(tmp_path, engine, _chain())
        measuring = asyncio.create_task(ev.evaluate("s"))
        await engine.started.wait()
        look = await asyncio.wait_for(ev.evaluate("s", measure=False), 30)
        assert look["rows"][1]["reward"]["value"] == 1.0 and not measuring.done()
        engine.go.set()
        assert (await measuring)["measured"] > 0

    asyncio.run(both())
