"""What crosses the gate's steps: the run a candidate makes through them (``GateRun``), the outcome that ends it
(``StepOutcome``, also the answer of ``Learner.step``), and what a step may use of the loop (``Host``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from daemon.chains import Chains
    from daemon.engines.base import Engine
    from daemon.events import EventBus
    from daemon.gate import Verdict
    from daemon.gating.heldout import Answer
    from daemon.metrics import Metrics
    from daemon.records import Scenario
    from daemon.releases import Manifest
    from recipes.base import Candidate, Recipe


@dataclass
class StepOutcome:
    """What one step of a scenario's loop did: the answer of ``Learner.step`` (``to_dict`` is what the API shows,
    in ``POST /reef/report``'s ``learning`` and ``evolve``'s answer)."""

    verdict: str  # accepted | rejected | pending | skipped | failed | paused
    scenario: str | None = None
    base: str | None = None  # the head release the step started from (None: no step ran)
    job: str | None = None  # the step's job id (None: no step ran)
    release_id: str | None = None  # what it published or held
    step: int | None = None  # that release's step
    reason: str | None = None
    summary: str | None = None
    metrics: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)  # what the recipe says about its candidate (harness)
    consumed: int = 0  # receipts the step consumed
    # the receipts the step consumed when not the whole batch (a skipped step that leaves them eligible): only the
    # loop reads it, the API shows ``consumed``
    kept: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("scenario", self.scenario), ("base", self.base),
                                                 ("job", self.job)) if v is not None}
        out.update(self.details)
        if self.metrics is not None:
            out["metrics"] = self.metrics
        out["verdict"] = self.verdict
        if self.job is not None:  # a step ran: what it released (or None) and why
            out.update(release_id=self.release_id)
        if self.step is not None:
            out["step"] = self.step
        if self.job is not None or self.reason is not None:
            out["reason"] = self.reason
        if self.summary is not None:
            out["summary"] = self.summary
        out["consumed"] = self.consumed
        return out


@dataclass
class GateRun:
    """One made candidate on its way through the gate's steps: what they read, and what they add (``metrics``,
    the gate kind's ``verdict`` and ``reason``)."""

    st: Any  # the scenario's ``daemon.learning.ScenarioLearning``
    scenario: Scenario
    head: Any  # the head release the step started from
    candidate: Candidate
    receipts: list[str]
    job_id: str
    record_settings: dict[str, Any]
    metrics: dict[str, Any]
    origin: dict[str, Any] | None = None  # an agent's proposal that made it (on every outcome's manifest)
    verdict: Verdict | None = None  # the recipe's gate kind, once judged
    reason: str | None = None  # why, as it stands (a later step may say more)
    # the held-out check's questions and the candidate's answers to them (kept as the head's once it is published)
    heldout_answers: tuple[tuple[int, int], dict[str, Answer]] | None = None  # (the lengths, answers by prompt)
    # weights: the running canary it was trained ahead of (release, content, dir; daemon/lineage.py)
    ahead: tuple[str, str, str] | None = None

    @property
    def recipe(self) -> Recipe:
        recipe: Recipe | None = self.st.recipe
        assert recipe is not None
        return recipe

    @property
    def weights(self) -> bool:
        return self.recipe.kind == "weights"

    @property
    def artifact(self) -> Any:
        return self.candidate.tree if self.candidate.tree is not None else self.candidate.path

    @property
    def details(self) -> dict[str, Any]:
        return dict(self.candidate.details)

    def manifest(self, host: Host, *, receipts: Sequence[str] | None = None, **extra: Any) -> Manifest:
        """The manifest of this candidate's outcome: its metrics (and ``extra`` ones), receipts, settings, origin."""
        return host.chains.manifest(self.scenario, metrics={**self.metrics, **extra},
                                    receipts=self.receipts if receipts is None else receipts,
                                    settings=self.record_settings, origin=self.origin)

    def outcome(self, verdict: str, **kw: Any) -> StepOutcome:
        return StepOutcome(verdict, metrics=self.metrics, details=self.details, **kw)


class Host(Protocol):
    """What the gate's steps use of the learning loop (``daemon.learning.Learner`` is one)."""

    chains: Chains
    events: EventBus
    metrics: Metrics
    engine: Callable[[str], Awaitable[Engine]]
    start_canary: Callable[[Scenario, dict[str, Any]], Awaitable[Any]] | None
    canary_running: Callable[[str], bool] | None  # whether a scenario's canary runs

    async def write_down(self, manifest: Manifest, head: Any, verdict: str, reason: str) -> None: ...

    def follow(self, st: Any, follows: str, candidate: Candidate, job_id: str, *, published: bool,
               restart: bool = False) -> None: ...


    async def set_warning(self, name: str, warning: dict[str, Any] | None) -> Any:
        """Write the scenario's early-warning state (``daemon/gating/warning.py``) to the record store."""
        ...

    async def heldout_prompts(self, st: Any) -> list[str]:
        """The scenario's reserved recorded prompts the held-out check asks (most recent last)."""
        ...

    def heldout_head(self, st: Any, key: tuple[Any, ...], answers: dict[str, Answer] | None = None
                     ) -> dict[str, Answer] | None:
        """The head's held-out answers by prompt kept for ``key`` (head content, max tokens); with ``answers``,
        keep them."""
        ...


class Step(Protocol):
    """One named step: an outcome ends the run, None lets the next step have it."""

    __name__: str

    def __call__(self, host: Host, run: GateRun) -> Awaitable[StepOutcome | None]: ...
