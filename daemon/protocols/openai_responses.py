"""OpenAI Responses (``POST /v1/responses``) <-> the neutral ``Exchange``.

Owns: request validation and translation (``instructions``, ``input`` as a string or a list of items: messages,
``function_call``, ``function_call_output``, ``reasoning``; flat function tools), the ``response`` object, the
SSE event sequence (``response.created`` ... ``response.completed``, every event numbered by ``sequence_number``,
the receipt as a ``reef`` field on the final event) and OpenAI's error shape.

Reef keeps no server-side state: ``previous_response_id`` and ``conversation`` are refused (clients send the full
input, as Codex and the AI SDK do with ``store: false``). A generation cut by the token limit ends, as with
OpenAI, in ``status: "incomplete"`` and a final ``response.incomplete`` event instead of ``response.completed``.
Item types the engine cannot have produced (web_search_call, ...) are skipped. Neutral conventions: see
``daemon/protocols/anthropic.py``.
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
from daemon.protocols.openai_chat import error_body as error_body  # the same error shape as chat
from daemon.protocols.sse import (
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

FORMAT: Final = "openai-responses"  # a WireFormat (daemon/protocols/base.py): this module
PATH = "/v1/responses"
ID_PREFIX = "resp_"  # answer ids

# --- requests ---------------------------------------------------------------------------------------------------


def parse_request(body: object) -> Exchange:
    body = need_object(body, "")
    model = field(body, "model", "string", required=True)
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise Unsupported(f"{key}: no server-side conversation state here; send the full input", param=key)
    messages: list[Message] = []
    if instructions := field(body, "instructions", "string"):
        messages.append(Message("system", [Part("text", text=instructions)]))
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append(Message("user", [Part("text", text=raw)]))
    elif isinstance(raw, list):
        for i, item in enumerate(raw):
            _item(item, f"input[{i}]", messages)
    else:
        kind = "field required" if raw is None else f"expected string or array of items, got {json_type(raw)}"
        raise BadRequest(f"input: {kind}", param="input")
    if all(m.role == "system" for m in messages):
        raise BadRequest("input: must contain at least one item", param="input")
    return Exchange(
        format=FORMAT,
        model=model,
        messages=messages,
        tools=_tools(body),
        tool_choice=openai_tool_choice(body, nested=False),
        sampling=sampling(body, ("max_output_tokens",), "stop"),
        stream=stream_flag(body),
        body=body,
    )


def _assistant(messages: list[Message]) -> Message:
    """The assistant message that reasoning, text and calls of one turn go into."""
    if not messages or messages[-1].role != "assistant":
        messages.append(Message("assistant"))
    return messages[-1]


def _item(item: Any, where: str, messages: list[Message]) -> None:
    item = need_object(item, where)
    w = where + "."
    kind = field(item, "type", "string", w) or "message"
    if kind == "message":
        role = field(item, "role", "string", w, required=True)
        if role not in ("user", "assistant", "system", "developer"):
            raise BadRequest(f"{w}role: must be user, assistant, system or developer; got {role!r}", param=f"{w}role")
        parts = _parts(item.get("content"), w + "content")
        if role == "assistant":
            _assistant(messages).parts += parts
        else:
            messages.append(Message("system" if role == "developer" else role, parts))
    elif kind == "function_call":
        call = Part(
            "tool_call",
            id=field(item, "call_id", "string", w, required=True),
            name=field(item, "name", "string", w, required=True),
            arguments=tool_arguments(item.get("arguments"), w + "arguments"),
        )
        _assistant(messages).parts.append(call)
    elif kind == "function_call_output":
        call_id = field(item, "call_id", "string", w, required=True)
        output = item.get("output")
        parts = [Part("text", text=output)] if isinstance(output, str) else _parts(output, w + "output")
        text = "".join(p.text for p in parts if p.type == "text")
        images = [p for p in parts if p.type == "image"]
        messages.append(Message("tool", [Part("tool_result", tool_call_id=call_id, text=text), *images]))
    elif kind == "reasoning":  # raw reasoning text if sent, else its summary; encrypted-only reasoning is dropped
        if texts := _texts(item.get("content")) or _texts(item.get("summary")):
            _assistant(messages).parts.append(Part("thinking", text="\n".join(texts)))


def _texts(value: Any) -> list[str]:
    return (
        [c["text"] for c in value if isinstance(c, dict) and isinstance(c.get("text"), str)]
        if isinstance(value, list)
        else []
    )


def _parts(content: Any, p: str) -> list[Part]:
    if isinstance(content, str):
        return [Part("text", text=content)]
    if not isinstance(content, list):
        raise BadRequest(f"{p}: expected string or array of content parts, got {json_type(content)}", param=p)
    parts: list[Part] = []
    for j, part in enumerate(content):
        q = f"{p}[{j}]"
        part = need_object(part, q)
        kind = field(part, "type", "string", q + ".", required=True)
        if kind in ("input_text", "output_text", "text"):
            parts.append(Part("text", text=field(part, "text", "string", q + ".", required=True)))
        elif kind == "refusal":
            parts.append(Part("text", text=field(part, "refusal", "string", q + ".", required=True)))
        elif kind == "input_image":
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise Unsupported(f"{q}.file_id: images by file id are not supported", param=f"{q}.file_id")
            parts.append(image_url_part(part.get("image_url"), q + ".image_url"))
        elif kind in ("input_file", "input_audio"):
            raise Unsupported(f"{q}.type: {kind} content is not supported", param=f"{q}.type")
        else:
            raise BadRequest(f"{q}.type: unknown content part type {kind!r}", param=f"{q}.type")
    return parts


def _tools(body: dict[str, Any]) -> list[Tool]:
    tools: list[Tool] = []
    for i, t in enumerate(field(body, "tools", "array") or []):
        p = f"tools[{i}]."
        t = need_object(t, p[:-1])
        if field(t, "type", "string", p) != "function":
            continue  # built-in tools (web_search, file_search, custom, ...) carry no schema
        if isinstance(t.get("function"), dict):  # the chat shape, sent here by mistake by some clients
            t, p = t["function"], p + "function."
        tools.append(
            Tool(
                name=field(t, "name", "string", p, required=True),
                description=field(t, "description", "string", p) or "",
                parameters=field(t, "parameters", "object", p) or {},
            )
        )
    return tools


# --- responses --------------------------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cache_read_tokens, "cache_write_tokens": u.cache_write_tokens},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.input_tokens + u.output_tokens,
    }


def _response(
    ex: Exchange, response_id: str, created: int, output: list[dict[str, Any]], status: str, c: Completion | None = None
) -> dict[str, Any]:
    """The ``response`` object: as rendered in full, and as carried by the stream's lifecycle events."""
    body = ex.body
    tc = ex.tool_choice
    metadata = body.get("metadata")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": ex.model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": got if isinstance(got := body.get("instructions"), str) else None,
        "metadata": metadata
        if isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        else {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": ex.sampling.temperature,
        "top_p": ex.sampling.top_p,
        "max_output_tokens": ex.sampling.max_tokens,
        "tool_choice": {"type": "function", "name": tc["name"]} if isinstance(tc, dict) else tc or "auto",
        "tools": [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": False,
            }
            for t in ex.tools
        ],
        "usage": _usage(c.usage) if c is not None else None,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _status(c: Completion) -> str:
    return "incomplete" if c.stop_reason == "length" else "completed"


def render_response(ex: Exchange, c: Completion, *, response_id: str, created: int, receipt: Receipt | None) -> dict[str, Any]:
    output = []
    if c.thinking:
        output.append(_reasoning_item(new_id("rs_"), c.thinking))
    if c.text or not c.tool_calls:
        output.append(_message_item(new_id("msg_"), c.text, _status(c)))
    for t in c.tool_calls:
        output.append(_call_item(new_id("fc_"), t.id or new_id("call_"), t.name, t.arguments, "completed"))
    out = _response(ex, response_id, created, output, _status(c), c)
    if receipt is not None:
        out["reef"] = receipt.to_dict()
    return out


class StreamRenderer:
    """Engine events -> Responses SSE events. One output item is open at a time; it closes when the kind switches."""

    def __init__(self, ex: Exchange, *, response_id: str, created: int) -> None:
        self.ex, self.id, self.created = ex, response_id, created
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.open: dict[str, Any] | None = None  # the open item: kind, id, index, text / call fields
        self.calls: dict[int, dict[str, Any]] = {}  # engine tool-call index -> its open-item state
        self.text = self.thinking = ""

    def _ev(self, kind: str, **data: Any) -> bytes:
        frame = sse({"type": kind, **data, "sequence_number": self.seq}, kind)
        self.seq += 1
        return frame

    def start(self) -> list[bytes]:
        response = _response(self.ex, self.id, self.created, [], "in_progress")
        return [self._ev("response.created", response=response), self._ev("response.in_progress", response=response)]

    def _open(self, state: dict[str, Any], item: dict[str, Any], part: dict[str, Any] | None) -> list[bytes]:
        frames = self._close()
        state["index"] = index = len(self.items)
        self.open = state
        frames.append(self._ev("response.output_item.added", output_index=index, item=item))
        if part is not None:
            where = {"item_id": state["id"], "output_index": index, "content_index": 0}
            frames.append(self._ev("response.content_part.added", **where, part=part))
        return frames

    def _close(self, status: str = "completed") -> list[bytes]:
        s, self.open = self.open, None
        if s is None:
            return []
        where = {"item_id": s["id"], "output_index": s["index"]}
        if s["kind"] == "message":
            item = _message_item(s["id"], s["text"], status)
            frames = [
                self._ev("response.output_text.done", **where, content_index=0, text=s["text"], logprobs=[]),
                self._ev("response.content_part.done", **where, content_index=0, part=item["content"][0]),
            ]
        elif s["kind"] == "reasoning":
            item = _reasoning_item(s["id"], s["text"])
            frames = [
                self._ev("response.reasoning_text.done", **where, content_index=0, text=s["text"]),
                self._ev("response.content_part.done", **where, content_index=0, part=item["content"][0]),
            ]
        else:
            item = _call_item(s["id"], s["call_id"], s["name"], s["text"], "completed")
            frames = [self._ev("response.function_call_arguments.done", **where, name=s["name"], arguments=s["text"])]
        self.items.append(item)
        return [*frames, self._ev("response.output_item.done", output_index=s["index"], item=item)]

    def event(self, ev: EngineEvent) -> list[bytes]:
        if isinstance(ev, TextDelta | ThinkingDelta) and ev.text:
            kind = "message" if isinstance(ev, TextDelta) else "reasoning"
            frames: list[bytes] = []
            if self.open is None or self.open["kind"] != kind:
                state = {"kind": kind, "id": new_id("msg_" if kind == "message" else "rs_"), "text": ""}
                if kind == "message":
                    item = {**_message_item(state["id"], "", "in_progress"), "content": []}
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                else:
                    item = {**_reasoning_item(state["id"], ""), "content": []}
                    part = {"type": "reasoning_text", "text": ""}
                frames = self._open(state, item, part)
            s = self.open
            assert s is not None
            s["text"] += ev.text
            where = {"item_id": s["id"], "output_index": s["index"], "content_index": 0}
            if kind == "message":
                self.text += ev.text
                return [*frames, self._ev("response.output_text.delta", **where, delta=ev.text, logprobs=[])]
            self.thinking += ev.text
            return [*frames, self._ev("response.reasoning_text.delta", **where, delta=ev.text)]
        if isinstance(ev, ToolCallStart):
            state = {
                "kind": "call",
                "id": new_id("fc_"),
                "call_id": ev.id or new_id("call_"),
                "name": ev.name,
                "text": "",
            }
            self.calls[ev.index] = state
            return self._open(state, _call_item(state["id"], state["call_id"], ev.name, "", "in_progress"), None)
        if (
            isinstance(ev, ToolCallDelta)
            and ev.arguments
            and self.open is not None
            and self.open is self.calls.get(ev.index)
        ):
            # (a delta for a call already closed cannot be sent any more; engines stream calls one after another)
            self.open["text"] += ev.arguments
            where = {"item_id": self.open["id"], "output_index": self.open["index"]}
            return [self._ev("response.function_call_arguments.delta", **where, delta=ev.arguments)]
        return []

    def finish(self, c: Completion, receipt: Receipt | None) -> list[bytes]:
        frames: list[bytes] = []
        for ev in missing_events(c, self.text, self.thinking, len(self.calls)):
            frames += self.event(ev)
        status = _status(c)
        frames += self._close(status)
        data: dict[str, Any] = {"response": _response(self.ex, self.id, self.created, self.items, status, c)}
        if receipt is not None:
            data["reef"] = receipt.to_dict()
        return [*frames, self._ev(f"response.{status}", **data)]

    def error(self, err: ReefError) -> list[bytes]:
        code = "server_error" if err.status >= 500 else "invalid_prompt"
        failed = _response(self.ex, self.id, self.created, self.items, "failed")
        failed["error"] = {"code": code, "message": err.message}
        return [
            self._ev("error", code=err.type, message=err.message, param=getattr(err, "param", None)),
            self._ev("response.failed", response=failed),
        ]


def relay_finish(final: tuple[str | None, str], receipt: Receipt | None) -> list[bytes]:
    """The end of a relayed Responses stream: the upstream's ``response.completed`` (or ``.incomplete``), with
    the receipt added."""
    return [with_receipt(final, receipt)]


# --- the upstream direction: an exchange as a Responses request, a Responses answer as a completion ---------------
#
# Used by ``daemon/engines/upstream.py`` when the upstream speaks Responses and the client does not (a Responses
# client has its body passed through). Choices: system messages before the first turn become ``instructions``
# (joined by blank lines), later ones stay in place as ``role: "system"`` input messages; requests are stateless
# (``store: false``, the full input every time); function tools go out with ``strict: false`` (Responses
# defaults to strict schemas, which ordinary tool schemas fail); thinking of earlier turns is dropped (Responses
# takes reasoning back only as its own encrypted items); a tool result with ``is_error`` gets an ``Error: ``
# prefix. ``seed`` and ``top_k`` have no equivalent and are dropped; stop sequences have none either and are
# refused (400), since dropping them would let the answer run past where the client wants it cut. OpenAI's
# reasoning models (``sse.reasoning_model``) get no ``temperature`` / ``top_p`` (they refuse them), and
# Anthropic's ``thinking`` budget as ``reasoning.effort``; other models get no effort read from a budget.


def render_request(ex: Exchange, *, model: str, stream: bool) -> dict[str, Any]:
    """``ex`` (any source format) as a Responses request body for an upstream."""
    intent = request_intent(ex)
    check_translatable(ex, intent, FORMAT, json_format=True)
    if ex.sampling.stop:
        param = "stop_sequences" if ex.format == "anthropic" else "stop"
        raise Unsupported(f"{param}: the {FORMAT} upstream format has no stop sequences", param=param)
    instructions: list[str] = []
    items: list[dict[str, Any]] = []
    for m in ex.messages:
        if m.role == "system":
            if not items:
                instructions.append(system_text(m))
            else:
                items.append({"type": "message", "role": "system",
                              "content": [{"type": "input_text", "text": system_text(m)}]})
        elif m.role == "user":
            items.append({"type": "message", "role": "user", "content": _input_content(m.parts)})
        elif m.role == "assistant":
            if text := m.text:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": text}]})
            for p in m.parts:
                if p.type == "tool_call":
                    items.append({"type": "function_call", "call_id": p.id, "name": p.name,
                                  "arguments": p.arguments or "{}"})
        else:
            images = [p for p in m.parts if p.type == "image"]
            for p in m.parts:
                if p.type == "tool_result":
                    text = f"Error: {p.text}" if p.is_error else p.text
                    output: Any = text
                    if images:
                        output = [{"type": "input_text", "text": text}] if text else []
                        output += [{"type": "input_image", "image_url": i.source} for i in images]
                    items.append({"type": "function_call_output", "call_id": p.tool_call_id, "output": output})
    body: dict[str, Any] = {"model": model}
    if instructions:
        body["instructions"] = "\n\n".join(instructions)
    body["input"] = items
    if ex.tools:
        body["tools"] = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
                "strict": False,
            }
            for t in ex.tools
        ]
        tc = ex.tool_choice
        if isinstance(tc, dict):
            body["tool_choice"] = {"type": "function", "name": tc["name"]}
        elif tc is not None:
            body["tool_choice"] = tc
        if intent.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = intent.parallel_tool_calls
    s = ex.sampling
    sampling: tuple[tuple[str, Any], ...] = (("max_output_tokens", s.max_tokens),)
    if not reasoning_model(model):  # OpenAI's reasoning models refuse temperature and top_p but the default
        sampling += (("temperature", s.temperature), ("top_p", s.top_p))
    for key, value in sampling:
        if value is not None:
            body[key] = value
    if (fmt := intent.json_format) is not None:
        body["text"] = {"format": fmt}
    if (effort := intent.effort_for(model)) is not None:
        body["reasoning"] = {"effort": effort}
    body["store"] = False
    if stream:
        body["stream"] = True
    return body


def _input_content(parts: list[Part]) -> list[dict[str, Any]]:
    return [
        {"type": "input_text", "text": p.text}
        if p.type == "text"
        else {"type": "input_image", "image_url": p.source, "detail": "auto"}
        for p in parts
        if p.type in ("text", "image")
    ]


def usage_from(u: Any) -> Usage:
    """A Responses ``usage`` object as neutral usage (``input_tokens`` already counts cached tokens)."""
    if not isinstance(u, dict):
        return Usage()

    def n(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    details = got if isinstance(got := u.get("input_tokens_details"), dict) else {}
    return Usage(
        input_tokens=n(u.get("input_tokens")),
        output_tokens=n(u.get("output_tokens")),
        cache_read_tokens=n(details.get("cached_tokens")),
        cache_write_tokens=n(details.get("cache_write_tokens")),
    )


def _failed(response: Any) -> UpstreamError:
    err = response.get("error") if isinstance(response, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return UpstreamError(f"upstream response failed: {message or 'no reason given'}")


def _stop(status: Any, details: Any, calls: bool) -> Any:
    if status == "incomplete":
        reason = details.get("reason") if isinstance(details, dict) else None
        return "stop" if reason == "content_filter" else "length"
    return "tool_calls" if calls else "stop"


def _item_texts(item: dict[str, Any]) -> tuple[str, str]:
    """(text, thinking) of one output item."""
    if item.get("type") == "message":
        parts = got if isinstance(got := item.get("content"), list) else []
        return "".join(p.get("text") or p.get("refusal") or "" for p in parts if isinstance(p, dict)), ""
    if item.get("type") == "reasoning":
        texts = _texts(item.get("content")) or _texts(item.get("summary"))
        return "", "\n".join(texts)
    return "", ""


def parse_response(body: Any) -> Completion:
    """An upstream's non-streaming ``response`` object as a completion."""
    if not isinstance(body, dict):
        raise bad_upstream("response (not an object)")
    if body.get("status") == "failed" or (body.get("error") and not body.get("output")):
        raise _failed(body)
    output = body.get("output")
    if not isinstance(output, list):
        raise bad_upstream("response (no output)")
    text, thinking, calls = [], [], []
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            args = item.get("arguments")
            calls.append(ToolCall(id=item.get("call_id") or new_id("call_"), name=item.get("name") or "",
                                  arguments=(args if isinstance(args, str) else dumps(args or {})) or "{}"))
        else:
            t, r = _item_texts(item)
            text.append(t)
            if r:
                thinking.append(r)
    usage = body.get("usage")
    return Completion(
        text="".join(text),
        tool_calls=calls,
        stop_reason=_stop(body.get("status"), body.get("incomplete_details"), bool(calls)),
        usage=usage_from(usage),
        model=got if isinstance(got := body.get("model"), str) else "",
        thinking="\n".join(thinking),
        upstream=usage if isinstance(usage, dict) else None,
    )


class StreamParser:
    """An upstream's Responses SSE stream -> engine events, then the assembled completion.

    Text, reasoning and function-call arguments are relayed from their deltas; an item whose deltas never came
    (servers that send only ``output_item.done``) is relayed whole when it is done. ``done`` turns true at
    ``response.completed`` or ``response.incomplete``; ``response.failed`` and ``error`` raise ``UpstreamError``.
    """

    def __init__(self) -> None:
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[tuple[str, str, list[str]]] = []  # call_id, name, argument pieces
        self.by_item: dict[Any, int] = {}  # item id or output index -> call number
        self.streamed: set[Any] = set()  # items (id or output index) whose text came as deltas
        self.response: dict[str, Any] = {}
        self.done = False

    def feed(self, event: str | None, data: str) -> list[EngineEvent]:
        try:
            d = loads(data)
        except ValueError:
            raise bad_upstream("stream event (not JSON)") from None
        if not isinstance(d, dict):
            raise bad_upstream("stream event (not an object)")
        kind = d.get("type") or event
        key = d.get("item_id") or d.get("output_index")
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            if delta := d.get("delta"):
                self.streamed.add(key)
                self.text.append(delta)
                return [TextDelta(delta)]
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            if delta := d.get("delta"):
                self.streamed.add(key)
                self.thinking.append(delta)
                return [ThinkingDelta(delta)]
        elif kind == "response.function_call_arguments.delta":
            n = self._call_of(d)
            if n is not None and (delta := d.get("delta")):
                self.calls[n][2].append(delta)
                return [ToolCallDelta(n, delta)]
        elif kind == "response.output_item.added":
            item = got if isinstance(got := d.get("item"), dict) else {}
            if item.get("type") == "function_call":
                return self._start_call(item, d.get("output_index"))
        elif kind == "response.output_item.done":
            item = got if isinstance(got := d.get("item"), dict) else {}
            return self._item_done(item, d.get("output_index"))
        elif kind in ("response.created", "response.in_progress"):
            if isinstance(d.get("response"), dict):
                self.response = d["response"]
        elif kind in ("response.completed", "response.incomplete"):
            if isinstance(d.get("response"), dict):
                self.response = d["response"]
            self.done = True
        elif kind == "response.failed":
            raise _failed(d.get("response"))
        elif kind == "error":
            raise UpstreamError(f"upstream error in the stream ({d.get('code')}): {d.get('message')}")
        return []

    def _call_of(self, d: dict[str, Any]) -> int | None:
        n = self.by_item.get(d.get("item_id"))
        return self.by_item.get(d.get("output_index")) if n is None else n

    def _start_call(self, item: dict[str, Any], output_index: Any) -> list[EngineEvent]:
        n = len(self.calls)
        self.calls.append((item.get("call_id") or new_id("call_"), item.get("name") or "", []))
        self.by_item[output_index] = n
        if item.get("id") is not None:
            self.by_item[item["id"]] = n
        out: list[EngineEvent] = [ToolCallStart(n, self.calls[n][0], self.calls[n][1])]
        if args := item.get("arguments"):
            self.calls[n][2].append(args)
            out.append(ToolCallDelta(n, args))
        return out

    def _item_done(self, item: dict[str, Any], output_index: Any) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        if item.get("type") == "function_call":
            n = self.by_item.get(item.get("id"), self.by_item.get(output_index))
            if n is None:
                return self._start_call(item, output_index)
            args = item.get("arguments")
            have = "".join(self.calls[n][2])
            if isinstance(args, str) and args.startswith(have) and len(args) > len(have):
                self.calls[n][2].append(args[len(have):])
                out.append(ToolCallDelta(n, args[len(have):]))
            return out
        if item.get("id", output_index) in self.streamed or output_index in self.streamed:
            return out
        text, thinking = _item_texts(item)
        if thinking:
            self.thinking.append(thinking)
            out.append(ThinkingDelta(thinking))
        if text:
            self.text.append(text)
            out.append(TextDelta(text))
        return out

    def finish(self) -> Completion:
        calls = [ToolCall(id=c[0], name=c[1], arguments="".join(c[2]) or "{}") for c in self.calls]
        r = self.response
        usage = r.get("usage")
        return Completion(
            text="".join(self.text),
            tool_calls=calls,
            stop_reason=_stop(r.get("status"), r.get("incomplete_details"), bool(calls)),
            usage=usage_from(usage),
            model=got if isinstance(got := r.get("model"), str) else "",
            thinking="".join(self.thinking),
            upstream=usage if isinstance(usage, dict) else None,
        )
