"""What ``reef status`` prints, in one place for both paths that print it: the fast one (``reef_cli/fast.py``,
the daemon asked over its socket with the standard library alone) and the typer command (``reef_cli/main.py``).
Standard library only: the fast path imports it."""

from __future__ import annotations

from typing import Any


def status_lines(info: dict[str, Any]) -> list[str]:
    """What ``reef status`` prints for a ``GET /reef/status`` answer."""
    models = ", ".join(f"{n} ({m['engine']}{', test model' if m.get('test_model') else ''}"
                       f"{', loaded' if m['loaded'] else ''})" for n, m in info["models"].items())
    return [f"daemon   pid {info['pid']}, up {info['uptime_s']:.0f}s, home {info['home']}",
            f"listen   {info['listen']['tcp']} and {info['listen']['unix']}",
            f"models   {models}; default {info['default_model']}",
            f"records  {info['records']} exchanges, {info['reports']} reports, {info['scenarios']} scenarios"]
