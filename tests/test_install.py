"""``install.sh``: installs into an isolated venv, links ``reef``, is idempotent, and refuses clearly when
Python is too old or git is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "install.sh"


def run(args: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True, text=True, timeout=timeout)


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REEF_", "VIRTUAL_ENV", "PYTHON"))}
    env["REEF_HOME"] = str(tmp_path / "reef-home")
    # pip skips compiling every installed module to bytecode (torch's and transformers' thousands: about 40% of the
    # install's CPU time, none of it install.sh's doing); the modules the tests import are compiled as they are
    # imported. pip reads this variable inverted: 0 is --no-compile.
    env["PIP_NO_COMPILE"] = "0"
    return env


def test_too_old_python_is_refused(tmp_path: Path) -> None:
    shim = tmp_path / "python3.10"
    shim.write_text('#!/bin/sh\ncase "$*" in *platform*) echo 3.10.12;; esac\nexit 1\n')
    shim.chmod(0o755)
    out = run(["--python", str(shim), "--venv", str(tmp_path / "v")], base_env(tmp_path))
    assert out.returncode != 0
    assert "Python 3.11 or newer is required" in out.stderr and "3.10.12" in out.stderr
    assert not (tmp_path / "v").exists()


def test_missing_git_is_refused(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for d in os.environ["PATH"].split(":"):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            target = bindir / name
            if name.startswith("git") or target.exists():
                continue
            target.symlink_to(Path(d) / name)
    env = dict(base_env(tmp_path), PATH=str(bindir))
    out = run(["--venv", str(tmp_path / "v")], env)
    assert out.returncode != 0 and "git is required" in out.stderr


def test_unknown_option_is_refused(tmp_path: Path) -> None:
    out = run(["--frobnicate"], base_env(tmp_path))
    assert out.returncode != 0 and "unknown option: --frobnicate" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: two real installs (pip, the default model) take 2-5 min on 2 busy cores
def test_install_is_isolated_linked_and_idempotent(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    venv, bindir = tmp_path / "venv", tmp_path / "bin"
    first = run(["--venv", str(venv), "--bin-dir", str(bindir)], env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "creating a virtual environment" in first.stdout
    reef = bindir / "reef"
    assert reef.is_symlink() and reef.resolve() == (venv / "bin" / "reef").resolve()
    version = subprocess.run([str(reef), "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("reef ")
    pinned = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                            capture_output=True, text=True, timeout=120)
    assert pinned.stdout.startswith("2.13.0")
    # the installed copy runs from the venv, not from this checkout
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import daemon; print(daemon.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert str(venv) in where.stdout
    # what the daemon runs on comes with a plain install (the dev extra's packages are for tests and benches)
    serving = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import daemon.server, daemon.app, daemon.engines.upstream, reef_cli.main"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert serving.returncode == 0, serving.stderr[-2000:]
    # the default model comes with a plain install, made once with a progress line
    model = tmp_path / "reef-home" / "models" / "smollm2"
    assert "making the default model, SmolLM2-135M-Instruct" in first.stdout, first.stdout
    assert (model / "config.json").is_file() and list(model.glob("*.safetensors"))
    made = (model / "config.json").stat().st_mtime_ns
    second = run(["--venv", str(venv), "--bin-dir", str(bindir)], env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "using the virtual environment" in second.stdout
    assert (model / "config.json").stat().st_mtime_ns == made  # made once, not again
    assert reef.resolve() == (venv / "bin" / "reef").resolve()
    assert subprocess.run([str(reef), "--version"], capture_output=True, env=env, timeout=60).returncode == 0
    shutil.rmtree(venv)
