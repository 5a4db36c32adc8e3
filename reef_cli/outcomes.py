"""Outcomes as feedback: what happened after a wrapped agent's run, reported on its receipts with
``metadata.source = "outcome"`` (visible and overridable like any report: an explicit report takes precedence).

- ``exit``: the agent's exit code: 0 scores ``pass_score``, anything else ``fail_score``.
- ``check``: a command the user names (the project's tests), run in the project after the agent finishes, within
  ``check_timeout_s``: exit 0 scores ``pass_score``, another exit ``fail_score``; its output's tail is kept in the
  report's metadata. A check that cannot run (not found, not executable, timed out) scores nothing: the run record
  says it failed and why. It runs in a session of its own, killed whole at the limit (``run_check``).
- ``kept``: whether the agent's changes to the project (a git work tree) are still there at the next run in the
  same project: the share of changed files not put back as they were, from ``fail_score`` (all reverted) to
  ``pass_score`` (all kept).

Asked per scenario in ``config.toml`` (``[outcomes.pi] exit = true, check = "pytest -q"``) or per run with the
wrapper's flags (``--reef-outcome exit,kept``, ``--reef-check "pytest -q"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from daemon.config import OutcomeSettings
from daemon.errors import BadRequest

OUTPUT_TAIL = 4000  # characters of a check's output kept with its report


def with_flags(base: OutcomeSettings, kinds: list[str], check: str | None) -> OutcomeSettings:
    """The scenario's settings with a run's flags added (``--reef-outcome exit,kept``, ``--reef-check CMD``)."""
    wanted = [k.strip() for item in kinds for k in item.split(",") if k.strip()]
    bad = [k for k in wanted if k not in ("exit", "kept")]
    if bad:
        raise BadRequest(f"--reef-outcome takes exit and kept (the check is --reef-check CMD), not {', '.join(bad)}")
    return dataclasses.replace(base, exit=base.exit or "exit" in wanted, kept=base.kept or "kept" in wanted,
                               check=check if check is not None else base.check)


# --- the project's state (git) ------------------------------------------------------------------------------


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def _hash(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def snapshot(cwd: Path) -> dict[str, Any] | None:
    """The project's commit and the hashes of its changed and untracked files; None outside a git work tree."""
    head = _git(cwd, "rev-parse", "--verify", "-q", "HEAD")
    top = _git(cwd, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        return None
    root = Path(top.stdout.decode().strip())
    status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all")
    files: dict[str, str | None] = {}
    entries = status.stdout.decode(errors="surrogateescape").split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        path = entry[3:]
        files[path] = _file_hash(root / path)
        if entry[0] in "RC" and i < len(entries):  # a rename or copy names its source next: a path too
            source = entries[i]
            i += 1
            if entry[0] == "R":  # moved away: changed (gone, or something else there now)
                files[source] = _file_hash(root / source)
    return {"root": str(root), "head": head.stdout.decode().strip() or None, "files": files}


def _file_hash(path: Path) -> str | None:
    try:
        return _hash(path.read_bytes()) if path.is_file() else None
    except OSError:
        return None


def _committed_hash(root: Path, commit: str | None, path: str) -> str | None:
    if commit is None:
        return None
    shown = _git(root, "show", f"{commit}:{path}")
    return _hash(shown.stdout) if shown.returncode == 0 else None


def changes(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, list[str | None]] | None:
    """The files the run changed: path -> [hash before, hash after] (None: absent)."""
    if before is None or after is None or before["root"] != after["root"]:
        return None
    root = Path(after["root"])
    paths = set(before["files"]) | set(after["files"])
    if before["head"] != after["head"] and after["head"]:  # the agent committed
        listed = (_git(root, "diff", "--name-only", "-z", before["head"], after["head"]) if before["head"] else
                  _git(root, "ls-tree", "-r", "-z", "--name-only", after["head"]))  # its first commit: every file
        paths |= {p for p in listed.stdout.decode(errors="surrogateescape").split("\0") if p}
    out: dict[str, list[str | None]] = {}
    for p in sorted(paths):
        was = before["files"][p] if p in before["files"] else _committed_hash(root, before["head"], p)
        now = after["files"][p] if p in after["files"] else _committed_hash(root, after["head"], p)
        if was != now:
            out[p] = [was, now]
    return out


def kept_share(changed: dict[str, list[str | None]], root: Path) -> tuple[int, int]:
    """(kept, reverted) among a run's changed files, as they are now: reverted = back to the content before."""
    reverted = sum(1 for p, (was, _now) in changed.items() if _file_hash(root / p) == was)
    return len(changed) - reverted, reverted


# --- reporting ---------------------------------------------------------------------------------------------


def run_check(command: str, cwd: Path, timeout_s: float) -> dict[str, Any]:
    """Run the user's check: ``{"status": "passed"|"failed", "exit_code", "output"}`` or, when it could not run,
    ``{"status": "error", "reason"}``.

    The check runs in its own session (a process group of its own): at the time limit, or when the wrapper itself
    is interrupted, the whole group is killed, not only the shell, so a test runner the check started stops writing
    in the project when the check is said to have timed out. (A process the check moves to yet another session
    escapes, as it would escape any terminal.)"""
    try:
        proc = subprocess.Popen(command, shell=True, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        return {"status": "error", "reason": f"the check could not start: {e}"}
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {"status": "error", "reason": f"the check timed out after {timeout_s:g} s"}
    except BaseException:  # Ctrl-C reaches the wrapper's group only: the check's must be ended here
        _kill_group(proc)
        raise
    output = (stdout + stderr).decode(errors="replace")[-OUTPUT_TAIL:]
    if proc.returncode in (126, 127):  # the shell could not find or run it: no verdict on the project
        return {"status": "error", "reason": f"the check could not run (exit {proc.returncode}): {output.strip()}"}
    return {"status": "passed" if proc.returncode == 0 else "failed", "exit_code": proc.returncode,
            "output": output}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the check's process group (its session: the shell and everything it started) and reap the shell."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=5)  # the pipes close with the group's processes
    except subprocess.TimeoutExpired:  # one that left the group holds them: stop reading, reap the shell
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.kill()
        proc.wait()


def score(settings: OutcomeSettings, passed: bool) -> float:
    return settings.pass_score if passed else settings.fail_score


def reports_for_run(settings: OutcomeSettings, exit_code: int, cwd: Path) -> tuple[list[dict[str, Any]],
                                                                               list[dict[str, Any]]]:
    """The outcome reports of a run that just ended (exit, check) as report metadata+score, and what could not be
    measured (written in the run record with its reason)."""
    out, failed = [], []
    if settings.exit:
        out.append({"score": score(settings, exit_code == 0),
                    "metadata": {"source": "outcome", "outcome": "exit", "exit_code": exit_code}})
    if settings.check is not None:
        got = run_check(settings.check, cwd, settings.check_timeout_s)
        if got["status"] == "error":
            failed.append({"outcome": "check", "command": settings.check, "reason": got["reason"]})
        else:
            out.append({"score": score(settings, got["status"] == "passed"),
                        "metadata": {"source": "outcome", "outcome": "check", "command": settings.check,
                                     "exit_code": got["exit_code"], "output": got["output"]}})
    return out, failed
