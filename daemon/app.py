"""The HTTP layer: routes, auth, limits, body parsing and error mapping.

Provider routes answer in the provider's own format (``daemon/protocols``); Reef routes in
``{"error": {"type", "message", ...}}``. Every error path ends in ``error_response``: bad input is a 4xx that
says what is wrong and where, never a 500, never a hang.

Guards, in order, on every request: the ``Host`` header must be a loopback name (no DNS rebinding); TCP
requests need the token (``Authorization: Bearer`` or ``x-api-key``), the Unix socket needs none (its 0600 mode
is the auth); a declared ``Content-Length`` over the limit is refused with 413 before any of the body is read
(and the connection closed), a chunked body is cut off at the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from daemon import forgetting, listening, openapi, providers, release_page, web
from daemon.bodies import discard, is_big, read_json, read_parsed
from daemon.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PayloadTooLarge,
    ReefError,
    Unauthorized,
)
from daemon.model_dirs import is_test_model
from daemon.names import check_run, check_scenario
from daemon.protocols import anthropic, formats
from daemon.protocols.base import WireFormat
from daemon.reports import accept_imports, accept_report, check_feedback, check_report_id, check_score
from daemon.serving import Answer, Reef
from recipes import check_api_recipe, load_recipe, report_schemas

log = logging.getLogger("reef.http")

MAX_REFERENCES = 10_000
EVENTS_SEND_BUFFER = 64 * 1024  # bytes of events an /reef/events connection holds unsent, beyond its queue
EVENTS_DROPPED_GRACE_S = 10.0  # a dropped subscriber's connection closes when it has not taken its end by then

Handler = Callable[[web.Request], Awaitable["web.Response | web.StreamResponse"]]


# --- request helpers ---------------------------------------------------------------------------------------


def _token_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    return request.headers.get("x-api-key")


def error_response(request: web.Request, err: ReefError) -> web.Response:
    wire = formats.for_path(request.path)
    body = wire.error_body(err) if wire is not None else {"error": err.to_dict()}
    status = err.data.get("status") if isinstance(err.data.get("status"), int) else err.status
    resp = web.Response(_dumpb(body), status=status, close=status == 413)
    if isinstance(rid := err.data.get("record_id"), str):  # a failed exchange that was recorded
        resp.headers["x-reef-agent-record-id"] = rid
    if isinstance(retry := err.data.get("retry_after"), dict):  # an upstream's 429/503: when to try again
        resp.headers.update(retry)
    return resp


def _dumpb(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # what orjson refuses (integers beyond 64 bits)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _dumps(value: Any) -> str:
    return _dumpb(value).decode()


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(_dumpb(value), status=status, headers=headers)


# --- middleware --------------------------------------------------------------------------------------------


def _dispatcher(reef: Reef, router: web.Router, *, scoped_only: bool = False) -> Handler:
    """Every request's way in: guards, route, handler, and its errors mapped to responses. ``scoped_only``: the
    scoped socket's (``Config.scoped_socket_path``): every request needs a scoped token, the full one is refused."""
    token = reef.token.encode()
    max_body = reef.config.max_body_bytes
    names = listening.answered_names(reef.config.host, reef.config.serve_names)
    hosts: dict[str, bool] = {}  # Host values seen (a handful in practice): parsed once; values are the client's

    def host_ok(host: str | None) -> bool:
        ok = hosts.get(host or "")
        if ok is None:
            ok = listening.host_ok(host, names)
            if len(hosts) < 256:
                hosts[host or ""] = ok
        return ok

    async def dispatch(request: web.Request) -> web.Response | web.StreamResponse:
        try:
            headers = request.headers
            if not host_ok(headers.get("host")):
                raise BadRequest(
                    f"Host header {headers.get('host')!r} is not a loopback name or one of serve_names; Reef only"
                    " answers requests addressed to localhost or to the names it is configured to serve"
                )
            scope = None  # a scoped token's limits (daemon/scopes.py); None: the full token, or the main socket
            if (scoped_only or not request.over_unix) and request.path not in openapi.OPEN_PATHS:
                given = _token_of(request)
                if given is None:
                    raise Unauthorized("missing token: send 'Authorization: Bearer <token>' or 'x-api-key: <token>'")
                full = not scoped_only and hmac.compare_digest(given.encode(), token)
                if not full and (scope := reef.scopes.get(given)) is None:
                    raise Unauthorized("invalid token" + (" (this socket takes scoped tokens only)" if scoped_only
                                                          else ""))
            if request.content_length is not None and request.content_length > max_body:
                raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the {max_body}-byte limit")
            try:
                handler = router.resolve(request)
            except web.MethodNotAllowed as e:
                raise BadRequest(f"method not allowed here: {e}", status=405) from None
            if handler is None:
                raise NotFound("no such route; see GET /reef/status for the API")
            if scope is not None:
                return await scope.serve(request, handler, _object_body)
            return await handler(request)
        except ReefError as err:
            reef.metrics.errors.labels(request.route, err.type).inc()
            return error_response(request, err)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("unexpected error on %s %s", request.method, request.path)
            err = ReefError(f"internal error: {type(exc).__name__}")
            reef.metrics.errors.labels(request.route, err.type).inc()
            return error_response(request, err)

    return dispatch


def refusal_body(status: int, message: str) -> bytes:
    """The body of an answer to a request refused before it reached a route (malformed, head too large)."""
    err = ReefError(message) if status >= 500 else BadRequest(message, status=status)
    return _dumpb({"error": err.to_dict()})


# --- provider routes ---------------------------------------------------------------------------------------


def _scenario_and_run(request: web.Request) -> tuple[str, str | None]:
    scenario = request.match_info.get("scenario") or request.headers.get("x-reef-scenario") or "default"
    run = request.match_info.get("run") or request.headers.get("x-reef-run") or None
    check_scenario(scenario)
    if run is not None:
        check_run(run)
    return scenario, run


def provider_handler(wire: WireFormat) -> Handler:
    """A provider route: the request parsed into an ``Exchange`` (in ``wire``'s format), served by the serve path
    (``daemon/serving.py``), its answer sent whole or as a stream of server-sent events."""

    async def handle(request: web.Request) -> web.Response | web.StreamResponse:
        reef = request.ctx
        scenario, run = _scenario_and_run(request)
        exchange, text = await read_parsed(request, reef.config.max_body_bytes, wire.parse_request, quiet=True)
        exchange.headers, exchange.query = request.headers, request.query_string
        try:
            try:
                answer = await reef.serve_path.serve(wire, exchange, scenario=scenario, run=run,
                                                     headers=request.headers, request_text=text)
            except ReefError as err:  # a refusal: its traceback's frames would keep the exchange alive
                err.__traceback__ = None
                raise
            if isinstance(answer, Answer):
                return web.Response(answer.body, headers=answer.headers)
            try:
                resp = web.StreamResponse(headers={**_SSE_HEADERS, **answer.headers})
                await resp.prepare(request)
                await answer.send(resp)
                return resp
            finally:
                await answer.close()
        finally:
            if is_big(text):  # freed in a thread, a slice at a time (daemon/bodies.py)
                trash = [exchange]
                del exchange
                await discard(trash, text)

    return handle


_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


async def handle_count_tokens(request: web.Request) -> web.Response:
    reef = request.ctx
    scenario, _ = _scenario_and_run(request)
    exchange, text = await read_parsed(request, reef.config.max_body_bytes, anthropic.parse_count_tokens, quiet=True)
    exchange.headers, exchange.query = request.headers, request.query_string
    try:
        n = await reef.serve_path.count_tokens(exchange, scenario=scenario,
                                               pinned_release=request.headers.get("x-reef-release-id"))
    except ReefError as err:  # a refusal: its traceback's frames would keep the exchange alive
        err.__traceback__ = None
        raise
    finally:
        if is_big(text):  # freed in a thread, a slice at a time (daemon/bodies.py)
            trash = [exchange]
            del exchange
            await discard(trash, text)
    return _json(anthropic.render_count_tokens(n))


async def handle_models(request: web.Request) -> web.Response:
    reef = request.ctx
    created = int(reef.started_at)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    data = [
        {
            "id": name,
            "object": "model",
            "type": "model",
            "created": created,
            "created_at": stamp,
            "owned_by": f"reef:{entry.engine}",
            "display_name": f"{name} (test model)" if is_test_model(name) else name,
            **({"reef": {"test_model": True}} if is_test_model(name) else {}),
        }
        for name, entry in sorted(reef.config.models.items())
    ]
    return _json(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


async def handle_head(request: web.Request) -> web.Response:
    return web.Response(content_type=None)


async def handle_root(request: web.Request) -> web.Response:
    return _json({"name": "reef", "api": ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/reef/status"]})


async def handle_healthz(request: web.Request) -> web.Response:
    reef = request.ctx
    models = {"loaded": sorted(reef._engines), "loading": sorted(reef.loading),
              "waiting": dict(sorted(reef.waiting.items())), "failed": dict(sorted(reef.load_errors.items()))}
    return _json({"ok": True, "pid": _pid(), "uptime_s": round(time.time() - reef.started_at, 3), "models": models})


def _pid() -> int:
    return os.getpid()


# --- reef routes -------------------------------------------------------------------------------------------


async def _object_body(request: web.Request) -> dict[str, Any]:
    reef = request.ctx
    body = await read_json(request, reef.config.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def handle_report(request: web.Request) -> web.Response:
    reef = request.ctx
    body = await _object_body(request)
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
    if report_schemas():  # a bound recipe declares structured report fields: check them before storing
        target = scenario
        if target is None:
            with contextlib.suppress(NotFound):  # unknown receipts: the store names them all next
                target = (await reef.store.get_record(refs[0], full=False))["scenario"]
        if target is not None:
            await reef.learner.check_report(target, metadata)
    stored = await accept_report(reef.store, reef.metrics, reef.events, scenario=scenario, score=score,
                                 feedback=feedback, references=refs, metadata=metadata, report_id=report_id)
    view = _report_view(stored)
    if await reef.learner.inline(stored["scenario"]):  # a harness edit takes milliseconds: answer its outcome
        outcome = await reef.learner.step(stored["scenario"])
        view["learning"] = None if outcome is None else outcome.to_dict()
    else:
        reef.learner.notify(stored["scenario"])
    return _json(view, status=201)


def _report_view(rec: dict[str, Any]) -> dict[str, Any]:
    report = rec.get("report") or {}
    return {"report_id": rec["id"], "scenario": rec["scenario"], "created_at": rec["created_at"], **report}


async def handle_export(request: web.Request) -> web.StreamResponse:
    """The exchanges (of a scenario, since a time) as JSON Lines in the export shape (``daemon/export.py``),
    streamed a page at a time (``RecordStore.export_page``: bounded in bytes), each page read and rendered in a
    worker thread and written when the client has taken the one before: memory stays a page's worth, however big
    the export, and the loop only hands pages on."""
    from daemon.export import render_lines

    reef = request.ctx
    scenario = request.query.get("scenario")
    if scenario is not None:
        await _existing_scenario(reef, scenario)
    since = request.query.get("since")
    try:
        since_t = float(since) if since is not None else None
    except ValueError:
        raise BadRequest("since must be a time in seconds since the epoch", param="since") from None
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"}, send_buffer=1 << 20)
    await resp.prepare(request)
    after: int | None = 0
    while after is not None:
        page, after = await reef.store.export_page(scenario=scenario, since=since_t, after=after)
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
    body = await _object_body(request)
    items = body.get("items")
    if not isinstance(items, list) or not items or len(items) > MAX_IMPORT:
        raise BadRequest(f"items must be a list of 1 to {MAX_IMPORT} exchanges", param="items")
    default = check_scenario(body.get("scenario") or "imported")
    first = body.get("first_line", 1)
    if not isinstance(first, int) or isinstance(first, bool):
        raise BadRequest("first_line must be an integer", param="first_line")
    parsed = [from_line(item, f"line {first + i} (items[{i}])", default, index=i) for i, item in enumerate(items)]
    for name in sorted({p["record"].scenario for p in parsed}):
        await reef.scenario(name)
    out = await accept_imports(reef.store, reef.metrics, reef.events, parsed)
    for name in sorted({p["record"].scenario for p in parsed if p["report"] is not None}):
        reef.learner.notify(name)
    return _json(out, status=201)


async def handle_canary(request: web.Request) -> web.Response:
    """``POST``: start a canary (``release_id``, ``share``, ``alpha``, ``max_reports``, ``max_error_rate``,
    ``min_exchanges``); ``GET``: the running one with its figures (404 when none)."""
    reef = request.ctx
    scen = await _existing_scenario(reef, request.match_info["name"])
    if request.method == "GET":
        status = await reef.canaries.status(scen.name)
        if status is None:
            raise NotFound(f"scenario {scen.name!r} has no canary", scenario=scen.name)
        return _json(status)
    return _json(await reef.canaries.begin(scen, await _object_body(request)), status=201)


async def handle_canary_end(request: web.Request) -> web.Response:
    reef = request.ctx
    scen = await _existing_scenario(reef, request.match_info["name"])
    body = await _object_body(request)
    promote = body.get("promote", False)
    if not isinstance(promote, bool):
        raise BadRequest("promote must be true or false", param="promote")
    async with reef.canaries._judging:  # never at the same time as the loop's own verdict
        return _json(await reef.canaries.end(scen, promote=promote))


async def handle_forget(request: web.Request) -> web.Response:
    return _json(await forgetting.forget(request.ctx, await _object_body(request)))


async def handle_start_run(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    return _json(await harness.start_run(reef, await _object_body(request)), status=201)


def _adapter_param(request: web.Request, required: bool) -> str | None:
    from adapters import ADAPTERS

    adapter = request.query.get("adapter")
    if adapter is None and not required:
        return None
    if adapter not in ADAPTERS:
        raise BadRequest(f"adapter must be one of {', '.join(ADAPTERS)}, got {adapter!r}", param="adapter")
    return adapter


async def handle_harness(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return _json(await harness.harness_view(reef, name, _adapter_param(request, required=False)))


async def handle_evolve(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return _json(await harness.evolve(reef, name, await _object_body(request)), status=201)


async def handle_proposal(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    status, answer = await harness.propose(reef, name, await _object_body(request))
    return _json(answer, status=status)


async def handle_proposals(request: web.Request) -> web.Response:
    """A scenario's proposals with their verdicts, newest first (``daemon/proposals.py``'s ``listing``), a page at a
    time: ``limit`` of them after the proposal ``after`` (the last of the page before), ``next_after`` naming the
    last of this page while more follow."""
    from daemon.proposals import listing

    reef = request.ctx
    scen = await _existing_scenario(reef, request.match_info["name"])
    limit = _int_param(request, "limit", 50, 1, 1000) or 50
    after = request.query.get("after")
    history, held, rejected = (await reef.chains.history(scen.name), await reef.chains.pending(scen.name),
                               await reef.chains.rejections(scen.name))
    every = listing(history, held, rejected, reef.learner.undecided(scen.name))
    start = 0
    if after:
        at = next((i for i, e in enumerate(every) if e["id"] == after), None)
        if at is None:
            raise BadRequest(f"after names no proposal of scenario {scen.name!r}: {after!r}", param="after")
        start = at + 1
    page = every[start:start + limit]
    more = start + limit < len(every)
    return _json({"scenario": scen.name, "proposals": page, "next_after": page[-1]["id"] if more and page else None})


async def handle_move_model(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return _json(await harness.move_model(reef, name, await _object_body(request)))


async def handle_promote_task(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return _json(await harness.promote_task(reef, name, await _object_body(request)), status=201)


async def handle_harness_install(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    adapter = _adapter_param(request, required=True)
    assert adapter is not None
    scenario = check_scenario(request.query.get("scenario") or adapter)
    return web.Response(harness.install_script(reef, adapter, scenario).encode(),
                        content_type="text/x-shellscript; charset=utf-8")


async def handle_scenarios(request: web.Request) -> web.Response:
    reef = request.ctx
    return _json({"scenarios": await reef.store.list_scenarios()})


async def handle_create_scenario(request: web.Request) -> web.Response:
    reef = request.ctx
    body = await _object_body(request)
    name = body.get("name")
    if not isinstance(name, str):
        raise BadRequest("name is required (a string)", param="name")
    check_scenario(name)
    recipe = body.get("recipe")
    if recipe is not None:
        if not isinstance(recipe, str):
            raise BadRequest("recipe must be a recipe name (a string)", param="recipe")
        cfg = reef.config
        check_api_recipe(recipe, paths=cfg.recipe_paths,
                         allowed=(*cfg.allowed_recipes, cfg.default_recipe, cfg.harness_recipe))
        load_recipe(recipe)  # unknown, fails to import, not a recipe: 400 saying which
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    base = body.get("base_release")
    if base is not None and not isinstance(base, str):
        raise BadRequest("base_release must be a release id (a string)", param="base_release")
    if base is not None:
        await reef.chains.release(base)  # unknown: 404 before the scenario exists
    settings = body.get("settings")
    if settings is not None and not isinstance(settings, dict):
        raise BadRequest("settings must be a JSON object of recipe settings", param="settings")
    reef.learner.check_settings(recipe or reef.config.default_recipe, settings or {})
    switches = {key: _switch(body, key) for key in ("capture", "paused") if key in body}
    scenario = await reef.scenario(name, recipe=recipe, model=model, settings=settings)
    if switches:
        scenario = await reef.store.set_switches(name, **switches)
    head = await reef.chains.head(scenario, base=base)
    return _json({**scenario.to_dict(), "head": head.release_id}, status=201)


def _switch(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false", param=key)
    return value


def switch_handler(**fixed: bool) -> Handler:
    """Pause or resume a scenario's learning (``paused``), archive it or bring it back (``archived``: neither
    served nor trained), or turn its capture on or off (the body's ``capture``): the binding, its chain and its
    records stay as they are."""

    async def handle(request: web.Request) -> web.Response:
        reef = request.ctx
        name = check_scenario(request.match_info["name"])
        switches = fixed or {"capture": _switch(await _object_body(request), "capture")}
        if switches.get("archived"):  # refused while a step is out; no step starts while it is written
            async with reef.learner.no_step(name):
                scenario = await reef.store.set_switches(name, **switches)
        else:
            scenario = await reef.store.set_switches(name, **switches)
        reef.events.publish("scenario", scenario=scenario.to_dict())
        if switches.get("paused") is False or switches.get("archived") is False:
            reef.learner.notify(name)  # what came while it was paused is learned from now
        return _json(scenario.to_dict())

    return handle


async def handle_scenario(request: web.Request) -> web.Response:
    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    for s in await reef.store.list_scenarios():
        if s["name"] == name:
            return _json({**s, **await _recipe_status(reef, s)})
    raise NotFound(f"no scenario named {name!r}", scenario=name)


async def _recipe_status(reef: Reef, scenario: dict[str, Any]) -> dict[str, Any]:
    """The recipe's own summary of its progress (``Recipe.status``), for recipes that have one."""
    from daemon.learning import left_out
    from recipes.base import Recipe

    try:
        recipe = reef.learner.make_recipe(scenario["recipe"], scenario.get("settings") or {})
    except ReefError:  # a recipe that no longer loads: the view still shows the scenario
        return {}
    settings = recipe.settings
    out: dict[str, Any] = {"effective_settings": _plain(dataclasses.asdict(settings)) if dataclasses.is_dataclass(
        settings) and not isinstance(settings, type) else {}}
    skipped = await left_out(reef.store, recipe, scenario["name"])
    if skipped is not None:
        out["left_out"] = skipped
    if type(recipe).status is Recipe.status:
        return out
    releases = [r.to_dict() for r in await reef.chains.history(scenario["name"])]
    rejected = [r.to_dict() for r in await reef.chains.rejections(scenario["name"])]
    return {**out, "recipe_status": recipe.status(releases, rejected)}


def _plain(value: Any) -> Any:
    """A recipe's settings as JSON: what the user set and every default (``effective_settings``)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def _int_param(request: web.Request, name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name} must be an integer", param=name) from None
    if not lo <= value <= hi:
        raise BadRequest(f"query parameter {name} must be between {lo} and {hi}", param=name)
    return value


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
    after = _int_param(request, "after", None, 0, 2**62)
    limit = _int_param(request, "limit", 50, 1, 1000)
    run = request.query.get("run")
    if run is not None:
        check_run(run)
    kind = request.query.get("kind")
    if kind not in (None, "exchange", "report"):
        raise BadRequest("kind must be exchange or report", param="kind")
    newest = request.query.get("order", "asc") == "desc"
    records = await reef.store.list_records(
        scenario=scenario, run=run, after=after, limit=limit or 50, kind=kind, newest_first=newest
    )
    return _json({"records": records, "next_after": records[-1]["seq"] if records and not newest else None})


async def handle_record(request: web.Request) -> web.Response:
    reef = request.ctx
    return _json(await reef.store.get_record(request.match_info["receipt"]))


async def _existing_scenario(reef: Reef, name: str) -> Any:
    check_scenario(name)
    scenario = await reef.store.get_scenario(name)
    return await reef.scenario(scenario.name)


async def handle_releases(request: web.Request) -> web.Response:
    reef = request.ctx
    scen = await _existing_scenario(reef, request.match_info["name"])
    head = await reef.chains.head(scen)
    limit = _int_param(request, "limit", None, 1, 100_000)
    body: dict[str, Any] = {
        "scenario": scen.name,
        "head": head.release_id,
        "releases": [r.to_dict() for r in await reef.chains.history(scen.name, limit)],
        "forgotten": await forgetting.chain_view(reef, scen.name),
    }
    for r in body["releases"]:
        r["trained_on_forgotten"] = r["release_id"] in body["forgotten"]["trained_on_forgotten"]
    body["canary"] = await reef.canaries.status(scen.name)
    if request.query.get("all") in ("1", "true", "yes"):
        body["pending"] = [r.to_dict() for r in await reef.chains.pending(scen.name)]
        body["rejected"] = [r.to_dict() for r in await reef.chains.rejections(scen.name, limit)]
    return _json(body)


async def _release_body(request: web.Request, release_id: str, scenario: str | None) -> web.Response:
    reef = request.ctx
    rel = await reef.chains.release(release_id)
    if scenario is not None and rel.scenario != scenario:
        raise NotFound(f"release {release_id} is not a release of scenario {scenario!r}", release_id=release_id)
    body = rel.to_dict()
    body["head"] = await reef.chains.head_id(rel.scenario)
    adapter = await reef.chains.adapter(rel.release_id)  # a LoRA adapter: on which base
    body["adapter"] = adapter.to_dict() if adapter is not None else None
    if request.query.get("diff", "1") not in ("0", "false", "no"):
        body["diff"] = await reef.chains.diff(rel.release_id)
    return _json(body)


async def handle_scenario_release(request: web.Request) -> web.Response:
    name = check_scenario(request.match_info["name"])
    return await _release_body(request, request.match_info["release"], name)


async def handle_release(request: web.Request) -> web.Response:
    return await _release_body(request, request.match_info["release"], None)


async def _release_page(request: web.Request, scenario: str | None) -> web.Response:
    """One release as a self-contained HTML page (``daemon/release_page.py``)."""
    data = await release_page.gather(request.ctx, request.match_info["release"], scenario)
    return web.Response(release_page.render(data).encode(), content_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": release_page.CSP, "X-Content-Type-Options": "nosniff",
                                 "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
                                 "x-reef-release-id": data.release["release_id"]})


async def handle_release_page(request: web.Request) -> web.Response:
    return await _release_page(request, None)


async def handle_scenario_release_page(request: web.Request) -> web.Response:
    return await _release_page(request, check_scenario(request.match_info["name"]))


def steer_handler(op: str) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        reef = request.ctx
        scen = await _existing_scenario(reef, request.match_info["name"])
        body = await _object_body(request)
        release_id = body.get("release_id")
        if not isinstance(release_id, str) or not release_id:
            raise BadRequest("release_id is required (a string)", param="release_id")
        expected = body.get("expected_head")
        if expected is not None and not isinstance(expected, str):
            raise BadRequest("expected_head must be a release id (a string)", param="expected_head")
        canary = reef.canaries.active.get(scen.name)
        if op == "promote" and canary is not None and canary["release_id"].startswith(release_id):
            raise Conflict(f"release {canary['release_id']} is serving as a canary of {scen.name!r}: promote it with "
                           f"`reef releases canary-end -s {scen.name} --promote` (its live figures go on the chain)",
                           release_id=canary["release_id"])
        engine = await reef.engine(scen.model)
        fn = reef.chains.rollback if op == "rollback" else reef.chains.promote
        rel = await fn(scen, release_id, expected, engine)
        return _json(rel.to_dict(), status=201)

    return handle


async def handle_status(request: web.Request) -> web.Response:
    reef = request.ctx
    counts = await reef.store.count()
    return _json(
        {
            "pid": _pid(),
            "home": str(reef.config.home),
            "uptime_s": round(time.time() - reef.started_at, 3),
            "listen": {"tcp": f"{reef.config.host}:{reef.config.port}", "unix": str(reef.config.socket_path)},
            "default_model": reef.config.default_model,
            "models": {
                name: {
                    "engine": e.engine,
                    "test_model": is_test_model(name),
                    "loaded": name in reef._engines,
                    "loading": name in reef.loading,
                    **({"load_error": reef.load_errors[name]} if name in reef.load_errors else {}),
                    "resident": reef._engines[name].resident if name in reef._engines else {},
                    **({"server": reef._engines[name].status} if name in reef._engines and reef._engines[name].status
                       else {}),
                    **({"upstream": providers.shown(e)} if e.engine == "upstream" else {}),
                }
                for name, e in reef.config.models.items()
            },
            "records": counts.get("exchange", 0),
            "reports": counts.get("report", 0),
            "scenarios": len(await reef.store.list_scenarios()),
            "learning": dict(reef.learner.state),
            # the running canaries with their figures and the lines a person reads (daemon/canary.describe)
            "canaries": [c for n in sorted(reef.canaries.active) if (c := await reef.canaries.status(n)) is not None],
            "events": {"subscribers": reef.events.subscribers, "dropped": reef.events.dropped},
            "trainer_pid": reef.learner.trainer_pid,
            "trainer": reef.config.trainer,
            "chain_remote": reef.chains.remote_state or None,  # url, last_fetch, error (None: chains are local)
        }
    )


async def handle_events(request: web.Request) -> web.StreamResponse:
    reef = request.ctx
    after = request.headers.get("Last-Event-ID") or request.query.get("after")
    try:
        after_seq = int(after) if after else None
    except ValueError:
        raise BadRequest("after / Last-Event-ID must be an integer", param="after") from None
    # a bounded send buffer: a subscriber that stops reading falls behind in its queue, where the bound (and the
    # drop) applies, instead of in megabytes of socket buffers that hide how far behind it is
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
                              send_buffer=EVENTS_SEND_BUFFER)
    await resp.prepare(request)
    ended = False

    def dropped() -> None:  # a client that takes its last events within the grace ends normally; else: closed
        asyncio.get_running_loop().call_later(EVENTS_DROPPED_GRACE_S, lambda: None if ended else resp.abort())

    q = reef.events.subscribe(after_seq, on_drop=dropped)
    try:
        await resp.write(b": reef events\n\n")
        while True:
            try:
                event = await asyncio.wait_for(q.get(), timeout=15)
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            if event is None:  # the daemon is stopping, or this subscriber was dropped (after a ``dropped`` event)
                break
            # a dropped event's id is where to resume: a client's Last-Event-ID follows it on reconnect
            seq = event["seq"] if event["seq"] is not None else event["resume_after"]
            await resp.write(f"id: {seq}\nevent: {event['kind']}\ndata: {_dumps(event)}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        ended = True
        reef.events.unsubscribe(q)
    return resp


async def handle_mint_token(request: web.Request) -> web.Response:
    """A scoped token (``daemon/scopes.py``) for code that runs on a scenario's behalf in a sandbox."""
    reef = request.ctx
    body = await _object_body(request)
    scenario = check_scenario(body.get("scenario"))
    ttl = body.get("ttl_s", 3600)
    from daemon.scopes import MAX_TTL_S

    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S:
        raise BadRequest(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}]", param="ttl_s")
    return _json({"token": reef.scopes.mint(scenario, float(ttl)), "scenario": scenario, "ttl_s": ttl,
                  "socket": str(reef.config.scoped_socket_path)}, status=201)


async def handle_revoke_token(request: web.Request) -> web.Response:
    reef = request.ctx
    token = (await _object_body(request)).get("token")
    if not isinstance(token, str):
        raise BadRequest("token is required (a scoped token)", param="token")
    return _json({"revoked": reef.scopes.revoke(token)})


async def handle_metrics(request: web.Request) -> web.Response:
    reef = request.ctx
    return web.Response(reef.metrics.render(), content_type="text/plain; charset=utf-8")


def openapi_handler(router: web.Router) -> Handler:
    """``GET /openapi.json``: the document of ``router``'s routes (``daemon/openapi.py``), made on first asking."""
    made: list[bytes] = []

    async def handle(request: web.Request) -> web.Response:
        if not made:
            from importlib.metadata import PackageNotFoundError, version

            try:
                v = version("reef")
            except PackageNotFoundError:  # run from a checkout that was never installed
                v = "unknown"
            made.append(_dumpb(openapi.document(router.routes(), v)))
        return web.Response(made[0])

    return handle


# --- the app -----------------------------------------------------------------------------------------------


def make_app(reef: Reef, *, scoped_only: bool = False) -> Handler:
    """The daemon's routes behind its guards: the handler ``web.Server`` serves (``scoped_only``: on the scoped
    socket, where only scoped tokens are taken)."""
    return _dispatcher(reef, router(), scoped_only=scoped_only)


def router() -> web.Router:
    """The route table (each route described in ``daemon/openapi.py``, served at ``GET /openapi.json``)."""
    r = web.Router()
    chat, responses, messages = (provider_handler(f) for f in (formats.OPENAI_CHAT, formats.OPENAI_RESPONSES,
                                                                 formats.ANTHROPIC))
    for prefix in ("", "/s/{scenario}", "/s/{scenario}/r/{run}"):
        r.add("POST", prefix + "/v1/chat/completions", chat)
        r.add("POST", prefix + "/v1/responses", responses)
        r.add("POST", prefix + "/v1/messages", messages)
        r.add("POST", prefix + "/v1/messages/count_tokens", handle_count_tokens)
        r.add("GET", prefix + "/v1/models", handle_models)
        if prefix:
            r.add("HEAD", prefix, handle_head)
            r.add("HEAD", prefix + "/", handle_head)
    r.add("GET", "/", handle_root)  # HEAD / is answered from the GET route
    r.add("GET", "/healthz", handle_healthz)
    r.add("GET", "/metrics", handle_metrics)
    r.add("GET", "/openapi.json", openapi_handler(r))
    r.add("POST", "/reef/report", handle_report)
    r.add("GET", "/reef/scenarios", handle_scenarios)
    r.add("POST", "/reef/scenarios", handle_create_scenario)
    r.add("GET", "/reef/scenarios/{name}", handle_scenario)
    r.add("GET", "/reef/scenarios/{name}/records", handle_scenario_records)
    r.add("GET", "/reef/records", handle_records)
    r.add("GET", "/reef/records/export", handle_export)  # before {receipt}: a fixed path wins
    r.add("POST", "/reef/records/import", handle_import)
    r.add("GET", "/reef/records/{receipt}", handle_record)
    r.add("POST", "/reef/records/forget", handle_forget)
    r.add("GET", "/reef/scenarios/{name}/releases", handle_releases)
    r.add("GET", "/reef/scenarios/{name}/releases/{release}", handle_scenario_release)
    r.add("GET", "/reef/scenarios/{name}/releases/{release}/page", handle_scenario_release_page)
    r.add("POST", "/reef/scenarios/{name}/rollback", steer_handler("rollback"))
    r.add("POST", "/reef/scenarios/{name}/promote", steer_handler("promote"))
    r.add("GET", "/reef/releases/{release}", handle_release)
    r.add("GET", "/reef/releases/{release}/page", handle_release_page)
    r.add("POST", "/reef/runs", handle_start_run)
    r.add("GET", "/reef/scenarios/{name}/harness", handle_harness)
    r.add("POST", "/reef/scenarios/{name}/evolve", handle_evolve)
    r.add("POST", "/reef/scenarios/{name}/proposals", handle_proposal)
    r.add("GET", "/reef/scenarios/{name}/proposals", handle_proposals)
    r.add("POST", "/reef/scenarios/{name}/tasks", handle_promote_task)
    r.add("POST", "/reef/scenarios/{name}/model", handle_move_model)
    r.add("POST", "/reef/scenarios/{name}/pause", switch_handler(paused=True))
    r.add("POST", "/reef/scenarios/{name}/resume", switch_handler(paused=False))
    r.add("POST", "/reef/scenarios/{name}/capture", switch_handler())
    r.add("POST", "/reef/scenarios/{name}/canary", handle_canary)
    r.add("GET", "/reef/scenarios/{name}/canary", handle_canary)
    r.add("POST", "/reef/scenarios/{name}/canary/end", handle_canary_end)
    r.add("POST", "/reef/scenarios/{name}/archive", switch_handler(archived=True))
    r.add("POST", "/reef/scenarios/{name}/unarchive", switch_handler(archived=False))
    r.add("GET", "/reef/harness/install", handle_harness_install)
    r.add("GET", "/reef/status", handle_status)
    r.add("GET", "/reef/events", handle_events)
    r.add("POST", "/reef/tokens", handle_mint_token)
    r.add("POST", "/reef/tokens/revoke", handle_revoke_token)
    return r
