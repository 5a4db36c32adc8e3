"""The wrappers' own subcommands: ``reef-pi report|runs|update|evolve|propose`` (the same for each adapter)."""

from __future__ import annotations

import time
from typing import Any

import typer

from adapters import Adapter
from daemon.errors import BadRequest, NotFound, ReefError
from reef_cli.common import ago, config, console, edge, print_json, score_problem
from reef_cli.runs import call_starting, list_runs, load_run, run_receipts, save_run


def subcommands(adapter: Adapter) -> Any:
    cmd = adapter.command
    app = typer.Typer(
        name=cmd,
        help=f"{cmd}: run {adapter.binary} through Reef. `{cmd} ARGS...` passes ARGS to {adapter.binary} unchanged; "
             f"`{cmd} -- report ...` sends the word `report` to {adapter.binary} itself.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_show_locals=False,
    )

    @app.command()
    @edge
    def report(
        score: float | None = typer.Option(None, "--score", help="A numeric score for the run (e.g. 0 or 1)."),
        feedback: str | None = typer.Option(None, "--feedback", help="What went right or wrong, in words."),
        run: str | None = typer.Option(None, "--run", help="The run to report on (default: the last one)."),
        no_train: bool = typer.Option(False, "--no-train", help="Keep this report out of training (stored and "
                                      "shown only)."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Attach one report (score and/or feedback) to every receipt of the last run (or --run ID)."""
        cfg = config()
        if score is None and feedback is None:
            raise BadRequest("give --score, --feedback, or both (nothing was reported)", param="score")
        if (why := score_problem(score)) is not None:
            raise BadRequest(why, param="score")
        rec = load_run(cfg, adapter, run)
        receipts = rec.get("receipts") or []
        if not receipts:  # the run's receipts were not stored (daemon unreachable then): ask again
            receipts = rec["receipts"] = run_receipts(lambda path: call_starting(cfg, "GET", path), rec["run"])
        if not receipts:
            raise NotFound(f"run {rec['run']} made no model requests; there is nothing to report on")
        body: dict[str, Any] = {"references": receipts, "scenario": rec["scenario"],
                                "metadata": {"run": rec["run"], "adapter": adapter.name,
                                             **({"training": {"eligible": False}} if no_train else {})}}
        if score is not None:
            body["score"] = score
        if feedback is not None:
            body["feedback"] = feedback
        stored = call_starting(cfg, "POST", "/reef/report", body)
        rec.setdefault("reports", []).append({"report_id": stored["report_id"], "score": score,
                                              "feedback": feedback, "at": time.time()})
        save_run(cfg, rec)
        if json_out:
            print_json(stored)
            return
        print(f"report {stored['report_id']} on {len(receipts)} receipt(s) of run {rec['run']}")
        _say_learning(stored.get("learning"), cmd)

    @app.command()
    @edge
    def runs(
        limit: int = typer.Option(20, "--limit", "-n", help="How many runs to show."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """List recent runs: time, prompt, receipts, score."""
        got = list_runs(config(), adapter)[:limit]
        if json_out:
            print_json(got)
            return
        if not got:
            print(f"no {cmd} runs yet")
            return
        from rich.table import Table

        table = Table("run", "when", "scenario", "prompt", "receipts", "exit", "score")
        for r in got:
            reports = r.get("reports") or []
            last = next((x["score"] for x in reversed(reports) if x.get("score") is not None), None)
            table.add_row(r["run"], ago(r.get("started_at")), r["scenario"], (r.get("prompt") or "")[:48],
                          str(len(r.get("receipts") or [])), str(r.get("exit_code")),
                          "-" if last is None else f"{last:g}")
        console().print(table)

    @app.command()
    @edge
    def update(
        scenario: str | None = typer.Option(None, "--reef-scenario", envvar="REEF_SCENARIO",
                                            help="Scenario (default: the adapter's name)."),
    ) -> None:
        """Install the scenario's current harness release into the agent's config home now."""
        from adapters.base import install_harness
        cfg = config()
        name = scenario or adapter.name
        start = call_starting(cfg, "POST", "/reef/runs", {"adapter": adapter.name, "scenario": name})
        if start.get("release_id") is None:
            print(f"scenario {name} releases weights; there is no harness to install")
            return
        home = adapter.home(cfg.homes_dir, name)
        result = install_harness(home, start["release_id"], {p: t.encode() for p, t in start["files"].items()})
        changed = len(result["written"]) + len(result["removed"])
        print(f"harness step {start['step']} ({start['release_id']}) of scenario {name} installed in {home}"
              f" ({changed} file(s) changed)")

    @app.command()
    @edge
    def evolve(
        instruction: str = typer.Argument(..., help="An instruction for the agent, e.g. 'always run the tests'."),
        skill: str | None = typer.Option(None, "--skill", help="Write it as a skill of this name, not a rule."),
        scenario: str | None = typer.Option(None, "--reef-scenario", envvar="REEF_SCENARIO",
                                            help="Scenario (default: the adapter's name)."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Teach the harness directly: the instruction becomes a rule (or a skill) in a new harness release."""
        cfg = config()
        name = scenario or adapter.name
        body: dict[str, Any] = {"instruction": instruction}
        if skill:
            body["skill"] = skill
        out = call_starting(cfg, "POST", f"/reef/scenarios/{name}/evolve", body)
        if json_out:
            print_json(out)
            return
        _say_learning(out, cmd)
        if out.get("verdict") == "rejected" or (out.get("refused") and not out.get("applied")):
            raise typer.Exit(2)

    @app.command()
    @edge
    def propose(
        reason: str = typer.Option(..., "--reason", help="Why the harness should change (required)."),
        add_rule: str | None = typer.Option(None, "--add-rule", help="Add this rule."),
        replace_rule: tuple[str, str] | None = typer.Option(None, "--replace-rule", metavar="ID RULE",
                                                            help="Replace rule ID (its id in brackets, or its whole text)."),
        retire_rule: str | None = typer.Option(None, "--retire-rule", metavar="ID",
                                               help="Retire rule ID (its id in brackets, or its whole text)."),
        add_skill: tuple[str, str] | None = typer.Option(None, "--add-skill", metavar="NAME TEXT",
                                                         help="Add a skill NAME whose SKILL.md says TEXT."),
        replace_skill: tuple[str, str] | None = typer.Option(None, "--replace-skill", metavar="NAME TEXT",
                                                             help="Replace skill NAME's SKILL.md with TEXT."),
        retire_skill: str | None = typer.Option(None, "--retire-skill", metavar="NAME", help="Retire skill NAME."),
        rule_id: str | None = typer.Option(None, "--id", help="With --add-rule: the new rule's id (a-z, 0-9, -)."),
        run: str | None = typer.Option(None, "--run", envvar="REEF_RUN",
                                       help="The run that proposes it (set for the agent by the wrapper)."),
        scenario: str | None = typer.Option(None, "--reef-scenario", envvar="REEF_SCENARIO",
                                            help="Scenario (default: the adapter's name)."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Propose a change to this agent's own harness (one rule or skill added, replaced or retired, with a
        reason): screened, then judged by the scenario's gate like any candidate; the verdict goes on the chain."""
        asked = [(op, kind, value) for op, kind, value in (
            ("add", "rule", add_rule), ("replace", "rule", replace_rule), ("retire", "rule", retire_rule),
            ("add", "skill", add_skill), ("replace", "skill", replace_skill), ("retire", "skill", retire_skill))
            if value is not None]
        if len(asked) != 1:
            raise ReefError("give exactly one of --add-rule, --replace-rule, --retire-rule, --add-skill, "
                            "--replace-skill, --retire-skill")
        op, kind, value = asked[0]
        if rule_id is not None and (op, kind) != ("add", "rule"):
            raise ReefError("--id goes with --add-rule only")
        body: dict[str, Any] = {"op": op, "kind": kind, "reason": reason}
        if isinstance(value, tuple):
            body["name"], body["text"] = value
        elif op == "retire":
            body["name"] = value
        else:
            body["text"] = value
            if rule_id is not None:
                body["name"] = rule_id
        if run:
            body["run"] = run
        name = scenario or adapter.name
        out = call_starting(config(), "POST", f"/reef/scenarios/{name}/proposals", body)
        if json_out:
            print_json(out)
        else:
            print(f"proposal {out.get('proposal')}: {op} {kind} on scenario {name}")
            _say_learning(out, cmd)
        if out.get("verdict") in ("rejected", "failed"):
            raise typer.Exit(2)

    @app.command("reef-help")
    def reef_help() -> None:
        """How the wrapper works and what it adds to the agent."""
        print(app.info.help)
        print(f"\nsubcommands: report, runs, update, evolve, propose; scenario: --reef-scenario NAME or REEF_SCENARIO;"
              "\nprovider: --reef-provider NAME or REEF_PROVIDER (anthropic, openai, ollama, ...: a real model);"
              f"\n`{cmd} -- ARGS` passes ARGS to {adapter.binary} even when the first is a subcommand name.")

    return app


def _refusal(r: Any) -> str:
    """One refused edit as a line, whatever its recipe put in it (lessons: text and reason; others: a reason, an
    answer, or only a string)."""
    if not isinstance(r, dict):
        return str(r)[:200]
    what = r.get("text") or r.get("answer") or r.get("id")
    reason = r.get("reason") or "no reason given"
    return f"{str(what)[:80]!r}: {reason}" if what else str(reason)


def _say_learning(outcome: Any, cmd: str) -> None:
    """What the learning step made of a report or an instruction, in a line or two; an outcome shaped in a way this
    does not know (another recipe's, a newer daemon's) prints what it has, never a traceback."""
    if not isinstance(outcome, dict):
        return
    refused = outcome.get("refused")
    for r in refused if isinstance(refused, list) else []:
        print(f"refused: {_refusal(r)}")
    verdict = outcome.get("verdict")
    if verdict == "accepted":
        print(f"harness: {outcome.get('summary')}; released step {outcome.get('step')} ({outcome.get('release_id')});"
              f" the next {cmd} run installs it")
    elif verdict == "pending":
        rel = outcome.get("release_id")
        print(f"harness: {outcome.get('summary')}; candidate {rel} is pending review (reef releases promote {rel})")
    elif verdict in ("unchanged", "skipped"):
        print(f"harness: unchanged ({outcome.get('summary')})")
    elif verdict == "rejected":
        print(f"harness: not released ({outcome.get('summary')})")
    elif verdict == "failed":
        print(f"harness: the learning step failed ({outcome.get('reason')})")
    elif verdict == "queued":  # a searching recipe (harness-search) runs its episodes in the background
        print(f"harness: {outcome.get('summary')}; `reef releases list` shows what it decides")
