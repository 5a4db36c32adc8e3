"""The one-prompt form per agent (issue 44: ``reef-opencode -p`` printed opencode's help, and the wrapper then
invited feedback on a run that never started). ``-p PROMPT`` means one prompt for every wrapper: pi and Claude Code
take it as is, Codex gets ``exec`` (``adapters/codex.py``), opencode ``run`` with the prompt as words.

The real ``reef-opencode`` wrapper against a real daemon; the agent is a small script where the adapter looks for
opencode (as ``tests/test_cli_exits.fake_agent`` does for pi), so the argument vector it receives is what opencode
would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adapters import ADAPTERS, Target
from daemon.errors import BadRequest
from tests.conftest import Daemon
from tests.test_cli_exits import one_line

BIN = Path(sys.executable).parent
TARGET = Target(url="http://127.0.0.1:8900", scenario="s", run="r", model="m")


def test_each_adapter_maps_the_one_prompt_form() -> None:
    """Bugs caught: opencode given ``-p`` (its help, no run), the prompt passed as one quoted argument (opencode
    wraps an argument holding a space in quotes), the rest of the line dropped."""
    b = Path("/bin/agent")
    assert ADAPTERS["opencode"].argv(b, ["-p", "fix the  bug", "-m", "x/y"], TARGET) == \
        ["/bin/agent", "run", "fix", "the", "bug", "-m", "x/y"]
    assert ADAPTERS["opencode"].argv(b, ["run", "say", "hi"], TARGET) == ["/bin/agent", "run", "say", "hi"]
    assert ADAPTERS["pi"].argv(b, ["-p", "say hi"], TARGET) == ["/bin/agent", "-p", "say hi"]
    assert ADAPTERS["claude"].argv(b, ["-p", "say hi"], TARGET) == ["/bin/agent", "-p", "say hi"]
    assert ADAPTERS["codex"].argv(b, ["-p", "say hi"], TARGET)[-3:] == ["exec", "--skip-git-repo-check", "say hi"]
    for bad in (["-p"], ["-p", "  "]):
        with pytest.raises(BadRequest, match="needs a prompt"):
            ADAPTERS["opencode"].argv(b, bad, TARGET)


def test_reef_opencode_p_runs_opencode_run_and_a_bare_p_starts_nothing(daemon: Daemon, tmp_path: Path) -> None:
    agents = tmp_path / "agents"
    binary = ADAPTERS["opencode"].binary_path(agents)
    binary.parent.mkdir(parents=True)
    seen = tmp_path / "seen"
    binary.write_text(f'#!/bin/sh\necho "$#:$*" >> "{seen}"\n')
    binary.chmod(0o755)
    env = {**daemon.env, "REEF_AGENTS_DIR": str(agents), "REEF_SCENARIO": "forms"}

    def wrapped(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "reef-opencode"), *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)

    ok = wrapped("-p", "say hi")
    assert ok.returncode == 0, ok.stderr
    assert seen.read_text().splitlines() == ["3:run say hi"]
    bare = wrapped("-p")
    assert bare.returncode == 2 and "needs a prompt" in one_line(bare.stderr), bare.stderr
    assert "opencode run" in bare.stderr and len(seen.read_text().splitlines()) == 1  # nothing started
