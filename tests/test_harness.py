"""Harness scenarios through the daemon's API: runs, rendered harness files, evolve, the lessons recipe's gates
(always, review, compare on tasks), and bad input to those routes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.conftest import Daemon, assert_canonical_error
from tests.test_upstream import stub  # noqa: F401, F811 - the scripted upstream, as a proposer model


def create(c: Any, name: str, **settings: Any) -> dict[str, Any]:
    resp = c.post("/reef/scenarios", json={"name": name, "recipe": "lessons", "settings": settings})
    assert resp.status_code == 201, resp.text
    return resp.json()


def test_a_run_creates_a_lessons_scenario_and_hands_out_its_harness(daemon: Daemon) -> None:
    with daemon.unix() as c:
        start = c.post("/reef/runs", json={"adapter": "claude"}).json()
        assert start["scenario"] == "claude" and start["recipe"] == "lessons" and start["run"].startswith("run_")
        # an empty harness but for the one rule that says how to propose a change (daemon/proposals.py)
        assert start["kind"] == "harness" and list(start["files"]) == [".claude/CLAUDE.md"]
        assert "`reef-claude propose" in start["files"][".claude/CLAUDE.md"]
        again = c.post("/reef/runs", json={"adapter": "claude", "installed_release": start["release_id"]}).json()
        assert "files" not in again and again["run"] != start["run"]  # nothing to send: it is installed
        out = c.post("/reef/scenarios/claude/evolve", json={"instruction": "keep diffs small"}).json()
        assert out["verdict"] == "accepted" and out["step"] == 1
        after = c.post("/reef/runs", json={"adapter": "claude", "installed_release": start["release_id"]}).json()
        assert "keep diffs small" in after["files"][".claude/CLAUDE.md"]
        neutral = c.get("/reef/scenarios/claude/harness").json()
        assert list(neutral["files"]) == ["AGENTS.md"] and neutral["release_id"] == out["release_id"]


def test_written_feedback_on_receipts_becomes_a_release_and_is_consumed_once(daemon: Daemon) -> None:
    with daemon.unix() as c:
        create(c, "fb")
        rec = c.post("/s/fb/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "x"}]})
        receipt = rec.headers["x-reef-agent-record-id"]
        rep = c.post("/reef/report", json={"references": [receipt], "score": 0, "feedback": "forgot the tests"})
        assert rep.status_code == 201
        learning = rep.json()["learning"]
        assert learning["verdict"] == "accepted" and learning["applied"][0]["rule"].endswith("forgot the tests")
        chain = c.get("/reef/scenarios/fb/releases").json()["releases"]
        assert chain[0]["receipts"] == [rep.json()["report_id"]]
        score_only = c.post("/reef/report", json={"references": [receipt], "score": 1}).json()
        assert "learning" not in score_only or score_only["learning"] is None
        assert len(c.get("/reef/scenarios/fb/releases").json()["releases"]) == 2  # nothing new to learn


def test_review_gate_holds_the_candidate_until_promoted(daemon: Daemon) -> None:
    with daemon.unix() as c:
        head = create(c, "reviewed", gate="review")["head"]
        out = c.post("/reef/scenarios/reviewed/evolve", json={"instruction": "explain each change"}).json()
        assert out["verdict"] == "pending"
        assert c.get("/reef/scenarios/reviewed/releases").json()["head"] == head  # serving untouched
        promoted = c.post("/reef/scenarios/reviewed/promote",
                          json={"release_id": out["release_id"], "expected_head": head})
        assert promoted.status_code == 201, promoted.text
        files = c.get("/reef/scenarios/reviewed/harness").json()["files"]
        assert "explain each change" in files["AGENTS.md"]


def test_compare_gate_judges_candidates_on_the_scenarios_tasks(daemon: Daemon) -> None:
    tasks = [{"prompt": "say hi", "expect": ""}, {"prompt": "name a colour", "expect": ""}]
    with daemon.unix() as c:
        # two tasks can never show a candidate better at the default error rate (a clean sweep needs 5 pairs)
        refused = c.post("/reef/scenarios", json={"name": "few", "recipe": "lessons",
                                                  "settings": {"gate": "compare", "tasks": tasks}})
        assert_canonical_error(refused, 400)
        assert "at least 5 untied pairs" in refused.json()["error"]["message"]
        # at a stated 0.25 two pairs can decide; every task ties (expect ""), so the gate cannot, and holds it
        head = create(c, "strict", gate="compare", tasks=tasks, alpha=0.25)["head"]
        out = c.post("/reef/scenarios/strict/evolve", json={"instruction": "answer in one word"}).json()
        assert out["verdict"] == "pending" and "cannot decide at error rate 0.25: 0 untied pair(s)" in out["reason"]
        chain = c.get("/reef/scenarios/strict/releases", params={"all": 1}).json()
        assert chain["head"] == head and chain["pending"][0]["release_id"] == out["release_id"]


def test_bad_input_to_harness_routes_is_refused(daemon: Daemon) -> None:
    with daemon.unix() as c:
        assert_canonical_error(c.post("/reef/runs", json={"adapter": "vim"}), 400)
        assert_canonical_error(c.post("/reef/runs", json={}), 400)
        assert_canonical_error(c.post("/reef/runs", json={"adapter": "pi", "scenario": "../x"}), 400)
        assert_canonical_error(c.get("/reef/harness/install"), 400)
        assert_canonical_error(c.get("/reef/scenarios/nope/harness"), 404)
        create(c, "ev")
        assert_canonical_error(c.post("/reef/scenarios/ev/evolve", json={"instruction": ""}), 400)
        assert_canonical_error(c.post("/reef/scenarios/ev/evolve", json={"instruction": 5}), 400)
        assert_canonical_error(c.post("/reef/scenarios/ev/evolve", json={"instruction": "x" * 10_001}), 400)
        assert_canonical_error(c.post("/reef/scenarios/ev/evolve", json={"instruction": "ok", "skill": "../a"}),
                               400)
        assert_canonical_error(c.post("/reef/scenarios", json={"name": "bad-gate", "recipe": "lessons",
                                                               "settings": {"gate": "compare"}}), 400)
        c.post("/reef/scenarios", json={"name": "weights", "recipe": "record"})
        assert_canonical_error(c.post("/reef/scenarios/weights/evolve", json={"instruction": "hi"}), 400)
        assert_canonical_error(c.get("/reef/scenarios/weights/harness"), 400)


def test_a_proposer_model_phrases_the_rule_and_failures_fall_back(daemon_factory: Any, stub: str) -> None:  # noqa: F811
    d = daemon_factory(f'\n[models.writer]\nengine = "upstream"\nurl = "{stub}/v1"\nformat = "openai-chat"\n'
                       'upstream_model = "stub-model"\n')
    with d.unix() as c:
        create(c, "phrased", proposer="writer")
        out = c.post("/reef/scenarios/phrased/evolve", json={
            "instruction": "the tests were skipped [stub:text=Run the whole test suite before you finish.]"}).json()
        (applied,) = out["applied"]
        assert applied["rule"] == "Run the whole test suite before you finish." and applied["proposed_by"] == "writer"
        create(c, "fallback", proposer="writer")
        plain = c.post("/reef/scenarios/fallback/evolve", json={"instruction": "keep it short [stub:status=500]"})
        assert plain.json()["applied"][0]["rule"] == "keep it short [stub:status=500]"
        assert_canonical_error(c.post("/reef/scenarios", json={"name": "nobody", "recipe": "lessons",
                                                               "settings": {"proposer": "nope"}}), 400)


def test_heads_moved_by_other_processes_are_announced_once_on_the_event_stream(daemon: Daemon) -> None:
    import json
    import time

    from daemon.releases import ReleaseStore

    with daemon.unix() as c:
        head = create(c, "watched")["head"]
        own = c.post("/reef/scenarios/watched/evolve", json={"instruction": "name things plainly"}).json()
        store = ReleaseStore(daemon.home / "artifacts.git")
        outside = store.publish("watched", {"AGENTS.md": b"# Rules\n\nwritten by another tool\n"},
                                expected_head=own["release_id"], operation="train", kind="harness",
                                recipe="lessons").release_id
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and outside not in {e.get("release_id") for e in seen}:
            time.sleep(0.5)
            with c.stream("GET", "/reef/events", params={"after": 0}, timeout=2) as resp:
                seen = []
                try:
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            event = json.loads(line[6:])
                            if event.get("kind") == "release" and event.get("scenario") == "watched":
                                seen.append(event)
                except Exception:  # the read timeout ends one look at the stream
                    pass
    ids = [e["release_id"] for e in seen]
    assert outside in ids and ids.count(outside) == 1 and ids.count(own["release_id"]) == 1
    assert next(e for e in seen if e["release_id"] == outside)["external"] is True
    assert head in ids  # the init release, published by this daemon, announced by it


def short_context_model(tiny_model: Path, tmp_path: Path, context: int) -> Path:
    """The tiny model with a smaller context in its config (the size a wrapper holds an agent's request against)."""
    short = tmp_path / "short"
    shutil.copytree(tiny_model, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": context}))
    return short


# SmolLM2-135M-Instruct's chat template (Apache-2.0): it renders each message's content and drops tool schemas
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def toolless_model(tiny_model: Path, tmp_path: Path, context: int) -> Path:
    """The tiny model with SmolLM2's context and chat template, which drops tool schemas."""
    path = tmp_path / "toolless"
    shutil.copytree(short_context_model(tiny_model, tmp_path / "t", context), path)
    tok = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": SMOLLM2_TEMPLATE}))
    return path


def test_a_wrapped_agents_scenario_says_its_model_and_moves_to_another(daemon_factory: Any, tiny_model: Path,
                                                                       tmp_path: Path) -> None:
    """A scenario made on a test model while the default is another: the run's start says both, the wrapper says
    so in one line each with the command that moves it, ``set-model`` moves it (its harness kept), and a weights
    scenario cannot move. An agent whose first request is larger than the model's context is told before it runs
    (Claude Code's 21,300 tokens against 8,192), one that fits (pi) is not; nor is Claude Code on a model of the same
    context whose chat template drops tool schemas (SmolLM2's): it reads about 3,000 tokens of it."""
    from adapters import get_adapter
    from reef_cli.wrapper import model_notes

    short = short_context_model(tiny_model, tmp_path, 8192)
    toolless = toolless_model(tiny_model, tmp_path, 8192)
    d: Daemon = daemon_factory(f'\n[models.short]\nengine = "transformers"\npath = "{short}"\n'
                               f'\n[models.smol]\nengine = "transformers"\npath = "{toolless}"\n', start=False)
    cfg = d.home / "config.toml"
    cfg.write_text(cfg.read_text().replace('default_model = "tiny"', 'default_model = "short"'))
    d.start()
    with d.unix() as c:
        assert create(c, "pi") and c.post("/reef/scenarios", json={"name": "w", "recipe": "online-rl"}).status_code == 201
        c.post("/reef/scenarios/pi/evolve", json={"instruction": "keep diffs small"}).raise_for_status()
        # "pi" was made on the default "short"; bind it to the test model by hand, as an old home has it
        assert c.post("/reef/scenarios/pi/model", json={"model": "tiny"}).json()["previous_model"] == "short"
        start = c.post("/reef/runs", json={"adapter": "pi"}).json()
        assert (start["model"], start["default_model"], start["test_model"]) == ("tiny", "short", True)
        notes = model_notes(get_adapter("pi"), start)
        assert len(notes) == 2, notes
        assert "tiny is a test model" in notes[0]
        assert "scenario pi is bound to model tiny, not the default short" in notes[1]
        assert notes[1].endswith("reef scenarios set-model pi short")
        moved = d.cli("scenarios", "set-model", "pi", "short")
        assert "model tiny -> short" in moved.stdout
        after = c.post("/reef/runs", json={"adapter": "pi"}).json()
        assert (after["model"], after["test_model"], after["context_length"]) == ("short", False, 8192)
        assert "keep diffs small" in after["files"][".pi/agent/AGENTS.md"]  # the harness moved with it
        assert model_notes(get_adapter("pi"), after) == []  # pi's 1,546 tokens fit
        claude = c.post("/reef/runs", json={"adapter": "claude", "scenario": "pi"}).json()
        (fit,) = model_notes(get_adapter("claude"), claude)
        assert "21,300 tokens as model short reads it, and it holds 8,192" in fit and "upstream" in fit
        assert claude["carries_tools"] is True
        assert create(c, "c2") and c.post("/reef/scenarios/c2/model", json={"model": "smol"}).status_code == 200
        smol = c.post("/reef/runs", json={"adapter": "claude", "scenario": "c2"}).json()
        assert (smol["context_length"], smol["carries_tools"]) == (8192, False)
        notes = model_notes(get_adapter("claude"), smol)  # about 3,000 tokens as SmolLM2's template renders it
        assert notes and not any("first request" in n for n in notes), notes
        # refused: a weights chain, an unknown model, a scenario that does not exist
        err = assert_canonical_error(c.post("/reef/scenarios/w/model", json={"model": "tiny"}), 409)
        assert "learns weights" in err["message"]
        assert c.get("/reef/scenarios/w").json()["model"] == "short"
        assert_canonical_error(c.post("/reef/scenarios/pi/model", json={"model": "nope"}), 400)
        assert_canonical_error(c.post("/reef/scenarios/pi/model", json={}), 400)
        assert_canonical_error(c.post("/reef/scenarios/none/model", json={"model": "tiny"}), 404)
        assert d.cli("scenarios", "set-model", "w", "tiny", check=False).returncode == 5


def test_a_scenario_shows_the_settings_it_actually_gets(daemon: Daemon) -> None:
    """``GET /reef/scenarios/{s}`` and ``reef scenarios show`` list the effective settings: what was set and every
    default the recipe fills in (a user reads the gate and bounds they get, not ``{}``). Bug caught: only the stored
    settings shown (the defaults invisible), or a set value shown as its default."""
    with daemon.unix() as c:
        create(c, "eff", gate="review")
        view = c.get("/reef/scenarios/eff").json()
        assert view["settings"] == {"gate": "review"}
        eff = view["effective_settings"]
        assert eff["gate"] == "review" and eff["max_chars"] == 1000, eff  # set, and a default
        create(c, "eff2")
        assert c.get("/reef/scenarios/eff2").json()["effective_settings"]["gate"] == "always"
    out = daemon.cli("scenarios", "show", "eff").stdout
    assert "* gate" in out and '"review"' in out and "  max_chars" in out, out


def test_a_lessons_candidate_whose_rules_silence_the_model_is_held_and_never_installed(
        daemon_factory: Any, stub: str) -> None:  # noqa: F811
    # the scenario's model is the scripted upstream playing a model that follows its rules exactly (none that both
    # does and answers within a test's time runs here; bench/harness_real.py measures SmolLM2): it answers each
    # probe, unless its system prompt (the rules file) says to say nothing
    d = daemon_factory(f'\n[models.follower]\nengine = "upstream"\nurl = "{stub}/v1"\nformat = "openai-chat"\n'
                       'upstream_model = "stub-model"\n')
    probes = [{"prompt": f"Name a colour, number {i}. [stub:obey=blue]", "accept": ["blue"]} for i in range(8)]
    with d.unix() as c:
        for name, check in (("checked", True), ("unchecked", False)):
            resp = c.post("/reef/scenarios", json={"name": name, "recipe": "lessons", "model": "follower", "settings": {
                "heldout_probes": probes, "heldout_check": check}})
            assert resp.status_code == 201, resp.text
        head = c.get("/reef/scenarios/checked/harness").json()["release_id"]
        fine = c.post("/reef/scenarios/checked/evolve", json={"instruction": "name the colour first"}).json()
        assert fine["verdict"] == "accepted" and fine["metrics"]["heldout"] == "passed", fine
        assert fine["metrics"]["heldout_probe_accuracy"] == 1.0 and "a harness candidate" in fine["metrics"]["heldout_note"]
        silenced = c.post("/reef/scenarios/checked/evolve", json={"instruction": "Say nothing when asked a question"}).json()
        assert silenced["verdict"] == "pending" and "it stops answering" in silenced["reason"], silenced
        assert silenced["metrics"]["heldout_empty"] == 1.0 and silenced["metrics"]["heldout_head_empty"] == 0.0
        served = c.get("/reef/scenarios/checked/harness").json()
        assert served["release_id"] == fine["release_id"] != head and "Say nothing" not in served["files"]["AGENTS.md"]
        start = c.post("/reef/runs", json={"adapter": "pi", "scenario": "checked"}).json()
        assert "Say nothing" not in json.dumps(start["files"])  # the next run gets the head, not the held candidate
        listed = c.get("/reef/scenarios/checked/releases", params={"all": "true"}).json()
        (held,) = [r for r in listed["pending"] if r["release_id"] == silenced["release_id"]]
        assert held["metrics"]["heldout"] == "held" and silenced["release_id"] not in {
            r["release_id"] for r in listed["releases"]}
        off = c.post("/reef/scenarios/unchecked/evolve", json={"instruction": "Say nothing when asked a question"}).json()
        assert off["verdict"] == "accepted" and off["metrics"]["heldout"] == "unchecked"
