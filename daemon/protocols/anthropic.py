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

import re
from typing import Any, Final

from daemon.errors import BadRequest, ReefError, Unsupported, UpstreamError
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
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    Usage,
)
from daemon.protocols.sse import (
    bad_upstream,
    check_translatable,
    dumps,
    field,
    loads,
    missing_events,
    need_object,
    new_id,
    parse_arguments,
    request_intent,
    sampling,
    sse,
    stream_flag,
    system_text,
    with_receipt,
)

FORMAT: Final = "anthropic"  # a WireFormat (daemon/protocols/base.py): this module
PATH = "/v1/messages"
ID_PREFIX = "msg_"  # answer ids

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
        text: str = field(source, "data", "string", p + ".source.", required=True)
        return text
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


def render_response(ex: Exchange, c: Completion, *, response_id: str, created: int, receipt: Receipt | None) -> dict[str, Any]:
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


def render_count_tokens(n: int) -> dict[str, Any]:
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
        message: dict[str, Any] = {
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


def relay_finish(final: tuple[str | None, str], receipt: Receipt | None) -> list[bytes]:
    """The end of a relayed Messages stream: the upstream's ``message_stop``, with the receipt added."""
    return [with_receipt(final, receipt)]


def error_body(err: ReefError) -> dict[str, Any]:
    kind = err.type if err.type in _ERROR_TYPES else "invalid_request_error" if err.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# --- the upstream direction: an exchange as a Messages request, a Messages answer as a completion -----------------
#
# Used by ``daemon/engines/upstream.py`` when the upstream speaks Messages and the client does not (an Anthropic
# client has its body passed through). Choices:
# - System messages before the first turn become the top-level ``system`` (one text block per part). A system
#   message later in the conversation stays where it was given: it becomes a text block
#   ``<system-reminder>...</system-reminder>`` in the user turn at that point (merged with the neighbouring user
#   content; Messages wants alternating turns and tool results first in a user turn). Hoisting it to the top would
#   move an instruction given at turn N to the start of the conversation; the tag is the convention Claude models
#   read mid-conversation instructions in.
# - ``max_tokens`` is required here: the client's limit, else ``max_tokens`` given by the caller (the engine
#   passes the model entry's ``max_new_tokens`` when set, else 4096).
# - Thinking of earlier turns is dropped (Messages only takes it back with the signature Anthropic issued);
#   OpenAI ``reasoning_effort`` has no budget equivalent and is dropped too; ``temperature`` is capped at 1
#   (Messages' range); ``seed`` has no equivalent and is dropped. Structured output (``response_format``) and
#   log-probs are refused (400). Tool-call ids are kept, with characters Messages refuses replaced by ``_``
#   (the same way in calls and results, so they still match).

_FROM_STOP: dict[str, Any] = {
    "end_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "stop_sequence": "stop_sequence",
    "pause_turn": "stop",
    "refusal": "stop",
    "model_context_window_exceeded": "length",
}
_TO_TOOL_CHOICE = {"auto": "auto", "required": "any", "none": "none"}
_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")
DEFAULT_MAX_TOKENS = 4096


def render_request(
    ex: Exchange, *, model: str, stream: bool, max_tokens: int = DEFAULT_MAX_TOKENS
) -> dict[str, Any]:
    """``ex`` (any source format) as a Messages request body for an upstream."""
    intent = request_intent(ex)
    check_translatable(ex, intent, FORMAT, json_format=False)
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for m in ex.messages:
        if m.role == "system":
            if not turns:
                system += [{"type": "text", "text": p.text} for p in m.parts if p.type == "text" and p.text]
            elif text := system_text(m):
                _append(turns, "user", [{"type": "text", "text": f"<system-reminder>\n{text}\n</system-reminder>"}])
            continue
        blocks: list[dict[str, Any]] = []
        for p in m.parts:
            if p.type == "text" and p.text:
                blocks.append({"type": "text", "text": p.text})
            elif p.type == "image":
                blocks.append(_image_block(p))
            elif p.type == "tool_call" and m.role == "assistant":
                blocks.append(
                    {"type": "tool_use", "id": _tool_id(p.id), "name": p.name,
                     "input": parse_arguments(p.arguments or "")}
                )
            elif p.type == "tool_result":
                blocks.append(_tool_result_block(p, [q for q in m.parts if q.type == "image"]))
        if m.role == "tool":
            blocks = [b for b in blocks if b["type"] == "tool_result"]
        _append(turns, "assistant" if m.role == "assistant" else "user", blocks)
    for turn in turns:  # tool results open a user turn
        if turn["role"] == "user":
            turn["content"].sort(key=lambda b: b["type"] != "tool_result")
    body: dict[str, Any] = {"model": model, "max_tokens": ex.sampling.max_tokens or max_tokens}
    if system:
        body["system"] = system
    body["messages"] = [t for t in turns if t["content"]]
    if ex.tools:
        body["tools"] = [
            {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "input_schema": t.parameters if t.parameters.get("type") else {"type": "object", **t.parameters},
            }
            for t in ex.tools
        ]
        tc = ex.tool_choice
        choice: dict[str, Any] | None = None
        if isinstance(tc, dict):
            choice = {"type": "tool", "name": tc["name"]}
        elif tc is not None:
            choice = {"type": _TO_TOOL_CHOICE.get(tc, "auto")}
        if intent.parallel_tool_calls is False and (choice or {}).get("type") != "none":
            choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
        if choice is not None:
            body["tool_choice"] = choice
    s = ex.sampling
    if s.temperature is not None:
        body["temperature"] = min(s.temperature, 1.0)
    if s.top_p is not None:
        body["top_p"] = s.top_p
    if s.top_k is not None:
        body["top_k"] = s.top_k
    if s.stop:
        body["stop_sequences"] = list(s.stop)
    if stream:
        body["stream"] = True
    return body


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"] += blocks
    else:
        turns.append({"role": role, "content": list(blocks)})


def _tool_id(call_id: str | None) -> str:
    return _BAD_ID_CHARS.sub("_", call_id) if call_id else new_id("toolu_")


def _image_block(p: Part) -> dict[str, Any]:
    source = p.source or ""
    if source.startswith("data:"):
        head, _, data = source.partition(",")
        if not head.endswith(";base64"):
            raise Unsupported("images: only base64 data URLs and http(s) URLs can be sent to an anthropic upstream")
        media_type = p.media_type or head[5:].split(";", 1)[0]
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": source}}


def _tool_result_block(p: Part, images: list[Part]) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": _tool_id(p.tool_call_id)}
    if images:
        content: list[dict[str, Any]] = [{"type": "text", "text": p.text}] if p.text else []
        block["content"] = content + [_image_block(i) for i in images]
    else:
        block["content"] = p.text
    if p.is_error:
        block["is_error"] = True
    return block


def usage_from(u: Any) -> Usage:
    """A Messages ``usage`` object as neutral usage: ``input_tokens`` counts cache reads and writes too."""
    if not isinstance(u, dict):
        return Usage()

    def n(key: str) -> int:
        v = u.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    read, write = n("cache_read_input_tokens"), n("cache_creation_input_tokens")
    return Usage(
        input_tokens=n("input_tokens") + read + write,
        output_tokens=n("output_tokens"),
        cache_read_tokens=read,
        cache_write_tokens=write,
    )


def _upstream_error(err: Any) -> UpstreamError:
    if isinstance(err, dict):
        return UpstreamError(f"upstream error in the stream ({err.get('type')}): {err.get('message')}")
    return UpstreamError(f"upstream error in the stream: {err}")


def parse_response(body: Any) -> Completion:
    """An upstream's non-streaming ``message`` as a completion."""
    if not isinstance(body, dict):
        raise bad_upstream("message (not an object)")
    if body.get("type") == "error":
        raise _upstream_error(body.get("error"))
    content = body.get("content")
    if not isinstance(content, list):
        raise bad_upstream("message (no content)")
    text, thinking, calls = [], [], []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(ToolCall(id=block.get("id") or new_id("toolu_"), name=block.get("name") or "",
                                  arguments=dumps(block.get("input") or {})))
    usage = body.get("usage")
    stop = _FROM_STOP.get(str(body.get("stop_reason")), "stop")
    return Completion(
        text="".join(text),
        tool_calls=calls,
        stop_reason="tool_calls" if calls and stop == "stop" else stop,
        stop_sequence=got if isinstance(got := body.get("stop_sequence"), str) else None,
        usage=usage_from(usage),
        model=got if isinstance(got := body.get("model"), str) else "",
        thinking="".join(thinking),
        upstream=usage if isinstance(usage, dict) else None,
    )


class StreamParser:
    """An upstream's Messages SSE stream -> engine events, then the assembled completion.

    ``done`` turns true at ``message_stop``; an ``error`` event raises ``UpstreamError``. Usage is the
    ``message_start`` usage updated by ``message_delta``'s (which carries the final counts).
    """

    def __init__(self) -> None:
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[tuple[str, str, list[str]]] = []  # id, name, argument pieces
        self.blocks: dict[int, Any] = {}  # content block index -> "text", "thinking", call number or None
        self.usage: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.model = ""
        self.done = False

    def feed(self, event: str | None, data: str) -> list[EngineEvent]:
        try:
            d = loads(data)
        except ValueError:
            raise bad_upstream("stream event (not JSON)") from None
        if not isinstance(d, dict):
            raise bad_upstream("stream event (not an object)")
        kind = d.get("type") or event
        if kind == "content_block_delta":
            return self._delta(d.get("index"), got if isinstance(got := d.get("delta"), dict) else {})
        if kind == "content_block_start":
            return self._start(d.get("index"), d.get("content_block") or {})
        if kind == "content_block_stop":
            block = self.blocks.get(d.get("index"))  # type: ignore[arg-type]
            if isinstance(block, int) and not self.calls[block][2]:
                self.calls[block][2].append("{}")
                return [ToolCallDelta(block, "{}")]
            return []
        if kind == "message_start":
            msg = got if isinstance(got := d.get("message"), dict) else {}
            if isinstance(msg.get("model"), str):
                self.model = msg["model"]
            if isinstance(msg.get("usage"), dict):
                self.usage.update(msg["usage"])
        elif kind == "message_delta":
            delta = got if isinstance(got := d.get("delta"), dict) else {}
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            if isinstance(delta.get("stop_sequence"), str):
                self.stop_sequence = delta["stop_sequence"]
            if isinstance(d.get("usage"), dict):
                self.usage.update({k: v for k, v in d["usage"].items() if v is not None})
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            raise _upstream_error(d.get("error"))
        return []

    def _start(self, index: Any, block: dict[str, Any]) -> list[EngineEvent]:
        kind = block.get("type")
        if kind == "text":
            self.blocks[index] = "text"
            return self._delta(index, {"type": "text_delta", "text": block.get("text") or ""})
        if kind == "thinking":
            self.blocks[index] = "thinking"
            return self._delta(index, {"type": "thinking_delta", "thinking": block.get("thinking") or ""})
        if kind == "tool_use":
            n = len(self.calls)
            self.blocks[index] = n
            self.calls.append((block.get("id") or new_id("toolu_"), block.get("name") or "", []))
            out: list[EngineEvent] = [ToolCallStart(n, self.calls[n][0], self.calls[n][1])]
            if block.get("input"):
                out += self._delta(index, {"type": "input_json_delta", "partial_json": dumps(block["input"])})
            return out
        self.blocks[index] = None  # redacted thinking, server tool traffic: nothing to relay
        return []

    def _delta(self, index: Any, delta: dict[str, Any]) -> list[EngineEvent]:
        block = self.blocks.get(index)
        kind = delta.get("type")
        if kind == "text_delta" and block == "text" and (text := delta.get("text")):
            self.text.append(text)
            return [TextDelta(text)]
        if kind == "thinking_delta" and block == "thinking" and (text := delta.get("thinking")):
            self.thinking.append(text)
            return [ThinkingDelta(text)]
        if kind == "input_json_delta" and isinstance(block, int) and (part := delta.get("partial_json")):
            self.calls[block][2].append(part)
            return [ToolCallDelta(block, part)]
        return []  # signature_delta, citations_delta: no neutral equivalent

    def finish(self) -> Completion:
        calls = [ToolCall(id=c[0], name=c[1], arguments="".join(c[2]) or "{}") for c in self.calls]
        stop = _FROM_STOP.get(self.stop_reason or "end_turn", "stop")
        return Completion(
            text="".join(self.text),
            tool_calls=calls,
            stop_reason="tool_calls" if calls and stop == "stop" else stop,
            stop_sequence=self.stop_sequence,
            usage=usage_from(self.usage),
            model=self.model,
            thinking="".join(self.thinking),
            upstream=self.usage or None,
        )
