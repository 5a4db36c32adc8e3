"""A new user's typos at the wrapper (issue: a typo became the last run): a near-miss of a wrapper subcommand and
an unknown ``--reef-*`` flag are refused before any agent starts, and a run that made no model request is never the
one ``report`` scores. The real ``reef-pi`` wrapper against a real daemon; the agent is a small script where the
adapter looks for pi (``tests/test_cli_exits.fake_agent``), which makes real requests when a test needs them."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import Daemon
from tests.test_cli_exits import agents, fake_agent, last_run, one_line, wrapped  # noqa: F401 - agents: a fixture

ASKS = ('import json, os, urllib.request\n'
        'req = urllib.request.Request("{url}/s/exits/r/" + os.environ["REEF_RUN"] + "/v1/chat/completions", '
        'data=json.dumps({{"model": "tiny", "max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}]}})'
        '.encode(), headers={{"x-api-key": "{token}", "content-type": "application/json"}})\n'
        'urllib.request.urlopen(req, timeout=60).read()\n')


def test_a_near_miss_of_a_subcommand_is_refused_and_starts_no_run(daemon: Daemon, agents: Path,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    """Bugs caught: ``reprot`` passed to the agent (a run with no receipt), the check firing on an agent's own word
    (opencode's ``run``) or after ``--``."""
    seen = tmp_path / "seen"
    fake_agent(agents, f'echo "$@" >> "{seen}"')
    out = wrapped(daemon, agents, ["reprot", "--score", "0"], tmp_path)
    assert out.returncode == 2 and "did you mean `reef-pi report`" in one_line(out.stderr), out.stderr
    assert not seen.exists()  # the agent never started
    assert wrapped(daemon, agents, ["--", "reprot"], tmp_path).returncode == 0
    assert wrapped(daemon, agents, ["run", "say", "hi"], tmp_path).returncode == 0
    assert seen.read_text().splitlines() == ["reprot", "run say hi"]


def test_an_unknown_reef_flag_is_refused_naming_the_known_ones(daemon: Daemon, agents: Path,  # noqa: F811
                                                                tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    fake_agent(agents, f'echo "$@" >> "{seen}"')
    for flag in (["--reef-scenaro", "x"], ["--reef-provder=ollama"]):
        out = wrapped(daemon, agents, [*flag, "-p", "hi"], tmp_path)
        line = one_line(out.stderr)
        assert out.returncode == 2 and "unknown wrapper flag" in line and "did you mean --reef-" in line, line
    assert not seen.exists()
    ok = wrapped(daemon, agents, ["-p", "hi", "--", "--reef-anything"], tmp_path)  # after --: the agent's
    assert ok.returncode == 0 and seen.read_text().split() == ["-p", "hi", "--", "--reef-anything"]


def test_a_run_with_no_request_is_never_the_one_report_scores(daemon: Daemon, agents: Path,  # noqa: F811
                                                              tmp_path: Path) -> None:
    """A run that made requests, then one that made none (the agent printed its help): ``report`` scores the first
    and says which; with no run that made requests at all, it says there is nothing to report on. Bugs caught: the
    newest run scored whatever it made, a report of no flags exiting 1 instead of 2."""
    (tmp_path / "asks.py").write_text(ASKS.format(url=daemon.url, token=daemon.token))
    fake_agent(agents, f'exec "{sys.executable}" "{tmp_path / "asks.py"}"')
    assert wrapped(daemon, agents, ["-p", "go"], tmp_path).returncode == 0
    scored = last_run(daemon)
    assert len(scored["receipts"]) == 1
    fake_agent(agents, "echo usage: pi [options]")
    quiet = wrapped(daemon, agents, ["-p", "go"], tmp_path)
    assert quiet.returncode == 0 and "made no model requests" in quiet.stderr, quiet.stderr
    assert last_run(daemon)["no_requests"] is True
    out = wrapped(daemon, agents, ["report", "--score", "1"], tmp_path)
    assert out.returncode == 0 and f"of run {scored['run']}" in out.stdout, out.stdout + out.stderr
    bare = wrapped(daemon, agents, ["report"], tmp_path)
    assert bare.returncode == 2 and "give --score, --feedback, or both" in one_line(bare.stderr)


def test_a_confirmation_with_stdin_closed_is_one_line_and_exit_2(daemon: Daemon, agents: Path,  # noqa: F811
                                                                 tmp_path: Path) -> None:
    """``reef records forget`` (and every command that asks) run from a script with standard input at its end: one
    line, exit 2, nothing done. Bug caught: click's Abort escaping as a traceback."""
    import subprocess

    (tmp_path / "asks.py").write_text(ASKS.format(url=daemon.url, token=daemon.token))
    fake_agent(agents, f'exec "{sys.executable}" "{tmp_path / "asks.py"}"')
    assert wrapped(daemon, agents, ["-p", "go"], tmp_path).returncode == 0
    receipt = last_run(daemon)["receipts"][0]
    out = daemon.cli("records", "forget", receipt, check=False, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "--yes" in one_line(out.stderr), out.stderr
    with daemon.http() as c:
        assert c.get(f"/reef/records/{receipt}").status_code == 200  # nothing was forgotten
        before = c.get("/reef/scenarios/exits/releases").json()
    # reef releases rollback, the other command: the same one line, and the chain unchanged
    back = daemon.cli("releases", "rollback", "-s", "exits", before["releases"][-1]["release_id"], check=False,
                      stdin=subprocess.DEVNULL)
    assert back.returncode == 2 and "--yes" in one_line(back.stderr) and "Traceback" not in back.stderr, back.stderr
    with daemon.http() as c:
        after = c.get("/reef/scenarios/exits/releases").json()
    assert (after["head"], len(after["releases"])) == (before["head"], len(before["releases"]))
