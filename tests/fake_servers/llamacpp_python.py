"""A stand-in for llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``) serving SmolLM2's GGUF,
for the provider tests: llama-cpp-python is not installed here (it builds from source in minutes), and what the
tests need from it is how it refuses what its chat template cannot take.

What it copies from that server, as its source (``llama_cpp/server/app.py``, ``types.py``) and the issue's run show:

- the request is validated first (FastAPI/pydantic): a system, assistant or tool message's ``content`` must be a
  string (a user message may give a list of parts); otherwise HTTP 422 ``{"detail": [{loc, msg, type}, ...]}``;
- then the model's chat template is rendered with jinja2 (a sandboxed environment), here SmolLM2-135M-Instruct's own
  template, verbatim from its GGUF: ``'<|im_start|>' + message['role'] + '\\n' + message['content']`` raises
  ``TypeError`` for a list (or ``None``) content, which the server answers as HTTP 500
  ``{"error": {"message": "<the exception's text>", "type": "internal_server_error", "param": null, "code": null}}``
  before any byte of a stream;
- otherwise it answers (here: ``I read N characters.``, N the rendered prompt's length), streaming as chat chunks
  then ``[DONE]``, with usage when ``stream_options.include_usage`` asks.

Run: ``python tests/fake_servers/llamacpp_python.py PORT LOG`` (each request body is appended to LOG, JSON lines).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from aiohttp import web
from jinja2.sandbox import ImmutableSandboxedEnvironment

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATE = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(SMOLLM2_TEMPLATE)
STRING_ONLY = ("system", "assistant", "tool")


def invalid(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        return [{"type": "list_type", "loc": ["body", "messages"], "msg": "Input should be a valid list"}]
    return [{"type": "string_type", "loc": ["body", "messages", i, "content"], "msg": "Input should be a valid string",
             "input": m.get("content")}
            for i, m in enumerate(messages)
            if m.get("role") in STRING_ONLY and m.get("content") is not None and not isinstance(m.get("content"), str)]


def chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    with open(request.app["log"], "a") as f:
        f.write(json.dumps(body) + "\n")
    errors = invalid(body.get("messages"))
    if errors:
        return web.json_response({"detail": errors}, status=422)
    try:
        prompt = TEMPLATE.render(messages=body["messages"], add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the server answers any exception as a 500 with its text
        return web.json_response({"error": {"message": str(e), "type": "internal_server_error", "param": None,
                                            "code": None}}, status=500)
    model = str(body.get("model") or "smollm2")
    text = f"I read {len(prompt)} characters."
    usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": 5, "total_tokens": len(prompt) // 4 + 5}
    if not body.get("stream"):
        return web.json_response({"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
                                  "model": model, "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                      "role": "assistant", "content": text}}], "usage": usage})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk(model, {"role": "assistant", "content": ""}))
    for word in text.split(" "):
        await resp.write(chunk(model, {"content": word + " "}))
    await resp.write(chunk(model, {}, "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        final = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": model, "choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "smollm2", "object": "model", "owned_by": "me"}]})


def make_app(log: str) -> web.Application:
    app = web.Application()
    app["log"] = log
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


if __name__ == "__main__":
    web.run_app(make_app(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), print=None)
