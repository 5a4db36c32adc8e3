"""``reef-pi``, ``reef-claude``, ``reef-opencode``, ``reef-codex``: a real coding agent whose traffic flows through Reef.

``reef-pi ARGS...`` runs ``pi ARGS...`` unchanged, in the current directory, with: the daemon started if needed,
the scenario chosen (``--reef-scenario NAME``, else ``$REEF_SCENARIO``, else the adapter's name), a fresh run
id in the base URL, the agent installed on first use, the scenario's current harness release installed in the
agent's isolated config home (or a note that a newer one exists, per ``harness_updates``), signals forwarded,
and the agent's exit code kept. Afterwards the run's receipts are stored in ``$REEF_HOME/runs/<run>.json``, with
the files the agent wrote in its config home during the run (``agent_files``: forgetting the run removes them).

``--reef-provider NAME`` (or ``REEF_PROVIDER``) serves the run from a real provider (``daemon/providers.py``): a
daemon the wrapper starts serves it, a running daemon must already serve it (else a one-line error), and the
scenario is moved to it when it was bound to another model.

Wrapper subcommands come first: ``report``, ``runs``, ``update``, ``evolve``, ``propose``, ``reef-help``. To send one of those
words to the agent itself, put ``--`` first: ``reef-pi -- report`` runs ``pi report``.

The path to the agent's first request is kept light (standard library only, one request to the daemon) so the
wrapper adds little to the agent's own start-up (``bench/wrapper_overhead.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from adapters import Adapter, Target, get_adapter
from adapters.base import install_harness, installed_release
from daemon.config import Config, load_config
from daemon.errors import AgentError, BadRequest, ReefError
from reef_cli.runs import call, call_starting, failed_requests, list_runs, run_receipts, save_run, say, token

SUBCOMMANDS = ("report", "runs", "update", "evolve", "propose", "reef-help")
FLAGS = ("--reef-scenario", "--reef-outcome", "--reef-check", "--reef-provider")  # the wrapper's own, before a --
# the agents' own subcommands, never taken for a near-miss of the wrapper's (opencode's `run` is one letter from `runs`)
AGENT_WORDS = frozenset({"run", "exec", "resume", "review", "login", "logout", "mcp", "serve", "auth", "models",
                         "export", "import", "upgrade", "agent", "debug", "stats", "github", "apply", "completion"})
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)
TTY_SIGNALS = (signal.SIGINT, signal.SIGQUIT)  # the terminal already sends these to the agent too


# --- the wrapped run --------------------------------------------------------------------------------------


def install_agent(config: Config, adapter: Adapter) -> Path:
    binary = adapter.binary_path(config.agents_path)
    if not binary.exists():
        say(f"{adapter.name} is not installed yet: installing {adapter.package}@{adapter.version} (once)")
        adapter.install(config.agents_path, progress=say)
    return binary


def sync_harness(config: Config, adapter: Adapter, home: Path, start: dict[str, Any]) -> str | None:
    """Install the scenario's current harness release (or say a newer one exists); returns the release the
    agent will run with."""
    current = installed_release(home)
    head = start.get("release_id")
    if not isinstance(head, str):
        return None
    if head == current:
        return current
    if current is not None and config.harness_updates == "notify":
        say(f"a newer harness (step {start['step']}, {head}) is available for scenario {start['scenario']}; "
            f"run `{adapter.command} update` to install it")
        return current
    # the daemon sends the files whenever its head differs from the release named installed (``current``)
    result = install_harness(home, head, {p: t.encode() for p, t in start["files"].items()})
    if current is not None and (result["written"] or result["removed"]):
        say(f"installed harness step {start['step']} of scenario {start['scenario']} ({head})")
    return head


def use_provider(config: Config, start: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """``--reef-provider NAME`` (or ``REEF_PROVIDER``): the daemon must serve that provider as set here (a daemon
    started without it is named, never used instead), and the run's scenario is moved to it when it was bound to
    another model (a harness moves; weights cannot: the daemon's 409 says so). Returns the run to use."""
    from daemon.providers import serves

    provider = config.provider
    assert provider is not None
    status = call(config, "GET", "/reef/status")
    if not serves(status, provider):
        raise ReefError(f"the daemon already runs (pid {status.get('pid')}) without provider {provider.name} as set "
                        f"here; stop it first (reef daemon stop) and run again")
    if start["model"] == provider.name:
        return start
    call(config, "POST", f"/reef/scenarios/{start['scenario']}/model", {"model": provider.name})
    say(f"scenario {start['scenario']} moved from model {start['model']} to provider {provider.name}")
    moved: dict[str, Any] = call(config, "POST", "/reef/runs", body)
    return moved


def run_agent(adapter: Adapter, args: list[str], scenario: str | None, *, outcome_flags: list[str] | None = None,
              check: str | None = None, provider: str | None = None) -> int:
    from daemon.config import OutcomeSettings
    from reef_cli import outcomes

    if provider is not None:  # read by this config and by a daemon this run starts (daemon/providers.py)
        os.environ["REEF_PROVIDER"] = provider
    config = load_config()
    if config.provider is not None:
        from daemon.providers import require_provider_key

        require_provider_key(config.provider, config.secrets)
    if scenario is None:
        scenario = os.environ.get("REEF_SCENARIO") or adapter.name
    asked = outcomes.with_flags(config.outcomes.get(scenario, OutcomeSettings()), outcome_flags or [], check)
    body = {"adapter": adapter.name, "scenario": scenario}
    home = adapter.home(config.homes_dir, scenario)
    installed = installed_release(home)
    if installed:
        body["installed_release"] = installed
    start = call_starting(config, "POST", "/reef/runs", body)
    if config.provider is not None:
        start = use_provider(config, start, body)
    for line in model_notes(adapter, start):
        say(line)
    binary = install_agent(config, adapter)
    release = sync_harness(config, adapter, home, start)
    target = Target(url=config.url or start["url"], scenario=start["scenario"], run=start["run"],
                    model=start["model"], release_id=release, context_window=int(start["context_length"]))
    argv = adapter.argv(binary, args, target)  # a form the agent lacks (`reef-opencode -p` alone) is refused here
    adapter.prepare(home, target)
    env = dict(os.environ)
    for name in adapter.unset_env():
        env.pop(name, None)
    env.update(adapter.env(home, target, token(config)))
    env["REEF_HOME"] = str(config.home)  # the agent's HOME is its own: `reef-pi propose` inside finds the daemon
    record: dict[str, Any] = {
        "run": target.run, "adapter": adapter.name, "scenario": target.scenario, "release_id": release,
        "model": target.model, "argv": args, "prompt": prompt_of(args), "cwd": os.getcwd(),
        "started_at": time.time(), "ended_at": None, "exit_code": None, "receipts": [], "reports": []}
    if asked.kept:
        report_kept(config, adapter, Path.cwd(), asked)
    before = outcomes.snapshot(Path.cwd()) if asked.kept else None
    record["spawned_at"] = time.time()
    save_run(config, record)
    with _long_requests(config, target.run, args):
        code = spawn(argv, env)
    record.update(ended_at=time.time(), exit_code=code)
    record["agent_files"] = agent_files(home, record["spawned_at"])
    failed: list[str] = []
    try:
        record["receipts"] = run_receipts(lambda path: call(config, "GET", path), target.run, failed)
        record["no_requests"] = not record["receipts"]  # the daemon says so: never the run a report scores
    except (OSError, ReefError) as e:
        say(f"could not read the run's receipts ({e}); `{adapter.command} report` will ask the daemon again")
    if asked.kept:
        changed = outcomes.changes(before, outcomes.snapshot(Path.cwd()))
        if changed:
            record["changes"] = {"root": before["root"] if before else None, "files": changed}
    if asked.any:
        report_outcomes(config, record, asked, code)
    save_run(config, record)
    n = len(record["receipts"])
    if not record.get("no_requests"):
        say(f"run {target.run}: {n} receipt{'s' if n != 1 else ''}; give feedback with "
            f"`{adapter.command} report --score S --feedback TEXT`")
        if failed:
            say(failed_requests(lambda path: call(config, "GET", path), failed, n))
    else:
        say(f"run {target.run} made no model requests: nothing to give feedback on (`{adapter.command} report` "
            "scores the last run that made some)")
    return code


def agent_files(home: Path, spawned_at: float) -> list[str]:
    """What the agent wrote in its config home during the run (sessions, transcripts, its own databases): kept in
    the run file, so that forgetting the run removes them too (``daemon/copies.py``)."""
    from daemon.copies import MARGIN_S, changed_files

    return changed_files(home, spawned_at - MARGIN_S)


def _post_outcome(config: Config, run: dict[str, Any], report: dict[str, Any]) -> None:
    body = {"references": run["receipts"], "scenario": run["scenario"], "score": report["score"],
            "metadata": {**report["metadata"], "run": run["run"], "adapter": run["adapter"]}}
    stored = call(config, "POST", "/reef/report", body)
    run.setdefault("reports", []).append({"report_id": stored["report_id"], "score": report["score"],
                                          "outcome": report["metadata"]["outcome"], "at": time.time()})


def report_outcomes(config: Config, run: dict[str, Any], asked: Any, exit_code: int) -> None:
    """The outcome reports of a run that just ended (exit code, the user's check), on its receipts; what could not
    be measured is written in the run record with its reason, never scored."""
    from reef_cli import outcomes

    reports, failed = outcomes.reports_for_run(asked, exit_code, Path(run["cwd"]))
    run["outcomes_failed"] = failed
    for f in failed:
        say(f"outcome {f['outcome']} not measured: {f['reason']}")
    if not run["receipts"]:
        if reports:
            say("the run made no model requests: no outcome to report on")
        return
    for report in reports:
        try:
            _post_outcome(config, run, report)
        except (OSError, ReefError) as e:
            run["outcomes_failed"].append({"outcome": report["metadata"]["outcome"], "reason": f"not stored: {e}"})
            say(f"outcome {report['metadata']['outcome']} could not be reported: {e}")
            continue
        m = report["metadata"]
        say(f"outcome {m['outcome']}: score {report['score']:g}"
            + (f" ({m['command']} exited {m['exit_code']})" if m["outcome"] == "check" else ""))


def report_kept(config: Config, adapter: Adapter, cwd: Path, asked: Any) -> None:
    """Before a run: for earlier runs of this agent in the same project whose changes were not judged yet, report
    whether those changes are still there (kept) or were put back (reverted)."""
    from reef_cli import outcomes

    for run in list_runs(config, adapter):
        changes = run.get("changes")
        if not changes or run.get("kept_reported") or not run.get("receipts"):
            continue
        root = Path(changes["root"])
        if root != Path(cwd).resolve() and root not in Path(cwd).resolve().parents:
            continue  # another project
        kept, reverted = outcomes.kept_share(changes["files"], root)
        share = kept / (kept + reverted)
        score = asked.fail_score + (asked.pass_score - asked.fail_score) * share
        try:
            _post_outcome(config, run, {"score": score, "metadata": {"source": "outcome", "outcome": "kept",
                                                                   "kept": kept, "reverted": reverted}})
        except (OSError, ReefError) as e:
            say(f"outcome kept of run {run['run']} could not be reported: {e}")
            continue
        run["kept_reported"] = True
        save_run(config, run)
        say(f"outcome kept of run {run['run']}: {kept} of {kept + reverted} changed file(s) kept, score {score:g}")


def model_notes(adapter: Adapter, start: dict[str, Any]) -> list[str]:
    """One line each for what would otherwise surprise the user after the agent ran: a test model (its answers are
    noise), a scenario bound to another model than the default (and the one command that moves it), a first
    request that cannot fit the model's context (and the ways out), a model whose chat template drops the agent's
    tools (said once, before the agent starts; each exchange records it as ``usage.tools_dropped``)."""
    out = []
    model, scenario, default = start["model"], start["scenario"], start.get("default_model")
    if start.get("warning"):  # the early warning (daemon/gating/warning.py): learning is paused until the user acts
        out.append(f"warning on scenario {scenario}: {start['warning']}")
    if start.get("test_model"):
        out.append(f"model {model} is a test model (random weights): its answers are noise")
    if default and model != default:
        out.append(f"scenario {scenario} is bound to model {model}, not the default {default}; move it with: "
                   f"reef scenarios set-model {scenario} {default}")
    # counted as the model's chat template renders it: a template that drops tool schemas never sees them
    need, context = adapter.first_request_seen(start.get("carries_tools")), int(start.get("context_length") or 0)
    if need and context and need > context:
        out.append(f"{adapter.name}'s first request is about {need:,} tokens as model {model} reads it, and it holds "
                   f"{context:,}: it will be refused. Ways out: an upstream provider ([models.NAME] engine = "
                   "\"upstream\"), or a server engine (vllm) with a larger model; then reef scenarios set-model")
    if start.get("carries_tools") is False:
        from daemon.providers import known

        out.append(f"model {model}'s chat template drops tool definitions: {adapter.name} will answer, but cannot "
                   f"read, edit or run anything (its tools never reach the model). To let it act, serve it from a "
                   f"provider: {adapter.command} --reef-provider NAME (one of {known()})")
    return out


def _long_requests(config: Config, run: str, args: list[str]) -> Any:
    """Say on stderr when one of the run's requests runs long (``reef_cli/progress.py``); not over an agent's own
    screen (a terminal and no one-shot prompt), where it would break the agent's display."""
    import contextlib

    from reef_cli import progress

    if sys.stdout.isatty() and not {"-p", "--print", "exec", "run"} & set(args):
        return contextlib.nullcontext()
    after = float(os.environ.get("REEF_LONG_REQUEST_S") or progress.AFTER_S)
    return progress.watch(lambda path: call(config, "GET", path), run, say, after_s=after,
                          poll_s=min(progress.POLL_S, max(after / 4, 0.05)))


def prompt_of(args: list[str]) -> str:
    words = [a for a in args if not a.startswith("-")]
    return " ".join(words)[:200]


def spawn(argv: list[str], env: dict[str, str]) -> int:
    """Run the agent in the foreground; forward signals; return its exit code (128+N when killed by signal N)."""
    try:
        proc = subprocess.Popen(argv, env=env)
    except OSError as e:  # not executable, a bad interpreter line, gone: the agent cannot be started (exit 8)
        raise AgentError(f"could not start {argv[0]}: {e.strerror or e}; reinstall it with "
                         f"`reef agents install --force`") from None

    def forward(signum: int, _frame: Any) -> None:
        if signum in TTY_SIGNALS and _foreground():
            return  # the terminal delivered it to the agent already (same process group)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (*FORWARDED, *TTY_SIGNALS)}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - code if code < 0 else code


def _foreground() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except OSError:
        return False


# --- entry points ------------------------------------------------------------------------------------------


def main(adapter_name: str, argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        adapter = get_adapter(adapter_name)
        if args and args[0] in SUBCOMMANDS:
            from reef_cli.wrapper_cmd import subcommands

            subcommands(adapter)(args=args, prog_name=adapter.command)
            return
        if args and args[0] == "--":
            args = args[1:]
        else:
            _refuse_near_miss(adapter, args)
        taken = {flag: _take_flag(args, flag) for flag in FLAGS}
        _refuse_unknown_flags(adapter, args)
        scenario = _last(taken["--reef-scenario"])
        outcome_flags = taken["--reef-outcome"]
        check = _last(taken["--reef-check"])
        provider = _last(taken["--reef-provider"])
        sys.exit(run_agent(adapter, args, scenario, outcome_flags=outcome_flags, check=check, provider=provider))
    except ReefError as e:
        sys.stderr.write(f"{'reef-' + adapter_name}: {e.message}\n")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


def _refuse_near_miss(adapter: Any, args: list[str]) -> None:
    """A first word one typo away from a wrapper subcommand (``reprot``) is refused, naming the subcommand: passed to
    the agent it would start a run that makes no request. ``--`` first sends it to the agent on purpose."""
    import difflib

    if not args or args[0].startswith("-") or args[0] in AGENT_WORDS:
        return
    near = difflib.get_close_matches(args[0].lower(), SUBCOMMANDS, n=1, cutoff=0.75)
    if near:
        raise BadRequest(f"{args[0]!r} is not a {adapter.command} subcommand; did you mean `{adapter.command} "
                         f"{near[0]}`? (to pass {args[0]!r} to {adapter.name} itself, put -- first: "
                         f"`{adapter.command} -- {args[0]}`)", param="subcommand")


def _refuse_unknown_flags(adapter: Any, args: list[str]) -> None:
    """A ``--reef-*`` flag the wrapper does not know (before a ``--``) is refused, naming the known ones: the agent
    would be started with it and fail, or ignore it."""
    import difflib

    end = args.index("--") if "--" in args else len(args)
    for a in args[:end]:
        if a.startswith("--reef-"):
            name = a.split("=", 1)[0]
            near = difflib.get_close_matches(name, FLAGS, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise BadRequest(f"unknown wrapper flag {name}{hint} ({adapter.command} takes {', '.join(FLAGS)}; to "
                             f"pass it to {adapter.name} itself, put it after --)", param=name)


def _last(values: list[str]) -> str | None:
    """The last of a flag's values (the one that counts), or None when it was not given."""
    return values[-1] if values else None


def _take_flag(args: list[str], name: str) -> list[str]:
    """Remove every ``name VALUE`` and ``name=VALUE`` of the wrapper's own from ``args`` (before a ``--`` only:
    what follows it is the agent's); their values, in order."""
    values, i = [], 0
    end = args.index("--") if "--" in args else len(args)
    while i < end:
        a = args[i]
        if a == name and i + 1 < end:
            values.append(args[i + 1])
            del args[i:i + 2]
            end -= 2
        elif a.startswith(name + "="):
            values.append(a.split("=", 1)[1])
            del args[i]
            end -= 1
        else:
            i += 1
    return values


def pi() -> None:
    main("pi")


def claude() -> None:
    main("claude")


def opencode() -> None:
    main("opencode")


def codex() -> None:
    main("codex")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
