"""Per-agent adapters: install a coding agent, isolate its config, point it at Reef, render a harness."""

from __future__ import annotations

from adapters.base import Adapter, Target
from adapters.claude import Claude
from adapters.codex import Codex
from adapters.opencode import Opencode
from adapters.pi import Pi

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (Pi(), Claude(), Opencode(), Codex())}


def get_adapter(name: str) -> Adapter:
    from daemon.errors import BadRequest

    try:
        return ADAPTERS[name]
    except KeyError:
        raise BadRequest(f"unknown adapter {name!r}; adapters: {', '.join(ADAPTERS)}", param="adapter") from None


__all__ = ["ADAPTERS", "Adapter", "Target", "get_adapter"]
