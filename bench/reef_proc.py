"""A real daemon for a benchmark, started one way: ``python -m daemon --log-file`` (or under cProfile) in its own
process, under a ``REEF_HOME`` whose ``config.toml`` the benchmark wrote, offline, with none of the caller's
``REEF_*`` settings; returned once ``/healthz`` answers. Or a home for a benchmark that drives the ``reef`` command
(``cli_home``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_command(profile: str | None = None) -> list[str]:
    """``python -m daemon --log-file``, or under cProfile writing its stats to ``profile``. Not ``-m cProfile``: the
    daemon leaves with os._exit after its atexit handlers (``daemon/__main__.exit_now``), so one of those writes."""
    if not profile:
        return [sys.executable, "-m", "daemon", "--log-file"]
    script = ("import atexit, cProfile, runpy, sys; p = cProfile.Profile(); "
              f"atexit.register(lambda: (p.disable(), p.dump_stats({str(Path(profile).resolve())!r}))); "
              "sys.argv = ['daemon', '--log-file']; p.enable(); runpy.run_module('daemon', run_name='__main__')")
    return [sys.executable, "-c", script]


def healthy(port: int) -> bool:
    """Whether the daemon on ``port`` answers ``/healthz`` with 200."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def start(home: Path, port: int, *, timeout_s: float = 300, profile: str | None = None) -> subprocess.Popen[bytes]:
    """The daemon of ``home`` (listening on ``port``, as its config says), once healthy; ``SystemExit`` when it exits
    or does not answer within ``timeout_s``. Its log is ``home/logs/daemon.log``."""
    (home / "logs").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    env.update(REEF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(daemon_command(profile), env=env)
    deadline = time.monotonic() + timeout_s
    while not healthy(port):
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited ({proc.returncode}); see {home}/logs/daemon.log")
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"the daemon did not answer in {timeout_s:.0f} s; see {home}/logs/daemon.log")
        time.sleep(0.05)
    return proc


def cli_home(prefix: str) -> tuple[Path, int, dict[str, str], list[str]]:
    """A throwaway ``REEF_HOME`` whose daemon will listen on a free port, for a benchmark that drives the ``reef``
    command: (home, port, the environment to run it in, the command's argv)."""
    home, port = Path(tempfile.mkdtemp(prefix=prefix)), free_port()
    (home / "config.toml").write_text(f"port = {port}\n")
    return home, port, dict(os.environ, REEF_HOME=str(home), PYTHONPATH=str(ROOT)), [sys.executable, "-m",
                                                                                      "reef_cli.main"]
