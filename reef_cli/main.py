"""The ``reef`` command: composes the command groups. Heavy imports happen inside commands."""

from __future__ import annotations

import typer
import typer.core
import typer.main

from reef_cli import agents, completions, daemon_cmd, demo, doctor, evaluation, model, records, releases, tui
from reef_cli.common import client, edge, print_json
from reef_cli.status import status_lines

# Plain (click-style) help: rich's help panels cost ~150 ms of start-up, over half of `reef --help`'s budget
# (bench/cli_startup.py). Errors are our own one-line messages either way.
typer.core.HAS_RICH = typer.main.HAS_RICH = False  # type: ignore[attr-defined]  # typer: a module flag it does not export

app = typer.Typer(
    name="reef",
    help="Reef: serve coding agents from a local daemon, record every exchange, learn from feedback.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"reef {version('reef')}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Reef: serve coding agents from a local daemon, record every exchange, learn from feedback."""


app.command("serve")(daemon_cmd.serve)
app.command("report")(records.report)
app.command("demo")(demo.demo)
app.command("tui")(tui.command)
app.command("doctor")(doctor.doctor)
app.command("eval")(evaluation.command)
app.add_typer(daemon_cmd.app, name="daemon")
app.add_typer(records.records_app, name="records")
app.add_typer(records.scenarios_app, name="scenarios")
app.add_typer(releases.app, name="releases")
app.add_typer(model.app, name="model")
app.add_typer(completions.app, name="completions")
app.add_typer(agents.app, name="agents")


@app.command()
@edge
def status(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show the daemon's status (starting it if needed): models, records, reports, scenarios."""
    with client() as c:
        info = c.get("/reef/status")
    if json_out:
        print_json(info)
        return
    print("\n".join(status_lines(info)))


def main() -> None:
    """Run ``reef``; usage errors too are one line on stderr (exit 2), like every other error."""
    import sys

    try:
        code = app(standalone_mode=False, prog_name="reef")
    except Exception as e:  # typer's usage errors (its private click fork): duck-typed on purpose
        if type(e).__name__ == "Abort":  # a prompt got end-of-input or Ctrl-C outside a command's own edge
            sys.stderr.write("reef: a confirmation was asked and got no answer; nothing was done (pass --yes)\n")
            sys.exit(2)
        exit_code = getattr(e, "exit_code", None)
        if not hasattr(e, "format_message") or not isinstance(exit_code, int):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # `reef` or `reef releases` alone: the help
            sys.stdout.write(e.format_message() + "\n")
        else:
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            sys.stderr.write(f"reef: {e.format_message()}{hint}\n")
        sys.exit(exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
