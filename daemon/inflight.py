"""The exchanges a daemon is serving now, as ``GET /reef/inflight`` and ``reef status`` show them: how long each has
run, and what its engine has made of it so far (the engine's own sequence, ``Exchange.progress``)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


def in_flight(exchanges: Iterable[Any], *, run: str | None = None, scenario: str | None = None) -> list[dict[str, Any]]:
    """``exchanges`` (``served.Served``, in arrival order) of ``run`` and ``scenario`` (None: any), oldest first: how long each has run and the tokens its engine has made
    so far (``None`` where the engine does not count them: an upstream provider)."""
    now = time.perf_counter()
    out = []
    for served in exchanges:
        if (run is not None and served.run != run) or (scenario is not None and served.scenario.name != scenario):
            continue
        progress = served.exchange.progress
        out.append({
            "receipt": served.receipt, "scenario": served.scenario.name, "run": served.run,
            "model": served.engine.info.model, "stream": served.exchange.stream,
            "elapsed_s": round(now - served.started, 3),
            "prompt_tokens": len(progress.prompt) if progress is not None else None,
            "output_tokens": progress.output_tokens if progress is not None else None,
            "output_cap": served.engine.info.output_cap,
        })
    return out
