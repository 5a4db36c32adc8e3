"""The learning loop: one generic path over the recipe interface (``recipes/base.py``), per scenario:

    eligible records -> batch -> candidate -> gate -> publish | hold for review | reject (written down)

Design choices:
- Each scenario whose recipe learns gets one ``ScenarioLearning`` (its recipe instance, cursor, pool, lineage,
  state) and one loop task, woken by each report on it. Nothing here names a recipe: what a recipe reads
  (``source``), which records are eligible, how they batch, how a candidate is made and judged is the recipe's.
- A scenario's recipe binding never changes, its settings can (a task promoted from a run, ``POST
  /reef/scenarios/{s}/tasks``): each step reads them from the store, and a recipe whose settings changed takes
  the new ones and keeps its memory, so a change made on another daemon sharing the store reaches the trainer too.
- Reads are incremental (``daemon/learning_reads.py``): each round reads only the records that came since the
  last one (a cursor per scenario) into a pool of unconsumed ones, kept between rounds (a receipt scored again
  moves to the back with its new score; a consumed or no longer eligible one leaves the pool).
- Consumption is written down where the outcome is: a published release lists the receipts it consumed in its
  manifest, a rejected, skipped or failed step in its rejection record. The consumed set is rebuilt from git at
  start-up, so a ``kill -9`` mid-step consumes nothing and the batch is learned from again after the restart.
- Weights: the step runs in the trainer worker (``daemon/trainer/``). Training follows a lineage
  (``daemon/lineage.py``): each batch continues from the previous candidate while the head is still the release
  that lineage follows; it restarts from the head when the head moves for another reason, after a candidate held
  for harm, and after the recipe's ``restart_after`` rejections in a row (measured: a lineage that kept training
  past a bad step reached a KL of 7-13 nats per token from the head and was rejected 200 times running). While a
  canary serves the lineage's candidate, the steps train ahead of it and one candidate waits for its verdict.
- Harness: the recipe edits the tree in the daemon; ``inline`` recipes step inside the report's own request and
  answer its outcome. A head that moves meanwhile makes the (cheap) edit again on the new head, up to 3 times.
- The gate is the recipe's ``judge``; a winner is published by compare-and-swap with the head as expected parent
  (a head that moved meanwhile rejects a weights candidate, written down) and preloaded by the engine. A
  candidate whose content equals its parent's is not a release: that step is written down as skipped, as is one
  the recipe skipped (nothing to learn). A step that raises is written down as failed with the exception's
  message; serving goes on. Every step is an event on ``/reef/events`` (``train.start``, ``train.step``,
  ``gate``, ``release``).
- Several daemons on one shared record store (PostgreSQL): only the holder of the training lease
  (``daemon/learning_lease.py``, renewed every third of ``lease_ttl_s``) steps; while it holds it, it also looks for
  work every renewal, since reports may have reached another daemon. A step claims its batch's receipts in the
  store (exactly once across daemons) and settles them once its outcome is written down; the consumed set is
  git's and the store's together. A daemon that takes the lease over gives back the claims of the previous
  holder whose outcome was never written down (a ``kill -9`` mid-step), so that batch is learned from again.
  A store only this daemon uses (SQLite) needs no lease: the code path is the same with the lease left out.
- Spend (``daemon/spend.py``): a weights step's trainer time is in its manifest's metrics whatever its outcome; a
  scenario's ``max_trainer_hours`` cuts a step that reaches it (failed, "cap reached") and holds its steps
  (state ``capped``) until the next UTC day, when a timer looks for a batch again, or until its settings change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon import learning_reads, learning_spend, lineage, spend, turn_judging
from daemon.chains import Chains
from daemon.config import Config
from daemon.engines.base import Engine
from daemon.errors import Conflict, HeadMoved, LeaseLost, ReefError
from daemon.events import EventBus
from daemon.gating.heldout import RECORDED, Answer, KeptAnswers
from daemon.gating.outcome import GateRun, StepOutcome
from daemon.gating.steps import prefetch_head
from daemon.gating.steps import run as run_gate
from daemon.gating.warning import batch_figures
from daemon.layout import check_tree
from daemon.learning_lease import LeaseKeeper
from daemon.learning_storage import StorageGuard
from daemon.metrics import Metrics
from daemon.recipe_context import RecipeContext
from daemon.records import FeedbackReport, Lease, RecordStore, Scenario, ScoredExchange, new_id
from daemon.releases import Manifest, Release, requires
from daemon.scopes import Scopes
from daemon.sessions import SessionIndex
from recipes import load_recipe
from recipes.base import Candidate, Recipe, TrainJob

log = logging.getLogger("reef.learning")



@dataclass
class ScenarioLearning:
    """Everything the loop keeps about one scenario."""

    name: str
    recipe: Recipe | None = None  # loaded on first use
    settings: dict[str, Any] | None = None  # the scenario's settings the recipe was made with (they can change)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task[None] | None = None
    # idle | waiting | training | judging | paused | warned | canary (a canary runs: no step, or one trained ahead
    # waits for its verdict) | capped (its
    # trainer-time cap reached today: daemon/spend.py) | storage (the disk short of a step's need: learning_storage.py)
    state: str = "idle"
    consumed: set[str] | None = None  # receipts listed in a release or a rejection (read from git once)
    cursor: int = 0  # seq of the last report read
    # unconsumed records read so far, oldest first, by receipt (scored exchanges) or report id (feedback reports)
    pool: dict[str, ScoredExchange | FeedbackReport] = field(default_factory=dict)
    lineage: tuple[str, str, str] | None = None  # (head release it follows, candidate key, candidate dir)
    # the canary the gate started of the lineage's candidate (release, content, dir), the canary the step under way
    # trains ahead of, and the candidate trained ahead that waits for its verdict (a GateRun; daemon/lineage.py)
    canary_of: tuple[str, str, str] | None = None
    ahead: tuple[str, str, str] | None = None
    waiting: GateRun | None = None
    head_eval: tuple[str, list[float]] | None = None  # (release, its gate scores), when the loop knows them
    rejected_run: int = 0  # candidates of the lineage rejected in a row
    base: tuple[str, str] | None = None  # what the current weights step starts from (None: the head)
    sessions: SessionIndex = field(default_factory=SessionIndex)  # judging recipes: which turn a request continues
    judged: OrderedDict[str, None] = field(default_factory=OrderedDict)  # turns already judged (bounded)
    verdicts: Counter[str] = field(default_factory=Counter)  # judge verdicts so far (good, bad, neutral, unparseable)
    # the held-out check (daemon/gating/heldout.py): the reserved recorded prompts, by prompt, most recent last
    # (receipt, its user prompt once read), and the head's answers kept for the next check against that head
    reserved: OrderedDict[str, tuple[str, str | None]] = field(default_factory=OrderedDict)
    heldout_head: KeptAnswers = field(default_factory=KeptAnswers)  # the head's and the first release's
    first_release: Release | None = None  # the chain's first release (the held-out check's base for the probes)
    heldout_prefetch: asyncio.Future[float] | None = None  # the head's answers, asked while the trainer trains
    spend: spend.Spend | None = None  # trainer time and released rewards (daemon/spend.py), as the chain says
    spend_gen: int = 0  # counts the steps that made ``spend`` out of date (a read begun before one is not kept)
    trainer_s: float = 0.0  # the trainer seconds of the step under way
    proposer_tokens: int = 0  # the provider tokens of the step's proposer calls (a harness step's)
    capped_wake: asyncio.TimerHandle | None = None  # looks for a batch again when a capped day ends


class Learner:
    """Runs the learning loop of every scenario. Gets what it uses, not the daemon: the config, the record
    store, the release chains, the event bus, the metrics (a judge's verdict is a report), and a way to get a
    model's engine."""

    def __init__(self, config: Config, store: RecordStore, chains: Chains, events: EventBus, metrics: Metrics,
                 engine: Callable[[str], Awaitable[Engine]], *, scopes: Scopes | None = None) -> None:
        self.config, self.store, self.chains, self.events, self.engine = config, store, chains, events, engine
        self.metrics = metrics
        self.scopes = scopes if scopes is not None else Scopes()  # the scoped tokens episodes get
        # starts a canary of a held candidate (``daemon/canary.py``; set by the daemon): for recipes whose
        # ``canary_share`` sends what the gate passes through a canary instead of straight to the head
        self.start_canary: Callable[[Scenario, dict[str, Any]], Awaitable[Any]] | None = None
        # whether a scenario has a canary running: its weights steps wait for the verdict (set by the daemon)
        self.canary_running: Callable[[str], bool] | None = None
        self.dir = config.home / "candidates"
        self.storage = StorageGuard(config.home, config.storage_reserve_mb, config.storage_check_s, self.notify)
        self._scenarios: dict[str, ScenarioLearning] = {}
        self._trainer: Any = None
        self._judging: set[asyncio.Task[None]] = set()
        # proposals received and not yet decided, by scenario and id (GET /reef/scenarios/{s}/proposals: pending)
        self._undecided: dict[str, dict[str, tuple[Any, str | None]]] = {}
        # the training lease of a shared store (daemon/learning_lease.py): only its holder steps
        self.lease = LeaseKeeper(store.training, config.lease_ttl_s, took_over=self._took_over,
                                 look_for_work=self._notify_learning)

    @property
    def trainer(self) -> Any:
        if self._trainer is None:
            from daemon.trainer.worker import TrainerClient

            # trainer = "ray": the worker is a Ray driver and the steps run on the cluster (daemon/trainer/ray_trainer.py)
            ray = (self.config.ray_address, self.config.trainer_workers) if self.config.trainer == "ray" else None
            self._trainer = TrainerClient(threads=self.config.trainer_threads,
                                          recipe_paths=[str(p) for p in self.config.recipe_paths], ray=ray)
        return self._trainer

    @property
    def trainer_pid(self) -> int | None:
        return None if self._trainer is None else self._trainer.pid

    @property
    def state(self) -> dict[str, str]:
        return {name: st.state for name, st in self._scenarios.items()}

    async def start(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)  # candidates of a crashed run: never published, retrained
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.store.shared:
            self.lease.start()
        await self._notify_learning(log_errors=True)

    async def _notify_learning(self, *, log_errors: bool = False) -> None:
        for s in await self.store.scenarios.all():
            try:
                if load_recipe(s.recipe).source is not None:
                    self.notify(s.name)
            except ReefError as e:  # a recipe that no longer loads: that scenario serves, and says why
                if log_errors:
                    log.error("scenario %s does not learn: %s", s.name, e.message)

    # --- the training lease (shared stores: daemon/learning_lease.py) -------------------------------------

    async def _took_over(self, lease: Lease) -> None:
        """This daemon just became the trainer: forget what it read under no lease, and give back the claims of
        earlier holders whose outcome was never written down (their step died with them)."""
        for st in self._scenarios.values():
            st.consumed, st.cursor, st.spend = None, 0, None
            st.pool.clear()
        for s in await self.store.scenarios.all():
            back = await self.store.training.recover_claims(s.name, lease, await self.chains.consumed(s.name))
            if back:
                log.info("scenario %s: %d receipts claimed by the previous trainer come back to learn from",
                         s.name, len(back))

    async def close(self) -> None:
        await self.lease.stop()
        self.storage.close()
        for st in self._scenarios.values():
            if st.capped_wake is not None:
                st.capped_wake.cancel()
        tasks = [st.task for st in self._scenarios.values() if st.task is not None] + list(self._judging)
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._trainer is not None:
            await asyncio.to_thread(self._trainer.close)
        await self.lease.release()

    # --- recipes and settings ------------------------------------------------------------------------------

    def make_recipe(self, recipe: str, settings: dict[str, Any] | None = None) -> Recipe:
        """The recipe instance a scenario's step uses: defaults < ``[recipes.<name>]`` < the scenario's
        settings. Raises ``BadRequest`` (the recipe cannot load, refuses the settings, names an unknown model)."""
        cls = load_recipe(recipe)
        merged = {**self.config.recipes.get(recipe, {}), **(settings or {})}
        # every recipe's candidates say what they need to run: the scenario's, not the recipe's, setting
        requires.parse_all(merged.pop("requires", None), param="settings.requires")
        made = cls(cls.parse_settings(merged))
        for model in made.models_used():
            self.config.model(model)  # an unknown model: 400 naming the configured ones
        return made

    def check_settings(self, recipe: str, settings: dict[str, Any]) -> None:
        self.make_recipe(recipe, settings)

    async def _get(self, name: str) -> ScenarioLearning:
        st = self._scenarios.setdefault(name, ScenarioLearning(name))
        if st.recipe is None:
            scenario = await self.store.scenarios.get(name)
            st.recipe = self.make_recipe(scenario.recipe, scenario.settings)
            st.settings = scenario.settings
        return st

    def _follow_settings(self, st: ScenarioLearning, scenario: Scenario) -> None:
        """The scenario's settings changed since its recipe was made (a task promoted, here or on another daemon
        sharing the store): the recipe takes the new ones and keeps what it holds in memory."""
        if st.recipe is not None and scenario.settings != st.settings:
            st.recipe.settings = self.make_recipe(scenario.recipe, scenario.settings).settings
        st.settings = scenario.settings

    async def inline(self, name: str) -> bool:
        """Whether reports on this scenario are learned from inside the report's request."""
        try:
            recipe = (await self._get(name)).recipe
        except ReefError:  # a recipe that no longer loads: the report is stored, the loop says why
            return False
        return recipe is not None and recipe.inline

    async def check_report(self, name: str, metadata: dict[str, Any] | None) -> None:
        """A report on this scenario against its recipe's report schema (a 400 naming the field)."""
        try:
            recipe = (await self._get(name)).recipe
        except ReefError:  # unknown scenario (the store says so next) or a recipe that no longer loads
            return
        if recipe is not None:
            type(recipe).check_report(metadata)

    @contextlib.asynccontextmanager
    async def no_step(self, name: str) -> AsyncIterator[None]:
        """Hold off this scenario's steps while the body runs (archiving it); a step already under way is a
        ``Conflict`` naming it, never waited for."""
        st = self._scenarios.setdefault(name, ScenarioLearning(name))
        if st.lock.locked():
            head = await self.chains.head(await self.store.scenarios.get(name))
            raise Conflict(f"scenario {name!r} has a training step under way (step {head.step + 1}); try again "
                           "when it ends (reef releases list --all shows it)", scenario=name, step=head.step + 1)
        async with st.lock:
            yield

    async def forget(self, name: str, ids: set[str]) -> None:
        """Records of this scenario were forgotten (``ids``: exchange receipts and report ids): drop what is held of
        them in memory and read the store again (it no longer gives their bodies); the recipe drops what it keeps
        of them (``Recipe.forget``). A step already under way finishes with the batch it took."""
        st = self._scenarios.get(name)
        if st is not None:
            st.pool.clear()
            st.cursor = 0
        try:
            st = await self._get(name)
            if st.recipe is not None:
                st.recipe.forget(ids, self._context(await self.store.scenarios.get(name)))
        except ReefError as e:  # a recipe that no longer loads keeps nothing in memory; its files stay as they are
            log.warning("scenario %s: the recipe could not drop forgotten records: %s", name, e.message)

    def notify(self, name: str) -> None:
        """A report arrived (or the daemon started): look for a batch."""
        st = self._scenarios.setdefault(name, ScenarioLearning(name))
        st.wake.set()
        if st.task is None or st.task.done():
            st.task = asyncio.ensure_future(self._loop(name))

    def canary_ended(self, name: str, promoted: bool, head: str | None = None) -> None:
        """A scenario's canary ended: learning goes on, from the promoted canary (the new head, ``head``), or, when
        it was ended, from the head: the lineage that led to a candidate live traffic turned away is not continued
        (``daemon/lineage.py``)."""
        st = self._scenarios.get(name)
        if st is not None:
            lineage.canary_ended(st, promoted, head)
        self.notify(name)

    async def _loop(self, name: str) -> None:
        try:
            st = await self._get(name)
        except ReefError as e:
            log.error("scenario %s does not learn: %s", name, e.message)
            return
        assert st.recipe is not None
        if st.recipe.source is None:
            return
        while True:
            await st.wake.wait()
            st.wake.clear()
            try:
                while (outcome := await self.step(name)) is not None and outcome.consumed:
                    pass  # a step that consumed nothing (skipped, the recipe keeps its receipts) waits for news
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("learning on %s failed; waiting for the next report", name)
                self.events.publish("train.error", scenario=name, error=f"{type(e).__name__}: {e}")
            if st.state not in ("paused", "warned", "canary", "capped", "storage"):
                st.state = "waiting"

    # --- judging turns by what came next (daemon/turn_judging.py) -----------------------------------------

    def observe(self, scenario: str, receipt: str, run: str | None, headers: Mapping[str, str], messages: Any,
                completion: Any) -> None:
        """A served exchange was recorded: for a judging recipe, judge the turn it continues (in the background,
        never on the serve path)."""
        turn_judging.observe(self, scenario, receipt, run, headers, messages, completion)

    def known(self, name: str) -> ScenarioLearning | None:
        return self._scenarios.get(name)

    async def learning(self, name: str) -> ScenarioLearning:
        return await self._get(name)

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task that ``close`` cancels (a judge's verdict, a proposal judged later)."""
        task = asyncio.ensure_future(work)
        self._judging.add(task)
        task.add_done_callback(self._judging.discard)

    # --- one step ------------------------------------------------------------------------------------------

    async def step(self, name: str) -> StepOutcome | None:
        """Learn from one batch if one is ready: what happened (None when there was nothing to learn from)."""
        st = await self._get(name)
        recipe = st.recipe
        if recipe is None or recipe.source is None:
            return None
        async with st.lock:
            lease = self.lease.held()
            if self.store.shared and lease is None:
                st.state = "waiting"  # another daemon trains (or none: the lease is being renewed or taken)
                return None
            scenario = await self.store.scenarios.get(name)
            if scenario.paused or scenario.archived:  # its reports wait; resuming looks for a batch again
                st.state = "paused"
                return StepOutcome("paused", summary=f"scenario {name} is paused: reef scenarios resume {name}")
            if scenario.warned:  # the early warning stands (daemon/gating/warning.py): its reports wait for the user
                st.state = "warned"
                return StepOutcome("paused", summary=str((scenario.warning or {}).get("reason")))
            self._follow_settings(st, scenario)
            ahead, resumed = None, None  # the canary this step trains ahead of; a candidate that trained ahead
            if recipe.kind == "weights" and self.canary_running is not None and self.canary_running(name):
                if (ahead := lineage.ahead_of(st, shared=self.store.shared)) is None:
                    st.state = "canary"  # its reports wait; the canary's end (canary_ended) looks for a batch again
                    return None
            elif recipe.kind == "weights":
                resumed, st.waiting = st.waiting, None  # its canary's verdict is in: judged now (daemon/lineage.py)
            if resumed is None and recipe.kind != "none" and (capped := await learning_spend.capped(self, st)):
                return capped
            head = await self.chains.head(scenario)
            consumed = await learning_reads.consumed(self, st)
            batch = [] if resumed else recipe.batch(await learning_reads.eligible(self, st, scenario, head)) or []
            if resumed is None and not batch:
                st.state = "canary" if ahead else "waiting"
                return None
            if resumed is None and recipe.kind == "weights" and (short := await self.storage.short(self, st, scenario)):
                return short  # the disk is short of the step's need: it waits for space (learning_storage.py)
            receipts = resumed.receipts if resumed else [r.id for r in batch]
            if lease is not None:
                try:
                    claimed = await self.store.training.claim(name, receipts, lease)
                except LeaseLost:
                    self.lease.lost()
                    st.state = "waiting"
                    return None
                if len(claimed) != len(receipts):  # consumed elsewhere meanwhile: out of the pool, batch again
                    taken = set(receipts) - set(claimed)
                    consumed.update(taken)
                    await self.store.training.release_claims(name, claimed, lease)
                    st.state = "waiting"
                    return StepOutcome("skipped", scenario=name, consumed=len(taken))
            job_id = resumed.job_id if resumed else new_id("job_")
            record_settings = {"recipe": scenario.recipe, **dataclasses.asdict(recipe.settings)}
            st.state = "judging" if resumed else "training"
            extra: dict[str, Any] = {}
            if recipe.kind == "weights" and resumed is None:
                st.base = lineage.base(st, head)
                extra["from_head"] = st.base is None
                if ahead is not None:
                    extra["ahead_of"] = ahead[0]
            if resumed is None:
                self.events.publish("train.start", scenario=name, job=job_id, base=head.release_id,
                                    samples=len(batch), **extra, **recipe.planned())
            t0 = time.perf_counter()
            st.trainer_s, st.proposer_tokens, st.ahead = 0.0, 0, ahead
            outcome = StepOutcome("failed", scenario=name, base=head.release_id, job=job_id)
            try:
                try:
                    for _attempt in range(3):
                        try:
                            made = await (run_gate(self, resumed) if resumed else self._make_and_judge(
                                st, scenario, head, batch, job_id, record_settings, t0))
                            outcome = dataclasses.replace(made, scenario=name, base=head.release_id, job=job_id)
                            break
                        except HeadMoved:  # only harness edits get here: redo the (cheap) edit on the new head
                            head = await self.chains.head(scenario)
                            outcome.base = head.release_id
                    else:
                        await self.write_down(self.chains.manifest(scenario, receipts=receipts,
                                                                    settings=record_settings),
                                               head, "rejected", "the head kept moving; not published")
                        outcome.verdict, outcome.reason = "rejected", "the head kept moving; not published"
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except Exception as e:  # the recipe (or its worker step) raised: written down, serving goes on
                    reason = f"step failed: {e.message if isinstance(e, ReefError) else f'{type(e).__name__}: {e}'}"
                    log.warning("learning on %s: %s", name, reason, exc_info=not isinstance(e, ReefError))
                    spent = {k: v for k, v in ((spend.KEY, round(st.trainer_s, 3)),
                                               (spend.TOKENS, st.proposer_tokens)) if v} or None
                    await self.write_down(self.chains.manifest(scenario, metrics=spent, receipts=receipts,
                                                                settings=record_settings), head, "failed", reason)
                    outcome.verdict, outcome.reason = "failed", reason
            except Exception:
                # not even the failure could be written down (the chain remote refuses every push, say): nothing was
                # consumed, so this lease's claims go back and the batch is learned from once the remote answers
                # (kept, they would block this holder's own next claim of the same receipts for good)
                if lease is not None:
                    with contextlib.suppress(ReefError):
                        await self.store.training.release_claims(name, receipts, lease)
                raise
            finally:
                st.ahead = None
            if outcome.summary is None:
                outcome.summary = (outcome.details["summary"] if "summary" in outcome.details
                                   else outcome.reason or outcome.verdict)
            if st.trainer_s or st.proposer_tokens:  # written down on the chain (its manifest's metrics): read again
                st.spend, st.spend_gen = None, st.spend_gen + 1
            kept = outcome.kept if outcome.kept is not None else receipts
            consumed.update(kept)
            outcome.consumed = len(kept)
            if resumed is not None and not kept:  # discarded: its batches are eligible again, look at once
                st.wake.set()
            if lease is not None:
                try:
                    await self.store.training.settle(name, kept, lease, outcome.release_id or outcome.verdict)
                    await self.store.training.release_claims(name, [r for r in receipts if r not in set(kept)], lease)
                except ReefError as e:  # the outcome is in git; a takeover settles these claims from there
                    log.warning("learning on %s: could not settle the step's claims: %s", name, e.message)
            self.events.publish("gate", scenario=name, job=job_id, verdict=outcome.verdict, reason=outcome.reason,
                                metrics=outcome.metrics or {}, release_id=outcome.release_id)
            st.state = "canary" if outcome.verdict == "ahead" else "waiting"
            return outcome

    # --- an agent's proposal ------------------------------------------------------------------------------

    def undecided(self, name: str) -> list[tuple[Any, str | None]]:
        """The proposals of ``name`` received and not yet decided (queued or being judged), with their receipts."""
        return list(self._undecided.get(name, {}).values())

    async def propose(self, name: str, proposal: Any, receipt: str | None, *, at_door: bool = True) -> StepOutcome:
        """An agent's proposal (``daemon/proposals.py``) through the screens and the scenario's gate, under the
        lock a step holds: published, held, or written down (rejected: screened out, or turned away by the gate;
        failed: it could not be evaluated), with the proposal as the manifest's ``origin``. ``at_door``: what the
        route refuses (archived, paused, a target missing or present) is raised with nothing written; else (judged
        in the background) it is written down as failed. Until then it is ``undecided``."""
        waiting = self._undecided.setdefault(name, {})
        waiting[proposal.id] = (proposal, receipt)
        try:
            return await self._propose(name, proposal, receipt, at_door=at_door)
        finally:
            waiting.pop(proposal.id, None)

    async def _propose(self, name: str, proposal: Any, receipt: str | None, *, at_door: bool) -> StepOutcome:
        from daemon import proposals

        st = await self._get(name)
        recipe = st.recipe
        assert recipe is not None
        async with st.lock:
            scenario = await self.store.scenarios.get(name)
            self._follow_settings(st, scenario)
            head = await self.chains.head(scenario)
            tree = await self.chains.harness_tree(head)
            record_settings = {"recipe": scenario.recipe, **dataclasses.asdict(recipe.settings)}
            job_id = new_id("job_")
            try:
                proposals.check_open(scenario)
                mutation = proposals.mutation(tree, proposal)
            except ReefError as e:
                if at_door:
                    raise
                origin = proposals.origin(proposal, None, receipt)
                await self.write_down(self.chains.manifest(scenario, settings=record_settings, origin=origin), head,
                                       "failed", f"the proposal could not be judged: {e.message}")
                outcome = StepOutcome("failed", reason=f"the proposal could not be judged: {e.message}")
                return self._proposed(name, head, job_id, outcome, proposal)
            origin = proposals.origin(proposal, mutation, receipt)
            self.events.publish("train.start", scenario=name, job=job_id, base=head.release_id, samples=0,
                                proposal=proposal.id)
            st.state = "judging"
            t0 = time.perf_counter()
            try:
                try:
                    candidate = proposals.candidate(tree, mutation, proposals.limits_of(recipe))
                except proposals.Screened as e:
                    reason = f"screened out by the {e.screen} screen: {e.reason}"
                    metrics = {"proposal": 1, "screen": e.screen}
                    await self.write_down(self.chains.manifest(scenario, metrics=metrics, settings=record_settings,
                                                                origin=origin), head, "rejected", reason)
                    outcome = StepOutcome("rejected", reason=reason, metrics=metrics, details={"screen": e.screen})
                else:
                    refused = None
                    if candidate.tree == tree:  # e.g. a replace with the same text: nothing to judge
                        candidate.skipped = "the candidate's content equals its parent's"
                    else:
                        refused = await self._policy(recipe, scenario, head, tree, candidate, [], record_settings,
                                                     origin)
                        if refused is None:
                            review = candidate.details.get("review")
                            candidate = await recipe.assess(tree, candidate, self._context(scenario))
                            if review:  # whatever the recipe's assessment kept of the details
                                candidate.details["review"] = review
                    outcome = refused or await self._gate(st, scenario, head, candidate, [], job_id, record_settings,
                                                          t0, origin)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as e:  # it could not be evaluated: written down as failed, never as a loss
                why = e.message if isinstance(e, ReefError) else f"{type(e).__name__}: {e}"
                if isinstance(e, HeadMoved):
                    why = f"the head moved while it was judged (now {e.actual}); propose again"
                reason = f"the proposal could not be evaluated: {why}"
                log.warning("proposal %s on %s: %s", proposal.id, name, reason, exc_info=not isinstance(e, ReefError))
                await self.write_down(self.chains.manifest(scenario, settings=record_settings, origin=origin), head,
                                       "failed", reason)
                outcome = StepOutcome("failed", reason=reason)
            finally:
                st.state = "waiting"
            return self._proposed(name, head, job_id, outcome, proposal)

    def _proposed(self, name: str, head: Any, job_id: str, outcome: StepOutcome, proposal: Any) -> StepOutcome:
        outcome = dataclasses.replace(outcome, scenario=name, base=head.release_id, job=job_id)
        if outcome.summary is None:
            said = [x for x in (outcome.details.get("summary"), outcome.reason) if x]
            outcome.summary = ": ".join(said) or outcome.verdict
        self.events.publish("gate", scenario=name, job=job_id, verdict=outcome.verdict, reason=outcome.reason,
                            metrics=outcome.metrics or {}, release_id=outcome.release_id, proposal=proposal.id)
        return outcome

    def propose_later(self, name: str, proposal: Any, receipt: str | None) -> None:
        """Judge a proposal in the background (a recipe that runs episodes); its verdict goes on the chain."""
        async def judge() -> None:
            try:
                await self.propose(name, proposal, receipt, at_door=False)
            except Exception as e:  # not even the failure could be written down: the log says so
                why = e.message if isinstance(e, ReefError) else f"{type(e).__name__}: {e}"
                log.error("proposal %s on %s could not be judged or written down: %s", proposal.id, name, why)
            finally:
                self._undecided.get(name, {}).pop(proposal.id, None)

        self._undecided.setdefault(name, {})[proposal.id] = (proposal, receipt)  # pending from the 202 on
        self.background(judge())

    def _context(self, scenario: Scenario, **spend_kw: Any) -> RecipeContext:
        return RecipeContext(self.engine, scenario.model, scenario=scenario.name, config=self.config,
                             store=self.store, chains=self.chains, scopes=self.scopes, **spend_kw)

    async def _make_and_judge(self, st: ScenarioLearning, scenario: Scenario, head: Any,
                              batch: list[ScoredExchange | FeedbackReport], job_id: str,
                              record_settings: dict[str, Any], t0: float) -> StepOutcome:
        recipe = st.recipe
        assert recipe is not None
        if recipe.kind == "weights":
            candidate = await self._train(st, scenario, head, batch, job_id)
            if candidate.path is not None and candidate.skipped is None:  # a cut-off file is a failed step
                from daemon.model_dirs import check_weights_files

                await asyncio.to_thread(check_weights_files, Path(candidate.path))
        else:
            tree = await self.chains.harness_tree(head)

            def spent(tokens: int) -> None:
                st.proposer_tokens += tokens

            candidate = await recipe.edit(tree, batch, self._context(
                scenario, tokens_left=await learning_spend.tokens_left(self, st), spent=spent))
            if st.proposer_tokens and isinstance(candidate, Candidate):
                candidate.metrics[spend.TOKENS] = st.proposer_tokens
            if not isinstance(candidate, Candidate):
                raise TypeError(f"recipe {scenario.recipe}: edit() returned {type(candidate).__name__}, "
                                "not a Candidate")
            if candidate.tree is not None and candidate.skipped is None:
                check_tree(candidate.tree)  # whatever recipe made it: only the harness layout, text, size caps
                if candidate.tree == tree:
                    candidate.skipped = "the candidate's content equals its parent's"
                else:
                    refused = await self._policy(recipe, scenario, head, tree, candidate, [r.id for r in batch],
                                                 record_settings, None)
                    if refused is not None:
                        return refused
        return await self._gate(st, scenario, head, candidate, batch, job_id, record_settings, t0)

    async def _policy(self, recipe: Recipe, scenario: Scenario, head: Any, tree: dict[str, bytes], candidate: Candidate,
                      receipts: list[str], record_settings: dict[str, Any],
                      origin: dict[str, Any] | None) -> StepOutcome | None:
        """The harness policy (``daemon/harness_policy.py``) over what a harness candidate adds or changes, whatever
        made it (feedback, a proposer model, an agent's proposal): what it refuses is written down as rejected by the
        ``rights`` screen (the step's receipts consumed: the same feedback is not tried again); what only a person may
        admit goes into ``details["review"]``, and ``_gate`` holds such a candidate for review."""
        from daemon import harness_policy

        assert candidate.tree is not None
        allow = bool(getattr(recipe.settings, "allow_executable", False))
        found = harness_policy.findings(candidate.tree, tree, allow_executable=allow)
        bad = harness_policy.refused(found)
        if bad:
            screen = "executable" if bad[0].rule == "executable" else "rights"
            reason = f"screened out by the {screen} screen: {bad[0]}" + (
                f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            metrics = {**({"proposal": 1} if origin else {}), "screen": screen}
            await self.write_down(self.chains.manifest(scenario, metrics=metrics, receipts=receipts,
                                                        settings=record_settings, origin=origin),
                                   head, "rejected", reason)
            return StepOutcome("rejected", reason=reason, metrics=metrics,
                               details={"screen": screen, "policy": [f.to_dict() for f in bad]})
        review = [str(f) for f in harness_policy.held(found)]
        if review:
            candidate.details["review"] = sorted(set(candidate.details.get("review") or []) | set(review))
        return None

    async def _gate(self, st: ScenarioLearning, scenario: Scenario, head: Any, candidate: Candidate,
                    batch: list[ScoredExchange | FeedbackReport], job_id: str, record_settings: dict[str, Any],
                    t0: float, origin: dict[str, Any] | None = None) -> StepOutcome:
        """A made candidate through the gate's steps (``daemon/gating``): published, held, or written down
        (skipped, rejected) with the batch's receipts; ``origin``: an agent's proposal that made it (on every
        outcome's manifest)."""
        recipe = st.recipe
        assert recipe is not None
        scored = [r for r in batch if isinstance(r, ScoredExchange)]
        metrics = {**{k: v for k, v in candidate.metrics.items() if isinstance(v, (int, float, str, bool))},
                   **(batch_figures(scored) if scored and len(scored) == len(batch) else {})}
        if recipe.judges:
            metrics.update({f"judge_{k}": v for k, v in st.verdicts.items()})
        self.events.publish("train.step", scenario=scenario.name, job=job_id, step=head.step + 1,
                            seconds=round(time.perf_counter() - t0, 3), metrics=metrics)
        return await run_gate(self, GateRun(st, scenario, head, candidate, [r.id for r in batch], job_id,
                                            record_settings, metrics, origin, ahead=st.ahead))

    async def set_warning(self, name: str, warning: dict[str, Any] | None) -> Scenario:
        """Write a scenario's early-warning state (``daemon/gating/warning.py``)."""
        return await self.store.scenarios.set_warning(name, warning)

    # --- what the held-out check reads (daemon/gating/heldout.py) ------------------------------------------

    async def heldout_prompts(self, st: ScenarioLearning) -> list[str]:
        """The user prompts of the scenario's most recent reserved recorded prompts (at most ``RECORDED``)."""
        from daemon.gating.heldout import user_prompt

        out: list[str] = []
        for key, (receipt, text) in reversed(list(st.reserved.items())):
            if len(out) >= RECORDED:
                break
            if text is None:
                try:
                    text = user_prompt(await self.store.exchanges.get(receipt)) or ""
                except ReefError:  # forgotten meanwhile: no longer a prompt to ask
                    text = ""
                if key in st.reserved:
                    st.reserved[key] = (receipt, text)
            if text:
                out.append(text)
        return out[::-1]

    def heldout_head(self, st: ScenarioLearning, key: tuple[Any, ...],
                     answers: dict[str, Answer] | None = None) -> dict[str, Answer] | None:
        return st.heldout_head(key, answers)

    async def write_down(self, manifest: Manifest, head: Any, verdict: str, reason: str) -> None:
        await self.chains.reject(manifest, verdict=verdict, reason=reason, base=head.release_id)

    def follow(self, st: ScenarioLearning, follows: str, candidate: Candidate, job_id: str, *,
               published: bool, restart: bool = False) -> None:
        lineage.follow(st, follows, candidate, job_id, published=published, restart=restart)

    async def _train(self, st: ScenarioLearning, scenario: Scenario, head: Any, batch: list[Any],
                     job_id: str) -> Candidate:
        assert st.recipe is not None
        ref = await self.chains.ref(scenario, head)
        base_key, base_path = st.base or (head.content_id, str(ref.path))
        model = ref.base or ref  # the whole model: the head, or the base its adapter applies to
        known = st.head_eval
        job = TrainJob(
            id=job_id, recipe=scenario.recipe, settings=dataclasses.asdict(st.recipe.settings), batch=batch,
            explicit=sorted(getattr(st.recipe.settings, "explicit", ())),
            base_key=base_key, base_path=base_path, head_key=head.content_id, head_path=str(ref.path),
            candidate_key=f"candidate:{job_id}", model_key=model.content_id, model_release=model.release_id,
            model_path=str(model.path), device=self.config.model(scenario.model).device,
            head_scores=known[1] if known and known[0] == head.release_id else None,
            recipe_paths=[str(p) for p in self.config.recipe_paths],
            data_parallel=st.recipe.data_parallel,
        )
        st.heldout_prefetch = asyncio.ensure_future(prefetch_head(self, st, scenario, head))  # the check's head
        spent = await learning_spend.spend(self, st)
        left = spent.remaining(st.recipe.settings, time.time())
        limit = None if left is None else (max(left, 0.0), learning_spend.cap_message(st, spent))
        try:
            candidate: Candidate = await self.trainer.run(job, self.dir / job_id, limit)
        finally:
            st.trainer_s = self.trainer.seconds.pop(job_id, 0.0)
        candidate.metrics[spend.KEY] = round(st.trainer_s, 3)
        return candidate
