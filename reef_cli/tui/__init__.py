"""``reef tui``: a Textual console for release chains, training, records and rollbacks.

``app.py`` (the app and its connection to the daemon), ``screens.py`` (what it shows), ``api.py`` (the
asynchronous HTTP client it uses), ``format.py`` (pure text helpers), ``widgets.py``. Textual is imported only
when the TUI starts, so the rest of the CLI stays fast.
"""

from __future__ import annotations

import typer

from daemon.config import Config
from reef_cli.common import config, edge


def run(config: Config, *, scenario: str | None = None, exit_after_paint: bool = False) -> float | None:
    """Run the TUI until the person quits; returns when the first chain screen was painted (epoch seconds)."""
    from reef_cli.tui.api import Api
    from reef_cli.tui.app import ReefApp

    app = ReefApp(Api(config), scenario=scenario, exit_after_paint=exit_after_paint)
    app.run()
    return app.painted_at




@edge
def command(
    scenario: str = typer.Option(None, "--scenario", "-s", help="Open this scenario's release chain first."),
    exit_after_paint: bool = typer.Option(
        False, "--exit-after-paint", hidden=True,
        help="Exit once the first chain screen is painted and print when (bench/tui_start.py measures this).",
    ),
) -> None:
    """Open the terminal console: scenarios, release chains, training, records feed; roll back and promote."""
    import sys

    cfg = config()
    if not cfg.url:  # a local daemon is started when needed; a remote one is waited for by the TUI itself
        from reef_cli.client import ensure_daemon

        ensure_daemon(cfg).close()
    painted = run(cfg, scenario=scenario, exit_after_paint=exit_after_paint)
    if exit_after_paint:
        sys.stderr.write(f"painted {painted or 0:.6f}\n")
