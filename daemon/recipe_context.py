"""What a recipe's step gets of the daemon (``recipes.base.HarnessContext``): greedy answers from the configured
models, and, for recipes that run episodes of the agent against this daemon, the scenario, the config, its records,
scoped tokens and episode releases. The learning loop (``daemon/learning.py``) makes one per step."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from daemon.chains import Chains
from daemon.config import Config
from daemon.engines.base import Engine
from daemon.errors import CapReached, HeadMoved, ReefError
from daemon.exchange import Finish, internal_exchange
from daemon.records import RecordRow, RecordStore
from daemon.scopes import Scopes


class RecipeContext:
    """The ``HarnessContext`` a harness recipe gets: greedy answers from configured models, and (for recipes that
    run episodes of the agent against this daemon) the scenario, the config, its records, episode scenarios."""

    def __init__(self, engine: Callable[[str], Awaitable[Engine]], model: str, *, scenario: str | None = None,
                 config: Config | None = None, store: RecordStore | None = None, chains: Chains | None = None,
                 scopes: Scopes | None = None, tokens_left: tuple[float, str] | None = None,
                 spent: Callable[[int], None] | None = None) -> None:
        self._engine, self.model = engine, model
        self.scenario, self.config, self._store, self._chains = scenario, config, store, chains
        self._scopes = scopes
        # the proposer tokens left today under max_proposer_tokens and the cap's message (None: no cap); ``spent``
        # is told each proposer call's tokens (the learning loop writes the step's sum in its metrics, whatever
        # the outcome)
        self._tokens_left, self._spent, self.proposer_tokens = tokens_left, spent, 0

    def scoped_token(self, name: str, ttl_s: float) -> str:
        """A token that can only sample scenario ``name``, start its runs and read those (``daemon/scopes.py``),
        for an episode's sandbox, which reaches the daemon on ``config.scoped_socket_path`` only. It expires after
        ``ttl_s``; revoke it (``revoke_token``) when the episode ends."""
        assert self._scopes is not None
        return self._scopes.mint(name, ttl_s)

    def revoke_token(self, token: str) -> None:
        assert self._scopes is not None
        self._scopes.revoke(token)

    async def record(self, receipt: str) -> RecordRow:
        """A stored record (an exchange with its request and response), by receipt."""
        assert self._store is not None
        return await self._store.exchanges.get(receipt)

    async def first_tree(self) -> dict[str, bytes] | None:
        """The harness tree of this scenario's first release (the base a retained evaluation compares with too)."""
        assert self._chains is not None and self.scenario is not None
        chain = await self._chains.history(self.scenario)
        return None if not chain else await self._chains.harness_tree(chain[-1])

    async def episode_release(self, name: str, tree: dict[str, bytes]) -> str:
        """A release whose content is ``tree`` on the chain of scenario ``name`` (created with recipe ``record`` and
        this scenario's model unless it exists): its head when the content is the same, else a new release. An
        episode's agent pins it, so its records name the exact harness it ran with."""
        assert self._store is not None and self.config is not None and self._chains is not None
        scenario = await self._store.scenarios.ensure(name, recipe="record", model=self.model,
                                                     default_recipe=self.config.default_recipe, settings=None)
        head = None
        for _ in range(3):
            head = await self._chains.head(scenario)
            if head.kind != "harness":
                raise ReefError(f"scenario {name} serves {head.kind}, not a harness: episodes need a harness chain")
            if await self._chains.harness_tree(head) == tree:
                return head.release_id
            try:
                manifest = self._chains.manifest(scenario, settings={"for": "episodes"})
                rel = await self._chains.publish_candidate(scenario, manifest, tree, expected_head=head.release_id)
            except HeadMoved:
                continue
            return rel.release_id
        raise HeadMoved(name, head.release_id if head else None, None)

    async def answer(self, model: str | None, system: str, user: str, max_tokens: int,
                     temperature: float = 0.0, *, proposal: bool = False) -> str:
        """The model's answer; ``proposal``: a proposer's call, refused (``CapReached``) once the day's proposer
        tokens are spent, its tokens counted."""
        if proposal and self._tokens_left is not None and self.proposer_tokens >= self._tokens_left[0]:
            raise CapReached(self._tokens_left[1])
        name = model or self.model
        engine = await self._engine(name)
        text, used = "", 0
        async for event in engine.generate(internal_exchange(name, system, user, max_tokens, temperature), None):
            if isinstance(event, Finish):
                text = event.completion.text
                used = event.completion.usage.input_tokens + event.completion.usage.output_tokens
        if proposal:
            self.proposer_tokens += used
            if self._spent is not None:
                self._spent(used)
        return text
