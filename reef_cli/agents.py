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
            result = adapter.install(cfg.agents_path, force=force, progress=status.update)
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


DOCTOR_SCENARIO = "doctor"  # one scenario for every check, reused; each check's run is forgotten after it
DOCTOR_TIMEOUT_S = 120.0
_PROMPTS = {"pi": ["-p", "--no-session", "say ok"], "claude": ["-p", "say ok"], "opencode": ["-p", "say ok"],
            "codex": ["-p", "say ok"]}


def _stop_group(proc: Any, grace_s: float = 5.0) -> None:
    """End the wrapper and everything it started (the agent and the agent's own children: one process group, made
    for the check), SIGTERM first, then SIGKILL: an agent left running would keep its requests in the daemon."""
    import os
    import signal
    import subprocess

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the wrapper is gone; what it started may still be there
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def _leave_nothing(cfg: Any, name: str, since: float, last_before: bytes | None) -> None:
    """Forget the check's run (its records, its run file, what its agent wrote) and put back the pointer to the
    agent's last run, so that ``reef-<agent> report`` still scores the user's own last run."""
    from adapters import ADAPTERS
    from reef_cli.runs import call, list_runs

    runs = [r["run"] for r in list_runs(cfg, ADAPTERS[name])
            if r.get("scenario") == DOCTOR_SCENARIO and (r.get("started_at") or 0) >= since]
    if runs:
        try:
            call(cfg, "POST", "/reef/records/forget", {"runs": runs})
        except Exception:  # noqa: BLE001 - the check's verdict stands; the run stays listed (reef-NAME runs)
            pass
    pointer = cfg.runs_dir / f"last-{name}"
    if last_before is None:
        pointer.unlink(missing_ok=True)
    else:
        from adapters.base import write_file

        write_file(pointer, last_before)


def check_agent(name: str, timeout: float = DOCTOR_TIMEOUT_S) -> dict[str, Any]:
    """Start the agent through its wrapper with one tiny prompt against the daemon: does it reach Reef? At most
    ``timeout`` seconds (then the wrapper's whole process group is ended); the run is forgotten afterwards."""
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
    env = dict(os.environ, REEF_QUIET="1", REEF_SCENARIO=DOCTOR_SCENARIO)
    pointer = cfg.runs_dir / f"last-{name}"
    last_before = pointer.read_bytes() if pointer.is_file() else None
    since = time.time() - 1
    t0 = time.monotonic()
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="reef-doctor-") as cwd:
        proc = subprocess.Popen([sys.executable, "-m", "reef_cli.wrapper", name, *_PROMPTS[name]], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc)
            stdout, stderr = proc.communicate()
        else:
            _stop_group(proc, grace_s=0)  # whatever the agent left running in its group ends with the check
    from reef_cli.runs import list_runs

    runs = [r for r in list_runs(cfg, adapter)
            if r.get("scenario") == DOCTOR_SCENARIO and (r.get("started_at") or 0) >= since]
    receipts = len(runs[0]["receipts"]) if runs else 0
    _leave_nothing(cfg, name, since, last_before)
    seconds = round(time.monotonic() - t0, 1)
    if timed_out:
        return {"agent": name, "ok": False, "version": installed, "exit_code": None, "receipts": receipts,
                "seconds": seconds, "problem": f"no answer in {timeout:.0f} s (stopped, with what it started)",
                "fix": f"run `reef-{name} -p \"say ok\"` by hand and read its output; or allow longer: "
                       "reef agents doctor --timeout S"}
    ok = proc.returncode == 0 and receipts > 0
    out: dict[str, Any] = {"agent": name, "ok": ok, "version": installed, "exit_code": proc.returncode,
                           "receipts": receipts, "seconds": seconds}
    if not ok:
        out["problem"] = ((stderr or stdout).strip().splitlines()[-1:] or ["no request reached Reef"])[0]
        out["fix"] = f"run `reef-{name} -p \"say ok\"` by hand; see {cfg.logs_dir / 'daemon.log'}"
    return out


def _verdict(r: dict[str, Any]) -> str:
    if r["ok"]:
        return (f"ok    {r['agent']} {r['version']}: answered through Reef in {r['seconds']} s "
                f"({r['receipts']} receipt(s))")
    return f"FAIL  {r['agent']}: {r['problem']}; fix: {r['fix']}"


@app.command()
@edge
def doctor(
    names: list[str] | None = typer.Argument(None, help="Agents to check (default: the installed ones)."),
    timeout: float = typer.Option(DOCTOR_TIMEOUT_S, "--timeout", min=1,
                                  help="Seconds each agent may take before it is stopped."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check that each installed agent starts and reaches the daemon: one tiny prompt each, at most --timeout
    seconds, a line as each check starts and ends. The checks' runs are forgotten afterwards (scenario doctor)."""
    import sys

    from adapters import ADAPTERS

    cfg = config()
    chosen = _names(names) if names else [n for n, a in ADAPTERS.items() if a.installed_version(cfg.agents_path)]
    if not chosen:
        print("no agents installed; install them with `reef agents install`")
        raise typer.Exit(1)
    results = []
    for i, name in enumerate(chosen, 1):
        # progress on stderr (stdout is the verdicts, or the JSON): a check can take up to --timeout
        sys.stderr.write(f"[{i}/{len(chosen)}] checking {name}: one prompt through reef-{name} (at most "
                         f"{timeout:g} s) ...\n")
        sys.stderr.flush()
        r = check_agent(name, timeout)
        results.append(r)
        if not json_out:
            print(_verdict(r), flush=True)
        else:
            sys.stderr.write(f"[{i}/{len(chosen)}] {name}: {'ok' if r['ok'] else 'FAIL'} in {r.get('seconds', 0)} s\n")
    if json_out:
        print_json(results)
    if not all(r["ok"] for r in results):
        raise typer.Exit(1)
