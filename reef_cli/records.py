"""``reef records list|show``, ``reef report``, ``reef scenarios list|show|create|proposals`` and ``reef scenarios
tasks``."""

from __future__ import annotations

import json
from typing import Any

import typer

from reef_cli.common import ago, client, console, edge, fail, print_json, score_problem

records_app = typer.Typer(help="Browse recorded exchanges and their reports.", no_args_is_help=True)
scenarios_app = typer.Typer(help="List, show and create scenarios.", no_args_is_help=True)


@records_app.command("list")
@edge
def list_records(
    scenario: str = typer.Option(None, "--scenario", "-s", help="Only this scenario."),
    run: str = typer.Option(None, "--run", "-r", help="Only this run."),
    limit: int = typer.Option(20, "--limit", "-n", help="How many (newest first)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List recent records, newest first."""
    with client() as c:
        data = c.get("/reef/records", scenario=scenario, run=run, limit=limit, order="desc", kind="exchange")
    recs = data["records"]
    if json_out:
        print_json(recs)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("receipt", "scenario", "run", "model", "status", "when", "ms", "tokens", "score"):
        table.add_column(col)
    for r in recs:
        timings, usage = r.get("timings") or {}, r.get("usage") or {}
        table.add_row(
            r["id"], r["scenario"], r.get("run") or "-", r.get("model") or "-", str(r["status"]).replace("_", " "),
            ago(r["created_at"]),
            f"{timings.get('total_ms', 0):.0f}", _tokens(usage),
            "-" if r.get("score") is None else f"{r['score']:g}",
        )
    console().print(table)


def _tokens(usage: dict[str, Any]) -> str:
    """An exchange's output tokens for a listing: ``unknown`` where its provider sent no usage (never a 0)."""
    if not usage:
        return "-"
    n = usage.get("output_tokens")
    return "unknown" if n is None else str(n)


@records_app.command("show")
@edge
def show_record(
    receipt: str = typer.Argument(..., help="The receipt (record id)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show one record: request, response, timings and its reports."""
    with client() as c:
        rec = c.get(f"/reef/records/{receipt}")
    if json_out:
        print_json(rec)
        return
    out = console()
    out.print(f"[bold]{rec['id']}[/]  {rec['kind']}  scenario [cyan]{rec['scenario']}[/]  run {rec.get('run') or '-'}")
    out.print(f"status {str(rec['status']).replace('_', ' ')}  format {rec.get('format')}  engine {rec.get('engine')}  model {rec.get('model')}")
    out.print(f"release {rec.get('release_id') or '-'}  load {rec.get('runtime_load_id') or '-'}  {ago(rec['created_at'])}")
    if rec.get("forgotten_at"):
        what = "request, answer and token ids" if rec["kind"] == "exchange" else "feedback and metadata"
        out.print(f"[bold]forgotten[/] {ago(rec['forgotten_at'])}: its {what} were deleted (reef records forget); "
                  "what stays is this tombstone" + (f", content_hash {rec['content_hash']}"
                                                    if rec.get("content_hash") else ""))
    if rec.get("timings"):
        out.print("timings " + ", ".join(f"{k} {v}" for k, v in rec["timings"].items()))
    if rec.get("usage"):
        usage = rec["usage"]
        if usage.get("unknown"):
            out.print(f"usage unknown ({usage['unknown']})")
        else:
            out.print("usage " + json.dumps(usage))
        if usage.get("tools_dropped"):
            out.print(f"[yellow]tools dropped[/]: the request sent {usage['tools_dropped']} tool(s); the model's "
                      "chat template left them out, so the model never saw them")
    if rec.get("request") is not None:
        out.rule("request")
        out.print_json(json.dumps(rec["request"])[:20000])
    if rec.get("response") is not None:
        out.rule("response")
        out.print_json(json.dumps(rec["response"])[:20000])
    if rec.get("report") is not None:
        out.rule("report")
        out.print_json(json.dumps(rec["report"]))
    out.rule(f"reports ({len(rec.get('reports', []))})")
    for rep in rec.get("reports", []):
        r = rep.get("report") or {}
        metadata = r.get("metadata")
        meta = metadata if isinstance(metadata, dict) else {}
        source = f"  ({meta['source']}: {meta.get('judge', '?')})" if meta.get("source") else ""
        out.print(f"{rep['id']}  score {r.get('score')}  feedback {r.get('feedback')!r}{source}  {ago(rep['created_at'])}")


EXPORT_BATCH = 1000  # lines per Parquet row group and per import request


def parquet_missing() -> str | None:
    """Why ``--format parquet`` cannot run here (None: it can): pyarrow, a dependency of Reef since December 2026,
    missing from an older install; the message names the install command for the Python that runs Reef."""
    import sys

    try:
        import pyarrow  # type: ignore[import-untyped]  # noqa: F401  # pyarrow ships no type information
    except ImportError:
        import shlex

        return (f"--format parquet needs pyarrow, which this install of Reef lacks: "
                f"{shlex.quote(sys.executable)} -m pip install 'pyarrow>=17' (or run Reef's install.sh again)")
    return None


@records_app.command("export")
@edge
def export(
    out: str = typer.Option("-", "--output", "-o", help="The file to write (default: standard output, JSON Lines)."),
    scenario: str = typer.Option(None, "--scenario", "-s", help="Only this scenario's exchanges."),
    since: float = typer.Option(None, "--since", help="Only exchanges since this time (seconds since the epoch)."),
    fmt: str = typer.Option("jsonl", "--format", help="jsonl or parquet."),
    shape: str = typer.Option("prompt-completion", "--shape", help="prompt-completion (prompt and completion "
                              "message lists) or messages (one list): TRL's conversational shapes."),
) -> None:
    """Write exchanges with their reports in the shapes TRL documents (prompt/completion or messages as lists of
    messages, numeric score, label where scored, a tools column, token ids and log-probs where recorded), streamed:
    any number of records. ``datasets.load_dataset`` reads either file as it is."""
    import sys

    from daemon.export_files import SHAPES, as_shape

    if fmt not in ("jsonl", "parquet"):
        fail(f"--format is jsonl or parquet, not {fmt!r}", 2)
    if shape not in SHAPES:
        fail(f"--shape is {' or '.join(SHAPES)}, not {shape!r}", 2)
    if fmt == "parquet":
        if out == "-":
            fail("--format parquet writes a file: give --output FILE", 2)
        if (why := parquet_missing()) is not None:
            fail(why, 2)
    n = 0
    with client() as c:
        lines = c.lines("/reef/records/export", scenario=scenario, since=since)
        if fmt == "jsonl":
            sink = sys.stdout if out == "-" else open(out, "w", encoding="utf-8")  # noqa: SIM115
            try:
                for line in lines:
                    if shape != "prompt-completion":
                        line = json.dumps(as_shape(json.loads(line), shape), ensure_ascii=False,
                                          separators=(",", ":"))
                    sink.write(line + "\n")
                    n += 1
            finally:
                if sink is not sys.stdout:
                    sink.close()
        else:
            n = _write_parquet(lines, out, shape)
    if out != "-":
        print(f"wrote {n} exchange(s) to {out}")


def _write_parquet(lines: Any, out: str, shape: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    from daemon.export_files import as_shape, parquet_row, parquet_schema

    schema = parquet_schema(pa, shape)
    writer, batch, n = None, [], 0
    try:
        for line in lines:
            batch.append(parquet_row(as_shape(json.loads(line), shape)))
            if len(batch) == EXPORT_BATCH:
                writer = _parquet_rows(pa, pq, schema, writer, batch, out)
                n, batch = n + len(batch), []
        if batch or writer is None:
            writer = _parquet_rows(pa, pq, schema, writer, batch, out)
            n += len(batch)
    finally:
        if writer is not None:
            writer.close()
    return n


def _parquet_rows(pa: Any, pq: Any, schema: Any, writer: Any, rows: list[dict[str, Any]], out: str) -> Any:
    table = pa.Table.from_pylist(rows, schema=schema)
    if writer is None:
        writer = pq.ParquetWriter(out, schema)
    writer.write_table(table)
    return writer


@records_app.command("import")
@edge
def import_records(
    path: str = typer.Argument(..., help="A JSON Lines file of exchanges (the export shape; prompt and completion "
                               "required)."),
    scenario: str = typer.Option("imported", "--scenario", "-s", help="Scenario for lines that name none."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Bring existing traces in as exchanges (with a report where a line has a score or feedback): idempotent by
    id, each batch of lines stored whole or not at all; malformed lines are refused with their numbers and
    nothing is imported."""
    from daemon.errors import ReefError
    from daemon.export import from_line

    items, bad = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                from_line(item, f"line {number}", scenario)
            except ValueError as e:
                bad.append(f"line {number}: not JSON ({e.args[0] if e.args else e})")
                continue
            except ReefError as e:
                bad.append(e.message)
                continue
            items.append((number, item))
    if bad:
        fail(f"{len(bad)} malformed line(s) in {path}, nothing imported:\n  " + "\n  ".join(bad[:20])
             + ("\n  ..." if len(bad) > 20 else ""), 2)
    totals = {"imported": 0, "skipped": 0, "reports": 0, "tokens_dropped": 0}
    with client() as c:
        for i in range(0, len(items), EXPORT_BATCH):
            chunk = items[i:i + EXPORT_BATCH]
            got = c.post("/reef/records/import", {"items": [it for _, it in chunk], "scenario": scenario,
                                                  "first_line": chunk[0][0]})
            for key in totals:
                totals[key] += got.get(key, 0)
    if json_out:
        print_json(totals)
    else:
        print(f"imported {totals['imported']} exchange(s) ({totals['skipped']} already there), "
              f"{totals['reports']} report(s)")
        if totals["tokens_dropped"]:
            print(f"{totals['tokens_dropped']} exchange(s) came from another model than their scenario's: their "
                  "text was kept, their token ids were not (weights recipes learn only from the scenario's own "
                  "model's tokens)")


@records_app.command("forget")
@edge
def forget(
    ids: list[str] = typer.Argument(..., help="Receipts (rec_...) and runs to forget: each run's exchanges all go."),
    scrub: bool = typer.Option(False, "--scrub", help="PostgreSQL: also rewrite the records table (VACUUM FULL, "
                               "which locks it while it runs) so the old bytes leave its files."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Delete the prompts, answers and feedback of these exchanges for good, with every copy under the state dir
    (the runs' files, what the agents wrote during them, release pages). A tombstone stays (ids, times, a hash of
    what was deleted); releases made from them are marked, and cannot unlearn them: roll back to undo."""
    receipts = [i for i in ids if i.startswith("rec_")]
    runs = [i for i in ids if not i.startswith("rec_")]
    if not yes and not typer.confirm(f"forget {len(receipts)} receipt(s) and every exchange of {len(runs)} run(s)? "
                                     "this cannot be undone", default=False):
        fail("nothing forgotten", 1)
    with client() as c:
        out = c.post("/reef/records/forget", {"receipts": receipts, "runs": runs, "scrub": scrub})
    if json_out:
        print_json(out)
        return
    print(f"forgot {len(out['forgotten'])} exchange(s) and the feedback of {out['reports']} report(s)"
          + (f" ({len(out['already'])} forgotten before)" if out["already"] else ""))
    if out["remains"]:
        print(out["remains"])
    copies = out.get("copies") or {}
    if any(copies.values()):
        print(f"removed under the state dir: {copies.get('runs', 0)} run file(s), {copies.get('agent_files', 0)} "
              f"file(s) the agents wrote in those runs, {copies.get('pages', 0)} release page(s)")
    for scenario, view in out["releases"].items():
        marked = view["trained_on_forgotten"]
        if marked:
            print(f"scenario {scenario}: {len(marked)} release(s) were trained on forgotten data (weights cannot "
                  "unlearn it; a harness keeps the text it learned)")
            if view.get("command"):
                print(f"  the newest release that was not: {view['command']}")


@edge
def report(
    receipts: list[str] = typer.Argument(..., help="One or more receipts to report on."),
    score: float = typer.Option(None, "--score", help="A numeric score (finite)."),
    feedback: str = typer.Option(None, "--feedback", "-f", help="Written feedback."),
    metadata: str = typer.Option(None, "--metadata", help="A JSON object stored with the report."),
    report_id: str = typer.Option(None, "--report-id", help="Makes retries idempotent."),
    no_train: bool = typer.Option(False, "--no-train", help="Keep this report out of training (stored and shown, "
                                  "metadata.training.eligible = false)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Attach a report (score and/or feedback) to receipts."""
    if (why := score_problem(score)) is not None:
        fail(why, 2)
    body: dict[str, Any] = {"references": receipts}
    if score is not None:
        body["score"] = score
    if feedback is not None:
        body["feedback"] = feedback
    if metadata is not None:
        try:
            body["metadata"] = json.loads(metadata)
        except ValueError as e:
            fail(f"--metadata is not valid JSON: {e}", 2)
    if no_train:
        if not isinstance(body.setdefault("metadata", {}), dict):
            fail("--metadata must be a JSON object with --no-train", 2)
        body["metadata"]["training"] = {"eligible": False}
    if report_id is not None:
        body["report_id"] = report_id
    with client() as c:
        rep = c.post("/reef/report", body)
    if json_out:
        print_json(rep)
    else:
        print(f"report {rep['report_id']} stored on {len(rep['references'])} receipt(s) in scenario {rep['scenario']}")


@scenarios_app.command("list")
@edge
def list_scenarios(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List scenarios with their recipe, records, reports and mean recent score."""
    with client() as c:
        scenarios = c.get("/reef/scenarios")["scenarios"]
    if json_out:
        print_json(scenarios)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("scenario", "recipe", "model", "records", "reports", "mean score", "created"):
        table.add_column(col)
    for s in scenarios:
        mean = "-" if s.get("mean_score") is None else f"{s['mean_score']:.3g}"
        table.add_row(s["name"], s["recipe"], s["model"], str(s["records"]), str(s["reports"]), mean,
                      ago(s["created_at"]))
    console().print(table)


@scenarios_app.command("show")
@edge
def show_scenario(
    name: str = typer.Argument(..., help="The scenario."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show one scenario."""
    with client() as c:
        s = c.get(f"/reef/scenarios/{name}")
    if json_out:
        print_json(s)
        return
    for key in ("name", "recipe", "model", "records", "serve_only", "reports", "mean_score"):
        print(f"{key:11} {s.get(key)}")
    print(f"{'capture':11} {'on' if s.get('capture', True) else 'off (serve-only: never trained on)'}")
    print(f"{'learning':11} {'paused (reef scenarios resume ' + name + ')' if s.get('paused') else 'on'}")
    if s.get("warning"):  # the early warning (daemon/gating/warning.py)
        print(f"{'warning':11} {s['warning'].get('reason')}")
    if s.get("archived"):
        print(f"{'archived':11} yes: neither served nor trained (reef scenarios unarchive {name})")
    print(f"{'created':11} {ago(s['created_at'])}")
    left = s.get("left_out")
    if left and left.get("total"):  # scored answers a weight recipe cannot train on, by the setting that was off
        counts = ", ".join(f"{n} by {k}" for k, n in sorted(left["sampling"].items()))
        print(f"{'left out':11} {left['total']} scored answers ({counts}): {left['why']}")
    for key, value in (s.get("recipe_status") or {}).items():  # the recipe's own summary (ttt-discover's best)
        print(f"{key:11} {value}")
    effective = s.get("effective_settings") or {}
    if effective:  # what the scenario actually gets: the settings it was given and every default
        given = s.get("settings") or {}
        print("settings    (* set for this scenario; the rest are the recipe's defaults)")
        for key, value in sorted(effective.items()):
            print(f"  {'*' if key in given else ' '} {key:24} {json.dumps(value)}")


@scenarios_app.command("create")
@edge
def create_scenario(
    name: str = typer.Argument(..., help="The new scenario's name."),
    recipe: str = typer.Option(None, "--recipe", help="Learning recipe (default from config)."),
    model: str = typer.Option(None, "--model", help="Model to serve it (default from config)."),
    capture: bool = typer.Option(None, "--capture/--serve-only", help="Serve-only: its exchanges get receipts "
                                 "and are recorded, and are never trained on."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Create a scenario bound to a recipe and a model (a no-op if it exists with the same recipe)."""
    body: dict[str, Any] = {"name": name}
    if capture is not None:
        body["capture"] = capture
    if recipe:
        body["recipe"] = recipe
    if model:
        body["model"] = model
    with client() as c:
        s = c.post("/reef/scenarios", body)
    if json_out:
        print_json(s)
    else:
        print(f"scenario {s['name']} (recipe {s['recipe']}, model {s['model']})")


@scenarios_app.command("set-model")
@edge
def set_model(
    name: str = typer.Argument(..., help="The scenario."),
    model: str = typer.Argument(..., help="A configured model's name."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Serve a scenario from another model. Its chain must hold no weights (a wrapped agent's harness scenario, or
    records only): a weights chain was trained on its model and is refused (exit 5)."""
    with client() as c:
        s = c.post(f"/reef/scenarios/{name}/model", {"model": model})
    if json_out:
        print_json(s)
    else:
        print(f"scenario {s['name']}: model {s['previous_model']} -> {s['model']}")


@scenarios_app.command("proposals")
@edge
def list_proposals(
    name: str = typer.Argument(..., help="The scenario."),
    limit: int = typer.Option(50, "--limit", "-n", help="How many (newest first)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the harness changes agents proposed for a scenario (reef-pi propose), newest first, with each verdict:
    admitted as a release, held for review, screened out, rejected by the gate (its figures), failed, pending."""
    with client() as c:
        data = c.get(f"/reef/scenarios/{name}/proposals", limit=limit)
    if json_out:
        print_json(data["proposals"])
        return
    from rich.table import Table
    from rich.text import Text

    if not data["proposals"]:
        print(f"scenario {name} has no agent proposals")
        return
    table = Table(box=None, header_style="bold")
    for col in ("proposal", "when", "change", "run", "reason", "verdict"):
        table.add_column(col)
    for p in data["proposals"]:
        table.add_row(*(Text(x) for x in (p["id"], ago(p.get("at")), f"{p.get('op')} {p.get('target')}",
                                          p.get("run") or "-", str(p.get("reason") or "")[:80], _proposal_verdict(p))))
    console().print(table)
    if data.get("next_after"):
        print(f"(the {limit} newest shown; --limit for more)")


def _proposal_verdict(p: dict[str, Any]) -> str:
    """One proposal's verdict in words (the gate's figures read as ``reef releases show`` reads them)."""
    from daemon.gate import describe

    v = p["verdict"]
    if v == "admitted":
        return f"admitted as release {p['release_id'][:12]} (step {p['step']}{', after review' if p.get('reviewed') else ''})"
    if v == "held":
        return f"held for review as {p['candidate'][:12]} (reef releases promote)"
    if v == "pending":
        return "pending: not judged yet"
    if v == "screened":
        why = str(p.get("why") or "").removeprefix(f"screened out by the {p.get('screen')} screen: ")
        return f"refused by the {p.get('screen')} screen: {why}"
    if v == "rejected":
        figures = describe(p.get("metrics") or {})
        return f"rejected by the gate: {figures or p.get('why')}"
    return f"{v}: {p.get('why')}"


def _switched(s: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print_json(s)
    else:
        print(f"scenario {s['name']}: {'archived (neither served nor trained), ' if s.get('archived') else ''}"
              f"learning {'paused' if s['paused'] else 'on'}, capture {'on' if s['capture'] else 'off (serve-only)'}"
              + ("; an early warning stands (reef scenarios show)" if s.get("warning") else ""))


@scenarios_app.command("pause")
@edge
def pause(name: str = typer.Argument(..., help="The scenario."),
          json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Stop a scenario's learning: it serves on, its reports are kept, no step runs until it is resumed."""
    with client() as c:
        _switched(c.post(f"/reef/scenarios/{name}/pause", {}), json_out)


@scenarios_app.command("resume")
@edge
def resume(name: str = typer.Argument(..., help="The scenario."),
           json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Resume a paused scenario's learning, from the reports that came meanwhile; this also clears an early
    warning (the reward rising while the answers collapse), whose trend is then read afresh."""
    with client() as c:
        _switched(c.post(f"/reef/scenarios/{name}/resume", {}), json_out)


@scenarios_app.command("accept-warning")
@edge
def accept_warning(name: str = typer.Argument(..., help="The scenario."),
                   json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Accept a scenario's early warning: learning goes on, and it is not warned again until its settings change
    (exit 5 when no warning stands). Held candidates stay held: reef releases promote ID serves one."""
    with client() as c:
        _switched(c.post(f"/reef/scenarios/{name}/accept-warning", {}), json_out)


@scenarios_app.command("update")
@edge
def update_scenario(name: str = typer.Argument(..., help="The scenario."),
                    settings: str = typer.Option(None, "--settings", help='Recipe settings to change, as JSON '
                                                 '(\'{"kl_coef": 0.5}\'; null puts one back to its default).'),
                    requires: list[str] = typer.Option(None, "--requires", help="What its releases need to run from "
                                                       "now on, once per item: tool:NAME, env:NAME, provider:NAME, "
                                                       "agent:NAME[>=V], engine:NAME[>=V] (the requires "
                                                       "setting)."),
                    json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Change a scenario's recipe settings, checked as at creation (exit 2 naming a setting the recipe refuses);
    this also clears an early warning, whose trend is then read afresh under the new settings."""
    if settings is None and not requires:
        fail("give --settings JSON, --requires ITEM, or both", 2)
    try:
        given = json.loads(settings) if settings is not None else {}
    except ValueError as e:
        fail(f"--settings must be JSON: {e}", 2)
    if requires:
        if not isinstance(given, dict):
            fail("--settings must be a JSON object", 2)
        items = [i for i in requires if i]
        given["requires"] = items or None  # --requires "": back to none
    with client() as c:
        s = c.post(f"/reef/scenarios/{name}/settings", {"settings": given})
    if json_out:
        print_json(s)
    else:
        print(f"scenario {s['name']}: settings {json.dumps(s['settings'])}")


@scenarios_app.command("archive")
@edge
def archive(name: str = typer.Argument(..., help="The scenario."),
            json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Stop serving and training a scenario; its records and release chain stay readable. Refused (exit 5) while
    a training step is under way."""
    with client() as c:
        _switched(c.post(f"/reef/scenarios/{name}/archive", {}), json_out)


@scenarios_app.command("unarchive")
@edge
def unarchive(name: str = typer.Argument(..., help="The scenario."),
              json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Serve and train an archived scenario again."""
    with client() as c:
        _switched(c.post(f"/reef/scenarios/{name}/unarchive", {}), json_out)


@scenarios_app.command("capture")
@edge
def set_capture(name: str = typer.Argument(..., help="The scenario."),
                state: str = typer.Argument(..., help="on (its exchanges may be trained on) or off (serve-only)."),
                json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Turn a scenario's capture on or off: off, its exchanges from now on are served and recorded, never trained
    on (one request can ask the same with the header x-reef-capture: false)."""
    if state not in ("on", "off"):
        fail(f"capture is on or off, not {state!r}", 2)
    with client() as c:
        _switched(c.post(f"/reef/scenarios/{name}/capture", {"capture": state == "on"}), json_out)


tasks_app = typer.Typer(help="The tasks a scenario's gate runs the agent on (harness-search).", no_args_is_help=True)
scenarios_app.add_typer(tasks_app, name="tasks")


@tasks_app.command("promote")
@edge
def promote_task(
    receipt: str = typer.Argument(..., help="The receipt of an exchange of the run that went badly."),
    check: str = typer.Option(..., "--check", help="Shell command run in the workspace after the agent; exit 0 "
                              "passes (e.g. 'pytest -q')."),
    workspace: str = typer.Option(None, "--workspace", help="Directory copied fresh for each episode (default: an "
                                  "empty one)."),
    task_id: str = typer.Option(None, "--id", help="The task's id (a-z, 0-9, -; default: from the receipt)."),
    scenario: str = typer.Option(None, "--scenario", "-s", help="The scenario (default: the receipt's own)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Make a recorded run's user prompt a task of its scenario, scored by CHECK; the next step's gate runs it."""
    from pathlib import Path

    body: dict[str, Any] = {"receipt": receipt, "check": check}
    if workspace is not None:
        body["workspace"] = str(Path(workspace).expanduser().resolve())  # the daemon resolves from its own home
    if task_id is not None:
        body["id"] = task_id
    with client() as c:
        name = scenario or c.get(f"/reef/records/{receipt}")["scenario"]
        out = c.post(f"/reef/scenarios/{name}/tasks", body)
    if json_out:
        print_json(out)
        return
    print(f"task {out['task']['id']} of scenario {name}: {out['task']['prompt'][:60]!r}, checked by {check!r} "
          f"({len(out['tasks'])} task(s); the next step's gate runs it)")


@tasks_app.command("list")
@edge
def list_tasks(
    name: str = typer.Argument(..., help="The scenario."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the tasks in a scenario's settings: id, check and prompt."""
    with client() as c:
        tasks = (c.get(f"/reef/scenarios/{name}").get("settings") or {}).get("tasks") or []
    if json_out:
        print_json(tasks)
        return
    if not tasks:
        print(f"scenario {name} has no tasks in its settings")
    for t in tasks:
        print(f"{t.get('id')}: {str(t.get('prompt'))[:60]!r} checked by {t.get('check')!r}")
