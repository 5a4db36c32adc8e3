"""Routes of release chains: list, show, pages, reef eval, rollback and promote, canaries."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from daemon import forgetting, release_page, web
from daemon.errors import (
    BadRequest,
    Conflict,
    NotFound,
    ReefError,
)
from daemon.names import check_scenario
from daemon.routes.common import Handler, dumpb, existing_scenario, int_param, json_response, object_body

log = logging.getLogger("reef.http")


async def handle_canary(request: web.Request) -> web.Response:
    """``POST``: start a canary (``release_id``, ``share``, ``alpha``, ``max_reports``, ``max_error_rate``,
    ``min_exchanges``); ``GET``: the running one with its figures (404 when none)."""
    reef = request.ctx
    scen = await existing_scenario(reef, request.match_info["name"])
    if request.method == "GET":
        status = await reef.canaries.status(scen.name)
        if status is None:
            raise NotFound(f"scenario {scen.name!r} has no canary", scenario=scen.name)
        return json_response(status)
    return json_response(await reef.canaries.begin(scen, await object_body(request)), status=201)


async def handle_canary_end(request: web.Request) -> web.Response:
    reef = request.ctx
    scen = await existing_scenario(reef, request.match_info["name"])
    body = await object_body(request)
    promote = body.get("promote", False)
    if not isinstance(promote, bool):
        raise BadRequest("promote must be true or false", param="promote")
    async with reef.canaries._judging:  # never at the same time as the loop's own verdict
        return json_response(await reef.canaries.end(scen, promote=promote))


async def handle_releases(request: web.Request) -> web.Response:
    reef = request.ctx
    scen = await existing_scenario(reef, request.match_info["name"])
    head = await reef.chains.head(scen)
    limit = int_param(request, "limit", None, 1, 100_000)
    history = await reef.chains.history(scen.name, limit)
    pruned = await reef.chains.pruned_of(history)  # the files whose weights the retention policy pruned
    body: dict[str, Any] = {
        "scenario": scen.name,
        "head": head.release_id,
        "releases": [r.to_dict() for r in history],
        "forgotten": await forgetting.chain_view(reef, scen.name),
    }
    for r in body["releases"]:
        r["trained_on_forgotten"] = r["release_id"] in body["forgotten"]["trained_on_forgotten"]
        r["weights_pruned"] = pruned[r["release_id"]]
    body["canary"] = await reef.canaries.status(scen.name)
    if request.query.get("all") in ("1", "true", "yes"):
        body["pending"] = [r.to_dict() for r in await reef.chains.pending(scen.name)]
        body["rejected"] = [r.to_dict() for r in await reef.chains.rejections(scen.name, limit)]
    return json_response(body)


async def _release_body(request: web.Request, release_id: str, scenario: str | None) -> web.Response:
    reef = request.ctx
    rel = await reef.chains.release(release_id)
    if scenario is not None and rel.scenario != scenario:
        raise NotFound(f"release {release_id} is not a release of scenario {scenario!r}", release_id=release_id)
    body = rel.to_dict()
    body["head"] = await reef.chains.head_id(rel.scenario)
    adapter = await reef.chains.adapter(rel.release_id)  # a LoRA adapter: on which base
    body["adapter"] = adapter.to_dict() if adapter is not None else None
    # each item it requires, checked on this machine now (met or not, what was found)
    body["requirements"] = await asyncio.to_thread(reef.chains.requirements, rel)
    # its files whose weights the scenario's retention policy pruned (daemon/retention.py); empty: all here
    body["weights_pruned"] = (await reef.chains.pruned_of([rel]))[rel.release_id]
    if request.query.get("diff", "1") not in ("0", "false", "no"):
        body["diff"] = await reef.chains.diff(rel.release_id)
    return json_response(body)


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


def _eval_args(request: web.Request) -> dict[str, Any]:
    transfer = request.query.get("transfer") or None
    if transfer is not None:
        check_scenario(transfer)
    return {"transfer": transfer, "last": int_param(request, "last", None, 1, 100_000)}


async def handle_eval(request: web.Request) -> web.Response:
    """``GET``: the scenario's ``reef eval`` table from what is known (recorded at the gate, cached, reported),
    measuring nothing (``daemon/evaluation.py``)."""
    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return json_response(await reef.evaluations.evaluate(name, measure=False, **_eval_args(request)))


async def handle_measure(request: web.Request) -> web.StreamResponse:
    """``POST``: the table, measuring what is missing: JSON Lines, ``{"progress": ...}`` per release measured, then
    ``{"result": ...}`` (or ``{"error": ...}`` when something beyond a figure broke). Bad arguments are a 4xx
    before the stream starts."""
    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    args = _eval_args(request)
    await reef.evaluations.check(name, args["transfer"], args["last"])
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)

    async def progress(p: dict[str, Any]) -> None:
        await resp.write(dumpb({"progress": p}) + b"\n")

    try:
        result = await reef.evaluations.evaluate(name, progress=progress, **args)
    except ReefError as e:
        await resp.write(dumpb({"error": {"type": e.type, "message": e.message}}) + b"\n")
        return resp
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client went away: nothing to tell it
    except Exception as e:  # noqa: BLE001 - the status line is sent: say it in the stream, not as a 500
        log.exception("reef eval of %s failed", name)
        await resp.write(dumpb({"error": {"type": "internal_error", "message": f"{type(e).__name__}: {e}"}})
                         + b"\n")
        return resp
    await resp.write(dumpb({"result": result}) + b"\n")
    return resp


async def handle_release_page(request: web.Request) -> web.Response:
    return await _release_page(request, None)


async def handle_scenario_release_page(request: web.Request) -> web.Response:
    return await _release_page(request, check_scenario(request.match_info["name"]))


def steer_handler(op: str) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        reef = request.ctx
        scen = await existing_scenario(reef, request.match_info["name"])
        body = await object_body(request)
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
        return json_response(rel.to_dict(), status=201)

    return handle


async def handle_bundle(request: web.Request) -> web.Response:
    """``POST /reef/scenarios/{name}/bundle``: one release of a weights release's adapter, a harness release's files
    and the evidence for both (``Chains.bundle``)."""
    reef = request.ctx
    scen = await existing_scenario(reef, request.match_info["name"])
    body = await object_body(request)
    unknown = sorted(set(body) - {"weights", "harness", "expected_head"})
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}: a bundle names weights, harness and expected_head",
                         param=unknown[0])
    expected = body.get("expected_head")
    if expected is not None and not isinstance(expected, str):
        raise BadRequest("expected_head must be a release id (a string)", param="expected_head")
    rel = await reef.chains.bundle(scen, body.get("weights"), body.get("harness"), expected,
                                   await reef.engine(scen.model))
    return json_response(rel.to_dict(), status=201)
