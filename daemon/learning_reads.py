"""What a learning step reads (``daemon/learning.py``): the consumed set and the recipe's eligible records.

- Consumption is written down where the outcome is (a release's manifest, a rejection record), so the consumed set
  is read from git once per scenario, and on a shared store what any daemon consumed or claimed is added.
- Reads are incremental: each round reads only the records that came since the last one (a cursor per scenario)
  into a pool of unconsumed ones (a receipt scored again moves to the back with its new score; an explicit report
  takes precedence over an automatic one; a consumed or no longer eligible one leaves the pool).
- The held-out check's reserved prompts (``daemon/gating/heldout.py``) are taken out of the pool as they come.
"""

from __future__ import annotations

from typing import Any

from daemon import lineage
from daemon.gating.heldout import RECORDED, reserved
from daemon.records import FeedbackReport, Scenario, ScoredExchange
from recipes.base import Head, off_policy_sampling

Learner = Any  # daemon.learning.Learner (its chains and record store), named loosely: it imports this module


async def consumed(learner: Learner, st: Any) -> set[str]:
    """Receipts listed in a release or a rejection of the scenario's chain (read from git once), and on a shared
    store what any daemon consumed or claimed."""
    if st.consumed is None:
        found = await learner.chains.consumed(st.name)
        if learner.store.shared:  # and what any daemon sharing the store consumed or claimed
            found.update(await learner.store.training.consumed(st.name))
        st.consumed = found
    out: set[str] = st.consumed
    return out


async def eligible(learner: Learner, st: Any, scenario: Scenario, head: Any) -> list[ScoredExchange | FeedbackReport]:
    """The recipe's unconsumed, eligible records, oldest first; reads only what came since the last round. A
    candidate waiting for a canary's verdict (``daemon/lineage.py``) keeps its receipts out of them."""
    used = await consumed(learner, st)
    assert st.recipe is not None
    rows: list[ScoredExchange] | list[FeedbackReport]
    if st.recipe.source == "scores":
        rows, st.cursor = await learner.store.reports.scored_exchanges(scenario.name, after=st.cursor)
    else:
        rows, st.cursor = await learner.store.reports.feedback(scenario.name, after=st.cursor)
    automatic = ("judge", "outcome")  # a judge's verdict, a wrapped run's outcome (reef_cli/outcomes.py)
    for rec in rows:
        old = st.pool.get(rec.id)
        if _source(rec) in automatic and old is not None and _source(old) not in automatic:
            continue  # an explicit report takes precedence over an automatic one
        st.pool.pop(rec.id, None)  # scored again: its latest score, in the order of that report
        if rec.id not in used:
            st.pool[rec.id] = rec
    view = Head(head.release_id, head.content_id, head.step)
    settings = st.recipe.settings
    share = (float(getattr(settings, "heldout_share", 0) or 0)
             if st.recipe.kind == "weights" and getattr(settings, "heldout_check", False) else 0.0)
    out: list[ScoredExchange | FeedbackReport] = []
    waiting = lineage.waiting_receipts(st)
    for rid, rec in list(st.pool.items()):
        if rid in waiting:  # trained on by the candidate that waits for a canary's verdict: not again
            continue
        if share and isinstance(rec, ScoredExchange) and reserved(rec.prompt_token_ids, share):
            # the held-out check's: never trained on (daemon/gating/heldout.py)
            del st.pool[rid]
            key = ",".join(map(str, rec.prompt_token_ids))
            st.reserved.pop(key, None)
            st.reserved[key] = (rid, None)
            while len(st.reserved) > 4 * RECORDED:
                st.reserved.popitem(last=False)
            continue
        served_step = None
        if isinstance(rec, ScoredExchange) and rec.release_id:
            served_step = (await learner.chains.release(rec.release_id)).step
        if (rid in used or (st.recipe.behaviour_logprobs and isinstance(rec, ScoredExchange)
                                and off_policy_sampling(rec))
                or not st.recipe.eligible(rec, head=view, served_step=served_step)):
            del st.pool[rid]  # consumed, or no longer eligible for good: the head's step only grows
            continue
        out.append(rec)
    return out


def _source(record: ScoredExchange | FeedbackReport) -> str | None:
    """Where a pool record's report came from (``FeedbackReport.source``): None for an explicit report."""
    return record.report.source if isinstance(record, ScoredExchange) else record.source
