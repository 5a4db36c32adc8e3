"""``reef agents install|list|doctor``: the coding agents Reef wraps (pinned npm versions, Reef's own prefix)."""

from __future__ import annotations

import time
from typing import Any

import typer

from reef_cli.common import config, console, edge, print_json

app = typer.Typer(help="Install and check the coding agents Reef wraps (pi, claude, opencode, codex).",
                  no_args_is_help=True)


def _names(names: list[str] | None) -> list[str]:
    from adapters import ADAPTERS, get_adapter

    return [get_adapter(n).name for n in names] if names else list(ADAPTERS)


@app.command()
@edge
def install(
    names: list[str] | None = typer.Argument(None, help="Agents to install (default: all): pi, claude, opencode, codex."),
    force: bool = typer.Option(False, "--force", help="Reinstall even when the pinned version is there."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Install the pinned version of each agent from npm into Reef's own prefix (never the user's)."""
    from adapters import ADAPTERS

    cfg = config()
    results = []
    for name in _names(names):
        adapter = ADAPTERS[name]
        if json_out:
            results.append(adapter.install(cfg.agents_path, force=force))
            continue
        with console().status(f"installing {adapter.package}@{adapter.version} ...") as status:
            result = adapter.install(cfg.agents_path, force=force, progress=lambda m, s=status: s.update(m))
        if result["installed"]:
            print(f"{name} {result['version']}: installed in {result['seconds']} s "
                  f"({adapter.binary_path(cfg.agents_path)})")
        else:
            print(f"{name} {result['version']}: already installed")
        results.append(result)
    if json_out:
        print_json(results)


@app.command("list")
@edge
def list_(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the agents: pinned version, installed version, where."""
    from adapters import ADAPTERS

    cfg = config()
    rows = []
    for a in ADAPTERS.values():
        installed = a.installed_version(cfg.agents_path)
        rows.append({"agent": a.name, "wrapper": a.command, "package": a.package, "pinned": a.version,
                     "installed": installed, "path": str(a.binary_path(cfg.agents_path)) if installed else None})
    if json_out:
        print_json(rows)
        return
    from rich.table import Table

    table = Table("agent", "wrapper", "package", "pinned", "installed")
    for r in rows:
        mark = r["installed"] or "no"
        if r["installed"] and r["installed"] != r["pinned"]:
            mark += " (differs: reef agents install --force)"
        table.add_row(r["agent"], r["wrapper"], r["package"], r["pinned"], mark)
    console().print(table)


def check_agent(name: str, timeout: float = 120.0) -> dict[str, Any]:
    """Start the agent through its wrapper with one tiny prompt against the daemon: does it reach Reef?"""
    import os
    import subprocess
    import sys
    import tempfile

    from adapters import ADAPTERS

    cfg = config()
    adapter = ADAPTERS[name]
    installed = adapter.installed_version(cfg.agents_path)
    if installed is None:
        return {"agent": name, "ok": False, "problem": "not installed", "fix": f"reef agents install {name}"}
    args = {"pi": ["-p", "--no-session", "say ok"], "claude": ["-p", "say ok"],
            "opencode": ["run", "say", "ok"], "codex": ["-p", "say ok"]}[name]
    scenario = f"doctor-{name}"
    env = dict(os.environ, REEF_QUIET="1", REEF_SCENARIO=scenario)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reef-doctor-") as cwd:
        try:
            proc = subprocess.run([sys.executable, "-m", "reef_cli.wrapper", name, *args], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"agent": name, "ok": False, "problem": f"no answer in {timeout:.0f} s",
                    "fix": f"run reef-{name} by hand and read its output"}
    from reef_cli.runs import list_runs

    runs = [r for r in list_runs(cfg, adapter) if r["scenario"] == scenario]
    receipts = len(runs[0]["receipts"]) if runs else 0
    ok = proc.returncode == 0 and receipts > 0
    out: dict[str, Any] = {"agent": name, "ok": ok, "version": installed, "exit_code": proc.returncode,
                           "receipts": receipts, "seconds": round(time.monotonic() - t0, 1)}
    if not ok:
        out["problem"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no request reached Reef"]
        out["fix"] = f"run `reef-{name} --reef-scenario {scenario}` by hand; see {cfg.logs_dir / 'daemon.log'}"
    return out


@app.command()
@edge
def doctor(
    names: list[str] | None = typer.Argument(None, help="Agents to check (default: the installed ones)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check that each installed agent starts and reaches the daemon (one tiny prompt, recorded in scenario
    doctor-<agent>)."""
    from adapters import ADAPTERS

    cfg = config()
    chosen = _names(names) if names else [n for n, a in ADAPTERS.items() if a.installed_version(cfg.agents_path)]
    if not chosen:
        print("no agents installed; install them with `reef agents install`")
        raise typer.Exit(1)
    results = [check_agent(n) for n in chosen]
    if json_out:
        print_json(results)
    else:
        for r in results:
            if r["ok"]:
                print(f"ok    {r['agent']} {r['version']}: answered through Reef in {r['seconds']} s "
                      f"({r['receipts']} receipt(s))")
            else:
                print(f"FAIL  {r['agent']}: {r['problem']}; fix: {r['fix']}")
    if not all(r["ok"] for r in results):
        raise typer.Exit(1)
