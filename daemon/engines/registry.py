"""Which engines there are and what each one serves: the one place that says so.

Every engine is registered here once, with what the rest of Reef must know about it without importing it
(``torch`` and ``transformers`` load only in a daemon that serves a local model):

- ``weights``: it serves a release's weights, so a scenario on it gets a chain of weights releases (the
  checkout is loaded into the engine); otherwise its scenarios' chains hold a harness (an upstream provider
  serves its own weights).
- ``server``: it runs a separate inference server process (vLLM, SGLang) that ``reef doctor`` checks; otherwise it
  is embedded in the daemon or is a provider elsewhere.
- ``build``: makes the engine for a model entry, called as ``build(entry, secrets, metrics)``; the built-ins
  import their module inside it.

``register`` adds one, as a call or as a decorator on an ``Engine`` class whose constructor takes those three;
``engine_kind`` looks one up by name, and an unknown name is a ``BadRequest`` listing the known ones. The config
accepts exactly the registered names (``daemon/config.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest

if TYPE_CHECKING:
    from daemon.engines.base import Engine
    from daemon.engines.entry import ModelEntry

Build = Callable[["ModelEntry", Mapping[str, str], Any], "Engine"]


@dataclass(frozen=True)
class EngineKind:
    name: str  # the value of ``engine`` in a model entry
    weights: bool  # serves a release's weights: its scenarios' chains hold weights (else a harness)
    server: bool  # a separate inference server process (else embedded, or a provider elsewhere)
    build: Build


_KINDS: dict[str, EngineKind] = {}


def register(name: str, *, weights: bool, server: bool = False) -> Callable[[Build], Build]:
    """Register the engine ``name``; decorates its builder (a function, or an ``Engine`` class whose constructor
    takes ``(entry, secrets, metrics)``). Registering a name twice is an error: one name, one engine."""

    def add(build: Build) -> Build:
        if name in _KINDS:
            raise ValueError(f"engine {name!r} is registered already")
        _KINDS[name] = EngineKind(name, weights=weights, server=server, build=build)
        return build

    return add


def unregister(name: str) -> None:
    """Remove a registered engine (tests that register one of their own)."""
    _KINDS.pop(name, None)


def engine_kind(name: str) -> EngineKind:
    """The registered engine ``name``; ``BadRequest`` naming the known ones when there is none."""
    kind = _KINDS.get(name)
    if kind is None:
        raise BadRequest(f"unknown engine {name!r}: one of {', '.join(engine_names())}")
    return kind


def engine_names() -> tuple[str, ...]:
    return tuple(_KINDS)


# --- the built-in engines -----------------------------------------------------------------------------------


@register("transformers", weights=True)
def _transformers(entry: ModelEntry, secrets: Mapping[str, str], metrics: Any) -> Engine:
    from daemon.engines.transformers import TransformersEngine

    return TransformersEngine(entry)


@register("upstream", weights=False)
def _upstream(entry: ModelEntry, secrets: Mapping[str, str], metrics: Any) -> Engine:
    from daemon.engines.upstream import UpstreamEngine

    return UpstreamEngine(entry, secrets, metrics)


@register("vllm", weights=True, server=True)
def _vllm(entry: ModelEntry, secrets: Mapping[str, str], metrics: Any) -> Engine:
    from daemon.engines.server import ServerEngine
    from daemon.engines.vllm import VLLM

    return ServerEngine(entry, VLLM(), metrics)


@register("sglang", weights=True, server=True)
def _sglang(entry: ModelEntry, secrets: Mapping[str, str], metrics: Any) -> Engine:
    from daemon.engines.server import ServerEngine
    from daemon.engines.sglang import SGLang

    return ServerEngine(entry, SGLang(), metrics)
