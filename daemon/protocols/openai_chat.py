"""OpenAI Chat Completions (``POST /v1/chat/completions``) <-> the neutral ``Exchange``.

Owns: request validation and translation (system/developer messages, multi-part content, function tools, assistant
``tool_calls`` and ``tool`` results, the legacy ``functions`` / ``function_call`` / ``role: "function"`` forms),
the non-streaming ``chat.completion`` body, the ``chat.completion.chunk`` stream (receipt in a last chunk with
``"choices": []`` before ``[DONE]``) and OpenAI's error shape. Thinking is rendered as ``reasoning_content``,
the field OpenAI-compatible servers use for it. Neutral conventions: see ``daemon/protocols/anthropic.py``.
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
    DONE,
    field,
    image_url_part,
    json_type,
    missing_events,
    need_object,
    new_id,
    sampling,
    sse,
    stream_flag,
    tool_arguments,
)

FORMAT = "openai-chat"

_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "stop_sequence": "stop"}
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# --- requests ---------------------------------------------------------------------------------------------------


def parse_request(body: object) -> Exchange:
    body = need_object(body, "")
    model = field(body, "model", "string", required=True)
    raw = field(body, "messages", "array", required=True)
    if not raw:
        raise BadRequest("messages: must contain at least one message", param="messages")
    if (n := field(body, "n", "integer")) not in (None, 1):
        raise Unsupported(f"n: only one choice per request is supported, got {n}", param="n")
    options = field(body, "stream_options", "object") or {}
    return Exchange(
        format=FORMAT,
        model=model,
        messages=[_message(m, f"messages[{i}]") for i, m in enumerate(raw)],
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        sampling=sampling(body, ("max_completion_tokens", "max_tokens"), "stop"),
        stream=stream_flag(body),
        body=body,
        stream_usage=options.get("include_usage") is True,
    )


def _message(m: Any, where: str) -> Message:
    m = need_object(m, where)
    w = where + "."
    role = field(m, "role", "string", w, required=True)
    if role not in _ROLES:
        raise BadRequest(f"{w}role: must be one of {', '.join(_ROLES)}; got {role!r}", param=f"{w}role")
    parts = _parts(m.get("content"), f"{w}content")
    if role in ("tool", "function"):
        call_id = field(m, "tool_call_id" if role == "tool" else "name", "string", w, required=True)
        text = "".join(p.text for p in parts if p.type == "text")
        result = Part("tool_result", tool_call_id=call_id, text=text)
        return Message("tool", [result, *(p for p in parts if p.type == "image")])
    if role == "assistant":
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if isinstance(reasoning, str):
            parts.insert(0, Part("thinking", text=reasoning))
        for k, call in enumerate(field(m, "tool_calls", "array", w) or []):
            q = f"{w}tool_calls[{k}]."
            call = need_object(call, q[:-1])
            fn = field(call, "function", "object", q, required=True)
            parts.append(
                Part(
                    "tool_call",
                    id=field(call, "id", "string", q, required=True),
                    name=field(fn, "name", "string", q + "function.", required=True),
                    arguments=tool_arguments(fn.get("arguments"), q + "function.arguments"),
                )
            )
        if (fc := field(m, "function_call", "object", w)) is not None:  # legacy: the call's id is its name
            name = field(fc, "name", "string", w + "function_call.", required=True)
            arguments = tool_arguments(fc.get("arguments"), w + "function_call.arguments")
            parts.append(Part("tool_call", id=name, name=name, arguments=arguments))
    return Message("system" if role == "developer" else role, parts)


def _parts(content: Any, p: str) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [Part("text", text=content)]
    if not isinstance(content, list):
        raise BadRequest(f"{p}: expected string or array of content parts, got {json_type(content)}", param=p)
    parts: list[Part] = []
    for j, part in enumerate(content):
        q = f"{p}[{j}]"
        part = need_object(part, q)
        kind = field(part, "type", "string", q + ".", required=True)
        if kind == "text":
            parts.append(Part("text", text=field(part, "text", "string", q + ".", required=True)))
        elif kind == "refusal":
            parts.append(Part("text", text=field(part, "refusal", "string", q + ".", required=True)))
        elif kind == "image_url":
            image = part.get("image_url")
            parts.append(image_url_part(image.get("url") if isinstance(image, dict) else image, q + ".image_url.url"))
        elif kind in ("input_audio", "file"):
            raise Unsupported(f"{q}.type: {kind} content is not supported", param=f"{q}.type")
        else:
            raise BadRequest(f"{q}.type: unknown content part type {kind!r}", param=f"{q}.type")
    return parts


def _tools(body: dict[str, Any]) -> list[Tool]:
    specs: list[tuple[str, Any]] = []
    for i, t in enumerate(field(body, "tools", "array") or []):
        t = need_object(t, f"tools[{i}]")
        if field(t, "type", "string", f"tools[{i}].") in (None, "function"):  # custom tools carry no schema
            specs.append((f"tools[{i}].function", t.get("function")))
    specs += [(f"functions[{i}]", f) for i, f in enumerate(field(body, "functions", "array") or [])]
    tools = []
    for p, fn in specs:
        fn = need_object(fn, p)
        tools.append(
            Tool(
                name=field(fn, "name", "string", p + ".", required=True),
                description=field(fn, "description", "string", p + ".") or "",
                parameters=field(fn, "parameters", "object", p + ".") or {},
            )
        )
    return tools


def _tool_choice(body: dict[str, Any]) -> Any:
    tc = body.get("tool_choice")
    if tc is None:
        return None
    if isinstance(tc, str):
        if tc not in ("auto", "none", "required"):
            raise BadRequest(f"tool_choice: must be auto, none or required, got {tc!r}", param="tool_choice")
        return tc
    tc = need_object(tc, "tool_choice")
    if tc.get("type") == "function":
        fn = field(tc, "function", "object", "tool_choice.", required=True)
        return {"name": field(fn, "name", "string", "tool_choice.function.", required=True)}
    return "auto"  # allowed_tools, custom: no narrower neutral form


# --- responses --------------------------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cache_read_tokens},
    }


def render_response(ex: Exchange, c: Completion, *, response_id: str, created: int, receipt: Receipt | None) -> dict:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": c.text or (None if c.tool_calls else ""),
        "refusal": None,
    }
    if c.thinking:
        message["reasoning_content"] = c.thinking
    if c.tool_calls:
        message["tool_calls"] = [
            {"id": t.id or new_id("call_"), "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in c.tool_calls
        ]
    out: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": ex.model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": _FINISH.get(c.stop_reason, "stop"), "logprobs": None}
        ],
        "usage": _usage(c.usage),
    }
    if receipt is not None:
        out["reef"] = receipt.to_dict()
    return out


class StreamRenderer:
    """Engine events -> ``chat.completion.chunk`` frames."""

    def __init__(self, ex: Exchange, *, response_id: str, created: int) -> None:
        self.ex, self.id, self.created = ex, response_id, created
        self.text = self.thinking = ""
        self.calls: dict[int, int] = {}  # engine tool-call index -> chat tool_calls index

    def _chunk(self, delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ex.model}
        return sse({**chunk, "choices": choices, **extra})

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def event(self, ev: EngineEvent) -> list[bytes]:
        if isinstance(ev, TextDelta) and ev.text:
            self.text += ev.text
            return [self._chunk({"content": ev.text})]
        if isinstance(ev, ThinkingDelta) and ev.text:
            self.thinking += ev.text
            return [self._chunk({"reasoning_content": ev.text})]
        if isinstance(ev, ToolCallStart):
            index = self.calls[ev.index] = len(self.calls)
            call = {"index": index, "id": ev.id or new_id("call_"), "type": "function"}
            return [self._chunk({"tool_calls": [{**call, "function": {"name": ev.name, "arguments": ""}}]})]
        if isinstance(ev, ToolCallDelta) and ev.arguments and ev.index in self.calls:
            call = {"index": self.calls[ev.index], "function": {"arguments": ev.arguments}}
            return [self._chunk({"tool_calls": [call]})]
        return []

    def finish(self, c: Completion, receipt: Receipt | None) -> list[bytes]:
        frames: list[bytes] = []
        for ev in missing_events(c, self.text, self.thinking, len(self.calls)):
            frames += self.event(ev)
        frames.append(self._chunk({}, _FINISH.get(c.stop_reason, "stop")))
        if self.ex.stream_usage:
            frames.append(self._chunk(usage=_usage(c.usage)))
        if receipt is not None:
            frames.append(self._chunk(reef=receipt.to_dict()))
        return [*frames, DONE]

    def error(self, err: ReefError) -> list[bytes]:
        return [sse(error_body(err))]


def error_body(err: ReefError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "code": err.type, "param": getattr(err, "param", None)}}
