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
import hmac
import logging

from daemon import listening, openapi, web
from daemon.errors import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    ReefError,
    Unauthorized,
)
from daemon.protocols import formats
from daemon.routes.admin import (
    handle_events,
    handle_inflight,
    handle_metrics,
    handle_mint_token,
    handle_revoke_token,
    handle_status,
    openapi_handler,
)
from daemon.routes.common import Handler, dumpb, object_body
from daemon.routes.harness import (
    handle_evolve,
    handle_harness,
    handle_harness_install,
    handle_move_model,
    handle_promote_task,
    handle_proposal,
    handle_proposals,
)
from daemon.routes.provider import (
    handle_count_tokens,
    handle_head,
    handle_healthz,
    handle_models,
    handle_root,
    provider_handler,
)
from daemon.routes.records import (
    handle_export,
    handle_forget,
    handle_import,
    handle_record,
    handle_records,
    handle_report,
    handle_scenario_records,
)
from daemon.routes.releases import (
    handle_bundle,
    handle_canary,
    handle_canary_end,
    handle_eval,
    handle_measure,
    handle_release,
    handle_release_page,
    handle_releases,
    handle_scenario_release,
    handle_scenario_release_page,
    steer_handler,
)
from daemon.routes.scenarios import (
    handle_accept_warning,
    handle_create_scenario,
    handle_scenario,
    handle_scenarios,
    handle_start_run,
    handle_update_settings,
    switch_handler,
)
from daemon.serving import Reef

log = logging.getLogger("reef.http")


def _token_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    key = request.headers.get("x-api-key")
    return None if key is None else str(key)


def error_response(request: web.Request, err: ReefError) -> web.Response:
    wire = formats.for_path(request.path)
    body = wire.error_body(err) if wire is not None else {"error": err.to_dict()}
    raw = err.data.get("status")
    status = raw if isinstance(raw, int) else err.status
    resp = web.Response(dumpb(body), status=status, close=status == 413)
    if isinstance(rid := err.data.get("record_id"), str):  # a failed exchange that was recorded
        resp.headers["x-reef-agent-record-id"] = rid
    if isinstance(retry := err.data.get("retry_after"), dict):  # an upstream's 429/503: when to try again
        resp.headers.update(retry)
    return resp


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
                served: web.Response | web.StreamResponse = await scope.serve(request, handler, object_body)
                return served
            return await handler(request)
        except ReefError as err:
            reef.metrics.errors.labels(request.route, err.type).inc()
            return error_response(request, err)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("unexpected error on %s %s", request.method, request.path)
            internal = ReefError(f"internal error: {type(exc).__name__}")
            reef.metrics.errors.labels(request.route, internal.type).inc()
            return error_response(request, internal)

    return dispatch


def refusal_body(status: int, message: str) -> bytes:
    """The body of an answer to a request refused before it reached a route (malformed, head too large)."""
    err = ReefError(message) if status >= 500 else BadRequest(message, status=status)
    return dumpb({"error": err.to_dict()})


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
    r.add("GET", "/reef/scenarios/{name}/eval", handle_eval)
    r.add("POST", "/reef/scenarios/{name}/eval", handle_measure)
    r.add("POST", "/reef/scenarios/{name}/rollback", steer_handler("rollback"))
    r.add("POST", "/reef/scenarios/{name}/promote", steer_handler("promote"))
    r.add("POST", "/reef/scenarios/{name}/bundle", handle_bundle)
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
    r.add("POST", "/reef/scenarios/{name}/accept-warning", handle_accept_warning)
    r.add("POST", "/reef/scenarios/{name}/settings", handle_update_settings)
    r.add("POST", "/reef/scenarios/{name}/capture", switch_handler())
    r.add("POST", "/reef/scenarios/{name}/canary", handle_canary)
    r.add("GET", "/reef/scenarios/{name}/canary", handle_canary)
    r.add("POST", "/reef/scenarios/{name}/canary/end", handle_canary_end)
    r.add("POST", "/reef/scenarios/{name}/archive", switch_handler(archived=True))
    r.add("POST", "/reef/scenarios/{name}/unarchive", switch_handler(archived=False))
    r.add("GET", "/reef/harness/install", handle_harness_install)
    r.add("GET", "/reef/status", handle_status)
    r.add("GET", "/reef/inflight", handle_inflight)
    r.add("GET", "/reef/events", handle_events)
    r.add("POST", "/reef/tokens", handle_mint_token)
    r.add("POST", "/reef/tokens/revoke", handle_revoke_token)
    return r
