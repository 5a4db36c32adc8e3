"""``reef releases list|show|open|rollback|promote|bundle``: a scenario's release chain, read and steered."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from daemon.errors import Conflict
from daemon.gate import describe as gate_line  # the one reading of a gate's figures (the release page's too)
from daemon.gating.heldout import describe as heldout_line  # and of the held-out check's
from reef_cli.common import ago, client, config, console, edge, fail, print_json

app = typer.Typer(help="Inspect and steer release chains: list, show, open, rollback, promote, bundle.", no_args_is_help=True)

SCENARIO_HELP = "The scenario (default: default)."


def _short(release_id: str | None) -> str:
    return release_id[:12] if release_id else "-"


def _metrics(m: dict[str, Any] | None) -> str:
    if not m:
        return ""
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in list(m.items())[:4])


def _held(m: dict[str, Any]) -> str:
    """Why a pending release was held, when a check held it (the held-out check, the watchdog)."""
    why = m.get("heldout_reason") or m.get("watchdog")
    return f"{why}; " if why else ""


def _origin(origin: Any) -> str:
    """Where a candidate came from, in a few words (an agent's proposal: what, why, which run)."""
    if not isinstance(origin, dict) or origin.get("kind") != "proposal":
        return f"from {origin.get('kind') if isinstance(origin, dict) else origin}"
    run = f" in run {origin['run']}" if origin.get("run") else ""
    return f"agent proposal{run}: {origin.get('op')} {origin.get('target')} ({str(origin.get('reason'))[:80]})"


def _which_scenario(c: Any) -> str:
    """``reef releases list`` without ``-s``: ``default`` where it exists, else the only scenario there is (said on
    stderr); with several and no ``default``, a refusal that lists them (a wrapper user's are pi, claude...)."""
    names = [s["name"] for s in c.get("/reef/scenarios")["scenarios"] if not s.get("archived")]
    if "default" in names:
        return "default"
    if len(names) == 1:
        sys.stderr.write(f"reef: no -s given: scenario {names[0]}, the only one\n")
        return str(names[0])
    if not names:
        fail("there are no scenarios yet: a first request through Reef (or reef-pi, reef-claude...) makes one", 2)
    fail(f"there is no scenario named 'default': give -s NAME, one of {', '.join(sorted(names))}", 2)
    raise AssertionError  # fail() exits


@app.command("list")
@edge
def list_releases(
    scenario: str | None = typer.Option(None, "--scenario", "-s", help="The scenario (default: default, or the only one "
                                 "there is)."),
    all_: bool = typer.Option(False, "--all", help="Also show pending releases and steps not published (rejected, "
                              "skipped, failed)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List a scenario's releases, newest first, the head marked."""
    with client() as c:
        scenario = scenario or _which_scenario(c)
        data = c.get(f"/reef/scenarios/{scenario}/releases", all="1" if all_ else None)
    if json_out:
        print_json(data)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("", "release", "step", "operation", "content", "when", "metrics", "note"):
        table.add_column(col)
    for r in data["releases"]:
        note = f"restores {_short(r.get('source'))}" if r.get("source") else ""
        if r.get("trained_on_forgotten"):
            note = (note + "; " if note else "") + "trained on forgotten data"
        if r.get("origin"):
            note = (note + "; " if note else "") + _origin(r["origin"])
        if r.get("weights_pruned"):
            note = (note + "; " if note else "") + "weights pruned (retention)"
        table.add_row("*" if r["release_id"] == data["head"] else "", _short(r["release_id"]), str(r["step"]),
                      r["operation"], _short(r["content_id"]), ago(r.get("created_at")), _metrics(r.get("metrics")),
                      note)
    for r in data.get("pending", []):
        table.add_row("?", _short(r["release_id"]), str(r["step"]), "pending", _short(r["content_id"]),
                      ago(r.get("created_at")), _metrics(r.get("metrics")), _held(r.get("metrics") or {})
                      + "reef releases promote to publish" + (f"; {_origin(r['origin'])}" if r.get("origin") else ""))
    for r in data.get("rejected", []):
        table.add_row("x", "-", str(r.get("step", "-")), str(r.get("verdict") or "rejected"), "-", ago(r.get("created_at")),
                      _metrics(r.get("metrics")), r.get("reason", "")
                      + (f"; {_origin(r['origin'])}" if r.get("origin") else ""))
    out = console()
    out.print(f"scenario [cyan]{scenario}[/]  head {_short(data['head'])}")
    out.print(table)
    canary = data.get("canary")
    if canary:  # its lines as the daemon words them (daemon/canary.describe)
        for line in canary["lines"]:
            out.print(line, markup=False, soft_wrap=True)
        out.print("  reef releases canary-end [--promote] ends it by hand", markup=False)
    if (data.get("forgotten") or {}).get("command"):
        out.print(f"the head was trained on forgotten data; the newest release that was not: "
                  f"{data['forgotten']['command']}", markup=False)


@app.command("show")
@edge
def show_release(
    release_id: str = typer.Argument(..., help="The release id (a prefix of at least 7 characters works)."),
    diff: bool = typer.Option(False, "--diff", help="Show the diff to its parent."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show one release: manifest, whether its weights were pruned, what it requires (each item met or not on this
    machine, with what was found), metrics, receipts, and optionally its diff to the parent."""
    with client() as c:
        rel = c.get(f"/reef/releases/{release_id}", diff="1" if diff else None)
    if json_out:
        print_json(rel)
        return
    out = console()
    out.print(f"[bold]{rel['release_id']}[/]  scenario [cyan]{rel['scenario']}[/]  step {rel['step']}  "
              f"{rel['operation']}  {rel['kind']}")
    out.print(f"content {rel['content_id']}  parent {_short(rel.get('parent'))}  recipe {rel.get('recipe')}  "
              f"{ago(rel.get('created_at'))}")
    if rel.get("source"):
        out.print(f"restores {rel['source']}")
    if rel.get("adapter"):
        out.print(f"LoRA adapter on base {rel['adapter']['base_content_id']} "
                  f"(release {_short(rel['adapter']['base_release_id'])})")
    if rel.get("weights_pruned"):  # the scenario's retention policy pruned them (daemon/retention.py)
        out.print(f"weights pruned by the retention policy: {', '.join(rel['weights_pruned'])}; the release stays on "
                  "the chain but cannot serve or be rolled back to", markup=False)
    for check in rel.get("requirements") or []:  # what it needs to run, checked on the daemon's machine now
        out.print(f"requires {check['item']}: {'met' if check['met'] else 'NOT MET'} ({check['found']})",
                  markup=False)
    m = rel.get("metrics") or {}
    for line in (gate_line(m), heldout_line(m)):
        if line:
            out.print(line, markup=False)
    if m:
        out.print("metrics " + json.dumps(m))
    fed = rel.get("receipts") or []  # a harness release lists the reports it learned from; a weights one, exchanges
    reports, exchanges = [i for i in fed if i.startswith("rep_")], [i for i in fed if not i.startswith("rep_")]
    for label, ids in (("reports", reports), ("receipts", exchanges)):
        if ids or label == "receipts" and not reports:
            out.print(f"{label} {len(ids)}" + (": " + ", ".join(ids[:10]) if ids else ""))
    if diff:
        _print_diff(out, rel.get("diff") or {})


@app.command("open")
@edge
def open_page(
    release_id: str = typer.Argument(..., help="The release id (a prefix of at least 7 characters works)."),
    scenario: str | None = typer.Option(None, "--scenario", "-s", help="Refuse a release of another scenario."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Where to write the page (default: "
                                    "$REEF_HOME/pages/<release>.html)."),
    no_browser: bool = typer.Option(False, "--no-browser", help="Write the page and print its path; open nothing "
                                    "(headless machines, scripts)."),
) -> None:
    """Open a release's page in the browser: why it was made, what changed, the gate's verdict, its place on the
    chain with a plot of the scenario's scores. The page is one self-contained HTML file (no script, nothing fetched)."""
    path = f"/reef/scenarios/{scenario}/releases/{release_id}/page" if scenario else f"/reef/releases/{release_id}/page"
    cfg = config()
    with client() as c:
        resp = c.request("GET", path, raw=True)
    full_id = resp.headers.get("x-reef-release-id") or release_id
    dest = out if out is not None else cfg.home / "pages" / f"{full_id}.html"
    try:
        dest = save_page(dest, resp.content)
    except OSError as e:
        fail(f"cannot write the page to {dest}: {e.strerror or e}", 1)
    print(dest)
    if no_browser:
        return
    if not to_browser(dest):
        fail(f"no browser could be started; the page is at {dest} (--no-browser only writes it)", 1)


def save_page(dest: Path, content: bytes) -> Path:
    """Write a release's page (``reef releases open``, the TUI's ``o``) where only its user reads it (feedback and
    diffs are the user's data); its absolute path. ``OSError`` when it cannot be written."""
    from daemon.durable import mkdirs, write_atomic

    mkdirs(dest.parent)
    write_atomic(dest, content, mode=0o600)
    return dest.resolve()


def to_browser(page: Path) -> bool:
    """Hand a written page's URL to the browser (``$BROWSER``, as Python's webbrowser reads it); False when none
    could be started."""
    import webbrowser

    return bool(webbrowser.open(page.as_uri()))


def _print_diff(out: Any, diff: dict[str, Any]) -> None:
    base = diff.get("base")
    out.rule(f"diff to {_short(base)}" if base else "diff (first release: everything is new)")
    for f in diff.get("files", []):
        sign = {"added": "[green]+[/]", "removed": "[red]-[/]"}.get(f["status"], "[yellow]~[/]")
        out.print(f"{sign} {f['path']} ({f['kind']}, {f['status']})")
        if f["kind"] == "safetensors":
            for t in f.get("tensors", []):
                if t.get("status") == "unchanged":
                    continue
                if t.get("status") == "added":
                    out.print(f"    {t['name']}: added |w| {t.get('norm') or 0:.4g}")
                    continue
                out.print(f"    {t['name']}: {t.get('status', 'changed')} |Δ| {t.get('diff_norm') or 0:.4g}"
                          f" (|w| {t.get('old_norm') or 0:.4g})")
            if f.get("unchanged_tensors"):
                out.print(f"    {f['unchanged_tensors']} tensors unchanged")
        elif f.get("diff"):
            out.print(f["diff"], markup=False, highlight=False)


def _publish(c: Any, scenario: str, op: str, body: dict[str, Any], yes: bool) -> dict[str, Any]:
    """After a person's yes (or ``--yes``), ``POST /reef/scenarios/{scenario}/{op}``: a compare-and-swap against the
    head they were shown, so a head that moved meanwhile changes nothing and says so."""
    if not yes and not typer.confirm("go ahead?", default=False):
        fail("nothing changed", 1)
    try:
        return dict(c.post(f"/reef/scenarios/{scenario}/{op}", body))
    except Conflict as e:
        if "actual_head" not in e.data:
            raise
        fail(f"the head of {scenario} moved meanwhile (now {_short(e.data['actual_head'])}); nothing changed",
             e.exit_code)


def _steer(op: str, scenario: str, release_id: str, yes: bool, json_out: bool) -> None:
    with client() as c:
        chain = c.get(f"/reef/scenarios/{scenario}/releases", all="1")
        target = c.get(f"/reef/releases/{release_id}", diff="0")
        head = chain["head"]
        current = next((r for r in chain["releases"] if r["release_id"] == head), None)
        out = console()
        if not json_out:
            out.print(f"{op} of scenario [cyan]{scenario}[/]:")
            out.print(f"  from head {_short(head)} (step {current['step'] if current else '-'}, "
                      f"content {_short(current['content_id'] if current else None)})")
            out.print(f"  to   {_short(target['release_id'])} (step {target['step']}, "
                      f"content {_short(target['content_id'])}), published as a new release")
            if current and current["content_id"] == target["content_id"]:
                out.print("  the content is the same as the head's")
        rel = _publish(c, scenario, op, {"release_id": target["release_id"], "expected_head": head}, yes)
    if json_out:
        print_json(rel)
    else:
        print(f"published {rel['release_id'][:12]} (step {rel['step']}, {rel['operation']}); it serves new requests now")


@app.command("canary")
@edge
def canary(
    release_id: str = typer.Argument(..., help="A candidate held for review (reef releases list --all)."),
    scenario: str = typer.Option("default", "--scenario", "-s", help=SCENARIO_HELP),
    share: float = typer.Option(0.2, "--share", help="The share of new runs it serves (0 to 1)."),
    alpha: float = typer.Option(0.05, "--alpha", help="The decision's error rate."),
    max_reports: int = typer.Option(400, "--max-reports", help="Reports per arm after which a tie ends it."),
    max_error_rate: float = typer.Option(0.2, "--max-error-rate", help="The share of failed exchanges that ends it."),
    max_latency_ratio: float = typer.Option(2.0, "--max-latency-ratio",
                                            help="Ends it when its median time to first token or per output token "
                                                 "is this many times the head's."),
    max_empty_excess: float = typer.Option(0.3, "--max-empty-excess",
                                           help="Ends it when its share of empty answers exceeds the head's by this."),
    min_length_ratio: float = typer.Option(0.25, "--min-length-ratio",
                                           help="Ends it when its median answer is shorter than this share of the "
                                                "head's."),
    max_loop_excess: float = typer.Option(0.3, "--max-loop-excess",
                                          help="Ends it when its share of answers that loop (a run of tokens said "
                                               "again and again) exceeds the head's by this."),
    min_exchanges: int = typer.Option(20, "--min-exchanges",
                                      help="Exchanges on each arm before the error and latency bounds apply."),
    guard_answers: int = typer.Option(10, "--guard-answers",
                                      help="Answers on each arm before the empty, short and looping answer bounds "
                                           "apply."),
    max_answers: int = typer.Option(None, "--max-answers",
                                    help="Promotes it on its guards after this many answers on its arm if no report "
                                         "came (default: off)."),
    max_hours: float = typer.Option(None, "--max-hours",
                                    help="Promotes it when still undecided after this many hours (default: off)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Serve a held candidate to a share of new runs beside the head; live scores promote or end it (an always-
    valid test at the stated error rate), or end it when it fails too often or is too slow."""
    body = {"release_id": release_id, "share": share, "alpha": alpha, "max_reports": max_reports,
            "max_error_rate": max_error_rate, "max_latency_ratio": max_latency_ratio,
            "max_empty_excess": max_empty_excess, "min_length_ratio": min_length_ratio,
            "max_loop_excess": max_loop_excess, "min_exchanges": min_exchanges, "guard_answers": guard_answers}
    if max_answers is not None:  # the bounds are off unless given (a learning canary has its recipe's)
        body["max_answers"] = max_answers
    if max_hours is not None:
        body["max_hours"] = max_hours
    with client() as c:
        row = c.post(f"/reef/scenarios/{scenario}/canary", body)
    if json_out:
        print_json(row)
    else:
        print(f"canary {row['release_id'][:12]} serves {row['share']:.0%} of new runs of {scenario} beside "
              f"{row['base_id'][:12]}; reef releases list -s {scenario} shows how it does")


@app.command("canary-end")
@edge
def canary_end(
    scenario: str = typer.Option("default", "--scenario", "-s", help=SCENARIO_HELP),
    promote_it: bool = typer.Option(False, "--promote", help="Publish the canary as the new head (default: discard "
                                    "it, the head stays)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """End a scenario's canary by hand, now: promote it or discard it (written on the chain either way)."""
    if not yes and not typer.confirm(f"{'promote' if promote_it else 'end'} the canary of {scenario}?",
                                     default=False):
        fail("nothing changed", 1)
    with client() as c:
        out = c.post(f"/reef/scenarios/{scenario}/canary/end", {"promote": promote_it})
    if json_out:
        print_json(out)
    elif out.get("release_id"):
        print(f"canary {out['candidate'][:12]} promoted: release {out['release_id'][:12]} (step {out['step']})")
    else:
        print(f"canary {out['candidate'][:12]} ended; the head stays")


@app.command("rollback")
@edge
def rollback(
    release_id: str = typer.Argument(..., help="The release to restore."),
    scenario: str = typer.Option("default", "--scenario", "-s", help=SCENARIO_HELP),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Publish an earlier release's content as the new head (history is kept)."""
    _steer("rollback", scenario, release_id, yes, json_out)


@app.command("promote")
@edge
def promote(
    release_id: str = typer.Argument(..., help="The pending release to publish."),
    scenario: str = typer.Option("default", "--scenario", "-s", help=SCENARIO_HELP),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Publish a release held as pending (by a review gate)."""
    _steer("promote", scenario, release_id, yes, json_out)


@app.command("bundle")
@edge
def bundle(
    weights: str = typer.Option(..., "--weights", help="A weights release holding a LoRA adapter (another "
                                "scenario's, trained on this scenario's model)."),
    harness: str = typer.Option(..., "--harness", help="A harness release (a lessons or harness-search scenario's)."),
    scenario: str = typer.Option("default", "--scenario", "-s", help="The scenario to publish on: one that serves a "
                                 "local model and does not train (recipe record)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Publish one release holding an adapter, a harness and the evidence for both: requests get the adapter,
    wrapped agents the harness, and a rollback moves both."""
    with client() as c:
        head = c.get(f"/reef/scenarios/{scenario}/releases")["head"]
        parts = {role: c.get(f"/reef/releases/{rid}", diff="0") for role, rid in (("weights", weights),
                                                                                ("harness", harness))}
        if not json_out:
            out = console()
            out.print(f"bundle on scenario [cyan]{scenario}[/] (head {_short(head)}):")
            for role, rel in parts.items():
                out.print(f"  {role:8s} {_short(rel['release_id'])} (step {rel['step']} of {rel['scenario']}, "
                          f"{rel['recipe']}) {_metrics(rel.get('metrics'))}")
        rel = _publish(c, scenario, "bundle", {"weights": parts["weights"]["release_id"],
                                               "harness": parts["harness"]["release_id"], "expected_head": head}, yes)
    if json_out:
        print_json(rel)
    else:
        print(f"published {rel['release_id'][:12]} (step {rel['step']}, bundle); requests get its adapter and "
              "wrapped agents its harness now")
