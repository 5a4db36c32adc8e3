"""The provider routes: chat completions, responses and messages in each provider's format, token
counts, models, and the daemon's liveness."""

from __future__ import annotations

import os
import time

from daemon import web
from daemon.bodies import discard, is_big, read_parsed
from daemon.errors import (
    ReefError,
)
from daemon.model_dirs import is_test_model
from daemon.protocols import anthropic
from daemon.protocols.base import WireFormat
from daemon.routes.common import Handler, json_response, scenario_and_run
from daemon.serving import Answer


def provider_handler(wire: WireFormat) -> Handler:
    """A provider route: the request parsed into an ``Exchange`` (in ``wire``'s format), served by the serve path
    (``daemon/serving.py``), its answer sent whole or as a stream of server-sent events."""

    async def handle(request: web.Request) -> web.Response | web.StreamResponse:
        reef = request.ctx
        scenario, run = scenario_and_run(request)
        exchange, text = await read_parsed(request, reef.config.max_body_bytes, wire.parse_request, quiet=True)
        exchange.headers, exchange.query = request.headers, request.query_string
        try:
            try:
                answer = await reef.serve_path.serve(wire, exchange, scenario=scenario, run=run,
                                                     headers=request.headers, request_text=text,
                                                     watch=request.watch)
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
    scenario, _ = scenario_and_run(request)
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
    return json_response(anthropic.render_count_tokens(n))


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
    return json_response(
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
    return json_response({"name": "reef", "api": ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/reef/status"]})


async def handle_healthz(request: web.Request) -> web.Response:
    reef = request.ctx
    models = {"loaded": sorted(reef._engines), "loading": sorted(reef.loading),
              "waiting": dict(sorted(reef.waiting.items())), "failed": dict(sorted(reef.load_errors.items()))}
    return json_response({"ok": True, "pid": _pid(), "uptime_s": round(time.time() - reef.started_at, 3), "models": models})


def _pid() -> int:
    return os.getpid()
