"""The learning loop: eligible records -> trainer -> gate -> release chain, per scenario.

Design choices:
- A scenario whose recipe trains gets one loop task, woken by each report on it. The loop gathers eligible
  records (a scored report, not yet consumed, served by a release at most ``max_staleness`` steps behind the
  head) and, once there are ``batch_prompts * group_size`` of them, sends the oldest as one batch to the trainer
  worker, with the head release as the base.
- Consumption is written down where the outcome is: a published release lists the receipts it consumed in its
  manifest, a rejected candidate in its rejection record. The consumed set is rebuilt from git at start-up, so
  a ``kill -9`` mid-training consumes nothing (nothing was published) and the batch is trained again after the
  restart; nothing is consumed twice.
- Training follows a lineage: each batch continues from the previous candidate while the head is still the
  release that lineage started from (or the one it last published), whatever the gate said; a rejected
  candidate is not lost progress, it is the starting point of the next step. When the head moves for another
  reason (a rollback, another publisher), the lineage restarts from the head; it also does after
  ``restart_after`` rejections in a row: such a lineage has drifted from the release whose answers it trains on
  (measured: one that kept training past a bad step reached a KL of 7-13 nats per token from the head and was
  rejected 200 times running).
- The gate (``daemon/gate.py``) judges the candidate against the serving head on the trainer's evaluation
  scores; a winner is published through the chain's compare-and-swap with the head as expected parent (a head
  that moved meanwhile rejects the candidate, written down) and loaded by the engine; a loser is written down
  with its verdict and reason. Every step is an event on ``/reef/events`` (``train.start``, ``train.step``,
  ``gate``, ``release``).
- Recipe settings come from ``[recipes.<name>]`` in the config over the recipe's defaults and are recorded in
  each release's manifest.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest, HeadMoved
from daemon.gate import judge
from daemon.records import Scenario, new_id

if TYPE_CHECKING:
    from daemon.serving import Reef

log = logging.getLogger("reef.learning")


@dataclass
class LoopSettings:
    """Daemon-side settings of a training recipe (the trainer's own settings travel to the worker as is)."""

    gate: str = "always"  # always | floor | compare | regression | review
    floor: float = 0.0  # gate floor: minimum mean evaluation score
    margin: float = 0.0  # gate compare: wins - losses needed; regression: allowed drop from the best
    eval_family: str | None = None  # task family for the gate's evaluation (recipes/tasks.py)
    eval_n: int = 64  # evaluation tasks
    eval_seed: int = 0
    restart_after: int = 3  # rejections in a row after which training restarts from the head (0: never)
    trainer: dict[str, Any] = field(default_factory=dict)  # OnlineRLSettings fields


def loop_settings(raw: dict[str, Any]) -> LoopSettings:
    from recipes.online_rl import OnlineRLSettings

    own = {f.name for f in fields(LoopSettings)} - {"trainer"}
    trainer_fields = {f.name for f in fields(OnlineRLSettings)}
    unknown = set(raw) - own - trainer_fields
    if unknown:
        raise BadRequest(f"unknown recipe settings: {', '.join(sorted(unknown))}", param="settings")
    trainer = OnlineRLSettings(**{k: v for k, v in raw.items() if k in trainer_fields})
    return LoopSettings(**{k: v for k, v in raw.items() if k in own}, trainer=trainer.to_dict())


class Learner:
    def __init__(self, reef: Reef) -> None:
        self.reef = reef
        self.dir = reef.config.home / "candidates"
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._consumed: dict[str, set[str]] = {}
        # scenario -> (seq of the last report read, its scored exchanges not yet consumed: receipt -> record)
        self._scored: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {}
        self._feedback_seen: dict[str, int] = {}  # scenario -> seq of the last feedback report consumed
        # scenario -> (head release the lineage follows, candidate key, candidate dir)
        self._lineage: dict[str, tuple[str, str, str]] = {}
        self._head_eval: dict[str, tuple[str, list[float]]] = {}  # scenario -> (release, its gate scores)
        self._rejected_run: dict[str, int] = {}  # scenario -> candidates of its lineage rejected in a row
        self.state: dict[str, str] = {}  # scenario -> idle | waiting | training | judging
        self._trainer: Any = None
        self._lessons_locks: dict[str, asyncio.Lock] = {}

    @property
    def trainer(self) -> Any:
        if self._trainer is None:
            from daemon.trainer.worker import TrainerClient

            self._trainer = TrainerClient(threads=self.reef.config.trainer_threads)
        return self._trainer

    @property
    def trainer_pid(self) -> int | None:
        return None if self._trainer is None else self._trainer.pid

    async def start(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)  # candidates of a crashed run: never published, retrained
        self.dir.mkdir(parents=True, exist_ok=True)
        for s in await self.reef.store.list_scenarios():
            if self._trains(s["recipe"]):
                self.notify(s["name"])

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._trainer is not None:
            await asyncio.to_thread(self._trainer.close)

    @staticmethod
    def _trains(recipe: str) -> bool:
        return recipe in ("online-rl", "lessons")

    def settings(self, scenario: Scenario) -> LoopSettings:
        """Recipe defaults < ``[recipes.<name>]`` in the config < the scenario's own settings."""
        return loop_settings({**self.reef.config.recipes.get(scenario.recipe, {}), **scenario.settings})

    def check_settings(self, recipe: str, settings: dict[str, Any]) -> None:
        if recipe == "lessons":
            from recipes.lessons import settings_from

            try:
                lessons = settings_from({**self.reef.config.recipes.get(recipe, {}), **settings})
            except TypeError as e:
                raise BadRequest(f"invalid recipe settings: {e}", param="settings") from None
            if lessons.proposer is not None:
                self.reef.config.model(lessons.proposer)  # an unknown model: 400 naming the configured ones
            return
        if not self._trains(recipe):
            if settings:
                raise BadRequest(f"recipe {recipe!r} takes no settings", param="settings")
            return
        try:
            loop_settings({**self.reef.config.recipes.get(recipe, {}), **settings})
        except TypeError as e:
            raise BadRequest(f"invalid recipe settings: {e}", param="settings") from None

    def notify(self, scenario: str) -> None:
        """A report arrived (or the daemon started): look for a batch."""
        event = self._wake.setdefault(scenario, asyncio.Event())
        event.set()
        if scenario not in self._tasks or self._tasks[scenario].done():
            self._tasks[scenario] = asyncio.ensure_future(self._loop(scenario))

    async def _loop(self, name: str) -> None:
        event = self._wake[name]
        while True:
            await event.wait()
            event.clear()
            try:
                scenario = await self.reef.store.get_scenario(name)
                if not self._trains(scenario.recipe):
                    self.state[name] = "idle"
                    return
                if scenario.recipe == "lessons":
                    await self.lessons(scenario)
                else:
                    while await self._round(scenario):
                        pass
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("learning on %s failed; waiting for the next report", name)
                self.reef.events.publish("train.error", scenario=name)
            self.state[name] = "waiting"

    async def consumed(self, scenario: str) -> set[str]:
        got = self._consumed.get(scenario)
        if got is None:
            store = self.reef.chains.store

            def read() -> set[str]:
                out: set[str] = set()
                for rel in store.history(scenario):
                    out.update(rel.receipts)
                for rej in store.rejections(scenario):
                    out.update(rej.receipts)
                return out

            got = self._consumed[scenario] = await asyncio.to_thread(read)
        return got

    async def _round(self, scenario: Scenario) -> bool:
        """Train on one batch if one is ready; returns whether it did."""
        settings = self.settings(scenario)
        trainer = settings.trainer
        need = trainer["batch_prompts"] * trainer["group_size"]
        chains = self.reef.chains
        head = await chains.head(scenario)
        consumed = await self.consumed(scenario.name)
        # the scored exchanges not yet consumed, oldest score first, kept between rounds: each round reads only
        # the reports that came since the last one (a scenario's whole history would be read every step)
        seen, pool = self._scored.get(scenario.name, (0, {}))
        rows, seen = await self.reef.store.scored_exchanges(scenario.name, after=seen)
        for rec in rows:
            pool.pop(rec["id"], None)  # scored again: its latest score, in the order of that report
            if rec["id"] not in consumed:
                pool[rec["id"]] = rec
        self._scored[scenario.name] = (seen, pool)
        eligible = []
        for rid, rec in list(pool.items()):
            served_by = await chains.release(rec["release_id"]) if rec["release_id"] else None
            if rid in consumed or served_by is None or head.step - served_by.step > trainer["max_staleness"]:
                del pool[rid]  # consumed, or too stale for good: the head's step only grows
                continue
            eligible.append(rec)
        if len(eligible) < need:
            self.state[scenario.name] = "waiting"
            return False
        batch = eligible[:need]
        receipts = [r["id"] for r in batch]
        job_id = new_id("job_")
        ref = await chains.ref(scenario, head)
        lineage = self._lineage.get(scenario.name)
        rejected_run = self._rejected_run.get(scenario.name, 0)
        if (lineage and lineage[0] == head.release_id and Path(lineage[2]).exists()
                and not (settings.restart_after and rejected_run >= settings.restart_after)):
            base_key, base_path = lineage[1], lineage[2]
        else:
            base_key, base_path, rejected_run = head.content_id, str(ref.path), 0
        job = {
            "id": job_id,
            "base_key": base_key,
            "base_path": base_path,
            "head_key": head.content_id,
            "head_path": str(ref.path),
            "candidate_key": f"candidate:{job_id}",
            "out_dir": str(self.dir / job_id),
            "settings": trainer,
            "samples": [
                {"prompt_token_ids": r["prompt_token_ids"], "token_ids": r["token_ids"], "logprobs": r["logprobs"],
                 "reward": r["score"], "group": hashlib.sha1(repr(r["prompt_token_ids"]).encode()).hexdigest()}
                for r in batch
            ],
        }
        if settings.eval_family:
            job["eval"] = {"family": settings.eval_family, "n": settings.eval_n, "seed": settings.eval_seed,
                           "max_new_tokens": trainer["max_new_tokens"]}
            known = self._head_eval.get(scenario.name)
            if known and known[0] == head.release_id:  # the head is a candidate scored when it was judged
                job["eval"]["head_scores"] = known[1]
        self.state[scenario.name] = "training"
        events = self.reef.events
        events.publish("train.start", scenario=scenario.name, job=job_id, base=head.release_id, samples=need,
                       from_head=base_key == head.content_id)
        t0 = time.perf_counter()
        result = await self.trainer.run(job)
        if not result.get("ok"):
            raise RuntimeError(f"trainer failed on {job_id}: {result.get('error')}")
        mean_reward = sum(r["score"] for r in batch) / len(batch)
        metrics = {**{k: v for k, v in result["train_metrics"].items() if isinstance(v, (int, float))},
                   "batch_reward": round(mean_reward, 4), "train_s": result["train_s"]}
        events.publish("train.step", scenario=scenario.name, job=job_id, step=head.step + 1,
                       seconds=round(time.perf_counter() - t0, 3), metrics=metrics)
        self.state[scenario.name] = "judging"
        ev = result.get("eval") or {}
        best = None
        if settings.gate == "regression":  # reads the whole chain: only the gate that needs it pays for it
            best = max((r.metrics.get("eval_reward") for r in await asyncio.to_thread(chains.store.history,
                                                                                       scenario.name)
                        if isinstance(r.metrics.get("eval_reward"), (int, float))), default=None)
        verdict = judge(settings.gate, candidate=ev.get("candidate"), base=ev.get("base"), best=best,
                        floor=settings.floor, margin=settings.margin)
        metrics.update({k: v for k, v in verdict.metrics.items() if v is not None})
        candidate = result["candidate"]
        record = {"settings": {**trainer, "gate": settings.gate}, "metrics": metrics, "receipts": receipts}
        published = None
        reason = verdict.reason
        if verdict.publish:
            try:
                published = await chains.publish_candidate(scenario, candidate, expected_head=head.release_id,
                                                           engine=await self.reef.engine(scenario.model), **record)
            except HeadMoved as e:
                reason = f"the head moved during training (now {e.actual}); not published"
        elif verdict.verdict == "pending":
            await chains.hold(scenario, candidate, base=head.release_id, **record)
        if published is None and verdict.verdict != "pending":
            await chains.reject(scenario, verdict="rejected", reason=reason, base=head.release_id, **record)
        consumed.update(receipts)
        if published is not None and ev.get("candidate"):
            self._head_eval[scenario.name] = (published.release_id, ev["candidate"])
        self._rejected_run[scenario.name] = 0 if published is not None else rejected_run + 1
        follows = published.release_id if published is not None else head.release_id
        self._lineage[scenario.name] = (follows, job["candidate_key"], candidate)
        if lineage and lineage[2] != candidate:
            shutil.rmtree(lineage[2], ignore_errors=True)
        events.publish("gate", scenario=scenario.name, job=job_id, verdict="accepted" if published else
                       verdict.verdict if verdict.verdict == "pending" else "rejected", reason=reason,
                       metrics=metrics, release_id=published.release_id if published else None)
        return True

    # --- harness recipes ---------------------------------------------------------------------------------------

    async def lessons(self, scenario: Scenario) -> dict[str, Any] | None:
        """Turn the scenario's unconsumed written feedback into one harness candidate, gate it, publish it.

        Runs in the daemon (an edit of a few text files takes milliseconds), one round at a time per scenario;
        returns what happened (None when there was nothing to learn). The reports it read are consumed whatever
        the outcome, and listed in the release's or the rejection's manifest."""
        from recipes.lessons import apply, check_tree, lesson_from_report, settings_from

        lock = self._lessons_locks.setdefault(scenario.name, asyncio.Lock())
        async with lock:
            consumed = await self.consumed(scenario.name)
            reports, seen = await self.reef.store.feedback_reports(scenario.name,
                                                                   after=self._feedback_seen.get(scenario.name, 0))
            reports = [r for r in reports if r["id"] not in consumed]
            if not reports:
                self._feedback_seen[scenario.name] = seen
                self.state[scenario.name] = "waiting"
                return None
            settings = settings_from({**self.reef.config.recipes.get("lessons", {}), **scenario.settings})
            lessons = [x for x in map(lesson_from_report, reports) if x is not None]
            if settings.proposer:
                await self._propose(settings.proposer, lessons)
            receipts = [r["id"] for r in reports]
            chains, events = self.reef.chains, self.reef.events
            self.state[scenario.name] = "training"
            events.publish("train.start", scenario=scenario.name, base=None, samples=len(lessons))
            for _attempt in range(3):  # a head that moves meanwhile: redo the (cheap) edit on the new head
                head = await chains.head(scenario)
                tree = await chains.harness_tree(head)
                outcome = apply(tree, lessons, settings)
                metrics = {"lessons": len(lessons), "applied": len(outcome.applied), "refused": len(outcome.refused),
                           "unchanged": len(outcome.unchanged), "tree_files": len(outcome.tree)}
                record = {"settings": {**settings.to_dict()}, "metrics": metrics, "receipts": receipts}
                result: dict[str, Any] = {"scenario": scenario.name, "base": head.release_id,
                                          "applied": outcome.applied, "refused": outcome.refused,
                                          "unchanged": outcome.unchanged, "summary": outcome.summary()}
                if not outcome.changed:
                    await chains.reject(scenario, verdict="rejected", reason=f"no change: {outcome.summary()}",
                                        base=head.release_id, **record)
                    result.update(verdict="unchanged", release_id=None)
                    break
                check_tree(outcome.tree)
                if settings.gate == "compare":
                    verdict = judge("compare", candidate=await self._task_scores(scenario, outcome.tree, settings),
                                    base=await self._task_scores(scenario, tree, settings), best=None,
                                    margin=settings.margin)
                    metrics.update({k: v for k, v in verdict.metrics.items() if v is not None})
                    if not verdict.publish:
                        await chains.reject(scenario, verdict="rejected", reason=verdict.reason,
                                            base=head.release_id, **record)
                        result.update(verdict="rejected", release_id=None, reason=verdict.reason)
                        break
                if settings.gate == "review":
                    rel = await chains.hold(scenario, outcome.tree, base=head.release_id, **record)
                    result.update(verdict="pending", release_id=rel.release_id, step=rel.step)
                    break
                try:
                    rel = await chains.publish_candidate(scenario, outcome.tree, expected_head=head.release_id,
                                                         **record)
                except HeadMoved:
                    continue
                result.update(verdict="accepted", release_id=rel.release_id, step=rel.step)
                break
            else:
                await chains.reject(scenario, verdict="rejected", reason="the head kept moving; not published",
                                    base=head.release_id, **record)
                result.update(verdict="rejected", release_id=None)
            consumed.update(receipts)
            self._feedback_seen[scenario.name] = seen  # read from here on next time (a failed round reads again)
            events.publish("gate", scenario=scenario.name, verdict=result["verdict"], reason=outcome.summary(),
                           metrics=metrics, release_id=result.get("release_id"))
            self.state[scenario.name] = "waiting"
            return result

    async def _task_scores(self, scenario: Scenario, tree: dict[str, bytes], settings: Any) -> list[float]:
        """Each configured task answered by the scenario's model with ``tree``'s rules as the system prompt."""
        from daemon.exchange import Finish
        from recipes.lessons import RULES_FILE, task_score

        engine = await self.reef.engine(scenario.model)
        rules = tree.get(RULES_FILE, b"").decode("utf-8", "replace")
        scores = []
        for task in settings.tasks:
            exchange = internal_exchange(scenario.model, rules, task["prompt"], int(task.get("max_tokens", 32)))
            answer = ""
            async for event in engine.generate(exchange, None):
                if isinstance(event, Finish):
                    answer = event.completion.text
            scores.append(task_score(task, answer))
        return scores

    async def _propose(self, model: str, lessons: list[Any]) -> None:
        """Ask the proposer model to phrase each rule lesson; failures leave the plain, deterministic edit."""
        from daemon.exchange import Finish
        from recipes.lessons import PROPOSER_PROMPT, proposal

        try:
            engine = await self.reef.engine(model)
        except Exception:
            log.exception("proposer model %s is unavailable; making plain edits", model)
            return
        for lesson in lessons:
            if lesson.skill is not None:
                continue
            exchange = internal_exchange(model, PROPOSER_PROMPT, lesson.text, 64)
            try:
                async for event in engine.generate(exchange, None):
                    if isinstance(event, Finish):
                        lesson.proposed = proposal(event.completion.text)
                        lesson.proposer = model
            except Exception:
                log.warning("proposer model %s failed on %s; making a plain edit", model, lesson.id, exc_info=True)


def internal_exchange(model: str, system: str, user: str, max_tokens: int) -> Any:
    """A request the daemon itself makes (a gate's task, a proposer's phrasing): greedy, in OpenAI chat form
    with its body, so any engine (an upstream relaying the body as it is) answers it."""
    from daemon.exchange import Exchange, Message, Part, Sampling

    messages = [Message("system", [Part("text", text=system)])] if system.strip() else []
    messages.append(Message("user", [Part("text", text=user)]))
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": m.role, "content": m.text} for m in messages]}
    return Exchange(format="openai-chat", model=model, messages=messages, body=body,
                    sampling=Sampling(max_tokens=max_tokens, temperature=0.0))
