"""A fake inference server for tests: speaks the parts of vLLM's or SGLang's HTTP API that Reef uses.

Started by Reef itself as if it were the real server (``tests/fake_servers/python -m vllm.entrypoints.openai.
api_server ...`` or ``-m sglang.launch_server ...``), or by a test for attach mode. Answers are deterministic:
the sampled ids are ``10 + (sum(prompt) + i) % 3000`` (plus 1000 under a LoRA adapter), the log-prob of token i is
``-(i + 1) / 100``. Each request body is appended to ``$REEF_STUB_LOG`` (JSON lines) so tests can check what
Reef sent. ``$REEF_STUB_CONTROL`` names a JSON file read on every request, to misbehave on demand:

    never_healthy     /health answers 503 forever
    malformed_after   after N tokens, a chunk that is not JSON
    drop_after        after N tokens, the connection is cut
    report_version    the weight version reported, whatever was set
    token_delay_s     pause between chunks (one token each, unless vLLM's stream_interval gathers several)
    die_on_generate   the process exits at once on its next generate request
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from aiohttp import web


def control() -> dict[str, Any]:
    path = os.environ.get("REEF_STUB_CONTROL")
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def note(path: str, body: Any) -> None:
    log = os.environ.get("REEF_STUB_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"path": path, "body": body}) + "\n")


class Stub:
    def __init__(self, dialect: str, model: str, version: str) -> None:
        self.dialect = dialect
        self.model = model
        self.version = version
        self.adapters: dict[str, str] = {}

    async def health(self, request: web.Request) -> web.Response:
        if control().get("never_healthy"):
            return web.Response(status=503)
        return web.Response(text="")

    async def version_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0-stub"})

    async def control_call(self, request: web.Request) -> web.Response:
        body = await request.json()
        note(request.path, body)
        p = request.path
        if p in ("/update_weight_version",):
            self.version = body["new_version"]
            return web.json_response({"success": True, "new_version": self.version})
        if p == "/collective_rpc":
            return web.json_response({"results": [None]})
        if p == "/update_weights_from_disk":
            self.model = body["model_path"]
            self.version = body.get("weight_version") or self.version
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if p in ("/v1/load_lora_adapter", "/load_lora_adapter"):
            self.adapters[body["lora_name"]] = body["lora_path"]
            if self.dialect == "sglang":
                return web.json_response({"success": True, "error_message": "", "loaded_adapters": self.adapters})
            return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        if p in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
            self.adapters.pop(body["lora_name"], None)
            return web.json_response({"success": True}) if self.dialect == "sglang" else web.Response(text="ok")
        return web.json_response({"error": f"no route {p}"}, status=404)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        note(request.path, body)
        ctl = control()
        if ctl.get("die_on_generate"):
            os._exit(3)
        if self.dialect == "vllm":
            prompt, sp, adapter = body["token_ids"], body["sampling_params"], body.get("model")
            n = sp["max_tokens"]
        else:
            prompt, sp, adapter = body["input_ids"], body["sampling_params"], body.get("lora_path")
            n = sp["max_new_tokens"]
        if adapter is not None and adapter not in self.adapters:
            return web.json_response({"error": {"message": f"The model `{adapter}` does not exist.", "code": 404}},
                                     status=404)
        shift = 1000 if adapter else 0
        ids = [10 + shift + (sum(prompt) + i) % 3000 for i in range(n)]
        lps = [-(i + 1) / 100 for i in range(n)]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        version = ctl.get("report_version") or self.version
        # vLLM's stream_interval: the first token at once, then chunks of that many tokens, the last one at once
        interval = (sp.get("stream_interval") or 1) if self.dialect == "vllm" else 1
        ends = sorted({1, n, *range(1 + interval, n, interval)}) if n else []
        start = 0
        for end in ends:
            for i in range(start, end):
                if ctl.get("drop_after") is not None and i >= ctl["drop_after"]:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if ctl.get("malformed_after") is not None and i >= ctl["malformed_after"]:
                    await resp.write(b"data: {not json\n\n")
                    await resp.write_eof()
                    return resp
            chunk = self.chunk(start, end, ids, lps, end == n, version)
            try:
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            except ConnectionResetError:  # Reef closed the connection: the request is aborted, as a server does
                note(request.path + "#aborted", {"at_token": start})
                return resp
            start = end
            if ctl.get("token_delay_s"):
                try:
                    await asyncio.sleep(ctl["token_delay_s"])
                except asyncio.CancelledError:  # aiohttp cancels the handler of a connection that closed
                    note(request.path + "#aborted", {"at_token": start})
                    raise
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def chunk(self, start: int, end: int, ids: list[int], lps: list[float], last: bool, version: str) -> Any:
        """The chunk carrying tokens ``start:end``."""
        if self.dialect == "vllm":
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None,
                                      "token_ids": ids[start:end],
                                      "logprobs": {"content": [{"token_id": t, "logprob": lp, "top_logprobs": []}
                                                               for t, lp in zip(ids[start:end], lps[start:end],
                                                                                strict=True)]}}
            if last:
                choice["weight_versions"] = [{"version": version, "start": 0, "end": len(ids)}]
            return {"request_id": "stub", "output_mode": "tokens", "choices": [choice]}
        # SGLang's default stream: cumulative output_ids and log-probs, meta_info on every chunk
        return {"text": "", "output_ids": ids[:end],
                "meta_info": {"id": "stub", "finish_reason": {"type": "length", "length": len(ids)} if last else None,
                              "prompt_tokens": 3, "completion_tokens": end, "weight_version": version,
                              "output_token_logprobs": [[x, y, None] for x, y in zip(lps[:end], ids[:end],
                                                                                     strict=True)]}}


def main(dialect: str, argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", "--model-path", dest="model")
    p.add_argument("--port", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--weight-version", default="default")
    args, _ = p.parse_known_args(argv)
    note("argv", {"dialect": dialect, "argv": argv})
    stub = Stub(dialect, args.model, args.weight_version)
    app = web.Application()
    app.router.add_get("/health", stub.health)
    app.router.add_get("/version", stub.version_info)
    app.router.add_get("/get_server_info", stub.version_info)
    app.router.add_post("/inference/v1/generate" if dialect == "vllm" else "/generate", stub.generate)
    for path in ("/update_weight_version", "/collective_rpc", "/update_weights_from_disk", "/v1/load_lora_adapter",
                 "/load_lora_adapter", "/v1/unload_lora_adapter", "/unload_lora_adapter"):
        app.router.add_post(path, stub.control_call)
    print(f"stub {dialect} on {args.host}:{args.port}", file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
