"""Recipes as a plugin interface, through a real daemon and its real trainer worker: recipes written in a
temporary directory and bound by ``module:Class`` learn (weights and harness), every way a recipe can be broken is
refused at once or written down, and a step with nothing to learn publishes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, assert_canonical_error
from tests.test_learning import releases, serve_and_report, wait_for

# The "Write a recipe" example (docs/writing-a-recipe.md), as a user would save it (kept in step with the page by a test
# below).
REWARD_WEIGHTED = '''
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from recipes.base import Candidate, GateSettings, Recipe


@dataclass
class Settings(GateSettings):
    lr: float = 0.05
    batch_size: int = 4  # scored exchanges per step


class RewardWeighted(Recipe):
    """Reward-weighted likelihood: raise the log-probability of each answer in proportion to its score."""

    name = "reward-weighted"
    kind = "weights"
    source = "scores"
    Settings = Settings

    def batch(self, records):
        n = self.settings.batch_size
        return records[:n] if len(records) >= n else None

    def train(self, job, state):  # runs in the trainer worker process
        model = AutoModelForCausalLM.from_pretrained(job.base_path, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=self.settings.lr)
        loss = torch.zeros(())
        for r in job.batch:  # each a ScoredExchange
            ids = torch.tensor([r.prompt_token_ids + r.token_ids])
            logits = model(ids).logits[0, len(r.prompt_token_ids) - 1 : -1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.token_ids)[:, None]).sum()
            loss = loss - r.score * logp / len(job.batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.save_pretrained(job.work_dir)  # the worker fsyncs it and renames it into place
        for f in Path(job.base_path).glob("tokenizer*"):  # the tokenizer travels with the weights
            shutil.copyfile(f, Path(job.work_dir) / f.name)
        return Candidate(metrics={"loss": float(loss)})
'''

PLUGINS = '''
from dataclasses import dataclass
from pathlib import Path

from recipes.base import Candidate, Recipe


class Notes(Recipe):
    """A harness recipe: each written feedback becomes one line of AGENTS.md."""

    name = "notes"
    kind = "harness"
    source = "feedback"

    async def edit(self, tree, batch, ctx):
        text = tree.get("AGENTS.md", b"# Rules\\n").decode()
        for r in batch:
            text += f"- {r.feedback}\\n"  # each a FeedbackReport
        return Candidate(tree={**tree, "AGENTS.md": text.encode()}, metrics={"notes": len(batch)})


@dataclass
class Rating:
    rating: int  # required in every report's metadata


class Rated(Notes):
    name = "rated"
    inline = True
    Report = Rating


class Exploding(Recipe):
    """A weights recipe whose step always raises."""

    name = "exploding"
    kind = "weights"
    source = "scores"

    def train(self, job, state):
        raise RuntimeError("the flux capacitor is out of alignment")


class ExplodingHarness(Notes):
    name = "exploding-harness"
    inline = True

    async def edit(self, tree, batch, ctx):
        raise ValueError("cannot edit today")


class Copycat(Recipe):
    """A weights recipe whose candidate is its base, byte for byte: a release that would change nothing."""

    name = "copycat"
    kind = "weights"
    source = "scores"

    def batch(self, records):
        return records[:2] if len(records) >= 2 else None

    def train(self, job, state):
        for f in Path(job.base_path).iterdir():
            if f.is_file():
                (Path(job.work_dir) / f.name).write_bytes(f.read_bytes())
        return Candidate(metrics={"copied": 1})


class Truncating(Copycat):
    """A weights recipe whose candidate's weights file is cut short (an interrupted write): never a release."""

    name = "truncating"

    def train(self, job, state):
        super().train(job, state)
        weights = Path(job.work_dir) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return Candidate(metrics={"cut": 1})


@dataclass
class TallySettings:
    tally: str = ""  # a file each attempt appends a line to


class KillsItself(Copycat):
    """A weights recipe whose step kills its own worker process, as the kernel's OOM killer would."""

    name = "kills-itself"
    Settings = TallySettings

    def train(self, job, state):
        import os

        with open(self.settings.tally, "a") as f:
            f.write(job.id + "\\n")
        os.kill(os.getpid(), 9)


class NotARecipe:
    name = "plain"


class NoTrain(Recipe):
    name = "no-train"
    kind = "weights"
    source = "scores"
'''


@pytest.fixture
def recipe_dir(tmp_path: Path) -> Path:
    d = tmp_path / "my-recipes"
    d.mkdir()
    (d / "rwl.py").write_text(REWARD_WEIGHTED)
    (d / "plugins.py").write_text(PLUGINS)
    (d / "broken.py").write_text("def oops(:\n")
    (d / "failing_import.py").write_text("import no_such_module_anywhere\n")
    return d


def with_recipe_paths(daemon_factory: Any, recipe_dir: Path, extra: str = "", start: bool = True) -> Daemon:
    d: Daemon = daemon_factory(extra, start=False)
    cfg = d.home / "config.toml"
    cfg.write_text(f"recipe_paths = [{json.dumps(str(recipe_dir))}]\n" + cfg.read_text())
    return d.start() if start else d


def test_an_external_weights_recipe_trains_and_its_release_serves_the_next_request(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        r = c.post("/reef/scenarios", json={"name": "rw", "recipe": "rwl:RewardWeighted",  # straight to the head:
                                            "settings": {"lr": 0.1, "canary_share": 0}})  # no canary here
        assert r.status_code == 201, r.text
        init = r.json()["head"]
        receipts = serve_and_report(c, "rw", 4, score=lambda i: 1.0)
        chain = wait_for(lambda: (x := releases(c, "rw"))["releases"][0]["step"] == 1 and x, what="a release")
        head = chain["releases"][0]
        assert head["operation"] == "train" and head["recipe"] == "rwl:RewardWeighted"
        assert sorted(head["receipts"]) == sorted(receipts)
        assert head["settings"]["lr"] == 0.1 and head["content_id"] != chain["releases"][1]["content_id"]
        diff = c.get(f"/reef/releases/{head['release_id']}").json()
        assert "model.safetensors" in diff["diff"]["changed"]
        nxt = c.post("/s/rw/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert nxt.headers["x-reef-release-id"] == head["release_id"] != init


def test_an_external_harness_recipe_edits_the_harness(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "nt", "recipe": "plugins:Notes", "model": "tiny"}
                      ).status_code == 201
        rec = c.post("/s/nt/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).headers["x-reef-agent-record-id"]
        assert c.post("/reef/report", json={"references": [rec], "feedback": "run the tests first"}).status_code == 201
        wait_for(lambda: releases(c, "nt")["releases"][0]["step"] == 1, what="a harness release")
        files = c.get("/reef/scenarios/nt/harness").json()["files"]
        assert "- run the tests first" in files["AGENTS.md"]


def test_a_recipe_that_cannot_load_is_refused_at_once(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir)
    cases = {
        "broken:Thing": "cannot import module broken: SyntaxError",
        "failing_import:Thing": "cannot import module failing_import: ModuleNotFoundError",
        "plugins:Missing": "module plugins has no Missing",
        "plugins:NotARecipe": "does not implement the recipe interface",
        "plugins:NoTrain": "a weights recipe implements train(job, state)",
        "nosuch.module:X": "'nosuch' is in neither",  # outside the recipe directories: never imported
    }
    with d.http() as c:
        for name, why in cases.items():
            r = c.post("/reef/scenarios", json={"name": "x", "recipe": name})
            assert_canonical_error(r, 400)
            assert why in r.json()["error"]["message"], (name, r.text)
        assert c.post("/reef/scenarios", json={"name": "x", "recipe": "plugins:Notes", "settings": {"lr": 1}}
                      ).status_code == 400
        # nothing was stored for any of them
        assert "x" not in [s["name"] for s in c.get("/reef/scenarios").json()["scenarios"]]
    out = d.cli("scenarios", "create", "y", "--recipe", "plugins:NotARecipe", check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "does not implement the recipe interface" in out.stderr and "Traceback" not in out.stderr
    assert "recipe plugins:NotARecipe: NotARecipe does not implement" in d.log_tail(200)  # the log says why too


SIDE_EFFECT = """
import os, pathlib
pathlib.Path(os.environ["REEF_HOME"], "imported-{name}").write_text("ran")
from recipes.base import Recipe
class Thing(Recipe):
    name = "{name}"
"""


def test_the_api_imports_no_module_outside_the_recipe_directories(daemon_factory, recipe_dir, tmp_path):
    """Importing runs a module's code: a request naming an installed module (on the daemon's import path, but in
    no recipe directory) is refused before the import, unless the config allows it by name; ``this:X`` (the
    standard library's Zen of Python, printed at import) never reaches the log; a recipe that is not a string is a
    400 naming the field, not a 500."""
    site = tmp_path / "site"
    site.mkdir()
    for mod in ("sneaky", "trusted"):
        (site / f"{mod}.py").write_text(SIDE_EFFECT.replace("{name}", mod))
    d = with_recipe_paths(daemon_factory, recipe_dir, start=False)
    d.env["PYTHONPATH"] += os.pathsep + str(site)
    cfg = d.home / "config.toml"
    cfg.write_text('allowed_recipes = ["trusted:Thing"]\n' + cfg.read_text())
    d.start()
    with d.http() as c:
        for name in ("sneaky:Thing", "this:X"):
            err = assert_canonical_error(c.post("/reef/scenarios", json={"name": "x", "recipe": name}), 400)
            assert "recipe_paths" in err["message"] and "allowed_recipes" in err["message"], err
        assert not (d.home / "imported-sneaky").exists()
        assert "Beautiful is better than ugly" not in d.log_tail(400)
        for bad in ({}, [], 7):
            err = assert_canonical_error(c.post("/reef/scenarios", json={"name": "x", "recipe": bad}), 400)
            assert err.get("param") == "recipe", err
        assert "x" not in [s["name"] for s in c.get("/reef/scenarios").json()["scenarios"]]
        # the same kind of module, named in the config, binds; one in a recipe directory binds without being named
        assert c.post("/reef/scenarios", json={"name": "t", "recipe": "trusted:Thing"}).status_code == 201
        assert (d.home / "imported-trusted").read_text() == "ran"
        assert c.post("/reef/scenarios", json={"name": "r", "recipe": "rwl:RewardWeighted"}).status_code == 201


def test_settings_a_recipe_refuses_are_a_400_naming_them(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        r = c.post("/reef/scenarios", json={"name": "s1", "recipe": "rwl:RewardWeighted",
                                            "settings": {"lr": 0.1, "momentum": 0.9}})
        assert_canonical_error(r, 400)
        assert "momentum" in r.json()["error"]["message"]
        r = c.post("/reef/scenarios", json={"name": "s2", "recipe": "rwl:RewardWeighted", "settings": {"lr": "fast"}})
        assert_canonical_error(r, 400)
        assert r.json()["error"]["param"] == "settings.lr"
        r = c.post("/reef/scenarios", json={"name": "s3", "recipe": "online-rl", "settings": {"gate": "floor"}})
        assert_canonical_error(r, 400)
        assert "eval_family" in r.json()["error"]["message"]
        assert c.post("/reef/scenarios", json={"name": "s4", "recipe": "rwl:RewardWeighted",
                                               "settings": {"lr": 0.1}}).status_code == 201


def test_a_daemon_with_a_broken_default_recipe_refuses_to_start(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir, start=False)
    cfg = d.home / "config.toml"
    cfg.write_text('default_recipe = "plugins:NotARecipe"\n' + cfg.read_text())
    proc = subprocess.run([sys.executable, "-m", "daemon"], env=d.env, capture_output=True, text=True, timeout=120,
                          cwd=d.home)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("reef: recipe plugins:NotARecipe: NotARecipe does not")
    assert "Traceback" not in proc.stderr


def test_a_candidate_with_truncated_weights_is_a_failed_step_never_a_release(daemon_factory, recipe_dir):
    """A weights file shorter than its own safetensors header says is refused when the candidate is published:
    the step is written down as failed naming the file, the head stays, and serving goes on (it was published,
    and serving it was a 500 with a traceback)."""
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "cut", "recipe": "plugins:Truncating"}).status_code == 201
        serve_and_report(c, "cut", 2)
        (failed,) = wait_for(lambda: releases(c, "cut", True)["rejected"], what="the failed step")
        assert failed["verdict"] == "failed" and "model.safetensors is truncated" in failed["reason"], failed
        assert len(releases(c, "cut")["releases"]) == 1  # only the init release
        ok = c.post("/s/cut/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
    assert "Traceback" not in d.log_tail(300)


def test_a_step_that_raises_is_written_down_as_failed_and_serving_goes_on(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "ex", "recipe": "plugins:Exploding"}).status_code == 201
        receipts = serve_and_report(c, "ex", 2)
        # each failed step lists what it consumed (a batch is whatever is eligible: one or two reports)
        done = wait_for(lambda: (x := releases(c, "ex", True)["rejected"]) and
                        sorted(r for f in x for r in f["receipts"]) == sorted(receipts) and x, what="failed steps")
        for failed in done:
            assert failed["verdict"] == "failed" and "the flux capacitor is out of alignment" in failed["reason"]
            assert "Traceback" not in failed["reason"]
        assert len(releases(c, "ex")["releases"]) == 1  # only the init release
        ok = c.post("/s/ex/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
        # a harness step that raises inside the report's own request: the report is stored, the answer says so
        assert c.post("/reef/scenarios", json={"name": "exh", "recipe": "plugins:ExplodingHarness",
                                               "model": "tiny"}).status_code == 201
        rec = c.post("/s/exh/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).headers["x-reef-agent-record-id"]
        r = c.post("/reef/report", json={"references": [rec], "feedback": "be brief"})
        assert r.status_code == 201, r.text
        learning = r.json()["learning"]
        assert learning["verdict"] == "failed" and "cannot edit today" in learning["reason"]


def test_a_worker_killed_twice_on_one_batch_is_a_failed_step_with_its_reason_never_a_loop(daemon_factory, recipe_dir,
                                                                                          tmp_path):
    """A step whose worker is SIGKILLed (the kernel's OOM killer at 23 GB, issue 23) is tried twice, then written
    down as failed naming how the worker died: in the chain, on /reef/events, in ``releases list --all``; the
    batch is consumed, never tried a third time, and serving goes on."""
    tally = tmp_path / "tally"
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "oom", "recipe": "plugins:KillsItself",
                                               "settings": {"tally": str(tally)}})
        assert made.status_code == 201, made.text
        with c.stream("GET", "/reef/events", timeout=httpx.Timeout(60, read=120)) as events:
            receipts = serve_and_report(c, "oom", 2)
            for line in events.iter_lines():
                if line.startswith("data:") and '"gate"' in line and '"oom"' in line:
                    gate = json.loads(line[5:])
                    break
        assert gate["verdict"] == "failed" and "died 2 times" in gate["reason"] and "SIGKILL" in gate["reason"], gate
        (failed,) = releases(c, "oom", True)["rejected"]
        assert failed["verdict"] == "failed" and failed["reason"] == gate["reason"]
        assert sorted(failed["receipts"]) == sorted(receipts)
        time.sleep(3)  # time for a third attempt, were there one
        assert len(tally.read_text().splitlines()) == 2, tally.read_text()
        assert len(releases(c, "oom", True)["rejected"]) == 1 and len(releases(c, "oom")["releases"]) == 1
        ok = c.post("/s/oom/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
    listed = d.cli("releases", "list", "-s", "oom", "--all").stdout
    assert "failed" in listed and "died 2 times" in " ".join(listed.split()), listed


def test_a_report_that_violates_the_recipes_schema_is_refused_and_not_stored(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "rt", "recipe": "plugins:Rated", "model": "tiny"}
                      ).status_code == 201
        rec = c.post("/s/rt/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).headers["x-reef-agent-record-id"]
        for metadata, why in (({}, "needs metadata.rating"), ({"rating": "good"}, "metadata.rating must be")):
            r = c.post("/reef/report", json={"references": [rec], "feedback": "ok", "metadata": metadata})
            assert_canonical_error(r, 400)
            assert why in r.json()["error"]["message"] and r.json()["error"]["param"] == "metadata.rating"
        assert c.get(f"/reef/records/{rec}").json()["reports"] == []
        r = c.post("/reef/report", json={"references": [rec], "feedback": "cite sources", "metadata": {"rating": 3}})
        assert r.status_code == 201 and r.json()["learning"]["verdict"] == "accepted"
        # the same fields are free on a scenario whose recipe declares no schema
        other = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).headers["x-reef-agent-record-id"]
        assert c.post("/reef/report", json={"references": [other], "score": 1, "metadata": {"rating": "good"}}
                      ).status_code == 201


def test_a_step_with_nothing_to_learn_publishes_nothing(daemon_factory, recipe_dir):
    d = with_recipe_paths(daemon_factory, recipe_dir,
                          "\n[recipes.online-rl]\ncanary_share = 0\nbatch_prompts = 2\ngroup_size = 2\ngate = \"always\"\n")
    with d.http() as c:
        # online-rl: every group scored alike carries no signal
        assert c.post("/reef/scenarios", json={"name": "flat", "recipe": "online-rl"}).status_code == 201
        with c.stream("GET", "/reef/events", timeout=httpx.Timeout(60, read=120)) as events:
            receipts = serve_and_report(c, "flat", 4, score=lambda i: 1.0)
            for line in events.iter_lines():
                if line.startswith("data:") and '"gate"' in line and '"flat"' in line:
                    gate = json.loads(line[5:])
                    break
        assert gate["verdict"] == "skipped" and "no signal" in gate["reason"]
        chain = releases(c, "flat", True)
        assert [r["step"] for r in chain["releases"]] == [0]
        assert chain["rejected"][0]["verdict"] == "skipped"
        assert sorted(chain["rejected"][0]["receipts"]) == sorted(receipts)
        # a candidate whose content equals its parent's is no release
        assert c.post("/reef/scenarios", json={"name": "cc", "recipe": "plugins:Copycat"}).status_code == 201
        serve_and_report(c, "cc", 2)
        skipped = wait_for(lambda: releases(c, "cc", True)["rejected"], what="the skipped step")[0]
        assert skipped["verdict"] == "skipped" and "same content as the head" in skipped["reason"]
        assert [r["step"] for r in releases(c, "cc")["releases"]] == [0]
    out = d.cli("releases", "list", "-s", "cc", "--all")
    assert "skipped" in out.stdout


def test_the_documented_example_is_the_one_tested():
    page = (Path(__file__).resolve().parent.parent / "docs" / "writing-a-recipe.md").read_text()
    block = page.split("# Write a recipe", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert textwrap.dedent(block).strip() == textwrap.dedent(DOCUMENTED_EXAMPLE).strip()


DOCUMENTED_EXAMPLE = REWARD_WEIGHTED


def test_a_failed_batch_is_never_trained_on_again_after_a_restart(daemon_factory, recipe_dir):
    """A failed step consumes its receipts (written down on the chain's rejection log): after a daemon restart the
    next step's batch holds only what came since. Catches a consumed set read from releases alone (rejections
    ignored): the restarted learner would take the failed receipts again."""
    d = with_recipe_paths(daemon_factory, recipe_dir)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "ex2", "recipe": "plugins:Exploding"}).status_code == 201
        first = serve_and_report(c, "ex2", 2)
        wait_for(lambda: sorted(r for f in releases(c, "ex2", True)["rejected"] for r in f["receipts"])
                 == sorted(first), what="the failed steps")
    d.stop()
    d.start()
    with d.http() as c:
        later = serve_and_report(c, "ex2", 1)
        done = wait_for(lambda: (x := releases(c, "ex2", True)["rejected"]) and later[0] in x[0]["receipts"] and x,
                        what="the step after the restart")
        assert done[0]["receipts"] == later, done[0]
        assert sorted(r for f in done for r in f["receipts"]) == sorted(first + later)  # each once
