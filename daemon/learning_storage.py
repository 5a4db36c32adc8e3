"""A weights step that waits while the disk is short (the learning loop's, ``daemon/learning.py``; the weights kept
and pruned: ``daemon/retention.py``).

Before a weights step trains, the free space under the Reef home (``shutil.disk_usage``) must cover the step's need:
twice the whole model's size (the candidate the trainer writes, then its copy into the store: an adapter step writes
far less, so this errs on the safe side) plus ``storage_reserve_mb`` (100 MB by default) for records and logs.
Short, the step waits: nothing is trained, failed or consumed; the scenario's state says ``storage``, ``reef status``
says why, a ``train.deferred`` event and a log line are written once per wait, and a timer looks again every
``storage_check_s`` (30 s), so the step runs once space returns (a new report looks at once too). The reading is
``StorageGuard.free``, which tests replace.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from daemon.gating.outcome import StepOutcome

if TYPE_CHECKING:
    from daemon.records import Scenario

log = logging.getLogger("reef.learning")


class _Learner(Protocol):
    """What ``StorageGuard.short`` reads of the learning loop (``daemon/learning.Learner``)."""

    chains: Any
    events: Any


class StorageGuard:
    """Whether a weights step may start, by the free space under the Reef home; the scenarios waiting for space."""

    def __init__(self, home: Path, reserve_mb: float, check_s: float, notify: Callable[[str], None],
                 free: Callable[[Path], int] | None = None) -> None:
        self.home, self.reserve, self.check_s, self.notify = home, int(reserve_mb * 1e6), check_s, notify
        # the free bytes under a path: shutil.disk_usage by default; a test gives its own reading
        self.free: Callable[[Path], int] = free or (lambda path: shutil.disk_usage(path).free)
        self.waiting: dict[str, dict[str, Any]] = {}  # scenario -> why it waits (``GET /reef/status``'s storage)
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def need(self, chains: Any, scenario: Scenario) -> tuple[int, int]:
        """``(need, model bytes)``: twice the whole model's size (the head's weights, or the base its adapter is on)
        plus the reserve."""
        head = await chains.head(scenario)
        adapter = await chains.adapter(head.release_id)
        model = await chains.release(adapter.base_release_id) if adapter is not None else head
        size = sum(int(e["size"]) for e in model.lfs.values())
        return 2 * size + self.reserve, size

    async def short(self, learner: _Learner, st: Any, scenario: Scenario) -> StepOutcome | None:
        """None when the step may start; else the scenario waits (state ``storage``) and the outcome says why."""
        need, model = await self.need(learner.chains, scenario)
        free = int(await asyncio.to_thread(self.free, self.home))
        if free >= need:
            if self.waiting.pop(st.name, None) is not None:
                log.info("learning on %s: %.0f MB free under %s again; the step runs", st.name, free / 1e6, self.home)
            return None
        st.state = "storage"
        summary = (f"storage short: {free / 1e6:.0f} MB free under {self.home}, the step needs {need / 1e6:.0f} MB "
                   f"(twice the model's {model / 1e6:.0f} MB and storage_reserve_mb {self.reserve / 1e6:g}); it "
                   f"waits, looking again every {self.check_s:g} s (lower keep_releases to prune more weights)")
        if st.name not in self.waiting:
            log.warning("learning on %s: %s", st.name, summary)
            learner.events.publish("train.deferred", scenario=st.name, summary=summary, free_bytes=free,
                                   need_bytes=need)
        self.waiting[st.name] = {"summary": summary, "free_bytes": free, "need_bytes": need,
                                 "since": self.waiting.get(st.name, {}).get("since", time.time())}
        old = self._timers.pop(st.name, None)
        if old is not None:
            old.cancel()
        self._timers[st.name] = asyncio.get_running_loop().call_later(self.check_s, self.notify, st.name)
        return StepOutcome("paused", scenario=st.name, summary=summary)
