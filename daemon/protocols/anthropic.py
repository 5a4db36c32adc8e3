"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``) <-> the neutral ``Exchange``.

Owns: request validation and translation (top-level ``system``, mid-conversation ``role: "system"`` messages as
Claude Code sends them, content blocks, client tools, tool_use / tool_result round trips, thinking blocks), the
non-streaming ``Message`` body, the SSE event sequence (``message_start`` ... ``message_stop``, the receipt as a
``reef`` field on ``message_stop``), and Anthropic's error shape.

Neutral conventions (shared by all protocol modules): ``Exchange.tool_choice`` is ``None`` (not given),
``"auto"``, ``"none"``, ``"required"`` or ``{"name": <tool>}``; ``Usage.input_tokens`` counts all prompt tokens,
cached ones included (Anthropic's ``input_tokens`` is rendered as that minus cache reads and writes).
"""

from __future__ import annotations

from typing import Any

from daemon.errors import BadRequest, ReefError, Unsupported
from daemon.exchange import (
    Completion,
    EngineEvent,
    Exchange,
    Message,
    Part,
    Receipt,
    TextDelta,
    ThinkingDelta,
    Tool,
    ToolCallDelta,
    ToolCallStart,
    Usage,
)
from daemon.protocols.sse import (
    dumps,
    field,
    missing_events,
    need_object,
    new_id,
    parse_arguments,
    sampling,
    sse,
    stream_flag,
)

FORMAT = "anthropic"

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}
_ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


# --- requests ---------------------------------------------------------------------------------------------------


def parse_request(body: object) -> Exchange:
    return _parse(body, count_tokens=False)


def parse_count_tokens(body: object) -> Exchange:
    """Like ``parse_request``, but ``max_tokens`` is not required."""
    return _parse(body, count_tokens=True)


def _parse(body: object, *, count_tokens: bool) -> Exchange:
    body = need_object(body, "")
    model = field(body, "model", "string", required=True)
    if not count_tokens:
        field(body, "max_tokens", "integer", required=True)
    messages: list[Message] = []
    if (system := body.get("system")) is not None:
        messages += _message({"role": "system", "content": system}, "system", content_param="system")
    raw = field(body, "messages", "array", required=True)
    if not raw:
        raise BadRequest("messages: must contain at least one message", param="messages")
    for i, m in enumerate(raw):
        messages += _message(m, f"messages[{i}]")
    return Exchange(
        format=FORMAT,
        model=model,
        messages=messages,
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        sampling=sampling(body, ("max_tokens",), "stop_sequences"),
        stream=stream_flag(body),
        body=body,
    )


def _message(m: Any, where: str, content_param: str | None = None) -> list[Message]:
    """One Anthropic message -> neutral messages: tool results first (one ``tool`` message each), then the rest."""
    m = need_object(m, where)
    role = field(m, "role", "string", where + ".", required=True)
    if role not in ("user", "assistant", "system"):
        raise BadRequest(f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}", param=f"{where}.role")
    cp = content_param or f"{where}.content"
    content = m.get("content")
    if isinstance(content, str):
        return [Message(role, [Part("text", text=content)])]
    if not isinstance(content, list):
        kind = "field required" if content is None else "expected string or array of content blocks"
        raise BadRequest(f"{cp}: {kind}", param=cp)
    tool_messages: list[Message] = []
    parts: list[Part] = []
    for j, block in enumerate(content):
        p = f"{cp}[{j}]"
        block = need_object(block, p)
        kind = field(block, "type", "string", p + ".", required=True)
        if kind == "text":
            parts.append(Part("text", text=field(block, "text", "string", p + ".", required=True)))
        elif kind == "image":
            parts.append(_image(block, p))
        elif kind == "document":
            parts.append(Part("text", text=_document(block, p)))
        elif kind == "thinking":
            parts.append(Part("thinking", text=field(block, "thinking", "string", p + ".") or ""))
        elif kind == "tool_use":
            if role != "assistant":
                raise BadRequest(f"{p}: tool_use blocks belong in assistant messages", param=f"{p}.type")
            parts.append(
                Part(
                    "tool_call",
                    id=field(block, "id", "string", p + ".", required=True),
                    name=field(block, "name", "string", p + ".", required=True),
                    arguments=dumps(field(block, "input", "object", p + ".") or {}),
                )
            )
        elif kind == "tool_result":
            if role != "user":
                raise BadRequest(f"{p}: tool_result blocks belong in user messages", param=f"{p}.type")
            tool_messages.append(_tool_result(block, p))
        elif kind in ("redacted_thinking", "container_upload") or kind.endswith(("_tool_use", "_tool_result")):
            continue  # server-side tool traffic and encrypted thinking: nothing an engine can use
        else:
            raise BadRequest(f"{p}.type: unknown content block type {kind!r}", param=f"{p}.type")
    if tool_messages and not parts:
        return tool_messages
    return [*tool_messages, Message(role, parts)]


def _image(block: dict[str, Any], p: str) -> Part:
    source = field(block, "source", "object", p + ".", required=True)
    kind = field(source, "type", "string", p + ".source.", required=True)
    if kind == "base64":
        media_type = field(source, "media_type", "string", p + ".source.", required=True)
        data = field(source, "data", "string", p + ".source.", required=True)
        return Part("image", media_type=media_type, source=f"data:{media_type};base64,{data}")
    if kind == "url":
        return Part("image", source=field(source, "url", "string", p + ".source.", required=True))
    raise Unsupported(f"{p}.source.type: image source {kind!r} is not supported", param=f"{p}.source.type")


def _document(block: dict[str, Any], p: str) -> str:
    """A plain-text document becomes text; PDFs and files are refused."""
    source = field(block, "source", "object", p + ".", required=True)
    kind = field(source, "type", "string", p + ".source.", required=True)
    if kind == "text":
        return field(source, "data", "string", p + ".source.", required=True)
    raise Unsupported(f"{p}.source.type: document source {kind!r} is not supported", param=f"{p}.source.type")


def _tool_result(block: dict[str, Any], p: str) -> Message:
    call_id = field(block, "tool_use_id", "string", p + ".", required=True)
    is_error = bool(field(block, "is_error", "boolean", p + "."))
    content = block.get("content")
    texts: list[str] = []
    images: list[Part] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for k, b in enumerate(content):
            q = f"{p}.content[{k}]"
            b = need_object(b, q)
            kind = field(b, "type", "string", q + ".", required=True)
            if kind == "text":
                texts.append(field(b, "text", "string", q + ".", required=True))
            elif kind == "image":
                images.append(_image(b, q))
            elif kind == "document":
                texts.append(_document(b, q))
            elif kind not in ("search_result", "tool_reference"):
                raise BadRequest(f"{q}.type: unknown tool result block type {kind!r}", param=f"{q}.type")
    elif content is not None:
        raise BadRequest(f"{p}.content: expected string or array of content blocks", param=f"{p}.content")
    result = Part("tool_result", tool_call_id=call_id, text="\n".join(texts), is_error=is_error)
    return Message("tool", [result, *images])


def _tools(body: dict[str, Any]) -> list[Tool]:
    tools: list[Tool] = []
    for i, t in enumerate(field(body, "tools", "array") or []):
        p = f"tools[{i}]."
        t = need_object(t, p[:-1])
        if field(t, "type", "string", p) not in (None, "custom"):
            continue  # server tools (web_search_...) and Anthropic-defined tools (bash_...) carry no schema
        tools.append(
            Tool(
                name=field(t, "name", "string", p, required=True),
                description=field(t, "description", "string", p) or "",
                parameters=field(t, "input_schema", "object", p, required=True),
            )
        )
    return tools


def _tool_choice(body: dict[str, Any]) -> Any:
    tc = field(body, "tool_choice", "object")
    if tc is None:
        return None
    kind = field(tc, "type", "string", "tool_choice.", required=True)
    if kind == "tool":
        return {"name": field(tc, "name", "string", "tool_choice.", required=True)}
    if kind not in _TOOL_CHOICE:
        raise BadRequest(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")
    return _TOOL_CHOICE[kind]


# --- responses --------------------------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, int]:
    return {
        "input_tokens": max(u.input_tokens - u.cache_read_tokens - u.cache_write_tokens, 0),
        "output_tokens": u.output_tokens,
        "cache_creation_input_tokens": u.cache_write_tokens,
        "cache_read_input_tokens": u.cache_read_tokens,
    }


def _stop(c: Completion) -> tuple[str, str | None]:
    reason = _STOP.get(c.stop_reason, "end_turn")
    return reason, (c.stop_sequence if reason == "stop_sequence" else None)


def render_response(ex: Exchange, c: Completion, *, response_id: str, created: int, receipt: Receipt | None) -> dict:
    content: list[dict[str, Any]] = []
    if c.thinking:
        content.append({"type": "thinking", "thinking": c.thinking, "signature": ""})
    if c.text:
        content.append({"type": "text", "text": c.text})
    for call in c.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": call.id or new_id("toolu_"),
                "name": call.name,
                "input": parse_arguments(call.arguments),
            }
        )
    stop_reason, stop_sequence = _stop(c)
    out: dict[str, Any] = {
        "id": response_id,
        "type": "message",
        "role": "assistant",
        "model": ex.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(c.usage),
    }
    if receipt is not None:
        out["reef"] = receipt.to_dict()
    return out


def render_count_tokens(n: int) -> dict:
    return {"input_tokens": n}


class StreamRenderer:
    """Engine events -> Anthropic SSE frames. Content blocks open lazily and close when the kind switches."""

    def __init__(self, ex: Exchange, *, response_id: str, created: int) -> None:
        self.ex, self.id = ex, response_id
        self.block = -1  # index of the last content block opened
        self.open: Any = None  # "text", "thinking", ("tool", engine index) or None
        self.text = self.thinking = ""
        self.tools = 0

    def start(self) -> list[bytes]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.ex.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [sse({"type": "message_start", "message": message}, "message_start")]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.block}, "content_block_stop")]

    def _open(self, kind: Any, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self.block += 1
        self.open = kind
        frames.append(
            sse({"type": "content_block_start", "index": self.block, "content_block": block}, "content_block_start")
        )
        return frames

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self.block, "delta": delta}, "content_block_delta")

    def event(self, ev: EngineEvent) -> list[bytes]:
        if isinstance(ev, TextDelta) and ev.text:
            frames = [] if self.open == "text" else self._open("text", {"type": "text", "text": ""})
            self.text += ev.text
            return [*frames, self._delta({"type": "text_delta", "text": ev.text})]
        if isinstance(ev, ThinkingDelta) and ev.text:
            if self.open == "thinking":
                frames = []
            else:
                frames = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += ev.text
            return [*frames, self._delta({"type": "thinking_delta", "thinking": ev.text})]
        if isinstance(ev, ToolCallStart):
            self.tools += 1
            block = {"type": "tool_use", "id": ev.id or new_id("toolu_"), "name": ev.name, "input": {}}
            return self._open(("tool", ev.index), block)
        if isinstance(ev, ToolCallDelta) and ev.arguments and self.open == ("tool", ev.index):
            # (a delta for a call whose block is already closed cannot be sent in this format; engines stream
            # tool calls one after another)
            return [self._delta({"type": "input_json_delta", "partial_json": ev.arguments})]
        return []

    def finish(self, c: Completion, receipt: Receipt | None) -> list[bytes]:
        frames: list[bytes] = []
        for ev in missing_events(c, self.text, self.thinking, self.tools):
            frames += self.event(ev)
        frames += self._close()
        stop_reason, stop_sequence = _stop(c)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        frames.append(sse({"type": "message_delta", "delta": delta, "usage": _usage(c.usage)}, "message_delta"))
        stop: dict[str, Any] = {"type": "message_stop"}
        if receipt is not None:
            stop["reef"] = receipt.to_dict()
        frames.append(sse(stop, "message_stop"))
        return frames

    def error(self, err: ReefError) -> list[bytes]:
        return [sse(error_body(err), "error")]


def error_body(err: ReefError) -> dict:
    kind = err.type if err.type in _ERROR_TYPES else "invalid_request_error" if err.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": err.message}}
