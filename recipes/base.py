"""The recipe interface: what every learning recipe implements, built-in or not, and what crosses the trainer
boundary.

A recipe is a subclass of ``Recipe`` named by a built-in name (``record``, ``online-rl``, ``lessons``) or by
``module:Class`` (from the daemon's Python path or a configured ``recipe_paths`` directory). The daemon runs
one generic loop over it (``daemon/learning.py``), per scenario:

    eligible records -> batch -> candidate -> gate -> publish | hold for review | reject (written down)

What the daemon calls, and where:

- ``parse_settings(raw)`` (class method, daemon): the recipe's typed settings from ``[recipes.<name>]`` and the
  scenario's ``settings``; unknown keys and bad values are a ``BadRequest`` naming them. The instance the loop
  uses is ``Recipe(settings)``.
- ``check_report(metadata)`` (class method, daemon, at ingress): the recipe's report schema (``Report``, a
  dataclass of structured fields a report's ``metadata`` may carry); a violation is a 400 naming the field and
  nothing is stored.
- ``eligible(record, ...)`` and ``batch(records)`` (daemon): which of the records it reads it learns from, and
  which of them form the next batch. The records are named types (``daemon/records/scored.py``, re-exported
  here): ``ScoredExchange`` for a ``scores`` recipe (the exchange's tokens and log-probs, and the
  ``FeedbackReport`` that scored it), ``FeedbackReport`` for a ``feedback`` recipe.
- weights recipes: ``train(job, state)`` runs in the trainer worker process, never in the daemon. It gets a
  ``TrainJob`` (the batch, the base to start from, the serving head, a fresh directory to write the candidate
  into) and a dict that lives as long as the worker (for a model kept in memory between steps), and returns a
  ``Candidate``: the directory it wrote (a whole model, or a LoRA adapter on ``job.model_key``: ``daemon/lora.py``),
  its metrics and the gate's evaluation scores, or ``skipped`` with the
  reason when the batch had nothing to teach. The worker fsyncs and renames the directory to its final name.
- harness recipes: ``edit(tree, batch, ctx)`` runs in the daemon (an edit of text files) and returns a
  ``Candidate`` holding the new tree; ``assess(tree, candidate, ctx)`` (optional) evaluates a candidate an agent
  proposed (``daemon/proposals.py``) as the recipe evaluates its own, for its gate.
- ``judge(candidate, best)`` (daemon): the gate's ``Verdict`` (``daemon/gate.py``; the ``gate`` setting by
  default).
- ``status(releases, rejected)`` (daemon, optional): a summary the scenario's view shows (``recipe_status``),
  computed from the chain (e.g. ttt-discover's best attempt and the release that found it).

Guarantees the daemon gives every recipe: a batch's receipts are consumed exactly once (listed in the release
or the rejection that came of them, rebuilt from the chain at start-up); a crash (``kill -9``, a dead worker)
retries the step, since nothing was consumed, but a worker that dies twice on the same batch (the kernel's
out-of-memory killer would only kill it again) is a failed step naming how it died, never a loop; a candidate
is never half published (the chain's compare-and-swap moves the head to a complete release or not at all); a
candidate whose content equals its parent is not published; a step that raises is written down as failed with
the exception's message, and serving goes on.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from daemon.errors import BadRequest
from daemon.gate import Verdict, judge
from daemon.records.scored import FeedbackReport, RequestSampling, ScoredExchange

__all__ = ["FeedbackReport", "RequestSampling", "ScoredExchange"]  # re-exported: what a recipe receives (and more)

KINDS = ("weights", "harness", "none")  # what a recipe's releases hold; none: it never makes a candidate
SOURCES = ("scores", "feedback")  # scored exchanges (with their token ids), or reports with written feedback


def explicit(settings: Any, key: str) -> bool:
    """Whether ``key`` was set by the user (in the settings ``parse_settings`` read), not left at its default: a
    setting that would be inert is refused when it was set, whatever its value."""
    return key in getattr(settings, "explicit", ())


def set_explicit(settings: Any, keys: Any) -> Any:
    """Mark ``keys`` as the ones the user set (``parse_settings`` does it; a trainer's job carries them across,
    ``TrainJob.explicit``, since its ``settings`` hold every value, defaults included)."""
    settings.__dict__["explicit"] = frozenset(keys)
    return settings


@dataclass
class NoSettings:
    """Settings of a recipe that takes none."""


@dataclass(frozen=True)
class Head:
    """The release a candidate is judged against (the scenario's head when the step started)."""

    release_id: str
    content_id: str
    step: int


@dataclass(frozen=True)
class Scores:
    """The gate's evaluation: one score per task, same tasks for the candidate and the serving head."""

    candidate: list[float]
    base: list[float] | None = None


@dataclass
class TrainJob:
    """One training step, as it crosses to the trainer worker (picklable, no live objects)."""

    id: str
    recipe: str  # the recipe's name as bound: a built-in name or module:Class
    settings: dict[str, Any]  # as parsed by the recipe's Settings (asdict)
    batch: list[ScoredExchange]  # the scored exchanges of the step, as the record store gives them
    base_key: str  # what the step starts from: the head's content id, or the lineage's last candidate
    base_path: str  # its model directory
    head_key: str  # the serving head's content id (the gate compares with it)
    head_path: str
    candidate_key: str  # the key of what this step makes (the next step's base_key if the lineage goes on)
    # the whole model that LoRA adapters apply to: the head's own weights, or the base the head's adapter is on.
    # base_path / head_path may be adapter directories (daemon/lora.py); an adapter candidate names this model.
    model_key: str = ""  # its content id
    model_release: str = ""  # a release holding it
    model_path: str = ""  # its model directory ("": base_path and head_path are whole models)
    device: str = "cpu"  # where to train: the model entry's device (cpu | cuda | auto)
    work_dir: str = ""  # set by the worker: an empty directory to write the candidate into
    head_scores: list[float] | None = None  # the head's evaluation scores, when the daemon knows them
    recipe_paths: list[str] = field(default_factory=list)
    explicit: list[str] = field(default_factory=list)  # the settings the user set (the others are defaults)
    data_parallel: bool = False  # the recipe's ``data_parallel``: the step may run as several workers


@dataclass
class Candidate:
    """What a step made. Weights: ``path`` (a model directory); harness: ``tree`` (path -> bytes)."""

    path: str | None = None
    tree: dict[str, bytes] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    eval: Scores | None = None
    skipped: str | None = None  # why the step had nothing to learn: nothing is published
    consume: bool = True  # whether a skipped step's receipts are consumed (False: they stay eligible)
    details: dict[str, Any] = field(default_factory=dict)  # what the daemon answers about the step (harness)


@dataclass(frozen=True)
class TurnVerdict:
    """A judge's verdict on one turn, from what came next."""

    verdict: str  # good | bad | neutral
    reason: str
    judge: str  # "rules", or the judge model's name
    hint: str | None = None  # what the next state said was wrong (hindsight hints train toward it)
    unparseable: bool = False  # a judge model's answer that did not parse (counted, neutral)
    votes: tuple[str, ...] = ()  # a judge model's votes: each good | bad | neutral | unparseable | failed | timed out


@dataclass
class HeldoutSettings:
    """The held-out check's settings that every recipe's candidates meet (``daemon/gating/heldout.py``): a weights
    candidate's answers against the serving head's, a harness candidate's rules asked of the scenario's model
    against the head's rules (``GateSettings`` holds them; ``lessons`` and ``harness-search`` extend them)."""

    # before a candidate serves, its greedy answers to probes it was never trained on (and, weights, to reserved
    # recorded prompts) are compared with the serving head's; one that stops answering, forgets probe answers
    # beyond the check's noise or (weights) drifts past heldout_max_kl is held. false: every release says "unchecked"
    heldout_check: bool = True
    heldout_probes: list[Any] | None = None  # [{"prompt": text, "accept": [text, ...]}, ...]; None: the shipped set
    heldout_max_degenerate: float = 0.25  # most the share of empty or degenerate answers may rise over the head's
    heldout_probe_z: float = 2.0  # probe accuracy may fall by this many standard errors of the paired difference
    heldout_max_tokens: int = 16  # tokens per probe answer (greedy): enough to tell an answer from none
    heldout_timeout_s: float = 600.0  # past this the check has failed (the step is written down as failed)


@dataclass
class GateSettings(HeldoutSettings):
    """The settings every recipe's gate reads (a recipe's Settings may inherit them)."""

    gate: str = "always"  # always | floor | compare | regression | review
    floor: float = 0.0  # floor: minimum mean evaluation score
    # compare and regression (daemon/gate.py): the error rate they decide on (None: 0.05, gate.ALPHA), and the margin
    # (None: the gate's, gate.MARGIN): compare's least lead in wins - losses on top of the test (0), regression's
    # tolerated drop below the serving head (0.1) that a candidate must be shown not to exceed
    margin: float | None = None
    alpha: float | None = None
    # what the gate and the held-out check pass serves this share of new runs as a canary beside the head; its live
    # scores and guards promote or end it (daemon/canary.py); the next step trains ahead and waits for it. None:
    # CANARY_SHARE (none under gate review: a person decides); 0: published to the head at once (docs/releases.md)
    canary_share: float | None = None
    # a canary with no report on its arm is promoted on its guards after this many answers on its arm
    canary_answers: int = 50
    canary_hours: float = 24.0  # a canary still undecided after this long is promoted (no guard tripped)
    # weights: while a canary serves the lineage's candidate, the steps train on top of it and one candidate waits
    # for its verdict (daemon/lineage.py); false: the steps wait for the verdict before they train
    canary_train_ahead: bool = True
    # the held-out check's settings for weights candidates alone (HeldoutSettings holds the others):
    heldout_share: float = 0.1  # share of the scenario's recorded prompts reserved for the check (never trained on)
    heldout_max_kl: float = 1.0  # nats per token from the base, on the candidate's held-out answers
    # tokens per answer to the reserved recorded prompts (greedy): long enough to see a loop that starts after an
    # opener ("A volcano is ... It erupts when magma erupts. It erupts when magma erupts.")
    heldout_recorded_tokens: int = 48

    def __post_init__(self) -> None:
        if self.canary_share is None:
            self.canary_share = 0.0 if self.gate == "review" else CANARY_SHARE


@dataclass
class SpendSettings:
    """What every weights recipe's settings take about learning spend (``daemon/spend.py``); ``WeightsSettings``
    extends it, so every built-in weights recipe takes it."""

    # trainer hours per UTC day for this scenario; a step that reaches it is cut and written down as failed ("cap
    # reached"), and no step starts until the next UTC day or a higher cap. None: no cap. A positive finite number
    max_trainer_hours: float | None = None


@dataclass
class ProposerSpendSettings:
    """What the harness recipes that ask a model for proposals take about learning spend (``daemon/spend.py``):
    ``lessons`` and ``harness-search`` extend it."""

    # provider tokens (prompt and answer, as the proposer model reports them) per UTC day for this scenario's
    # proposer calls; a call made with the day's tokens spent ends its step as failed ("cap reached"), and no step
    # starts until the next UTC day or a higher cap. None: no cap. A positive whole number
    max_proposer_tokens: int | None = None


@dataclass
class RetentionSettings:
    """What every weights recipe's settings take about keeping weights (``daemon/retention.py``); ``WeightsSettings``
    extends it, so every built-in weights recipe takes it."""

    # the weights of the last keep_releases releases of the chain (the head among them) stay in the store, with those
    # of every release still served or pinned; older ones are pruned and stay listed (docs/releases.md). An integer
    # of at least 1; None (the default): every release's weights are kept, so that any release can be rolled back
    # until the user bounds the store (pruning is opt-in: a pruned release can no longer be rolled back to)
    keep_releases: int | None = None
    # which keep_releases releases keep their weights: "latest" (the newest) or "best" (the head and the others of
    # the highest gate score, eval_reward)
    keep_policy: str = "latest"


# a weights candidate's canary share by default: half, since the paired test decides soonest with equal arms and
# the runs a worse candidate serves before its verdict are about the same at any share (docs/releases.md)
CANARY_SHARE = 0.5


class HarnessContext(typing.Protocol):
    """What the daemon lends a harness recipe's ``edit``: answers from a configured model (``None``: the
    scenario's own), asked with a system prompt and one user message, greedy unless ``temperature`` says otherwise
    (``proposal``: a proposer's call, whose tokens count against ``max_proposer_tokens``). The daemon's context also carries
    ``model`` and ``scenario`` (names), ``config`` (the daemon's ``Config``), ``record(receipt)`` (a stored record)
    and ``episode_release(scenario, tree)`` (a release of ``tree`` on a side scenario's chain, for an episode's
    agent to pin), for recipes that run the agent against the daemon
    (``harness-search``); read them with ``getattr`` (the episode ones: ``isinstance(ctx, EpisodeContext)``), since
    a recipe's own tests may lend less."""

    async def answer(self, model: str | None, system: str, user: str, max_tokens: int,
                     temperature: float = 0.0, *, proposal: bool = False) -> str: ...


@typing.runtime_checkable
class EpisodeContext(HarnessContext, typing.Protocol):
    """The ``HarnessContext`` the daemon lends (``daemon/recipe_context.py``), as a recipe that runs the agent
    against the daemon uses it: a release of a tree on a side scenario's chain for an episode's agent to pin, and a
    scoped token per episode, revoked when the episode ends."""

    async def episode_release(self, name: str, tree: dict[str, bytes]) -> str: ...

    def scoped_token(self, name: str, ttl_s: float) -> str: ...

    def revoke_token(self, token: str) -> None: ...


def off_policy_sampling(record: ScoredExchange | RequestSampling | Mapping[str, Any]) -> str | None:
    """Why a record's answer was not sampled from the distribution its behaviour log-probs describe, or None.

    The engines record each sampled token's log-prob under the raw logits (temperature 1, before top-p / top-k:
    what vLLM and SGLang return too), so an answer sampled at another temperature, or with top-p or top-k
    truncation, came from a distribution those log-probs do not describe, and a recipe's importance ratio on it
    would be wrong. The reason names the setting (``temperature``, ``top_p``, ``top_k``). ``record``: a scored
    exchange, its ``sampling``, or (as before the named types) a mapping with a ``sampling`` mapping."""
    if isinstance(record, ScoredExchange):
        s = record.sampling
    elif isinstance(record, RequestSampling):
        s = record
    else:
        s = RequestSampling.from_mapping(record.get("sampling") or {})
    t, p, k = s.temperature, s.top_p, s.top_k
    if t is not None and t != 1:
        return "temperature"
    if p is not None and p < 1:
        return "top_p"
    if k is not None and k > 0:
        return "top_k"
    return None


class Recipe:
    """Base of every recipe. Subclasses set the class attributes and override what their kind needs."""

    name: ClassVar[str]
    kind: ClassVar[str] = "none"
    Settings: ClassVar[type] = NoSettings
    Report: ClassVar[type | None] = None  # structured report fields (in a report's ``metadata``)
    source: ClassVar[str | None] = None  # which records feed it (SOURCES); None: it never learns
    inline: ClassVar[bool] = False  # step at once, in the report's request, answering the outcome (harness edits)
    judges: ClassVar[bool] = False  # judge each turn by what came next (judge_turn): verdicts are stored as reports
    # its settings' ``tasks`` are episodes of the agent ({id, prompt, check, workspace?}): a recorded run's prompt
    # can be promoted into one (``POST /reef/scenarios/{s}/tasks``)
    episode_tasks: ClassVar[bool] = False
    # trains on the behaviour log-probs recorded at serving time: only records sampled at temperature 1 without
    # top-p / top-k are eligible (``off_policy_sampling``); the scenario's view counts the others and says why
    behaviour_logprobs: ClassVar[bool] = False
    # its gate's ``eval_reward`` scores tasks it never trains on, so the watchdog may read a fall in it against a
    # rising training reward as reward hacking (daemon/watchdog.py); False where the gate scores the very problem
    # trained on (ttt-discover): nothing there is held out
    held_out_eval: ClassVar[bool] = True
    # a weights recipe whose step is correct as data-parallel workers (``recipes/parallel.py``: each worker trains on
    # its share of the batch and the gradients are summed across them): with ``trainer_workers`` its steps run on
    # that many Ray Train workers (``daemon/trainer/ray_parallel.py``); the others run on one worker
    data_parallel: ClassVar[bool] = False

    def __init__(self, settings: Any = None) -> None:
        self.settings = settings if settings is not None else type(self).Settings()

    # --- settings and reports (class level: checked before anything is stored) ----------------------------

    @classmethod
    def parse_settings(cls, raw: dict[str, Any]) -> Any:
        """Typed settings from a mapping; unknown keys or wrong types are a ``BadRequest`` naming them."""
        known = {f.name: f for f in dataclasses.fields(cls.Settings)}
        unknown = sorted(set(raw) - set(known))
        gate = sorted(set(unknown) & {f.name for f in dataclasses.fields(GateSettings)})
        if gate:  # a recipe whose settings do not extend GateSettings: its gate runs at the defaults
            raise BadRequest(f"recipe {cls.name} cannot take {', '.join(gate)}: its Settings do not extend "
                             f"recipes.base.GateSettings, so its gate runs at the defaults (a weights recipe's "
                             f"candidates meet the held-out check on the shipped probe set); extend GateSettings "
                             f"in the recipe to set them", param=f"settings.{gate[0]}")
        if unknown:
            raise BadRequest(f"unknown settings for recipe {cls.name}: {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known)) or 'none'})", param="settings")
        hints = typing.get_type_hints(cls.Settings)
        for key, value in raw.items():
            if not _fits(value, hints.get(key, Any)):
                raise BadRequest(f"recipe {cls.name} setting {key} must be {_type_name(hints[key])}, "
                                 f"not {value!r}", param=f"settings.{key}")
        try:
            settings = cls.Settings(**raw)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"invalid settings for recipe {cls.name}: {e}", param="settings") from None
        set_explicit(settings, raw)  # what the user set, as opposed to a default (``explicit``)
        cls.check_settings(settings)
        from daemon.gating.heldout import check_settings as check_heldout

        check_heldout(settings)  # here, not in check_settings: recipes that override it without super() get it too
        from daemon import spend

        spend.check(settings)  # here too, for the same reason
        check_retention(settings)  # and the retention bound
        return settings

    @classmethod
    def check_settings(cls, settings: Any) -> None:
        """Checks beyond types (a known gate, ranges); raise ``BadRequest``. The default checks ``gate``."""
        gate = getattr(settings, "gate", None)
        if gate is not None:
            from daemon.gate import GATES

            if gate not in GATES:
                raise BadRequest(f"unknown gate {gate!r}; gates: {', '.join(GATES)}", param="settings.gate")
        check_alpha(settings)
        check_canary_share(settings)

    @classmethod
    def check_report(cls, metadata: dict[str, Any] | None) -> None:
        """Validate the structured fields the recipe's ``Report`` declares; a 400 naming the field."""
        if cls.Report is None:
            return
        metadata = metadata or {}
        hints = typing.get_type_hints(cls.Report)
        for f in dataclasses.fields(cls.Report):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if f.name not in metadata:
                if required:
                    raise BadRequest(f"recipe {cls.name} needs metadata.{f.name} in every report "
                                     f"({_type_name(hints[f.name])})", param=f"metadata.{f.name}")
                continue
            if not _fits(metadata[f.name], hints[f.name]):
                raise BadRequest(f"metadata.{f.name} must be {_type_name(hints[f.name])} for recipe {cls.name}, "
                                 f"not {metadata[f.name]!r}", param=f"metadata.{f.name}")

    def status(self, releases: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> dict[str, Any] | None:
        """What the scenario's view (``GET /reef/scenarios/{s}``) shows about this recipe's progress, from the
        chain: its releases and its rejected, skipped or failed steps (each as ``to_dict``, newest first, with
        their ``metrics``). None (the default): nothing to show."""
        return None

    def models_used(self) -> list[str]:
        """Configured model names the settings refer to (a proposer, a judge): the daemon checks they exist."""
        return []

    def planned(self) -> dict[str, int]:
        """What a step will spend at most, said before it starts (on its ``train.start`` event): harness-search's
        episodes (tasks x repeats x sides, within ``max_episodes``). None said: {}."""
        return {}

    # --- the step --------------------------------------------------------------------------------------------

    def eligible(self, record: ScoredExchange | FeedbackReport, *, head: Head, served_step: int | None) -> bool:
        """Whether a record (not yet consumed) may feed a step; ``served_step``: the step of its release."""
        return True

    def batch(self, records: list[Any]) -> list[Any] | None:
        """The next batch from the eligible records (oldest first), or None to wait for more: ``ScoredExchange``
        for a ``scores`` recipe, ``FeedbackReport`` for a ``feedback`` one."""
        return records or None

    def train(self, job: TrainJob, state: dict[str, Any]) -> Candidate:
        """Weights recipes: one training step in the trainer worker; write the candidate into ``job.work_dir``."""
        raise NotImplementedError

    async def edit(self, tree: dict[str, bytes], batch: list[Any], ctx: HarnessContext) -> Candidate:
        """Harness recipes: a new tree from the current one and the batch (in the daemon): ``FeedbackReport``
        for a ``feedback`` recipe, ``ScoredExchange`` for a ``scores`` one."""
        raise NotImplementedError

    def forget(self, ids: set[str], ctx: HarnessContext) -> None:
        """Exchanges were forgotten (``ids``: their receipts and the ids of the reports on them, whose feedback went
        with them): drop what the recipe keeps of them, in memory and in files of its own (harness-search's memory
        of bad runs). The default keeps nothing between steps."""

    async def assess(self, tree: dict[str, bytes], candidate: Candidate, ctx: HarnessContext) -> Candidate:
        """Harness recipes: evaluate a candidate made elsewhere (an agent's proposal, ``daemon/proposals.py``)
        against the serving ``tree`` the way the recipe evaluates its own, so that ``judge`` decides on it as on
        any of its candidates: fill ``candidate.eval`` (and metrics, details). The default evaluates nothing, which
        gates ``always`` and ``review`` need; a gate that needs scores then fails the proposal (written down as
        failed, never as a loss). Raise to say it cannot be evaluated (the same)."""
        return candidate

    async def judge_turn(self, turn: Any, next_state: Any, ctx: HarnessContext) -> TurnVerdict | None:
        """Judging recipes: a verdict on ``turn`` (``daemon/sessions.Turn``) from ``next_state`` (what came after
        it), in the daemon, off the serve path. The loop stores it as a report on the turn's receipt (metadata
        ``source = "judge"``; good scores 1, bad 0, neutral no score); an explicit report takes precedence."""
        raise NotImplementedError

    @property
    def gate(self) -> str:
        return str(getattr(self.settings, "gate", "always"))

    def judge(self, candidate: Candidate, *, best: float | None) -> Verdict:
        """The gate's verdict on a candidate; ``best``: the best evaluation mean published so far (the regression gate
        writes it down; it decides against the serving head, paired)."""
        ev = candidate.eval
        return judge(self.gate, candidate=ev.candidate if ev else None, base=ev.base if ev else None, best=best,
                     floor=float(getattr(self.settings, "floor", 0.0)), margin=getattr(self.settings, "margin", None),
                     alpha=getattr(self.settings, "alpha", None))

    @classmethod
    def check_class(cls) -> None:
        """That a class implements the interface for its kind; raises ``TypeError`` saying what is missing."""
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError("it has no name (a class attribute `name = \"...\"`)")
        if cls.kind not in KINDS:
            raise TypeError(f"kind must be one of {', '.join(KINDS)}, not {cls.kind!r}")
        if not dataclasses.is_dataclass(cls.Settings):
            raise TypeError("Settings must be a dataclass")
        if cls.Report is not None and not dataclasses.is_dataclass(cls.Report):
            raise TypeError("Report must be a dataclass or None")
        if cls.kind != "none" and cls.source not in SOURCES:
            raise TypeError(f"source must be one of {', '.join(SOURCES)} for a {cls.kind} recipe")
        if cls.kind == "weights" and cls.train is Recipe.train:
            raise TypeError("a weights recipe implements train(job, state)")
        if cls.kind == "harness" and cls.edit is Recipe.edit:
            raise TypeError("a harness recipe implements edit(tree, batch, ctx)")
        if cls.judges and cls.judge_turn is Recipe.judge_turn:
            raise TypeError("a judging recipe implements judge_turn(turn, next_state, ctx)")


def _fits(value: Any, hint: Any) -> bool:
    """A JSON value against a settings annotation (bool is not a number; an int is a float)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint) or hint
    return {int: "an integer", float: "a number", str: "text", bool: "true or false", list: "a list",
            dict: "an object"}.get(origin, getattr(origin, "__name__", str(hint)))


def check_retention(settings: Any) -> None:
    """``keep_releases`` (``RetentionSettings``, ``daemon/retention.py``) is None (keep every release's weights) or a
    whole number of at least 1, and ``keep_policy`` latest or best; else a ``BadRequest`` naming the setting: a bound
    below one checkpoint leaves nothing to serve."""
    policy = getattr(settings, "keep_policy", "latest")
    if policy not in ("latest", "best"):
        raise BadRequest(f"keep_policy must be latest or best, not {policy!r}", param="settings.keep_policy")
    keep = getattr(settings, "keep_releases", None)
    if keep is None:
        if policy != "latest":  # which releases a bound keeps, with no bound: it would do nothing
            raise BadRequest(f"keep_policy {policy!r} needs keep_releases (how many releases keep their weights); "
                             "without it every release keeps its weights", param="settings.keep_policy")
        return
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise BadRequest(f"keep_releases must be a whole number of releases of at least 1 (the head's weights are "
                         f"always kept; a bound below one checkpoint keeps nothing to serve), not {keep!r}",
                         param="settings.keep_releases")


def check_canary_share(settings: Any) -> None:
    share = getattr(settings, "canary_share", 0.0) or 0.0
    answers, hours = getattr(settings, "canary_answers", 1), getattr(settings, "canary_hours", 1.0)
    if not 1 <= answers <= 10 ** 9:
        raise BadRequest(f"canary_answers must be a whole number from 1 to 10^9, got {answers}",
                         param="settings.canary_answers")
    if not (math.isfinite(hours) and 0 < hours <= 10 ** 6):
        raise BadRequest(f"canary_hours must be a positive number of hours up to 10^6, got {hours}",
                         param="settings.canary_hours")
    if not 0 <= share < 1:
        raise BadRequest(f"canary_share must be a fraction of new runs in [0, 1), got {share}",
                         param="settings.canary_share")
    if share and getattr(settings, "gate", None) == "review":
        raise BadRequest("canary_share and gate review both decide what the gate passes: pick one",
                         param="settings.canary_share")


def check_alpha(settings: Any, gates: tuple[str, ...] = ("compare", "regression")) -> None:
    """``alpha`` and ``margin`` are read by the comparing gates (``gates``) only: set with another gate they are
    refused, and out of range (``daemon.gate.check``) too."""
    from daemon.gate import check

    gate = getattr(settings, "gate", None)
    if gate in gates:
        check(gate, alpha=getattr(settings, "alpha", None), margin=getattr(settings, "margin", None))
        return
    for key in ("alpha", "margin"):
        if getattr(settings, key, None) is not None:
            raise BadRequest(f"{key} is read by the {' and '.join(gates)} gates; gate {gate!r} does not read it",
                             param=f"settings.{key}")


def check_eval_size(name: str, settings: Any, n: int, what: str) -> None:
    """A comparing gate whose evaluation has ``n`` paired tasks (``what`` names the setting) must be able to
    decide at its error rate: fewer than ``daemon.gate.tasks_needed`` is refused, naming both numbers."""
    from daemon.gate import check, tasks_needed

    gate = getattr(settings, "gate", None)
    if gate not in ("compare", "regression"):
        return
    alpha, margin = check(gate, alpha=getattr(settings, "alpha", None), margin=getattr(settings, "margin", None))
    need = tasks_needed(gate, alpha=alpha, margin=margin)
    if n < need:
        kind = "untied pairs" if gate == "compare" else f"paired tasks to show a drop under margin {margin:g}"
        raise BadRequest(f"recipe {name}: gate {gate} cannot decide at error rate {alpha} on {n} evaluation task(s) "
                         f"({what}): at least {need} {kind} are needed; raise {what}, or state a higher alpha"
                         + (" or margin" if gate == "regression" else ""), param=f"settings.{what}")
