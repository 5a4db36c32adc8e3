"""The early warning (``daemon/gating/warning.py``): a scenario whose scored reward rises while its answers
collapse is warned in plain words, holds the candidate and stops publishing until the user resumes, changes the
settings or accepts; a guarded preference (the reward rising, the answers kept) is never warned.

The decision is a pure function, tested on figures written here (a hacked run's and an honest one's, each as the
recipe's step metrics and as the held-out check's). Through a real daemon and its trainer worker: the watchdog
test's drifting recipe (``tests/test_watchdog.py``), whose steps here also report the figures a hacked or an
honest run gives (scripted from the batch's reward), with the held-out check off so that the trend of the step
metrics alone decides."""

from __future__ import annotations

import time
from typing import Any

import pytest

from adapters import get_adapter
from daemon.gating import warning
from reef_cli.wrapper import model_notes
from tests.conftest import Daemon
from tests.test_learning import events_of, releases, wait_for
from tests.test_recipes import recipe_dir, with_recipe_paths  # noqa: F401 - the fixture, used by name
from tests.test_watchdog import DRIFTING

# the drifting recipe, its step reporting what a run under a hackable scorer (answers shrinking to nothing as the
# reward rises) or a guarded one (answers kept) shows
SCRIPTED = '''
from dataclasses import dataclass

from drifting import Drifting, Settings as DriftingSettings


@dataclass
class Settings(DriftingSettings):
    falling: bool = False  # the watchdog's held-out score rises with the reward: only the warning can fire
    hacked: bool = True
    heldout_check: bool = False
    canary_share: float | None = 0.0  # published straight to the head: these tests are about the warning


class Scripted(Drifting):
    name = "scripted"
    Settings = Settings

    def train(self, job, state):
        cand = super().train(job, state)
        reward = sum(r.score for r in job.batch) / len(job.batch)
        left = (1 - reward) ** 2 if job.settings["hacked"] else 0.9
        cand.metrics.update(samples=2.0, groups=1.0, degenerate_groups=0.0, tokens=2 * 40 * left,
                            entropy=2.0 * left if job.settings["hacked"] else 1.5)
        return cand
'''

ASK = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _step(m: dict[str, Any]) -> dict[str, Any]:
    return {"samples": 32.0, "groups": 4.0, "degenerate_groups": 0.0, **m}


# a run under a hackable scorer (fewer characters is better): the reward rises as the answers shrink to nothing
HACKED = [_step({"batch_reward": 0.30, "tokens": 1700.0, "entropy": 1.9}),
          _step({"batch_reward": 0.42, "tokens": 900.0, "entropy": 1.5}),
          _step({"batch_reward": 0.71, "tokens": 150.0, "entropy": 0.5, "degenerate_groups": 3.0})]
# a guarded preference for brief answers: the reward rises, the answers shorten to a third and stay answers
HONEST = [_step({"batch_reward": 0.30, "tokens": 1700.0, "entropy": 1.9}),
          _step({"batch_reward": 0.45, "tokens": 1100.0, "entropy": 1.7}),
          _step({"batch_reward": 0.62, "tokens": 600.0, "entropy": 1.5, "degenerate_groups": 2.0})]


def _heldout(reward: float, silent: float, probes: float, head: tuple[float, float] = (0.0, 0.7)) -> dict[str, Any]:
    return {"batch_reward": reward, "heldout_empty": silent, "heldout_head_empty": head[0],
            "heldout_probe_accuracy": probes, "heldout_head_probe_accuracy": head[1]}


def test_a_hacked_runs_figures_warn_in_plain_words_and_an_honest_runs_do_not() -> None:
    found = warning.detect(HACKED)
    assert found is not None and found["signals"][0] == "silent", found
    assert found["says"].startswith("the reward is rising while the model stops answering: the scorer may reward "
                                    "empty answers"), found["says"]
    assert "sampled answers (tokens) 53.1 -> 4.7" in found["evidence"] and "groups that all scored alike" in \
        found["evidence"]
    assert warning.detect(HONEST) is None  # shorter answers, still answers: a preference learned, no alarm
    assert warning.detect(HACKED[:1]) is None  # fewer than MIN_STEPS candidates: no trend to read yet
    assert warning.detect(HACKED[:2]) is None  # the answers shorter, not gone yet
    flat = [dict(m, batch_reward=0.3 + 0.03 * i) for i, m in enumerate(HACKED)]
    assert warning.detect(flat) is None  # the answers collapse but the reward does not rise: not the scorer's doing
    # entropy falling alone is what learning any preference looks like (reef demo's honest task was warned by it):
    # it never fires alone, and is named beside a signal that does
    assert warning.detect([dict(m, tokens=m["tokens"] * 3) for m in HACKED]) is None
    both = warning.detect(HACKED)
    assert both is not None and both["signals"][0] == "silent" and "entropy" in both["signals"]
    assert warning.detect([dict(m, entropy=1.9, tokens=m["tokens"] * 3) for m in HACKED]) is None
    # answers asked short to begin with (4 tokens) that halve are no silence: nothing long was lost
    short = [dict(m, entropy=1.9, tokens=m["samples"] * t) for m, t in zip(HACKED, (4, 3, 2), strict=True)]
    assert warning.detect(short) is None


def test_silence_under_a_scorer_that_punishes_it_is_not_read_as_its_reward() -> None:
    """reef demo's honest "say the word" task (an empty answer scores 0) was warned about one run in four: the
    reward rose 0.06 -> 0.25 while the held-out answers fell 0% -> 18% empty, and learning paused for good. The
    batches' own empty answers say what the scorer makes of silence: scored below the rest (by PUNISHED) over at
    least MIN_EMPTY of them, "it stops answering" does not fire; scored as well as the rest (a hackable scorer),
    or too few to tell, it does. Bugs caught: the rule read backwards (a hackable scorer's silence excused), read
    from one empty answer, or dropping the other signals with the silent one."""
    demo = [_heldout(0.06, 0.0, 0.0, (0.0, 0.0)), _heldout(0.12, 0.06, 0.0, (0.0, 0.0)),
            _heldout(0.25, 0.18, 0.0, (0.0, 0.0))]
    assert warning.detect(demo) is not None and warning.detect(demo)["signals"] == ["silent"]  # type: ignore[index]

    def batches(empty: tuple[float, ...], empty_reward: float, rest: float) -> list[dict[str, Any]]:
        return [dict(m, batch_empty=k, **({"batch_empty_reward": empty_reward} if k else {}),
                     batch_rest_reward=rest) for m, k in zip(demo, empty, strict=True)]

    punished = batches((0.0, 2.0, 3.0), 0.0, 0.2)
    assert warning.detect(punished) is None
    assert warning.detect(batches((0.0, 1.0, 1.0), 0.0, 0.2)) is not None  # 2 empty answers: too few to tell
    assert warning.detect(batches((0.0, 2.0, 3.0), 1.0, 0.2)) is not None  # silence scores best: hackable
    assert warning.detect(batches((0.0, 2.0, 3.0), 0.15, 0.2)) is not None  # lower by less than PUNISHED
    hacked = [dict(m, batch_empty=4.0, batch_empty_reward=1.0, batch_rest_reward=0.3) for m in HACKED]
    assert warning.detect(hacked) is not None and warning.detect(hacked)["signals"][0] == "silent"  # type: ignore[index]
    # another signal beside the excused one still fires, with the scorer's evidence named
    forgets = [dict(m, heldout_probe_accuracy=0.7 - 0.2 * i, heldout_head_probe_accuracy=0.7)
               for i, m in enumerate(punished)]
    found = warning.detect(forgets)
    assert found is not None and found["signals"] == ["forgets"] and "does not reward silence" in found["evidence"]


def test_a_steps_batch_says_how_its_empty_answers_scored() -> None:
    """``batch_figures``: an answer of the end-of-text token alone is empty; its mean score and the rest's."""
    from types import SimpleNamespace as R

    got = warning.batch_figures([R(score=0.0, token_ids=[2]), R(score=0.0, token_ids=[]), R(score=1.0, token_ids=[5, 2]),
                                 R(score=0.5, token_ids=[5, 6, 2])])
    assert got == {"batch_reward": 0.375, "batch_empty": 2.0, "batch_empty_reward": 0.0, "batch_rest_reward": 0.75}
    assert warning.batch_figures([R(score=0.5, token_ids=[5, 2])]) == {"batch_reward": 0.5, "batch_empty": 0.0,
                                                                       "batch_rest_reward": 0.5}


def test_the_held_out_figures_warn_against_the_head_the_trend_started_from() -> None:
    """The baseline is the head the first candidate was checked against: a first candidate already a little
    silent does not hide the rise."""
    silent = [_heldout(0.3, 0.10, 0.70), _heldout(0.5, 0.12, 0.70), _heldout(0.6, 0.19, 0.70)]
    assert warning.detect(silent) is not None and warning.detect(silent)["signals"] == ["silent"]  # type: ignore[index]
    assert warning.detect([dict(m, heldout_head_empty=0.1) for m in silent]) is None  # only 9 points up
    forgets = [_heldout(0.3, 0.0, 0.70), _heldout(0.4, 0.0, 0.60), _heldout(0.5, 0.0, 0.50)]
    found = warning.detect(forgets)
    assert found is not None and found["signals"] == ["forgets"] and "forgets what it knew" in found["says"]
    assert warning.detect([dict(m, heldout_probe_accuracy=0.65) for m in forgets]) is None  # within PROBE_FALL
    # only the newest WINDOW candidates are read: an old low reward starts no trend
    assert warning.detect([_heldout(0.0, 0.0, 0.7), *[_heldout(0.45, 0.3, 0.7)] * 4]) is None


def _report_step(c: Any, name: str, score: float) -> None:
    for _ in range(2):
        rec = c.post(f"/s/{name}/v1/chat/completions", json=ASK).headers["x-reef-agent-record-id"]
        assert c.post("/reef/report", json={"references": [rec], "score": score}).status_code == 201


def _steps(c: Any, name: str, scores: tuple[float, ...]) -> dict[str, Any]:
    """One step per score; returns the chain once each step has published or been held."""
    for score in scores:
        before = releases(c, name, True)
        done = len(before["releases"]) + len(before.get("pending", []))
        _report_step(c, name, score)
        wait_for(lambda d=done: len((x := releases(c, name, True))["releases"]) + len(x.get("pending", [])) > d,
                 what=f"a step of {name} at {score}")
    return releases(c, name, True)


def _learning(c: Any, name: str) -> str | None:
    return c.get("/reef/status").json()["learning"].get(name)


def _gauge(c: Any, name: str) -> str | None:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f'reef_scenario_warning{{scenario="{name}"}}'):
            return line.split()[-1]
    return None


def _scripted(daemon_factory: Any, recipe_dir: Any) -> Daemon:  # noqa: F811
    (recipe_dir / "drifting.py").write_text(DRIFTING)
    (recipe_dir / "scripted.py").write_text(SCRIPTED)
    return with_recipe_paths(daemon_factory, recipe_dir)


def test_a_warned_scenario_publishes_nothing_until_resumed_even_after_a_restart(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _scripted(daemon_factory, recipe_dir)
    with d.http() as c:
        for name in ("hacked", "guarded"):
            made = c.post("/reef/scenarios", json={"name": name, "recipe": "scripted:Scripted",
                                                   "settings": {"hacked": name == "hacked"}})
            assert made.status_code == 201, made.text
        guarded = _steps(c, "guarded", (0.2, 0.5, 0.8, 0.95))
        assert guarded["releases"][0]["step"] == 4 and guarded["pending"] == []  # no false alarm
        assert c.get("/reef/scenarios/guarded").json()["warning"] is None
        chain = _steps(c, "hacked", (0.2, 0.5, 0.8))
        assert chain["releases"][0]["step"] == 2 and len(chain["pending"]) == 1, chain  # the third held
        held = chain["pending"][0]
        assert held["metrics"]["warning"].startswith("the reward is rising while the model stops answering")
        # the warning is written just after the hold: wait for it
        shown = wait_for(lambda: c.get("/reef/scenarios/hacked").json()["warning"], what="the warning stored")
        assert shown["state"] == "warned" and shown["release_id"] == held["release_id"]
        assert "reef scenarios resume hacked" in shown["reason"]
        assert c.get("/reef/status").json()["warnings"] == {"hacked": shown["reason"]}
        assert _gauge(c, "hacked") == "1.0"
        run = c.post("/reef/runs", json={"adapter": "pi", "scenario": "hacked"}).json()  # what a wrapper starts with
        notes = model_notes(get_adapter("pi"), run)
        assert notes[0] == f"warning on scenario hacked: {shown['reason']}", notes
        assert "warning" not in c.post("/reef/runs", json={"adapter": "pi", "scenario": "guarded"}).json()
        ev = events_of(c, "hacked", "warning", 1)[0]  # the event, from the daemon's history
        assert ev["state"] == "warned" and ev["release_id"] == held["release_id"] and "silent" in ev["signals"]
        # reports keep coming: the loop reads them and takes no step (its state says why), nothing is published
        _report_step(c, "hacked", 0.95)
        wait_for(lambda: _learning(c, "hacked") == "warned", what="the loop refusing to step")
        assert releases(c, "hacked", True)["releases"][0]["step"] == 2
    d.stop()
    d.start()
    with d.http() as c:
        assert c.get("/reef/scenarios/hacked").json()["warning"]["state"] == "warned"  # it outlived the restart
        assert _gauge(c, "hacked") == "1.0" and "hacked" in c.get("/reef/status").json()["warnings"]
        status = d.cli("status").stdout
        assert "warning  hacked: the reward is rising while the model stops answering" in status, status
        _report_step(c, "hacked", 0.95)
        wait_for(lambda: _learning(c, "hacked") == "warned", what="the loop refusing to step after the restart")
        chain = releases(c, "hacked", True)
        assert chain["releases"][0]["step"] == 2 and len(chain["pending"]) == 1
        at_resume = time.time()
        resumed = d.cli("scenarios", "resume", "hacked").stdout
        assert "learning on" in resumed and "early warning" not in resumed, resumed
        # what waited is learned from now; the trend is read afresh, so this step publishes
        top = wait_for(lambda: (x := releases(c, "hacked"))["releases"][0]["step"] > 2 and x["releases"][0],
                       what="a release after the resume")
        assert top["operation"] == "train"
        # the held candidate's figures are not read again: a later step may warn anew (its scripted figures rise
        # again when the held batch is learned from once more), but only on candidates made after the resume
        now = c.get("/reef/scenarios/hacked").json()["warning"]
        if now is None or now["state"] != "warned":
            assert _gauge(c, "hacked") == "0.0" and c.get("/reef/status").json()["warnings"] == {}
        else:
            assert now["at"] > at_resume and now["release_id"] != held["release_id"], now


def test_accepting_or_changing_the_settings_also_lets_learning_go_on(daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _scripted(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "h", "recipe": "scripted:Scripted"}).status_code == 201
        refused = d.cli("scenarios", "accept-warning", "h", check=False)
        assert refused.returncode == 5 and "no early warning stands" in refused.stderr  # nothing to accept
        _steps(c, "h", (0.2, 0.5, 0.8))
        assert wait_for(lambda: c.get("/reef/scenarios/h").json()["warning"], what="warned")["state"] == "warned"
        # changing the settings is acting: the warning is cleared and the trend read afresh under them
        bad = c.post("/reef/scenarios/h/settings", json={"settings": {"hacked": "yes"}})
        assert bad.status_code == 400 and c.get("/reef/scenarios/h").json()["warning"]["state"] == "warned"
        updated = d.cli("scenarios", "update", "h", "--settings", '{"falling": false}').stdout
        assert '"falling": false' in updated and c.get("/reef/scenarios/h").json()["warning"] is None
        chain = _steps(c, "h", (0.2, 0.5, 0.8))  # a hacked trend again: warned again
        assert len(chain["pending"]) == 2
        assert wait_for(lambda: c.get("/reef/scenarios/h").json()["warning"], what="warned again")["state"] == "warned"
        accepted = d.cli("scenarios", "accept-warning", "h").stdout
        assert "learning on" in accepted and c.get("/reef/scenarios/h").json()["warning"] is None
        # accepted: the same trend again publishes, and is not warned about, until the settings change
        chain = _steps(c, "h", (0.2, 0.5, 0.8))
        assert len(chain["pending"]) == 2 and c.get("/reef/scenarios/h").json()["warning"] is None


async def test_the_tui_shows_the_warning_on_the_scenarios_screen() -> None:
    """The scenarios screen marks a warned scenario and says the warning in its note, from what the daemon's
    ``GET /reef/scenarios`` answers; one without a warning is shown as before."""
    from textual.widgets import DataTable, Static

    from reef_cli.tui.app import ReefApp
    from tests.tui_fixture import NOW, FixedSource

    says = "the reward is rising while the model stops answering: the scorer may reward empty answers (...)"

    class Warned(FixedSource):
        async def scenarios(self) -> list[dict[str, Any]]:
            out = await super().scenarios()
            out[0]["warning"] = {"state": "warned", "reason": says}
            return out

    app = ReefApp(Warned(), clock=lambda: NOW)
    async with app.run_test(size=(160, 34)) as pilot:
        for _ in range(200):
            if getattr(app.screen, "loaded", 1):
                break
            await pilot.pause(0.02)
        table = app.screen.query_one(DataTable)
        names = [table.get_row_at(i)[0] for i in range(table.row_count)]
        training = [str(c.label) for c in table.columns.values()].index("training")
        states = {n: table.get_row_at(i)[training] for i, n in enumerate(names)}
        assert states[names[0]] == "WARNING" and all(states[n] != "WARNING" for n in names[1:]), states
        note = str(app.screen.query_one("#note", Static).render())
        assert f"warning on {names[0]}: the reward is rising while the model stops answering" in note, note


def test_degenerate_answers_warn_only_where_the_head_answers_properly() -> None:
    """A tiny model's held-out answers are fragments and loops already (reef demo's head): their share rising while
    it learns an honest task is noise, never a warning; the same rise from a head that answers properly warns."""
    def m(reward: float, degenerate: float, head: float) -> dict[str, Any]:
        return {"batch_reward": reward, "heldout_degenerate": degenerate, "heldout_head_degenerate": head}

    assert warning.detect([m(0.2, 0.1, 0.1), m(0.45, 0.4, 0.1)]) is not None  # a proper head: it warns
    assert warning.detect([m(0.2, 0.6, 0.6), m(0.45, 0.9, 0.6)]) is None  # a head of fragments: noise


# --- reading the chain and writing the warning down, against stand-ins -------------------------------------------


# the old point makes the trend: from it the reward rises 0.3 while the answers fall from 53 tokens to 5; from the
# next one it rises 0.05, no trend
OLD = _step({"batch_reward": 0.2, "tokens": 1700.0})
NEXT = _step({"batch_reward": 0.45, "tokens": 1600.0})
GATE = _step({"batch_reward": 0.5, "tokens": 150.0})


def _rel(t: float, metrics: dict[str, Any], operation: str = "train") -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(created_at=t, metrics=metrics, operation=operation)


class _Chains:
    """A scenario's chain (newest first), its pending candidates and its rejections; each read recorded."""

    def __init__(self, history: list[Any], pending: list[Any] | None = None,
                 rejections: list[Any] | None = None) -> None:
        self.rows = {"history": history, "pending": pending or [], "rejections": rejections or []}
        self.reads: list[tuple[Any, ...]] = []

    async def history(self, name: str, n: int | None = None) -> list[Any]:
        self.reads.append(("history", name, n))
        return list(self.rows["history"])

    async def pending(self, name: str) -> list[Any]:
        self.reads.append(("pending", name))
        return list(self.rows["pending"])

    async def rejections(self, name: str, n: int | None = None) -> list[Any]:
        self.reads.append(("rejections", name, n))
        return list(self.rows["rejections"])


def _read(chains: _Chains, warned: Any = None, weights: bool = True, metrics: Any = None) -> Any:
    import asyncio
    from types import SimpleNamespace

    run = SimpleNamespace(weights=weights, scenario=SimpleNamespace(name="s", warning=warned),
                          metrics=GATE if metrics is None else metrics)
    return asyncio.run(warning.read(SimpleNamespace(chains=chains), run))  # type: ignore[arg-type]


def test_the_trend_is_read_from_the_chain_the_pending_and_the_rejected_in_time_order() -> None:
    """``read``: the candidate at the gate after the newest ``WINDOW - 1`` of the chain's train steps, the pending
    and the rejected candidates, oldest first; each asked of the store with the window. Bugs caught: a source left
    out, the candidates not put in time order, fewer than ``WINDOW - 1`` read."""
    chains = _Chains([_rel(2, NEXT), _rel(1, OLD)])
    found = _read(chains)
    assert found is not None and found["signals"] == ["silent"] and found["figures"]["reward_from"] == 0.2
    assert sorted(chains.reads) == [("history", "s", warning.WINDOW), ("pending", "s"),
                                    ("rejections", "s", warning.WINDOW)]
    assert _read(_Chains([_rel(2, NEXT)])) is None  # from the next one alone: no trend
    assert _read(_Chains([_rel(2, NEXT)], pending=[_rel(1, OLD)])) is not None  # the old one held for review
    assert _read(_Chains([_rel(2, NEXT)], rejections=[_rel(1, OLD)])) is not None  # ...or written down
    assert _read(_Chains([_rel(1, OLD)], pending=[_rel(2, NEXT)])) is not None  # in time order, whatever the source
    assert _read(_Chains([_rel(3, NEXT), _rel(2, NEXT), _rel(1, OLD)])) is not None  # the window's first
    assert _read(_Chains([_rel(4, NEXT), _rel(3, NEXT), _rel(2, NEXT), _rel(1, OLD)])) is None  # past it


def test_the_trend_starts_after_a_rollback_a_clear_and_skips_steps_without_a_reward() -> None:
    """``read``: a rollback or a promote on the chain starts the trend again after it; so does the warning's last
    clear (a step at that very time is before it); a step without ``batch_reward`` is no point of the trend; a
    harness candidate, or a scenario whose warning was accepted, reads nothing. Bugs caught: the rollback not
    read, a step at the clear's time read, steps without a reward read (the trend's first point then has none)."""
    assert _read(_Chains([_rel(3, NEXT), _rel(2, {}, "rollback"), _rel(1, OLD)])) is None
    assert _read(_Chains([_rel(3, NEXT), _rel(2, {}, "rollback")], pending=[_rel(1, OLD)])) is None
    assert _read(_Chains([_rel(3, NEXT), _rel(2, {}, "promote")], rejections=[_rel(1, OLD)])) is None
    assert _read(_Chains([_rel(2, NEXT), _rel(1, OLD)]), warned={"state": "cleared", "since": 1.0}) is None
    assert _read(_Chains([_rel(2, NEXT), _rel(1, OLD)]), warned={"state": "cleared", "since": 0.5}) is not None
    assert _read(_Chains([_rel(3, NEXT), _rel(2, OLD), _rel(1, {"tokens": 1700.0})])) is not None
    for chains, kw in ((_Chains([_rel(2, NEXT), _rel(1, OLD)]), {"weights": False}),
                       (_Chains([_rel(2, NEXT), _rel(1, OLD)]), {"warned": {"state": "accepted", "since": 0.0}})):
        assert _read(chains, **kw) is None and chains.reads == []


def test_a_raised_warning_is_written_down_published_and_logged_with_its_reason(caplog: Any) -> None:
    """``raise_warning`` (through ``after_hold``, as a held candidate's step calls it): the stored state (warned,
    since now, the release and step held, the signals, figures, words and the reason a person reads) written for
    the scenario, the same on ``/reef/events``, the reason in the log; a hold whose trend warns of nothing writes
    nothing."""
    import asyncio
    import logging
    from types import SimpleNamespace

    written: list[tuple[str, Any]] = []
    published: list[tuple[str, dict[str, Any]]] = []

    async def set_warning(name: str, stored: Any) -> None:
        written.append((name, stored))

    host = SimpleNamespace(chains=_Chains([_rel(2, NEXT), _rel(1, OLD)]), set_warning=set_warning,
                           events=SimpleNamespace(publish=lambda kind, **data: published.append((kind, data))))
    run = SimpleNamespace(weights=True, scenario=SimpleNamespace(name="s", warning=None), metrics=GATE)
    before = time.time()
    with caplog.at_level(logging.WARNING, logger="reef.warning"):
        asyncio.run(warning.after_hold(host, run, SimpleNamespace(release_id="rel_9", step=9)))  # type: ignore[arg-type]
    found = warning.detect([OLD, NEXT, GATE])
    assert found is not None and len(written) == 1 and written[0][0] == "s"
    stored = written[0][1]
    assert before <= stored["since"] <= time.time() and before <= stored["at"] <= time.time()  # (two reads)
    assert stored == {"state": "warned", "since": stored["since"], "at": stored["at"], "release_id": "rel_9",
                      "step": 9, "signals": found["signals"], "figures": found["figures"], "says": found["says"],
                      "evidence": found["evidence"], "reason": warning.text("s", found)}
    assert published == [("warning", {"scenario": "s", "state": "warned", "release_id": "rel_9",
                                      "says": found["says"], "reason": stored["reason"],
                                      "signals": found["signals"], "figures": found["figures"]})]
    assert f"scenario s: {stored['reason']}" in caplog.text
    host.chains = _Chains([_rel(2, NEXT)])
    asyncio.run(warning.after_hold(host, run, SimpleNamespace(release_id="rel_9", step=9)))  # type: ignore[arg-type]
    assert len(written) == 1 and len(published) == 1


def test_the_user_clears_accepts_or_updates_a_warning_as_each_says() -> None:
    """``clear``: resumed or updated, a standing warning becomes ``cleared`` from now (what it was kept); accepted,
    ``accepted``; each said on the events. A resume with no warning standing, or an update of a scenario never
    warned, changes nothing; accepting none is a conflict. ``state``, ``since`` and ``standing`` read it back.
    Bugs caught: a state written for nothing to clear, the accepted state for a resume, the previous warning not
    kept, an accept of nothing taken."""
    import asyncio
    from types import SimpleNamespace

    from daemon.errors import Conflict
    from daemon.records.scenarios import Scenario

    warned = {"state": "warned", "since": 5.0, "at": 5.0, "says": "it stops answering", "release_id": "rel_3"}

    class Store:
        def __init__(self, warning_: Any) -> None:
            self.scenario = Scenario("s", "r", "m", 0.0, {}, warning=warning_)
            self.written: list[Any] = []
            self.scenarios = SimpleNamespace(get=self.get, set_warning=self.set_warning, warned=self.all)

        async def get(self, name: str) -> Any:
            return self.scenario

        async def set_warning(self, name: str, new: Any) -> Any:
            self.written.append(new)
            self.scenario = Scenario("s", "r", "m", 0.0, {}, warning=new)
            return self.scenario

        async def all(self) -> list[Any]:
            return [self.scenario]

    def clear(warning_: Any, how: str) -> tuple[Store, list[Any], Any]:
        store, events = Store(warning_), []
        out = asyncio.run(warning.clear(store, SimpleNamespace(publish=lambda kind, **d: events.append((kind, d))),
                                        "s", how))
        return store, events, out

    for how, state in (("resumed", "cleared"), ("updated", "cleared"), ("accepted", "accepted")):
        before = time.time()
        store, events, out = clear(warned, how)
        new = store.written[0]
        assert new == {"state": state, "since": new["since"], "how": how,
                       "was": {"says": "it stops answering", "release_id": "rel_3", "at": 5.0}}, how
        assert before <= new["since"] <= time.time() and out.warning == new
        assert events == [("warning", {"scenario": "s", "state": state, "how": how})]
        assert warning.state(out.warning) == state and warning.since(out.warning) == new["since"]
        assert asyncio.run(warning.standing(store)) == {"s": new}
    for previous, how in ((None, "resumed"), ({"state": "cleared", "since": 7.0}, "resumed"), (None, "updated")):
        store, events, out = clear(previous, how)
        assert store.written == [] and events == [] and out.warning == previous, (previous, how)
    store, events, out = clear({"state": "accepted", "since": 7.0}, "updated")  # new settings: warned again
    assert store.written[0]["state"] == "cleared" and "was" not in store.written[0] and len(events) == 1
    for previous in (None, {"state": "cleared", "since": 7.0}):
        with pytest.raises(Conflict):
            clear(previous, "accepted")
    assert warning.state(None) == "none" and warning.since(None) == 0.0 and warning.since({"state": "x"}) == 0.0


def test_each_signal_fires_at_its_bound_and_not_short_of_it() -> None:
    """``detect``'s bounds, each met exactly and missed: degenerate answers rising by ``DEGENERATE_RISE`` (0.25)
    from a head at ``NOISE_HEAD`` (0.5) itself, answers falling to ``SHORT_TOKENS`` (6) from more than twice that,
    entropy to a third; the entropy beside a signal only when it fell that far; two signals said as one and an
    "also". Bugs caught: a bound moved or a comparison made strict, the rise read as a quotient, "also" said
    wrongly."""
    def deg(reward: float, degenerate: float, head: float) -> dict[str, Any]:
        return {"batch_reward": reward, "heldout_degenerate": degenerate, "heldout_head_degenerate": head}

    assert warning.detect([deg(0.2, 0.0, 0.0), deg(0.45, 0.25, 0.0)]) is not None  # 0.25: the bound itself
    assert warning.detect([deg(0.2, 0.1, 0.1), deg(0.45, 0.3, 0.1)]) is None  # a rise of 0.2
    assert warning.detect([deg(0.2, 0.5, 0.5), deg(0.45, 0.8, 0.5)]) is not None  # a head at NOISE_HEAD is read

    def short(first: float, last: float) -> dict[str, Any] | None:
        return warning.detect([_step({"batch_reward": 0.2, "tokens": 32 * first}),
                               _step({"batch_reward": 0.5, "tokens": 32 * last})])

    assert short(13, 6) is not None and short(12, 6) is None and short(13, 6.5) is None

    def entropy(first: float, last: float) -> dict[str, Any] | None:
        return warning.detect([dict(HACKED[0], entropy=first), dict(HACKED[2], entropy=last)])

    third, more = entropy(3.0, 1.0), entropy(3.0, 1.1)
    assert third is not None and third["signals"] == ["silent", "entropy"]
    assert third["says"].endswith("(also: the model's answers collapse into one pattern)"), third["says"]
    assert more is not None and more["signals"] == ["silent"] and "also" not in more["says"]


def test_the_degenerate_share_leaves_out_answers_only_cut_short_and_reads_what_is_there() -> None:
    """``Point.of``: the held-out degenerate share less the cut-short ones (degenerate - silent + empty, at least
    0), the share as written where the parts are not all there; the head's the same. Bugs caught: the parts
    combined otherwise, the guard read backwards."""
    p = warning.Point.of({"heldout_degenerate": 0.5, "heldout_silent": 0.3, "heldout_empty": 0.1,
                          "heldout_head_degenerate": 0.2, "heldout_head_silent": 0.3, "heldout_head_empty": 0.0})
    assert p.degenerate == pytest.approx(0.3) and p.head_degenerate == 0.0 and p.silent == 0.1
    assert warning.Point.of({"heldout_degenerate": 0.5, "heldout_silent": 0.3}).degenerate == 0.5
    assert warning.Point.of({"heldout_degenerate": 0.5}).degenerate == 0.5
    assert warning.Point.of({"heldout_silent": 0.3, "heldout_empty": 0.1}).degenerate is None
    # a ratio with no numerator or a zero denominator is not measured
    assert warning.Point.of({"samples": 2.0}).answer_tokens is None
    assert warning.Point.of({"tokens": 5.0, "samples": 0.0}).answer_tokens is None
    assert warning.Point.of({"tokens": 5.0, "samples": 2.0}).answer_tokens == 2.5
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):  # a point read is not changed
        p.reward = 1.0  # type: ignore[misc]


def test_the_held_out_length_falls_from_the_heads_and_the_sampled_from_the_first_steps() -> None:
    """The held-out answers' length is read against the head the trend started from (``heldout_head_tokens``), the
    sampled answers' against the first step's own: a first candidate already short (5 tokens against its head's
    30) that stays short warns; its sampled answers, 5 tokens then 4, do not (the head's 30 is no baseline of
    theirs). Bug caught: the head's baseline
    given to the wrong length."""
    first = {"batch_reward": 0.2, "heldout_tokens": 5.0, "heldout_head_tokens": 30.0, "tokens": 5.0, "samples": 1.0}
    last = {"batch_reward": 0.5, "heldout_tokens": 4.0, "tokens": 4.0, "samples": 1.0}
    found = warning.detect([first, last])
    assert found is not None and "held-out answers (tokens) 30.0 -> 4.0" in found["evidence"], found
    assert "sampled answers" not in found["evidence"]
    assert warning.detect([dict(first, heldout_head_tokens=None), last]) is None  # from its own 5: no fall


def test_silence_is_excused_from_three_empty_answers_and_an_unscored_count_is_no_evidence() -> None:
    """``MIN_EMPTY`` (3) empty answers scored below the rest are enough to say the scorer punishes silence; a step
    that counted empty answers but wrote no score for them says nothing of it. Bugs caught: ``<=`` for ``<`` at
    ``MIN_EMPTY``, a count without a score read (a crash on None)."""
    demo = [_heldout(0.06, 0.0, 0.0, (0.0, 0.0)), _heldout(0.12, 0.06, 0.0, (0.0, 0.0)),
            _heldout(0.25, 0.18, 0.0, (0.0, 0.0))]
    three = [dict(m, batch_empty=k, batch_empty_reward=0.0, batch_rest_reward=0.2)
             for m, k in zip(demo, (0.0, 1.0, 2.0), strict=True)]
    assert warning.detect(three) is None
    unscored = [dict(m, batch_empty=3.0, batch_rest_reward=0.2) for m in demo]  # counted, never scored
    assert warning.detect(unscored) is not None
    from types import SimpleNamespace

    assert warning.batch_figures([SimpleNamespace(score=1 / 3, token_ids=[5, 2])])["batch_reward"] == 0.3333


def test_a_change_of_exactly_a_bound_counts_whatever_its_floating_point() -> None:
    """The figures are written to 4 places, and their differences are judged so: a reward from 0.2 to 0.3 rose by
    ``RISE`` (0.1) though ``0.3 - 0.2`` is 0.09999999999999998; probe accuracy from 70% to 55% fell by
    ``PROBE_FALL``; degenerate answers from 10% to 35% rose by ``DEGENERATE_RISE``; entropy from 0.6 to 0.2 fell to
    a third; empty answers scoring 0.2 against the rest's 0.3 are punished by ``PUNISHED``. Bug caught (the code's
    own, found by the mutation run: ``<=`` for ``<`` at ``RISE`` survived): each of these missed its bound by the
    last bit, so a change the docstring says warns did not."""
    rise = [_heldout(0.2, 0.0, 0.70), _heldout(0.3, 0.0, 0.40)]
    assert warning.detect(rise) is not None
    forgets = [_heldout(0.2, 0.0, 0.70), _heldout(0.4, 0.0, 0.55)]
    found = warning.detect(forgets)
    assert found is not None and found["signals"] == ["forgets"], found
    degenerate = [{"batch_reward": 0.2, "heldout_degenerate": 0.1, "heldout_head_degenerate": 0.1},
                  {"batch_reward": 0.45, "heldout_degenerate": 0.35}]
    assert warning.detect(degenerate) is not None
    entropy = warning.detect([dict(HACKED[0], entropy=0.6), dict(HACKED[2], entropy=0.2)])
    assert entropy is not None and "entropy" in entropy["signals"], entropy
    demo = [_heldout(0.06, 0.0, 0.0, (0.0, 0.0)), _heldout(0.12, 0.06, 0.0, (0.0, 0.0)),
            _heldout(0.25, 0.18, 0.0, (0.0, 0.0))]
    punished = [dict(m, batch_empty=k, batch_empty_reward=0.2, batch_rest_reward=0.3)
                for m, k in zip(demo, (0.0, 2.0, 3.0), strict=True)]
    assert warning.detect(punished) is None
    # ...and a change short of a bound by a figure's last place (0.0001) is short of it
    assert warning.detect([_heldout(0.2, 0.0, 0.70), _heldout(0.2999, 0.0, 0.40)]) is None
    assert warning.detect([degenerate[0], dict(degenerate[1], heldout_degenerate=0.3499)]) is None
    near = warning.detect([dict(HACKED[0], entropy=3.0), dict(HACKED[2], entropy=1.0004)])
    assert near is not None and "entropy" not in near["signals"]
    assert warning.detect([dict(m, batch_empty_reward=0.2001) for m in punished]) is not None
    assert warning.detect([_heldout(0.2, 0.05, 0.7, (0.05, 0.7)), _heldout(0.5, 0.1999, 0.7)]) is None  # 0.1499
    assert warning.detect([_heldout(0.2, 0.0, 0.7), _heldout(0.5, 0.0, 0.5501)]) is None  # probes: 0.1499


def test_the_warnings_figures_and_evidence_say_what_moved() -> None:
    """``detect``'s figures: the reward and each figure read, first and last, to 4 places; the groups that all
    scored alike named as evidence only when they rose; silence rising by exactly ``SILENT_RISE`` fires. Bugs
    caught: a figure rounded otherwise, groups named when they held or fell."""
    first = {"batch_reward": 0.123456, "heldout_empty": 0.011111, "heldout_head_empty": 0.011111, "groups": 4.0,
             "degenerate_groups": 1.0}
    last = {"batch_reward": 0.654321, "heldout_empty": 0.222222, "groups": 4.0, "degenerate_groups": 1.0}
    found = warning.detect([first, last])
    assert found is not None and found["figures"] == {"steps": 2, "reward_from": 0.1235, "reward_to": 0.6543,
                                                      "silent_from": 0.0111, "silent_to": 0.2222}, found["figures"]
    assert "groups that all scored alike" not in found["evidence"]  # held at 25%
    rose = warning.detect([first, dict(last, degenerate_groups=2.0)])
    assert rose is not None and "groups that all scored alike 25% -> 50%" in rose["evidence"]
    assert "groups" not in str(warning.detect([first, dict(last, degenerate_groups=0.0)])["evidence"])  # type: ignore[index]
    edge = [{"batch_reward": 0.2, "heldout_empty": 0.05}, {"batch_reward": 0.5, "heldout_empty": 0.2}]
    assert warning.detect(edge) is not None  # 0.2 - 0.05 is SILENT_RISE
    # no reward at either end: no trend (a step whose metrics lack it)
    assert warning.detect([{"heldout_empty": 0.0}, {"batch_reward": 0.5, "heldout_empty": 0.5}]) is None
    assert warning.detect([{"batch_reward": 0.2, "heldout_empty": 0.0}, {"heldout_empty": 0.5}]) is None
    # a figure the first point lacks is not compared (no baseline), whatever the last says
    assert warning.detect([{"batch_reward": 0.2}, {"batch_reward": 0.5, "heldout_empty": 0.5}]) is None


def test_the_scorers_view_of_silence_is_the_weighted_mean_of_empty_answers_against_the_mean_of_the_rest() -> None:
    """``_silence_punished`` through ``detect``: the empty answers' mean score weighted by their count, the rest's
    mean over the steps; empty answers at 0.05 against 0.2 are punished, at 0.25 against 0.3 are not. And
    ``batch_figures`` writes each mean to 4 places. Bugs caught: the mean multiplied by the count, the rest's
    summed to a power."""
    from types import SimpleNamespace

    demo = [_heldout(0.06, 0.0, 0.0, (0.0, 0.0)), _heldout(0.12, 0.06, 0.0, (0.0, 0.0)),
            _heldout(0.25, 0.18, 0.0, (0.0, 0.0))]

    def batches(empty_reward: float, rest: float) -> list[dict[str, Any]]:
        return [dict(m, batch_empty=k, **({"batch_empty_reward": empty_reward} if k else {}), batch_rest_reward=rest)
                for m, k in zip(demo, (0.0, 2.0, 3.0), strict=True)]

    assert warning.detect(batches(0.05, 0.2)) is None  # punished: silence is no reward
    assert warning.detect(batches(0.25, 0.3)) is not None  # 0.05 lower: not punished
    got = warning.batch_figures([SimpleNamespace(score=s, token_ids=t) for s, t in (
        (1 / 3, [2]), (0.0, [2]), (1 / 3, [5, 2]), (1.0, [5, 2]), (0.0, [5, 6, 2]))])
    assert got == {"batch_reward": 0.3333, "batch_empty": 2.0, "batch_empty_reward": 0.1667,
                   "batch_rest_reward": 0.4444}
