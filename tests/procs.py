"""Waiting on processes by events, not by sleeps: has a process installed its handler for a signal yet?"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (the SigCgt mask in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def wait_until_catching(proc: subprocess.Popen[Any], *sigs: int, guard_s: float = 60) -> None:
    """Block until ``proc`` has installed its handlers for all ``sigs`` or has exited (``guard_s``: a hang guard)."""
    deadline = time.monotonic() + guard_s
    while proc.poll() is None and not all(catches(proc.pid, sig) for sig in sigs):
        assert time.monotonic() < deadline, "the process never installed its signal handler"
        time.sleep(0.01)


def wait_until_forwarding(proc: subprocess.Popen[Any]) -> None:
    """Block until a wrapper (``reef_cli.wrapper.spawn``) forwards every signal it forwards to its agent."""
    from reef_cli.wrapper import FORWARDED, TTY_SIGNALS

    wait_until_catching(proc, *FORWARDED, *TTY_SIGNALS)


def wait_standin(url: str, guard_s: float = 30) -> None:
    """Wait until a stand-in server (tests/harness_standins.py) answers ``/_stats`` (``guard_s``: a hang guard)."""
    import httpx

    deadline = time.monotonic() + guard_s
    while True:
        try:
            if httpx.get(f"{url}/_stats", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the stand-in at {url} did not start"
        time.sleep(0.1)
