"""Routes of the daemon itself: status, the event stream, scoped tokens, metrics, the OpenAPI document."""

from __future__ import annotations

import asyncio
import time

from daemon import learning_spend, openapi, providers, web
from daemon.errors import (
    BadRequest,
)
from daemon.gating import warning
from daemon.model_dirs import is_test_model
from daemon.names import check_run, check_scenario
from daemon.routes.common import Handler, dumpb, dumps, json_response, object_body
from daemon.routes.provider import _pid

EVENTS_SEND_BUFFER = 64 * 1024  # bytes of events an /reef/events connection holds unsent, beyond its queue


EVENTS_DROPPED_GRACE_S = 10.0  # a dropped subscriber's connection closes when it has not taken its end by then


async def handle_status(request: web.Request) -> web.Response:
    reef = request.ctx
    counts = await reef.store.exchanges.count()
    return json_response(
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
            "scenarios": len(await reef.store.scenarios.all()),
            "warnings": {n: w["reason"] for n, w in (await warning.standing(reef.store)).items()
                         if w.get("state") == "warned"},
            "learning": dict(reef.learner.state),
            # each weights scenario's trainer time today and in all, its cap, and the cost per point of reward gained
            # (daemon/spend.py)
            "spend": await learning_spend.status(reef.learner),
            # the weights scenarios waiting for disk space, and why; each one's weights kept and pruned, by the
            # last retention pass (daemon/retention.py)
            "storage": {n: v for n, v in reef.learner.storage.waiting.items() if reef.learner.state.get(n) == "storage"},
            "retention": reef.weights_retention.figures,
            # the running canaries with their figures and the lines a person reads (daemon/canary.describe)
            "canaries": [c for n in sorted(reef.canaries.active) if (c := await reef.canaries.status(n)) is not None],
            "events": {"subscribers": reef.events.subscribers, "dropped": reef.events.dropped},
            "trainer_pid": reef.learner.trainer_pid,
            "trainer": reef.config.trainer,
            "chain_remote": reef.chains.remote_state or None,  # url, last_fetch, error (None: chains are local)
            "inflight": reef.serve_path.in_flight(),
        }
    )


async def handle_inflight(request: web.Request) -> web.Response:
    """The exchanges being served now (``?run=``, ``?scenario=``): elapsed time and tokens so far, for ``reef
    status`` and a wrapper telling its user that a slow model is still answering."""
    reef = request.ctx
    run, scenario = request.query.get("run") or None, request.query.get("scenario") or None
    if run is not None:
        check_run(run)
    if scenario is not None:
        check_scenario(scenario)
    return json_response({"inflight": reef.serve_path.in_flight(run=run, scenario=scenario)})


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
            await resp.write(f"id: {seq}\nevent: {event['kind']}\ndata: {dumps(event)}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        ended = True
        reef.events.unsubscribe(q)
    return resp


async def handle_mint_token(request: web.Request) -> web.Response:
    """A scoped token (``daemon/scopes.py``) for code that runs on a scenario's behalf in a sandbox."""
    reef = request.ctx
    body = await object_body(request)
    scenario = check_scenario(body.get("scenario"))
    ttl = body.get("ttl_s", 3600)
    from daemon.scopes import MAX_TTL_S

    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S:
        raise BadRequest(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}]", param="ttl_s")
    return json_response({"token": reef.scopes.mint(scenario, float(ttl)), "scenario": scenario, "ttl_s": ttl,
                  "socket": str(reef.config.scoped_socket_path)}, status=201)


async def handle_revoke_token(request: web.Request) -> web.Response:
    reef = request.ctx
    token = (await object_body(request)).get("token")
    if not isinstance(token, str):
        raise BadRequest("token is required (a scoped token)", param="token")
    return json_response({"revoked": reef.scopes.revoke(token)})


async def handle_metrics(request: web.Request) -> web.Response:
    reef = request.ctx
    for name, w in (await warning.standing(reef.store)).items():  # read from the store: true after a restart
        reef.metrics.scenario_warning.labels(name).set(1 if w.get("state") == "warned" else 0)
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
            made.append(dumpb(openapi.document(router.routes(), v)))
        return web.Response(made[0])

    return handle
