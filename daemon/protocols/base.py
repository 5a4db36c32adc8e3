"""What a wire format is: the one interface the three provider formats implement.

A wire format (``openai_chat``, ``openai_responses``, ``anthropic``) turns a provider's request body into the
neutral ``Exchange`` and engine output back into the provider's answer, whole or streamed, with the receipt in
it; it shapes errors the way that provider's clients read them; and, for an upstream engine of that format, it
goes the other way (the neutral exchange as that provider's request, its answer and stream read back).

Each format is a module whose functions and classes are its members: the module *is* the implementation (mypy
checks a module against a Protocol member by member, and ``isinstance(module, WireFormat)`` checks that every
member is there). ``daemon/protocols/formats.py`` holds the three, typed as ``WireFormat``, so a format that
lacks a member, or has one of another shape, is a type error where they are listed, not a failure on some
request.

The serve path (``daemon/serving.py``) uses ``parse_request`` (in ``daemon/app.py``: parsing is the route's),
``render_response``, ``StreamRenderer``, ``relay_finish``, ``FORMAT`` and ``ID_PREFIX``; the HTTP layer
``error_body`` and ``PATH``; export and the upstream engine ``parse_response``, ``render_request`` and
``StreamParser``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from daemon.errors import ReefError
from daemon.exchange import Completion, EngineEvent, Exchange, Receipt


class StreamRenderer(Protocol):
    """Engine events -> the format's SSE frames, for one streamed answer (each method: the frames to send)."""

    def start(self) -> list[bytes]:
        """The frames that open the stream (before the first engine event)."""
        ...

    def event(self, ev: EngineEvent) -> list[bytes]:
        """The frames of one engine event (a delta, a tool call's start)."""
        ...

    def finish(self, c: Completion, receipt: Receipt | None) -> list[bytes]:
        """The frames that end the stream, the receipt in the final event."""
        ...

    def error(self, err: ReefError) -> list[bytes]:
        """The frames that end a stream that failed after it started."""
        ...


class StreamParser(Protocol):
    """An upstream's SSE stream of the format -> engine events, then the assembled completion."""

    def feed(self, event: str | None, data: str) -> list[EngineEvent]:
        ...

    @property
    def done(self) -> bool:
        """Whether the stream's own end has been read (a stream cut before it is incomplete)."""
        ...

    def finish(self) -> Completion:
        ...


@runtime_checkable
class WireFormat(Protocol):
    """One provider format, both ways. Implemented by the modules ``daemon.protocols.openai_chat``,
    ``openai_responses`` and ``anthropic``."""

    @property
    def FORMAT(self) -> str:
        """The format's name, as ``Exchange.format`` and records carry it (``openai-chat``...)."""
        ...

    @property
    def PATH(self) -> str:
        """The route the format is served on, under ``/v1`` (``/v1/chat/completions``...)."""
        ...

    @property
    def ID_PREFIX(self) -> str:
        """How the format's answer ids begin (``chatcmpl-``, ``resp_``, ``msg_``)."""
        ...

    # --- serving: the client's request in, the answer out ------------------------------------------------------

    def parse_request(self, body: object) -> Exchange:
        """A request body (decoded JSON) as an ``Exchange``; ``BadRequest`` naming the exact param otherwise."""
        ...

    def render_response(self, ex: Exchange, c: Completion, *, response_id: str, created: int,
                        receipt: Receipt | None) -> dict[str, Any]:
        """The whole (non-streamed) answer body, the receipt in it."""
        ...

    def StreamRenderer(self, ex: Exchange, *, response_id: str, created: int) -> StreamRenderer:
        """A renderer for one streamed answer (the module's class)."""
        ...

    def relay_finish(self, final: tuple[str | None, str], receipt: Receipt | None) -> list[bytes]:
        """The end of a relayed stream (an upstream of this same format): its held-back final event, the receipt
        added."""
        ...

    def error_body(self, err: ReefError) -> dict[str, Any]:
        """An error in the shape the format's clients read."""
        ...

    # --- an upstream of this format: the neutral exchange out, the provider's answer back ------------------------

    def render_request(self, ex: Exchange, *, model: str, stream: bool) -> dict[str, Any]:
        """``ex`` (of any format) as this format's request body; ``Unsupported`` when it cannot say the same."""
        ...

    def parse_response(self, body: Any) -> Completion:
        """A whole answer body of this format read back into a ``Completion``."""
        ...

    def StreamParser(self) -> StreamParser:
        """A parser for one upstream stream of this format (the module's class)."""
        ...
