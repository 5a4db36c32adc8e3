"""The wire formats Reef serves, each a ``WireFormat`` (``daemon/protocols/base.py``): listed here, typed, so that
mypy checks every module against the interface (a missing or misshapen member is an error on this page)."""

from __future__ import annotations

from daemon.protocols import anthropic, openai_chat, openai_responses
from daemon.protocols.base import WireFormat

OPENAI_CHAT: WireFormat = openai_chat
OPENAI_RESPONSES: WireFormat = openai_responses
ANTHROPIC: WireFormat = anthropic

FORMATS: dict[str, WireFormat] = {f.FORMAT: f for f in (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC)}


def for_path(path: str) -> WireFormat | None:
    """The format whose answers a request path gets (its errors too): ``None`` outside ``/v1``."""
    if "/v1/" not in path and not path.endswith("/v1"):
        return None
    if "/v1/messages" in path:
        return ANTHROPIC
    return OPENAI_RESPONSES if "/v1/responses" in path else OPENAI_CHAT
