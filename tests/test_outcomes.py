"""Outcomes as feedback, with the real ``pi`` wrapped by ``reef-pi`` against a real daemon: the agent's exit code
and the user's check command (a project whose check fails, then passes) become reports with ``source = "outcome"``
on the run's receipts; a check that cannot run is written down as failed, never scored; whether the agent's
changes were kept is judged at the next run in the same git project."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from reef_cli import outcomes
from tests.test_agents import BIN, agents_dir, last_run, setup  # noqa: F401 - fixtures, used by name


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def project(root: Path) -> Path:
    p = root / "outcome-project"
    p.mkdir(parents=True, exist_ok=True)
    (p / "app.py").write_text("print('v1')\n")
    git(p, "init", "-q")
    git(p, "add", ".")
    git(p, "commit", "-qm", "start")
    return p


def reef_pi(s: dict[str, Any], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "reef-pi"), *args], cwd=cwd, env=s["env"], capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)


def outcome_reports(s: dict[str, Any], receipt: str) -> list[dict[str, Any]]:
    with s["daemon"].http() as c:
        rec = c.get(f"/reef/records/{receipt}").json()
    return [r["report"] for r in rec["reports"] if (r["report"].get("metadata") or {}).get("source") == "outcome"]


def test_exit_code_and_check_become_outcome_reports(setup: dict[str, Any]) -> None:  # noqa: F811
    p = project(setup["work"])
    ask = ["--reef-scenario", "outc", "--reef-outcome", "exit", "--reef-check", "test -e ok && echo fine || "
           "(echo 'ok is missing' && exit 3)", "-p", "--no-session", "say hi"]
    failing = reef_pi(setup, p, *ask)
    assert failing.returncode == 0, failing.stderr
    assert "outcome exit: score 1" in failing.stderr and "outcome check: score 0" in failing.stderr, failing.stderr
    run = last_run(setup, "pi")
    got = {r["metadata"]["outcome"]: r for r in outcome_reports(setup, run["receipts"][0])}
    assert got["exit"]["score"] == 1.0 and got["exit"]["metadata"]["exit_code"] == 0
    assert got["check"]["score"] == 0.0 and got["check"]["metadata"]["exit_code"] == 3
    assert "ok is missing" in got["check"]["metadata"]["output"]
    (p / "ok").write_text("")
    passing = reef_pi(setup, p, *ask)
    assert "outcome check: score 1" in passing.stderr, passing.stderr
    run2 = last_run(setup, "pi")
    assert {r["metadata"]["outcome"]: r["score"] for r in outcome_reports(setup, run2["receipts"][0])} == {
        "exit": 1.0, "check": 1.0}
    # a check that cannot run: written down with its reason, no report
    broken = reef_pi(setup, p, "--reef-scenario", "outc", "--reef-check", "no-such-checker-xyz", "-p",
                     "--no-session", "say hi")
    assert "outcome check not measured: the check could not run (exit 127)" in broken.stderr, broken.stderr
    run3 = last_run(setup, "pi")
    assert run3["outcomes_failed"][0]["outcome"] == "check" and outcome_reports(setup, run3["receipts"][0]) == []
    # not asked: no outcome reports
    plain = reef_pi(setup, p, "--reef-scenario", "outc", "-p", "--no-session", "say hi")
    assert "outcome" not in plain.stderr and outcome_reports(setup, last_run(setup, "pi")["receipts"][0]) == []
    bad = reef_pi(setup, p, "--reef-outcome", "vibes", "-p", "--no-session", "say hi")
    assert bad.returncode == 2 and "--reef-outcome takes exit and kept" in bad.stderr


def test_the_scenarios_outcome_settings_come_from_config_and_bad_ones_are_refused(setup: dict[str, Any]) -> None:  # noqa: F811
    p = project(setup["work"] / "cfg")  # a fresh project
    cfg = setup["daemon"].home / "config.toml"
    original = cfg.read_text()
    try:
        cfg.write_text(original + '\n[outcomes.outcfg]\nexit = true\npass_score = 0.75\nfail_score = -1\n')
        out = reef_pi(setup, p, "--reef-scenario", "outcfg", "-p", "--no-session", "say hi")
        assert "outcome exit: score 0.75" in out.stderr, out.stderr
        cfg.write_text(original + '\n[outcomes.outcfg]\nexits = true\n')
        refused = reef_pi(setup, p, "--reef-scenario", "outcfg", "-p", "--no-session", "say hi")
        assert refused.returncode == 2 and "outcomes.outcfg: unknown keys exits" in refused.stderr, refused.stderr
    finally:
        cfg.write_text(original)


def test_changes_kept_or_reverted_are_judged_at_the_next_run(setup: dict[str, Any]) -> None:  # noqa: F811
    """The state the wrapper snapshots around a run (real git): a file the agent changed, one it created, one it
    committed; put back afterwards, the next run in that project reports the share kept on the earlier run's
    receipts."""
    p = project(setup["work"] / "kept")
    first = reef_pi(setup, p, "--reef-scenario", "outkept", "--reef-outcome", "kept", "-p", "--no-session", "say hi")
    assert first.returncode == 0, first.stderr
    run = last_run(setup, "pi")
    assert "changes" not in run  # pi on the tiny model changed nothing
    before = outcomes.snapshot(p)
    (p / "app.py").write_text("print('v2')\n")  # as the agent would have
    (p / "new.py").write_text("x = 1\n")
    (p / "lib.py").write_text("y = 2\n")
    git(p, "add", "lib.py")
    git(p, "commit", "-qm", "the agent's commit")
    changed = outcomes.changes(before, outcomes.snapshot(p))
    assert sorted(changed) == ["app.py", "lib.py", "new.py"]
    assert outcomes.changes(outcomes.snapshot(p), outcomes.snapshot(p)) == {}
    run["changes"] = {"root": before["root"], "files": changed}
    (setup["daemon"].home / "runs" / f"{run['run']}.json").write_text(json.dumps(run))
    (p / "app.py").write_text("print('v1')\n")  # the user puts one back
    second = reef_pi(setup, p, "--reef-scenario", "outkept", "--reef-outcome", "kept", "-p", "--no-session",
                     "say hi")
    assert f"outcome kept of run {run['run']}: 2 of 3 changed file(s) kept" in second.stderr, second.stderr
    got = outcome_reports(setup, run["receipts"][0])
    assert [(r["metadata"]["kept"], r["metadata"]["reverted"]) for r in got] == [(2, 1)]
    assert abs(got[0]["score"] - 2 / 3) < 1e-9
    third = reef_pi(setup, p, "--reef-scenario", "outkept", "--reef-outcome", "kept", "-p", "--no-session",
                    "say hi")
    assert f"outcome kept of run {run['run']}" not in third.stderr  # judged once
