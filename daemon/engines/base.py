"""The engine interface: what generates tokens for an exchange.

An engine is built from one model entry of the config. The daemon calls ``generate`` with a neutral
``Exchange`` and relays the events it yields; the last event of a successful generation is always ``Finish``
carrying the assembled ``Completion``. Errors are raised as ``daemon.errors`` classes: an exchange the engine
cannot serve (images for a text-only model, a prompt beyond the context) is a ``BadRequest`` raised *before*
the first event, so the HTTP layer can still answer with a clean 400.

Embedded engines (``transformers``) fill ``Completion.token_ids``/``logprobs``/``runtime_load_id``; remote ones
(``upstream``) fill what their server reports; inference servers (``vllm``, ``sglang``) fill the token ids and
log-probs the server sampled, and the load id whose weight version it reported.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from pathlib import Path

from daemon.errors import EngineError
from daemon.exchange import Completion, EngineEvent, Exchange, Finish


@dataclass(frozen=True)
class ReleaseRef:
    """The release a request is frozen to: its ids and where its artifact is checked out."""

    release_id: str
    content_id: str
    path: Path | None = None  # the materialised artifact (weights engines load from here)
    base: ReleaseRef | None = None  # a LoRA adapter release: the release of whole weights the adapter applies to


@dataclass(frozen=True)
class EngineInfo:
    name: str  # engine kind: transformers, upstream, vllm, sglang
    model: str  # the model name clients use
    context_length: int | None = None
    accepts_images: bool = False
    output_cap: int | None = None  # the most new tokens a request may take (daemon/engines/prompts.py); None: none
    # whether the model's chat template puts an agent's tools into the prompt (``daemon/engines/chat_template.py``);
    # None: not known (an upstream provider renders its own prompt)
    carries_tools: bool | None = None


class Engine(abc.ABC):
    """Base class of all engines."""

    info: EngineInfo

    async def start(self) -> None:
        """Load what is needed before serving (called once, before the first request)."""

    async def close(self) -> None:
        """Release resources; in-flight generations have finished when this is called."""

    @abc.abstractmethod
    def generate(self, exchange: Exchange, release: ReleaseRef | None = None) -> AsyncIterator[EngineEvent]:
        """Generate an answer; yields deltas then one ``Finish``. Validation errors raise before the first yield.

        ``release`` is the release the request is frozen to; weights engines serve that release's weights from
        start to finish (``Completion.runtime_load_id`` names the load), others may ignore it."""

    @abc.abstractmethod
    async def count_tokens(self, exchange: Exchange, release: ReleaseRef | None = None) -> int:
        """Number of prompt tokens the exchange would take."""

    async def divergence(self, prompt_token_ids: list[int], token_ids: list[int], release: ReleaseRef,
                         reference: ReleaseRef) -> list[float] | None:
        """KL(``release`` || ``reference``) of the next-token distributions at each position that predicts one of
        ``token_ids`` after ``prompt_token_ids`` (teacher-forced, nats), or None where the engine cannot say (the
        default): the held-out check's KL from the base (``daemon/gating/heldout.py``) is then not measured."""
        return None

    async def answer_many(self, exchanges: list[Exchange], release: ReleaseRef | None = None) -> list[Completion]:
        """What ``generate`` finishes with for each of ``exchanges`` (the daemon's own questions: the held-out
        check's answers). The default asks them all at once, each as a request; an engine that can decode them as
        one batch beside its users' requests does (``transformers``)."""
        async def one(exchange: Exchange) -> Completion:
            async for event in self.generate(exchange, release):
                if isinstance(event, Finish):
                    return event.completion
            raise EngineError("the engine ended an answer without finishing it")

        return list(await asyncio.gather(*(one(e) for e in exchanges)))

    async def divergence_many(self, pairs: list[tuple[list[int], list[int]]], release: ReleaseRef,
                              reference: ReleaseRef) -> list[list[float]] | None:
        """``divergence`` of each (prompt, tokens) pair; None where the engine cannot say. The default asks them one
        at a time; ``transformers`` runs them in a few batched forwards."""
        out = []
        for prompt, tokens in pairs:
            kl = await self.divergence(prompt, tokens, release, reference)
            if kl is None:
                return None
            out.append(kl)
        return out

    async def unload(self, release: ReleaseRef) -> None:
        """Drop a release loaded only for a look at it (a candidate the held-out check sampled), if no request
        holds it; the default keeps nothing to drop."""

    def retain(self, keep: Collection[str]) -> None:
        """The content ids of the releases that serve new requests now: each scenario's head, the canary arms, the
        releases requests pinned lately (``daemon/residency.py``). A weights engine drops a release it loaded while
        it served and that serves no more, once no request runs on it; the default keeps nothing to drop."""

    @property
    def resident(self) -> dict[str, str]:
        """content_id -> runtime load id of the releases kept loaded (weights engines)."""
        return {}

    async def preload(self, release: ReleaseRef) -> str | None:
        """Make a release resident before requests need it (after a publish); returns its load id, if any."""
        return None

    @property
    def status(self) -> dict[str, object]:
        """What ``/reef/status`` and ``reef doctor`` show of a server the engine runs or talks to (empty: none)."""
        return {}

    @property
    def runtime_load_id(self) -> str | None:
        """The load currently serving new requests, or ``None`` for engines that do not load weights."""
        return None
