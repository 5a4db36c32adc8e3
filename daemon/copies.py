"""The copies of exchanges that live under ``$REEF_HOME`` outside the record store, and their removal when the
exchanges are forgotten or retention lets them go (``daemon/forgetting.py`` calls ``remove_runs`` and
``remove_pages``):

- A wrapped run's file, ``runs/<run>.json``: the agent's argv and prompt, the run's receipts and reports.
- What the agent wrote in its isolated home during the run (``homes/<adapter>/<scenario>/``): its session
  transcripts (pi's ``.pi/agent/sessions/*/*.jsonl``, Claude Code's ``.claude/projects/*/<session>.jsonl``, Codex's
  ``.codex/sessions/**/rollout-*.jsonl``), its own databases and logs (opencode's ``.local/share/opencode/
  opencode.db`` and its WAL, Codex's ``.codex/*.sqlite``), backups and snapshots. When the agent exits, the wrapper
  lists them in the run file (``agent_files``: ``changed_files``, every file under the home changed since the agent
  started, less the harness Reef installed there); for a run whose wrapper never got that far (killed), the files
  changed from its start until the next run of the same home began.
- Release pages written under ``pages/`` (``reef releases open``, the TUI's ``o``): they quote feedback and
  harness diffs. A page is written anew each time it is opened, so any forget removes them all.

Design choices:
- The agents' own formats are not parsed: a file an agent shares between runs (opencode's database, Codex's state
  databases, a session a later run continued) goes whole when any run that changed it is forgotten. More goes than
  the one run, never less; the agent makes a new one at its next run.
- Removing never follows a symlink: each directory below the agent home is opened with ``O_NOFOLLOW`` from the one
  above it, and a path in a run file that is absolute, holds ``..``, or names an unknown agent or an invalid
  scenario is skipped. A run file is the wrapper's, but anything running as the user can write one.
- Directories left empty by a removal go too, up to the agent home (pi names a session's directory after the
  project's path).
- A database goes whole: with its WAL, shared memory and journal, whichever of them the run's list named
  (``_whole_databases``): SQLite may write the WAL after the agent's files were listed.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.config import Config

HARNESS_MARKER = ".reef-harness.json"  # adapters/base.py: the installed release and the files it wrote
# a file changed this long before the agent started still counts as its run's: file times come from a coarse clock
# (a few ms behind), and a file of Reef's own counted in is only written again at the next run
MARGIN_S = 1.0
PAGES = "pages"  # under $REEF_HOME
SQLITE_SUFFIXES = (".sqlite", ".sqlite3", ".db")  # agents' databases (Codex's state_5.sqlite, opencode's opencode.db)
SQLITE_SIDECARS = ("-wal", "-shm", "-journal")  # what SQLite keeps beside a database


def changed_files(home: Path, since: float, *, until: float | None = None) -> list[str]:
    """The regular files under ``home`` changed at or after ``since`` (and before ``until``), as paths relative to
    it, less the harness files Reef installed there: what an agent wrote during its run. Symlinks are not
    followed or listed."""
    keep = _harness_files(home)
    out = []
    for dirpath, _dirs, names in os.walk(home):  # followlinks=False: a symlinked directory is not entered
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone meanwhile
            if not stat.S_ISREG(st.st_mode) or st.st_mtime < since or (until is not None and st.st_mtime >= until):
                continue
            rel = os.path.relpath(path, home)
            if rel not in keep:
                out.append(rel)
    return sorted(out)


def _harness_files(home: Path) -> set[str]:
    try:
        fd = os.open(home / HARNESS_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {HARNESS_MARKER}
    try:
        with os.fdopen(fd, "rb") as f:
            files = json.loads(f.read()).get("files", [])
    except (OSError, ValueError, AttributeError):
        files = []
    return {HARNESS_MARKER, *(f for f in files if isinstance(f, str))}


def remove_runs(config: Config, runs: Iterable[str]) -> dict[str, int]:
    """Remove the run files of ``runs`` and the files their agents wrote; returns how many of each went. A run
    with no file here (run on another machine, removed already) is skipped."""
    gone = {"runs": 0, "agent_files": 0}
    for run in dict.fromkeys(runs):
        if not _valid_run(run):
            continue
        path = config.runs_dir / f"{run}.json"
        record = _read_run(path)
        if record is None:
            continue
        home = _agent_home(config, record)
        if home is not None:
            files = record.get("agent_files")
            if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
                files = _files_of_unfinished_run(config, record, home)
            gone["agent_files"] += sum(_unlink_below(home, rel) for rel in _whole_databases(files))
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove: said by the count
            path.unlink()
            gone["runs"] += 1
    return gone


def runs_started_before(config: Config, before: float, *, limit: int) -> list[str]:
    """Runs whose file says they started before ``before`` (by the file's time where it says nothing): what an
    age bound lets go, with their exchanges or without (a run whose agent made no request)."""
    out = []
    try:
        entries = list(os.scandir(config.runs_dir))
    except OSError:
        return []
    for entry in entries:
        run = entry.name.removesuffix(".json")
        if run == entry.name or not _valid_run(run) or not entry.is_file(follow_symlinks=False):
            continue
        record = _read_run(Path(entry.path))
        started = record.get("started_at") if record is not None else None
        if not isinstance(started, (int, float)) or isinstance(started, bool):
            try:
                started = entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
        if started < before:
            out.append(run)
            if len(out) >= limit:
                break
    return out


def remove_pages(config: Config) -> int:
    """Remove every release page written under ``$REEF_HOME/pages``; returns how many went."""
    n = 0
    try:
        entries = list(os.scandir(config.home / PAGES))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.endswith(".html") and not entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                n += 1
    return n


# --- the parts -----------------------------------------------------------------------------------------------


def _valid_run(run: object) -> bool:
    """A run name (``daemon/names.py``: no ``/``, never ``.`` or ``..``), so ``runs/<run>.json`` is a file there."""
    from daemon.errors import InvalidName
    from daemon.names import check_run

    try:
        check_run(run)
    except InvalidName:
        return False
    return True


def _read_run(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return {}  # unreadable: the file still goes, with nothing known of the agent's
    return record if isinstance(record, dict) else {}


def _agent_home(config: Config, record: dict[str, Any]) -> Path | None:
    from adapters import ADAPTERS
    from daemon.errors import InvalidName
    from daemon.names import check_scenario

    adapter, scenario = record.get("adapter"), record.get("scenario")
    if not isinstance(adapter, str) or adapter not in ADAPTERS:
        return None
    try:
        check_scenario(scenario)
    except InvalidName:
        return None
    return ADAPTERS[adapter].home(config.homes_dir, str(scenario))


def _files_of_unfinished_run(config: Config, record: dict[str, Any], home: Path) -> list[str]:
    """A run whose wrapper did not list what its agent wrote (killed first): the files of its home changed from
    its start until the next run of the same home started."""
    start = record.get("spawned_at") or record.get("started_at")
    if not isinstance(start, (int, float)) or isinstance(start, bool):
        return []
    until = None
    try:
        entries = list(os.scandir(config.runs_dir))
    except OSError:
        entries = []
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue
        other = _read_run(Path(entry.path)) or {}
        t = other.get("spawned_at")
        if (other.get("adapter"), other.get("scenario")) == (record.get("adapter"), record.get("scenario")) \
                and isinstance(t, (int, float)) and t > start and (until is None or t < until) \
                and other.get("run") != record.get("run"):
            until = t - MARGIN_S
    return changed_files(home, start - MARGIN_S, until=until)


def _whole_databases(files: Iterable[str]) -> list[str]:
    """``files`` with each SQLite database among them whole: a database named goes with its sidecars (its WAL, shared
    memory and rollback journal) and a sidecar named goes with its database and the other sidecars. A WAL holds
    the newest pages until a checkpoint: Codex's ``state_5.sqlite-wal`` was written after the agent's files were
    listed and kept the forgotten prompt (a failed run of tests/test_forget_agents.py)."""
    out: dict[str, None] = {}
    for rel in files:
        out[rel] = None
        base = next((rel[: -len(s)] for s in SQLITE_SIDECARS if rel.endswith(s)), rel)
        if base.endswith(SQLITE_SUFFIXES):
            for name in (base, *(base + s for s in SQLITE_SIDECARS)):
                out[name] = None
    return list(out)


def _unlink_below(root: Path, rel: str) -> int:
    """Remove the file ``root/rel`` without following a symlink on the way, then the directories it leaves empty
    (up to ``root``); 1 if a file went, else 0."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        return 0
    try:
        fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    except OSError:
        return 0
    try:
        for part in parts[:-1]:
            try:
                fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   dir_fd=fds[-1]))
            except OSError:
                return 0  # gone, or a symlink or a file where a directory should be
        try:
            os.unlink(parts[-1], dir_fd=fds[-1])  # a symlink itself goes, never its target
        except OSError:
            return 0  # gone meanwhile, or a directory
        for i in range(len(parts) - 2, -1, -1):  # the directories it leaves empty, deepest first
            try:
                os.rmdir(parts[i], dir_fd=fds[i])
            except OSError:
                break  # not empty
        return 1
    finally:
        for fd in fds:
            os.close(fd)
