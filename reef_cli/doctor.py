"""``reef doctor``: check what Reef needs and say how to fix each problem.

Checks: the config, the state dir, the token file's permissions (0600), the socket's, the daemon (reachable,
and over TCP whether the token is accepted), the release chains (no head or reflog entry naming a commit that a
full or failing disk lost), free disk space, git, node and npm, the coding agents (installed at their pinned
versions, via ``adapters.ADAPTERS`` when that package is there), the default model, and each inference server
(vLLM, SGLang) a model entry names: its interpreter, and from a running daemon its health, version and restarts. It never starts the daemon
or changes anything: damaged release chains are reported with the fix (the daemon's start-up recovery repairs
them). Exit 0 when nothing failed (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer

from reef_cli.common import print_json

OK, WARN, FAIL = "ok", "warn", "fail"
GIB = 1 << 30
DISK_FAIL_BYTES = 1 * GIB  # below this, records and releases may not fit
DISK_WARN_BYTES = 5 * GIB  # a weights release of a small real model is a few GiB


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str | None = None


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def check_config() -> tuple[Check, Any]:
    from daemon.config import load_config
    from daemon.errors import ReefError

    try:
        cfg = load_config()
    except ReefError as e:
        return Check("config", FAIL, e.message, "fix the file named above (TOML), or move it aside"), None
    where = cfg.home / "config.toml"
    return Check("config", OK, f"{where}" if where.exists() else f"defaults (no {where})"), cfg


def check_home(home: Path) -> Check:
    if not home.exists():
        return Check("state dir", WARN, f"{home} does not exist yet", "reef daemon start (creates it)")
    if not os.access(home, os.W_OK | os.X_OK):
        return Check("state dir", FAIL, f"{home} is not writable by you", f"chown -R $USER {home}")
    return Check("state dir", OK, str(home))


def check_token(path: Path) -> Check:
    if not path.exists():
        return Check("token file", WARN, f"{path} does not exist yet", "reef daemon start (creates it, mode 0600)")
    mode = _mode(path)
    if mode & 0o077:
        return Check("token file", FAIL, f"{path} has mode {mode:04o}: other users can read the token",
                     f"chmod 600 {path}")
    return Check("token file", OK, f"{path} (mode {mode:04o})")


def check_socket(path: Path) -> Check | None:
    if not path.exists():
        return None
    mode = _mode(path)
    if mode & 0o077:
        return Check("socket", FAIL, f"{path} has mode {mode:04o}: other users can use the daemon",
                     "reef daemon stop && reef daemon start (the daemon creates it 0600)")
    return Check("socket", OK, f"{path} (mode {mode:04o})")


def check_daemon(cfg: Any) -> Check:
    from daemon.errors import ReefError, Unauthorized
    from reef_cli.client import Client, read_pid

    with Client(cfg, timeout=3.0) as c:
        if not c.healthy():
            if cfg.url:
                return Check("daemon", FAIL, f"nothing answers at {cfg.url}",
                             "start the daemon there, or unset REEF_URL to use the local one")
            pid = read_pid(cfg)
            if pid is not None:
                return Check("daemon", FAIL, f"process {pid} holds {cfg.pid_path} but does not answer on "
                             f"{cfg.socket_path}", "reef daemon logs; then reef daemon stop && reef daemon start")
            return Check("daemon", WARN, "not running (commands that need it start it)", "reef daemon start")
        try:
            info = c.get("/reef/status")
        except Unauthorized:
            return Check("daemon", FAIL, f"{cfg.url} refuses the token in REEF_TOKEN",
                         f"export REEF_TOKEN=$(cat {cfg.token_path}) (the daemon's token)")
        except ReefError as e:
            return Check("daemon", FAIL, f"answers /healthz but not /reef/status: {e.message}", "reef daemon logs")
    return Check("daemon", OK, f"pid {info['pid']} at {c.where()}, up {info['uptime_s']:.0f}s, "
                 f"{info['records']} records, {info['scenarios']} scenarios")


def check_releases(cfg: Any, daemon: Check) -> Check | None:
    """Dangling heads and reflog entries naming lost commits, found read-only (``daemon.releases.find_damage``)."""
    path = cfg.artifacts_path
    if not (path / "HEAD").exists():
        return None  # no release published yet
    from daemon.releases import find_damage

    try:
        damage = find_damage(path)
    except Exception as e:  # an unreadable store is a finding, not a crash
        return Check("releases", FAIL, f"cannot read {path}: {e}", "reef daemon logs")
    if not damage:
        return Check("releases", OK, f"{path}: every head and reflog entry names a commit that reads back")
    restart = "reef daemon stop && reef daemon start" if daemon.status == OK else "reef daemon start"
    return Check("releases", FAIL, f"{path}: " + "; ".join(d.describe() for d in damage),
                 f"{restart} (start-up recovery repairs it and logs what it did)")


def check_disk(home: Path) -> Check:
    probe = home if home.exists() else home.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"{free / GIB:.1f} GiB free on {probe}"
    if free < DISK_FAIL_BYTES:
        return Check("disk space", FAIL, detail, "free space there, or set REEF_HOME to a roomier disk")
    if free < DISK_WARN_BYTES:
        return Check("disk space", WARN, detail + " (weights releases need a few GiB)",
                     "free space there, or set REEF_HOME to a roomier disk")
    return Check("disk space", OK, detail)


def _version(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout or out.stderr).strip().splitlines()[0] if out.returncode == 0 and (out.stdout or out.stderr) \
        else None


def check_tool(name: str, why: str, install: str) -> Check:
    path = shutil.which(name)
    if path is None:
        return Check(name, FAIL, f"not found on PATH ({why})", install)
    version = _version([name, "--version"])
    if version is None:
        return Check(name, FAIL, f"{path} does not run", install)
    return Check(name, OK, f"{version} ({path})")


def check_node() -> Check:
    check = check_tool("node", "the coding agents run on it", "install Node.js 18 or newer (e.g. apt-get install nodejs)")
    if check.status == OK:
        try:
            major = int(check.detail.lstrip("v").split(".")[0])
        except ValueError:
            return check
        if major < 18:
            return Check("node", FAIL, check.detail + ": the agents need Node.js 18 or newer", "install Node.js 18+")
    return check


def check_agents(agents_dir: Path) -> list[Check]:
    try:
        from adapters import ADAPTERS
    except ImportError:
        return [Check("agents", WARN, "the adapters package is not installed", "./install.sh (reinstall Reef)")]
    checks = []
    for name, adapter in sorted(ADAPTERS.items()):
        try:
            installed = adapter.installed_version(agents_dir)
        except Exception as e:  # one broken adapter must not hide the others
            checks.append(Check(f"agent {name}", FAIL, f"cannot tell: {e}", f"reef agents install {name}"))
            continue
        if installed is None:
            checks.append(Check(f"agent {name}", WARN, f"{adapter.package} is not installed (reef-{name} needs it)",
                                f"reef agents install {name}"))
        elif installed != adapter.version:
            checks.append(Check(f"agent {name}", FAIL, f"{adapter.package} {installed} installed, Reef pins "
                                f"{adapter.version}", f"reef agents install {name}"))
        else:
            checks.append(Check(f"agent {name}", OK, f"{adapter.package} {installed}"))
    return checks


def check_model(cfg: Any) -> Check | None:
    entry = cfg.models.get(cfg.default_model)
    if entry is None:
        return Check("model", FAIL, f"default_model {cfg.default_model!r} is not in the config",
                     "set default_model in config.toml to one of: " + ", ".join(cfg.models))
    if entry.engine == "upstream":
        from daemon.providers import describe

        detail = f"{cfg.default_model}: {describe(entry)}"
        if entry.api_key_env and not cfg.secrets.get(entry.api_key_env):  # the name, never the value
            return Check("model", WARN, f"{detail}; {entry.api_key_env} is not set here",
                         f"export {entry.api_key_env} in the environment that starts the daemon")
        return Check("model", OK, detail)
    if entry.engine != "transformers" or entry.path is None:
        return Check("model", OK, f"{cfg.default_model} ({entry.engine})")
    from daemon.model_dirs import TEST_MODEL_NOTE, is_test_model

    if is_test_model(cfg.default_model):
        return Check("model", WARN, f"the default model {cfg.default_model} is {TEST_MODEL_NOTE}",
                     'set default_model = "smollm2" in config.toml (./install.sh makes it)')
    path = Path(entry.path)
    if not (path / "config.json").exists():
        from daemon.model_dirs import BUILT_IN

        if cfg.default_model in BUILT_IN:
            return Check("model", WARN, f"{cfg.default_model} is not made yet (the daemon makes it on first start)",
                         f"reef model init {cfg.default_model}")
        return Check("model", FAIL, f"{path} is not a model directory", f"point models.{cfg.default_model}.path at one")
    return Check("model", OK, f"{cfg.default_model} at {path}")


def check_fit(cfg: Any) -> list[Check]:
    """Each installed agent's first request (its measured size) against each configured model's context: an agent
    whose first request no model holds gets every answer refused."""
    try:
        from adapters import ADAPTERS
    except ImportError:  # the agents check says so already
        return []
    from daemon.engines.prompts import dir_renders_tools
    from daemon.model_dirs import context_of

    local = {name: e.path for name, e in sorted(cfg.models.items()) if e.engine == "transformers"}
    contexts = {k: n for k, p in local.items() if (n := context_of(p))}
    tools = {k: dir_renders_tools(local[k]) for k in contexts}  # counted as each model's template renders it
    checks = []
    for name, adapter in sorted(ADAPTERS.items()):
        if not adapter.first_request_tokens or not contexts or adapter.installed_version(cfg.agents_path) is None:
            continue
        needs = {m: adapter.first_request_seen(tools[m]) or 0 for m in contexts}
        sizes = ", ".join(f"{m} {n:,} for about {needs[m]:,}{'' if tools[m] is not False else ' (no tool schemas)'}"
                          f" {'ok' if n >= needs[m] else 'too small'}" for m, n in contexts.items())
        detail = f"first request as each model reads it; contexts: {sizes}"
        fits = [m for m, n in contexts.items() if n >= needs[m]]
        if cfg.default_model in contexts and contexts[cfg.default_model] < needs[cfg.default_model]:
            checks.append(Check(f"fit {name}", WARN, detail + f" (the default {cfg.default_model} cannot hold it)",
                                (f"reef scenarios set-model {name} {fits[0]}" if fits else
                                 "serve it from an upstream provider or a server engine with a larger model")))
        else:
            checks.append(Check(f"fit {name}", OK, detail))
    return checks


def check_servers(cfg: Any, daemon: Check) -> list[Check]:
    """One check per model served by an inference server: what the daemon reports of it, else whether it can start."""
    from daemon.engines.registry import engine_kind  # the registry says which engines are servers

    entries = [e for e in cfg.models.values() if engine_kind(e.engine).server]
    if not entries:
        return []
    reported: dict[str, Any] = {}
    if daemon.status == OK:
        from daemon.errors import ReefError
        from reef_cli.client import Client

        try:
            with Client(cfg, timeout=3.0) as c:
                reported = c.get("/reef/status").get("models", {})
        except ReefError:
            reported = {}
    out = []
    for e in entries:
        name = f"{e.engine} ({e.name})"
        server = reported.get(e.name, {}).get("server")
        if server:
            where = f"{server['url']}" + (f", pid {server['pid']}" if server.get("pid") else "")
            if server["healthy"]:
                out.append(Check(name, OK, f"healthy at {where}, {e.engine} {server.get('version') or '?'}, "
                                 f"weight version {server.get('weight_version')}, {server['restarts']} restarts"))
            else:
                out.append(Check(name, FAIL, f"not healthy at {where}: {server.get('last_error') or 'starting'}",
                                 f"see {server.get('log') or 'the server log'}; reef daemon logs"))
            continue
        if e.url is None and e.server and not Path(e.server).exists():
            fix = "./install.sh --vllm (its own venv), then point server at its bin/python" if e.engine == "vllm" \
                else "install SGLang in a venv of its own (it needs a GPU) and point server at its python"
            out.append(Check(name, FAIL, f"models.{e.name}.server = {e.server} does not exist", fix))
        else:
            what = f"attaches to {e.url}" if e.url else f"starts with the daemon ({e.server or 'python3'})"
            out.append(Check(name, OK if daemon.status == OK else WARN, f"{what}; not started yet",
                             "a request to the model starts it"))
    return out


def run_checks() -> list[Check]:
    """Every check, in the order shown; a check that passed carries no fix, whichever way the checks ended (a
    config that does not load ends them early)."""
    checks: list[Check] = []
    _gather(checks)
    for c in checks:
        if c.status == OK:
            c.fix = None
    return checks


def _gather(checks: list[Check]) -> None:
    cfg_check, cfg = check_config()
    checks.append(Check("python", OK if sys.version_info >= (3, 11) else FAIL,
                        sys.version.split()[0] + f" ({sys.executable})", "Reef needs Python 3.11 or newer"))
    checks.append(cfg_check)
    if cfg is None:
        return
    checks.append(check_home(cfg.home))
    checks.append(check_token(cfg.token_path))
    sock = check_socket(cfg.socket_path)
    if sock is not None:
        checks.append(sock)
    daemon = check_daemon(cfg)
    checks.append(daemon)
    releases = check_releases(cfg, daemon)
    if releases is not None:
        checks.append(releases)
    checks.append(check_disk(cfg.home))
    checks.append(check_tool("git", "to read release chains with git tools", "install git (e.g. apt-get install git)"))
    checks.append(check_node())
    checks.append(check_tool("npm", "installs the coding agents", "install npm (e.g. apt-get install npm)"))
    checks.extend(check_agents(cfg.agents_path))
    model = check_model(cfg)
    if model is not None:
        checks.append(model)
    checks.extend(check_fit(cfg))
    checks.extend(check_servers(cfg, daemon))


def doctor(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Check the daemon, token and socket permissions, disk space, git, node, npm, agents and the model; say how to
    fix each problem."""
    checks = run_checks()
    failed = [c for c in checks if c.status == FAIL]
    if json_out:
        print_json({"ok": not failed, "checks": [asdict(c) for c in checks]})
    else:
        from reef_cli.common import console

        out = console()
        marks = {OK: "[green]ok[/]  ", WARN: "[yellow]warn[/]", FAIL: "[red]FAIL[/]"}
        for c in checks:
            out.print(f"{marks[c.status]}  [bold]{c.name:12}[/] {c.detail}", highlight=False)
            if c.fix:
                out.print(f"              fix: {c.fix}", highlight=False)
        warned = sum(c.status == WARN for c in checks)
        out.print(f"{len(failed)} problem(s), {warned} warning(s)" if failed or warned else "all good")
    if failed:
        raise typer.Exit(1)
