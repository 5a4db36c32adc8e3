"""What every route module shares: JSON responses, a body that must be an object, query numbers."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from daemon import web
from daemon.bodies import read_json
from daemon.errors import (
    BadRequest,
)
from daemon.names import check_run, check_scenario
from daemon.serving import Reef

MAX_REFERENCES = 10_000


Handler = Callable[[web.Request], Awaitable["web.Response | web.StreamResponse"]]


def dumpb(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # what orjson refuses (integers beyond 64 bits)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def dumps(value: Any) -> str:
    return dumpb(value).decode()


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(dumpb(value), status=status, headers=headers)


def scenario_and_run(request: web.Request) -> tuple[str, str | None]:
    scenario = request.match_info.get("scenario") or request.headers.get("x-reef-scenario") or "default"
    run = request.match_info.get("run") or request.headers.get("x-reef-run") or None
    check_scenario(scenario)
    if run is not None:
        check_run(run)
    return scenario, run


async def object_body(request: web.Request) -> dict[str, Any]:
    reef = request.ctx
    body = await read_json(request, reef.config.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def plain(value: Any) -> Any:
    """A recipe's settings as JSON: what the user set and every default (``effective_settings``)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def int_param(request: web.Request, name: str, default: int | None, lo: int, hi: int) -> int | None:
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


async def existing_scenario(reef: Reef, name: str) -> Any:
    check_scenario(name)
    scenario = await reef.store.scenarios.get(name)
    return await reef.scenario(scenario.name)
