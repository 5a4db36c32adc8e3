"""The internal, provider-neutral form of one exchange.

``daemon/protocols/*`` turn provider request bodies into an ``Exchange`` and engine output back into provider
responses and SSE streams; engines only ever see an ``Exchange`` and emit ``EngineEvent``s. Keeping one neutral
form means every client format works against every engine (and, for the upstream engine, every wire format).

Design choices:
- System prompts are ordinary ``Message(role="system")`` entries, wherever they occur (Anthropic's top-level
  ``system``, OpenAI's system/developer messages, Claude Code's mid-conversation system message).
- Content is a list of typed ``Part``s; a tool result is a part of a ``role="tool"`` message carrying the id of
  the call it answers, so ids stay consistent across formats.
- ``Completion`` is what a finished generation is: text, tool calls, stop reason, usage, and for local engines
  the sampled token ids and their log-probs (learning needs the exact tokens, never re-tokenised text).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
StopReason = Literal["stop", "length", "tool_calls", "stop_sequence", "error"]


@dataclass
class Part:
    """One piece of message content."""

    type: Literal["text", "image", "tool_call", "tool_result", "thinking"]
    text: str = ""
    # tool_call: id, name, arguments (a JSON string, as OpenAI sends it)
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # tool_result: the call it answers; its content is ``text`` (parts flattened), ``is_error`` as sent
    tool_call_id: str | None = None
    is_error: bool = False
    # image: media type and source (data URL or URL); kept so an engine can refuse it by name
    media_type: str | None = None
    source: str | None = None


@dataclass
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if p.type == "text")


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sampling:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Exchange:
    """One request, in neutral form. ``body`` keeps the provider body as received (for the record)."""

    format: Literal["openai-chat", "openai-responses", "anthropic"]
    model: str
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: Any = None
    sampling: Sampling = field(default_factory=Sampling)
    stream: bool = False
    body: dict[str, Any] = field(default_factory=dict)
    # OpenAI chat: include usage in the stream (stream_options.include_usage)
    stream_usage: bool = False
    # the client's HTTP headers and query string, as received (an upstream engine forwards a chosen few)
    headers: Mapping[str, str] = field(default_factory=dict)
    query: str = ""
    # what a local engine has made of it so far (its sequence: ``output_tokens``, ``prompt``), read by
    # ``GET /reef/inflight``; None until the engine takes it, and for engines that do not count tokens
    progress: Any = None

    def has_images(self) -> bool:
        return any(p.type == "image" for m in self.messages for p in m.parts)


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Completion:
    """A finished generation."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    stop_sequence: str | None = None
    usage: Usage = field(default_factory=Usage)
    model: str = ""
    # local engines: the exact sampled tokens and their log-probs under the serving weights
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    runtime_load_id: str | None = None
    thinking: str = ""
    # upstream usage as reported by the provider, verbatim
    upstream: dict[str, Any] | None = None


# --- engine events: what an engine yields while generating ------------------------------------------------


@dataclass
class TextDelta:
    text: str


@dataclass
class ThinkingDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallDelta:
    index: int
    arguments: str


@dataclass
class Relay:
    """Bytes already in the client's format (an upstream of the same format): sent to the client as they are.

    An engine that relays yields only ``Relay`` events and its ``Finish``; the stream's final event is held back
    in ``Finish.final`` so that the receipt can be added to it once the record is durable."""

    data: bytes


@dataclass
class Finish:
    """Always the last event of a successful generation; carries the assembled completion."""

    completion: Completion
    # relayed answers (same format in and out): the upstream's own body (not streaming), or the stream's final
    # SSE event as (event name, data), to which the receipt is added
    body: dict[str, Any] | None = None
    final: tuple[str | None, str] | None = None


EngineEvent = TextDelta | ThinkingDelta | ToolCallStart | ToolCallDelta | Relay | Finish


@dataclass
class Receipt:
    """What the client gets back to report on: the record id and the release that served it."""

    record_id: str
    release_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``reef`` object of an answer: the receipt under both of its names (``agent_record_id``, as in the
        ``x-reef-agent-record-id`` header and Reef's own clients; ``record_id``, as in the record store), and the
        release."""
        return {"agent_record_id": self.record_id, "record_id": self.record_id, "release_id": self.release_id}
