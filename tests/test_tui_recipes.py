"""The TUI's training screen shows the recipes' own metrics, from the daemon's events: sao's value loss, and
ttt-discover's best attempt so far with the release that served it (Textual's Pilot against a real daemon)."""

from __future__ import annotations

from typing import Any

from reef_cli.tui.format import recipe_summary
from reef_cli.tui.screens import TrainingScreen
from tests.conftest import Daemon
from tests.test_learning import releases, wait_for
from tests.test_tui import SIZE, loaded, make_app, plain, until


def test_recipe_summary_reads_value_loss_and_the_best_attempt() -> None:
    steps = [{"metrics": {"value_loss": 0.5}}, {"metrics": {"value_loss": 0.1, "batch_best": 0.4,
                                                             "batch_best_release": "aaaaaaaaaaaaaaaa"}},
             {"metrics": {"batch_best": 0.9, "batch_best_release": "bbbbbbbbbbbbbbbb"}}, {"metrics": {"batch_best": 0.2}},
             {"metrics": {"loss": 1.0}}]
    assert recipe_summary(steps) == "value loss 0.3   best attempt 0.9 (release bbbbbbbbbb)"
    assert recipe_summary(steps, window=1) == "value loss 0.1   best attempt 0.9 (release bbbbbbbbbb)"
    assert recipe_summary([{"metrics": {"loss": 1.0, "batch_reward": 0.5}}]) == ""  # online-rl: nothing more


async def test_the_training_screen_shows_value_loss_for_sao_and_the_best_attempt_for_ttt(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory('\n[recipes.ttt-discover]\ncanary_share = 0\ngroup_size = 2\n\n[recipes.sao]\ncanary_share = 0\n')
    receipts: dict[str, list[str]] = {"s": [], "t": []}
    with d.http() as c:
        for name, recipe in (("s", "sao"), ("t", "ttt-discover")):
            assert c.post("/reef/scenarios", json={"name": name, "recipe": recipe}).status_code == 201
        for i, score in enumerate((0.5, 1.0)):  # sao: the first seeds the critic, the second trains
            r = c.post("/s/s/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "messages": [
                {"role": "user", "content": f"Say w{i}."}]})
            receipts["s"].append(r.headers["x-reef-agent-record-id"])
            assert c.post("/reef/report", json={"score": score, "references": receipts["s"][-1:]}).status_code == 201
            wait_for(lambda i=i: len(releases(c, "s", True)["rejected"]) + len(releases(c, "s")["releases"]) == i + 2,
                     what=f"sao step {i}")
        for score in (0.25, 0.75):
            r = c.post("/s/t/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "messages": [
                {"role": "user", "content": "Say one long word."}]})
            receipts["t"].append(r.headers["x-reef-agent-record-id"])
            served_by = r.headers["x-reef-release-id"]
            assert c.post("/reef/report", json={"score": score, "references": receipts["t"][-1:],
                                                "metadata": {"group": "round-1"}}).status_code == 201
        wait_for(lambda: releases(c, "t")["releases"][0]["step"] == 1, what="the ttt step")

    app = make_app(d)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.screen.loaded, what="scenarios")
        await pilot.press("t")
        training = await loaded(pilot, TrainingScreen)
        state = await until(pilot, lambda: "best attempt" in (s := plain(training.query_one("#state"))) and s,
                            what="the recipes' metrics, replayed from the event history")
        assert "value loss" in state and f"best attempt 0.75 (release {served_by[:10]})" in state
