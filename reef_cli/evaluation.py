"""``reef eval``: a scenario's release chain measured release by release (``daemon/evaluation.py``): the learning
curve (held-out reward), forgetting (probe accuracy against the base) and transfer (another scenario's held-out
prompts), as a table or ``--json``."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from daemon.errors import ReefError
from daemon.evaluation import cell
from reef_cli.common import client, console, edge, print_json

COLUMNS = ("reward", "probes", "forgetting", "transfer")


@edge
def command(
    scenario: str = typer.Option("default", "--scenario", "-s", help="The scenario (default: default)."),
    last: int | None = typer.Option(None, "--last", "-n", min=1, help="Only the last N releases (the base is "
                                    "measured all the same: forgetting is against it)."),
    transfer: str | None = typer.Option(None, "--transfer", "-t", help="Also measure each release on this other "
                                        "scenario's held-out (reserved recorded) prompts."),
    known: bool = typer.Option(False, "--known", help="Measure nothing: show what is recorded at the gate, cached "
                               "or reported, and say what needs measuring."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Evaluate a scenario's releases: held-out reward per release (the learning curve), probe accuracy against
    the base (forgetting) and, with --transfer, another scenario's held-out prompts. Figures recorded at the gate
    or measured before are read; the rest are measured by loading each release in the engine (progress on stderr).
    A figure that cannot be had says n/a, one whose measurement broke says failed: reason."""
    query = {"last": last, "transfer": transfer}
    with client() as c:
        if known:
            result = c.get(f"/reef/scenarios/{scenario}/eval", **query)
        else:
            result = _measure(c, scenario, query, quiet=json_out)
    if json_out:
        print_json(result)
        return
    render(result)


def _measure(c: Any, scenario: str, query: dict[str, Any], *, quiet: bool) -> dict[str, Any]:
    """POST the eval, showing its progress on stderr; the result."""
    result: dict[str, Any] | None = None
    for line in c.lines(f"/reef/scenarios/{scenario}/eval", method="POST", **query):
        item = json.loads(line)
        if "progress" in item:
            p = item["progress"]
            if not quiet:
                sys.stderr.write(f"measuring release {p['done'] + 1}/{p['total']} (step {p['step']}, "
                                 f"{p['release_id'][:12]}): {', '.join(p['measuring'])}\n")
        elif "error" in item:
            raise ReefError(item["error"].get("message") or "the evaluation failed")
        elif "result" in item:
            result = item["result"]
    if result is None:
        raise ReefError("the daemon ended the evaluation without a result")
    return result


def render(result: dict[str, Any]) -> None:
    """The table, oldest release first, then how each figure is had."""
    from rich.table import Table

    out = console()
    title = f"reef eval {result['scenario']} ({result['recipe']}, {result['kind']})"
    table = Table(box=None, header_style="bold", title=title, title_justify="left")
    for col in ("", "step", "release", "operation", *COLUMNS):
        table.add_column(col)
    for r in result["rows"]:
        mark = "*" if r.get("head") else ("b" if r["release_id"] == result["base"]["release_id"] else "")
        table.add_row(mark, str(r["step"]), r["release_id"][:12], r["operation"], cell(r["reward"]),
                      cell(r["probes"]), cell(r["forgetting"], signed=True),
                      cell(r["transfer"]) if result.get("transfer") else "-")
    out.print(table)
    base = result["base"]
    out.print(f"base: step {base['step']} ({base['release_id'][:12]}), probes {cell(base.get('probes'))}"
              + (f", transfer {cell(base.get('transfer'))}" if result.get("transfer") else ""), highlight=False)
    out.print(f"reward: {result['reward_how']}", highlight=False)
    out.print(f"probes: {result['probes_how']}; forgetting: probe accuracy minus the base's", highlight=False)
    if result.get("transfer"):
        out.print(f"transfer: {result['transfer_how']}", highlight=False)
    reasons = sorted({f"{k}: {r[k]['reason']}" for r in result["rows"] for k in COLUMNS
                      if r[k]["status"] == "n/a" and (k != "transfer" or result.get("transfer"))})
    for why in reasons:
        out.print(f"n/a {why}", highlight=False)
    out.print(f"{result['measured']} figure(s) measured, {result['cached']} from the cache, in "
              f"{result['seconds']:.1f} s; * the head, b the base", highlight=False)
