"""JSON Schemas of the provider request bodies, as far as the wire formats here check them (``GET /openapi.json``,
``daemon/openapi.py``): the fields each ``parse_request`` reads, with the limits it and ``sse.sampling`` enforce.
Everything else in a body is the provider's own and passes through unread, so every object stays open. Kept beside
the parsers they describe: change one with the other."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

S: dict[str, Any] = {"type": "string"}
O: dict[str, Any] = {"type": "object"}  # noqa: E741
ANY: dict[str, Any] = {}


def obj(props: dict[str, Any], required: Iterable[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required := list(required):
        out["required"] = required
    return out


def arr(items: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **kw}


def kind(name: str, **props: Any) -> dict[str, Any]:
    """A tagged object (``{"type": name, ...}``) whose ``props`` are all required."""
    return obj({"type": {"const": name}, **props}, ["type", *props])


POSITIVE = {"type": "integer", "minimum": 1}
# sse.sampling; the embedded engine also refuses top_p 0 (it would keep no token)
SAMPLING = {"temperature": {"type": "number", "minimum": 0},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0}, "seed": {"type": "integer"}, "stream": {"type": "boolean"}}
STOP = {"anyOf": [S, arr(S)]}
ARGUMENTS = {"anyOf": [S, O, {"type": "null"}]}  # sse.tool_arguments

# --- OpenAI chat completions (openai_chat.parse_request) ----------------------------------------------------------

_CHAT_PART = {"anyOf": [kind("text", text=S), kind("refusal", refusal=S),
                        obj({"type": {"const": "image_url"}, "image_url": obj({"url": S}, ["url"])},
                            ["type", "image_url"])]}
_CHAT_CONTENT = {"anyOf": [S, arr(_CHAT_PART), {"type": "null"}]}
_CHAT_CALL = obj({"id": S, "type": S, "function": obj({"name": S, "arguments": ARGUMENTS}, ["name"])},
                 ["id", "function"])
CHAT = obj({
    "model": S,
    "messages": arr({"anyOf": [
        obj({"role": {"enum": ["system", "developer", "user"]}, "content": _CHAT_CONTENT}, ["role"]),
        obj({"role": {"const": "assistant"}, "content": _CHAT_CONTENT, "tool_calls": arr(_CHAT_CALL),
             "reasoning_content": S}, ["role"]),
        obj({"role": {"const": "tool"}, "tool_call_id": S, "content": _CHAT_CONTENT}, ["role", "tool_call_id"]),
        obj({"role": {"const": "function"}, "name": S, "content": _CHAT_CONTENT}, ["role", "name"]),
    ]}, minItems=1),
    "n": {"enum": [1, None]}, "max_tokens": POSITIVE, "max_completion_tokens": POSITIVE, "stop": STOP,
    "stream_options": obj({"include_usage": {"type": "boolean"}}),
    "tools": arr(obj({"type": {"const": "function"}, "function": obj({"name": S, "description": S, "parameters": O},
                                                                     ["name"])}, ["function"])),
    "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]},
                              obj({"type": {"const": "function"}, "function": obj({"name": S}, ["name"])},
                                  ["type", "function"])]},
    **SAMPLING,
}, ["model", "messages"])

# --- OpenAI Responses (openai_responses.parse_request) -------------------------------------------------------------

_RESPONSES_PART = {"anyOf": [obj({"type": {"enum": ["input_text", "output_text", "text"]}, "text": S},
                                 ["type", "text"]),
                             kind("refusal", refusal=S), kind("input_image", image_url=S)]}
_RESPONSES_CONTENT = {"anyOf": [S, arr(_RESPONSES_PART)]}
_STATELESS = {"type": "null", "description": "no server-side conversation state here: send the full input"}
RESPONSES = obj({
    "model": S,
    "input": {"anyOf": [S, arr({"anyOf": [
        obj({"type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
             "content": _RESPONSES_CONTENT}, ["role", "content"]),
        obj({"type": {"const": "function_call"}, "call_id": S, "name": S, "arguments": ARGUMENTS},
            ["type", "call_id", "name"]),
        obj({"type": {"const": "function_call_output"}, "call_id": S, "output": _RESPONSES_CONTENT},
            ["type", "call_id", "output"]),
        obj({"type": {"const": "reasoning"}, "summary": arr(obj({"text": S}))}, ["type"]),
    ]}, minItems=1)]},
    "instructions": S, "max_output_tokens": POSITIVE, "stop": STOP,
    "tools": arr(obj({"type": S, "name": S, "description": S, "parameters": O}, ["type"])),
    "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]},
                              obj({"type": {"const": "function"}, "name": S}, ["type", "name"])]},
    "previous_response_id": _STATELESS, "conversation": _STATELESS,
    **SAMPLING,
}, ["model", "input"])

# --- Anthropic Messages (anthropic.parse_request, parse_count_tokens) ----------------------------------------------

_IMAGE = obj({"type": {"const": "image"}, "source": {"anyOf": [
    obj({"type": {"const": "base64"}, "media_type": S, "data": S}, ["type", "media_type", "data"]),
    obj({"type": {"const": "url"}, "url": S}, ["type", "url"])]}}, ["type", "source"])
_DOCUMENT = obj({"type": {"const": "document"}, "source": obj({"type": {"const": "text"}, "data": S},
                                                              ["type", "data"])}, ["type", "source"])
_TEXT = kind("text", text=S)
_BLOCKS = arr({"anyOf": [
    _TEXT, _IMAGE, _DOCUMENT, obj({"type": {"const": "thinking"}, "thinking": S}, ["type"]),
    obj({"type": {"const": "tool_use"}, "id": S, "name": S, "input": O}, ["type", "id", "name"]),
    obj({"type": {"const": "tool_result"}, "tool_use_id": S, "is_error": {"type": "boolean"},
         "content": {"anyOf": [S, arr({"anyOf": [_TEXT, _IMAGE, _DOCUMENT]})]}}, ["type", "tool_use_id"]),
]})
_ANTHROPIC = {
    "model": S, "max_tokens": POSITIVE,
    "system": {"anyOf": [S, _BLOCKS]},
    # tool_use blocks only in assistant turns and tool_result blocks only in user turns (else a 400)
    "messages": arr(obj({"role": {"enum": ["user", "assistant", "system"]}, "content": {"anyOf": [S, _BLOCKS]}},
                        ["role", "content"]), minItems=1),
    "tools": arr({"anyOf": [obj({"type": {"const": "custom"}, "name": S, "description": S, "input_schema": O},
                                ["name", "input_schema"]),
                            obj({"type": S}, ["type"])]}),  # a server tool: carries no schema, passed on
    "tool_choice": {"anyOf": [obj({"type": {"enum": ["auto", "any", "none"]}}, ["type"]),
                              obj({"type": {"const": "tool"}, "name": S}, ["type", "name"])]},
    "stop_sequences": STOP,
    **SAMPLING,
}
MESSAGES = obj(_ANTHROPIC, ["model", "max_tokens", "messages"])
COUNT_TOKENS = obj(_ANTHROPIC, ["model", "messages"])
