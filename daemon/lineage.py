"""Where a weights step starts: the lineage, and training ahead of a canary.

Training follows a lineage: each batch continues from the previous candidate (its weights, and the optimizer the
trainer worker keeps with them) while the head is still the release that lineage follows. It follows:
- a published candidate: the new head;
- a canary's candidate once the canary is promoted: the promoted head (its content is the candidate's), so the
  optimizer goes on (before, every step after a promotion started from the head with a fresh optimizer, at a
  quarter of its rate under ``warmup_steps`` 4);
- a rejected candidate, or one held for review or as a canary: the head it was made against (it goes on from the
  candidate, until the recipe's ``restart_after`` rejections in a row);
- nothing, once a candidate is held for harm (the drift bound, the held-out check, the early warning: it drifted,
  forgot or stopped answering) or a canary is ended: the next step starts again from the head with a fresh
  optimizer, since going on from harmful weights makes the next candidate inherit the harm;
- nothing when the head moves for another reason (a rollback, another publisher).

Training ahead of a canary: while a canary serves its candidate, learning need not idle. When the lineage's last
candidate is the canary's (``canary_of``) or one trained ahead of it, the next step trains on top of it
(``ahead_of``); its candidate then waits for the canary's verdict (``park``: kept in memory as ``waiting``, its
receipts out of the next batches, nothing written down, no lock held), and the next batch trains on top of that one,
so every batch is learned from while the canary runs and the waiting candidate carries them all. Once the canary
ends, the next step judges the waiting candidate (the gate's ``canary_verdict``): promoted, it goes through the rest
of the gate against the promoted head, with every receipt it was trained on; ended (or the head moved another way),
it is discarded, written down as skipped without its receipts, which train again from the head. A restart loses
it (nothing was written down: its batches train again). ``canary_train_ahead = false`` turns it off, and so does a
record store shared by several daemons (the batches' claims are settled per step): the step waits for the verdict.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from recipes.base import Candidate


def follow(st: Any, follows: str, candidate: Candidate, job_id: str, *, published: bool,
           restart: bool = False) -> None:
    """Where the next weights step starts: the lineage goes on from this candidate, or (``restart``) from the
    head."""
    if st.recipe is None or st.recipe.kind != "weights":
        return
    if restart:
        for path in {candidate.path, st.lineage[2] if st.lineage else None} - {None}:
            shutil.rmtree(str(path), ignore_errors=True)
        st.lineage, st.rejected_run = None, 0
        return
    st.rejected_run = 0 if published else st.rejected_run + (candidate.skipped is None)
    if candidate.path is None:  # skipped: the lineage (and the model in the worker) did not move
        if st.lineage is not None:
            st.lineage = (follows, st.lineage[1], st.lineage[2])
        return
    old = st.lineage
    st.lineage = (follows, f"candidate:{job_id}", candidate.path)
    if old and old[2] != candidate.path:
        shutil.rmtree(old[2], ignore_errors=True)


def base(st: Any, head: Any) -> tuple[str, str] | None:
    """The lineage's last candidate (key, dir) when the next step continues it; None: start from the head."""
    lineage = st.lineage
    restart_after = int(getattr(st.recipe.settings, "restart_after", 0) or 0)
    if (lineage and lineage[0] == head.release_id and Path(lineage[2]).exists()
            and not (restart_after and st.rejected_run >= restart_after)):
        return lineage[1], lineage[2]
    st.rejected_run = 0
    return None


def canary_started(st: Any, release: Any) -> None:
    """The gate started a canary of the lineage's last candidate (held as ``release``)."""
    st.canary_of = (release.release_id, release.content_id, st.lineage[2]) if st.lineage else None


def canary_ended(st: Any, promoted: bool, head: str | None) -> None:
    """A canary ended: promoted (``head``: the new head's release), the lineage follows the new head when its
    candidate is the canary's; ended, the lineage is dropped (live traffic turned its candidate away)."""
    ours, st.canary_of = st.canary_of, None
    if st.lineage is None:
        return
    if not promoted:
        shutil.rmtree(st.lineage[2], ignore_errors=True)
        st.lineage = None
    elif head is not None and ours is not None and ours[2] == st.lineage[2]:
        st.lineage, st.rejected_run = (head, *st.lineage[1:]), 0


def ahead_of(st: Any, *, shared: bool = False) -> tuple[str, str, str] | None:
    """The running canary a weights step may train ahead of: (its release, content, dir), when the lineage's last
    candidate is the canary's or one trained ahead of it; None: the step waits for the verdict."""
    ours: tuple[str, str, str] | None = st.canary_of
    if (ours is None or shared or st.lineage is None
            or not getattr(st.recipe.settings, "canary_train_ahead", True)):
        return None
    waiting = st.waiting
    if st.lineage[2] == ours[2] or (waiting is not None and st.lineage[2] == waiting.candidate.path):
        return ours
    return None


def park(st: Any, run: Any) -> None:
    """A candidate trained ahead of a running canary waits for its verdict: it replaces the one that waited (it was
    trained on top of it, so it carries that one's receipts, trainer seconds and step count), and the lineage goes
    on from it."""
    from daemon import spend

    old = st.waiting
    if old is not None:
        run.receipts[:0] = old.receipts
        run.metrics["steps_ahead"] = int(old.metrics.get("steps_ahead", 1)) + 1
        run.metrics[spend.KEY] = round(float(old.metrics.get(spend.KEY, 0)) + float(run.metrics.get(spend.KEY, 0)), 3)
    else:
        run.metrics["steps_ahead"] = 1
    st.waiting = run
    before = st.lineage
    st.lineage = (run.head.release_id, f"candidate:{run.job_id}", run.candidate.path)
    if before and before[2] != run.candidate.path:
        shutil.rmtree(before[2], ignore_errors=True)


def waiting_receipts(st: Any) -> set[str]:
    """The receipts the candidate waiting for a canary's verdict was trained on: out of the next batches."""
    return set(st.waiting.receipts) if st.waiting is not None else set()
