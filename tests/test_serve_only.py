"""Serve-only traffic and a scenario's learning switches, through a real daemon, its trainer worker and the CLI:
``x-reef-capture: false`` and a serve-only scenario answer with a receipt and are never trained on, a report marked
``metadata.training.eligible = false`` stays out of training, and a paused scenario takes no step until resumed,
then learns from what came meanwhile. Both recipe kinds (weights: scores; harness: written feedback)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Daemon, assert_canonical_error
from tests.test_learning import releases, wait_for
from tests.test_recipes import recipe_dir, with_recipe_paths  # noqa: F401 - the fixture, used by name

ASK = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}


def serve(c: httpx.Client, scenario: str, **headers: str) -> str:
    r = c.post(f"/s/{scenario}/v1/chat/completions", json=ASK, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers["x-reef-agent-record-id"]


def report(c: httpx.Client, receipt: str, **extra: Any) -> None:
    r = c.post("/reef/report", json={"references": [receipt], "score": 1.0, **extra})
    assert r.status_code == 201, r.text


def state(c: httpx.Client, scenario: str) -> str | None:
    return c.get("/reef/status").json()["learning"].get(scenario)


def test_serve_only_traffic_and_ineligible_reports_never_train_and_a_paused_scenario_waits(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d: Daemon = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "so", "recipe": "rwl:RewardWeighted",  # no canary: this is
                                               "settings": {"batch_size": 2, "canary_share": 0}, "paused": True})
        assert made.status_code == 201 and made.json()["paused"] is True and made.json()["capture"] is True, made.text
        # refused, never taken for either value
        bad = c.post("/s/so/v1/chat/completions", json=ASK, headers={"x-reef-capture": "maybe"})
        assert "x-reef-capture" in assert_canonical_error(bad, 400)["message"]
        # oldest first: without the filters these four would make the first batch
        answered = c.post("/s/so/v1/chat/completions", json=ASK, headers={"x-reef-capture": "false"})
        assert answered.status_code == 200 and answered.headers["x-reef-capture"] == "false"
        off = [answered.headers["x-reef-agent-record-id"], serve(c, "so", **{"x-reef-capture": "FALSE"})]
        ineligible = [serve(c, "so"), serve(c, "so")]
        kept = [serve(c, "so", **{"x-reef-capture": "true"}), serve(c, "so")]
        assert "x-reef-capture" not in c.post("/s/so/v1/chat/completions", json=ASK).headers
        for receipt in off:
            report(c, receipt)
        for receipt in ineligible:
            report(c, receipt, metadata={"training": {"eligible": False}})
        bad = c.post("/reef/report", json={"references": kept[:1], "score": 1.0, "metadata": {"training": "no"}})
        assert "metadata.training" in assert_canonical_error(bad, 400)["message"]
        for receipt in kept:
            report(c, receipt)
        assert [c.get(f"/reef/records/{r}").json()["capture"] for r in off + kept] == [False, False, True, True]
        # paused: the reports are in, the learner looked and waits
        wait_for(lambda: state(c, "so") == "paused", what="the learner to see the pause")
        assert releases(c, "so")["releases"][0]["step"] == 0
        listed = {s["name"]: s for s in c.get("/reef/scenarios").json()["scenarios"]}["so"]
        assert listed["serve_only"] == 2 and listed["paused"] is True
        d.cli("scenarios", "resume", "so")
        head = wait_for(lambda: (x := releases(c, "so")["releases"][0])["step"] == 1 and x, what="a release")
        assert sorted(head["receipts"]) == sorted(kept)
        # a serve-only scenario: every exchange from now on, whatever the request says
        out = d.cli("scenarios", "capture", "so", "off")
        assert "serve-only" in out.stdout
        later = serve(c, "so", **{"x-reef-capture": "true"})
        assert c.get(f"/reef/records/{later}").json()["capture"] is False
        assert d.cli("scenarios", "capture", "so", "sideways", check=False).returncode == 2
        assert c.post("/reef/scenarios/so/capture", json={"capture": "off"}).status_code == 400
        assert c.post("/reef/scenarios/nope/pause", json={}).status_code == 404


def test_a_harness_recipe_never_learns_from_feedback_on_serve_only_traffic(daemon_factory: Any,
                                                                          recipe_dir: Any) -> None:  # noqa: F811
    d: Daemon = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "nt", "recipe": "plugins:Notes", "model": "tiny",
                                               "capture": False}).status_code == 201
        serve_only = serve(c, "nt")  # the scenario's switch, no header
        c.post("/reef/scenarios/nt/capture", json={"capture": True}).raise_for_status()
        captured = serve(c, "nt")
        for receipt, words, meta in ((serve_only, "from serve-only traffic", None),
                                     (captured, "kept out by the user", {"training": {"eligible": False}}),
                                     (captured, "run the tests first", None)):
            r = c.post("/reef/report", json={"references": [receipt], "feedback": words,
                                             **({"metadata": meta} if meta else {})})
            assert r.status_code == 201, r.text
        wait_for(lambda: "run the tests first" in c.get("/reef/scenarios/nt/harness").json()["files"].get(
            "AGENTS.md", ""), what="the harness release")
        text = c.get("/reef/scenarios/nt/harness").json()["files"]["AGENTS.md"]
        assert "serve-only" not in text and "kept out" not in text, text


WAITING = '''
import time
from pathlib import Path

from recipes.base import Candidate, Recipe


class Waiting(Recipe):
    """A weights recipe whose step waits for a file the test writes: a step that is out for as long as needed."""

    name = "waiting"
    kind = "weights"
    source = "scores"

    def batch(self, records):
        return records[:1] or None

    def train(self, job, state):
        go = Path(job.base_path).parent.parent / "go"
        while not go.exists():
            time.sleep(0.05)
        for f in Path(job.base_path).iterdir():  # its base again: the step is written down as changing nothing
            if f.is_file():
                (Path(job.work_dir) / f.name).write_bytes(f.read_bytes())
        return Candidate(metrics={"waited": 1})
'''


def test_archiving_is_refused_while_a_step_is_out_then_stops_serving_and_keeps_what_was_recorded(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    (recipe_dir / "waiting.py").write_text(WAITING)
    d: Daemon = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "ar", "recipe": "waiting:Waiting"}).status_code == 201
        receipt = serve(c, "ar")
        report(c, receipt)
        wait_for(lambda: state(c, "ar") == "training", what="the step to start")
        err = assert_canonical_error(c.post("/reef/scenarios/ar/archive", json={}), 409)
        assert "training step under way (step 1)" in err["message"], err
        refused = d.cli("scenarios", "archive", "ar", check=False)
        assert refused.returncode == 5 and "step 1" in refused.stderr
        assert serve(c, "ar")  # still served: nothing changed
    go = d.home / "cache" / "go"
    go.parent.mkdir(parents=True, exist_ok=True)
    go.write_text("")
    with d.http() as c:
        wait_for(lambda: state(c, "ar") == "waiting", what="the step to end")
        assert "archived (neither served nor trained)" in d.cli("scenarios", "archive", "ar").stdout
        gone = c.post("/s/ar/v1/chat/completions", json=ASK)
        assert "archived" in assert_canonical_error(gone, 409)["message"]
        assert c.get(f"/reef/records/{receipt}").json()["id"] == receipt  # records stay readable
        assert releases(c, "ar")["releases"]  # and the chain
        assert {s["name"]: s for s in c.get("/reef/scenarios").json()["scenarios"]}["ar"]["archived"] is True
        d.cli("scenarios", "unarchive", "ar")
        assert serve(c, "ar")
