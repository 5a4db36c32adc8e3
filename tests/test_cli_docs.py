"""The CLI as documentation: every command has help text and appears in the README; ``reef --help`` stays
fast (no heavy imports on that path); the code passes ruff."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer.main

from reef_cli.main import app

ROOT = Path(__file__).resolve().parent.parent


def walk(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        yield from walk(sub, (*path, name))


def commands() -> list[tuple[tuple[str, ...], Any]]:
    found = [(p, c) for p, c in walk(typer.main.get_command(app)) if p]
    assert len(found) > 20, found  # the walk must see the whole tree
    return found


def test_every_command_has_help_and_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing_help, missing_doc = [], []
    for path, cmd in commands():
        if not (cmd.help or "").strip():
            missing_help.append(" ".join(path))
        if f"reef {' '.join(path)}" not in readme:
            missing_doc.append(" ".join(path))
        for param in cmd.params:
            is_option = getattr(param, "param_type_name", "") == "option"
            if is_option and not (getattr(param, "help", "") or "").strip() and param.name != "help":
                missing_help.append(f"{' '.join(path)} {param.opts[0]}")
    assert not missing_help, f"commands/options without help: {missing_help}"
    assert not missing_doc, f"commands not in README.md: {missing_doc}"


def test_help_does_not_import_heavy_modules() -> None:
    code = (
        "import sys, runpy; sys.argv = ['reef', '--help']\n"
        "try:\n    runpy.run_module('reef_cli.main', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'pygit2', 'textual', 'aiohttp', 'daemon.app')"
        " if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]


def test_unknown_command_is_a_clear_error() -> None:
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "frobnicate"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "frobnicate" in out.stderr and "Traceback" not in out.stderr


def test_ruff_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
