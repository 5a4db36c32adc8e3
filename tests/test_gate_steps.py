"""The gate's steps (``daemon/gating/steps.py``), each alone against a stand-in for the learning loop that records
what they did: what each writes down, holds, publishes or lets through, and what it tells the chain, the events and
the loop. The same steps through a running daemon are in tests/test_learning.py, test_watchdog.py, test_heldout.py
and test_canary_learning.py; these run in milliseconds, so that every mutant of the module meets them
(``bench/mutation.py gating_steps``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.errors import BadRequest, CheckFailed, Conflict, HeadMoved, NotFound, Unchanged
from daemon.gate import Verdict
from daemon.gating import steps, warning
from daemon.gating.outcome import GateRun
from recipes.base import Candidate, GateSettings, Scores


def rel(operation: str = "train", created_at: float = 0.0, **metrics: Any) -> Any:
    return SimpleNamespace(operation=operation, metrics=metrics, created_at=created_at)


class Chains:
    """The chain as the steps see it: its history (newest first), what they hold and publish."""

    def __init__(self) -> None:
        self.history_rows: list[Any] = []
        self.held: list[tuple[Any, Any, str]] = []
        self.head_rid = "rel_head"
        self.publish_error: Exception | None = None
        self.published: list[dict[str, Any]] = []

    def manifest(self, scenario: Any, **kw: Any) -> dict[str, Any]:
        return {"scenario": scenario.name, **kw}

    async def hold(self, manifest: Any, artifact: Any, *, base: str) -> Any:
        self.held.append((manifest, artifact, base))
        return SimpleNamespace(release_id=f"rel_held{len(self.held)}", content_id=f"c_held{len(self.held)}",
                               step=6 + len(self.held))

    async def history(self, name: str, n: int | None = None) -> list[Any]:
        return self.history_rows if n is None else self.history_rows[:n]

    async def pending(self, name: str) -> list[Any]:
        return []

    async def rejections(self, name: str, n: int) -> list[Any]:
        return []

    async def head_id(self, name: str) -> str:
        return self.head_rid

    async def head(self, scenario: Any) -> Any:
        return self.head_release

    async def publish_candidate(self, scenario: Any, record: Any, artifact: Any, *, expected_head: str,
                                engine: Any) -> Any:
        self.published.append({"record": record, "artifact": artifact, "expected_head": expected_head,
                               "engine": engine})
        if self.publish_error is not None:
            raise self.publish_error
        return SimpleNamespace(release_id="rel_new", content_id="c_new", step=9)


class Counter:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def labels(self, outcome: str) -> Any:
        return SimpleNamespace(inc=lambda: self.seen.append(outcome))


class Host:
    """A stand-in for the learning loop (``daemon.gating.outcome.Host``): each call it gets, recorded."""

    def __init__(self) -> None:
        self.chains = Chains()
        self.events: Any = SimpleNamespace(publish=lambda kind, **data: self.published.append((kind, data)))
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.metrics: Any = SimpleNamespace(heldout_checks=Counter())
        self.written: list[tuple[Any, Any, str, str]] = []
        self.followed: list[tuple[str, str, bool]] = []
        self.warnings: list[tuple[str, Any]] = []
        self.canaries: list[dict[str, Any]] = []
        self.canary_error: Exception | None = None
        self.start_canary: Any = self._start_canary
        self.canary_running: Any = None

    async def _start_canary(self, scenario: Any, body: dict[str, Any]) -> None:
        if self.canary_error is not None:
            raise self.canary_error
        self.canaries.append(body)

    async def engine(self, model: str) -> Any:
        return f"engine:{model}"

    async def write_down(self, manifest: Any, head: Any, verdict: str, reason: str) -> None:
        self.written.append((manifest, head.release_id, verdict, reason))

    def follow(self, st: Any, follows: str, candidate: Any, job_id: str, *, published: bool,
               restart: bool = False) -> None:
        self.followed.append((follows, job_id, published, *(("restart",) if restart else ())))


    async def set_warning(self, name: str, found: Any) -> None:
        self.warnings.append((name, found))

    async def heldout_prompts(self, st: Any) -> list[str]:
        return []

    def heldout_head(self, st: Any, key: Any, answers: Any = None) -> Any:
        if answers is not None:
            self.warnings.append(("heldout_head", (key, answers)))
        return None


def gate_run(kind: str = "weights", candidate: Candidate | None = None, judge: Any = None, held_out: bool = True,
             warned: Any = None, **settings: Any) -> GateRun:
    recipe = SimpleNamespace(kind=kind, settings=GateSettings(**settings), gate=settings.get("gate", "always"),
                             judge=judge, held_out_eval=held_out)
    return GateRun(SimpleNamespace(recipe=recipe, state="training", lineage=None, canary_of=None, waiting=None),
                   SimpleNamespace(name="s", model="tiny", warning=warned),  # type: ignore[arg-type]
                   # an id made at run time (not the interned literal): ``is`` for ``==`` shows
                   SimpleNamespace(release_id="".join(["rel_", "head"]), content_id="c_head"),
                   candidate or Candidate(path="/cand"), ["r1", "r2"], "job_1", {"lr": 1}, {"loss": 0.5})


def go(step: Any, host: Host, run: GateRun) -> Any:
    return asyncio.run(step(host, run))


# --- skipped -------------------------------------------------------------------------------------------------


def test_a_candidate_with_nothing_to_publish_is_written_down_as_skipped_with_its_receipts_if_it_consumes_them() -> None:
    host, run = Host(), gate_run()
    assert go(steps.skipped, host, run) is None and host.written == []
    for consume, kept in ((True, ["r1", "r2"]), (False, [])):
        host, run = Host(), gate_run(candidate=Candidate(path="/c", skipped="nothing new", consume=consume))
        out = go(steps.skipped, host, run)
        assert (out.verdict, out.reason, out.kept) == ("skipped", "nothing new", kept)
        (manifest, head, verdict, reason), = host.written
        assert (manifest["receipts"], head, verdict, reason) == (kept, "rel_head", "skipped", "nothing new")
        assert host.followed == [("rel_head", "job_1", False)]


# --- gate_kind -----------------------------------------------------------------------------------------------


def judged(verdict: Verdict, seen: list[Any] | None = None) -> Any:
    def judge(candidate: Any, *, best: Any) -> Verdict:
        if seen is not None:
            seen.append(best)
        return verdict
    return judge


def test_a_publishing_verdict_goes_on_with_its_figures_and_a_refusing_one_is_rejected() -> None:
    v = Verdict(True, "accepted", "better by 0.2", {"eval_reward": 0.7, "head_reward": None})
    host, run = Host(), gate_run(judge=judged(v))
    assert go(steps.gate_kind, host, run) is None
    assert run.st.state == "judging" and run.verdict == v and run.reason == "better by 0.2"
    assert run.metrics == {"loss": 0.5, "eval_reward": 0.7}  # None figures left out
    assert host.written == [] and host.chains.held == []
    host, run = Host(), gate_run(judge=judged(Verdict(False, "rejected", "worse", {"eval_reward": 0.1})))
    out = go(steps.gate_kind, host, run)
    assert (out.verdict, out.reason) == ("rejected", "worse")
    assert [(w[2], w[3]) for w in host.written] == [("rejected", "worse")] and host.chains.held == []


def test_a_pending_verdict_is_held_for_review() -> None:
    host, run = Host(), gate_run(judge=judged(Verdict(False, "pending", "a person decides", {})))
    out = go(steps.gate_kind, host, run)
    assert (out.verdict, out.release_id, out.step, out.reason) == ("pending", "rel_held1", 7, "a person decides")
    (manifest, artifact, base), = host.chains.held
    assert (manifest["receipts"], artifact, base) == (["r1", "r2"], "/cand", "rel_head")
    assert host.followed == [("rel_head", "job_1", False)] and host.written == []


@pytest.mark.parametrize(("review", "says"), [
    (["allowed-tools in SKILL.md"], "only a person may admit allowed-tools in SKILL.md: reef releases promote ID"),
    (["hooks", "settings.json", "an MCP server"], "only a person may admit hooks (and 2 more): reef releases"),
    (["hooks", "settings.json"], "only a person may admit hooks (and 1 more): reef releases"),
])
def test_what_only_a_person_may_admit_is_held_whatever_the_gate(review: list[str], says: str) -> None:
    cand = Candidate(tree={"a": b"x"}, details={"review": review})
    host, run = Host(), gate_run(kind="harness", candidate=cand, judge=judged(Verdict(True, "accepted", "ok", {})))
    out = go(steps.gate_kind, host, run)
    assert out.verdict == "pending" and out.reason.startswith("ok; held for review, since ") and says in out.reason
    assert run.verdict is not None and (run.verdict.publish, run.verdict.verdict) == (False, "pending")
    assert host.chains.held[0][1] == {"a": b"x"}  # a harness's tree is what is held


def test_the_regression_gate_is_given_the_best_eval_reward_on_the_chain_and_no_other_gate_reads_it() -> None:
    for gate, best in (("regression", 0.8), ("compare", None), ("review", None)):
        seen: list[Any] = []
        host, run = Host(), gate_run(judge=judged(Verdict(True, "accepted", "ok", {}), seen), gate=gate)
        host.chains.history_rows = [rel(eval_reward=0.5), rel(eval_reward="n/a"), rel(eval_reward=0.8),
                                    rel(eval_reward=True and 0.2), rel()]
        go(steps.gate_kind, host, run)
        assert seen == [best]
    seen = []
    host, run = Host(), gate_run(judge=judged(Verdict(True, "accepted", "ok", {}), seen), gate="regression")
    go(steps.gate_kind, host, run)
    assert seen == [None]  # no figure on the chain yet


# --- drift_bound ---------------------------------------------------------------------------------------------


HACKED = [rel(batch_reward=0.5, eval_reward=0.6), rel(batch_reward=0.4, eval_reward=0.7),
          rel(batch_reward=0.3, eval_reward=0.8)]


def test_the_watchdog_holds_a_hacked_trend_and_says_so_on_the_events() -> None:
    host, run = Host(), gate_run()
    run.metrics.update(batch_reward=0.6, eval_reward=0.5)
    host.chains.history_rows = list(HACKED)
    out = go(steps.drift_bound, host, run)
    assert out.verdict == "pending" and out.reason.startswith("watchdog: training reward rose 0.300 -> 0.600")
    assert host.chains.held[0][0]["metrics"]["watchdog"] == out.reason
    kind, data = host.published[0]
    assert kind == "watchdog" and data["release_id"] == "rel_held1" and data["held_to"] == 0.5
    assert data["scenario"] == "s"


def test_the_watchdog_reads_only_the_train_steps_since_the_last_rollback_and_never_a_harness() -> None:
    host, run = Host(), gate_run()
    run.metrics.update(batch_reward=0.6, eval_reward=0.5)
    # (the rollback's own figures would complete a hacked trend if it were read as a step)
    host.chains.history_rows = [HACKED[0], rel("rollback", batch_reward=0.4, eval_reward=0.7), *HACKED[1:]]
    assert go(steps.drift_bound, host, run) is None and host.chains.held == [] and host.published == []
    host, run = Host(), gate_run(kind="harness", candidate=Candidate(tree={}))
    run.metrics.update(batch_reward=0.6, eval_reward=0.5)
    host.chains.history_rows = list(HACKED)
    assert go(steps.drift_bound, host, run) is None


def test_the_drift_bound_holds_past_max_kl_and_the_watchdog_follows_the_recipes_held_out() -> None:
    host, run = Host(), gate_run()
    run.st.recipe.settings.max_kl = 0.2  # (a weights recipe's setting)
    run.metrics["kl_from_base"] = 0.3
    out = go(steps.drift_bound, host, run)
    assert out.verdict == "pending" and "more than max_kl 0.2" in out.reason
    assert host.followed == [("rel_head", "job_1", False, "restart")]  # held for harm: from the head next
    host, run = Host(), gate_run(held_out=False)  # its eval is not held out: the trend is not read
    run.metrics.update(batch_reward=0.6, eval_reward=0.5)
    host.chains.history_rows = list(HACKED)
    assert go(steps.drift_bound, host, run) is None


def test_a_hold_by_the_watchdog_may_warn_as_well() -> None:
    host, run = Host(), gate_run()
    run.metrics.update(batch_reward=0.6, eval_reward=0.5)
    host.chains.history_rows = list(HACKED)
    found = {"says": "collapse", "signals": [], "figures": {}}

    async def read(h: Any, r: Any) -> Any:
        return found

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warning, "read", read)
        mp.setattr(warning, "raised", lambda name, f, release_id, step: {
            "reason": f"warned {release_id} {step}", "signals": [], "figures": {}})
        out = go(steps.drift_bound, host, run)
    assert host.warnings == [("s", {"reason": "warned rel_held1 7", "signals": [], "figures": {}})]
    assert out.verdict == "pending"


# --- heldout_check -------------------------------------------------------------------------------------------


class Fig:
    def __init__(self, hold: str | None) -> None:
        self.hold = hold

    def metrics(self) -> dict[str, Any]:
        return {"heldout_probes": 20}


def checked(monkeypatch: pytest.MonkeyPatch, fig: Any) -> list[Any]:
    calls: list[Any] = []

    async def check(host: Any, run: Any, settings: Any) -> Any:
        calls.append(settings)
        if isinstance(fig, Exception):
            raise fig
        return fig

    monkeypatch.setattr(steps, "_check", check)
    return calls


def test_a_candidate_the_check_passes_goes_on_with_its_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = checked(monkeypatch, Fig(None))
    host, run = Host(), gate_run()
    assert go(steps.heldout_check, host, run) is None and len(calls) == 1
    assert run.metrics["heldout_probes"] == 20 and host.metrics.heldout_checks.seen == ["passed"]
    assert host.published == [("heldout", {"scenario": "s", "job": "job_1", "verdict": "passed",
                                           "metrics": {"heldout_probes": 20}})]


def test_a_candidate_the_check_holds_is_held_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    checked(monkeypatch, Fig("it stopped answering"))
    host, run = Host(), gate_run()
    out = go(steps.heldout_check, host, run)
    assert (out.verdict, out.reason, out.release_id) == ("pending", "it stopped answering", "rel_held1")
    assert host.metrics.heldout_checks.seen == ["held"]
    assert host.followed == [("rel_head", "job_1", False, "restart")]  # held for harm: from the head next
    kind, data = host.published[0]
    assert (kind, data["verdict"], data["release_id"], data["reason"]) == ("heldout", "held", "rel_held1",
                                                                          "it stopped answering")


def test_the_check_is_not_run_for_a_candidate_without_weights_or_rules_or_a_moved_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = checked(monkeypatch, Fig("never"))
    for run in (gate_run(kind="harness", candidate=Candidate(path="/x")), gate_run(candidate=Candidate(path=None)),
                gate_run(kind="weights", candidate=Candidate(tree={"AGENTS.md": b"x"}))):
        host = Host()
        assert go(steps.heldout_check, host, run) is None and "heldout" not in run.metrics
    for moved in ("rel_aaa", "rel_zzz"):  # publish turns it away, saying so (ids before and after the head's)
        host, run = Host(), gate_run()
        host.chains.head_rid = moved
        assert go(steps.heldout_check, host, run) is None
    assert calls == [] and host.metrics.heldout_checks.seen == [] and host.published == []


def test_a_harness_candidate_meets_the_check_of_its_rules_and_is_held_or_passed_on_its_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, Any]] = []
    current: list[Any] = []

    async def rules_check(host: Any, run: Any, settings: Any) -> Any:
        seen.append(("rules", settings))
        return current[0]

    monkeypatch.setattr(steps, "_harness_check", rules_check)
    checked(monkeypatch, AssertionError("a harness candidate is not a weights candidate"))
    for fig, verdict in ((Fig(None), None), (Fig("held-out check: it forgets"), "pending")):
        current[:] = [fig]
        host, run = Host(), gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": b"- say nothing"}))
        out = go(steps.heldout_check, host, run)
        assert (out and out.verdict) == verdict and len(seen) == 1 and seen.pop()[1].on
        assert run.metrics["heldout_probes"] == 20
        assert host.metrics.heldout_checks.seen == ["held" if verdict else "passed"]
        if verdict:
            assert host.chains.held[0][1] == {"AGENTS.md": b"- say nothing"}  # held, never published
            assert host.followed == [("rel_head", "job_1", False, "restart")]
    host, run = Host(), gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": b"x"}), heldout_check=False)
    assert go(steps.heldout_check, host, run) is None and run.metrics["heldout"] == "unchecked" and seen == []


class RulesEngine:
    """A model that follows its rules exactly, as the check asks it: every probe answered right, unless the system
    prompt says ``say nothing`` (empty) or ``wrong`` (a wrong word); ``asked`` keeps each (system prompt, probe)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, Any]] = []
        self.unloaded: list[Any] = []

    async def answer_many(self, exchanges: list[Any], release: Any = None) -> list[Any]:
        out = []
        for e in exchanges:
            system = e.body["messages"][0]["content"] if e.body["messages"][0]["role"] == "system" else ""
            prompt = e.body["messages"][-1]["content"]
            self.asked.append((system, prompt, release))
            text = "" if "say nothing" in system else "nope" if "wrong" in system else f"it is {prompt[-2:]} indeed"
            out.append(SimpleNamespace(text=text, prompt_token_ids=[1], token_ids=[5, 6, 7] if text else [2],
                                       logprobs=None))
        return out

    async def divergence_many(self, *a: Any) -> Any:
        raise AssertionError("a harness candidate's weights are the head's: no KL")

    async def unload(self, release: Any) -> None:
        self.unloaded.append(release)


def rules_host(first: bool) -> tuple[Host, RulesEngine]:
    host, engine = Host(), RulesEngine()
    trees = {"c_head": {"AGENTS.md": b"- be kind"}, "c_first": {}}

    async def get_engine(model: str) -> Any:
        return engine

    async def harness_tree(release: Any) -> Any:
        return trees[release.content_id]

    async def history(name: str, n: int | None = None) -> list[Any]:
        return [SimpleNamespace(content_id="c_first", release_id="rel_first")] if first else []

    host.engine = get_engine  # type: ignore[method-assign]
    host.chains.harness_tree = harness_tree  # type: ignore[attr-defined]
    host.chains.history = history  # type: ignore[method-assign]
    host.heldout_head = Kept()  # type: ignore[assignment]
    return host, engine


PROBES = [{"prompt": f"question {i:02d}", "accept": [f"{i:02d}"]} for i in range(10)]


@pytest.mark.parametrize("first", [False, True])
def test_the_rules_check_asks_the_probes_under_each_rules_file_and_holds_one_that_stops_answering_or_forgets(
        first: bool) -> None:
    for rules, held in ((b"- say nothing", "it stops answering"), (b"- give wrong answers", "it forgets"),
                        (b"- be brief", None)):
        host, engine = rules_host(first)
        run = gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": rules}), heldout_probes=PROBES)
        out = go(steps.heldout_check, host, run)
        assert (out is not None) == (held is not None), (rules, out)
        if held:
            assert held in out.reason and host.chains.held[0][1] == {"AGENTS.md": rules}
        else:
            assert run.metrics["heldout"] == "passed" and run.metrics["heldout_probe_accuracy"] == 1.0
        systems = {s for s, _, _ in engine.asked}
        assert systems == {rules.decode(), "- be kind"} | ({""} if first else set())  # the first release's: none
        assert {r for _, _, r in engine.asked} == {None} and engine.unloaded == []  # the model itself, kept loaded
        assert "a harness candidate" in run.metrics["heldout_note"] and "heldout_kl" not in run.metrics
    # the head's answers are kept for its content: the next check asks the candidate alone
    host, engine = rules_host(False)
    for rules in (b"- be brief", b"- be briefer"):
        run = gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": rules}), heldout_probes=PROBES)
        engine.asked.clear()
        assert go(steps.heldout_check, host, run) is None
    assert {s for s, _, _ in engine.asked} == {"- be briefer"}


def test_rules_equal_to_the_heads_are_not_asked_again() -> None:
    host, engine = rules_host(False)
    run = gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": b"- be kind", "skills/x/SKILL.md": b"y"}),
                   heldout_probes=PROBES)
    assert go(steps.heldout_check, host, run) is None and len(engine.asked) == 10  # nothing kept: both, 5 probes each
    engine.asked.clear()
    run = gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": b"- be kind", "skills/x/SKILL.md": b"z"}),
                   heldout_probes=PROBES)
    assert go(steps.heldout_check, host, run) is None and engine.asked == []
    assert run.metrics["heldout"] == "passed" and run.metrics["heldout_probes"] == 5  # the first stage: no harm


def test_a_rules_check_that_cannot_reach_the_model_fails_the_step() -> None:
    host, _ = rules_host(False)

    async def away(model: str) -> Any:
        raise BadRequest("model 'tiny' is not configured")

    host.engine = away  # type: ignore[method-assign]
    run = gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": b"- be brief"}), heldout_probes=PROBES)
    with pytest.raises(CheckFailed, match="not configured"):
        go(steps.heldout_check, host, run)
    assert host.metrics.heldout_checks.seen == ["failed"] and host.chains.held == []


def test_a_check_that_fails_is_counted_and_told_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    checked(monkeypatch, CheckFailed("the engine is away"))
    host, run = Host(), gate_run()
    with pytest.raises(CheckFailed):
        go(steps.heldout_check, host, run)
    assert host.metrics.heldout_checks.seen == ["failed"]
    assert host.published == [("heldout", {"scenario": "s", "job": "job_1", "verdict": "failed",
                                           "reason": "the held-out check could not run: the engine is away"})]


def test_the_check_fails_when_the_heads_answers_take_too_long_or_the_head_cannot_be_read() -> None:
    async def slow() -> None:
        await asyncio.sleep(30)

    async def timed_out() -> None:
        host, run = Host(), gate_run(heldout_timeout_s=0.01)
        run.st.heldout_prefetch = asyncio.ensure_future(slow())
        with pytest.raises(CheckFailed, match="it took longer than heldout_timeout_s 0.01"):
            await steps._check(host, run, steps.heldout.CheckSettings.of(run.recipe.settings))
        assert run.st.heldout_prefetch is None  # taken: never awaited twice

    asyncio.run(timed_out())

    async def no_ref(*args: Any) -> Any:
        raise NotFound("the head's files are gone")

    host, run = Host(), gate_run()
    host.chains.ref = no_ref  # type: ignore[attr-defined]
    with pytest.raises(CheckFailed, match="could not run: the head's files are gone"):
        asyncio.run(steps._check(host, run, steps.heldout.CheckSettings.of(run.recipe.settings)))


class Kept:
    """The loop's store of the head's held-out answers, by (head content, max tokens)."""

    def __init__(self, known: dict[Any, Any] | None = None) -> None:
        self.known = dict(known or {})
        self.calls: list[tuple[Any, Any]] = []

    def __call__(self, st: Any, key: Any, answers: Any = None) -> Any:
        self.calls.append((key, answers))
        if answers is not None:
            self.known[key] = answers
            return None
        return self.known.get(key)


def test_the_check_asks_the_candidate_under_its_own_key_and_keeps_the_heads_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon import lora

    got: list[tuple[Any, ...]] = []
    fig = SimpleNamespace(seconds=1.0, prefetch_seconds=None)

    async def run(engine: Any, model: str, candidate: Any, head: Any, base: Any, recorded: Any, settings: Any,
                  head_known: Any, first_release: Any = None, first_known: Any = None) -> Any:
        assert first_release is None and first_known is None  # the head is the chain's first release here
        got.append((engine, model, candidate, head, base, recorded, head_known))
        return fig, {"q": "cand"}, {"q": "head"}

    async def ref(scenario: Any, head: Any) -> Any:
        return SimpleNamespace(release_id="rel_head", base=SimpleNamespace(release_id="rel_base"))

    async def prompts(st: Any) -> list[str]:
        return ["a recorded prompt"]

    monkeypatch.setattr(steps.heldout, "run", run)
    for adapter in (False, True):
        monkeypatch.setattr(lora, "read_dir", lambda path, a=adapter: object() if a else None)
        host, run_ = Host(), gate_run(heldout_max_tokens=8)
        host.chains.ref = ref  # type: ignore[attr-defined]
        host.heldout_prompts = prompts  # type: ignore[method-assign]
        host.heldout_head = kept = Kept({("c_head", 8, 48): {"q": "before"}})  # type: ignore[assignment]
        fig.seconds = 1.0
        clock = [10.0, 25.0]  # the check's start, and when the head's answers came: 15 s of waiting
        real = steps.time.perf_counter
        monkeypatch.setattr(steps.time, "perf_counter", lambda c=clock, r=real: c.pop(0) if c else r())

        async def prefetched() -> float:
            await asyncio.sleep(0.05)
            return 2.5

        async def check(host: Host, run_: GateRun) -> Any:
            run_.st.heldout_prefetch = asyncio.ensure_future(prefetched())
            return await steps._check(host, run_, steps.heldout.CheckSettings.of(run_.recipe.settings))

        assert asyncio.run(check(host, run_)) is fig
        engine, model, candidate, head, base, recorded, known = got.pop()
        assert (engine, model, recorded, known) == ("engine:tiny", "tiny", ["a recorded prompt"], {"q": "before"})
        assert (candidate.release_id, candidate.content_id, str(candidate.path)) == ("candidate:job_1",
                                                                                     "candidate:job_1", "/cand")
        assert base.release_id == "rel_base" and head.release_id == "rel_head"  # the whole model: its base
        assert (candidate.base is base) == adapter  # an adapter applies to the whole model; full weights alone
        assert kept.known[("c_head", 8, 48)] == {"q": "head"} and run_.heldout_answers == ((8, 48), {"q": "cand"})
        assert fig.prefetch_seconds == 2.5 and fig.seconds == 16.0  # the wait for the head's answers counts


def test_the_heads_answers_are_asked_ahead_only_for_what_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []

    async def answers(engine: Any, model: str, prompts: Any, release: Any, max_tokens: int, longer: Any = (),
                      longer_tokens: int = 0) -> list[str]:
        asked.append((engine, model, list(prompts), release, max_tokens, longer, longer_tokens))
        return [f"answer to {p}" for p in prompts]

    async def prompts(st: Any) -> list[str]:
        return ["r1", "r2", "r1"]

    async def ref(scenario: Any, head: Any) -> Any:
        return "ref_head"

    monkeypatch.setattr(steps.heldout, "answers", answers)
    probes = [p.prompt for p in steps.heldout.shipped_probes()]
    host, run = Host(), gate_run(heldout_max_tokens=4)
    host.heldout_prompts = prompts  # type: ignore[method-assign]
    host.chains.ref = ref  # type: ignore[attr-defined]
    host.heldout_head = kept = Kept({("c_head", 4, 48): {"r1": "known", probes[0]: "known"}})  # type: ignore[assignment]
    clock = iter([10.0, 25.0])  # (not 100 and 102.5: 102.5 % 100 is 2.5 as well)
    monkeypatch.setattr(steps.time, "perf_counter", lambda: next(clock))
    took = asyncio.run(steps.prefetch_head(host, run.st, run.scenario, run.head))
    monkeypatch.undo()
    monkeypatch.setattr(steps.heldout, "answers", answers)
    # the recorded prompts' answers at heldout_recorded_tokens (48), long enough to see a loop; the probes' at 4
    assert asked == [("engine:tiny", "tiny", ["r2", *probes[1:]], "ref_head", 4, {"r1", "r2"}, 48)] and took == 15.0
    assert kept.known[("c_head", 4, 48)] == {"r1": "known", probes[0]: "known", "r2": "answer to r2",
                                         **{p: f"answer to {p}" for p in probes[1:]}}
    asked.clear()
    assert asyncio.run(steps.prefetch_head(host, run.st, run.scenario, run.head)) >= 0 and asked == []  # all kept
    off = gate_run(heldout_check=False)
    assert asyncio.run(steps.prefetch_head(host, off.st, off.scenario, off.head)) == 0.0 and asked == []

    async def broken(*args: Any) -> Any:
        raise CheckFailed("the engine is away")

    monkeypatch.setattr(steps.heldout, "answers", broken)
    host.heldout_head = Kept()  # type: ignore[assignment]
    assert asyncio.run(steps.prefetch_head(host, run.st, run.scenario, run.head)) >= 0  # never raises


# --- early_warning -------------------------------------------------------------------------------------------


def test_a_trend_that_warns_holds_the_candidate_and_raises_the_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    found: dict[str, Any] = {"says": "the answers collapse", "signals": ["silent"], "figures": {"x": 1},
                             "evidence": "reward 0.2 -> 0.6"}
    got: list[Any] = []

    async def read(h: Any, r: Any) -> Any:
        return got.pop() if got else None

    async def raise_warning(h: Any, r: Any, f: Any, release_id: Any, step: Any) -> None:
        h.warnings.append((f["says"], release_id, step))

    monkeypatch.setattr(warning, "read", read)
    monkeypatch.setattr(warning, "raise_warning", raise_warning)
    host, run = Host(), gate_run()
    assert go(steps.early_warning, host, run) is None and host.chains.held == []
    got.append(found)
    out = go(steps.early_warning, host, run)
    assert out.verdict == "pending" and out.reason == warning.text("s", found)
    assert host.chains.held[0][0]["metrics"]["warning"] == "the answers collapse"
    assert host.warnings == [("the answers collapse", "rel_held1", 7)]
    assert host.followed == [("rel_head", "job_1", False, "restart")]  # held for harm: from the head next


# --- canary --------------------------------------------------------------------------------------------------


def test_a_candidate_with_a_canary_share_is_held_and_served_as_a_canary_with_its_bounds() -> None:
    host, run = Host(), gate_run(canary_share=0.25, canary_answers=40, canary_hours=6.0)
    run.reason = "better by 0.2"
    out = go(steps.canary, host, run)
    assert (out.verdict, out.release_id, out.step) == ("pending", "rel_held1", 7)
    assert out.reason == "better by 0.2; serving 25% of new runs as a canary (reef releases list shows it)"
    assert host.canaries == [{"release_id": "rel_held1", "share": 0.25, "max_answers": 40, "max_hours": 6.0}]
    assert host.followed == [("rel_head", "job_1", False)]  # a canary: the lineage goes on from it


@pytest.mark.parametrize("share", [0.0, -0.5])
def test_no_canary_without_a_share_above_zero(share: float) -> None:
    """Bugs caught: a canary started at share 0 (or below: a setting from before the bound was checked), serving
    nobody and holding the candidate until its hours run out; ``or`` read as ``and``."""
    host, run = Host(), gate_run(canary_share=share)
    assert go(steps.canary, host, run) is None
    assert host.canaries == [] and host.chains.held == [] and run.st.canary_of is None


def test_a_started_canary_is_the_lineages_to_train_ahead_of_and_its_answers_are_kept_for_its_promotion() -> None:
    """Bugs caught: the canary not marked (no step trains ahead of it), one marked that could not start, the
    candidate's held-out answers not kept under the canary's content (asked again once it is promoted)."""
    host, run = Host(), gate_run(canary_share=0.5)
    run.st.lineage = ("rel_head", "candidate:job_1", "/cand")
    run.heldout_answers = ((16, 48), {"q": "a"})
    go(steps.canary, host, run)
    assert run.st.canary_of == ("rel_held1", "c_held1", "/cand")
    assert ("heldout_head", (("c_held1", 16, 48), {"q": "a"})) in host.warnings
    host, run = Host(), gate_run(canary_share=0.5)
    run.st.lineage = ("rel_head", "candidate:job_1", "/cand")
    host.canary_error = Conflict("scenario s already has a canary")
    go(steps.canary, host, run)
    assert run.st.canary_of is None


def test_a_candidate_trained_ahead_of_a_running_canary_waits_for_its_verdict_carrying_every_batch(
        tmp_path: Any) -> None:
    """While the canary runs, a candidate trained ahead of it is parked (nothing written down, nothing consumed),
    and the next one trained on top of it carries its receipts and trainer seconds. Bugs caught: a parked candidate
    written down or its batch consumed before the verdict, the second one dropping the first one's receipts (they
    would be learned from twice), the trainer time of the first lost."""
    first_dir, second_dir = tmp_path / "c1", tmp_path / "c2"
    first_dir.mkdir()
    second_dir.mkdir()
    host = Host()
    host.canary_running = lambda name: True
    run = gate_run(candidate=Candidate(path=str(first_dir)))
    run.ahead, run.metrics["trainer_seconds"] = ("rel_held1", "c_held1", "/cand0"), 40.0
    out = go(steps.canary_verdict, host, run)
    assert (out.verdict, out.kept) == ("ahead", []) and host.written == [] and host.chains.held == []
    assert out.reason == "trained ahead of canary rel_held1 (1 batches): waits for its verdict"
    st = run.st
    assert st.waiting is run and st.lineage == ("rel_head", "candidate:job_1", str(first_dir))
    nxt = GateRun(st, run.scenario, run.head, Candidate(path=str(second_dir)), ["r3", "r4"], "job_2", {},
                  {"trainer_seconds": 30.0}, ahead=run.ahead)
    out = go(steps.canary_verdict, host, nxt)
    assert out.verdict == "ahead" and st.waiting is nxt and nxt.receipts == ["r1", "r2", "r3", "r4"]
    assert nxt.metrics["steps_ahead"] == 2 and nxt.metrics["trainer_seconds"] == 70.0
    assert st.lineage == ("rel_head", "candidate:job_2", str(second_dir)) and not first_dir.exists()


def test_a_candidate_trained_ahead_of_a_promoted_canary_goes_on_against_the_promoted_head() -> None:
    host, run = Host(), gate_run()
    assert go(steps.canary_verdict, host, run) is None  # not trained ahead: nothing to wait for
    run.ahead = ("rel_held1", "c_held1", "/cand0")
    host.canary_running = lambda name: False
    # the content made at run time (not the interned literal): ``is`` for ``==`` shows
    host.chains.head_release = promoted = SimpleNamespace(release_id="rel_promoted",
                                                          content_id="".join(["c_held", "1"]))
    assert go(steps.canary_verdict, host, run) is None
    assert run.head is promoted and run.metrics["trained_ahead_of"] == "rel_held1" and host.written == []
    assert run.st.waiting is None


def test_a_candidate_trained_ahead_of_an_ended_canary_is_discarded_and_its_batches_kept(tmp_path: Any) -> None:
    """Bugs caught: a candidate trained on top of weights live traffic turned away going on to serve, its batches
    consumed (learned only from the ended lineage), its weights left on disk."""
    cand = tmp_path / "cand"
    cand.mkdir()
    host, run = Host(), gate_run(candidate=Candidate(path=str(cand)))
    run.ahead = ("rel_held1", "c_held1", "/cand0")
    host.canary_running = lambda name: False
    host.chains.head_release = SimpleNamespace(release_id="rel_head", content_id="c_head")
    out = go(steps.canary_verdict, host, run)
    assert (out.verdict, out.kept) == ("skipped", [])
    assert out.reason == ("trained ahead of canary rel_held1, which was not promoted (the head is rel_head): "
                          "discarded; its batches are learned from again from the head")
    manifest, base, verdict, reason = host.written[0]
    assert (manifest["receipts"], base, verdict, reason) == ([], "rel_head", "skipped", out.reason)
    assert not cand.exists() and host.followed == []
    # a head whose content sorts after the canary's is not the canary's either; a candidate whose weights are
    # already gone is discarded all the same (bugs caught: ``>=`` for ``==``, a removal that raises)
    host, run = Host(), gate_run(candidate=Candidate(path=str(tmp_path / "gone")))
    run.ahead = ("rel_held1", "c_held1", "/cand0")
    host.canary_running = lambda name: False
    host.chains.head_release = SimpleNamespace(release_id="rel_other", content_id="c_zzz")
    assert go(steps.canary_verdict, host, run).verdict == "skipped" and "trained_ahead_of" not in run.metrics


# --- publish and rejected ------------------------------------------------------------------------------------


def test_a_published_candidate_is_the_new_head_with_its_evaluation_and_held_out_answers() -> None:
    host, run = Host(), gate_run(candidate=Candidate(path="/cand", eval=Scores([0.7, 0.9])))
    run.reason, run.heldout_answers = "better", ((16, 48), {"q": "a"})
    out = go(steps.publish, host, run)
    assert (out.verdict, out.release_id, out.step, out.reason) == ("accepted", "rel_new", 9, "better")
    (sent,) = host.chains.published
    assert (sent["artifact"], sent["expected_head"], sent["engine"]) == ("/cand", "rel_head", "engine:tiny")
    assert sent["record"]["receipts"] == ["r1", "r2"] and sent["record"]["settings"] == {"lr": 1}
    assert run.st.head_eval == ("rel_new", [0.7, 0.9])
    assert host.warnings == [("heldout_head", (("c_new", 16, 48), {"q": "a"}))]
    assert host.followed == [("rel_new", "job_1", True)]


def test_a_harness_is_published_without_an_engine_or_answers() -> None:
    host, run = Host(), gate_run(kind="harness", candidate=Candidate(tree={"AGENTS.md": b"x"}))
    out = go(steps.publish, host, run)
    assert out.verdict == "accepted" and host.chains.published[0]["engine"] is None
    assert host.chains.published[0]["artifact"] == {"AGENTS.md": b"x"}
    assert not hasattr(run.st, "head_eval") and host.warnings == []


def test_an_unchanged_candidate_is_skipped_and_a_moved_head_turns_weights_away() -> None:
    host, run = Host(), gate_run()
    host.chains.publish_error = Unchanged("s", "c_head")
    out = go(steps.publish, host, run)
    assert out.verdict == "skipped" and "same content as the head" in out.reason
    assert [(w[2], w[3]) for w in host.written] == [("skipped", out.reason)]
    assert host.followed == [("rel_head", "job_1", False)]
    host, run = Host(), gate_run()
    host.chains.publish_error = HeadMoved("s", "rel_head", "rel_other")
    assert go(steps.publish, host, run) is None  # rejected next, saying why
    assert run.reason == "the head moved during training (now rel_other); not published"
    host, run = Host(), gate_run(kind="harness", candidate=Candidate(tree={}))
    host.chains.publish_error = HeadMoved("s", "rel_head", "rel_other")
    with pytest.raises(HeadMoved):  # a harness step is made again on the new head by the loop
        go(steps.publish, host, run)


def test_what_no_step_took_is_written_down_as_rejected_with_the_reason_so_far() -> None:
    host, run = Host(), gate_run()
    out = go(steps.rejected, host, run)
    assert (out.verdict, out.reason) == ("rejected", None)
    assert [(w[1], w[2], w[3]) for w in host.written] == [("rel_head", "rejected", "rejected")]
    run.reason = "worse by 0.1"
    assert go(steps.rejected, host, run).reason == "worse by 0.1" and host.written[-1][3] == "worse by 0.1"
    assert host.followed == [("rel_head", "job_1", False)] * 2


def test_the_run_goes_through_the_steps_until_one_ends_it() -> None:
    seen: list[str] = []

    def step(name: str, ends: bool) -> Any:
        async def s(host: Any, run: Any) -> Any:
            seen.append(name)
            return name if ends else None
        s.__name__ = name
        return s

    host, run = Host(), gate_run()
    assert asyncio.run(steps.run(host, run, (step("a", False), step("b", True), step("c", True)))) == "b"
    assert seen == ["a", "b"]
    with pytest.raises(AssertionError, match=r"no step of \['a'\] ended"):
        asyncio.run(steps.run(host, run, (step("a", False),)))
