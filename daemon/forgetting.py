"""Forgetting: a user takes back exchanges they gave (``reef records forget``, ``POST /reef/records/forget``), and
retention lets them go by age and size (``retention_days``, ``retention_max_mb``).

- The record store deletes their bodies in one transaction and keeps a tombstone (``RecordStore.forget``): the
  request, the answer, their tokens, and the feedback of every report on them; the learner drops what it holds of
  them in memory, so no later step reads them, and tells the scenario's recipe, which drops what it keeps of its
  own (``Recipe.forget``: harness-search's memory of bad runs, in memory and in its file).
- Then the copies under ``$REEF_HOME`` go (``daemon/copies.py``): the wrappers' run files of those runs, the files
  the agents wrote in their isolated homes during them (sessions, transcripts, their own databases and logs), and
  the release pages written there. Reef's own log never holds a prompt, an answer or feedback.
- What cannot be undone is said, not hidden: a release built from forgotten data keeps it, as weights (a step
  trained on a forgotten receipt) or as text (a harness step that learned from a forgotten report's feedback, a
  proposal made in a forgotten run), and so does every release built on it (a train step starts from its parent;
  a rollback or promote restores content that may carry it). Such releases are marked ``trained_on_forgotten`` in
  release listings, and the newest release of the chain that was not is named with the one command that rolls
  back to it.
- Retention judges exchanges by their date, and runs by when they started; a record dated beyond this clock
  (``CLOCK_SKEW_S``) is due at once under ``retention_days`` (``store.user_data.retention_due``); imports refuse
  such dates. Each round forgets at most ``RETENTION_ROUND`` exchanges, and rounds follow each other until nothing is
  due, so a backlog goes within one check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from daemon.services import Daemon

if TYPE_CHECKING:
    from daemon.config import Config
    from daemon.records.store import RecordStore

log = logging.getLogger("reef.forgetting")


MAX_FORGET = 100_000  # receipts and runs in one request
RETENTION_ROUND = 10_000  # exchanges one retention round forgets at most (one transaction)


def tainted(history: Sequence[Any], forgotten: set[str], runs: Collection[str] = frozenset(),
            bundled: Collection[str] = frozenset()) -> set[str]:
    """The releases of a chain (``history`` newest first, as ``ReleaseStore.history`` gives it) made from forgotten
    data: directly (their step consumed a forgotten receipt, or a report whose feedback was forgotten: ``forgotten``
    holds both kinds of id; or an agent proposed them in a run in ``runs``, one with a forgotten exchange; or a
    bundle of a release in ``bundled``, marked on its own chain), through their parent (a train step, or a promoted
    candidate, builds on it), or through their content (a rollback restores content that carries it)."""
    marked: set[str] = set()
    carried: set[str] = set()  # content ids made from forgotten data
    for rel in reversed(history):  # oldest first: a release after what it builds on
        origin = rel.origin or {}
        direct = bool(forgotten.intersection(rel.receipts)) or origin.get("receipt") in forgotten \
            or origin.get("run") in runs \
            or (origin.get("kind") == "bundle" and bool({origin.get("weights"), origin.get("harness")} & set(bundled)))
        inherited = rel.operation in ("train", "promote") and rel.parent in marked
        if direct or inherited or rel.content_id in carried:
            marked.add(rel.release_id)
            carried.add(rel.content_id)
    return marked


async def forgotten_sources(store: RecordStore, scenario: str) -> tuple[set[str], set[str]]:
    """What a scenario's releases may have been made from and was forgotten: the ids of its forgotten exchanges and
    of the reports on them (their feedback went with them), and the runs those exchanges belonged to."""

    def op(conn: Any) -> tuple[set[str], set[str]]:
        rows = conn.execute("SELECT id, run FROM records WHERE scenario=? AND kind='exchange'"
                            " AND forgotten_at IS NOT NULL", (scenario,)).fetchall()
        ids, runs = {r["id"] for r in rows}, {r["run"] for r in rows if r["run"]}
        if ids:  # a report on a forgotten exchange lost its feedback in the same transaction
            ids |= {r["report_id"] for r in conn.execute(
                "SELECT DISTINCT rr.report_id FROM report_refs rr JOIN records r ON r.id = rr.receipt"
                " WHERE r.scenario=? AND r.kind='exchange' AND r.forgotten_at IS NOT NULL", (scenario,)).fetchall()}
        return ids, runs

    result: tuple[set[str], set[str]] = await store.read(op)
    return result


async def chain_view(reef: Daemon, scenario: str) -> dict[str, Any]:
    """For a scenario's chain: which releases were made from forgotten data, and the newest that was not (with
    the command that rolls back to it) when the head was."""
    forgotten, runs = await forgotten_sources(reef.store, scenario)
    history = await reef.chains.history(scenario, None)
    bundled = await _marked_sources(reef, history)
    if not forgotten and not bundled:
        return {"trained_on_forgotten": [], "rollback_to": None}
    marked = tainted(history, forgotten, runs, bundled)
    out: dict[str, Any] = {"trained_on_forgotten": [r.release_id for r in history if r.release_id in marked],
                           "rollback_to": None}
    if history and history[0].release_id in marked:
        clean = next((r for r in history if r.release_id not in marked), None)
        if clean is not None:
            out["rollback_to"] = clean.release_id
            out["command"] = f"reef releases rollback {clean.release_id[:12]} --scenario {scenario}"
    return out


async def _marked_sources(reef: Daemon, history: Sequence[Any]) -> set[str]:
    """The releases that the bundles of ``history`` were made from and that their own chains mark as made from
    forgotten data (a bundle's weights and harness come from other scenarios, whose records are forgotten there)."""
    sources = {rid for rel in history if (rel.origin or {}).get("kind") == "bundle"
               for rid in (rel.origin.get("weights"), rel.origin.get("harness")) if isinstance(rid, str)}
    marked: set[str] = set()
    for name in sorted({(await reef.chains.release(rid)).scenario for rid in sources}):
        forgotten, runs = await forgotten_sources(reef.store, name)
        if forgotten or runs:
            marked |= tainted(await reef.chains.history(name, None), forgotten, runs) & sources
    return marked


async def forget(reef: Daemon, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /reef/records/forget``: ``receipts`` and/or ``runs`` (lists of ids), ``scrub`` (PostgreSQL: rewrite
    the table). A run with a run file here but no exchange (its agent made no request) is forgotten too: its file
    and what its agent wrote go."""
    from daemon.errors import BadRequest, NotFound

    lists = {}
    for key in ("receipts", "runs"):
        value = body.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise BadRequest(f"{key} must be a list of ids", param=key)
        if len(value) > MAX_FORGET:
            raise BadRequest(f"at most {MAX_FORGET} {key} at once", param=key)
        lists[key] = value
    if not lists["receipts"] and not lists["runs"]:
        raise BadRequest("name at least one receipt or run to forget", param="receipts")
    scrub = body.get("scrub", False)
    if not isinstance(scrub, bool):
        raise BadRequest("scrub must be true or false", param="scrub")
    receipts, runs, file_only = lists["receipts"], lists["runs"], []
    try:
        out = await reef.store.user_data.forget(receipts=receipts, runs=runs, scrub=scrub)
    except NotFound as e:
        unknown = e.data.get("runs")
        if not unknown or not all((reef.config.runs_dir / f"{r}.json").is_file() for r in unknown):
            raise
        file_only = list(unknown)
        runs = [r for r in runs if r not in set(file_only)]
        out = (await reef.store.user_data.forget(receipts=receipts, runs=runs, scrub=scrub) if receipts or runs else
               _nothing())
    await _tell_learner(reef, out["scenarios"])
    out["copies"] = await asyncio.to_thread(_remove_copies, reef.config, [*out["runs"], *file_only])
    out["releases"] = {s: await chain_view(reef, s) for s in out["scenarios"]}
    reef.events.publish("forget", receipts=len(out["forgotten"]), scenarios=out["scenarios"])
    return out


def _nothing() -> dict[str, Any]:
    """What ``RecordStore.forget`` answers when no exchange was named: only run files go."""
    return {"forgotten": [], "already": [], "reports": 0, "scenarios": [], "runs": [], "remains": ""}


async def _tell_learner(reef: Daemon, scenarios: list[str]) -> None:
    for scenario in scenarios:
        ids, _runs = await forgotten_sources(reef.store, scenario)
        await reef.learner.forget(scenario, ids)


def _remove_copies(config: Config, runs: list[str]) -> dict[str, int]:
    from daemon import copies

    return {**copies.remove_runs(config, runs), "pages": copies.remove_pages(config)}


async def apply_retention(reef: Daemon) -> dict[str, Any] | None:
    """Forget what the retention settings say is due now (``retention_days``, ``retention_max_mb``): at most
    ``RETENTION_ROUND`` exchanges, and the runs (files and what their agents wrote) that started before the age
    bound; None when nothing was."""
    from daemon import copies

    cfg = reef.config
    before = time.time() - cfg.retention_days * 86400 if cfg.retention_days is not None else None
    max_bytes = int(cfg.retention_max_mb * 1e6) if cfg.retention_max_mb is not None else None
    due = await reef.store.user_data.retention_due(before=before, max_bytes=max_bytes, limit=RETENTION_ROUND)
    old_runs = (await asyncio.to_thread(copies.runs_started_before, cfg, before, limit=RETENTION_ROUND)
                if before is not None else [])
    if not due and not old_runs:
        return None
    out = (await reef.store.user_data.forget(receipts=due, runs=[]) if due else
           _nothing())
    await _tell_learner(reef, out["scenarios"])
    out["copies"] = await asyncio.to_thread(_remove_copies, cfg, [*out["runs"], *old_runs])
    if not due and not out["copies"]["runs"]:
        return None  # run files that could not be removed: not a reason for another round
    log.info("retention: forgot %d exchanges and %d runs (%s)", len(out["forgotten"]), out["copies"]["runs"],
             out["remains"])
    reef.events.publish("forget", receipts=len(out["forgotten"]), scenarios=out["scenarios"], retention=True)
    return out


async def retention_loop(reef: Daemon, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Apply the retention settings at start and every ``retention_check_s``, round after round until nothing is
    due; a round that fails is logged and tried again at the next check."""
    from daemon.errors import ReefError

    while True:
        try:
            while await apply_retention(reef) is not None:
                pass  # more than one round's worth was due
        except ReefError as e:
            log.warning("retention: could not forget what is due: %s", e.message)
        await sleep(reef.config.retention_check_s)
