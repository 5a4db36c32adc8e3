"""What each engine is told to keep (``daemon/residency.py``): the heads, the canaries' arms, recent pins, and a
release served before the read that names it. Unit tests on stand-ins for the chains and the engine (the live
daemon's: tests/test_lora_releases.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from daemon.events import EventBus
from daemon.residency import Residency


class _Chains:
    def __init__(self) -> None:
        self.head = "r-head"

    def heads(self) -> dict[str, str]:
        return {"s": self.head}

    async def release(self, release_id: str) -> Any:
        return SimpleNamespace(content_id="c-" + release_id[2:])


class _Engine:
    def __init__(self) -> None:
        self.told: list[frozenset[str]] = []

    def retain(self, keep: frozenset[str]) -> None:
        self.told.append(keep)


def test_a_canarys_first_answer_before_its_start_is_read_never_drops_the_head() -> None:
    """A canary's first request can come before the residency has read its start: its candidate is kept beside the
    head, never in the head's place (the head serves the other arm; dropped, it was loaded again: a failed live test
    at load). The next read says what serves and forgets what it covered; one served while reading stays. Bugs
    caught: the served release taking the head's place, served releases kept forever, one served during a read
    forgotten by it."""
    async def run() -> None:
        chains, engine = _Chains(), _Engine()
        canaries = SimpleNamespace(active={})
        res = Residency(chains, canaries, EventBus(), lambda: {"m": engine})  # type: ignore[arg-type]
        await res.refresh()
        assert engine.told[-1] == {"c-head"}
        canaries.active["s"] = {"release_id": "r-cand", "base_id": "r-head"}  # started, not read yet
        res.serves("s", "m", "c-cand", pinned=False)
        assert engine.told[-1] == {"c-head", "c-cand"}
        await res.refresh()  # the read: both arms serve
        assert engine.told[-1] == {"c-head", "c-cand"} and res.served == {"s": set()}
        canaries.active.clear()  # the canary ended
        await res.refresh()
        assert engine.told[-1] == {"c-head"}
        # served while a read is under way: kept after it
        release = chains.release

        async def slow(release_id: str) -> Any:
            res.serves("s", "m", "c-new", pinned=False)
            return await release(release_id)

        chains.release = slow  # type: ignore[method-assign]
        await res.refresh()
        assert "c-new" in engine.told[-1] and "c-new" in res.keep("m")
    asyncio.run(run())
