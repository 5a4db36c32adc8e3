"""Forgetting: a user takes back exchanges they gave (``reef records forget``, ``POST /reef/records/forget``).

- The record store deletes their bodies in one transaction and keeps a tombstone (``RecordStore.forget``); the
  learner drops what it holds of them in memory, so no later step reads them.
- What cannot be undone is said, not hidden: a release whose step consumed a forgotten receipt was trained on it,
  and so is every release built on it (a train step starts from its parent; a rollback or promote restores content
  that may carry it). Such releases are marked ``trained_on_forgotten`` in release listings, and the newest release
  of the chain that was not is named with the one command that rolls back to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from daemon.chains import Chains
    from daemon.config import Config
    from daemon.events import EventBus
    from daemon.learning import Learner
    from daemon.records.store import RecordStore

log = logging.getLogger("reef.forgetting")


class Daemon(Protocol):
    """What forgetting uses of the daemon (``daemon.serving.Reef`` is one), named here so that this module does not
    depend on the serving object that starts its retention loop."""

    @property
    def config(self) -> Config: ...

    @property
    def store(self) -> RecordStore: ...

    @property
    def chains(self) -> Chains: ...

    @property
    def events(self) -> EventBus: ...

    @property
    def learner(self) -> Learner: ...

MAX_FORGET = 100_000  # receipts and runs in one request


def tainted(history: Sequence[Any], forgotten: set[str]) -> set[str]:
    """The releases of a chain (``history`` newest first, as ``ReleaseStore.history`` gives it) that were trained
    on forgotten receipts: directly (their step consumed one), through their parent (a train step learns on top of
    it), or through their content (a rollback restores content that carries it)."""
    marked: set[str] = set()
    carried: set[str] = set()  # content ids trained on forgotten data
    for rel in reversed(history):  # oldest first: a release after what it builds on
        direct = bool(forgotten.intersection(rel.receipts))
        inherited = rel.operation == "train" and rel.parent in marked
        if direct or inherited or rel.content_id in carried:
            marked.add(rel.release_id)
            carried.add(rel.content_id)
    return marked


async def chain_view(reef: Daemon, scenario: str) -> dict[str, Any]:
    """For a scenario's chain: which releases were trained on forgotten receipts, and the newest that was not
    (with the command that rolls back to it) when the head was."""
    forgotten = await reef.store.forgotten(scenario)
    if not forgotten:
        return {"trained_on_forgotten": [], "rollback_to": None}
    history = await reef.chains.history(scenario, None)
    marked = tainted(history, forgotten)
    out: dict[str, Any] = {"trained_on_forgotten": [r.release_id for r in history if r.release_id in marked],
                           "rollback_to": None}
    if history and history[0].release_id in marked:
        clean = next((r for r in history if r.release_id not in marked), None)
        if clean is not None:
            out["rollback_to"] = clean.release_id
            out["command"] = f"reef releases rollback {clean.release_id[:12]} --scenario {scenario}"
    return out


async def forget(reef: Daemon, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /reef/records/forget``: ``receipts`` and/or ``runs`` (lists of ids), ``scrub`` (PostgreSQL: rewrite
    the table)."""
    from daemon.errors import BadRequest

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
    out = await reef.store.forget(receipts=lists["receipts"], runs=lists["runs"], scrub=scrub)
    for scenario in out["scenarios"]:
        reef.learner.forget(scenario)
    out["releases"] = {s: await chain_view(reef, s) for s in out["scenarios"]}
    reef.events.publish("forget", receipts=len(out["forgotten"]), scenarios=out["scenarios"])
    return out


async def apply_retention(reef: Daemon) -> dict[str, Any] | None:
    """Forget what the retention settings say is due now (``retention_days``, ``retention_max_mb``); None when
    nothing is."""
    cfg = reef.config
    before = time.time() - cfg.retention_days * 86400 if cfg.retention_days is not None else None
    max_bytes = int(cfg.retention_max_mb * 1e6) if cfg.retention_max_mb is not None else None
    due = await reef.store.retention_due(before=before, max_bytes=max_bytes)
    if not due:
        return None
    out = await reef.store.forget(receipts=due, runs=[])
    for scenario in out["scenarios"]:
        reef.learner.forget(scenario)
    log.info("retention: forgot %d exchanges (%s)", len(out["forgotten"]), out["remains"])
    reef.events.publish("forget", receipts=len(out["forgotten"]), scenarios=out["scenarios"], retention=True)
    return out


async def retention_loop(reef: Daemon) -> None:
    """Apply the retention settings at start and every ``retention_check_s``; a round that fails is logged and
    tried again at the next."""
    from daemon.errors import ReefError

    while True:
        try:
            while await apply_retention(reef) is not None:
                pass  # more than one round's worth was due
        except ReefError as e:
            log.warning("retention: could not forget what is due: %s", e.message)
        await asyncio.sleep(reef.config.retention_check_s)
