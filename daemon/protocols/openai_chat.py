"""OpenAI Chat Completions (``POST /v1/chat/completions``) <-> the neutral ``Exchange``.

Owns: request validation and translation (system/developer messages, multi-part content, function tools, assistant
``tool_calls`` and ``tool`` results, the legacy ``functions`` / ``function_call`` / ``role: "function"`` forms),
the non-streaming ``chat.completion`` body, the ``chat.completion.chunk`` stream (receipt in a last chunk with
``"choices": []`` before ``[DONE]``) and OpenAI's error shape. Thinking is rendered as ``reasoning_content``,
the field OpenAI-compatible servers use for it. Neutral conventions: see ``daemon/protocols/anthropic.py``.
"""

from __future__ import annotations

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
    DONE,
    bad_upstream,
    check_translatable,
    dumps,
    field,
    image_url_part,
    json_type,
    loads,
    missing_events,
    need_object,
    new_id,
    openai_tool_choice,
    reasoning_model,
    request_intent,
    sampling,
    sse,
    stream_flag,
    system_text,
    tool_arguments,
    with_receipt,
)

FORMAT: Final = "openai-chat"  # a WireFormat (daemon/protocols/base.py): this module
PATH = "/v1/chat/completions"
ID_PREFIX = "chatcmpl-"  # answer ids

_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "stop_sequence": "stop"}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # a chat message's roles (an import checks the same)


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
        tool_choice=openai_tool_choice(body, nested=True),
        sampling=sampling(body, ("max_completion_tokens", "max_tokens"), "stop"),
        stream=stream_flag(body),
        body=body,
        stream_usage=options.get("include_usage") is True,
    )


def _message(m: Any, where: str) -> Message:
    m = need_object(m, where)
    w = where + "."
    role = field(m, "role", "string", w, required=True)
    if role not in ROLES:
        raise BadRequest(f"{w}role: must be one of {', '.join(ROLES)}; got {role!r}", param=f"{w}role")
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


# --- responses --------------------------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cache_read_tokens},
    }


def render_response(ex: Exchange, c: Completion, *, response_id: str, created: int, receipt: Receipt | None) -> dict[str, Any]:
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


def relay_finish(final: tuple[str | None, str], receipt: Receipt | None) -> list[bytes]:
    """The end of a relayed chat stream: a chunk with the receipt (``final``: the upstream's id, created and
    model, no choices), then ``[DONE]``."""
    return [with_receipt(final, receipt), DONE]


def error_body(err: ReefError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "code": err.code or err.type,
                      "param": getattr(err, "param", None)}}


# --- the upstream direction: an exchange as a chat request, a chat answer as a completion ------------------------
#
# Used by ``daemon/engines/upstream.py`` when the upstream speaks chat completions and the client does not (a
# client that speaks chat too has its body passed through). System messages stay system messages where they are
# (chat allows them anywhere; multi-block system prompts are joined by blank lines). Thinking of earlier turns is
# dropped (chat servers take none back, and some refuse it). A tool result with ``is_error`` gets an ``Error: ``
# prefix (chat has no error flag); images in tool results follow the tool messages as one user message (chat tool
# messages carry text only). ``top_k``, Anthropic's ``metadata`` and cache hints have no chat equivalent and are
# dropped; Anthropic's ``thinking`` budget becomes ``reasoning_effort`` for a reasoning model only
# (``sse.Intent.effort_for``); the token limit goes out as ``max_tokens``, the field every chat server accepts,
# except to OpenAI's reasoning models (``o1``, ``o3-mini``, ``o4-mini``, ``gpt-5``..., by name, with or without a
# ``provider/`` prefix): those refuse ``max_tokens`` and take ``max_completion_tokens`` (which counts reasoning
# tokens too), and refuse any ``temperature`` / ``top_p`` but the default, so those are dropped for them.

_FROM_FINISH: dict[str, Any] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "stop",
}


def render_request(ex: Exchange, *, model: str, stream: bool) -> dict[str, Any]:
    """``ex`` (any source format) as a chat completions request body for an upstream."""
    intent = request_intent(ex)
    check_translatable(ex, intent, FORMAT, json_format=True)
    messages: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []  # images of the tool results just rendered
    for m in ex.messages:
        if images and m.role != "tool":
            messages.append(_tool_images(images))
            images = []
        if m.role == "system":
            messages.append({"role": "system", "content": system_text(m)})
        elif m.role == "user":
            messages.append({"role": "user", "content": _render_content(m.parts)})
        elif m.role == "assistant":
            calls = [
                {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments or "{}"}}
                for p in m.parts
                if p.type == "tool_call"
            ]
            msg: dict[str, Any] = {"role": "assistant", "content": m.text or (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
        else:
            for p in m.parts:
                if p.type == "tool_result":
                    text = f"Error: {p.text}" if p.is_error else p.text
                    messages.append({"role": "tool", "tool_call_id": p.tool_call_id, "content": text})
                elif p.type == "image":
                    images.append({"type": "image_url", "image_url": {"url": p.source}})
    if images:
        messages.append(_tool_images(images))
    body: dict[str, Any] = {"model": model, "messages": messages}
    if ex.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.parameters or {"type": "object", "properties": {}},
                },
            }
            for t in ex.tools
        ]
        tc = ex.tool_choice
        if isinstance(tc, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
        elif tc is not None:
            body["tool_choice"] = tc
        if intent.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = intent.parallel_tool_calls
    elif ex.tool_choice == "none":
        body["tool_choice"] = "none"
    s = ex.sampling
    if reasoning_model(model):
        sampling: tuple[tuple[str, float | None], ...] = (("max_completion_tokens", s.max_tokens),
                                                          ("seed", s.seed))
    else:
        sampling = (("max_tokens", s.max_tokens), ("temperature", s.temperature), ("top_p", s.top_p),
                    ("seed", s.seed))
    for key, value in sampling:
        if value is not None:
            body[key] = value
    if s.stop:
        body["stop"] = list(s.stop)
    if (fmt := intent.json_format) is not None:
        body["response_format"] = (
            {"type": "json_object"}
            if fmt["type"] == "json_object"
            else {"type": "json_schema",
                  "json_schema": {"name": fmt["name"], "schema": fmt["schema"], "strict": fmt["strict"]}}
        )
    if (effort := intent.effort_for(model)) is not None:
        body["reasoning_effort"] = effort
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _tool_images(images: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "(images from the tool results above)"}, *images]}


def _render_content(parts: list[Part]) -> str | list[dict[str, Any]]:
    """Message content: a string for one text part, else an array of text and image parts."""
    kept = [p for p in parts if p.type in ("text", "image")]
    if all(p.type == "text" for p in kept) and len(kept) <= 1:
        return kept[0].text if kept else ""
    return [
        {"type": "text", "text": p.text} if p.type == "text" else {"type": "image_url", "image_url": {"url": p.source}}
        for p in kept
    ]


def usage_from(u: Any) -> Usage:
    """A chat ``usage`` object as neutral usage (``prompt_tokens`` already counts cached tokens)."""
    if not isinstance(u, dict):
        return Usage()
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        input_tokens=_int(u.get("prompt_tokens")),
        output_tokens=_int(u.get("completion_tokens")),
        cache_read_tokens=_int(cached),
    )


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text") or p.get("refusal") or "" for p in content if isinstance(p, dict)
        )
    return ""


def _upstream_error(err: Any) -> UpstreamError:
    message = err.get("message") if isinstance(err, dict) else err
    return UpstreamError(f"upstream error in the stream: {message or 'unknown error'}")


def parse_response(body: Any) -> Completion:
    """An upstream's non-streaming ``chat.completion`` as a completion."""
    if not isinstance(body, dict):
        raise bad_upstream("chat completion (not an object)")
    if body.get("error"):
        raise _upstream_error(body["error"])
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad_upstream("chat completion (no choices)")
    choice = choices[0]
    msg = got if isinstance(got := choice.get("message"), dict) else {}
    calls: list[ToolCall] = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments")
            calls.append(
                ToolCall(
                    id=call.get("id") or new_id("call_"),
                    name=fn.get("name") or "",
                    arguments=(args if isinstance(args, str) else dumps(args or {})) or "{}",
                )
            )
    if isinstance(fc := msg.get("function_call"), dict):
        calls.append(ToolCall(id=fc.get("name") or new_id("call_"), name=fc.get("name") or "",
                              arguments=fc.get("arguments") or "{}"))
    thinking = msg.get("reasoning_content") or msg.get("reasoning")
    stop = _FROM_FINISH.get(str(choice.get("finish_reason")), "stop")
    usage = body.get("usage")
    return Completion(
        text=_content_text(msg.get("content")),
        tool_calls=calls,
        stop_reason="tool_calls" if calls and stop == "stop" else stop,
        usage=usage_from(usage),
        model=got if isinstance(got := body.get("model"), str) else "",
        thinking=thinking if isinstance(thinking, str) else "",
        upstream=usage if isinstance(usage, dict) else None,
    )


class StreamParser:
    """An upstream's ``chat.completion.chunk`` stream -> engine events, then the assembled completion.

    Tool calls keep the upstream's ids and are numbered in order of appearance; ``done`` turns true at
    ``[DONE]`` or at a ``finish_reason`` (servers that end the stream without ``[DONE]``).
    """

    def __init__(self) -> None:
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: dict[int, tuple[int, str, str, list[str]]] = {}  # chat index -> (ours, id, name, args)
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model = ""
        self.id = ""
        self.created = 0
        self.chunk: dict[str, Any] = {}  # the last chunk read
        self.ended = False

    @property
    def done(self) -> bool:
        return self.ended or self.finish_reason is not None

    def feed(self, event: str | None, data: str) -> list[EngineEvent]:
        if data == "[DONE]":
            self.ended = True
            return []
        try:
            chunk = loads(data)
        except ValueError:
            raise bad_upstream("stream chunk (not JSON)") from None
        if not isinstance(chunk, dict):
            raise bad_upstream("stream chunk (not an object)")
        if chunk.get("error"):
            raise _upstream_error(chunk["error"])
        self.chunk = chunk
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if not self.id:
            self.id = got if isinstance(got := chunk.get("id"), str) else ""
            self.created = got if isinstance(got := chunk.get("created"), int) else 0
            self.model = got if isinstance(got := chunk.get("model"), str) else ""
        out: list[EngineEvent] = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = got if isinstance(got := choice.get("delta"), dict) else {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self.thinking.append(reasoning)
                out.append(ThinkingDelta(reasoning))
            content = delta.get("content")
            if isinstance(content, str) and content:
                self.text.append(content)
                out.append(TextDelta(content))
            for tc in delta.get("tool_calls") or []:
                if isinstance(tc, dict):
                    out += self._tool_call(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _tool_call(self, tc: dict[str, Any]) -> list[EngineEvent]:
        index = tc.get("index")
        if not isinstance(index, int):  # servers that send whole calls without an index
            index = len(self.calls) if tc.get("id") or not self.calls else max(self.calls)
        fn = got if isinstance(got := tc.get("function"), dict) else {}
        out: list[EngineEvent] = []
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = (len(self.calls), tc.get("id") or new_id("call_"), fn.get("name") or "", [])
            out.append(ToolCallStart(call[0], call[1], call[2]))
        args = fn.get("arguments")
        if isinstance(args, dict):
            args = dumps(args)
        if isinstance(args, str) and args:
            call[3].append(args)
            out.append(ToolCallDelta(call[0], args))
        return out

    def final(self) -> tuple[str | None, str]:
        """The receipt chunk that ends a relayed stream: the upstream's id, created and model, no choices."""
        return None, dumps({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model, "choices": []})

    def finish(self) -> Completion:
        calls = [ToolCall(id=c[1], name=c[2], arguments="".join(c[3]) or "{}") for c in self.calls.values()]
        stop = _FROM_FINISH.get(self.finish_reason or "stop", "stop")
        return Completion(
            text="".join(self.text),
            tool_calls=calls,
            stop_reason="tool_calls" if calls and stop == "stop" else stop,
            usage=usage_from(self.usage),
            model=self.model,
            thinking="".join(self.thinking),
            upstream=self.usage,
        )
