"""The CLI as documentation: every command has help text and appears in ``docs/commands.md``; ``reef --help``
stays fast (no heavy imports on that path); the code passes ruff."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main

from reef_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
COMMANDS_PAGE = ROOT / "docs" / "commands.md"  # the command table and the exit codes (linked from README.md)


def walk(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        yield from walk(sub, (*path, name))


def commands() -> list[tuple[tuple[str, ...], Any]]:
    found = [(p, c) for p, c in walk(typer.main.get_command(app)) if p]
    assert len(found) > 20, found  # the walk must see the whole tree
    return found


def test_every_command_has_help_and_is_in_the_docs() -> None:
    page = COMMANDS_PAGE.read_text()
    missing_help, missing_doc = [], []
    for path, cmd in commands():
        if not (cmd.help or "").strip():
            missing_help.append(" ".join(path))
        if f"reef {' '.join(path)}" not in page:
            missing_doc.append(" ".join(path))
        for param in cmd.params:
            is_option = getattr(param, "param_type_name", "") == "option"
            if is_option and not (getattr(param, "help", "") or "").strip() and param.name != "help":
                missing_help.append(f"{' '.join(path)} {param.opts[0]}")
    assert not missing_help, f"commands/options without help: {missing_help}"
    assert not missing_doc, f"commands not in docs/commands.md: {missing_doc}"


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


# commands that print data, and so take --json; `completions show` prints a shell script, not data
LISTING = ("list", "show", "status", "doctor", "runs")
NOT_DATA = {("completions", "show")}


def test_every_listing_command_has_json() -> None:
    missing = []
    for path, cmd in commands():
        if path[-1] in LISTING and path not in NOT_DATA and not getattr(cmd, "commands", None):
            if not any("--json" in getattr(p, "opts", []) for p in cmd.params):
                missing.append(" ".join(path))
    assert not missing, f"listing commands without --json: {missing}"


def test_every_exit_code_is_documented() -> None:
    import daemon.errors as errors

    page = COMMANDS_PAGE.read_text()
    codes = {cls.exit_code for cls in vars(errors).values() if isinstance(cls, type) and hasattr(cls, "exit_code")}
    missing = [code for code in sorted(codes | {0, 130}) if f"\n| {code} |" not in page]
    assert not missing, f"exit codes not in docs/commands.md's table: {missing}"


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["status"], 7, "is not answering (connection refused"),
        (["releases", "list", "--json"], 7, "the Reef daemon at http"),
        (["records", "list", "--bogus"], 2, "No such option: --bogus"),
        (["report", "rec_x", "--score", "1", "--metadata", "{"], 2, "--metadata is not valid JSON"),
        (["completions", "show", "tcsh"], 2, "tcsh"),
        (["scenarios", "show"], 2, "Missing argument"),
    ],
)
def test_errors_are_one_line_with_an_exit_code(args: list[str], code: int, says: str, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    env.update(REEF_HOME=str(tmp_path), REEF_URL=f"http://127.0.0.1:{port}", REEF_TOKEN="secret-token",
               PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", *args], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == code, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("reef: ") and says in lines[0], out.stderr
    assert "secret-token" not in out.stderr + out.stdout


def test_the_entry_points_help_is_typers_own() -> None:
    """``reef --help`` prints ``reef_cli/help.txt`` without importing typer: it must be what typer prints (after
    a command is added or its help changes: ``python -m reef_cli.fast --write-help``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="80")
    typer_help = subprocess.run([sys.executable, "-m", "reef_cli.main", "--help"], env=env, capture_output=True,
                                text=True, timeout=120).stdout
    for args in (["--help"], []):
        fast = subprocess.run([sys.executable, "-m", "reef_cli.fast", *args], env=env, capture_output=True, text=True,
                              timeout=120)
        full = subprocess.run([sys.executable, "-m", "reef_cli.main", *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert fast.stdout == typer_help, "run: python -m reef_cli.fast --write-help"
        assert fast.returncode == full.returncode and full.stdout.strip() == typer_help.strip(), args


def test_reef_status_is_answered_without_typer_and_says_what_the_full_command_says(daemon: Any) -> None:
    import json

    daemon.wait_loaded()  # both commands see the same models (a load finishing between them would differ)
    probe = ("import sys, runpy; sys.argv = ['reef'] + sys.argv[1:]\n"
             "runpy.run_module('reef_cli.fast', run_name='__main__')\n"
             "sys.stderr.write('TYPER=%s' % ('typer' in sys.modules))")
    for args in (["status"], ["status", "--json"]):
        fast = subprocess.run([sys.executable, "-c", probe, *args], env=daemon.env, capture_output=True, text=True,
                              timeout=120)
        assert fast.returncode == 0 and "TYPER=False" in fast.stderr, fast.stderr
        full = daemon.cli(*args)
        if args[-1] == "--json":
            mine, theirs = json.loads(fast.stdout), json.loads(full.stdout)
            for d in (mine, theirs):
                d.pop("uptime_s")
            assert mine == theirs
        else:  # the uptime may differ by a second
            assert fast.stdout.splitlines()[1:] == full.stdout.splitlines()[1:] and len(full.stdout.splitlines()) == 4
            assert fast.stdout.split(", up")[0] == full.stdout.split(", up")[0]
