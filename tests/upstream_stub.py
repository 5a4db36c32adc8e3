"""A small provider stand-in for the upstream tests: answers in all three formats and fails on demand.

Run: ``python tests/upstream_stub.py PORT``. Routes: ``POST [<prefix>]/v1/chat/completions``, ``/v1/responses``,
``/v1/messages``, ``/v1/messages/count_tokens`` (any path prefix is accepted); ``GET /_stub/requests`` lists what
it received (path, headers, body), ``DELETE /_stub/requests`` forgets it.

Behaviour is chosen by directives ``[stub:NAME]`` or ``[stub:NAME=VALUE]`` in the request's last message (so they
survive any translation on the way), or in the ``x-stub`` header:

- ``status=N``: answer HTTP N with the format's error body (message ``stub refuses: status N``; 429 and 503 come
  with ``Retry-After: 7``);
- ``slow=S``: wait S seconds before the response headers;
- ``after_record=PATH|NONCE``: before the response headers, wait until the SQLite record store at PATH holds a
  record whose request contains NONCE (a stream whose opening write is durable before its first event leaves);
- ``cut=N``: stream N text pieces, then drop the connection (no final event; non-streaming: half a body);
- ``error_event``: stream one text piece, then the format's in-stream error event;
- ``stall=S``: stream up to the first text piece, then wait S seconds before the rest;
- ``tool``: answer with one call of ``get_weather`` ``{"city": "Paris"}`` (id ``call_stub1`` / ``toolu_stub1``);
- ``text=...``: answer this text;
- ``obey=WORD``: answer WORD, or nothing when the system prompt says ``say nothing`` (a model that follows its
  rules exactly: a harness rule that silences it shows in its answers);
- ``echo_system``: answer the request's system prompt (chat and Responses: its system and developer messages,
  Responses ``instructions``; Anthropic: ``system``), or ``no system prompt``: a model that follows its harness;
- ``no_usage`` (chat streams): no usage chunk, even when the request asks for one (as some servers do);
- ``thinking`` (Anthropic): a thinking block with its signature and a ``redacted_thinking`` block come first.

Like OpenAI, a request with a reasoning effort for a model that is not a reasoning model is refused, and a chat
request for a reasoning model (``o3-mini``...) that sends ``max_tokens`` or a ``temperature``
is refused (400). Chat chunks and bodies carry ``system_fingerprint: fp_stub`` (a field Reef does not model).

Without directives it answers ``stub says hello``, or ``tool said: <result>`` when the last message is a tool
result. Usage is fixed: 11 prompt tokens (3 of them cached), 5 output tokens, in each format's own terms.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

from aiohttp import web

DIRECTIVE = re.compile(r"\[stub:([a-z_]+)(?:=([^\]]*))?\]")
RECEIVED: list[dict[str, Any]] = []
TOOL_ARGS = '{"city": "Paris"}'


def dumps(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


def frame(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else dumps(data)}\n\n".encode()


def last_message(fmt: str, body: dict[str, Any]) -> Any:
    if fmt == "responses":
        items = body.get("input")
        return items if isinstance(items, str) else (items or [None])[-1]
    return (body.get("messages") or [None])[-1]


def tool_result_text(fmt: str, last: Any) -> str | None:
    """The text of a tool result if the last message is one."""
    if not isinstance(last, dict):
        return None
    if fmt == "chat" and last.get("role") == "tool":
        c = last.get("content")
        return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [])
    if fmt == "responses" and last.get("type") == "function_call_output":
        out = last.get("output")
        return out if isinstance(out, str) else "".join(p.get("text", "") for p in out or [])
    if fmt == "anthropic" and isinstance(last.get("content"), list):
        for block in last["content"]:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                c = block.get("content")
                return c if isinstance(c, str) else "".join(b.get("text", "") for b in c or [])
    return None


def plan(fmt: str, body: dict[str, Any], header: str) -> dict[str, str]:
    last = last_message(fmt, body)
    directives = {m.group(1): m.group(2) or "" for m in DIRECTIVE.finditer(dumps(last) + " " + header)}
    result = tool_result_text(fmt, last)
    if "echo_system" in directives:
        directives["text"] = system_text(fmt, body) or "no system prompt"
    if "obey" in directives:  # a model that follows its rules: it answers, unless told to say nothing
        directives["text"] = "" if "say nothing" in system_text(fmt, body).lower() else directives["obey"]
    if "text" not in directives:
        directives["text"] = f"tool said: {result}" if result is not None else "stub says hello"
    return directives


def system_text(fmt: str, body: dict[str, Any]) -> str:
    """The system prompt of a request, as plain text."""

    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))

    if fmt == "anthropic":
        return text(body.get("system"))
    items = body.get("messages") if fmt == "chat" else body.get("input")
    parts = [body.get("instructions") or ""] if fmt == "responses" else []
    system = ("system", "developer")
    if isinstance(items, list):
        parts += [text(m.get("content")) for m in items if isinstance(m, dict) and m.get("role") in system]
    return "\n".join(p for p in parts if p)


def error_body(fmt: str, status: int, message: str) -> dict[str, Any]:
    if fmt == "anthropic":
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 529: "overloaded_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": None, "code": None}}


def pieces(text: str) -> list[str]:
    """The text in three pieces (as a model streams it)."""
    n = max(1, len(text) // 3)
    return [p for p in (text[:n], text[n : 2 * n], text[2 * n :]) if p]


# --- chat completions ------------------------------------------------------------------------------------------


def chat_body(model: str, text: str, tool: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None if tool else text}
    if tool:
        message["tool_calls"] = [{"id": "call_stub1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": TOOL_ARGS}}]
    return {
        "id": "chatcmpl-stub", "object": "chat.completion", "created": 1, "model": model,
        "system_fingerprint": "fp_stub", "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool else "stop",
                     "logprobs": None}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16,
                  "prompt_tokens_details": {"cached_tokens": 3}},
    }


def chat_stream(model: str, text: str, tool: bool, usage: bool) -> list[bytes]:
    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return frame({"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1, "model": model,
                      "system_fingerprint": "fp_stub", "choices": choices, **extra})

    out = [chunk({"role": "assistant", "content": ""})]
    if tool:
        call = {"index": 0, "id": "call_stub1", "type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": ""}}
        out.append(chunk({"tool_calls": [call]}))
        for part in (TOOL_ARGS[:8], TOOL_ARGS[8:]):
            out.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}))
    else:
        out += [chunk({"content": p}) for p in pieces(text)]
    out.append(chunk({}, "tool_calls" if tool else "stop"))
    if usage:
        out.append(chunk(None, usage=chat_body(model, "", False)["usage"]))
    return [*out, b"data: [DONE]\n\n"]


# --- responses ---------------------------------------------------------------------------------------------------

RESP_USAGE = {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 5,
              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 16}


def responses_items(text: str, tool: bool) -> list[dict[str, Any]]:
    if tool:
        return [{"id": "fc_stub1", "type": "function_call", "call_id": "call_stub1", "name": "get_weather",
                 "arguments": TOOL_ARGS, "status": "completed"}]
    return [{"id": "msg_stub1", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": text, "annotations": []}]}]


def responses_body(model: str, text: str, tool: bool, status: str = "completed") -> dict[str, Any]:
    return {"id": "resp_stub", "object": "response", "created_at": 1, "status": status, "model": model,
            "output": responses_items(text, tool) if status != "in_progress" else [], "error": None,
            "incomplete_details": None, "usage": RESP_USAGE if status != "in_progress" else None}


def responses_stream(model: str, text: str, tool: bool) -> list[bytes]:
    seq = 0

    def ev(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        return frame({"type": kind, "sequence_number": seq, **data}, kind)

    out = [ev("response.created", response=responses_body(model, "", False, "in_progress"))]
    item = responses_items(text, tool)[0]
    if tool:
        out.append(ev("response.output_item.added", output_index=0, item={**item, "arguments": "",
                                                                          "status": "in_progress"}))
        for part in (TOOL_ARGS[:8], TOOL_ARGS[8:]):
            out.append(ev("response.function_call_arguments.delta", item_id="fc_stub1", output_index=0, delta=part))
        out.append(ev("response.function_call_arguments.done", item_id="fc_stub1", output_index=0,
                      arguments=TOOL_ARGS))
    else:
        out.append(ev("response.output_item.added", output_index=0, item={**item, "content": [],
                                                                          "status": "in_progress"}))
        out.append(ev("response.content_part.added", item_id="msg_stub1", output_index=0, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": []}))
        for p in pieces(text):
            out.append(ev("response.output_text.delta", item_id="msg_stub1", output_index=0, content_index=0,
                          delta=p))
        out.append(ev("response.output_text.done", item_id="msg_stub1", output_index=0, content_index=0, text=text))
    out.append(ev("response.output_item.done", output_index=0, item=item))
    out.append(ev("response.completed", response=responses_body(model, text, tool)))
    return out


# --- anthropic messages ------------------------------------------------------------------------------------------

ANTH_USAGE = {"input_tokens": 8, "cache_read_input_tokens": 3, "cache_creation_input_tokens": 0, "output_tokens": 5}


THINKING = [{"type": "thinking", "thinking": "Let me think.", "signature": "c2lnbmF0dXJlLXN0dWI="},
            {"type": "redacted_thinking", "data": "ZW5jcnlwdGVkLXN0dWI="}]


def anthropic_body(model: str, text: str, tool: bool, thinking: bool = False) -> dict[str, Any]:
    content = ([{"type": "tool_use", "id": "toolu_stub1", "name": "get_weather", "input": json.loads(TOOL_ARGS)}]
               if tool else [{"type": "text", "text": text}])
    if thinking:
        content = THINKING + content
    return {"id": "msg_stub", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None, "usage": ANTH_USAGE}


def anthropic_stream(model: str, text: str, tool: bool, thinking: bool = False) -> list[bytes]:
    start = {**anthropic_body(model, "", False), "content": [], "stop_reason": None,
             "usage": {**ANTH_USAGE, "output_tokens": 1}}
    out = [frame({"type": "message_start", "message": start}, "message_start"), frame({"type": "ping"}, "ping")]
    first = 0
    if thinking:
        deltas = [{"type": "thinking_delta", "thinking": THINKING[0]["thinking"]},
                  {"type": "signature_delta", "signature": THINKING[0]["signature"]}]
        out.append(frame({"type": "content_block_start", "index": 0,
                          "content_block": {"type": "thinking", "thinking": "", "signature": ""}}, "content_block_start"))
        out += [frame({"type": "content_block_delta", "index": 0, "delta": d}, "content_block_delta") for d in deltas]
        out.append(frame({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        out.append(frame({"type": "content_block_start", "index": 1, "content_block": THINKING[1]},
                         "content_block_start"))
        out.append(frame({"type": "content_block_stop", "index": 1}, "content_block_stop"))
        first = 2
    if tool:
        block = {"type": "tool_use", "id": "toolu_stub1", "name": "get_weather", "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in ("", TOOL_ARGS[:8], TOOL_ARGS[8:])]
    else:
        block = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in pieces(text)]
    out.append(frame({"type": "content_block_start", "index": first, "content_block": block}, "content_block_start"))
    out += [frame({"type": "content_block_delta", "index": first, "delta": d}, "content_block_delta") for d in deltas]
    out.append(frame({"type": "content_block_stop", "index": first}, "content_block_stop"))
    delta = {"stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None}
    out.append(frame({"type": "message_delta", "delta": delta, "usage": {"output_tokens": 5}}, "message_delta"))
    return [*out, frame({"type": "message_stop"}, "message_stop")]


# --- the server --------------------------------------------------------------------------------------------------


def in_stream_error(fmt: str) -> bytes:
    if fmt == "anthropic":
        return frame({"type": "error", "error": {"type": "overloaded_error", "message": "stub overloaded"}}, "error")
    if fmt == "responses":
        return frame({"type": "error", "code": "server_error", "message": "stub overloaded", "sequence_number": 99},
                     "error")
    return frame({"error": {"message": "stub overloaded", "type": "server_error"}})


async def record_committed(path: str, nonce: str, guard_s: float = 30) -> None:
    """Poll the store (a reader of its WAL, as any other) until a record whose request holds ``nonce`` is committed;
    ``guard_s``: a hang guard."""
    import sqlite3

    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard_s
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        while conn.execute("SELECT 1 FROM records WHERE instr(request, ?) > 0", (nonce,)).fetchone() is None:
            if loop.time() > deadline:
                raise TimeoutError(f"no record with {nonce} committed in {path}")
            await asyncio.sleep(0.002)
    finally:
        conn.close()


async def handle(request: web.Request) -> web.StreamResponse:
    path = request.path
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    RECEIVED.append({"path": path, "query": request.query_string, "headers": dict(request.headers), "body": body})
    if not isinstance(body, dict):
        return web.json_response({"error": {"message": "stub: body is not a JSON object"}}, status=400)
    if path.endswith("/v1/messages/count_tokens"):
        return web.json_response({"input_tokens": 42})
    fmt = ("chat" if path.endswith("/v1/chat/completions") else "responses" if path.endswith("/v1/responses")
           else "anthropic" if path.endswith("/v1/messages") else None)
    if fmt is None:
        return web.json_response({"error": {"message": f"stub: no route {path}"}}, status=404)
    d = plan(fmt, body, request.headers.get("x-stub", ""))
    model = str(body.get("model"))
    if "slow" in d:
        await asyncio.sleep(float(d["slow"]))
    if "after_record" in d:
        await record_committed(*d["after_record"].split("|"))
    if "status" in d:
        status = int(d["status"])
        headers = {"Retry-After": "7"} if status in (429, 503) else None
        return web.json_response(error_body(fmt, status, f"stub refuses: status {status}"), status=status,
                                 headers=headers)
    if fmt != "anthropic" and not re.match(r"o\d", model) and ("reasoning_effort" in body or "reasoning" in body):
        param = "reasoning_effort" if "reasoning_effort" in body else "reasoning.effort"
        message = f"Unsupported parameter: '{param}' is not supported with this model."
        return web.json_response(error_body(fmt, 400, message), status=400)
    if fmt == "chat" and re.match(r"o\d", model) and ("max_tokens" in body or "temperature" in body):
        param = "max_tokens" if "max_tokens" in body else "temperature"
        message = (f"Unsupported parameter: '{param}' is not supported with this model."
                   + (" Use 'max_completion_tokens' instead." if param == "max_tokens" else ""))
        return web.json_response(error_body(fmt, 400, message), status=400)
    text, tool, thinking = d["text"], "tool" in d, "thinking" in d and fmt == "anthropic"
    stream = body.get("stream") is True
    if not stream:
        if fmt == "anthropic":
            answer = anthropic_body(model, text, tool, thinking)
        else:
            answer = {"chat": chat_body, "responses": responses_body}[fmt](model, text, tool)
        data = dumps(answer).encode()
        if "cut" in d:
            resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(data))})
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            assert request.transport is not None
            request.transport.close()
            return resp
        return web.Response(body=data, content_type="application/json")
    if fmt == "chat":
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True and "no_usage" not in d
        frames = chat_stream(model, text, tool, include_usage)
    else:
        frames = (responses_stream(model, text, tool) if fmt == "responses"
                  else anthropic_stream(model, text, tool, thinking))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    if "cut" in d or "error_event" in d:
        n = int(d.get("cut") or 0)
        head = [f for f in frames if any(dumps(p).encode() in f for p in pieces(text))][: max(n, 1)]
        lead = frames[: frames.index(head[0])] if head else frames[:1]
        await resp.write(b"".join(lead + head))
        await asyncio.sleep(0.05)
        if "error_event" in d:
            await resp.write(in_stream_error(fmt))
            await resp.write_eof()
            return resp
        assert request.transport is not None
        request.transport.close()
        return resp
    if "stall" in d:
        first = next((i for i, f in enumerate(frames) if any(dumps(p).encode() in f for p in pieces(text))), 0)
        await resp.write(b"".join(frames[: first + 1]))
        await asyncio.sleep(float(d["stall"]))
        frames = frames[first + 1 :]
    for f in frames:
        await resp.write(f)
    await resp.write_eof()
    return resp


async def requests(request: web.Request) -> web.Response:
    if request.method == "DELETE":
        RECEIVED.clear()
        return web.json_response({"ok": True})
    return web.json_response(RECEIVED)


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("GET", "/_stub/requests", requests)
    app.router.add_route("DELETE", "/_stub/requests", requests)
    app.router.add_get("/_stub/health", lambda r: web.json_response({"ok": True}))
    app.router.add_post("/{tail:.*}", handle)
    return app


if __name__ == "__main__":
    web.run_app(make_app(), host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
