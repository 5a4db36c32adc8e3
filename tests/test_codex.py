"""``reef-codex``: OpenAI's Codex CLI (the real binary, installed from npm by ``reef agents install``) wrapped
against a real daemon, beyond what ``tests/test_agents.py`` runs for every agent.

Its model here is the stand-in over real HTTP (``tests/harness_standins.py``: no model that can use tools exists
here): a ``[run] COMMAND`` prompt gets a call of Codex's ``exec_command`` tool, and the tool's result a ``done``.
So one wrapped prompt is a whole Responses tool round trip through Reef: Codex's request, the daemon's streamed
function call, Codex running it, its ``function_call_output`` back, the final answer. Every run is watched with
strace (no address outside loopback), and the user's own ``~/.codex`` (and ``~/.agents/skills``, which Codex reads
too) stay unchanged and unread by the model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters import ADAPTERS
from tests.conftest import ROOT, Daemon, free_port, make_home
from tests.procs import wait_standin
from tests.test_agents import _user_home, agents_dir, remote_addresses, snapshot  # noqa: F401 - a fixture

pytestmark = pytest.mark.agents

CODEX = ADAPTERS["codex"]


@pytest.fixture(scope="module")
def world(tiny_model: Path, agents_dir: Path) -> Iterator[dict[str, Any]]:  # noqa: F811
    port = free_port()
    stub = subprocess.Popen([sys.executable, str(ROOT / "tests" / "harness_standins.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    standin = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="reef-codex-"))
    short = work / "short"  # the tiny model with a 1,024-token context: Codex's first request does not fit
    shutil.copytree(tiny_model, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    home, dport, env = make_home(tiny_model, f'\n[models.agent]\nengine = "upstream"\nurl = "{standin}"\n'
                                             'format = "openai-chat"\nupstream_model = "agent"\n'
                                             f'\n[models.short]\nengine = "transformers"\npath = "{short}"\n'
                                             f'\n[models.capped]\nengine = "transformers"\npath = "{tiny_model}"\n'
                                             'max_tokens_limit = 16\n')
    settings = (home / "config.toml").read_text().replace('default_model = "tiny"', 'default_model = "agent"', 1)
    (home / "config.toml").write_text(f'agents_dir = "{agents_dir}"\n' + settings)
    d = Daemon(home=home, port=dport, env=env).start()
    try:
        wait_standin(standin)
        project = work / "project"
        project.mkdir()
        user = _user_home(work)
        yield {"daemon": d, "work": work, "project": project, "user": user, "standin": standin,
               "env": dict(env, REEF_AGENTS_DIR=str(agents_dir), HOME=str(user), OPENAI_API_KEY="sk-users-own")}
    finally:
        stub.kill()
        stub.wait()
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def reef_codex(w: dict[str, Any], *args: str, trace: Path | None = None) -> subprocess.CompletedProcess[str]:
    from tests.test_agents import BIN

    script = BIN / "reef-codex"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "reef_cli.wrapper", "codex"]
    if trace is not None:
        cmd = ["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace), *cmd]
    return subprocess.run([*cmd, *args], cwd=w["project"], env=w["env"], capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)


def run_record(w: dict[str, Any]) -> dict[str, Any]:
    runs = w["daemon"].home / "runs"
    return json.loads((runs / f"{(runs / 'last-codex').read_text().strip()}.json").read_text())


def records(w: dict[str, Any], receipts: list[str]) -> list[dict[str, Any]]:
    with w["daemon"].http() as c:
        return [c.get(f"/reef/records/{r}").json() for r in receipts]


def test_a_tool_call_round_trips_through_reef_and_nothing_leaves_loopback(world: dict[str, Any]) -> None:
    before = snapshot(world["user"])
    trace = world["work"] / "codex-tool.strace"
    out = reef_codex(world, "--reef-scenario", "cx-tools", "-p", "[run] echo hi-from-codex", trace=trace)
    assert out.returncode == 0, out.stdout + out.stderr
    assert remote_addresses(trace) == set(), "a wrapped Codex run connected outside loopback"
    assert "done" in out.stdout  # the stand-in's answer to the tool's result, printed by codex exec
    run = run_record(world)
    assert run["scenario"] == "cx-tools" and run["exit_code"] == 0 and len(run["receipts"]) == 2, run
    first, second = records(world, run["receipts"])
    assert first["format"] == "openai-responses" and first["request"]["store"] is False
    call = [i for i in first["response"]["output"] if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in call] == [("exec_command", {"cmd": "echo hi-from-codex"})]
    outputs = [i for i in second["request"]["input"] if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [call[0]["call_id"]]  # Codex ran it and sent its result back
    # one Codex session across both requests, recognised as such by the daemon
    from daemon.sessions import session_key

    keys = {session_key(r["headers"], None) for r in (first, second)}
    assert len(keys) == 1 and next(iter(keys)).startswith("session-id="), keys
    assert snapshot(world["user"]) == before, "the user's own ~/.codex (or skills) changed"


def test_the_codex_home_is_isolated_and_holds_no_token(world: dict[str, Any], agents_dir: Path) -> None:  # noqa: F811
    d: Daemon = world["daemon"]
    out = reef_codex(world, "--reef-scenario", "cx-home", "-p", "say hi")
    assert out.returncode == 0, out.stdout + out.stderr
    run = run_record(world)
    codex_home = d.home / "homes" / "codex" / "cx-home" / ".codex"
    config = tomllib.loads((codex_home / "config.toml").read_text())
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == f"{d.url}/s/cx-home/r/{run['run']}/v1"
    assert provider["wire_api"] == "responses" and provider["env_key"] == "REEF_TOKEN"
    for p in codex_home.parent.rglob("*"):  # the whole agent home: the token is read from the environment only
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            assert d.token.encode() not in data and b"sk-users-own" not in data, p
    recs = records(world, run["receipts"])
    sent = json.dumps([r["request"] for r in recs])
    # the user's own rules and skills (~/.codex, ~/.agents/skills) never reach the model; the token Reef got is
    # Reef's, not the user's OpenAI key
    assert "the user's own Codex rules" not in sent and "the user's skill" not in sent
    assert recs and "users-own-model" not in sent and all(r["model"] == "agent" for r in recs)
    # every key the wrapper writes is one this Codex knows: a renamed offline switch would otherwise be ignored
    strict = subprocess.run([str(CODEX.binary_path(agents_dir)), "exec", "--strict-config", "--skip-git-repo-check",
                             "say hi"], cwd=world["project"], capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL, env={**world["env"], "HOME": str(codex_home.parent),
                                                           "CODEX_HOME": str(codex_home), "REEF_TOKEN": d.token})
    assert strict.returncode == 0, strict.stdout + strict.stderr


def test_p_runs_in_codexs_read_only_sandbox_until_the_user_widens_it(world: dict[str, Any]) -> None:
    """docs/agents.md: ``reef-codex -p`` runs ``codex exec`` in Codex's read-only sandbox (it cannot edit files), and
    Codex's own ``--sandbox workspace-write`` after the prompt lets it; the wrapper never widens it by itself (argv or
    config.toml). Read from what Codex itself prints of the session (``sandbox: ...``). Bugs caught: the wrapper
    adding ``--full-auto`` or a ``sandbox_mode`` to the home's config.toml, the user's flag dropped."""
    def sandbox(out: subprocess.CompletedProcess[str]) -> str:
        assert out.returncode == 0, out.stdout + out.stderr
        said = [ln.split(":", 1)[1].strip() for ln in (out.stdout + out.stderr).splitlines()
                if ln.startswith("sandbox:")]
        assert len(said) == 1, out.stdout + out.stderr
        return said[0]

    assert sandbox(reef_codex(world, "--reef-scenario", "cx-sandbox", "-p", "say hi")).startswith("read-only")
    widened = sandbox(reef_codex(world, "--reef-scenario", "cx-sandbox", "-p", "say hi", "--sandbox",
                                 "workspace-write"))
    assert widened.startswith("workspace-write"), widened
    codex_home = world["daemon"].home / "homes" / "codex" / "cx-sandbox" / ".codex"
    config = tomllib.loads((codex_home / "config.toml").read_text())
    assert not {"sandbox_mode", "sandbox_workspace_write", "approval_policy"} & set(config), config


def test_flags_and_exit_codes_pass_through(world: dict[str, Any], agents_dir: Path) -> None:  # noqa: F811
    version = reef_codex(world, "--version")
    assert version.returncode == 0 and f"codex-cli {CODEX.version}" in version.stdout, version.stdout + version.stderr
    dashed = reef_codex(world, "--", "--version")
    assert dashed.returncode == 0 and CODEX.version in dashed.stdout
    bad = reef_codex(world, "--no-such-flag-xyz")
    direct = subprocess.run([str(CODEX.binary_path(agents_dir)), "--no-such-flag-xyz"], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL,
                            env={**world["env"], "CODEX_HOME": str(world["work"] / "cx")})
    assert bad.returncode == direct.returncode != 0


def test_a_prompt_beyond_the_models_context_is_told_as_codex_understands_it(world: dict[str, Any]) -> None:
    """Codex's first request (about 6,000 tokens) against a 1,024-token model: the daemon's 400 carries OpenAI's
    ``context_length_exceeded`` code, which Codex turns into its own clear message, at once (no retries)."""
    with world["daemon"].http() as c:
        made = c.post("/reef/scenarios", json={"name": "cx-short", "model": "short"})
        assert made.status_code == 201, made.text
    out = reef_codex(world, "--reef-scenario", "cx-short", "-p", "say hi")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ran out of room in the model's context window" in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_interactive_tui_stays_on_loopback_and_leaves_no_daemon(world: dict[str, Any]) -> None:
    """``reef-codex`` with no arguments is Codex's TUI (on a pseudo-terminal here). It fetches an announcement from
    raw.githubusercontent.com on every start, with no switch to stop it: the test waits for that attempt, which
    must end at the refusing proxy on loopback (no name looked up, no address outside). The TUI runs its app
    server in-process: no release copied into the home, no daemon left behind."""
    import os
    import pty
    import select
    import signal

    from tests.test_agents import BIN

    trace = world["work"] / "tui.strace"
    script = BIN / "reef-codex"
    wrapper = [str(script)] if script.exists() else [sys.executable, "-m", "reef_cli.wrapper", "codex"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace),
                             *wrapper, "--reef-scenario", "cx-tui"], stdin=slave, stdout=slave, stderr=slave,
                            cwd=world["project"], env={**world["env"], "TERM": "xterm"}, start_new_session=True)
    os.close(slave)
    try:
        deadline = time.monotonic() + 180  # a hang guard only: the test waits for the attempt itself
        # the attempt: to the refusing proxy (port 9), or a name lookup (port 53) when nothing stops it
        while not any(f"sin_port=htons({port})" in (trace.read_text() if trace.exists() else "") for port in (9, 53)):
            assert proc.poll() is None, f"the TUI exited ({proc.returncode}) before its announcement fetch"
            assert time.monotonic() < deadline, "the TUI never tried its announcement fetch"
            if select.select([master], [], [], 0.2)[0]:
                try:
                    os.read(master, 65536)  # drain the screen, so the TUI never blocks drawing it
                except OSError:
                    break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        os.close(master)
    assert remote_addresses(trace) == set(), "the TUI connected outside loopback"
    codex_home = world["daemon"].home / "homes" / "codex" / "cx-tui" / ".codex"
    assert codex_home.is_dir() and not (codex_home / "packages").exists()
    assert not (codex_home / "app-server-daemon").exists()


def test_an_answer_the_output_cap_ends_lets_codex_end_with_it(world: dict[str, Any]) -> None:
    """Codex sends no output limit. On a local model its answer gets the model's output cap, and an answer the cap
    ends is ``completed``, not ``incomplete``: Codex ends a run that got ``incomplete`` with "Incomplete response
    returned, reason: max_output_tokens" and exit 1. The model here has a cap of 16 tokens, so every answer is cut by
    it (the tiny model rarely says its end token that soon); the run still ends with its answer and exit 0."""
    with world["daemon"].http() as c:
        made = c.post("/reef/scenarios", json={"name": "cx-cap", "recipe": "lessons", "model": "capped"})
        assert made.status_code == 201, made.text
    out = reef_codex(world, "--reef-scenario", "cx-cap", "-p", "say hi")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "max_output_tokens" not in out.stdout + out.stderr
    run = run_record(world)
    recs = records(world, run["receipts"])
    assert recs and all(r["model"] == "capped" and r["status"] == "complete" for r in recs), recs
    assert all("max_output_tokens" not in r["request"] for r in recs)  # Codex asks for no limit
    answers = [r["response"] for r in recs]
    assert all(a["status"] == "completed" and a["incomplete_details"] is None for a in answers), answers
    assert all(a["usage"]["output_tokens"] <= 16 for a in answers)
