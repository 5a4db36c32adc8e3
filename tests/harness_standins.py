"""Stand-ins for what cannot run here (an outside provider playing proposer and agent model), over real HTTP.

Run: ``python tests/harness_standins.py PORT``. ``POST [<prefix>]/v1/chat/completions`` answers as:

- model ``proposer``: the next scripted answer (``POST /_script {"proposer": [text, ...]}`` queues them; when none
  is left: ``not json``);
- model ``echo``: its system prompt, as text (a model whose answer shows which rules it was given: a gate's tasks
  that expect a rule's words pass exactly under the rules holding them);
- any other model, a coding agent's model that follows its harness exactly: on a request whose last message is
  a tool result, or asking for a title (opencode's first request), it answers ``done``; otherwise it calls the
  agent's ``write`` tool (pi's ``path``, opencode's ``filePath``, Claude Code's ``Write`` ``file_path``; pi's
  form without tools) with ``answer.txt`` and the greeting ``hello``, or ``bonjour`` when the harness (the system
  prompt, or Claude Code's user message holding CLAUDE.md) holds the rule text ``Write greetings in French``, upper-cased
  when it holds ``Write greetings in upper case``. A prompt holding ``[hang]`` gets no answer at all (the request
  is counted in ``GET /_stats`` first, so a test can wait for it). A prompt ``[run] COMMAND`` gets a call of the
  agent's ``bash`` tool with ``COMMAND`` (pi's; Codex's ``exec_command`` with ``cmd``), as an agent told to run
  something does.

``GET /_requests`` lists the bodies received (model, system prompt); ``GET /_stats`` the counts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from aiohttp import web

SCRIPT: list[str] = []
RECEIVED: list[dict[str, Any]] = []
STATS = {"proposer": 0, "agent": 0, "hang": 0}


def system_text(body: dict[str, Any]) -> str:
    out = []
    for m in body.get("messages") or []:
        if m.get("role") in ("system", "developer"):
            c = m.get("content")
            out.append(c if isinstance(c, str) else " ".join(p.get("text", "") for p in c or []))
    return "\n".join(out)


def user_texts(body: dict[str, Any]) -> list[str]:
    out = []
    for m in body.get("messages") or []:
        if m.get("role") == "user":
            c = m.get("content")
            out.append(c if isinstance(c, str) else " ".join(str(p.get("text", "")) for p in c or []))
    return out


def last_user(body: dict[str, Any]) -> str:
    for m in reversed(body.get("messages") or []):
        if m.get("role") == "user":
            c = m.get("content")
            return c if isinstance(c, str) else " ".join(p.get("text", "") for p in c or [])
    return ""


def write_tool(body: dict[str, Any]) -> tuple[str, str] | None:
    """The agent's file-writing tool and its path parameter (pi: write/path, opencode: write/filePath, Claude Code:
    Write/file_path)."""
    for t in body.get("tools") or []:
        fn = t.get("function") or {}
        if str(fn.get("name", "")).lower() == "write":
            props = (fn.get("parameters") or {}).get("properties") or {}
            for key in ("path", "filePath", "file_path"):
                if key in props:
                    return fn["name"], key
    return None


def agent_answer(body: dict[str, Any]) -> dict[str, Any]:
    """{"text": ...} or {"tool": name, "arguments": {...}}."""
    messages = body.get("messages") or []
    system = system_text(body)
    if (messages and messages[-1].get("role") == "tool") or "title generator" in system:
        return {"text": "done"}
    prompt = last_user(body)
    if prompt.startswith("[run] ") and any((t.get("function") or {}).get("name") == "bash"
                                           for t in body.get("tools") or []):
        return {"tool": "bash", "arguments": {"command": prompt[len("[run] "):]}}
    if prompt.startswith("[run] ") and any((t.get("function") or {}).get("name") == "exec_command"
                                           for t in body.get("tools") or []):
        return {"tool": "exec_command", "arguments": {"cmd": prompt[len("[run] "):]}}  # Codex's shell tool
    tool = write_tool(body) or ("write", "path")
    # the harness: pi and opencode put it in the system prompt, Claude Code CLAUDE.md in a user message
    harness = system + "\n".join(user_texts(body))
    greeting = "bonjour" if "Write greetings in French" in harness else "hello"
    if "Write greetings in upper case" in harness:
        greeting = greeting.upper()
    return {"tool": tool[0], "arguments": {tool[1]: "answer.txt", "content": greeting + "\n"}}


def chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    data = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(data)}\n\n".encode()


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model = body.get("model", "")
    RECEIVED.append({"model": model, "system": system_text(body)[:4000], "user": last_user(body)[:4000]})
    if model == "proposer":
        STATS["proposer"] += 1
        answer: dict[str, Any] = {"text": SCRIPT.pop(0) if SCRIPT else "not json"}
    elif model == "echo":
        answer = {"text": system_text(body) or "(no rules)"}
    else:
        STATS["agent"] += 1
        if "[hang]" in last_user(body):
            STATS["hang"] += 1
            await asyncio.sleep(3600)
        answer = agent_answer(body)
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    if not body.get("stream"):
        if "tool" in answer:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": answer["tool"], "arguments": json.dumps(answer["arguments"])}}]}
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": answer["text"]}, "stop"
        return web.json_response({"id": "chatcmpl-standin", "object": "chat.completion", "created": int(time.time()),
                                  "model": model, "choices": [{"index": 0, "message": message,
                                                               "finish_reason": finish}], "usage": usage})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk(model, {"role": "assistant", "content": ""}))
    if "tool" in answer:
        await resp.write(chunk(model, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                       "function": {"name": answer["tool"], "arguments": ""}}]}))
        await resp.write(chunk(model, {"tool_calls": [{"index": 0, "function": {
            "arguments": json.dumps(answer["arguments"])}}]}))
        await resp.write(chunk(model, {}, "tool_calls"))
    else:
        await resp.write(chunk(model, {"content": answer["text"]}))
        await resp.write(chunk(model, {}, "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        data = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model, "choices": [], "usage": usage}
        await resp.write(f"data: {json.dumps(data)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def script(request: web.Request) -> web.Response:
    body = await request.json()
    SCRIPT[:] = list(body.get("proposer", []))
    return web.json_response({"queued": len(SCRIPT)})


async def requests(_request: web.Request) -> web.Response:
    return web.json_response(RECEIVED)


async def stats(_request: web.Request) -> web.Response:
    return web.json_response({**STATS, "script_left": len(SCRIPT)})


def app() -> web.Application:
    a = web.Application()
    a.router.add_post("/_script", script)
    a.router.add_get("/_requests", requests)
    a.router.add_get("/_stats", stats)
    a.router.add_post("/{prefix:.*}v1/chat/completions", chat)
    return a


if __name__ == "__main__":
    web.run_app(app(), host="127.0.0.1", port=int(sys.argv[1]), print=None)
