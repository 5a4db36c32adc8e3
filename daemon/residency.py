"""Which releases the weights engines keep loaded: those that serve new requests, so that memory is given back.

A weights engine loads a release when a request or a publish needs it and keeps it for the next request. Here the
daemon tells each engine which releases still serve (``Engine.retain``); one that served and serves no more (a
superseded head, an ended canary's candidate) is dropped by the engine once its last request ends, and the
embedded engine then frees the load and detaches its LoRA adapter (``daemon/engines/transformers.py``). Without
this a superseded head's adapter stayed until the engine's ``memory_budget_mb`` (some 400 SmolLM2 adapters), about
10 MB a release in the daemon's memory.

What serves:

- **each scenario's head** (every chain in the store: an engine ignores content it never loaded);
- **each running canary's two arms** (its candidate and the head it is compared with);
- **the releases requests pinned lately** (``x-reef-release-id``: a wrapper pins the release its run began with for
  the whole run, a canary's run its arm): the ``PINS`` most recently pinned per model, so that a run on a release
  superseded meanwhile keeps its load (and its prefix cache) to its end, and what pins keep stays bounded.

Heads and arms are read again on every ``release``, ``canary.start`` and ``canary.end`` event (a publish, rollback
or promote here, a head moved by another process or followed from a chain remote, a canary begun or ended). The
serve path says what each request is served by before the request reaches the engine (``serves``): a pin, or the
head it found, which replaces the scenario's head at once (another process's publish is seen by the next request,
seconds before its event).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.canary import Canaries
    from daemon.chains import Chains
    from daemon.engines import Engine
    from daemon.events import EventBus

log = logging.getLogger("reef")

PINS = 4  # releases pinned lately that each model's engine keeps (a SmolLM2 adapter: about 10 MB)
KINDS = frozenset({"release", "canary.start", "canary.end"})  # events after which heads and arms are read again


class Residency:
    """The releases that serve new requests, told to each engine (``Engine.retain``) whenever they change."""

    def __init__(self, chains: Chains, canaries: Canaries, events: EventBus,
                 engines: Callable[[], Mapping[str, Engine]]) -> None:
        self.chains = chains
        self.canaries = canaries
        self.events = events
        self._engines = engines
        self.heads: dict[str, str] = {}  # scenario -> its head's content id
        self.arms: frozenset[str] = frozenset()  # content ids of the running canaries' arms, as last read
        self.pins: dict[str, OrderedDict[str, None]] = {}  # model -> content ids pinned lately, the newest last
        # scenario -> content ids served unpinned since the heads and arms were last read (a new head, a canary's
        # arm): kept beside the heads until the next read, which says what still serves
        self.served: dict[str, set[str]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="reef-residency")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def keep(self, model: str) -> frozenset[str]:
        """What ``model``'s engine keeps: the heads, the canary arms and the model's pins."""
        served = frozenset(c for contents in self.served.values() for c in contents)
        return frozenset(self.heads.values()) | self.arms | served | self.pins.get(model, {}).keys()

    def tell(self, model: str) -> None:
        """Tell ``model``'s engine (if it is loaded) what it keeps."""
        engine = self._engines().get(model)
        if engine is not None:
            engine.retain(self.keep(model))

    def serves(self, scenario: str, model: str, content_id: str, *, pinned: bool) -> None:
        """A request of ``scenario`` on ``model`` is served by the release with ``content_id``: one it ``pinned``,
        or else the head or a canary's arm. One the last read did not name is kept beside the heads until the heads
        and arms are read again (after the event that made it serve), never in place of the head: a canary's
        first request can come before its start is read, and taking its candidate for the head then dropped the
        head, which serves the other arm."""
        if pinned:
            self.pin(model, content_id)
        elif self.heads.get(scenario) != content_id and content_id not in self.arms:
            contents = self.served.setdefault(scenario, set())
            if content_id not in contents:
                contents.add(content_id)
                self.tell(model)

    def pin(self, model: str, content_id: str) -> None:
        """A request pinned the release with ``content_id`` on ``model``: kept among the ``PINS`` newest pins."""
        pins = self.pins.setdefault(model, OrderedDict())
        new = content_id not in pins
        pins[content_id] = None
        pins.move_to_end(content_id)
        if new:
            while len(pins) > PINS:
                pins.popitem(last=False)
            self.tell(model)

    async def refresh(self) -> None:
        """Read the heads and the canary arms again and tell every engine."""
        async def content(release_id: str | None) -> str | None:
            if release_id is None:
                return None
            with contextlib.suppress(Exception):  # a release that cannot be read serves nothing here
                return (await self.chains.release(release_id)).content_id
            return None

        read = {scenario: set(contents) for scenario, contents in self.served.items()}  # what this read covers
        heads = {name: await content(rid) for name, rid in (await asyncio.to_thread(self.chains.heads)).items()}
        arms = {await content(row[k]) for row in list(self.canaries.active.values()) for k in ("release_id", "base_id")}
        self.heads = {name: cid for name, cid in heads.items() if cid is not None}
        self.arms = frozenset(cid for cid in arms if cid is not None)
        for scenario, contents in read.items():  # one served while reading stays until the next read
            self.served[scenario] -= contents
        for model in list(self._engines()):
            self.tell(model)

    async def _watch(self) -> None:
        queue = self.events.subscribe(internal=True)
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # a torn read while another process writes: the next event reads again
                log.debug("reading the releases that serve", exc_info=True)
            while True:
                event = await queue.get()
                if event is None:  # dropped for falling behind: what it missed is read again now
                    queue = self.events.subscribe(internal=True)
                    break
                if event["kind"] in KINDS:
                    while not queue.empty():  # a burst of events: one read for all of them
                        if queue.get_nowait() is None:
                            queue = self.events.subscribe(internal=True)
                    break
