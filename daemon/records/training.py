"""The training lease and the consumption of receipts, a part of the record store (``RecordStore.training``).

Several daemons sharing one store agree on who trains and on what was learned from: the lease row and the
consumption rows are what the database locks, never a lock in one process. ``lease`` takes or renews it; a step
``claim``s its receipts under the lease, ``settle``s them once its outcome is written down, or gives them back
(``release_claims``); a new holder ``recover_claims`` of earlier holders that never settled.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from daemon.errors import LeaseLost
from daemon.records.conn import Conn, Rows


@dataclass(frozen=True)
class Lease:
    """The training lease as one ``lease`` call found it. ``held``: whether the caller holds it now (until
    ``expires_at``, on the database's clock); ``epoch`` grows by one each time the lease changes hands, so a
    holder can tell a takeover happened even if it was its own name before."""

    name: str
    holder: str | None
    epoch: int
    expires_at: float
    held: bool


class Training:
    """The lease and consumption rows of one record store (its writer, its reads, its SQL dialect)."""

    def __init__(self, store: Rows) -> None:
        self.store = store

    # --- the training lease --------------------------------------------------------------------------------

    async def lease(self, name: str, holder: str, *, ttl_s: float) -> Lease:
        """Take the lease ``name`` for ``holder``, or renew it, for ``ttl_s`` seconds from now on the database's
        clock; a lease its holder did not renew in time is taken over. Returns the lease as it now stands:
        ``held`` says whether ``holder`` has it. One statement, an upsert whose row lock decides between daemons
        asking at once."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")

        def op(conn: Conn) -> Lease:
            row = conn.execute(
                f"""INSERT INTO leases(name, holder, epoch, expires_at, acquired_at)
                    VALUES (?, ?, 1, {self.store.NOW} + ?, {self.store.NOW})
                    ON CONFLICT (name) DO UPDATE SET
                        epoch = CASE WHEN leases.holder = excluded.holder THEN leases.epoch ELSE leases.epoch + 1 END,
                        acquired_at = CASE WHEN leases.holder = excluded.holder THEN leases.acquired_at
                                           ELSE excluded.acquired_at END,
                        holder = excluded.holder,
                        expires_at = excluded.expires_at
                    WHERE leases.holder = excluded.holder OR leases.holder IS NULL
                       OR leases.expires_at <= excluded.acquired_at
                    RETURNING holder, epoch, expires_at""",
                (name, holder, float(ttl_s)),
            ).fetchone()
            if row is not None:
                return Lease(name, row["holder"], row["epoch"], row["expires_at"], held=True)
            row = conn.execute("SELECT holder, epoch, expires_at FROM leases WHERE name=?", (name,)).fetchone()
            return Lease(name, row["holder"], row["epoch"], row["expires_at"], held=False)

        return await self.store.write(op)

    async def release_lease(self, lease: Lease) -> bool:
        """Give the lease up at once (a clean stop), so that another daemon need not wait for it to expire.
        Only its holder at that epoch can; returns whether it did."""

        def op(conn: Conn) -> bool:
            cur = conn.execute(
                "UPDATE leases SET holder=NULL, expires_at=0 WHERE name=? AND holder=? AND epoch=?",
                (lease.name, lease.holder, lease.epoch),
            )
            return bool(cur.rowcount == 1)

        return await self.store.write(op)

    def _check(self, conn: Conn, lease: Lease) -> None:
        row = conn.execute(
            f"SELECT holder, epoch, expires_at > {self.store.NOW} AS live FROM leases WHERE name=?{self.store.FOR_UPDATE}",
            (lease.name,),
        ).fetchone()
        if row is None or row["holder"] != lease.holder or row["epoch"] != lease.epoch or not row["live"]:
            raise LeaseLost(lease.name, lease.holder, row["holder"] if row is not None else None)

    async def claim(self, scenario: str, receipts: Sequence[str], lease: Lease) -> list[str]:
        """Claim receipts for a step of ``lease``'s holder: returns those it now has (in the order given); a
        receipt consumed or claimed already is left out. Raises ``LeaseLost`` when the lease is no longer the
        caller's (taken over): a holder that paused past its expiry learns so before it trains. Exactly once
        across daemons: the claim is a row keyed by (scenario, receipt), inserted only where none exists."""

        def op(conn: Conn) -> list[str]:
            self._check(conn, lease)
            got = []
            now = time.time()
            for receipt in dict.fromkeys(receipts):
                row = conn.execute(
                    "INSERT INTO consumption(scenario, receipt, holder, epoch, state, claimed_at)"
                    " VALUES (?,?,?,?,'claimed',?) ON CONFLICT DO NOTHING RETURNING receipt",
                    (scenario, receipt, lease.holder, lease.epoch, now),
                ).fetchone()
                if row is not None:
                    got.append(receipt)
            return got

        return await self.store.write(op)

    async def settle(self, scenario: str, receipts: Sequence[str], lease: Lease, outcome: str) -> int:
        """Mark claimed receipts consumed for good, with the step's ``outcome`` (a release id, or a rejection):
        called once the outcome is written down. Returns how many were settled."""

        def op(conn: Conn) -> int:
            n = 0
            for receipt in receipts:
                n += conn.execute(
                    "UPDATE consumption SET state='consumed', outcome=? WHERE scenario=? AND receipt=? AND holder=?"
                    " AND epoch=? AND state='claimed'",
                    (outcome, scenario, receipt, lease.holder, lease.epoch),
                ).rowcount
            return n

        return await self.store.write(op)

    async def release_claims(self, scenario: str, receipts: Sequence[str], lease: Lease) -> int:
        """Give back claims of this lease that the step did not consume (a skipped step that keeps its
        receipts): they can be claimed again."""

        def op(conn: Conn) -> int:
            n = 0
            for receipt in receipts:
                n += conn.execute(
                    "DELETE FROM consumption WHERE scenario=? AND receipt=? AND holder=? AND epoch=?"
                    " AND state='claimed'", (scenario, receipt, lease.holder, lease.epoch)).rowcount
            return n

        return await self.store.write(op)

    async def recover_claims(self, scenario: str, lease: Lease, consumed: Iterable[str]) -> list[str]:
        """After taking the lease over: claims of earlier holders that were never settled are theirs no more.
        Those in ``consumed`` (their outcome was written down, e.g. a published release lists them) are settled;
        the rest go back to the pool, to be learned from again. Returns the receipts given back."""
        done = set(consumed)

        def op(conn: Conn) -> list[str]:
            self._check(conn, lease)
            rows = conn.execute(
                "SELECT receipt FROM consumption WHERE scenario=? AND state='claimed' AND NOT (holder=? AND epoch=?)",
                (scenario, lease.holder, lease.epoch),
            ).fetchall()
            back = []
            for row in rows:
                if row["receipt"] in done:
                    conn.execute("UPDATE consumption SET state='consumed' WHERE scenario=? AND receipt=?",
                                 (scenario, row["receipt"]))
                else:
                    conn.execute("DELETE FROM consumption WHERE scenario=? AND receipt=?", (scenario, row["receipt"]))
                    back.append(row["receipt"])
            return back

        return await self.store.write(op)

    async def consumed(self, scenario: str) -> dict[str, str]:
        """Receipts of a scenario consumed or claimed, with their state (``consumed`` or ``claimed``)."""

        def op(conn: Conn) -> dict[str, str]:
            return {r["receipt"]: r["state"] for r in conn.execute(
                "SELECT receipt, state FROM consumption WHERE scenario=?", (scenario,)).fetchall()}

        return await self.store.read(op)
