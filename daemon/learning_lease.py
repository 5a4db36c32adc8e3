"""The training lease as the learning loop keeps it (``daemon/learning.py``), when several daemons share one record
store (PostgreSQL): only the holder of the lease steps.

The lease itself is a row of the store (``store.training``: ``daemon/records/training.py``); this keeps it: taken
or renewed every third of ``lease_ttl_s``, trusted only for 90% of its term counted from before the request (the
database counted from later), handed over at once on a clean stop. Whoever holds it also looks for work at every
renewal, since reports may have reached another daemon; a daemon that takes it over is told (``took_over``), so
that it gives back the claims of the previous holder whose outcome was never written down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable

from daemon.errors import ReefError
from daemon.records import Lease, new_id
from daemon.records.training import Training

log = logging.getLogger("reef.learning")

LEASE = "trainer"  # the one training lease of a shared store: exactly one daemon trains


class LeaseKeeper:
    """Keeps this daemon's claim on the training lease of a shared store, renewing it in the background."""

    def __init__(self, training: Training, ttl_s: float, *, took_over: Callable[[Lease], Awaitable[None]],
                 look_for_work: Callable[[], Awaitable[None]]) -> None:
        self.training, self.ttl_s = training, ttl_s
        self.took_over, self.look_for_work = took_over, look_for_work
        # this process, as a lease holder (a restarted daemon is a new holder: it waits out the old lease)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{new_id('')[-6:]}"
        self._lease: Lease | None = None
        self._until = 0.0  # loop time until which the lease is surely still ours
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._keep())

    def held(self) -> Lease | None:
        """The lease while it is surely ours (renewed less than its term ago, on this machine's clock)."""
        if self._lease is not None and asyncio.get_running_loop().time() < self._until:
            return self._lease
        return None

    def lost(self) -> None:
        """The store said the lease is no longer ours (``LeaseLost``): until the next renewal, it is not."""
        self._lease = None

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            try:
                lease: Lease | None = await self.training.lease(LEASE, self.holder, ttl_s=self.ttl_s)
            except ReefError as e:  # the store is away: whether we still hold it is unknown, so we do not
                log.warning("could not renew the training lease: %s", e.message)
                lease = None
            previous = self._lease
            self._lease = lease if lease is not None and lease.held else None
            self._until = asked + self.ttl_s * 0.9  # from before the request: the database counted from later
            try:
                if self._lease is not None:
                    if previous is None or previous.epoch != self._lease.epoch:
                        log.info("training here: holding the training lease (epoch %d)", self._lease.epoch)
                        await self.took_over(self._lease)
                    await self.look_for_work()  # reports may have reached another daemon
                elif previous is not None:
                    log.warning("the training lease is no longer ours (held by %s)",
                                lease.holder if lease is not None else "unknown")
            except ReefError as e:
                log.warning("the training lease's holder could not look for work: %s", e.message)
            await asyncio.sleep(self.ttl_s / 3)

    async def stop(self) -> None:
        """Stop renewing (the lease stays held until ``release`` or its term)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def release(self) -> None:
        """A clean stop hands training over at once, not after the lease's term."""
        if self._lease is not None:
            try:
                await self.training.release_lease(self._lease)
            except ReefError:
                pass  # the store is away: the lease runs out by itself
