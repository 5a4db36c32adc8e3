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
from tests.procs import wait_standin
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
        cfg.write_text(original + '\n[outcomes.outcfg]\nexit = true\npass_score = 0.75\nfail_score = 0.1\n'
                                  'check = "test -e app.py"\n')
        out = reef_pi(setup, p, "--reef-scenario", "outcfg", "-p", "--no-session", "say hi")
        assert "outcome exit: score 0.75" in out.stderr, out.stderr
        # the configured check runs without --reef-check; the flag, given, replaces it for that run
        assert "outcome check: score 0.75 (test -e app.py exited 0)" in out.stderr, out.stderr
        flagged = reef_pi(setup, p, "--reef-scenario", "outcfg", "--reef-check", "test -e nothing-here", "-p",
                          "--no-session", "say hi")
        assert "outcome check: score 0.1 (test -e nothing-here exited 1)" in flagged.stderr, flagged.stderr
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


def test_a_real_agents_changes_are_snapshotted_by_the_wrapper_and_judged_kept_or_reverted(
        tiny_model: Path, agents_dir: Path) -> None:  # noqa: F811
    """End to end: the real pi, wrapped, writes answer.txt with its own write tool (its model is a stand-in over
    real HTTP, tests/harness_standins.py: no model that can use tools exists here). The wrapper's snapshots around
    the run write the change into the run record; put back by the user, the next run reports it reverted (score 0)
    on the first run's receipts; kept, the run after reports it kept (score 1) on the second's."""
    import shutil
    import sys
    import tempfile

    from tests.conftest import ROOT, Daemon, free_port, make_home
    from tests.test_agents import _user_home

    port = free_port()
    stub = subprocess.Popen([sys.executable, str(ROOT / "tests" / "harness_standins.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    standin = f"http://127.0.0.1:{port}"
    home, dport, env = make_home(tiny_model, f'\n[models.agent]\nengine = "upstream"\nurl = "{standin}"\n'
                                             'format = "openai-chat"\nupstream_model = "agent"\n')
    (home / "config.toml").write_text(f'agents_dir = "{agents_dir}"\n' + (home / "config.toml").read_text())
    work = Path(tempfile.mkdtemp(prefix="reef-kept-"))
    d = Daemon(home=home, port=dport, env=env).start()
    try:
        wait_standin(standin)
        with d.http() as c:
            made = c.post("/reef/scenarios", json={"name": "kept-e2e", "recipe": "record", "model": "agent"})
            assert made.status_code == 201, made.text
        s = {"daemon": d, "env": dict(env, REEF_AGENTS_DIR=str(agents_dir), HOME=str(_user_home(work)))}
        p = project(work)
        args = ("--reef-scenario", "kept-e2e", "--reef-outcome", "kept", "-p", "--no-session",
                "Write the greeting into answer.txt.")

        first = reef_pi(s, p, *args)
        assert first.returncode == 0, first.stderr
        assert (p / "answer.txt").read_text().strip() == "hello"  # the agent's own write tool
        run1 = last_run(s, "pi")
        assert list(run1["changes"]["files"]) == ["answer.txt"] and run1["receipts"]
        (p / "answer.txt").unlink()  # the user puts it back

        second = reef_pi(s, p, *args)
        assert f"outcome kept of run {run1['run']}: 0 of 1 changed file(s) kept" in second.stderr, second.stderr
        assert [(r["metadata"]["kept"], r["score"]) for r in outcome_reports(s, run1["receipts"][0])] == [(0, 0.0)]
        run2 = last_run(s, "pi")
        assert run2["run"] != run1["run"] and list(run2["changes"]["files"]) == ["answer.txt"]

        third = reef_pi(s, p, *args)  # answer.txt from the second run is still there
        assert f"outcome kept of run {run2['run']}: 1 of 1 changed file(s) kept" in third.stderr, third.stderr
        assert [(r["metadata"]["kept"], r["score"]) for r in outcome_reports(s, run2["receipts"][0])] == [(1, 1.0)]
    finally:
        stub.kill()
        stub.wait()
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# --- the check and the project's state, on their own (no agent needed) ---------------------------------------------


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its parent to reap it runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_check_that_times_out_takes_the_processes_it_started_with_it(tmp_path: Path) -> None:
    """A check that starts a test runner which keeps writing in the project: at the time limit the whole check
    ends (its process group), not only the shell, so nothing writes in the project after "the check timed out"."""
    import os
    import signal
    import time

    check = ("sh -c 'echo $$ > runner.pid; while :; do echo x >> grow.txt; sleep 0.05; done' & "
             "while ! test -s runner.pid; do sleep 0.01; done; wait")
    got = outcomes.run_check(check, tmp_path, timeout_s=3)
    pid = int((tmp_path / "runner.pid").read_text())
    try:
        assert got == {"status": "error", "reason": "the check timed out after 3 s"}, got
        deadline = time.monotonic() + 30  # a bound on the wait, not the assertion: the runner is gone when killed
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid), "the check's runner is still writing in the project after the check timed out"
        assert (tmp_path / "grow.txt").stat().st_size > 0  # it ran, and with it gone nothing writes there
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_check_that_exits_126_or_127_is_not_measured_and_any_other_exit_is_a_verdict(tmp_path: Path) -> None:
    from daemon.config import OutcomeSettings

    for code in (126, 127):  # the shell could not run the command: no verdict on the project
        reports, failed = outcomes.reports_for_run(OutcomeSettings(check=f"exit {code}"), 0, tmp_path)
        assert reports == [] and failed[0]["outcome"] == "check", (code, reports)
        assert f"the check could not run (exit {code})" in failed[0]["reason"]
    for code, score in ((125, 0.0), (1, 0.0), (0, 1.0)):
        reports, failed = outcomes.reports_for_run(OutcomeSettings(check=f"exit {code}"), 0, tmp_path)
        assert failed == [] and [(r["score"], r["metadata"]["exit_code"]) for r in reports] == [(score, code)]


def test_the_check_output_keeps_its_tail(tmp_path: Path) -> None:
    got = outcomes.run_check("echo FIRST-LINE; head -c 20000 /dev/zero | tr '\\0' x; echo; echo LAST-LINE",
                             tmp_path, timeout_s=60)
    assert got["status"] == "passed" and len(got["output"]) == outcomes.OUTPUT_TAIL
    assert got["output"].endswith("LAST-LINE\n") and "FIRST-LINE" not in got["output"]


def test_a_check_in_config_is_run_without_the_flag_and_the_flag_wins() -> None:
    from daemon.config import OutcomeSettings

    configured = OutcomeSettings(check="pytest -q", exit=True)
    assert outcomes.with_flags(configured, [], None).check == "pytest -q"
    assert outcomes.with_flags(configured, ["kept"], None) == OutcomeSettings(check="pytest -q", exit=True, kept=True)
    assert outcomes.with_flags(configured, [], "make test").check == "make test"
    assert outcomes.with_flags(OutcomeSettings(), [], None).check is None


def test_after_git_mv_the_changes_name_both_real_paths_and_nothing_else(tmp_path: Path) -> None:
    """``git status -z`` writes a rename as the new path then its source: each is a path the run changed (the
    source is gone); read as an entry of its own, the source became a path that does not exist."""
    p = project(tmp_path)
    (p / "lib.py").write_text("y = 1\n")
    git(p, "add", "lib.py")
    git(p, "commit", "-qm", "lib")
    before = outcomes.snapshot(p)
    git(p, "mv", "app.py", "main.py")
    git(p, "mv", "lib.py", "library.py")
    after = outcomes.snapshot(p)
    assert after is not None and sorted(after["files"]) == ["app.py", "lib.py", "library.py", "main.py"], after
    changed = outcomes.changes(before, after)
    assert sorted(changed) == ["app.py", "lib.py", "library.py", "main.py"], changed
    assert changed["app.py"][1] is None and changed["main.py"][0] is None and changed["main.py"][1] is not None
    # put back by the user: every changed path reverted
    git(p, "mv", "main.py", "app.py")
    git(p, "mv", "library.py", "lib.py")
    assert outcomes.kept_share(changed, p) == (0, 4)


def test_an_outcome_report_never_overrides_an_explicit_one(daemon_factory: Any) -> None:
    """The user scores an answer 1; the run's outcome (a failing check) then scores it 0: the step trains on the
    user's 1. Four answers, two prompts of two: the batch's reward is 0.5 with the user's score, 0.25 had the
    outcome won."""
    from tests.test_learning import releases, settings_toml, wait_for

    d = daemon_factory(settings_toml())
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "prec", "recipe": "online-rl"}).status_code == 201
        receipts = []
        for i in range(4):
            r = c.post("/s/prec/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f'Say "w{i // 2}".'}]})
            assert r.status_code == 200, r.text
            receipts.append(r.headers["x-reef-agent-record-id"])
        first = receipts[0]
        assert c.post("/reef/report", json={"references": [first], "score": 1.0}).status_code == 201
        outcome = c.post("/reef/report", json={"references": [first], "score": 0.0, "metadata": {
            "source": "outcome", "outcome": "check", "command": "pytest -q", "exit_code": 1}})
        assert outcome.status_code == 201, outcome.text
        for rec, score in zip(receipts[1:], (0.0, 1.0, 0.0), strict=True):  # the batch is complete with the last
            assert c.post("/reef/report", json={"references": [rec], "score": score}).status_code == 201
        head = wait_for(lambda: (x := releases(c, "prec"))["releases"][0]["operation"] == "train" and x,
                        what="a train release")["releases"][0]
        assert sorted(head["receipts"]) == sorted(receipts)
        assert head["metrics"]["batch_reward"] == 0.5, head["metrics"]
