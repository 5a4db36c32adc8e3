"""Engines: what generates tokens. ``build_engine`` makes the engine a model entry names, through the registry
(``daemon/engines/registry.py``: which engines there are, whether each serves weights, whether it is a server),
importing its module lazily so that torch and transformers load only in a daemon that serves a local model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from daemon.engines.base import Engine, EngineInfo
from daemon.engines.registry import EngineKind, engine_kind, engine_names, register
from daemon.errors import BadRequest

if TYPE_CHECKING:
    from daemon.engines.entry import ModelEntry

__all__ = ["Engine", "EngineInfo", "EngineKind", "build_engine", "engine_kind", "engine_names", "register"]


def build_engine(entry: ModelEntry, secrets: Mapping[str, str] | None = None, metrics: Any = None) -> Engine:
    """The engine of a model entry; ``metrics`` (the daemon's ``Metrics``) lets remote engines report on their
    upstream."""
    try:
        kind = engine_kind(entry.engine)
    except BadRequest as e:
        raise BadRequest(f"model {entry.name!r}: {e.message}") from None
    return kind.build(entry, secrets or {}, metrics)
