"""What every command shares: the config, the daemon client, output helpers and the error edge.

Commands are thin: parse, call the daemon (or the library), render. ``fail`` turns any ``ReefError`` into one
line on stderr and the error's exit code; tracebacks are never shown with locals (a token must never print).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn, ParamSpec, TypeVar

import typer

from daemon.config import Config, load_config
from daemon.errors import ReefError

P = ParamSpec("P")
R = TypeVar("R")


def config(**overrides: Any) -> Config:
    return load_config(overrides=overrides)


def edge(fn: Callable[P, R]) -> Callable[P, R]:
    """Map Reef errors to one clear line and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except ReefError as e:
            fail(e.message, e.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except typer.Abort:  # a confirmation read end-of-file (a script, CI): nothing was done
            fail("a confirmation was asked and standard input gave no answer (it is closed); nothing was done: "
                 "pass --yes to go ahead without asking", 2)

    return wrapper


def fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(f"reef: {message}\n")
    raise typer.Exit(code)


def score_problem(score: float | None) -> str | None:
    """What is wrong with a ``--score`` typer read as a float (None: nothing): ``nan`` and ``inf`` parse as floats
    but are no score (JSON cannot carry them, and the daemon's answer would be about JSON, not the score)."""
    import math

    if score is None or math.isfinite(score):
        return None
    what = "not a number" if math.isnan(score) else "not a finite number"
    return f"--score {score} is {what}: give a number in the scenario's range (0 to 1 unless config.toml sets one)"


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def console() -> Any:
    import sys

    from rich.console import Console

    # piped output is read by scripts and tests: do not wrap it at 80 columns
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def ago(ts: float | None) -> str:
    import time

    if ts is None:
        return "-"
    d = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= size:
            return f"{int(d // size)}{unit} ago"
    return f"{int(d)}s ago"


def client() -> Any:
    """A client of the daemon, starting it if it is not running (with a spinner on a terminal: a first start
    builds the tiny model)."""
    from reef_cli.client import Client, ensure_daemon

    cfg = config()
    probe = Client(cfg)
    if probe.healthy() or cfg.url:
        probe.close()
        return ensure_daemon(cfg)
    probe.close()
    with starting():
        return ensure_daemon(cfg)


def starting() -> Any:
    """A spinner on stderr while the daemon starts (nothing when stderr is not a terminal)."""
    from rich.console import Console

    return Console(stderr=True).status("starting the daemon (a first start builds the tiny model)...")
