"""Engines: what generates tokens. ``build_engine`` picks the class for a model entry, importing it lazily
so that torch and transformers load only in a daemon that serves a local model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from daemon.config import ModelEntry
from daemon.engines.base import Engine, EngineInfo
from daemon.errors import BadRequest

__all__ = ["Engine", "EngineInfo", "build_engine"]


def build_engine(entry: ModelEntry, secrets: Mapping[str, str] | None = None, metrics: Any = None) -> Engine:
    """The engine of a model entry; ``metrics`` (the daemon's ``Metrics``) lets remote engines report on their
    upstream."""
    if entry.engine == "transformers":
        from daemon.engines.transformers import TransformersEngine

        return TransformersEngine(entry)
    if entry.engine == "upstream":
        from daemon.engines.upstream import UpstreamEngine

        return UpstreamEngine(entry, secrets or {}, metrics)
    if entry.engine in ("vllm", "sglang"):
        from daemon.engines.server import ServerEngine

        if entry.engine == "vllm":
            from daemon.engines.vllm import VLLM as Dialect
        else:
            from daemon.engines.sglang import SGLang as Dialect  # type: ignore[assignment]
        return ServerEngine(entry, Dialect(), metrics)
    raise BadRequest(f"model {entry.name!r}: unknown engine {entry.engine!r} (transformers, upstream, vllm, sglang)")
