"""The provider formats on their own (no server): request bodies real agents send parse into the neutral form,
malformed ones are a ``BadRequest`` naming the param, and rendered responses and SSE streams are read back by the
official ``openai`` and ``anthropic`` SDKs (their own parsers and stream accumulators, over a mock transport)."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.errors import BadRequest, Conflict, NotFound, StorageError, Unsupported, UpstreamError
from daemon.exchange import (
    Completion,
    Receipt,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    Usage,
)
from daemon.protocols import anthropic as anth
from daemon.protocols import openai_chat as chat
from daemon.protocols import openai_responses as resp
from daemon.protocols.sse import sse
from tests.conftest import sse_events

RECEIPT = Receipt(record_id="rec_123", release_id="rel_abc")
MODULES = {"anthropic": anth, "chat": chat, "responses": resp}
IDS = {"anthropic": "msg_01", "chat": "chatcmpl-01", "responses": "resp_01"}


# --- bodies ----------------------------------------------------------------------------------------------------


def claude_code_body() -> dict[str, Any]:
    """Shaped like Claude Code 2.x's first tool round trip (trimmed)."""
    cache = {"type": "ephemeral"}
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "temperature": 1,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197"},
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": cache,
            },
            {"type": "text", "text": "You are an interactive CLI tool.", "cache_control": cache},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "read a.txt", "cache_control": cache},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read it.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "a.txt"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
                        "cache_control": cache,
                    },
                    {"type": "text", "text": "now summarise"},
                ],
            },
            {"role": "system", "content": "The user switched to plan mode."},
            {"role": "user", "content": "go"},
        ],
        "tools": [
            {
                "name": "Read",
                "description": "Read a file",
                "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
                "cache_control": cache,
            },
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "some_future_field": {"anything": [1, 2]},
    }


def chat_body() -> dict[str, Any]:
    return {
        "model": "tiny",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 64,
        "temperature": 0.2,
        "stop": "END",
        "seed": 7,
        "parallel_tool_calls": False,
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"x":1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "a cat"}]},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "look", "description": "Look", "parameters": {"type": "object"}},
            },
            {"type": "custom", "custom": {"name": "grammar_tool"}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "look"}},
    }


def responses_body() -> dict[str, Any]:
    return {
        "model": "tiny",
        "instructions": "You are Codex.",
        "stream": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": "low", "summary": "auto"},
        "max_output_tokens": 100,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "env: linux"}]},
            {"role": "user", "content": "list files"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "Plan: run ls."}],
                "encrypted_content": "gAAA",
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running ls."}]},
            {"type": "function_call", "call_id": "call_9", "name": "shell", "arguments": '{"cmd":"ls"}'},
            {"type": "function_call_output", "call_id": "call_9", "output": "a.txt\nb.txt"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "and this?"},
                    {"type": "input_image", "image_url": "https://example.com/x.jpg", "detail": "auto"},
                ],
            },
        ],
        "tools": [
            {"type": "function", "name": "shell", "description": "Run", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
    }


# --- parsing ---------------------------------------------------------------------------------------------------


def test_claude_code_body() -> None:
    body = claude_code_body()
    ex = anth.parse_request(body)
    assert ex.format == "anthropic" and ex.model == "claude-sonnet-4-5" and ex.stream and ex.body is body
    roles = [m.role for m in ex.messages]
    assert roles == ["system", "user", "assistant", "tool", "user", "system", "user"]
    assert [p.text for p in ex.messages[0].parts][1] == "You are Claude Code, Anthropic's official CLI for Claude."
    assistant = ex.messages[2]
    assert [p.type for p in assistant.parts] == ["thinking", "text", "tool_call"]
    call = assistant.parts[2]
    assert (call.id, call.name, json.loads(call.arguments or "")) == ("toolu_01", "Read", {"file_path": "a.txt"})
    result = ex.messages[3].parts[0]
    assert (result.type, result.tool_call_id, result.text, result.is_error) == (
        "tool_result",
        "toolu_01",
        "hello\nworld",
        False,
    )
    assert ex.messages[4].text == "now summarise"
    assert ex.messages[5].text == "The user switched to plan mode."
    assert [t.name for t in ex.tools] == ["Read"]
    assert ex.tools[0].parameters["properties"]["file_path"] == {"type": "string"}
    assert ex.tool_choice == "auto"
    assert (ex.sampling.max_tokens, ex.sampling.temperature) == (32000, 1.0)


def test_anthropic_variants() -> None:
    ex = anth.parse_request(
        {
            "model": "m",
            "max_tokens": 5,
            "system": "sys",
            "stop_sequences": ["\n\nHuman:"],
            "top_k": 40,
            "top_p": 0.9,
            "tool_choice": {"type": "tool", "name": "Read"},
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "is_error": True,
                            "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}],
                        },
                    ],
                }
            ],
        }
    )
    assert [m.role for m in ex.messages] == ["system", "tool", "user"]
    assert ex.messages[1].parts[0].is_error and ex.messages[1].parts[1].source == "https://x/y.png"
    image = ex.messages[2].parts[0]
    assert (image.type, image.media_type, image.source) == ("image", "image/png", "data:image/png;base64,AAAA")
    assert ex.has_images() and ex.messages[2].parts[1].text == "doc"
    assert ex.sampling.stop == ["\n\nHuman:"] and ex.sampling.top_k == 40 and ex.tool_choice == {"name": "Read"}
    assert not ex.stream
    # count_tokens: no max_tokens needed; messages does not
    assert (
        anth.parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).messages[0].text
        == "hi"
    )
    assert anth.render_count_tokens(12) == {"input_tokens": 12}


def test_openai_chat_body() -> None:
    ex = chat.parse_request(chat_body())
    assert [m.role for m in ex.messages] == ["system", "user", "assistant", "tool"]
    image = ex.messages[1].parts[1]
    assert (image.type, image.media_type) == ("image", "image/png")
    call = ex.messages[2].parts[0]
    assert (call.type, call.id, call.name, call.arguments) == ("tool_call", "call_1", "look", '{"x":1}')
    assert (ex.messages[3].parts[0].tool_call_id, ex.messages[3].parts[0].text) == ("call_1", "a cat")
    assert [t.name for t in ex.tools] == ["look"] and ex.tool_choice == {"name": "look"}
    s = ex.sampling
    assert (s.max_tokens, s.temperature, s.stop, s.seed) == (64, 0.2, ["END"], 7)
    assert ex.stream and ex.stream_usage and ex.format == "openai-chat"


def test_responses_bodies() -> None:
    ex = resp.parse_request({"model": "tiny", "input": "hi"})
    assert [(m.role, m.text) for m in ex.messages] == [("user", "hi")] and not ex.stream
    ex = resp.parse_request(responses_body())
    assert [m.role for m in ex.messages] == ["system", "system", "user", "assistant", "tool", "user"]
    assert ex.messages[0].text == "You are Codex." and ex.messages[1].text == "env: linux"
    assistant = ex.messages[3]
    assert [p.type for p in assistant.parts] == ["thinking", "text", "tool_call"]
    assert assistant.parts[0].text == "Plan: run ls." and assistant.parts[2].id == "call_9"
    assert ex.messages[4].parts[0].tool_call_id == "call_9" and ex.messages[4].parts[0].text == "a.txt\nb.txt"
    assert ex.messages[5].parts[1].source == "https://example.com/x.jpg"
    assert [t.name for t in ex.tools] == ["shell"] and ex.tool_choice == "auto" and ex.sampling.max_tokens == 100


def _set(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    *keys, last = path.split(".")
    target: Any = body
    for k in keys:
        target = target[int(k)] if isinstance(target, list) else target[k]
    if value is DELETE:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return body


DELETE = object()
MINIMAL = {
    "anthropic": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "m", "input": [{"role": "user", "content": "hi"}]},
}
MALFORMED = [
    ("anthropic", "max_tokens", True, "max_tokens"),
    ("anthropic", "max_tokens", DELETE, "max_tokens"),
    ("anthropic", "max_tokens", 0, "max_tokens"),
    ("anthropic", "max_tokens", "8", "max_tokens"),
    ("anthropic", "model", DELETE, "model"),
    ("anthropic", "model", 3, "model"),
    ("anthropic", "messages", [], "messages"),
    ("anthropic", "messages", "hi", "messages"),
    ("anthropic", "messages.0", "hi", "messages[0]"),
    ("anthropic", "messages.0.role", "robot", "messages[0].role"),
    ("anthropic", "messages.0.content", [{"type": "nope"}], "messages[0].content[0].type"),
    ("anthropic", "messages.0.content", [{"text": "x"}], "messages[0].content[0].type"),
    ("anthropic", "messages.0.content", [{"type": "text", "text": 5}], "messages[0].content[0].text"),
    ("anthropic", "messages.0.content", 5, "messages[0].content"),
    ("anthropic", "temperature", math.nan, "temperature"),
    ("anthropic", "temperature", math.inf, "temperature"),
    ("anthropic", "temperature", "hot", "temperature"),
    ("anthropic", "top_p", 2, "top_p"),
    ("anthropic", "stop_sequences", [1], "stop_sequences[0]"),
    ("anthropic", "stream", "yes", "stream"),
    ("anthropic", "system", 5, "system"),
    ("anthropic", "tools", [{"name": "x"}], "tools[0].input_schema"),
    ("anthropic", "tools", {"name": "x"}, "tools"),
    ("anthropic", "tool_choice", {"type": "maybe"}, "tool_choice.type"),
    ("chat", "messages", DELETE, "messages"),
    ("chat", "messages.0.role", "bot", "messages[0].role"),
    ("chat", "messages.0", {"content": "hi"}, "messages[0].role"),
    ("chat", "messages.0.content", [{"type": "image_url", "image_url": {}}], "messages[0].content[0].image_url.url"),
    ("chat", "messages.0", {"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ("chat", "messages.0", {"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function"),
    ("chat", "max_tokens", False, "max_tokens"),
    ("chat", "max_completion_tokens", -1, "max_completion_tokens"),
    ("chat", "temperature", math.nan, "temperature"),
    ("chat", "stop", 5, "stop"),
    ("chat", "seed", 1.5, "seed"),
    ("chat", "tool_choice", "always", "tool_choice"),
    ("chat", "tools", [{"type": "function"}], "tools[0].function"),
    ("responses", "input", DELETE, "input"),
    ("responses", "input", 5, "input"),
    ("responses", "input", [], "input"),
    ("responses", "input.0", {"type": "function_call", "name": "f"}, "input[0].call_id"),
    ("responses", "input.0.content", [{"type": "input_text"}], "input[0].content[0].text"),
    ("responses", "max_output_tokens", 1.0, "max_output_tokens"),
    ("responses", "instructions", ["x"], "instructions"),
]


@pytest.mark.parametrize(("fmt", "path", "value", "param"), MALFORMED)
def test_malformed_bodies(fmt: str, path: str, value: Any, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        MODULES[fmt].parse_request(_set(MINIMAL[fmt], path, value))
    assert info.value.param == param, info.value.message
    assert param.split(".")[-1].split("[")[0] in info.value.message


@pytest.mark.parametrize("fmt", MODULES)
@pytest.mark.parametrize("body", [None, [], "x", 1, True])
def test_non_object_body(fmt: str, body: Any) -> None:
    with pytest.raises(BadRequest, match="request body"):
        MODULES[fmt].parse_request(body)


@pytest.mark.parametrize(
    ("fmt", "path", "value"),
    [
        ("anthropic", "messages.0.content", [{"type": "document", "source": {"type": "base64", "data": "JVBE"}}]),
        ("chat", "messages.0.content", [{"type": "input_audio", "input_audio": {}}]),
        ("chat", "n", 2),
        ("responses", "previous_response_id", "resp_1"),
        ("responses", "input.0.content", [{"type": "input_file", "file_id": "f"}]),
    ],
)
def test_unsupported(fmt: str, path: str, value: Any) -> None:
    with pytest.raises(Unsupported):
        MODULES[fmt].parse_request(_set(MINIMAL[fmt], path, value))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
VALID = {"anthropic": claude_code_body(), "chat": chat_body(), "responses": responses_body()}


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(list(MODULES)), data=st.data(), junk=JSON)
def test_mutated_bodies_only_raise_bad_request(fmt: str, data: st.DataObject, junk: Any) -> None:
    body = copy.deepcopy(VALID[fmt])
    path = data.draw(st.sampled_from(_paths(body)))
    if not path:
        body = junk
    else:
        target = body
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = junk
    try:
        MODULES[fmt].parse_request(body)
    except BadRequest:
        pass


# --- rendering: non-streaming ----------------------------------------------------------------------------------


def completion(**kw: Any) -> Completion:
    base: dict[str, Any] = {
        "text": "Hello",
        "thinking": "hmm",
        "tool_calls": [ToolCall("call_1", "read", '{"path":"a.txt"}'), ToolCall("call_2", "ls", "")],
        "stop_reason": "tool_calls",
        "usage": Usage(input_tokens=10, output_tokens=5, cache_read_tokens=4),
    }
    return Completion(**{**base, **kw})


def exchange(fmt: str, **kw: Any) -> Any:
    bodies = {
        "anthropic": {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        "responses": {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "read"}]},
    }
    return MODULES[fmt].parse_request({**bodies[fmt], **kw})


def mock_client(sdk: type, payload: bytes | dict, base: str) -> Any:
    def handler(request: httpx2.Request) -> httpx2.Response:
        if isinstance(payload, bytes):
            return httpx2.Response(200, content=payload, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=payload)

    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    return sdk(api_key="k", base_url="http://reef.test" + base, http_client=http, max_retries=0)


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_render_anthropic() -> None:
    ex = exchange("anthropic")
    body = anth.render_response(ex, completion(), response_id="msg_01", created=0, receipt=RECEIPT)
    with mock_client(anthropic.Anthropic, body, "") as client:
        msg = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert isinstance(msg, anthropic.types.Message) and msg.id == "msg_01" and msg.model == "m"
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[2].input == {"path": "a.txt"} and msg.content[3].input == {} and msg.content[2].id == "call_1"
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (6, 4, 5)
    assert extra(msg, "reef") == RECEIPT.to_dict()
    c = completion(text="x", thinking="", tool_calls=[], stop_reason="stop_sequence", stop_sequence="END")
    body = anth.render_response(ex, c, response_id="msg_02", created=0, receipt=None)
    msg = anthropic.types.Message.model_validate(body)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "END") and "reef" not in body
    assert (
        anth.render_response(ex, completion(stop_reason="length"), response_id="m", created=0, receipt=None)[
            "stop_reason"
        ]
        == "max_tokens"
    )


def test_render_chat() -> None:
    ex = exchange("chat")
    body = chat.render_response(ex, completion(), response_id="chatcmpl-01", created=5, receipt=RECEIPT)
    with mock_client(openai.OpenAI, body, "/v1") as client:
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert isinstance(out, openai.types.chat.ChatCompletion) and out.created == 5
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Hello"
    assert [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or []] == [
        ("call_1", "read", '{"path":"a.txt"}'),
        ("call_2", "ls", ""),
    ]
    assert extra(choice.message, "reasoning_content") == "hmm"
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        10,
        5,
        15,
    )
    assert extra(out, "reef") == RECEIPT.to_dict()
    for reason, finish in [("stop", "stop"), ("length", "length"), ("stop_sequence", "stop")]:
        c = completion(stop_reason=reason, tool_calls=[])
        body = chat.render_response(ex, c, response_id="x", created=0, receipt=None)
        assert openai.types.chat.ChatCompletion.model_validate(body).choices[0].finish_reason == finish


def test_render_responses() -> None:
    ex = exchange("responses", temperature=0.5, metadata={"k": "v"})
    body = resp.render_response(ex, completion(), response_id="resp_01", created=7, receipt=RECEIPT)
    with mock_client(openai.OpenAI, body, "/v1") as client:
        out = client.responses.create(model="m", input="hi")
    assert isinstance(out, openai.types.responses.Response) and out.id == "resp_01" and out.status == "completed"
    assert [o.type for o in out.output] == ["reasoning", "message", "function_call", "function_call"]
    assert out.output_text == "Hello" and out.output[2].call_id == "call_1" and out.output[2].id.startswith("fc_")
    assert out.usage is not None and out.usage.input_tokens_details.cached_tokens == 4
    assert out.temperature == 0.5 and out.metadata == {"k": "v"} and out.tools[0].name == "read"
    assert extra(out, "reef") == RECEIPT.to_dict()
    cut = resp.render_response(ex, completion(stop_reason="length"), response_id="r", created=0, receipt=None)
    cut = openai.types.responses.Response.model_validate(cut)
    assert (
        cut.status == "incomplete" and cut.incomplete_details and cut.incomplete_details.reason == "max_output_tokens"
    )


# --- rendering: streams -----------------------------------------------------------------------------------------

EVENTS = [
    ThinkingDelta("h"),
    ThinkingDelta("mm"),
    TextDelta("Hel"),
    TextDelta("lo"),
    ToolCallStart(0, "call_1", "read"),
    ToolCallDelta(0, '{"path":'),
    ToolCallDelta(0, '"a.txt"}'),
    ToolCallStart(1, "call_2", "ls"),
]


def stream(fmt: str, events: list, c: Completion, receipt: Receipt | None = RECEIPT, **kw: Any) -> bytes:
    ex = exchange(fmt, stream=True, **kw)
    r = MODULES[fmt].StreamRenderer(ex, response_id=IDS[fmt], created=3)
    frames = r.start()
    for ev in events:
        frames += r.event(ev)
    return b"".join(frames + r.finish(c, receipt))


@pytest.mark.parametrize("events", [EVENTS, []], ids=["streamed", "finish-only"])
def test_anthropic_stream(events: list) -> None:
    payload = stream("anthropic", events, completion())
    with mock_client(anthropic.Anthropic, payload, "") as client:
        with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as s:
            msg = s.get_final_message()
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[0].thinking == "hmm" and msg.content[1].text == "Hello"
    assert (msg.content[2].id, msg.content[2].input) == ("call_1", {"path": "a.txt"})
    assert msg.content[3].name == "ls" and msg.content[3].input == {}
    assert msg.stop_reason == "tool_use" and (msg.usage.input_tokens, msg.usage.output_tokens) == (6, 5)
    events_ = sse_events(payload.decode())
    assert all(name == data["type"] for name, data in events_)
    assert events_[-1] == ("message_stop", {"type": "message_stop", "reef": RECEIPT.to_dict()})
    assert events_[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


@pytest.mark.parametrize("events", [EVENTS, []], ids=["streamed", "finish-only"])
def test_chat_stream(events: list) -> None:
    payload = stream("chat", events, completion(), stream_options={"include_usage": True})
    assert payload.endswith(b"data: [DONE]\n\n")
    with mock_client(openai.OpenAI, payload, "/v1") as client:
        chunks = list(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        )
        with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "hi"}]) as s:
            final = s.get_final_completion()
    assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-2].usage is not None and chunks[-2].usage.total_tokens == 15 and chunks[-2].choices == []
    assert chunks[-1].choices == [] and extra(chunks[-1], "reef") == RECEIPT.to_dict()
    message = final.choices[0].message
    assert message.content == "Hello" and final.choices[0].finish_reason == "tool_calls"
    assert [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []] == [
        ("call_1", "read", '{"path":"a.txt"}'),
        ("call_2", "ls", ""),
    ]


def test_chat_stream_without_usage_or_receipt() -> None:
    payload = stream(
        "chat", [TextDelta("x")], completion(text="x", thinking="", tool_calls=[], stop_reason="stop"), None
    )
    chunks = [data for _, data in sse_events(payload.decode())]
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"] for c in chunks[:-1])


@pytest.mark.parametrize("events", [EVENTS, []], ids=["streamed", "finish-only"])
def test_responses_stream(events: list) -> None:
    payload = stream("responses", events, completion())
    with mock_client(openai.OpenAI, payload, "/v1") as client:
        raw = list(client.responses.create(model="m", input="hi", stream=True))
        with client.responses.stream(model="m", input="hi") as s:
            final = s.get_final_response()
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    types = [e.type for e in raw]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 4
    assert extra(raw[-1], "reef") == RECEIPT.to_dict()
    assert final.id == "resp_01" and final.status == "completed" and final.output_text == "Hello"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert (final.output[2].call_id, final.output[2].arguments) == ("call_1", '{"path":"a.txt"}')
    added = [e.item.id for e in raw if e.type == "response.output_item.added"]
    assert added == [o.id for o in final.output]
    assert all(name == data["type"] for name, data in sse_events(payload.decode()))


def test_responses_stream_incomplete() -> None:
    c = completion(text="Hel", thinking="", tool_calls=[], stop_reason="length")
    payload = stream("responses", [TextDelta("Hel")], c)
    with mock_client(openai.OpenAI, payload, "/v1") as client:
        raw = list(client.responses.create(model="m", input="hi", stream=True))
    assert raw[-1].type == "response.incomplete" and raw[-1].response.status == "incomplete"
    assert raw[-1].response.output[0].content[0].text == "Hel" and extra(raw[-1], "reef") == RECEIPT.to_dict()


def test_stream_errors() -> None:
    err = UpstreamError("upstream went away")
    r = anth.StreamRenderer(exchange("anthropic"), response_id="msg_1", created=0)
    payload = b"".join(r.start() + r.event(TextDelta("a")) + r.error(err))
    with mock_client(anthropic.Anthropic, payload, "") as client:
        with pytest.raises(anthropic.APIStatusError, match="upstream went away"):
            with client.messages.stream(model="m", max_tokens=9, messages=[{"role": "user", "content": "hi"}]) as s:
                s.get_final_message()
    assert sse_events(payload.decode())[-1][1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream went away"},
    }

    r = chat.StreamRenderer(exchange("chat"), response_id="c1", created=0)
    payload = b"".join(r.start() + r.error(err))
    with mock_client(openai.OpenAI, payload, "/v1") as client:
        with pytest.raises(openai.APIError, match="upstream went away"):
            list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))

    r = resp.StreamRenderer(exchange("responses"), response_id="resp_1", created=0)
    payload = b"".join(r.start() + r.event(TextDelta("a")) + r.error(err))
    with mock_client(openai.OpenAI, payload, "/v1") as client:
        raw = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in raw[-2:]] == ["error", "response.failed"]
    assert raw[-1].response.error is not None and raw[-1].response.error.code == "server_error"


def test_error_bodies() -> None:
    bad = BadRequest("messages[0].role: nope", param="messages[0].role")
    assert chat.error_body(bad) == {
        "error": {
            "message": "messages[0].role: nope",
            "type": "invalid_request_error",
            "code": "invalid_request_error",
            "param": "messages[0].role",
        }
    }
    assert resp.error_body(NotFound("x"))["error"]["code"] == "not_found_error"
    cases = [
        (bad, "invalid_request_error"),
        (NotFound("x"), "not_found_error"),
        (Conflict("x"), "invalid_request_error"),
        (StorageError("x"), "api_error"),
        (UpstreamError("x"), "api_error"),
    ]
    for err, kind in cases:
        assert anth.error_body(err) == {"type": "error", "error": {"type": kind, "message": err.message}}


def test_sse_frame() -> None:
    assert sse({"a": "é"}, "x") == 'event: x\ndata: {"a":"é"}\n\n'.encode()
    assert sse("[DONE]") == b"data: [DONE]\n\n"
