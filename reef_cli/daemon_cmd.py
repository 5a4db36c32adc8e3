"""``reef serve`` and ``reef daemon start|stop|status|logs``."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import typer

from reef_cli.common import config, edge, fail, print_json, starting

app = typer.Typer(help="Run the daemon in the background: start, stop, status, logs.", no_args_is_help=True)

EXIT_NOT_RUNNING = 3


PROVIDER_HELP = ("Serve from a real provider: anthropic ($ANTHROPIC_API_KEY), openai ($OPENAI_API_KEY), ollama, "
                 "llamacpp, openai-compatible (with --upstream-url). Adds the model NAME and makes it the default; "
                 "the key is read from the environment, never stored.")


def provider_options() -> dict[str, Any]:
    """The provider flags, shared by ``reef serve`` and ``reef daemon start``."""
    return {
        "provider": typer.Option(None, "--provider", help=PROVIDER_HELP),
        "upstream_url": typer.Option(None, "--upstream-url", help="The provider's base URL (overrides the preset's; "
                                     "alone: any OpenAI- or Anthropic-compatible URL, as the model 'upstream', key: "
                                     "$REEF_UPSTREAM_API_KEY)."),
        "upstream_format": typer.Option(None, "--upstream-format", help="The upstream's format: openai-chat, "
                                        "openai-responses, anthropic (default: the provider's)."),
        "upstream_model": typer.Option(None, "--upstream-model", help="The provider's model name (default: the "
                                       "preset's, else the client's)."),
        "upstream_key_env": typer.Option(None, "--upstream-key-env", help="The environment variable holding the key "
                                         "(a name ending in _API_KEY, _KEY or _TOKEN; default: the provider's)."),
    }


_P = provider_options()


def _flags(provider: str | None, upstream_url: str | None, upstream_format: str | None, upstream_model: str | None,
           upstream_key_env: str | None) -> dict[str, str | None]:
    return {"provider": provider, "upstream_url": upstream_url, "upstream_format": upstream_format,
            "upstream_model": upstream_model, "upstream_key_env": upstream_key_env}


@edge
def serve(
    host: str = typer.Option(None, help="Address to listen on (default 127.0.0.1)."),
    port: int = typer.Option(None, help="TCP port (default 8900)."),
    model: str = typer.Option(None, help="Default model for new scenarios (a name from config.toml)."),
    provider: str = _P["provider"],
    upstream_url: str = _P["upstream_url"],
    upstream_format: str = _P["upstream_format"],
    upstream_model: str = _P["upstream_model"],
    upstream_key_env: str = _P["upstream_key_env"],
) -> None:
    """Run the daemon in the foreground (Ctrl-C drains in-flight requests and stops)."""
    from daemon.providers import require_provider_key
    from daemon.server import run, setup_logging

    cfg = config(host=host, port=port, default_model=model,
                 **_flags(provider, upstream_url, upstream_format, upstream_model, upstream_key_env))
    require_provider_key(cfg.provider, cfg.secrets)
    setup_logging(cfg, to_file=False)
    run(cfg)


@app.command()
@edge
def start(
    timeout: float = typer.Option(120.0, help="Seconds to wait until the daemon is healthy."),
    provider: str = _P["provider"],
    upstream_url: str = _P["upstream_url"],
    upstream_format: str = _P["upstream_format"],
    upstream_model: str = _P["upstream_model"],
    upstream_key_env: str = _P["upstream_key_env"],
) -> None:
    """Start the daemon in the background and wait until it is healthy."""
    from daemon.providers import provider_env, require_provider_key, serves
    from reef_cli.client import Client, read_pid, start_daemon

    flags = _flags(provider, upstream_url, upstream_format, upstream_model, upstream_key_env)
    cfg = config(**flags)
    pid = read_pid(cfg)
    client = Client(cfg)
    try:
        running = client.get("/reef/status") if pid is not None and client.healthy() else None
    finally:
        client.close()
    if running is not None:
        if cfg.provider is not None and not serves(running, cfg.provider):
            fail(f"the daemon already runs (pid {pid}) without provider {cfg.provider.name} as set here; stop it "
                 "first (reef daemon stop)", 1)
        print(f"reef daemon already running (pid {pid})")
        return
    require_provider_key(cfg.provider, cfg.secrets)
    t0 = time.monotonic()
    with starting():
        pid = start_daemon(cfg, timeout=timeout, env=provider_env(flags))
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
