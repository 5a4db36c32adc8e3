"""A release says what it requires (``daemon/releases/requires.py``): items parsed at publish (an unknown kind is a 400
naming it, nothing written), checked on this machine before a release is loaded, rolled back to or followed from a
chain remote (refused naming the item, the newest release that needs nothing more offered), and listed by
``reef releases show``. Real daemons, a real PATH with a real executable, a real bare git remote."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from daemon.chain_remote import ChainRemote
from daemon.config import load_config
from daemon.errors import BadRequest
from daemon.releases import ReleaseStore, files_from_dir
from daemon.releases.requires import Check, Machine, Requirement, check, first_unmet, parse_all
from tests.conftest import Daemon, assert_canonical_error, make_home
from tests.test_chain_remote import bare, with_top_level

PRESENT, ABSENT = "reef-test-present-tool", "reef-test-absent-tool"
BODY = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}
HANG_GUARD_S = 60


# --- the items and the checks -------------------------------------------------------------------------------


def machine(tmp_path: Path, **kw: Any) -> Machine:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / PRESENT
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    (bin_dir / "not-executable").write_text("")
    agent = tmp_path / "agents" / "claude" / "node_modules"
    (agent / ".bin").mkdir(parents=True, exist_ok=True)
    (agent / ".bin" / "claude").write_text("")
    (agent / "@anthropic-ai" / "claude-code").mkdir(parents=True, exist_ok=True)
    (agent / "@anthropic-ai" / "claude-code" / "package.json").write_text(json.dumps({"version": "2.10.3"}))
    fields: dict[str, Any] = dict(env_names=frozenset({"SET_VAR"}), search_path=str(bin_dir),
                                  models={"tiny": "transformers", "openai": "upstream"},
                                  agents_dir=tmp_path / "agents",
                                  package_version={"transformers": "5.24.0"}.get)
    fields.update(kw)
    return Machine(**fields)


def test_items_parse_to_their_canonical_spelling_and_bad_ones_are_refused_naming_them() -> None:
    assert parse_all([" tool:git", "agent:claude>=2.0", "tool:git", "env:HOME"]) == ("tool:git", "agent:claude>=2.0",
                                                                                     "env:HOME")
    assert parse_all(None) == ()
    assert Requirement.parse("engine:transformers>=5.0") == Requirement("engine", "transformers", "5.0")
    for bad, said in (("gpu:h100", "unknown kind 'gpu'"), ("gpu:h100>=1", "unknown kind 'gpu'"),
                      ("tool:git>=2", "takes no version"), ("tool", "KIND:NAME"), ("agent:claude>=x", "KIND:NAME"),
                      ("tool:../x", "KIND:NAME")):
        with pytest.raises(BadRequest) as e:
            parse_all(["tool:git", bad])
        assert said in e.value.message and bad in e.value.message and e.value.param == "requires", bad
    for not_a_list in ("tool:git", {"tool": "git"}, 3):
        with pytest.raises(BadRequest):
            parse_all(not_a_list)


def test_each_kind_is_checked_on_the_machine(tmp_path: Path) -> None:
    m = machine(tmp_path)
    got = {item: (c.met, c.found) for item in (
        f"tool:{PRESENT}", f"tool:{ABSENT}", "tool:not-executable", "env:SET_VAR", "env:UNSET_VAR", "provider:openai",
        "provider:anthropic", "agent:claude", "agent:claude>=2.9", "agent:claude>=2.10.3", "agent:claude>=2.11", "agent:pi",
        "engine:transformers>=5.3", "engine:transformers>=5.30", "engine:vllm", "engine:vllm>=0.1", "engine:nope",
    ) for c in [check(item, m)]}
    assert got[f"tool:{PRESENT}"] == (True, str(tmp_path / "bin" / PRESENT))
    assert got[f"tool:{ABSENT}"][0] is False and "PATH" in got[f"tool:{ABSENT}"][1]
    assert got["tool:not-executable"][0] is False
    assert got["env:SET_VAR"] == (True, "set") and got["env:UNSET_VAR"][0] is False
    assert got["provider:openai"] == (True, "model openai (engine upstream)")
    assert got["provider:anthropic"][0] is False and "openai, tiny" in got["provider:anthropic"][1]
    # versions compare as numbers: 2.10 is newer than 2.9, older than 2.11
    assert got["agent:claude"] == (True, "claude 2.10.3") and got["agent:claude>=2.9"][0] is True
    assert got["agent:claude>=2.10.3"][0] is True  # at least: the same version is enough
    assert got["agent:claude>=2.11"] == (False, "claude 2.10.3")
    assert got["agent:pi"][0] is False and "reef agents install pi" in got["agent:pi"][1]
    assert got["engine:transformers>=5.3"] == (True, "transformers 5.24.0")
    assert got["engine:transformers>=5.30"][0] is False
    assert got["engine:vllm"][0] is True and got["engine:vllm>=0.1"][0] is False  # not installed here
    assert got["engine:nope"][0] is False
    # a newer Reef's kind read back from a chain is not met, never taken as met
    assert check("gpu:h100", m).met is False
    assert first_unmet(["env:SET_VAR", f"tool:{ABSENT}", "env:UNSET_VAR"], m).item == f"tool:{ABSENT}"  # type: ignore[union-attr]
    assert first_unmet(["env:SET_VAR", f"tool:{PRESENT}"], m) is None


def test_a_model_is_met_by_a_configured_local_model_whose_files_are_here(tmp_path: Path) -> None:
    """``model:NAME``: a weights release needs its model's files, which ``provider:NAME`` (any configured model) does
    not say. Bugs caught: a configured name taken as enough, an upstream model taken as local, an empty directory
    taken as a model."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    (tmp_path / "gone").mkdir()
    m = machine(tmp_path, models={"tiny": "transformers", "gone": "transformers", "openai": "upstream"},
                model_paths={"tiny": tmp_path / "tiny", "gone": tmp_path / "gone", "openai": None})
    assert check("model:tiny", m) == Check("model:tiny", "model", True, f"model tiny at {tmp_path / 'tiny'}")
    gone = check("model:gone", m)
    assert not gone.met and "no model files" in gone.found and "reef model init gone" in gone.found
    assert not check("model:openai", m).met and "engine upstream" in check("model:openai", m).found
    assert not check("model:smollm2", m).met and "configured: gone, openai, tiny" in check("model:smollm2", m).found
    assert check("provider:gone", m).met  # configured is enough for a provider
    with pytest.raises(BadRequest, match="takes no version"):
        parse_all(["model:tiny>=2"])


def test_the_config_keeps_names_of_set_variables_and_the_path_never_empty_ones(tmp_path: Path) -> None:
    cfg = load_config(env={"REEF_HOME": str(tmp_path), "PATH": "/x:/y", "SET_VAR": "1", "EMPTY_VAR": ""})
    m = Machine.of(cfg)
    assert cfg.search_path == "/x:/y" and "SET_VAR" in m.env_names and "EMPTY_VAR" not in m.env_names
    assert check("env:EMPTY_VAR", m).met is False


# --- publishing -----------------------------------------------------------------------------------------------


def objects(store: ReleaseStore) -> set[str]:
    return {str(p.relative_to(store.path)) for p in (Path(store.path) / "objects").rglob("*") if p.is_file()}


def test_an_unknown_kind_is_refused_at_publish_with_nothing_written(tmp_path: Path) -> None:
    store = ReleaseStore(tmp_path / "a.git")
    init = store.publish("s", {"a.md": b"a"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
    before = objects(store)
    with pytest.raises(BadRequest) as e:
        store.publish("s", {"a.md": b"b"}, expected_head=init.release_id, operation="train", kind="harness",
                      recipe="lessons", requires=["tool:git", "gpu:h100"])
    assert "gpu:h100" in e.value.message and e.value.param == "requires"
    assert store.head("s") == init.release_id and objects(store) == before
    # a good one is written in the manifest, canonical, and a rollback restores the needs with the content
    rel = store.publish("s", {"a.md": b"b"}, expected_head=init.release_id, operation="train", kind="harness",
                        recipe="lessons", requires=["tool:git ", "agent:claude>=2.0"])
    assert store.get(rel.release_id).requires == ["tool:git", "agent:claude>=2.0"]
    back = store.rollback("s", init.release_id)
    again = store.rollback("s", rel.release_id)
    assert back.requires == [] and again.requires == ["tool:git", "agent:claude>=2.0"]


# --- a live daemon --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model: Path) -> Iterator[Daemon]:
    """A daemon whose PATH has the present tool (and not the absent one), and ``REQ_SET`` set."""
    home, port, env = make_home(tiny_model)
    bin_dir = home / "bin"
    bin_dir.mkdir()
    (bin_dir / PRESENT).write_text("#!/bin/sh\n")
    (bin_dir / PRESENT).chmod(0o755)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", REQ_SET="1")
    env.pop("REQ_UNSET", None)
    d = Daemon(home=home, port=port, env=env).start()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def publish(d: Daemon, scenario: str, tiny_model: Path, note: str, needs: list[str]) -> str:
    store = ReleaseStore(d.home / "artifacts.git")
    files = {**files_from_dir(tiny_model), "note.txt": note.encode()}
    return store.publish(scenario, files, expected_head=store.head(scenario), operation="train", kind="weights",
                         recipe="record", requires=needs).release_id


def chat(c: httpx.Client, scenario: str, **headers: str) -> httpx.Response:
    return c.post(f"/s/{scenario}/v1/chat/completions", json=BODY, headers=headers)


def test_rollback_to_a_release_needing_a_missing_tool_is_refused_and_the_newest_that_needs_nothing_more_serves(
        live: Daemon, tiny_model: Path) -> None:
    s = "needs-a"
    with live.http() as c:
        assert chat(c, s).status_code == 200  # the init
        a = publish(live, s, tiny_model, "a", [f"tool:{PRESENT}"])
        b = publish(live, s, tiny_model, "b", [f"tool:{ABSENT}"])
        met = publish(live, s, tiny_model, "c", ["env:REQ_SET", f"tool:{PRESENT}"])
        d = publish(live, s, tiny_model, "d", ["env:REQ_SET", f"tool:{ABSENT}"])

        # loading the head that needs a missing tool is refused, naming it and offering the newest met release
        resp = chat(c, s)
        assert resp.status_code == 409, resp.text
        assert f"tool:{ABSENT}" in resp.text and met[:12] in resp.text
        # a pinned release whose needs are met loads; one whose needs are not is refused
        ok = chat(c, s, **{"x-reef-release-id": met})
        assert ok.status_code == 200 and ok.headers["x-reef-release-id"] == met
        assert chat(c, s, **{"x-reef-release-id": a}).status_code == 200
        assert chat(c, s, **{"x-reef-release-id": b}).status_code == 409

        refused = c.post(f"/reef/scenarios/{s}/rollback", json={"release_id": b, "expected_head": d})
        assert_canonical_error(refused, 409)
        err = refused.json()["error"]
        assert err["requirement"] == f"tool:{ABSENT}" and f"tool:{ABSENT}" in err["message"]
        # the newest release that needs nothing more: not b's parent (a), not the head (d), not the first (init)
        assert err["offered"] == met and f"reef releases rollback {met[:12]} -s {s}" in err["message"]
        assert c.get(f"/reef/scenarios/{s}/releases").json()["head"] == d  # nothing was published

        cli = live.cli("releases", "rollback", b, "-s", s, "--yes", check=False)
        assert cli.returncode == 5 and f"tool:{ABSENT}" in cli.stderr and met[:12] in cli.stderr

        done = c.post(f"/reef/scenarios/{s}/rollback", json={"release_id": err["offered"], "expected_head": d})
        assert done.status_code == 201, done.text
        served = chat(c, s)
        assert served.status_code == 200 and served.headers["x-reef-release-id"] == done.json()["release_id"]
        assert done.json()["requires"] == ["env:REQ_SET", f"tool:{PRESENT}"]


def test_a_tool_installed_while_the_daemon_runs_counts(live: Daemon, tiny_model: Path) -> None:
    s, later = "needs-later", "reef-test-later-tool"
    with live.http() as c:
        assert chat(c, s).status_code == 200
        rid = publish(live, s, tiny_model, "later", [f"tool:{later}"])
        assert chat(c, s, **{"x-reef-release-id": rid}).status_code == 409
        tool = live.home / "bin" / later
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
        deadline = time.monotonic() + HANG_GUARD_S  # a hang guard: the check is kept a second
        while (resp := chat(c, s, **{"x-reef-release-id": rid})).status_code != 200:
            assert resp.status_code == 409 and time.monotonic() < deadline, resp.text
            time.sleep(0.05)
        assert resp.headers["x-reef-release-id"] == rid


def test_a_held_candidate_needing_what_this_machine_lacks_serves_no_canary(live: Daemon, tiny_model: Path) -> None:
    s = "needs-canary"
    with live.http() as c:
        assert chat(c, s).status_code == 200
        store = ReleaseStore(live.home / "artifacts.git")
        files = {**files_from_dir(tiny_model), "note.txt": b"held"}
        unmet = store.hold(s, files, kind="weights", recipe="record", requires=[f"tool:{ABSENT}"])
        met = store.hold(s, {**files, "note.txt": b"held too"}, kind="weights", recipe="record",
                         requires=[f"tool:{PRESENT}"])
        refused = c.post(f"/reef/scenarios/{s}/canary", json={"release_id": unmet.release_id, "share": 0.5})
        assert_canonical_error(refused, 409)
        assert refused.json()["error"]["requirement"] == f"tool:{ABSENT}"
        assert c.get(f"/reef/scenarios/{s}/canary").status_code == 404
        started = c.post(f"/reef/scenarios/{s}/canary", json={"release_id": met.release_id, "share": 0.5})
        assert started.status_code == 201, started.text
        assert c.post(f"/reef/scenarios/{s}/canary/end", json={}).status_code == 200


def test_releases_show_lists_each_item_checked_on_this_machine(live: Daemon, tiny_model: Path) -> None:
    s = "needs-show"
    with live.http() as c:
        assert chat(c, s).status_code == 200
        rid = publish(live, s, tiny_model, "x", [f"tool:{PRESENT}", "env:REQ_UNSET", "provider:tiny"])
        shown = c.get(f"/reef/releases/{rid}").json()
        plain = c.get(f"/reef/releases/{shown['parent']}").json()
    by_item = {r["item"]: r for r in shown["requirements"]}
    assert list(by_item) == [f"tool:{PRESENT}", "env:REQ_UNSET", "provider:tiny"]
    assert by_item[f"tool:{PRESENT}"]["met"] is True and by_item[f"tool:{PRESENT}"]["found"].endswith(PRESENT)
    assert by_item["env:REQ_UNSET"]["met"] is False and by_item["provider:tiny"]["met"] is True
    assert plain["requirements"] == [] and plain["requires"] == []
    out = live.cli("releases", "show", rid).stdout
    assert f"requires tool:{PRESENT}: met" in out and "requires env:REQ_UNSET: NOT MET (not set" in out
    assert "requires provider:tiny: met (model tiny" in out


def test_an_unknown_kind_in_a_scenarios_settings_is_refused_before_anything_is_written(live: Daemon) -> None:
    with live.http() as c:
        resp = c.post("/reef/scenarios", json={"name": "needs-bad", "recipe": "lessons",
                                               "settings": {"requires": ["tool:git", "gpu:h100"]}})
        assert_canonical_error(resp, 400)
        assert "gpu:h100" in resp.json()["error"]["message"] and resp.json()["error"]["param"] == "settings.requires"
        assert c.get("/reef/scenarios/needs-bad").status_code == 404
        assert "needs-bad" not in ReleaseStore(live.home / "artifacts.git").scenarios()
        assert c.post("/reef/scenarios", json={"name": "needs-upd", "recipe": "lessons"}).status_code == 201
        cli = live.cli("scenarios", "update", "needs-upd", "--requires", "tool:git", "--requires", "gpu:h100",
                       check=False)
        assert cli.returncode == 2 and "gpu:h100" in cli.stderr
        assert c.get("/reef/scenarios/needs-upd").json()["settings"] == {}


def test_a_recipes_candidates_say_what_the_scenarios_settings_require(live: Daemon) -> None:
    s = "needs-lessons"
    with live.http() as c:
        made = c.post("/reef/scenarios", json={"name": s, "recipe": "lessons",
                                               "settings": {"requires": [f"tool:{PRESENT}"]}})
        assert made.status_code == 201, made.text
        out = c.post(f"/reef/scenarios/{s}/evolve", json={"instruction": "Run the tests before you finish."})
        assert out.status_code == 201, out.text
        head = c.get(f"/reef/scenarios/{s}/releases").json()["releases"][0]
        assert head["operation"] == "train" and head["requires"] == [f"tool:{PRESENT}"]
        # a need this machine lacks: the step publishes nothing, saying which item
        live.cli("scenarios", "update", s, "--requires", f"tool:{ABSENT}")
        out = c.post(f"/reef/scenarios/{s}/evolve", json={"instruction": "Keep answers short."})
        after = c.get(f"/reef/scenarios/{s}/releases").json()
    assert after["head"] == head["release_id"], out.text
    assert out.json()["verdict"] == "failed" and f"tool:{ABSENT}" in out.json()["reason"]


def test_a_harness_whose_needs_are_not_met_is_not_handed_to_an_agent(live: Daemon) -> None:
    s = "needs-harness"
    with live.http() as c:
        assert c.post("/reef/scenarios", json={"name": s, "recipe": "lessons"}).status_code == 201
        store = ReleaseStore(live.home / "artifacts.git")
        init = store.head(s)
        met = store.publish(s, {"AGENTS.md": b"Run the tests.\n"}, expected_head=init, operation="train",
                            kind="harness", recipe="lessons", requires=[f"tool:{PRESENT}"]).release_id
        run = c.post("/reef/runs", json={"adapter": "pi", "scenario": s})
        assert run.status_code == 201 and run.json()["release_id"] == met, run.text
        unmet = store.publish(s, {"AGENTS.md": b"Use the linter.\n"}, expected_head=met, operation="train",
                              kind="harness", recipe="lessons", requires=["agent:pi>=999", f"tool:{PRESENT}"])
        # refused whether the wrapper has the harness installed already or not
        for resp in (c.post("/reef/runs", json={"adapter": "pi", "scenario": s, "installed_release": met}),
                     c.post("/reef/runs", json={"adapter": "pi", "scenario": s, "installed_release": unmet.release_id}),
                     c.get(f"/reef/scenarios/{s}/harness", params={"adapter": "pi"})):
            assert_canonical_error(resp, 409)
            assert resp.json()["error"]["requirement"] == "agent:pi>=999" and resp.json()["error"]["offered"] == met


# --- following a chain remote ---------------------------------------------------------------------------------


def after_follow(c: httpx.Client, since: float) -> float:
    """The time of the first follow the daemon finished after ``since`` (it may have started before)."""
    deadline = time.monotonic() + HANG_GUARD_S  # a hang guard only
    while (state := c.get("/reef/status").json()["chain_remote"])["last_fetch"] is None or state["last_fetch"] <= since:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return float(state["last_fetch"])


def next_follow(c: httpx.Client, since: float) -> dict[str, Any]:
    """The remote state after a follow that started after ``since``: the one after the next one that ended."""
    after_follow(c, since)
    return dict(c.get("/reef/status").json()["chain_remote"])


def test_a_remote_head_needing_what_this_machine_lacks_is_not_followed(daemon_factory: Any, tiny_model: Path,
                                                                       tmp_path: Path) -> None:
    remote = bare(tmp_path / "chains.git")
    follower = with_top_level(daemon_factory(start=False), f'chain_remote = "{remote}"\nchain_fetch_s = 0.2\n')
    s = "needs-remote"
    with follower.http() as c:
        init = chat(c, s).headers["x-reef-release-id"]
        path = tmp_path / "other.git"  # another machine's store on the same remote
        pub = ReleaseStore(path, remote=ChainRemote(path, str(remote)))
        pub.follow()
        files = {**files_from_dir(tiny_model), "note.txt": b"remote"}
        unmet = pub.publish(s, files, expected_head=init, operation="train", kind="weights", recipe="record",
                            requires=[f"tool:{ABSENT}"])
        # the follower fetches it and refuses it, naming the item; it serves on from the release it has
        error = next_follow(c, after_follow(c, time.time()))["error"]
        assert error is not None and f"tool:{ABSENT}" in error, error
        assert unmet.release_id[:12] in error and f"{init[:12]} (step 0), the head, which serves on" in error
        resp = chat(c, s)
        assert resp.status_code == 200 and resp.headers["x-reef-release-id"] == init
        # a release on top that needs nothing more is followed (the check is of the head to serve)
        met = pub.publish(s, {**files, "note.txt": b"met"}, expected_head=unmet.release_id, operation="train",
                          kind="weights", recipe="record", requires=["provider:tiny"])
        deadline = time.monotonic() + HANG_GUARD_S
        while (got := chat(c, s)).headers.get("x-reef-release-id") != met.release_id:
            assert got.status_code == 200 and time.monotonic() < deadline, got.text
            time.sleep(0.05)
