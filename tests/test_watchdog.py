"""The reward-hacking watchdog (``daemon/watchdog.py``): a weights candidate whose training reward keeps rising
while its held-out score falls is held for review, with the figures; a healthy run is published. Through a real
daemon and its trainer worker, with a recipe whose held-out score is scripted per step."""

from __future__ import annotations

from typing import Any

from daemon import watchdog
from tests.conftest import Daemon
from tests.test_learning import releases, wait_for
from tests.test_recipes import recipe_dir, with_recipe_paths  # noqa: F401 - the fixture, used by name

DRIFTING = '''
import shutil
from dataclasses import dataclass
from pathlib import Path

from recipes.base import Candidate, GateSettings, Recipe, Scores


@dataclass
class Settings(GateSettings):
    falling: bool = True  # the held-out score falls as the batch's reward rises (a hacked reward), or rises with it


class Drifting(Recipe):
    """A weights recipe whose step nudges every weight and reports a held-out score scripted from its batch's
    reward."""

    name = "drifting"
    kind = "weights"
    source = "scores"
    Settings = Settings

    def batch(self, records):
        return records[:2] if len(records) >= 2 else None

    def train(self, job, state):
        from safetensors.torch import load_file, save_file

        base, out = Path(job.base_path), Path(job.work_dir)
        for f in base.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copyfile(f, out / f.name)
        reward = sum(r.score for r in job.batch) / len(job.batch)
        weights = {k: v + 1e-3 * reward for k, v in load_file(base / "model.safetensors").items()}
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        held = 1.0 - reward if job.settings["falling"] else reward
        return Candidate(metrics={}, eval=Scores(candidate=[held] * 4, base=[held] * 4))
'''


def test_the_decision_needs_both_a_rise_and_a_fall_over_the_window() -> None:
    def m(train: float, held: float) -> dict[str, float]:
        return {"batch_reward": train, "eval_reward": held}

    hacked = [m(0.8, 0.6), m(0.5, 0.7), m(0.2, 0.8)]  # newest first
    assert watchdog.check(hacked, m(0.95, 0.5)) is not None
    assert watchdog.check(hacked[:2], m(0.95, 0.5)) is None  # not enough steps yet
    assert watchdog.check([m(0.8, 0.8), m(0.5, 0.7), m(0.2, 0.6)], m(0.95, 0.9)) is None  # both rise: healthy
    assert watchdog.check([m(0.2, 0.6), m(0.2, 0.7), m(0.2, 0.8)], m(0.2, 0.5)) is None  # held falls alone
    assert watchdog.check([{"batch_reward": 0.5}] * 3, m(0.9, 0.1)) is None  # no held-out score: nothing to judge
    # one step of the window without its held-out score: the window is not whole, nothing is judged (not the rise
    # and fall of the steps around it)
    assert watchdog.check([hacked[0], {"batch_reward": 0.5}, hacked[2]], m(0.95, 0.5)) is None


def test_with_four_published_steps_the_newest_three_are_the_window() -> None:
    """The window is the newest ``WINDOW`` published steps and the candidate: an older step neither starts a hold
    nor prevents one (the chain passed newest first, as the learner reads it)."""
    def m(train: float, held: float) -> dict[str, float]:
        return {"batch_reward": train, "eval_reward": held}

    assert watchdog.WINDOW == 3
    hacked = [m(0.8, 0.6), m(0.5, 0.7), m(0.2, 0.8)]  # newest first: training up 0.75, held-out down 0.3
    alarm = watchdog.check([*hacked, m(0.9, 0.4)], m(0.95, 0.5))  # from the oldest it rose 0.05 only
    assert alarm is not None and (alarm["train_from"], alarm["held_from"], alarm["steps"]) == (0.2, 0.8, 4), alarm
    flat = [m(0.5, 0.6)] * 3
    assert watchdog.check([*flat, m(0.2, 0.9)], m(0.55, 0.55)) is None  # only from the oldest would it hold


def test_a_rise_and_a_fall_of_exactly_the_bounds_hold_with_the_figures_and_reason_in_full() -> None:
    """Training reward up exactly ``RISE`` (0.0 -> 0.1) while held-out is down exactly ``FALL`` (0.05 -> 0.0): held
    (the bounds are "at least"), measured from the oldest step of the window to the candidate, and said so. Bugs
    caught: ``>`` for ``>=``, the rise read from the step before the candidate, the figures or the reason naming
    other steps or another window."""
    def m(train: float, held: float) -> dict[str, float]:
        return {"batch_reward": train, "eval_reward": held}

    published = [m(0.05, 0.02), m(0.02, 0.03), m(0.0, 0.05)]  # newest first
    alarm = watchdog.check(published, m(0.1, 0.0))
    assert alarm == {"train_from": 0.0, "train_to": 0.1, "held_from": 0.05, "held_to": 0.0, "steps": 4,
                     "reason": "watchdog: training reward rose 0.000 -> 0.100 over 4 steps while held-out fell "
                               "0.050 -> 0.000; held for review (reef releases promote ID publishes it)"}
    assert watchdog.check(published, m(0.0999, 0.0)) is None and watchdog.check(published, m(0.1, 0.0001)) is None


def test_a_drift_of_exactly_max_kl_is_not_held() -> None:
    assert watchdog.check([], {"kl_from_base": 0.2}, max_kl=0.2) is None  # at the bound: within it
    assert watchdog.check([], {"kl_from_base": 0.2000001}, max_kl=0.2) is not None


def test_a_gate_that_scores_the_problem_trained_on_is_not_read_as_held_out() -> None:
    """ttt-discover's gate samples fresh attempts at the very problem it trains on: its eval_reward is no held-out
    score, so the same rise-and-fall (its sampling noise: 0.318 -> 0.237 over four steps held a healthy search for
    review, and nothing was ever asked to promote it) holds nothing there; the drift bound still holds."""
    from recipes import load_recipe

    def m(train: float, held: float) -> dict[str, float]:
        return {"batch_reward": train, "eval_reward": held}

    noisy = [m(0.30, 0.30), m(0.25, 0.28), m(0.156, 0.318)]  # newest first
    assert watchdog.check(noisy, m(0.349, 0.237)) is not None  # read as held out, it would hold
    ttt = load_recipe("ttt-discover")
    assert ttt.held_out_eval is False and load_recipe("online-rl").held_out_eval is True
    assert watchdog.check(noisy, m(0.349, 0.237), held_out=ttt.held_out_eval) is None
    drifted = {**m(0.349, 0.237), "kl_from_base": 0.3}
    assert watchdog.check(noisy, drifted, max_kl=0.2, held_out=False) is not None


def test_a_hacked_run_is_held_and_a_healthy_one_published(daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    (recipe_dir / "drifting.py").write_text(DRIFTING)
    d: Daemon = with_recipe_paths(daemon_factory, recipe_dir)
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with d.http() as c:
        for name in ("hacked", "healthy"):
            assert c.post("/reef/scenarios", json={"name": name, "recipe": "drifting:Drifting",
                                                   # straight to the head: this test is about the watchdog
                                                   "settings": {"falling": name == "hacked", "canary_share": 0}}
                          ).status_code == 201
            for step, score in enumerate((0.2, 0.5, 0.8, 0.95), start=1):
                for _ in range(2):
                    rec = c.post(f"/s/{name}/v1/chat/completions", json=ask).headers["x-reef-agent-record-id"]
                    assert c.post("/reef/report", json={"references": [rec], "score": score}).status_code == 201
                wait_for(lambda s=step, n=name: (x := releases(c, n, True))["releases"][0]["step"] == s
                         or len(x.get("pending", [])) > 0, what=f"step {step} of {name}")
        hacked = releases(c, "hacked", True)
        assert hacked["releases"][0]["step"] == 3 and len(hacked["pending"]) == 1
        held = hacked["pending"][0]
        assert held["metrics"]["watchdog"].startswith("watchdog: training reward rose 0.200 -> 0.950")
        assert "held-out fell 0.800 -> 0.050" in held["metrics"]["watchdog"]
        healthy = releases(c, "healthy", True)
        assert healthy["releases"][0]["step"] == 4 and healthy["pending"] == []


def test_a_policy_past_max_kl_from_its_base_is_held() -> None:
    cand = {"batch_reward": 0.5, "kl_from_base": 0.3}
    alarm = watchdog.check([], cand, max_kl=0.2)
    assert alarm is not None and alarm["kl_from_base"] == 0.3 and "more than max_kl 0.2" in alarm["reason"]
    assert watchdog.check([], cand, max_kl=0.5) is None  # within the bound
    assert watchdog.check([], cand) is None  # no bound: measured, never held
    assert watchdog.check([], {"batch_reward": 0.5}, max_kl=0.2) is None  # whole weights: nothing measured


def test_online_rl_holds_a_lora_candidate_that_drifted_past_max_kl(daemon_factory: Any) -> None:
    """Through the daemon: every LoRA step's metrics carry kl_from_base; with max_kl below it the candidate is
    held for review with the figures (the same batch with no bound publishes); a bound that could never be
    measured (whole weights) or is not above 0 is refused."""
    from tests.test_learning import serve_and_report, settings_toml

    d: Daemon = daemon_factory(settings_toml(lr=0.05))
    with d.http() as c:
        for name, extra in (("drifted", {"max_kl": 1e-9}), ("free", {})):
            made = c.post("/reef/scenarios", json={"name": name, "recipe": "online-rl",
                                                   "settings": {"lora": True, "lora_rank": 4, **extra}})
            assert made.status_code == 201, made.text
            serve_and_report(c, name, 4)
        held = wait_for(lambda: releases(c, "drifted", True)["pending"], what="the drifted candidate held")[0]
        assert held["metrics"]["kl_from_base"] > 1e-9
        assert "nats per token from its base model" in held["metrics"]["watchdog"]
        published = wait_for(lambda: (r := releases(c, "free"))["releases"][0]["operation"] == "train" and r,
                             what="the unbounded one published")["releases"][0]
        assert published["metrics"]["kl_from_base"] > 0
        assert releases(c, "drifted")["releases"][0]["operation"] == "init"  # the head did not move
        for bad in ({"max_kl": 0.1, "lora": False}, {"max_kl": 0}):
            r = c.post("/reef/scenarios", json={"name": "bad", "recipe": "online-rl", "settings": bad})
            assert r.status_code == 400 and "max_kl" in r.text, r.text


def test_through_the_daemon_figures_from_before_a_rollback_do_not_count(daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    """Three hacked steps published (training reward 0.2 -> 0.8, held-out 0.8 -> 0.2: the next such step would be
    held, as above), then a person rolls back: what the rolled-back steps showed is no trend of the policy that
    serves now, so the next step (0.95, held-out 0.05) is published. Through the daemon's learner and its public
    routes (the window is built in ``daemon/learning.py``: the train steps since the last rollback or promote)."""
    (recipe_dir / "drifting.py").write_text(DRIFTING)
    d: Daemon = with_recipe_paths(daemon_factory, recipe_dir)
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

    def step(c: Any, score: float, done: Any, what: str) -> Any:
        for _ in range(2):
            rec = c.post("/s/rolled/v1/chat/completions", json=ask).headers["x-reef-agent-record-id"]
            assert c.post("/reef/report", json={"references": [rec], "score": score}).status_code == 201
        def ready() -> Any:
            x = releases(c, "rolled", True)
            return x if done(x) else None

        return wait_for(ready, what=what)

    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "rolled", "recipe": "drifting:Drifting",  # no canary: the
                                               "settings": {"canary_share": 0}}).status_code == 201  # watchdog's test
        for n, score in enumerate((0.2, 0.5, 0.8), start=1):
            step(c, score, lambda x, n=n: x["releases"][0]["step"] == n or x["pending"], f"step {n}")
        chain = releases(c, "rolled", True)
        assert [r["operation"] for r in chain["releases"]] == ["train"] * 3 + ["init"] and chain["pending"] == []
        first = chain["releases"][2]["release_id"]
        back = c.post("/reef/scenarios/rolled/rollback", json={"release_id": first,
                                                               "expected_head": chain["head"]})
        assert back.status_code == 201, back.text
        after = step(c, 0.95, lambda x: x["releases"][0]["operation"] == "train" or x["pending"], "the step after")
        assert after["pending"] == [], after["pending"][0]["metrics"].get("watchdog")
        top = after["releases"][0]
        assert top["operation"] == "train" and top["metrics"]["batch_reward"] == 0.95
        assert after["releases"][1]["operation"] == "rollback"
