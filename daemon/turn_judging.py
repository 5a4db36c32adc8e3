"""Judging turns by what came next, for recipes that judge (``Recipe.judges``): a served exchange that continues an
earlier turn of its session has that turn judged in the background, never on the serve path, and the verdict
stored as a report (``source`` ``judge``) like any other, which wakes the learning loop (``daemon/learning.py``).

Design choices:
- The serve path pays one dict look-up for a scenario whose recipe does not judge (``observe``).
- Which turn a request continues is the scenario's ``SessionIndex`` (``daemon/sessions.py``); a turn is judged
  once (the judged ones are remembered, bounded).
- A judge that fails or runs past its recipe's ``judge_timeout_s`` (plus ``JUDGE_GRACE_S``, the backstop for a
  recipe that does not bound its own calls) is a neutral verdict, never a reward.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol

from daemon.engines.base import Engine
from daemon.errors import ReefError
from daemon.events import EventBus
from daemon.metrics import Metrics
from daemon.recipe_context import RecipeContext
from daemon.records import RecordStore
from daemon.reports import SHOWN_FEEDBACK_CHARS, accept_report
from daemon.sessions import SessionIndex, Turn, session_key
from recipes.base import Recipe, TurnVerdict

log = logging.getLogger("reef.learning")

JUDGE_GRACE_S = 2.0  # past a judging recipe's judge_timeout_s, the loop gives up on its verdict (neutral)


class Judged(Protocol):
    """What judging keeps of a scenario (``daemon.learning.ScenarioLearning`` is one)."""

    recipe: Recipe | None
    sessions: SessionIndex
    judged: OrderedDict[str, None]
    verdicts: Counter[str]


class Host(Protocol):
    """What judging uses of the learning loop (``daemon.learning.Learner`` is one)."""

    store: RecordStore
    events: EventBus
    metrics: Metrics
    engine: Callable[[str], Awaitable[Engine]]

    def known(self, name: str) -> Judged | None:
        """The scenario's learning state, if it has one yet (never loads it)."""
        ...

    async def learning(self, name: str) -> Judged:
        """The scenario's learning state, its recipe loaded (``ReefError`` when it cannot be)."""
        ...

    def notify(self, name: str) -> None: ...

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task the loop cancels when it closes."""
        ...


def observe(host: Host, scenario: str, receipt: str, run: str | None, headers: Mapping[str, str], messages: Any,
            completion: Any) -> None:
    """A served exchange was recorded: for a judging recipe, judge the turn it continues (in the background)."""
    st = host.known(scenario)
    if st is not None and st.recipe is not None and not st.recipe.judges:
        return
    turn = Turn(receipt, session_key(headers, run), tuple(messages), completion.text or "",
                tuple(completion.tool_calls))
    host.background(_judge(host, scenario, turn))


async def _judge(host: Host, name: str, turn: Turn) -> None:
    try:
        st = await host.learning(name)
    except ReefError:
        return
    recipe = st.recipe
    if recipe is None or not recipe.judges:
        return
    found = st.sessions.follow(name, turn)
    if found is None or found[0].receipt in st.judged:
        return
    prev, nxt = found
    st.judged[prev.receipt] = None
    while len(st.judged) > 4 * st.sessions.capacity:
        st.judged.popitem(last=False)
    scenario = await host.store.scenarios.get(name)
    timeout = float(getattr(recipe.settings, "judge_timeout_s", 30.0))
    verdict: TurnVerdict | None
    try:  # a recipe may bound each of its judge's calls by the timeout itself: this is the backstop
        verdict = await asyncio.wait_for(recipe.judge_turn(prev, nxt, RecipeContext(host.engine, scenario.model)),
                                         timeout + JUDGE_GRACE_S)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a judge that fails or times out is a neutral verdict, never a reward
        reason = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        verdict = TurnVerdict("neutral", f"the judge failed: {reason}", judge="error", unparseable=True)
    if verdict is None:
        return
    st.verdicts[verdict.verdict] += 1
    if verdict.unparseable:
        st.verdicts["unparseable"] += 1
    score = {"good": 1.0, "bad": 0.0}.get(verdict.verdict)
    metadata = {"source": "judge", "judge": verdict.judge, "verdict": verdict.verdict,
                **({"hint": verdict.hint} if verdict.hint else {}),
                **({"unparseable": True} if verdict.unparseable else {}),
                **({"votes": list(verdict.votes)} if verdict.votes else {})}
    try:
        await accept_report(host.store, host.metrics, host.events, scenario=name, score=score,
                            feedback=verdict.reason or verdict.verdict, references=[prev.receipt],
                            metadata=metadata, shown=verdict.reason[:SHOWN_FEEDBACK_CHARS], source="judge",
                            verdict=verdict.verdict)
    except ReefError as e:
        log.warning("could not store the judge's verdict on %s: %s", prev.receipt, e.message)
        return
    if score is not None:
        host.notify(name)
