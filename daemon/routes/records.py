"""Routes of the user's data: reports on receipts, records listed and shown, export, import, forget."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from daemon import forgetting, web
from daemon.errors import (
    BadRequest,
    NotFound,
)
from daemon.names import check_run, check_scenario
from daemon.records import RecordRow
from daemon.reports import (
    accept_imports,
    accept_report,
    check_feedback,
    check_report_id,
    check_score,
    check_score_range,
)
from daemon.routes.common import MAX_REFERENCES, existing_scenario, int_param, json_response, object_body
from daemon.serving import Reef
from recipes import report_schemas


async def handle_report(request: web.Request) -> web.Response:
    reef = request.ctx
    body = await object_body(request)
    known = {"score", "feedback", "references", "metadata", "report_id", "scenario"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown fields in report: {', '.join(unknown)}", param=unknown[0])
    score = body.get("score")
    if score is not None:
        score = check_score(score)
    feedback = body.get("feedback")
    if feedback is not None:
        check_feedback(feedback)
    if score is None and feedback is None:
        raise BadRequest("a report needs a score, feedback, or both", param="score")
    refs = body.get("references")
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) and r for r in refs):
        raise BadRequest("references must be a non-empty list of receipts (strings)", param="references")
    if len(refs) > MAX_REFERENCES:
        raise BadRequest(f"at most {MAX_REFERENCES} references per report", param="references")
    refs = list(dict.fromkeys(refs))
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("metadata must be a JSON object", param="metadata")
    training = (metadata or {}).get("training")
    if training is not None and not (isinstance(training, dict) and isinstance(training.get("eligible", True), bool)):
        raise BadRequest('metadata.training must be an object such as {"eligible": false} (eligible: true or false)',
                         param="metadata.training")
    report_id = body.get("report_id")
    if report_id is not None:
        check_report_id(report_id)
    scenario = body.get("scenario") or request.headers.get("x-reef-scenario")
    if scenario is not None:
        if not isinstance(scenario, str):
            raise BadRequest("scenario must be a string", param="scenario")
        check_scenario(scenario)
    target = scenario
    if target is None and (score is not None or report_schemas()):
        with contextlib.suppress(NotFound):  # unknown receipts: the store names them all next
            target = (await reef.store.exchanges.get(refs[0], full=False))["scenario"]
    if score is not None and target is not None:
        check_score_range(score, target, reef.config)
    if report_schemas() and target is not None:  # a bound recipe declares structured report fields: check them
        await reef.learner.check_report(target, metadata)
    stored = await accept_report(reef.store, reef.metrics, reef.events, scenario=scenario, score=score,
                                 feedback=feedback, references=refs, metadata=metadata, report_id=report_id)
    view = _report_view(stored)
    if await reef.learner.inline(stored["scenario"]):  # a harness edit takes milliseconds: answer its outcome
        outcome = await reef.learner.step(stored["scenario"])
        view["learning"] = None if outcome is None else outcome.to_dict()
    else:
        reef.learner.notify(stored["scenario"])
    return json_response(view, status=201)


def _report_view(rec: RecordRow) -> dict[str, Any]:
    report = rec.get("report") or {}
    return {"report_id": rec["id"], "scenario": rec["scenario"], "created_at": rec["created_at"], **report}


async def handle_export(request: web.Request) -> web.StreamResponse:
    """The exchanges (of a scenario, since a time) as JSON Lines in the export shape (``daemon/export.py``),
    streamed a page at a time (``store.user_data.export_page``: bounded in bytes), each page read and rendered in
    a worker thread and written when the client has taken the one before: memory stays a page's worth, however big
    the export, and the loop only hands pages on."""
    from daemon.export import render_lines

    reef = request.ctx
    scenario = request.query.get("scenario")
    if scenario is not None:
        await existing_scenario(reef, scenario)
    since = request.query.get("since")
    try:
        since_t = float(since) if since is not None else None
    except ValueError:
        raise BadRequest("since must be a time in seconds since the epoch", param="since") from None
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"}, send_buffer=1 << 20)
    await resp.prepare(request)
    after: int | None = 0
    while after is not None:
        page, after = await reef.store.user_data.export_page(scenario=scenario, since=since_t, after=after)
        data = await asyncio.to_thread(render_lines, page) if page else b""
        del page
        await resp.write(data)  # waits while the client's socket holds more than the send buffer
    return resp


MAX_IMPORT = 1000  # lines in one import request (the CLI sends a file in batches of this many)


async def handle_import(request: web.Request) -> web.Response:
    """``{"items": [...], "scenario": default}``: exchanges in the export shape, stored in one transaction,
    idempotent by id; an item that fails a check (``daemon/export.from_line``: the checks of every other way in)
    refuses the whole batch with a 4xx naming its index and field (``param`` ``items[<i>].<field>``; the message
    names the line, counted from ``first_line``)."""
    from daemon.export import from_line

    reef = request.ctx
    body = await object_body(request)
    items = body.get("items")
    if not isinstance(items, list) or not items or len(items) > MAX_IMPORT:
        raise BadRequest(f"items must be a list of 1 to {MAX_IMPORT} exchanges", param="items")
    default = check_scenario(body.get("scenario") or "imported")
    first = body.get("first_line", 1)
    if not isinstance(first, int) or isinstance(first, bool):
        raise BadRequest("first_line must be an integer", param="first_line")
    parsed = [from_line(item, f"line {first + i} (items[{i}])", default, index=i) for i, item in enumerate(items)]
    for i, p in enumerate(parsed):  # each score within its scenario's range, as /reef/report checks it
        for k, rep in enumerate(p["reports"]):
            if rep["score"] is not None:
                try:
                    check_score_range(rep["score"], p["record"].scenario, reef.config)
                except BadRequest as e:
                    field = f"reports[{k}].score" if items[i].get("reports") else "score"
                    raise BadRequest(f"line {first + i} (items[{i}]): {e.message}", param=f"items[{i}].{field}") \
                        from None
    models = {name: (await reef.scenario(name)).model for name in sorted({p["record"].scenario for p in parsed})}
    dropped = _foreign_tokens(parsed, models)
    out = await accept_imports(reef.store, reef.metrics, reef.events, parsed)
    out["tokens_dropped"] = dropped
    for name in sorted({p["record"].scenario for p in parsed if p["reports"]}):
        reef.learner.notify(name)
    return json_response(out, status=201)


def _foreign_tokens(parsed: list[dict[str, Any]], models: dict[str, str]) -> int:
    """Token ids are a model's own (its tokenizer's): an imported exchange whose ``model`` is not its scenario's
    keeps its text but not its token ids and log-probs, so a weights recipe never trains the scenario's model on
    another model's ids. Changes ``parsed`` in place; the number of exchanges whose tokens were dropped."""
    from dataclasses import replace

    dropped = 0
    for p in parsed:
        rec = p["record"]
        has = rec.prompt_token_ids is not None or rec.token_ids is not None or rec.logprobs is not None
        if has and rec.model != models[rec.scenario]:
            p["record"] = replace(rec, prompt_token_ids=None, token_ids=None, logprobs=None)
            dropped += 1
    return dropped


async def handle_forget(request: web.Request) -> web.Response:
    return json_response(await forgetting.forget(request.ctx, await object_body(request)))


async def handle_scenario_records(request: web.Request) -> web.Response:
    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return await _list_records(request, reef, name)


async def handle_records(request: web.Request) -> web.Response:
    reef = request.ctx
    scenario = request.query.get("scenario")
    if scenario is not None:
        check_scenario(scenario)
    return await _list_records(request, reef, scenario)


async def _list_records(request: web.Request, reef: Reef, scenario: str | None) -> web.Response:
    after = int_param(request, "after", None, 0, 2**62)
    limit = int_param(request, "limit", 50, 1, 1000)
    run = request.query.get("run")
    if run is not None:
        check_run(run)
    kind = request.query.get("kind")
    if kind not in (None, "exchange", "report"):
        raise BadRequest("kind must be exchange or report", param="kind")
    newest = request.query.get("order", "asc") == "desc"
    records = await reef.store.exchanges.listing(
        scenario=scenario, run=run, after=after, limit=limit or 50, kind=kind, newest_first=newest
    )
    for r in records:
        _live(reef, r)
    return json_response({"records": records, "next_after": records[-1]["seq"] if records and not newest else None})


def _live(reef: Reef, rec: RecordRow) -> RecordRow:
    """A stream still being answered is ``in_progress``, not ``incomplete`` (the word for one cut off): its record
    is opened (``incomplete``, no timings yet) by this daemon process. One opened before this process started was
    cut off by the stop or crash between, and stays ``incomplete``."""
    if (rec.get("kind") == "exchange" and rec.get("status") == "incomplete" and rec.get("timings") is None
            and rec.get("engine") != "import" and (rec.get("created_at") or 0) >= reef.started_at):
        rec["status"] = "in_progress"
    return rec


async def handle_record(request: web.Request) -> web.Response:
    reef = request.ctx
    return json_response(_live(reef, await reef.store.exchanges.get(request.match_info["receipt"])))
