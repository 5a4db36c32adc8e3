"""Forgetting and retention reach every copy a wrapped run leaves under ``$REEF_HOME``: the real agents (pi,
Claude Code, opencode, Codex, installed from npm as ``tests/test_agents.py`` installs them), with their sessions on,
each run's prompt carrying a unique marker. After the forget (or the retention round) no file under the home holds
the marker's bytes: the record store and its WAL, the run file, the agent's transcripts, databases and logs, the
release pages. A lessons release learned from feedback on the forgotten run is marked, the way back is named, and
after the rollback the next run installs rules without that feedback. The agents still run afterwards."""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, make_home
from tests.test_agents import agents_dir, last_run, setup, wrapped  # noqa: F401 - fixtures, used by name
from tests.test_learning import releases, wait_for

pytestmark = pytest.mark.agents

AGENTS = ["pi", "claude", "opencode", "codex"]


def prompt(agent: str, marker: str) -> list[str]:
    """A non-interactive prompt with the marker, sessions on (no ``--no-session``, no ``--ephemeral``)."""
    words = f"say hi {marker}"
    return {"pi": ["-p", words], "claude": ["-p", words], "opencode": ["run", *words.split()],
            "codex": ["-p", words]}[agent]


def holding(root: Path, data: bytes) -> list[str]:
    """Every regular file under ``root`` whose bytes hold ``data`` (binary files included; symlinks not followed)."""
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue  # the daemon's sockets
                with open(path, "rb") as f:
                    if data in f.read():
                        found.append(os.path.relpath(path, root))
            except FileNotFoundError:
                continue
    return sorted(found)


def run_ok(setup: dict[str, Any], agent: str, args: list[str], **env: str) -> dict[str, Any]:  # noqa: F811
    out = wrapped(setup, agent, args, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    run = last_run(setup, agent)
    assert run["receipts"], run
    return run


@pytest.mark.parametrize("agent", AGENTS)
def test_forgetting_a_wrapped_run_leaves_no_copy_and_marks_what_learned_from_it(
        setup: dict[str, Any], agent: str) -> None:  # noqa: F811
    d: Daemon = setup["daemon"]
    home = d.home
    scenario = f"fg-{agent}"
    gone, kept = f"GONE{uuid.uuid4().hex}", f"KEPT{uuid.uuid4().hex}"
    lesson = f"always greet {uuid.uuid4().hex[:16]} first"
    env = {"REEF_SCENARIO": scenario}
    first = run_ok(setup, agent, prompt(agent, gone), **env)
    assert first["agent_files"], "the wrapper listed nothing the agent wrote"
    agent_home = home / "homes" / agent / scenario
    assert holding(agent_home, gone.encode()), "the check cannot see the agent's transcript"
    with d.http() as c:
        init = releases(c, scenario)["releases"][-1]["release_id"]
    reported = wrapped(setup, agent, ["report", "--score", "0", "--feedback", lesson], **env)
    assert reported.returncode == 0 and "released step 1" in reported.stdout, reported.stdout + reported.stderr
    with d.http() as c:
        learned = releases(c, scenario)["releases"][0]
    page = d.cli("releases", "open", learned["release_id"], "--scenario", scenario, "--no-browser").stdout.strip()
    assert lesson.encode() in Path(page).read_bytes()
    second = run_ok(setup, agent, prompt(agent, kept), **env)  # installs the learned rules

    out = d.cli("records", "forget", first["run"], "--yes")
    assert f"forgot {len(first['receipts'])} exchange" in out.stdout, out.stdout
    assert "trained on forgotten data" in out.stdout and f"reef releases rollback {init[:12]}" in out.stdout

    assert holding(home, gone.encode()) == [], "a copy of the forgotten run is left"
    assert not (home / "runs" / f"{first['run']}.json").exists() and not Path(page).exists()
    # the other run stays: its run file, its records; its own transcript too, where the agent keeps one per session
    # (opencode keeps every session in one database, which goes whole)
    assert (home / "runs" / f"{second['run']}.json").exists()
    if agent != "opencode":
        assert holding(agent_home, kept.encode()), "the other run's transcript went too"
    with d.http() as c:
        assert all(c.get(f"/reef/records/{r}").json()["request"] is not None for r in second["receipts"])
        listed = releases(c, scenario)
    assert listed["releases"][0]["release_id"] == learned["release_id"]
    assert listed["releases"][0]["trained_on_forgotten"] is True
    assert listed["forgotten"]["rollback_to"] == init

    # the agent still runs with its files gone; after the rollback the rules it installs no longer carry the lesson
    # (the other run's transcript may quote the rules it ran with: Codex's does)
    assert installed_holding(agent_home, lesson.encode()), "the learned rules were installed"
    d.cli("releases", "rollback", init, "--scenario", scenario, "--yes")
    third = run_ok(setup, agent, prompt(agent, "again"), **env)
    assert third["release_id"] != learned["release_id"]
    assert installed_holding(agent_home, lesson.encode()) == []


def installed_holding(agent_home: Path, data: bytes) -> list[str]:
    """The harness files installed in an agent's home (as its marker lists them) that hold ``data``."""
    files = json.loads((agent_home / ".reef-harness.json").read_text())["files"]
    return [f for f in files if data in (agent_home / f).read_bytes()]


def test_retention_leaves_no_copy_of_what_it_forgets(tiny_model: Path, agents_dir: Path) -> None:  # noqa: F811
    """Each agent runs once with a marker; the daemon restarts with an age bound they are all past: the round at
    start forgets their exchanges and removes their run files and what the agents wrote. Then no file under the home
    holds any marker, and the agents still run."""
    home, port, env = make_home(tiny_model)
    config = (home / "config.toml").read_text().replace('engine = "transformers"\n',
                                                        'engine = "transformers"\nmax_tokens_limit = 12\n', 1)
    (home / "config.toml").write_text(f'agents_dir = "{agents_dir}"\n' + config)
    d = Daemon(home=home, port=port, env=env).start()
    project = home.parent / f"{home.name}-project"
    project.mkdir()
    ctx = {"daemon": d, "project": project, "env": dict(env, REEF_AGENTS_DIR=str(agents_dir),
                                                        HOME=str(home.parent / f"{home.name}-user"))}
    try:
        markers = {agent: f"OLD{uuid.uuid4().hex}" for agent in AGENTS}
        runs = {agent: run_ok(ctx, agent, prompt(agent, markers[agent])) for agent in AGENTS}
        assert all(holding(home / "homes" / a, m.encode()) for a, m in markers.items())
        d.stop()
        (home / "config.toml").write_text("retention_days = 0.00000001\n" + (home / "config.toml").read_text())
        d.start()
        receipts = [r for run in runs.values() for r in run["receipts"]]
        with d.http() as c:
            wait_for(lambda: all(c.get(f"/reef/records/{r}").json()["forgotten_at"] for r in receipts),
                     what="retention to forget the runs' exchanges")
        wait_for(lambda: not any((home / "runs" / f"{run['run']}.json").exists() for run in runs.values()),
                 what="retention to remove the run files")
        left = {agent: holding(home, m.encode()) for agent, m in markers.items()}
        assert left == {agent: [] for agent in AGENTS}, left
        d.stop()
        (home / "config.toml").write_text("\n".join(line for line in (home / "config.toml").read_text().splitlines()
                                                    if not line.startswith("retention_days")) + "\n")
        d.start()
        for agent in AGENTS:
            run_ok(ctx, agent, prompt(agent, "again"))
    finally:
        d.stop()
        for path in (home, project, Path(ctx["env"]["HOME"])):
            shutil.rmtree(path, ignore_errors=True)
