"""What the three protocol modules share: SSE framing, ids, request field checks, stream catch-up.

- ``sse`` frames one server-sent event; ``DONE`` is OpenAI chat's terminator.
- ``field`` / ``sampling`` check request fields by JSON type and raise ``BadRequest`` naming the exact param
  (``messages[3].content[0].type``), so a malformed body never surfaces as a ``KeyError`` or a 500.
- ``missing_events`` lets a stream renderer emit whatever a ``Completion`` holds that the engine did not stream
  (an engine that yields only ``Finish`` still produces a well-formed stream).
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

from daemon.errors import BadRequest
from daemon.exchange import (
    Completion,
    EngineEvent,
    Part,
    Sampling,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    ToolCallStart,
)

DONE = b"data: [DONE]\n\n"


def dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE frame: ``event: X`` (if given) and one ``data:`` line of compact JSON (or the string as is)."""
    text = data if isinstance(data, str) else dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def new_id(prefix: str) -> str:
    """A short random id such as ``call_3f9a...`` (24 hex digits)."""
    return prefix + secrets.token_hex(12)


# --- request field checks -------------------------------------------------------------------------------------

_KINDS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number" if math.isfinite(v) else str(v)
    return {str: "string", dict: "object", list: "array"}.get(type(v), type(v).__name__)


def field(obj: dict[str, Any], key: str, kind: str, where: str = "", *, required: bool = False) -> Any:
    """``obj[key]`` checked to be a JSON ``kind`` (string, integer, number, boolean, object, array).

    Absent or null gives ``None`` unless ``required``. ``where`` is the param prefix (``"messages[2]."``).
    """
    value = obj.get(key)
    if value is None:
        if required:
            raise BadRequest(f"{where}{key}: field required", param=f"{where}{key}")
        return None
    if not _KINDS[kind](value):
        raise BadRequest(f"{where}{key}: expected {kind}, got {json_type(value)}", param=f"{where}{key}")
    return value


def need_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        what = "request body" if not param else param
        raise BadRequest(f"{what}: expected object, got {json_type(value)}", param=param or None)
    return value


def sampling(body: dict[str, Any], max_keys: tuple[str, ...], stop_key: str) -> Sampling:
    """The sampling fields every format shares; the first present of ``max_keys`` is the token limit."""
    s = Sampling()
    for key in max_keys:
        if (n := field(body, key, "integer")) is not None:
            if n < 1:
                raise BadRequest(f"{key}: must be a positive integer, got {n}", param=key)
            s.max_tokens = n if s.max_tokens is None else s.max_tokens
    if (t := field(body, "temperature", "number")) is not None:
        if t < 0:
            raise BadRequest(f"temperature: must be >= 0, got {t}", param="temperature")
        s.temperature = float(t)
    if (p := field(body, "top_p", "number")) is not None:
        if not 0 <= p <= 1:
            raise BadRequest(f"top_p: must be between 0 and 1, got {p}", param="top_p")
        s.top_p = float(p)
    if (k := field(body, "top_k", "integer")) is not None:
        if k < 0:
            raise BadRequest(f"top_k: must be >= 0, got {k}", param="top_k")
        s.top_k = k
    s.seed = field(body, "seed", "integer")
    stop = body.get(stop_key)
    if isinstance(stop, str):
        s.stop = [stop]
    elif stop is not None:
        if not isinstance(stop, list):
            raise BadRequest(f"{stop_key}: expected string or array of strings, got {json_type(stop)}", param=stop_key)
        for i, x in enumerate(stop):
            if not isinstance(x, str):
                raise BadRequest(f"{stop_key}[{i}]: expected string, got {json_type(x)}", param=f"{stop_key}[{i}]")
        s.stop = list(stop)
    return s


def stream_flag(body: dict[str, Any]) -> bool:
    return bool(field(body, "stream", "boolean"))


def image_url_part(url: Any, param: str) -> Part:
    """An image given by URL (``data:image/png;base64,...`` or ``https://...``)."""
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{param}: expected a non-empty URL string, got {json_type(url)}", param=param)
    media_type = None
    if url.startswith("data:"):
        media_type = url[5:].split(",", 1)[0].split(";", 1)[0] or None
    return Part(type="image", media_type=media_type, source=url)


def tool_arguments(value: Any, param: str) -> str:
    """Tool-call arguments as JSON text (OpenAI sends a string; a stray object is serialised)."""
    if isinstance(value, str):
        return value
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return dumps(value)
    raise BadRequest(f"{param}: expected string, got {json_type(value)}", param=param)


def parse_arguments(arguments: str) -> dict[str, Any]:
    """Tool-call arguments as an object (Anthropic's ``input``); malformed or non-object JSON gives ``{}``."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# --- streams ----------------------------------------------------------------------------------------------------


def missing_events(c: Completion, text: str, thinking: str, tool_calls: int) -> list[EngineEvent]:
    """Events for what ``c`` holds beyond what was streamed (``text``/``thinking`` so far, ``tool_calls`` started)."""
    out: list[EngineEvent] = []
    if c.thinking.startswith(thinking) and len(c.thinking) > len(thinking):
        out.append(ThinkingDelta(c.thinking[len(thinking) :]))
    if c.text.startswith(text) and len(c.text) > len(text):
        out.append(TextDelta(c.text[len(text) :]))
    for index, call in enumerate(c.tool_calls[tool_calls:], start=tool_calls):
        out += [ToolCallStart(index, call.id, call.name), ToolCallDelta(index, call.arguments)]
    return out
