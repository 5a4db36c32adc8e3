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


# --- the module's parts, without an agent ---------------------------------------------------------------------------


def test_a_runs_outcome_flags_add_to_the_scenarios_and_an_unknown_one_is_refused() -> None:
    """``--reef-outcome exit,kept`` (or repeated, with spaces and empty items) adds to what the scenario asks, never
    takes away; ``check`` is not a flag's kind (it has its own). Bugs caught: a kind asked by the flag alone not
    taken (``and`` for ``or``), items not split on commas or not stripped, an empty item taken for a bad kind, an
    unknown kind taken."""
    import pytest

    from daemon.config import OutcomeSettings
    from daemon.errors import BadRequest

    none = OutcomeSettings()
    assert outcomes.with_flags(none, ["exit"], None) == OutcomeSettings(exit=True)
    assert outcomes.with_flags(none, [" exit , kept ", ""], None) == OutcomeSettings(exit=True, kept=True)
    assert outcomes.with_flags(none, ["kept,", ",exit"], None) == OutcomeSettings(exit=True, kept=True)
    assert outcomes.with_flags(OutcomeSettings(exit=True, kept=True), [], None) == OutcomeSettings(exit=True, kept=True)
    with pytest.raises(BadRequest, match=r"--reef-outcome takes exit and kept \(the check is --reef-check CMD\), "
                                         r"not check, tests$"):
        outcomes.with_flags(none, ["exit,check", "tests"], None)


def test_a_snapshot_names_each_changed_and_untracked_file_with_its_hash_and_the_commit(tmp_path: Path) -> None:
    """Bugs caught: a file with a one-character name skipped or misread (the status line's path cut at another
    place), the commit not read, a project without commits given a commit, a folder outside git given a snapshot."""
    import hashlib

    assert outcomes.snapshot(tmp_path) is None  # not a git work tree
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    git(fresh, "init", "-q")
    (fresh / "a").write_text("one\n")
    snap = outcomes.snapshot(fresh)
    assert snap == {"root": str(fresh.resolve()), "head": None,
                    "files": {"a": hashlib.sha256(b"one\n").hexdigest()}}, snap
    p = project(tmp_path)
    head = subprocess.run(["git", "-C", str(p), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (p / "app.py").write_text("print('v2')\n")
    (p / "b").write_text("new\n")
    (p / "sub").mkdir()
    (p / "sub" / "c.txt").write_text("deep\n")
    snap = outcomes.snapshot(p / "sub")  # from a folder inside the project: the project's root
    assert snap is not None and snap["root"] == str(p.resolve()) and snap["head"] == head
    assert snap["files"] == {"app.py": hashlib.sha256(b"print('v2')\n").hexdigest(),
                             "b": hashlib.sha256(b"new\n").hexdigest(),
                             "sub/c.txt": hashlib.sha256(b"deep\n").hexdigest()}, snap
    (p / "app.py").unlink()
    assert outcomes.snapshot(p)["files"]["app.py"] is None  # deleted: changed, nothing there


def test_the_changes_of_a_run_include_what_it_committed_and_only_what_differs(tmp_path: Path) -> None:
    """Between two snapshots: files whose content differs, those the agent committed (read from the commits) among
    them; a file changed and put back within the run is no change; another project, or no snapshot, is no answer.
    Bugs caught: the commits' files not read (or read when the head did not move), a file's hash before taken
    from the wrong commit, unchanged files listed, another project's snapshot compared."""
    p = project(tmp_path)
    (p / "notes.md").write_text("draft\n")
    before = outcomes.snapshot(p)
    assert outcomes.changes(before, before) == {}
    (p / "app.py").write_text("print('v2')\n")
    git(p, "add", "app.py")
    git(p, "commit", "-qm", "v2")  # the agent commits its change to app.py: no longer in the status
    (p / "notes.md").write_text("draft\n")  # written again, the same
    (p / "new.py").write_text("x = 1\n")
    after = outcomes.snapshot(p)
    assert after is not None and "app.py" not in after["files"]
    changed = outcomes.changes(before, after)
    import hashlib

    h = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert changed == {"app.py": [h(b"print('v1')\n"), h(b"print('v2')\n")], "new.py": [None, h(b"x = 1\n")]}, changed
    assert outcomes.changes(None, after) is None and outcomes.changes(before, None) is None
    other = outcomes.snapshot(project(tmp_path / "other"))
    assert outcomes.changes(other, after) is None and outcomes.changes(after, other) is None
    # a run that moves the commit back (a reset) changes the same files the other way: whichever commit id sorts first
    assert outcomes.changes(after, before) == {f: [now, was] for f, (was, now) in changed.items()}
    # kept: app.py as the run left it; reverted: new.py gone again
    (p / "new.py").unlink()
    assert outcomes.kept_share(changed, p) == (1, 1)
    (p / "app.py").write_text("print('v1')\n")
    assert outcomes.kept_share(changed, p) == (0, 2)


def test_a_check_that_cannot_start_is_not_measured_and_its_output_is_both_streams(tmp_path: Path) -> None:
    """Bugs caught: a check in a folder that is gone raised instead of written down, stderr dropped or put first,
    more or less than the documented 4,000 characters of output kept."""
    got = outcomes.run_check("true", tmp_path / "gone", timeout_s=5)
    assert got["status"] == "error" and got["reason"].startswith("the check could not start: "), got
    both = outcomes.run_check("echo out; echo err >&2; exit 3", tmp_path, timeout_s=30)
    assert both == {"status": "failed", "exit_code": 3, "output": "out\nerr\n"}, both
    slow = outcomes.run_check("sleep 5", tmp_path, timeout_s=0.5)
    assert slow == {"status": "error", "reason": "the check timed out after 0.5 s"}, slow
    long = outcomes.run_check("head -c 5000 /dev/zero | tr '\\0' y", tmp_path, timeout_s=30)
    assert long["output"] == "y" * 4000  # the last 4,000 characters, as docs/your-data.md says


def test_an_interrupted_check_takes_the_processes_it_started_with_it(tmp_path: Path, monkeypatch: Any) -> None:
    """Ctrl-C reaches the wrapper while its check runs (the check's own session does not get it): the check's
    process group is killed before the interrupt goes on. Bug caught: only the time limit kills the group (the
    runner the check started goes on writing in the project after the wrapper is gone)."""
    import os
    import signal
    import time

    import pytest

    real = subprocess.Popen.communicate
    pid_file = tmp_path / "runner.pid"

    def communicate(self: subprocess.Popen[bytes], input: bytes | None = None,  # noqa: A002
                    timeout: float | None = None) -> tuple[bytes, bytes]:
        if timeout == 60:  # the check's own wait: interrupted once its runner is up
            while not (pid_file.exists() and pid_file.read_text().strip()):
                time.sleep(0.01)
            raise KeyboardInterrupt
        return real(self, input, timeout)

    monkeypatch.setattr(subprocess.Popen, "communicate", communicate)
    with pytest.raises(KeyboardInterrupt):
        outcomes.run_check("sh -c 'echo $$ > runner.pid; while :; do sleep 0.05; done' & wait", tmp_path, 60)
    pid = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid), "the check's runner outlived the interrupted wrapper"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_exit_code_scores_the_run_with_the_scenarios_scores(tmp_path: Path) -> None:
    """Bugs caught: exit 0 scored as a failure (or any exit, or a kill by a signal, as a pass), the scores swapped, the exit report made
    when not asked, the check's report without its command, exit code or output, a check that cannot run without
    its command in the failure."""
    from daemon.config import OutcomeSettings

    s = OutcomeSettings(exit=True, pass_score=0.75, fail_score=0.25)
    assert outcomes.score(s, True) == 0.75 and outcomes.score(s, False) == 0.25
    for code, want in ((0, 0.75), (1, 0.25), (2, 0.25), (-9, 0.25)):  # -9: the agent killed by a signal
        reports, failed = outcomes.reports_for_run(s, code, tmp_path)
        assert failed == [] and reports == [{"score": want, "metadata": {"source": "outcome", "outcome": "exit",
                                                                         "exit_code": code}}], reports
    assert outcomes.reports_for_run(OutcomeSettings(), 1, tmp_path) == ([], [])
    both, _ = outcomes.reports_for_run(OutcomeSettings(exit=True, check="echo ok"), 1, tmp_path)
    assert both == [{"score": 0.0, "metadata": {"source": "outcome", "outcome": "exit", "exit_code": 1}},
                    {"score": 1.0, "metadata": {"source": "outcome", "outcome": "check", "command": "echo ok",
                                                "exit_code": 0, "output": "ok\n"}}], both
    _, failed = outcomes.reports_for_run(OutcomeSettings(check="exit 127"), 0, tmp_path)
    assert failed == [{"outcome": "check", "command": "exit 127", "reason": "the check could not run (exit 127): "}]


def test_a_snapshot_of_hundreds_of_new_files_lists_them_all(tmp_path: Path) -> None:
    """Bug caught: the status entries walked with ``is not`` for ``<`` (the same past 256 entries only by value:
    the walk runs off the end)."""
    p = project(tmp_path)
    for i in range(300):
        (p / f"f{i:03}.txt").write_text(f"{i}\n")
    snap = outcomes.snapshot(p)
    assert snap is not None and len(snap["files"]) == 300


def test_a_file_that_cannot_be_read_is_hashed_as_absent(tmp_path: Path, monkeypatch: Any) -> None:
    """Bug caught: an unreadable file in the project (a permission, a file removed while it is read) raises out of
    the snapshot instead of counting as not there."""
    p = project(tmp_path)
    (p / "app.py").write_text("print('v2')\n")

    def unreadable(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    snap = outcomes.snapshot(p)
    assert snap is not None and snap["files"] == {"app.py": None}


def test_a_check_killed_by_a_signal_is_a_failure(tmp_path: Path) -> None:
    """The shell ends by a signal (a negative exit status): the project's check did not pass. Bug caught: ``<= 0``
    for ``== 0`` (a crash scored as a pass)."""
    got = outcomes.run_check("kill -9 $$", tmp_path, timeout_s=30)
    assert got["status"] == "failed" and got["exit_code"] == -9, got


def test_a_timed_out_check_whose_child_left_its_session_still_returns(tmp_path: Path, monkeypatch: Any) -> None:
    """A process the check moved to a session of its own escapes the kill and holds the output pipes: the wrapper
    stops reading (the pipes closed), reaps the shell and says the check timed out. (The wait for the pipes is
    made 0.2 s here, not 5.) Bugs caught: the wait's timeout not caught, the pipes left open."""
    import os
    import signal

    real = subprocess.Popen.communicate
    seen: list[subprocess.Popen[bytes]] = []

    def communicate(self: subprocess.Popen[bytes], input: bytes | None = None,  # noqa: A002
                    timeout: float | None = None) -> tuple[bytes, bytes]:
        seen.append(self)
        return real(self, input, 0.2 if timeout == 5 else timeout)

    monkeypatch.setattr(subprocess.Popen, "communicate", communicate)
    try:
        got = outcomes.run_check("setsid sh -c 'echo $$ > away.pid; exec sleep 60' & sleep 60", tmp_path, 1)
        assert got == {"status": "error", "reason": "the check timed out after 1 s"}, got
        proc = seen[0]
        assert proc.stdout is not None and proc.stdout.closed and proc.stderr is not None and proc.stderr.closed
        assert proc.returncode is not None  # the shell reaped
    finally:
        os.kill(int((tmp_path / "away.pid").read_text()), signal.SIGKILL)


def two_files(p: Path) -> Path:
    """A fresh git project with two untracked files, a.py and b.py."""
    p.mkdir()
    git(p, "init", "-q")
    (p / "a.py").write_text("a = 1\n")
    (p / "b.py").write_text("b = 1\n")
    return p


def test_a_run_that_makes_the_projects_first_commit_compares_its_files_by_content(tmp_path: Path) -> None:
    """Before the run the project has no commit (its files untracked); the agent commits them, one changed: only
    that one changed, and a file it created and committed is listed as new. Bugs caught: the commits diffed when
    there was none before (git is asked to diff from no commit), the first commit's files not read at all (a new
    file the agent made and committed never counted)."""
    import hashlib

    p = two_files(tmp_path / "first")
    before = outcomes.snapshot(p)
    assert before is not None and before["head"] is None
    (p / "b.py").write_text("b = 2\n")
    (p / "c.py").write_text("c = 1\n")
    git(p, "add", ".")
    git(p, "commit", "-qm", "first")
    after = outcomes.snapshot(p)
    assert after is not None and after["head"] is not None and after["files"] == {}
    h = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert outcomes.changes(before, after) == {"b.py": [h(b"b = 1\n"), h(b"b = 2\n")], "c.py": [None, h(b"c = 1\n")]}


def test_a_run_that_leaves_the_project_without_a_commit_compares_its_files_with_the_one_before(tmp_path: Path) -> None:
    """The agent leaves the project on no commit (``git checkout --orphan``: HEAD unborn, the files staged): nothing
    is diffed against no commit, each file is compared with the commit before the run, and the one it changed is
    listed. Bug caught: the commits diffed whenever the heads differ, also when there is none after (git asked to
    diff a commit with nothing: the wrapper crashed)."""
    import hashlib

    p = two_files(tmp_path / "orphaned")
    git(p, "add", ".")
    git(p, "commit", "-qm", "first")
    before = outcomes.snapshot(p)
    assert before is not None and before["head"] is not None and before["files"] == {}
    git(p, "checkout", "-q", "--orphan", "fresh")
    (p / "b.py").write_text("b = 2\n")
    after = outcomes.snapshot(p)
    assert after is not None and after["head"] is None
    h = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert outcomes.changes(before, after) == {"b.py": [h(b"b = 1\n"), h(b"b = 2\n")]}
