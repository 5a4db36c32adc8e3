"""What the three protocol modules share: SSE framing, ids, request field checks, stream catch-up.

- ``sse`` frames one server-sent event; ``DONE`` is OpenAI chat's terminator.
- ``field`` / ``sampling`` check request fields by JSON type and raise ``BadRequest`` naming the exact param
  (``messages[3].content[0].type``), so a malformed body never surfaces as a ``KeyError`` or a 500.
- ``missing_events`` lets a stream renderer emit whatever a ``Completion`` holds that the engine did not stream
  (an engine that yields only ``Finish`` still produces a well-formed stream).
- The upstream direction (``daemon/engines/upstream.py``): ``SSEDecoder`` splits a provider's stream into
  events as bytes arrive; ``request_intent`` / ``check_translatable`` read what a request asks beyond the
  neutral form and refuse what another format cannot carry without changing the answer.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

import orjson

from daemon.errors import BadRequest, Unsupported, UpstreamError
from daemon.exchange import (
    Completion,
    EngineEvent,
    Exchange,
    Message,
    Part,
    Sampling,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    ToolCallStart,
)

DONE = b"data: [DONE]\n\n"


def dumpb(data: Any) -> bytes:
    """Compact JSON as UTF-8 bytes. orjson (a tenth of the stdlib's time: an 80 kB Claude Code body is dumped in
    about 0.1 ms instead of 1 ms), the stdlib for what orjson refuses (integers beyond 64 bits)."""
    try:
        return orjson.dumps(data)
    except TypeError:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def dumps(data: Any) -> str:
    """Compact JSON text (see ``dumpb``)."""
    return dumpb(data).decode()


loads = orjson.loads  # JSON text or bytes -> value; raises ValueError (orjson.JSONDecodeError) on bad JSON


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE frame: ``event: X`` (if given) and one ``data:`` line of compact JSON (or the string as is)."""
    body = data.encode() if isinstance(data, str) else dumpb(data)
    if event:
        return b"event: " + event.encode() + b"\ndata: " + body + b"\n\n"
    return b"data: " + body + b"\n\n"


def with_receipt(final: tuple[str | None, str], receipt: Any) -> bytes:
    """A relayed stream's held-back final event, re-framed with the receipt as its ``reef`` field."""
    event, data = final
    body = loads(data)
    if receipt is not None and isinstance(body, dict):
        body["reef"] = receipt.to_dict()
    return sse(body, event)


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


_JSON_TYPES: dict[type, str] = {str: "string", dict: "object", list: "array"}


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number" if math.isfinite(v) else str(v)
    return _JSON_TYPES.get(type(v), type(v).__name__)


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


def openai_tool_choice(body: dict[str, Any], nested: bool) -> Any:
    """The neutral tool choice of an OpenAI body: auto, none, required, or ``{"name": ...}`` for a function, named
    at ``tool_choice.function.name`` (chat, ``nested``) or ``tool_choice.name`` (responses). Other kinds
    (allowed_tools, custom, built-in tools) have no narrower neutral form: auto."""
    tc = body.get("tool_choice")
    if tc is None:
        return None
    if isinstance(tc, str):
        if tc not in ("auto", "none", "required"):
            raise BadRequest(f"tool_choice: must be auto, none or required, got {tc!r}", param="tool_choice")
        return tc
    tc = need_object(tc, "tool_choice")
    if tc.get("type") != "function":
        return "auto"
    if nested:
        return {"name": field(field(tc, "function", "object", "tool_choice.", required=True), "name", "string",
                              "tool_choice.function.", required=True)}
    return {"name": field(tc, "name", "string", "tool_choice.", required=True)}


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
        value = loads(arguments) if arguments.strip() else {}
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


# --- the upstream direction: reading a provider's stream, what a request asks beyond the neutral form ----------


class SSEDecoder:
    """Bytes of a server-sent event stream -> events, as chunks arrive (any split, ``\\r\\n`` too).

    ``feed`` gives ``(event, data)`` pairs: comment lines (``: ping``) and fields other than ``event`` and ``data``
    are skipped; several ``data:`` lines of one event are joined with newlines, as the SSE spec says. ``frames``
    gives each event with its exact bytes, ``(raw, event, data)``, for relaying a stream unchanged: ``data`` is
    ``None`` for a block without data (a keep-alive comment).
    """

    __slots__ = ("_buf", "_event", "_data", "_raw")

    def __init__(self) -> None:
        self._buf = b""
        self._event: str | None = None
        self._data: list[str] = []
        self._raw: list[bytes] = []

    def frames(self, chunk: bytes) -> list[tuple[bytes, str | None, str | None]]:
        buf = self._buf + chunk
        if not self._raw and b"\r" not in buf:
            return self._split(buf)
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        out: list[tuple[bytes, str | None, str | None]] = []
        for raw in lines:
            self._line(raw, out)
        return out

    def _split(self, buf: bytes) -> list[tuple[bytes, str | None, str | None]]:
        """The common case, ``\\n`` line ends: whole events split off at blank lines (several times faster than
        line by line); an event's first line is usually ``data:`` or ``event:``. The rest stays in ``_buf``."""
        blocks = buf.split(b"\n\n")
        self._buf = blocks.pop()
        out: list[tuple[bytes, str | None, str | None]] = []
        for block in blocks:
            if not block:
                continue
            if block.startswith(b"data: ") and b"\n" not in block:
                out.append((block + b"\n\n", None, block[6:].decode("utf-8", "replace")))
                continue
            for line in block.split(b"\n"):
                self._line(line, out)
            self._line(b"", out)  # the blank line that ended it
        return out

    def feed(self, chunk: bytes) -> list[tuple[str | None, str]]:
        return [(event, data) for _, event, data in self.frames(chunk) if data is not None]

    def close_frames(self) -> list[tuple[bytes, str | None, str | None]]:
        """What is left when the stream ends: an event not closed by a blank line is still delivered."""
        out: list[tuple[bytes, str | None, str | None]] = []
        for line in self._buf.split(b"\n") if self._buf else ():
            self._line(line, out)
        self._buf = b""
        self._line(b"", out)
        return out

    def close(self) -> list[tuple[str | None, str]]:
        return [(event, data) for _, event, data in self.close_frames() if data is not None]

    def _line(self, raw: bytes, out: list[tuple[bytes, str | None, str | None]]) -> None:
        line = raw[:-1] if raw.endswith(b"\r") else raw
        if not line:
            if self._raw:
                self._raw.append(raw)
                out.append((b"\n".join(self._raw) + b"\n", self._event, "\n".join(self._data) if self._data else None))
            self._event, self._data, self._raw = None, [], []
            return
        self._raw.append(raw)
        if line[:1] == b":":
            return
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")


@dataclass
class Intent:
    """What a request asks beyond the neutral ``Exchange``, read from the body in its own format.

    ``render_request`` of another format uses it to carry what has an equivalent there, and to refuse (400) what
    would change the answer's meaning if dropped: tools without a schema (server-side / built-in tools),
    structured output where the target has none, logprobs (not relayed), options that need server state.
    """

    parallel_tool_calls: bool | None = None
    # {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"}
    json_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # the effort was read from Anthropic's thinking budget, not asked by name: sent only to reasoning models
    effort_from_thinking: bool = False
    # (param, kind) of tools the neutral form has no schema for
    builtin_tools: list[tuple[str, str]] = dc_field(default_factory=list)
    # (param, what): asked for, with no equivalent in any other format
    unsupported: list[tuple[str, str]] = dc_field(default_factory=list)
    logprobs: str | None = None  # the param that asked for log-probs

    def effort_for(self, model: str) -> str | None:
        """The reasoning effort to send ``model``: the one asked by name, or the one read from a thinking budget
        when ``model`` is a reasoning model (other models refuse the field)."""
        if self.effort_from_thinking and not reasoning_model(model):
            return None
        return self.reasoning_effort


_REASONING_MODEL = re.compile(r"(?:^|/)(?:o\d|gpt-5)(?:$|[-.:_])")


def reasoning_model(model: str) -> bool:
    """Whether ``model`` names one of OpenAI's reasoning models (``o3-mini``, ``openai/gpt-5``...)."""
    return _REASONING_MODEL.search(model) is not None


def thinking_effort(budget_tokens: int) -> str:
    """Anthropic's thinking budget as an OpenAI reasoning effort: Claude Code asks 4,000 tokens to "think",
    10,000 to "think hard" and 31,999 to "ultrathink"."""
    return "low" if budget_tokens < 4096 else "medium" if budget_tokens < 16384 else "high"


def request_intent(ex: Exchange) -> Intent:
    body = ex.body
    intent = Intent()
    tools = got if isinstance(got := body.get("tools"), list) else []
    if ex.format == "anthropic":
        tc = body.get("tool_choice")
        if isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is True:
            intent.parallel_tool_calls = False
        for i, t in enumerate(tools):
            if isinstance(t, dict) and t.get("type") not in (None, "custom"):
                intent.builtin_tools.append((f"tools[{i}]", str(t.get("type"))))
        oc = body.get("output_config")
        fmt = (oc.get("format") if isinstance(oc, dict) else None) or body.get("output_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            intent.json_format = {"type": "json_schema", "name": "output", "schema": fmt.get("schema") or {},
                                  "strict": True}
        for key in ("mcp_servers", "container"):
            if body.get(key):
                intent.unsupported.append((key, "Anthropic-hosted MCP servers and containers"))
        thinking = body.get("thinking")
        budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
        if isinstance(thinking, dict) and thinking.get("type") == "enabled" and type(budget) is int:
            intent.reasoning_effort = thinking_effort(budget)
            intent.effort_from_thinking = True
        return intent
    if isinstance(body.get("parallel_tool_calls"), bool):
        intent.parallel_tool_calls = body["parallel_tool_calls"]
    if ex.format == "openai-chat":
        for i, t in enumerate(tools):
            if isinstance(t, dict) and t.get("type") not in (None, "function"):
                intent.builtin_tools.append((f"tools[{i}]", str(t.get("type"))))
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type") == "json_object":
            intent.json_format = {"type": "json_object"}
        elif isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
            js = rf["json_schema"]
            intent.json_format = {"type": "json_schema", "name": js.get("name") or "output",
                                  "schema": js.get("schema") or {}, "strict": js.get("strict") is True}
        if isinstance(body.get("reasoning_effort"), str):
            intent.reasoning_effort = body["reasoning_effort"]
        if body.get("logprobs") is True:
            intent.logprobs = "logprobs"
        if body.get("web_search_options") is not None:
            intent.unsupported.append(("web_search_options", "OpenAI-hosted web search"))
        if body.get("logit_bias"):
            intent.unsupported.append(("logit_bias", "token logit biases"))
        if body.get("audio") is not None or "audio" in (body.get("modalities") or []):
            intent.unsupported.append(("modalities", "audio output"))
        return intent
    # openai-responses
    for i, t in enumerate(tools):
        if isinstance(t, dict) and t.get("type") != "function":
            intent.builtin_tools.append((f"tools[{i}]", str(t.get("type"))))
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        intent.json_format = (
            {"type": "json_object"}
            if fmt["type"] == "json_object"
            else {"type": "json_schema", "name": fmt.get("name") or "output", "schema": fmt.get("schema") or {},
                  "strict": fmt.get("strict") is True}
        )
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        intent.reasoning_effort = reasoning["effort"]
    if body.get("top_logprobs") or "message.output_text.logprobs" in (body.get("include") or []):
        intent.logprobs = "top_logprobs" if body.get("top_logprobs") else "include"
    return intent


def check_translatable(ex: Exchange, intent: Intent, target: str, *, json_format: bool) -> None:
    """Refuse (``Unsupported``, 400) what ``target`` cannot carry and would change the answer if dropped."""
    for param, kind in intent.builtin_tools:
        raise Unsupported(
            f"{param}: the {kind!r} tool is run by the {ex.format} provider itself and has no equivalent in the"
            f" {target} upstream format; send function tools only",
            param=param,
        )
    for param, what in intent.unsupported:
        raise Unsupported(f"{param}: {what} have no equivalent in the {target} upstream format", param=param)
    if intent.logprobs is not None:
        raise Unsupported(f"{intent.logprobs}: log-probs are not relayed from a {target} upstream",
                          param=intent.logprobs)
    if intent.json_format is not None and not json_format:
        raise Unsupported(
            f"structured output ({intent.json_format['type']}) has no equivalent in the {target} upstream format",
            param="response_format" if ex.format == "openai-chat" else "text.format" if ex.format ==
            "openai-responses" else "output_config.format",
        )


def system_text(m: Message) -> str:
    """A system message as one string: its text parts joined by blank lines."""
    return "\n\n".join(p.text for p in m.parts if p.type == "text")


def bad_upstream(what: str) -> UpstreamError:
    return UpstreamError(f"upstream answered a malformed {what}")
