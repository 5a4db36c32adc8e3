"""Tasks and episodes: the real wrapped agent, headless, through Reef, in a fresh workspace copy in a sandbox.

A task (in the scenario's ``tasks`` setting)::

    {"id": "greet", "prompt": "Write the greeting into answer.txt", "workspace": "/path/to/template",
     "check": "test \\"$(cat answer.txt)\\" = hello", "time_limit_s": 120, "check_timeout_s": 60}

``workspace``: a directory copied fresh for every episode (absolute, or relative to the daemon's home; none: an
empty directory). ``check``: a shell command run in the workspace after the agent, in the same kind of sandbox
but without even the daemon: exit status 0 scores 1, anything else 0; its output's tail is kept with the result.

An episode: copy the workspace, write the spec (the tree rendered for the adapter, the prompt, the episode's scoped
token), start ``inside.py`` in the sandbox (``sandbox.py``), which runs the real wrapper (``reef-pi -p ...``)
against the daemon's episodes scenario through the daemon's scoped socket, so the agent's requests are recorded as
that run (and the token allows nothing else: ``daemon/scopes.py``); at ``time_limit_s`` the whole
sandbox is killed and the episode scores 0 (``timeout``). Then the check. The copy is removed afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from daemon.errors import BadRequest
from daemon.layout import SKILL_NAME
from recipes.harness_search import sandbox

ROOT = Path(__file__).resolve().parents[2]  # the directory holding daemon/, recipes/, adapters/, reef_cli/
_TASK_KEYS = {"id", "prompt", "workspace", "check", "time_limit_s", "check_timeout_s"}


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    check: str
    workspace: str | None = None
    time_limit_s: float = 120.0
    check_timeout_s: float = 60.0


def parse_tasks(raw: Any) -> list[Task]:
    """Tasks from the ``tasks`` setting; a ``BadRequest`` naming the task and the field when one is wrong."""
    if not isinstance(raw, list):
        raise BadRequest("tasks must be a list of {id, prompt, check, workspace?, time_limit_s?}", param="tasks")
    out, seen = [], set()
    for i, t in enumerate(raw):
        where = f"tasks[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        extra = sorted(set(t) - _TASK_KEYS)
        if extra:
            raise BadRequest(f"{where}: unknown keys {', '.join(extra)} (known: {', '.join(sorted(_TASK_KEYS))})",
                             param=where)
        for key in ("id", "prompt", "check"):
            if not isinstance(t.get(key), str) or not t[key].strip():
                raise BadRequest(f"{where}.{key} is required (text)", param=f"{where}.{key}")
        if not SKILL_NAME.fullmatch(t["id"]) or t["id"] in seen:
            raise BadRequest(f"{where}.id {t['id']!r} must be a-z, 0-9 and -, and unique", param=f"{where}.id")
        seen.add(t["id"])
        if t.get("workspace") is not None and not isinstance(t["workspace"], str):
            raise BadRequest(f"{where}.workspace must be a directory path", param=f"{where}.workspace")
        for key in ("time_limit_s", "check_timeout_s"):
            v = t.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise BadRequest(f"{where}.{key} must be a positive number", param=f"{where}.{key}")
        fields: dict[str, Any] = {k: (float(v) if k.endswith("_s") else v) for k, v in t.items()}
        out.append(Task(**fields))
    return out


@dataclass(frozen=True)
class EpisodeEnv:
    """Where episodes run: the daemon (its scoped socket, port, a scoped token), its episodes scenario, the agent."""

    socket: Path  # the daemon's scoped socket (``Config.scoped_socket_path``), never its main one
    port: int
    scenario: str
    agents_dir: Path
    home: Path  # the daemon's home: its workspace templates resolve here; hidden from the sandbox
    adapter: str = "pi"
    work_root: Path | None = None  # where workspace copies go (default: the system temp dir)
    hide: tuple[str, ...] = ()  # host paths hidden even under a path the sandbox binds (``sandbox.allowed()``)
    token: str | None = None  # a token scoped to ``scenario`` (``daemon/scopes.py``); the only one the sandbox gets


@dataclass
class Episode:
    task: str
    side: str  # serving | candidate
    repeat: int
    score: float
    status: str  # passed | failed | timeout | error
    run: str | None = None
    seconds: float = 0.0  # the agent's part
    check_seconds: float = 0.0
    output: str = ""  # the tail of the agent's output (or why it failed)
    check_output: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "LANG": "C.UTF-8",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": "/tmp/home"}


async def _run(cmd: list[str], timeout: float) -> tuple[int | None, bytes]:
    """Run ``cmd`` in its own process group; at ``timeout`` kill the group. (exit status or None, output)."""
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        return proc.returncode, out
    except TimeoutError:
        await _kill(proc)
        return None, b""
    except asyncio.CancelledError:
        await _kill(proc)
        raise


async def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bubblewrap and, with its PID namespace, everything it started
    except ProcessLookupError:
        pass
    await proc.wait()


async def run_episode(task: Task, files: dict[str, str], env: EpisodeEnv, *, side: str, repeat: int,
                      release_id: str | None = None) -> Episode:
    """One episode of ``task`` with the harness ``files`` (rendered for ``env.adapter``); ``release_id``: the
    release of the episodes scenario holding that tree, which the agent pins (its records name it)."""
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="reef-episode-", dir=env.work_root))
    try:
        ws = root / "workspace"
        if task.workspace:
            template = Path(task.workspace)
            template = template if template.is_absolute() else env.home / template
            shutil.copytree(template, ws, symlinks=True)
        else:
            ws.mkdir()
        spec = root / "spec.json"
        spec.write_text(json.dumps({"adapter": env.adapter, "scenario": env.scenario, "port": env.port,
                                    "agents_dir": str(env.agents_dir), "files": files, "prompt": task.prompt,
                                    "release_id": release_id, "workspace": str(ws), "token": env.token}))
        spec.chmod(0o600)  # the token: never on a command line (any local user reads those)
        hide = (str(env.home), *env.hide)
        cmd = sandbox.argv([sys.executable, "-m", "recipes.harness_search.inside", "/tmp/reef-episode.json"],
                           workspace=ws, env=_env(), socket=env.socket, hide=hide,
                           ro_binds={str(env.agents_dir): str(env.agents_dir), str(spec): "/tmp/reef-episode.json"})
        t1, spawned_at = time.perf_counter(), time.time()
        code, out = await _run(cmd, task.time_limit_s)
        agent_s = time.perf_counter() - t1
        timings = {"setup_s": round(t1 - t0, 3), "agent_s": round(agent_s, 3), "spawned_at": spawned_at}
        if code is None:
            return Episode(task.id, side, repeat, 0.0, "timeout", seconds=round(agent_s, 3), timings=timings,
                           output=f"killed at the time limit ({task.time_limit_s} s)")
        text = out.decode("utf-8", "replace")
        try:
            result = json.loads(text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return Episode(task.id, side, repeat, 0.0, "error", seconds=round(agent_s, 3), timings=timings,
                           output=f"the sandbox exited {code}: {text[-1500:]}")
        t2 = time.perf_counter()
        check_code, check_out = await _run(sandbox.argv(["/bin/sh", "-c", task.check], workspace=ws, env=_env(),
                                                        hide=hide), task.check_timeout_s)
        check_s = time.perf_counter() - t2
        timings["check_s"] = round(check_s, 3)
        passed = check_code == 0
        return Episode(task.id, side, repeat, 1.0 if passed else 0.0, "passed" if passed else "failed",
                       run=result.get("run"), seconds=round(agent_s, 3), check_seconds=round(check_s, 3),
                       output=str(result.get("output", ""))[-1000:], timings=timings,
                       check_output=("check timed out" if check_code is None else
                                     check_out.decode("utf-8", "replace")[-1000:]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
