"""A learner's spend as the learning loop keeps it (``daemon/learning.py``; the account itself: ``daemon/spend.py``):
the scenario's spend read from its chain, the cap's message, the ``capped`` state with its event and the timer that
looks for a batch again when the UTC day ends, and ``GET /reef/status``'s ``spend``."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from daemon.chains import Chains
from daemon.errors import ReefError
from daemon.events import EventBus
from daemon.gating.outcome import StepOutcome
from daemon.records import RecordStore
from daemon.spend import DAY_S, Spend, day_start, read
from recipes import load_recipe
from recipes.base import Recipe

# a scenario's learning state (``daemon/learning.ScenarioLearning``: its ``name``, ``recipe``, ``settings``, ``state``,
# ``spend``, ``spend_gen`` and ``capped_wake`` are read and set here); typed loosely: learning.py imports this module
ScenarioLearning = Any


class Learner(Protocol):
    """What this module reads of the learning loop (``daemon/learning.Learner``)."""

    chains: Chains
    events: EventBus
    store: RecordStore

    def notify(self, name: str) -> None: ...

    async def _get(self, name: str) -> Any: ...

    def make_recipe(self, recipe: str, settings: dict[str, Any] | None = None) -> Recipe: ...


async def spend(learner: Learner, st: ScenarioLearning) -> Spend:
    """The scenario's spend, as its chain says: read again after each step that spent trainer time and whenever
    the head moved (a promote, a rollback: the released rewards changed). The chain is the one account, so a
    status read racing a step can neither miss the step nor count it twice."""
    head = await learner.chains.head_id(st.name)
    kept: Spend | None = st.spend
    if kept is not None and kept.head == head:
        return kept
    gen = st.spend_gen
    fresh = read(await learner.chains.history(st.name), await learner.chains.pending(st.name),
                 await learner.chains.rejections(st.name), head)
    if gen == st.spend_gen:  # no step wrote anything down meanwhile
        st.spend = fresh
    return fresh


def cap_message(st: ScenarioLearning, spent: Spend) -> str:
    assert st.recipe is not None
    cap = float(getattr(st.recipe.settings, "max_trainer_hours", 0) or 0)
    return (f"cap reached: the scenario's trainer time reached max_trainer_hours {cap:g} "
            f"({cap * 3600:g} s) today; no step until the next UTC day or a higher cap")


async def tokens_left(learner: Learner, st: ScenarioLearning) -> tuple[float, str] | None:
    """A harness step's proposer tokens left today and the message a call past them fails with (None: no cap)."""
    assert st.recipe is not None
    left = (await spend(learner, st)).tokens_left(st.recipe.settings, time.time())
    cap = getattr(st.recipe.settings, "max_proposer_tokens", None)
    # less what this step spent already (an edit redone on a head that moved: not on the chain yet)
    return None if left is None else (max(left - st.proposer_tokens, 0.0), f"cap reached: the scenario's proposer calls reached "
                                      f"max_proposer_tokens {cap} today; no step until the next UTC day or a higher cap")


async def capped(learner: Learner, st: ScenarioLearning) -> StepOutcome | None:
    """When the scenario's cap is reached for today: its state ``capped``, a ``train.capped`` event, a timer
    that looks for a batch again when the UTC day ends, and the outcome saying so (no step starts)."""
    assert st.recipe is not None
    spent = await spend(learner, st)
    now = time.time()
    if not spent.reached(st.recipe.settings, now):
        return None
    st.state = "capped"
    view = spent.view(st.recipe.settings, now)
    left = spent.remaining(st.recipe.settings, now)
    summary = (f"trainer time cap reached: {view['trainer_seconds_today']:g} s today under max_trainer_hours "
               f"{view['max_trainer_hours']:g}" if left is not None and left <= 0 else
               f"proposer token cap reached: {view['proposer_tokens_today']} tokens today under max_proposer_tokens "
               f"{view['max_proposer_tokens']}") + f"; no step until {view['resumes_at']} or a higher cap"
    if st.capped_wake is not None:
        st.capped_wake.cancel()
    st.capped_wake = asyncio.get_running_loop().call_later(day_start(now) + DAY_S - now + 1,
                                                           learner.notify, st.name)
    learner.events.publish("train.capped", scenario=st.name, summary=summary, **view)
    return StepOutcome("paused", scenario=st.name, summary=summary)


async def status(learner: Learner, only: str | None = None) -> dict[str, dict[str, Any]]:
    """Each learning scenario's spend view (``GET /reef/status``'s ``spend``); ``only``: that scenario's alone (the
    release page's)."""
    out: dict[str, dict[str, Any]] = {}
    now = time.time()
    for s in await learner.store.scenarios.all():
        if only is not None and s.name != only:
            continue
        try:
            kind = load_recipe(s.recipe).kind
            if kind == "none":
                continue
            st = await learner._get(s.name)
            assert st.recipe is not None
            settings = (st.recipe.settings if s.settings == st.settings
                        else learner.make_recipe(s.recipe, s.settings).settings)
            out[s.name] = {"kind": kind, **(await spend(learner, st)).view(settings, now)}
        except ReefError:  # a recipe that no longer loads: the scenario's view says why
            continue
    return out
