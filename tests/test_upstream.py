"""The upstream engine, over real sockets on loopback: a front daemon serving from upstreams in all three formats.

Upstreams: a second Reef daemon serving the tiny model (a real provider-compatible process), and
``tests/upstream_stub.py`` (scripted answers: tool calls, HTTP errors, slow first bytes, cut streams). The front
daemon has one model entry per upstream and format; each test reaches one through a scenario bound to it
(``/s/<model>/v1/...``). Clients are the official ``openai`` and ``anthropic`` SDKs (and raw httpx where the bytes
matter). Pure translation checks (no server) come first.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from daemon.config import ModelEntry, load_config, upstream_entry
from daemon.engines.upstream import UpstreamEngine, estimate_tokens
from daemon.errors import BadRequest, Unsupported
from daemon.exchange import Completion, Finish, ToolCall, Usage
from daemon.protocols import anthropic as anth
from daemon.protocols import openai_chat as chat
from daemon.protocols import openai_responses as resp
from daemon.protocols.sse import SSEDecoder
from tests.conftest import Daemon, assert_canonical_error, free_port, make_home, probe_unix, sse_events
from tests.test_protocols import claude_code_body

STUB = Path(__file__).with_name("upstream_stub.py")
FORMATS = ["openai-chat", "openai-responses", "anthropic"]
CLIENTS = ["chat", "responses", "messages"]
SHORT = {"openai-chat": "chat", "openai-responses": "responses", "anthropic": "anthropic"}
MODULES = {"openai-chat": chat, "openai-responses": resp, "anthropic": anth}
STUB_KEY = "stub-secret-key-0123456789"
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


# --- translation on its own ------------------------------------------------------------------------------------


def _claude_code_like(n_tools: int = 24) -> dict[str, Any]:
    """Claude Code's request shape (shared/CLIENTS.md): 24 client tools, 3 system blocks with cache hints, a
    system message mid-conversation, thinking, metadata.user_id, context_management, output_config."""
    body = claude_code_body()
    cache = {"type": "ephemeral"}
    body["tools"] = [
        {
            "name": f"Tool{i}",
            "description": f"tool number {i}",
            "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
            **({"cache_control": cache} if i == n_tools - 1 else {}),
        }
        for i in range(n_tools - 1)
    ] + [body["tools"][0]]
    body.pop("some_future_field")
    return body


def test_anthropic_to_chat_translation() -> None:
    ex = anth.parse_request(_claude_code_like())
    out = chat.render_request(ex, model="gpt-x", stream=True)
    assert out["model"] == "gpt-x" and out["max_tokens"] == 32000 and out["temperature"] == 1
    assert out["stream_options"] == {"include_usage": True}
    assert "cache_control" not in json.dumps(out)
    for key in ("thinking", "metadata", "context_management", "output_config", "system"):
        assert key not in out
    roles = [m["role"] for m in out["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user", "system", "user"]
    assert out["messages"][0]["content"].startswith("x-anthropic-billing-header")
    assert "You are Claude Code" in out["messages"][0]["content"]
    assert out["messages"][5] == {"role": "system", "content": "The user switched to plan mode."}
    assert out["messages"][2]["tool_calls"][0]["id"] == "toolu_01"
    assert out["messages"][3] == {"role": "tool", "tool_call_id": "toolu_01", "content": "hello\nworld"}
    assert len(out["tools"]) == 24 and out["tools"][-1]["function"]["name"] == "Read"
    # read back by Reef's own chat parser: the same conversation
    back = chat.parse_request(out)
    assert [m.role for m in back.messages] == [m.role for m in ex.messages]
    assert [t.name for t in back.tools] == [t.name for t in ex.tools]


def test_chat_and_responses_to_anthropic_translation() -> None:
    body = {
        "model": "m",
        "parallel_tool_calls": False,
        "temperature": 1.7,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call.1:x", "type": "function", "function": {"name": "look", "arguments": '{"a":1}'}}]},
            {"role": "system", "content": "now in plan mode"},
            {"role": "tool", "tool_call_id": "call.1:x", "content": "a cat"},
        ],
        "tools": [{"type": "function", "function": {"name": "look", "parameters": {"properties": {}}}}],
        "tool_choice": "required",
    }
    out = anth.render_request(chat.parse_request(body), model="claude", stream=False, max_tokens=333)
    assert out["system"] == [{"type": "text", "text": "be brief"}]
    assert out["max_tokens"] == 333 and out["temperature"] == 1.0
    assert out["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert out["tools"][0]["input_schema"]["type"] == "object"
    user, assistant, last = out["messages"]
    assert user["content"][1]["source"] == {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    assert assistant["content"] == [{"type": "tool_use", "id": "call_1_x", "name": "look", "input": {"a": 1}}]
    # the mid-conversation system message stays at its place; the tool result opens the user turn
    assert last["role"] == "user" and last["content"][0] == {"type": "tool_result", "tool_use_id": "call_1_x",
                                                            "content": "a cat"}
    assert last["content"][1]["text"] == "<system-reminder>\nnow in plan mode\n</system-reminder>"
    # the Responses client's body: instructions and function call items
    rbody = {"model": "m", "instructions": "sys", "max_output_tokens": 50,
             "input": [{"role": "user", "content": "hi"},
                       {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c1", "output": "boom"}]}
    out = anth.render_request(resp.parse_request(rbody), model="claude", stream=True)
    assert out["system"] == [{"type": "text", "text": "sys"}] and out["max_tokens"] == 50 and out["stream"]
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]
    assert out["messages"][2]["content"][0]["tool_use_id"] == "c1"


def test_to_responses_translation() -> None:
    ex = anth.parse_request(_claude_code_like())
    out = resp.render_request(ex, model="gpt-x", stream=True)
    assert out["instructions"].startswith("x-anthropic-billing-header") and out["store"] is False
    kinds = [(i["type"], i.get("role")) for i in out["input"]]
    assert kinds == [("message", "user"), ("message", "assistant"), ("function_call", None),
                     ("function_call_output", None), ("message", "user"), ("message", "system"), ("message", "user")]
    assert out["input"][2]["call_id"] == out["input"][3]["call_id"] == "toolu_01"
    assert all(t["strict"] is False for t in out["tools"]) and len(out["tools"]) == 24
    assert "cache_control" not in json.dumps(out)
    back = resp.parse_request(out)
    assert [m.role for m in back.messages] == [m.role for m in ex.messages]


@pytest.mark.parametrize(
    ("fmt", "body", "target", "param"),
    [
        ("anthropic", claude_code_body(), "openai-chat", "tools[1]"),  # a server tool (web_search)
        ("anthropic", {"model": "m", "max_tokens": 5, "stop_sequences": ["X"],
                       "messages": [{"role": "user", "content": "hi"}]}, "openai-responses", "stop_sequences"),
        ("openai-chat", {"model": "m", "response_format": {"type": "json_object"},
                         "messages": [{"role": "user", "content": "hi"}]}, "anthropic", "response_format"),
        ("openai-chat", {"model": "m", "logprobs": True, "messages": [{"role": "user", "content": "hi"}]},
         "anthropic", "logprobs"),
        ("openai-responses", {"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}, "openai-chat",
         "tools[0]"),
    ],
)
def test_refused_where_meaning_would_change(fmt: str, body: dict[str, Any], target: str, param: str) -> None:
    ex = {"anthropic": anth, "openai-chat": chat, "openai-responses": resp}[fmt].parse_request(body)
    with pytest.raises(Unsupported) as e:
        MODULES[target].render_request(ex, model="x", stream=False)
    assert e.value.param == param and target in e.value.message


def test_structured_output_carried_between_openai_formats() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    ex = chat.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    out = resp.render_request(ex, model="m", stream=False)
    assert out["text"] == {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    back = chat.render_request(resp.parse_request({**out, "input": "hi"}), model="m", stream=False)
    assert back["response_format"]["json_schema"]["schema"] == schema


COMPLETION = Completion(
    text="Hello, wörld! 🙂",
    thinking="let me think",
    tool_calls=[ToolCall("call_a", "Read", '{"path": "a.txt"}'), ToolCall("call_b", "Grep", '{"q": "x"}')],
    stop_reason="tool_calls",
    usage=Usage(input_tokens=120, output_tokens=30, cache_read_tokens=100, cache_write_tokens=0),
)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split", [1, 7, 10_000])
def test_stream_parser_reads_what_a_provider_streams(fmt: str, split: int) -> None:
    """Each format's stream (as rendered by Reef, split into chunks of ``split`` bytes, CRLF for Anthropic) parses
    back into the same events and completion; the ids of tool calls are kept."""
    mod = MODULES[fmt]
    body = {"openai-chat": {"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "stream_options": {"include_usage": True}},
            "openai-responses": {"model": "m", "input": "x"},
            "anthropic": {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}}[fmt]
    ex = mod.parse_request(body)
    r = mod.StreamRenderer(ex, response_id="id1", created=1)
    raw = b"".join(r.start() + r.finish(COMPLETION, None))
    if fmt == "anthropic":
        raw = raw.replace(b"\n", b"\r\n")
    decoder, parser, events = SSEDecoder(), mod.StreamParser(), []
    for i in range(0, len(raw), split):
        for event, data in decoder.feed(raw[i : i + split]):
            events += parser.feed(event, data)
    for event, data in decoder.close():
        events += parser.feed(event, data)
    assert parser.done
    c = parser.finish()
    assert (c.text, c.thinking, c.stop_reason) == (COMPLETION.text, COMPLETION.thinking, "tool_calls")
    assert [(t.id, t.name, json.loads(t.arguments)) for t in c.tool_calls] == [
        (t.id, t.name, json.loads(t.arguments)) for t in COMPLETION.tool_calls
    ]
    assert (c.usage.input_tokens, c.usage.output_tokens, c.usage.cache_read_tokens) == (120, 30, 100)
    assert c.upstream and isinstance(c.upstream, dict)
    assert [type(e).__name__ for e in events][:1] == ["ThinkingDelta"]
    # and the non-streaming body
    whole = mod.parse_response(mod.render_response(ex, COMPLETION, response_id="id1", created=1, receipt=None))
    assert (whole.text, whole.thinking, [t.id for t in whole.tool_calls]) == (
        COMPLETION.text, COMPLETION.thinking, ["call_a", "call_b"])
    assert whole.usage.input_tokens == 120 and whole.usage.cache_read_tokens == 100


def test_sse_decoder_edges() -> None:
    d = SSEDecoder()
    assert d.feed(b": comment\r\nevent: a\r\ndata: 1\r\ndata: 2\r\n\r\nretry: 5\ndata:x") == [("a", "1\n2")]
    assert d.feed(b"y\n") == [] and d.close() == [(None, "xy")]


def test_sse_frames_give_each_event_with_its_exact_bytes() -> None:
    """What the relay sends: every event's own bytes (CRLF, comments, ids, several data lines kept), in order,
    whatever the chunking; the events read from them are those of the line-by-line reading."""
    import random

    rng = random.Random(7)
    samples = [b": ping\n\n", b'data: {"a":1}\n\n', b"event: x\ndata: 1\n\n", b"data: a\ndata: b\n\n",
               b"retry: 5\n\n", b"id: 3\nevent: y\ndata: z\n\n", b"data: [DONE]\n\n", b"data:nospace\n\n",
               b"event: cr\r\ndata: 2\r\n\r\n"]
    for _ in range(500):
        data = b"".join(rng.choice(samples) for _ in range(rng.randint(1, 10)))
        decoder, frames, i = SSEDecoder(), [], 0
        while i < len(data):
            n = rng.randint(1, 12)
            frames += decoder.frames(data[i : i + n])
            i += n
        frames += decoder.close_frames()
        assert b"".join(raw for raw, _, _ in frames) == data
        reference = SSEDecoder()
        events = reference.feed(data) + reference.close()
        assert [(e, d) for _, e, d in frames if d is not None] == events


def test_engine_config_errors_and_estimate() -> None:
    entry = ModelEntry(name="u", engine="upstream", url="http://127.0.0.1:9/v1/", format="anthropic",
                       api_key_env="MISSING_KEY")
    with pytest.raises(BadRequest, match="MISSING_KEY is not set"):
        UpstreamEngine(entry, {})
    engine = UpstreamEngine(entry, {"MISSING_KEY": "k"})
    assert engine.url == "http://127.0.0.1:9/v1/messages" and "k" not in repr(engine)
    assert engine.max_tokens == 4096
    for bad in ({"format": "grpc"}, {"url": None}, {"url": "ftp://x"}):
        with pytest.raises(BadRequest):
            UpstreamEngine(ModelEntry(**{**entry.__dict__, "api_key_env": None, **bad}), {})
    ex = chat.parse_request({"model": "m", "messages": [{"role": "user", "content": "x" * 401}]})
    assert estimate_tokens(ex) == math.ceil(401 / 4)
    flagged = upstream_entry("http://127.0.0.1:1", "anthropic", "m", {"REEF_UPSTREAM_API_KEY": "k"})
    assert (flagged.name, flagged.engine, flagged.api_key_env, flagged.upstream_model) == (
        "upstream", "upstream", "REEF_UPSTREAM_API_KEY", "m")
    with pytest.raises(BadRequest):
        upstream_entry("http://h:1", "soap", None, {})


# --- real processes --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("stub") / "stub.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, str(STUB), str(port)], stdout=log, stderr=log)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    with httpx.Client(timeout=2) as http:
        while True:
            try:
                if http.get(url + "/_stub/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "stub did not start"
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def upstream(tiny_model: Path) -> Iterator[Daemon]:
    """A second Reef daemon serving the tiny model: a real provider-compatible upstream."""
    home, port, env = make_home(tiny_model)
    d = Daemon(home=home, port=port, env=env).start()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def front(tiny_model: Path, upstream: Daemon, stub: str) -> Iterator[Daemon]:
    extra = ""
    for fmt in FORMATS:
        s = SHORT[fmt]
        extra += (f'\n[models.up-{s}]\nengine = "upstream"\nurl = "{upstream.url}"\nformat = "{fmt}"\n'
                  f'upstream_model = "tiny"\napi_key_env = "UP_KEY"\n')
        extra += (f'\n[models.stub-{s}]\nengine = "upstream"\nurl = "{stub}/v1"\nformat = "{fmt}"\n'
                  f'upstream_model = "stub-model"\napi_key_env = "STUB_API_KEY"\ntimeout_s = 1.5\n')
    extra += (f'\n[models.stub-o3]\nengine = "upstream"\nurl = "{stub}/v1"\nformat = "openai-chat"\n'
              f'upstream_model = "o3-mini"\napi_key_env = "STUB_API_KEY"\n')
    closed = free_port()
    extra += f'\n[models.dead]\nengine = "upstream"\nurl = "http://127.0.0.1:{closed}"\nconnect_timeout_s = 1\n'
    home, port, env = make_home(tiny_model, extra)
    env.update(UP_KEY=upstream.token, STUB_API_KEY=STUB_KEY, REEF_MODEL="stub-chat")
    d = Daemon(home=home, port=port, env=env, extra_config=extra).start()
    with d.http() as http:
        for model in [f"{p}-{SHORT[f]}" for p in ("up", "stub") for f in FORMATS] + ["stub-o3", "dead"]:
            r = http.post("/reef/scenarios", json={"name": model, "model": model})
            assert r.status_code == 201, r.text
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def scenario(front: Daemon, name: str, model: str) -> str:
    """A fresh scenario bound to ``model``: its records are this test's alone."""
    with front.http() as http:
        r = http.post("/reef/scenarios", json={"name": name, "model": model})
        assert r.status_code == 201, r.text
    return name


def latest_record(d: Daemon, scenario: str | None = None) -> dict[str, Any]:
    with d.http() as http:
        query = {"order": "desc", "limit": "1", "kind": "exchange", **({"scenario": scenario} if scenario else {})}
        summary = http.get("/reef/records", params=query).json()["records"][0]
        return http.get(f"/reef/records/{summary['id']}").json()


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    with d.http() as http:
        r = http.get(f"/reef/records/{receipt}")
        assert r.status_code == 200, r.text
        return r.json()


def extra(obj: Any, name: str) -> Any:
    return (getattr(obj, "model_extra", None) or {}).get(name)


def answer_text(fmt: str, response: dict[str, Any]) -> str:
    if fmt == "openai-chat":
        return response["choices"][0]["message"]["content"] or ""
    if fmt == "openai-responses":
        return "".join(c["text"] for i in response["output"] if i["type"] == "message" for c in i["content"])
    return "".join(b["text"] for b in response["content"] if b["type"] == "text")


def ask(front: Daemon, scen: str, client: str, stream: bool, messages: list[dict[str, Any]] | None = None,
        tools: bool = False, **kw: Any) -> dict[str, Any]:
    """One request through the official SDK of ``client``; returns text, tool calls (id, name, args), receipt."""
    text, calls, receipt = "", [], None
    if client == "chat":
        with openai.OpenAI(base_url=f"{front.url}/s/{scen}/v1", api_key=front.token, max_retries=0) as c:
            args: dict[str, Any] = {"model": "any", "messages": messages or [{"role": "user", "content": "say hi"}],
                                    "max_tokens": 8, **kw}
            if tools:
                args["tools"] = [{"type": "function", "function": {
                    "name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["schema"]}}]
            if not stream:
                raw = c.chat.completions.with_raw_response.create(**args)
                m = raw.parse().choices[0].message
                text, receipt = m.content or "", raw.headers["x-reef-agent-record-id"]
                calls = [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []]
            else:
                pieces: dict[int, list[str]] = {}
                for chunk in c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
                    receipt = receipt or (extra(chunk, "reef") or {}).get("record_id")
                    for choice in chunk.choices:
                        text += choice.delta.content or ""
                        for t in choice.delta.tool_calls or []:
                            if t.id:
                                pieces[t.index] = [t.id, t.function.name, ""]
                            pieces[t.index][2] += t.function.arguments or ""
                calls = [tuple(p) for p in pieces.values()]
    elif client == "responses":
        with openai.OpenAI(base_url=f"{front.url}/s/{scen}/v1", api_key=front.token, max_retries=0) as c:
            items = messages or [{"role": "user", "content": "say hi"}]
            args = {"model": "any", "input": items, "max_output_tokens": 8, **kw}
            if tools:
                args["tools"] = [{"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
                                  "parameters": WEATHER["schema"], "strict": False}]
            if not stream:
                raw = c.responses.with_raw_response.create(**args)
                r = raw.parse()
                receipt = raw.headers["x-reef-agent-record-id"]
            else:
                events = list(c.responses.create(**args, stream=True))
                assert events[0].type == "response.created"
                assert events[-1].type in ("response.completed", "response.incomplete")
                r = events[-1].response
                receipt = extra(events[-1], "reef")["record_id"]
                assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
            text = r.output_text
            calls = [(i.call_id, i.name, i.arguments) for i in r.output if i.type == "function_call"]
    else:
        with anthropic.Anthropic(base_url=f"{front.url}/s/{scen}", api_key=front.token, max_retries=0) as c:
            args = {"model": "any", "max_tokens": 8, "messages": messages or [{"role": "user", "content": "say hi"}],
                    **kw}
            if tools:
                args["tools"] = [{"name": WEATHER["name"], "description": WEATHER["description"],
                                  "input_schema": WEATHER["schema"]}]
            if not stream:
                raw = c.messages.with_raw_response.create(**args)
                msg = raw.parse()
                receipt = raw.headers["x-reef-agent-record-id"]
            else:
                with c.messages.stream(**args) as s:
                    msg = s.get_final_message()
                    receipt = s.response.headers["x-reef-agent-record-id"]
            text = "".join(b.text for b in msg.content if b.type == "text")
            calls = [(b.id, b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"]
    assert receipt and receipt.startswith("rec_")
    return {"text": text, "calls": calls, "receipt": receipt}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("up", FORMATS)
@pytest.mark.parametrize("client", CLIENTS)
def test_every_client_against_every_upstream(
    front: Daemon, upstream: Daemon, client: str, up: str, stream: bool
) -> None:
    """The tiny model answers through the front; the front's answer is the upstream's answer, recorded with the
    upstream's usage; same format in and out sends the client's body unchanged apart from the model."""
    got = ask(front, f"up-{SHORT[up]}", client, stream)
    rec = record(front, got["receipt"])
    assert rec["status"] == "complete" and rec["engine"] == "upstream" and rec["model"] == f"up-{SHORT[up]}"
    assert rec["usage"]["input_tokens"] > 0 and rec["usage"]["output_tokens"] > 0 and rec["usage"]["upstream"]
    up_rec = latest_record(upstream)
    assert up_rec["format"] == up and up_rec["request"]["model"] == "tiny"
    assert answer_text(up, up_rec["response"]) == got["text"]
    if up == rec["format"]:
        sent = {k: v for k, v in up_rec["request"].items() if k not in ("model", "stream_options")}
        assert sent == {k: v for k, v in rec["request"].items() if k not in ("model", "stream_options")}
    assert rec["usage"]["input_tokens"] == up_rec["usage"]["input_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("up", FORMATS)
@pytest.mark.parametrize("client", CLIENTS)
def test_tool_call_round_trip(front: Daemon, stub: str, client: str, up: str, stream: bool) -> None:
    scen = f"stub-{SHORT[up]}"
    first = ask(front, scen, client, stream, messages=[{"role": "user", "content": "weather? [stub:tool]"}],
                tools=True)
    call_id = "toolu_stub1" if up == "anthropic" else "call_stub1"
    assert len(first["calls"]) == 1
    cid, name, args = first["calls"][0]
    assert (cid, name, json.loads(args)) == (call_id, "get_weather", {"city": "Paris"})
    # the tool result goes back under the same id
    if client == "chat":
        history = [{"role": "user", "content": "weather? [stub:tool]"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]},
                   {"role": "tool", "tool_call_id": cid, "content": "sunny"}]
    elif client == "responses":
        history = [{"role": "user", "content": "weather? [stub:tool]"},
                   {"type": "function_call", "call_id": cid, "name": name, "arguments": args},
                   {"type": "function_call_output", "call_id": cid, "output": "sunny"}]
    else:
        history = [{"role": "user", "content": "weather? [stub:tool]"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": name,
                                                      "input": json.loads(args)}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": "sunny"}]}]
    second = ask(front, scen, client, stream, messages=history, tools=True)
    assert second["text"] == "tool said: sunny" and not second["calls"]
    with httpx.Client() as http:
        received = http.get(stub + "/_stub/requests").json()[-1]
    body = received["body"]
    assert received["path"] == {"openai-chat": "/v1/chat/completions", "openai-responses": "/v1/responses",
                                "anthropic": "/v1/messages"}[up]
    assert body["model"] == "stub-model" and body.get("stream", False) == stream
    if up == "openai-chat":
        assert body["tools"][0]["function"]["name"] == "get_weather"
        assert body["tools"][0]["function"]["parameters"] == WEATHER["schema"]
        assert body["messages"][1]["tool_calls"][0]["id"] == cid
        assert body["messages"][2] == {"role": "tool", "tool_call_id": cid, "content": "sunny"}
        assert received["headers"]["Authorization"] == f"Bearer {STUB_KEY}"
    elif up == "openai-responses":
        assert body["tools"][0]["name"] == "get_weather" and body["tools"][0]["parameters"] == WEATHER["schema"]
        call, output = body["input"][1], body["input"][2]
        assert (call["type"], call["call_id"], output["type"], output["call_id"]) == (
            "function_call", cid, "function_call_output", cid)
        assert output["output"] == "sunny"
    else:
        assert body["tools"][0]["input_schema"] == WEATHER["schema"] and body["max_tokens"] == 8
        assert body["messages"][1]["content"][0] == {"type": "tool_use", "id": cid, "name": "get_weather",
                                                     "input": {"city": "Paris"}}
        result = body["messages"][2]["content"][0]
        assert (result["type"], result["tool_use_id"], result["content"]) == ("tool_result", cid, "sunny")
        assert received["headers"]["x-api-key"] == STUB_KEY
        # Reef's own version for a translated body; an Anthropic client's own (its SDK's) is forwarded
        with anthropic.Anthropic(api_key="x", base_url="http://127.0.0.1:9") as sdk:
            sdk_version = sdk.default_headers["anthropic-version"]
        assert received["headers"]["anthropic-version"] == ("2023-06-01" if client != "messages" else sdk_version)
    rec = record(front, first["receipt"])
    assert rec["usage"]["input_tokens"] == 11 and rec["usage"]["upstream"]


@pytest.mark.parametrize("up", ["openai-chat", "openai-responses"])
def test_claude_code_against_openai_upstream(front: Daemon, stub: str, up: str) -> None:
    body = _claude_code_like()
    with front.http() as http, httpx.Client() as s:
        s.delete(stub + "/_stub/requests")
        r = http.post(f"/s/stub-{SHORT[up]}/v1/messages?beta=true", json=body,
                      headers={"anthropic-beta": "interleaved-thinking-2025-05-14",
                               "X-Claude-Code-Session-Id": "s-1"})
        received = s.get(stub + "/_stub/requests").json()[-1]["body"]
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    kinds = [e for e, _ in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    text = "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta")
    assert text == "stub says hello"
    assert events[-1][1]["reef"]["record_id"].startswith("rec_")
    assert [d for e, d in events if e == "message_delta"][0]["delta"]["stop_reason"] == "end_turn"
    dumped = json.dumps(received)
    assert "cache_control" not in dumped and "user_id" not in dumped and "clear_thinking" not in dumped
    assert received["max_tokens" if up == "openai-chat" else "max_output_tokens"] == 32000
    assert len(received["tools"]) == 24
    if up == "openai-chat":
        roles = [m["role"] for m in received["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "user", "system", "user"]
        system = received["messages"][0]["content"]
        assert all(b["text"] in system for b in body["system"])
        assert received["messages"][5]["content"] == "The user switched to plan mode."
        assert received["messages"][2]["tool_calls"][0]["id"] == received["messages"][3]["tool_call_id"]
    else:
        assert all(b["text"] in received["instructions"] for b in body["system"])
        system_items = [i for i in received["input"] if i.get("role") == "system"]
        assert system_items[0]["content"][0]["text"] == "The user switched to plan mode."


def test_claude_code_against_tiny_through_chat(front: Daemon) -> None:
    """The same shape, answered by a real model behind an OpenAI chat upstream, with the SDK's own parser."""
    body = _claude_code_like()
    body.pop("stream")
    known = {k: body.pop(k) for k in ("system", "messages", "tools")}
    body.pop("model")
    with anthropic.Anthropic(base_url=f"{front.url}/s/up-chat", api_key=front.token, max_retries=0) as c:
        with c.beta.messages.stream(**known, model="claude-x", max_tokens=8, extra_body=body) as s:
            msg = s.get_final_message()
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 100


ERROR_SHAPE = {"chat": "openai", "responses": "openai", "messages": "anthropic"}


def raw_request(front: Daemon, scen: str, client: str, text: str, stream: bool) -> httpx.Response:
    if client == "chat":
        path, body = "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}]}
    elif client == "responses":
        path, body = "/v1/responses", {"model": "m", "input": text}
    else:
        path, body = "/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    with front.http() as http:
        return http.post(f"/s/{scen}{path}", json={**body, "stream": stream})


@pytest.mark.parametrize("client", CLIENTS)
def test_upstream_4xx_relayed_in_the_client_format(front: Daemon, client: str) -> None:
    for up in FORMATS:
        for status in (400, 429):
            r = raw_request(front, f"stub-{SHORT[up]}", client, f"hi [stub:status={status}]", stream=status == 429)
            err = assert_canonical_error(r, status, ERROR_SHAPE[client])
            assert f"stub refuses: status {status}" in err["message"]
            if status == 429:
                assert err["type"] == "rate_limit_error"
    # the SDKs map them to their own exception classes
    if client == "messages":
        with anthropic.Anthropic(base_url=f"{front.url}/s/stub-chat", api_key=front.token, max_retries=0) as c:
            with pytest.raises(anthropic.RateLimitError):
                c.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "[stub:status=429]"}])
    else:
        with openai.OpenAI(base_url=f"{front.url}/s/stub-anthropic/v1", api_key=front.token, max_retries=0) as c:
            with pytest.raises(openai.BadRequestError, match="stub refuses"):
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": "[stub:status=400]"}])


@pytest.mark.parametrize("client", CLIENTS)
def test_upstream_5xx_timeout_and_refused_connection(front: Daemon, stub: str, client: str) -> None:
    r = raw_request(front, "stub-responses", client, "[stub:status=503]", stream=True)
    err = assert_canonical_error(r, 502, ERROR_SHAPE[client])
    assert stub + "/v1/responses" in err["message"] and "503" in err["message"]
    r = raw_request(front, "stub-anthropic", client, "[stub:status=401]", stream=False)
    err = assert_canonical_error(r, 502, ERROR_SHAPE[client])
    assert "STUB_API_KEY" in err["message"] and STUB_KEY not in r.text
    # the stub would answer 200 after 3 s: a 504 can only be the 1.5 s timeout
    r = raw_request(front, "stub-chat", client, "[stub:slow=3]", stream=client != "chat")
    err = assert_canonical_error(r, 504, ERROR_SHAPE[client])
    assert "1.5 s" in err["message"] and stub in err["message"]
    r = raw_request(front, "dead", client, "hi", stream=False)
    err = assert_canonical_error(r, 502, ERROR_SHAPE[client])
    assert "cannot reach upstream" in err["message"]
    log = front.log_tail(200)
    assert "connect failed (" in log and "), retry 2" in log  # never sent: retried


CUT_END = {
    "chat": lambda ev: ev[-1][0] is None and "error" in ev[-1][1],
    "responses": lambda ev: [e for e, _ in ev[-2:]] == ["error", "response.failed"],
    "messages": lambda ev: ev[-1][0] == "error" and ev[-1][1]["type"] == "error",
}


def test_receipt_wait_counts_from_the_first_event_not_from_the_write(front: Daemon) -> None:
    """A stream's ``receipt-wait`` (Server-Timing) is how long its first event waited for the opening record's
    write. The stub holds its answer until that record is committed, so the first event arrives after the write and
    waits for nothing: the wait is far under the write's own time. Catches the wait measured from the write's start
    or from the request (both at least the whole write), which the bound ``wait <= record`` alone cannot tell."""
    nonce = uuid.uuid4().hex
    text = f"hi [stub:after_record={front.home / 'records.sqlite3'}|{nonce}]"
    with front.http() as c:
        r = c.post("/s/stub-chat/v1/chat/completions",
                   json={"model": "x", "stream": True, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    timing = {p.split(";")[0].strip(): float(p.split("dur=")[1]) for p in r.headers["Server-Timing"].split(",")}
    assert timing["record"] > 0, timing
    assert timing["receipt-wait"] < timing["record"] / 2, timing


@pytest.mark.parametrize("client", CLIENTS)
def test_cut_stream_ends_with_the_error_event_and_an_incomplete_record(front: Daemon, client: str) -> None:
    for up in FORMATS:
        for directive in ("[stub:cut=2]", "[stub:error_event]"):
            scen = scenario(front, f"cut-{client}-{SHORT[up]}-{directive[6:9]}", f"stub-{SHORT[up]}")
            r = raw_request(front, scen, client, f"hi {directive}", stream=True)
            assert r.status_code == 200
            events = sse_events(r.text)
            assert CUT_END[client](events), (up, directive, events[-3:])
            assert "[DONE]" not in r.text and "message_stop" not in r.text and "response.completed" not in r.text
            text = "".join(d["choices"][0]["delta"].get("content") or "" for e, d in events
                           if isinstance(d, dict) and d.get("choices")) if client == "chat" else None
            rec = latest_record(front, scen)
            assert rec["status"] == "incomplete", rec["status"]
            assert rec["response"]["error"]["incomplete"] is True
            if text:
                assert rec["response"]["error"]["partial_text"] == text
    # a non-streaming answer cut half-way is a 502
    r = raw_request(front, "stub-anthropic", client, "[stub:cut=1]", stream=False)
    assert_canonical_error(r, 502, ERROR_SHAPE[client])


def _frames(text: str) -> list[str]:
    return [f for f in text.split("\n\n") if f.strip()]


def _data(frame: str) -> Any:
    return json.loads(next(line[6:] for line in frame.split("\n") if line.startswith("data: ")))


@pytest.mark.parametrize("client", CLIENTS)
def test_same_format_stream_is_relayed_byte_for_byte(front: Daemon, stub: str, client: str) -> None:
    """Same format in and out: the client gets the upstream's own events as the upstream wrote them (what Reef
    does not model, like Anthropic's thinking signatures and redacted thinking, included); only the final event
    is Reef's, carrying the receipt. A chat client that did not ask for usage does not get the usage chunk."""
    up = {"chat": "openai-chat", "responses": "openai-responses", "messages": "anthropic"}[client]
    with httpx.Client() as s:
        s.delete(stub + "/_stub/requests")
        via = raw_request(front, f"stub-{SHORT[up]}", client, "hi [stub:thinking]", stream=True)
        sent = s.get(stub + "/_stub/requests").json()[-1]
        direct = s.post(stub + sent["path"], json=sent["body"]).text
    assert via.status_code == 200, via.text
    receipt = via.headers["x-reef-agent-record-id"]
    got, want = _frames(via.text), _frames(direct)
    if client == "chat":
        usage = [f for f in want if '"usage":{' in f]  # Reef asked for it (to record usage); the client did not
        assert len(usage) == 1 and '"usage"' not in via.text
        want = [f for f in want if f not in usage]
        assert got[:-2] == want[:-1] and got[-1] == want[-1] == "data: [DONE]"
        assert _data(got[-2]) == {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1,
                                  "model": "stub-model", "choices": [],
                                  "reef": {"agent_record_id": receipt, "record_id": receipt,
                                           "release_id": via.headers["x-reef-release-id"]}}
    else:
        assert got[:-1] == want[:-1]
        assert got[-1].split("\n")[0] == want[-1].split("\n")[0]  # event: message_stop / response.completed
        assert _data(got[-1]) == {**_data(want[-1]), "reef": {"agent_record_id": receipt, "record_id": receipt,
                                                              "release_id": via.headers["x-reef-release-id"]}}
    rec = record(front, receipt)
    assert rec["status"] == "complete" and answer_text(up, rec["response"]) == "stub says hello"
    assert rec["usage"]["input_tokens"] == 11 and rec["usage"]["upstream"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_thinking_signatures_survive(front: Daemon, stream: bool) -> None:
    """Claude Code sends earlier thinking blocks back with their signatures; through Reef it must get them."""
    with anthropic.Anthropic(base_url=f"{front.url}/s/stub-anthropic", api_key=front.token, max_retries=0) as c:
        args: dict[str, Any] = {"model": "claude-x", "max_tokens": 64,
                                "thinking": {"type": "enabled", "budget_tokens": 32},
                                "messages": [{"role": "user", "content": "think [stub:thinking]"}]}
        if stream:
            with c.messages.stream(**args) as s:
                msg = s.get_final_message()
                receipt = s.response.headers["x-reef-agent-record-id"]
        else:
            raw = c.messages.with_raw_response.create(**args)
            msg, receipt = raw.parse(), raw.headers["x-reef-agent-record-id"]
    thinking, redacted, text = msg.content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "Let me think.",
                                                                      "c2lnbmF0dXJlLXN0dWI=")
    assert (redacted.type, redacted.data) == ("redacted_thinking", "ZW5jcnlwdGVkLXN0dWI=")
    assert text.text == "stub says hello" and msg.stop_reason == "end_turn"
    assert (extra(msg, "reef") or {}).get("record_id", receipt) == receipt
    rec = record(front, receipt)
    assert rec["status"] == "complete" and rec["usage"]["output_tokens"] == 5


def test_chat_fields_reef_does_not_model_reach_the_client(front: Daemon) -> None:
    with openai.OpenAI(base_url=f"{front.url}/s/stub-chat/v1", api_key=front.token, max_retries=0) as c:
        whole = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        chunks = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                stream=True))
    assert whole.system_fingerprint == "fp_stub" and whole.choices[0].message.content == "stub says hello"
    assert extra(whole, "reef")["record_id"].startswith("rec_")
    assert all(ch.system_fingerprint == "fp_stub" for ch in chunks[:-1])
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "stub says hello"
    assert all(ch.usage is None for ch in chunks) and extra(chunks[-1], "reef")["record_id"].startswith("rec_")


def test_client_headers_forwarded_but_never_reefs_token(front: Daemon, stub: str) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": front.token, "anthropic-version": "2023-06-01",
               "anthropic-beta": "context-management-2025-06-27", "X-Claude-Code-Session-Id": "sess-1"}
    with httpx.Client(base_url=front.url, headers={"Authorization": ""}) as c, httpx.Client() as s:
        c.headers.pop("Authorization")
        s.delete(stub + "/_stub/requests")
        assert c.post("/s/stub-anthropic/v1/messages?beta=true", json=body, headers=headers).status_code == 200
        counted = c.post("/s/stub-anthropic/v1/messages/count_tokens?beta=true", json=body, headers=headers)
        assert counted.json() == {"input_tokens": 42}
        # translated for an upstream of another format: the Anthropic headers and query mean nothing there
        assert c.post("/s/stub-chat/v1/messages?beta=true", json=body, headers=headers).status_code == 200
        sent = s.get(stub + "/_stub/requests").json()
    assert [r["path"] for r in sent] == ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"]
    for r in sent[:2]:
        h = {k.lower(): v for k, v in r["headers"].items()}
        assert r["query"] == "beta=true"
        assert h["anthropic-beta"] == "context-management-2025-06-27" and h["x-claude-code-session-id"] == "sess-1"
        assert h["x-api-key"] == STUB_KEY and "authorization" not in h
    h = {k.lower(): v for k, v in sent[2]["headers"].items()}
    assert sent[2]["query"] == "" and "anthropic-beta" not in h and h["authorization"] == f"Bearer {STUB_KEY}"
    assert front.token not in json.dumps(sent)


@pytest.mark.parametrize("client", CLIENTS)
def test_failed_exchanges_are_recorded_with_retry_after(front: Daemon, client: str) -> None:
    """An upstream that refuses or fails before answering: the client gets the error (with the upstream's
    Retry-After, which the SDKs wait for) and a receipt; the record holds the request and the error."""
    scen = scenario(front, f"fail-{client}", "stub-anthropic")
    for directive, status, stream in (("[stub:status=429]", 429, True), ("[stub:status=503]", 502, False)):
        r = raw_request(front, scen, client, f"hi {directive}", stream=stream)
        err = assert_canonical_error(r, status, ERROR_SHAPE[client])
        assert r.headers["retry-after"] == "7"
        rec = record(front, r.headers["x-reef-agent-record-id"])
        assert rec["status"] == "error" and rec["scenario"] == scen and rec["release_id"]
        assert directive in json.dumps(rec["request"]) and rec["request"]["stream"] is stream
        error = rec["response"]["error"]
        assert error["upstream_status"] == (429 if status == 429 else 503) and err["message"] == error["message"]
        assert "stub refuses" in error["message"] and rec["timings"]["total_ms"] > 0 and rec["usage"] is None
    if client == "messages":
        with anthropic.Anthropic(base_url=f"{front.url}/s/{scen}", api_key=front.token, max_retries=0) as c:
            with pytest.raises(anthropic.RateLimitError) as e:
                c.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "[stub:status=429]"}])
        assert e.value.response.headers["retry-after"] == "7"
        # a timeout is recorded too
        r = raw_request(front, scenario(front, "fail-timeout", "stub-chat"), client, "[stub:slow=3]", stream=True)
        assert_canonical_error(r, 504, "anthropic")
        rec = record(front, r.headers["x-reef-agent-record-id"])
        assert rec["status"] == "error" and rec["response"]["error"]["type"] == "timeout_error"
    with front.http() as http:
        listed = http.get(f"/reef/scenarios/{scen}/records").json()["records"]
    assert [x["status"] for x in listed] == ["error"] * (3 if client == "messages" else 2)


def test_openai_reasoning_model_upstream(front: Daemon, stub: str) -> None:
    """An Anthropic client (Claude Code's temperature and token limit) served by an OpenAI reasoning model behind
    a chat upstream, which refuses ``max_tokens`` and ``temperature``."""
    with anthropic.Anthropic(base_url=f"{front.url}/s/stub-o3", api_key=front.token, max_retries=0) as c, \
            httpx.Client() as s:
        msg = c.messages.create(model="claude-x", max_tokens=300, extra_body={"temperature": 0.5},
                                messages=[{"role": "user", "content": "hi"}])
        sent = s.get(stub + "/_stub/requests").json()[-1]["body"]
    assert msg.content[0].text == "stub says hello"
    assert sent["model"] == "o3-mini" and sent["max_completion_tokens"] == 300
    assert "max_tokens" not in sent and "temperature" not in sent


@pytest.mark.parametrize(("budget", "effort"), [(1024, "low"), (10_000, "medium"), (31_999, "high")])
def test_thinking_budget_becomes_reasoning_effort(front: Daemon, stub: str, budget: int, effort: str) -> None:
    """Claude Code's "think" / "think hard" / "ultrathink" budgets reach an OpenAI reasoning model as its effort;
    a model that is not a reasoning model (which would refuse the field) gets none and still answers."""
    thinking = {"type": "enabled", "budget_tokens": budget}
    with anthropic.Anthropic(base_url=front.url, api_key=front.token, max_retries=0) as c, httpx.Client() as s:
        for scen, model in (("stub-o3", "o3-mini"), ("stub-chat", "stub-model")):
            with c.messages.stream(model="claude-x", max_tokens=budget + 100, thinking=thinking,  # type: ignore[arg-type]
                                   messages=[{"role": "user", "content": "hi"}],
                                   extra_headers={"x-reef-scenario": scen}) as events:
                msg = events.get_final_message()
            sent = s.get(stub + "/_stub/requests").json()[-1]["body"]
            assert msg.content[-1].text == "stub says hello" and sent["model"] == model
            assert sent.get("reasoning_effort") == (effort if model == "o3-mini" else None)


def test_count_tokens(front: Daemon, upstream: Daemon, stub: str) -> None:
    body = {"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "count these words"}]}
    with front.http() as http, upstream.http() as direct, httpx.Client() as s:
        via = http.post("/s/up-anthropic/v1/messages/count_tokens", json=body).json()["input_tokens"]
        assert via == direct.post("/v1/messages/count_tokens", json={**body, "model": "tiny"}).json()["input_tokens"]
        s.delete(stub + "/_stub/requests")
        assert http.post("/s/stub-anthropic/v1/messages/count_tokens",
                         json={**body, "max_tokens": 5}).json() == {"input_tokens": 42}
        sent = s.get(stub + "/_stub/requests").json()[-1]
        assert sent["path"] == "/v1/messages/count_tokens" and "max_tokens" not in sent["body"]
        assert sent["body"]["model"] == "stub-model"
        estimate = http.post("/s/stub-chat/v1/messages/count_tokens", json=body).json()["input_tokens"]
        assert estimate == math.ceil(len("be brief" + "count these words") / 4)


def test_metrics_report_upstream_latency_and_errors(front: Daemon) -> None:
    raw_request(front, "stub-chat", "chat", "[stub:status=503]", stream=False)
    raw_request(front, "stub-chat", "chat", "hi", stream=False)
    with front.http() as http:
        text = http.get("/metrics").text
    assert 'reef_upstream_seconds_count{model="stub-chat"}' in text
    assert 'reef_upstream_errors_total{kind="http_503",model="stub-chat"}' in text
    assert 'reef_upstream_errors_total{kind="connect",model="dead"}' in text or "dead" not in text


def test_serve_flags(tiny_model: Path, stub: str) -> None:
    """``reef serve --upstream-url --upstream-format --upstream-model`` serves from that upstream by default."""
    home, port, env = make_home(tiny_model)
    env["REEF_UPSTREAM_API_KEY"] = "flag-key_123"
    log = open(home / "logs" / "serve.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen(
        [sys.executable, "-m", "reef_cli.main", "serve", "--port", str(port), "--upstream-url", stub,
         "--upstream-format", "anthropic", "--upstream-model", "flag-model"],
        env=env, stdout=log, stderr=log, cwd=home,
    )
    log.close()
    try:
        deadline = time.monotonic() + 60
        while not probe_unix(home / "reef.sock"):
            assert proc.poll() is None and time.monotonic() < deadline, (home / "logs" / "serve.log").read_text()
            time.sleep(0.05)
        token = (home / "token").read_text().strip()
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0) as c, \
                httpx.Client() as s:
            out = c.chat.completions.create(model="whatever", messages=[{"role": "user", "content": "hi"}])
            sent = s.get(stub + "/_stub/requests").json()[-1]
        assert out.choices[0].message.content == "stub says hello"
        assert sent["path"] == "/v1/messages" and sent["body"]["model"] == "flag-model"
        assert sent["headers"]["x-api-key"] == "flag-key_123"
        cfg = load_config({"REEF_HOME": str(home)})
        assert cfg.default_model == "tiny"  # the flags are not written to the config file
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(home, ignore_errors=True)


def test_engine_streams_events_as_they_arrive() -> None:
    """In-process: the engine hands on the first event while the upstream still holds the rest of its answer
    (no buffering of the whole answer): a bare server sends the rest only once that first event came through."""
    import asyncio
    import socket
    import threading

    first_seen = threading.Event()
    held: list[bool] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        data = json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        return f"data: {data}\n\n".encode()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         + chunk({"role": "assistant", "content": "hel"}))
            held.append(first_seen.wait(60))  # hang guard only: the engine must pass "hel" on before the rest
            conn.sendall(chunk({"content": "lo"}) + chunk({}, "stop") + b"data: [DONE]\n\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def run() -> tuple[object, str]:
        entry = ModelEntry(name="s", engine="upstream", url=f"http://127.0.0.1:{srv.getsockname()[1]}",
                           format="openai-chat", upstream_model="m")
        engine = UpstreamEngine(entry, {})
        await engine.start()
        try:
            ex = chat.parse_request({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
            events = engine.generate(ex)
            first = await anext(events)
            first_seen.set()
            rest = [ev async for ev in events]
            assert isinstance(rest[-1], Finish)
            return first, rest[-1].completion.text
        finally:
            await engine.close()

    try:
        first, text = asyncio.run(run())
    finally:
        first_seen.set()
        thread.join(10)
        srv.close()
    assert held == [True], "the first event came only after the upstream sent the whole answer"
    assert not isinstance(first, Finish) and text == "hello"  # the first event: "hel" (relayed or as a delta)


def _raw_upstream(answers: list[tuple[bytes, bool]]) -> tuple[int, list[bytes], Any]:
    """A bare HTTP server on loopback (a thread) that answers each request with the next of ``answers``: raw bytes,
    and whether to close the connection after them. Returns the port, the requests it got, and a stop function."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    got: list[bytes] = []
    todo = list(answers)

    def serve() -> None:
        while todo:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while todo:
                    while b"\r\n\r\n" not in buf or len(buf.split(b"\r\n\r\n", 1)[1]) < int(
                            buf.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0]):
                        data = conn.recv(65536)
                        if not data:
                            break
                        buf += data
                    if not buf:
                        break
                    head, rest = buf.split(b"\r\n\r\n", 1)
                    n = int(head.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0])
                    got.append(head + b"\r\n\r\n" + rest[:n])
                    buf = rest[n:]
                    answer, close = todo.pop(0)
                    conn.sendall(answer)
                    if close:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def stop() -> None:
        srv.close()
        thread.join(5)

    return srv.getsockname()[1], got, stop


def test_upstream_connections_closed_by_the_server_are_not_reused() -> None:
    """The engine's HTTP client against a bare server: an answer that ends with the connection (no length), an
    HTTP/1.0 answer, ``Connection: close``, and a server that drops a kept-alive connection while it is idle
    (as uvicorn does after 5 s): each next request gets a fresh connection and its answer."""
    import asyncio

    body = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()
    sized = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    answers = [
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + body, True),  # ends with the connection
        (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
         True),
        (sized.replace(b"Content-Type", b"Connection: close\r\nContent-Type"), True),
        (sized, True),  # kept alive as far as the answer says, then dropped by the server while idle
        (sized, False),
    ]
    port, got, stop = _raw_upstream(answers)

    async def run() -> list[str]:
        entry = ModelEntry(name="raw", engine="upstream", url=f"http://127.0.0.1:{port}", format="openai-chat",
                           upstream_model="m")
        engine = UpstreamEngine(entry, {})
        await engine.start()
        texts = []
        try:
            for i in range(5):
                if i == 4:  # the server closed the idle connection after the 4th answer
                    await asyncio.sleep(0.2)
                ex = chat.parse_request({"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]})
                async for ev in engine.generate(ex):
                    if isinstance(ev, Finish):
                        texts.append(ev.completion.text)
        finally:
            await engine.close()
        return texts

    try:
        assert asyncio.run(run()) == ["hi"] * 5
    finally:
        stop()
    assert len(got) == 5 and all(g.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") for g in got)
    assert all(f"q{i}".encode() in g for i, g in enumerate(got))


def test_a_request_meeting_the_servers_idle_close_is_resent_only_where_asked() -> None:
    """A kept-alive connection the server closes as the next request arrives, answering nothing (its idle timeout
    racing the request: vLLM's and SGLang's uvicorn close idle connections after 5 s; a 502 in the middle of a
    benchmark here): the inference-server engines' pool (``resend_on_stale``) sends the request again on a new
    connection and gets its answer; the default pool (outside providers, where a resend could run a request
    twice) reports the lost connection."""
    import asyncio

    from daemon.engines import http

    sized = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    async def run(port: int, resend: bool) -> list[tuple[int, bytes, bool]]:
        pool = http.Pool("http", "127.0.0.1", port, connect_timeout=5, resend_on_stale=resend)
        out = []
        try:
            for i in range(2):
                head = http.request_head("POST", f"/q{i}", pool.host_header, "", 2)
                resp, fresh = await pool.request(head, b"{}", timeout=10)
                out.append((resp.status, await resp.read(10), fresh))
                resp.release()
        finally:
            await pool.close()
        return out

    port, got, stop = _raw_upstream([(sized, False), (b"", True), (sized, False)])
    try:
        assert asyncio.run(run(port, True)) == [(200, b"{}", True), (200, b"{}", True)]
    finally:
        stop()
    assert [g.split(b" ")[1] for g in got] == [b"/q0", b"/q1", b"/q1"]  # the second one, sent again
    port, got, stop = _raw_upstream([(sized, False), (b"", True)])
    try:
        with pytest.raises(http.ConnectionLost):
            asyncio.run(run(port, False))
    finally:
        stop()
    assert len(got) == 2


def test_exchange_built_in_the_daemon_reaches_a_same_format_upstream(stub: str) -> None:
    """The daemon's own requests (gate tasks, proposers) are exchanges without a client body: translated."""
    import asyncio

    from daemon.exchange import Message, Part

    async def run() -> str:
        entry = ModelEntry(name="s", engine="upstream", url=stub, format="openai-chat", upstream_model="m")
        engine = UpstreamEngine(entry, {})
        await engine.start()
        try:
            ex = chat.parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
            ex.body, ex.messages = {}, [Message("user", [Part("text", text="hi")])]
            async for ev in engine.generate(ex):
                if isinstance(ev, Finish):
                    return ev.completion.text
            raise AssertionError("no Finish")
        finally:
            await engine.close()

    assert asyncio.run(run()) == "stub says hello"
    with httpx.Client() as s:
        sent = s.get(stub + "/_stub/requests").json()[-1]["body"]
    assert sent["messages"] == [{"role": "user", "content": "hi"}] and sent["model"] == "m"


def test_upstream_keys_never_stored_or_logged(front: Daemon, upstream: Daemon) -> None:
    """Runs last: after every test above went through the front, its records and logs hold neither key."""
    ask(front, "stub-anthropic", "messages", True)
    secrets = [STUB_KEY.encode(), upstream.token.encode()]
    checked = 0
    for path in [*front.home.glob("records.sqlite3*"), *(front.home / "logs").rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            checked += 1
            assert not any(s in data for s in secrets), path
    assert checked >= 2
    assert os.environ.get("STUB_API_KEY") is None  # the key lived in the front's environment only
