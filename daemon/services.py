"""The daemon as its parts see it: ``Daemon``, what canaries and forgetting use of the serving object
(``daemon.serving.Reef`` is one), named here once so that they do not depend on the object that holds them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from daemon.chains import Chains
    from daemon.config import Config
    from daemon.engines.base import Engine
    from daemon.events import EventBus
    from daemon.learning import Learner
    from daemon.metrics import Metrics
    from daemon.records.store import RecordStore


class Daemon(Protocol):
    """The daemon's config, record store, release chains, events, metrics, learner and engines."""

    config: Config
    store: RecordStore
    chains: Chains
    events: EventBus
    metrics: Metrics
    learner: Learner

    async def engine(self, model: str) -> Engine: ...
