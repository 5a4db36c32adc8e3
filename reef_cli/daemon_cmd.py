"""``reef serve`` and ``reef daemon start|stop|status|logs``."""

from __future__ import annotations

import os
import signal
import sys
import time

import typer

from reef_cli.common import config, edge, fail, print_json, starting

app = typer.Typer(help="Run the daemon in the background: start, stop, status, logs.", no_args_is_help=True)

EXIT_NOT_RUNNING = 3


@edge
def serve(
    host: str = typer.Option(None, help="Address to listen on (default 127.0.0.1)."),
    port: int = typer.Option(None, help="TCP port (default 8900)."),
    model: str = typer.Option(None, help="Default model for new scenarios (a name from config.toml)."),
    upstream_url: str = typer.Option(None, help="Serve from this OpenAI- or Anthropic-compatible base URL: adds"
                                     " the model 'upstream' and makes it the default (key: $REEF_UPSTREAM_API_KEY)."),
    upstream_format: str = typer.Option(None, help="The upstream's format: openai-chat (default), openai-responses,"
                                        " anthropic."),
    upstream_model: str = typer.Option(None, help="The upstream's model name (default: the client's)."),
) -> None:
    """Run the daemon in the foreground (Ctrl-C drains in-flight requests and stops)."""
    from daemon.config import upstream_entry
    from daemon.server import run, setup_logging

    extra = {}
    if upstream_url:
        entry = upstream_entry(upstream_url, upstream_format, upstream_model, os.environ)
        extra = {"models": {entry.name: entry}, "default_model": model or entry.name}
    elif upstream_format or upstream_model:
        fail("--upstream-format and --upstream-model need --upstream-url", 2)
    cfg = config(host=host, port=port, **({"default_model": model} | extra))
    setup_logging(cfg, to_file=False)
    run(cfg)


@app.command()
@edge
def start(timeout: float = typer.Option(120.0, help="Seconds to wait until the daemon is healthy.")) -> None:
    """Start the daemon in the background and wait until it is healthy."""
    from reef_cli.client import Client, read_pid, start_daemon

    cfg = config()
    pid = read_pid(cfg)
    if pid is not None and Client(cfg).healthy():
        print(f"reef daemon already running (pid {pid})")
        return
    t0 = time.monotonic()
    with starting():
        pid = start_daemon(cfg, timeout=timeout)
    print(f"reef daemon started (pid {pid}) in {time.monotonic() - t0:.1f}s; listening on {cfg.host}:{cfg.port} "
          f"and {cfg.socket_path}")


@app.command()
@edge
def stop(timeout: float = typer.Option(90.0, help="Seconds to wait for in-flight requests to drain.")) -> None:
    """Stop the daemon, letting in-flight requests finish first."""
    from reef_cli.client import read_pid

    cfg = config()
    pid = read_pid(cfg)
    if pid is None:
        print("reef daemon is not running")
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"reef daemon stopped (pid {pid})")
            return
        time.sleep(0.05)
    fail(f"the daemon (pid {pid}) did not stop within {timeout:.0f}s; it may still be draining", 1)


@app.command()
@edge
def status(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Say whether the daemon runs (exit 0) or not (exit 3)."""
    from reef_cli.client import Client, read_pid

    cfg = config()
    client = Client(cfg)
    try:
        info = client.get("/reef/status") if client.healthy() else None
    finally:
        client.close()
    if info is None:
        if json_out:
            print_json({"running": False, "pid": read_pid(cfg)})
        else:
            print("reef daemon is not running")
        raise typer.Exit(EXIT_NOT_RUNNING)
    if json_out:
        print_json({"running": True, **info})
    else:
        print(f"reef daemon running (pid {info['pid']}), up {info['uptime_s']:.0f}s, "
              f"tcp {info['listen']['tcp']}, socket {info['listen']['unix']}")


@app.command()
@edge
def logs(
    lines: int = typer.Option(50, "-n", "--lines", help="How many lines to show."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
) -> None:
    """Show the daemon's log."""
    from reef_cli.client import tail

    cfg = config()
    path = cfg.logs_dir / "daemon.log"
    if not path.exists():
        fail(f"no log yet at {path}", 1)
    with open(path, "rb") as f:
        # the tail and the follow share one end offset: a line written in between is shown once, never lost
        end = f.seek(0, os.SEEK_END)
        text = tail(path, lines, end=end)
        if text:
            print(text, flush=follow)  # piped, the tail would otherwise wait in the buffer for the next new line
        # Ctrl-C ends the follow like any interrupted command: the edge says so and exits 130 (as tail -f does)
        while follow:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
            else:
                time.sleep(0.2)
