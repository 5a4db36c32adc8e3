"""``reef eval``: a scenario's release chain measured release by release (``/reef/scenarios/{s}/eval``).

Three figures per release, oldest first, each ``ok`` with a value and where it comes from, ``n/a`` with why it
cannot be had, or ``failed`` with the reason a measurement broke (never a 0 standing in for one):

- **reward** (the learning curve): the scenario's reward on prompts it never trained on.
  - A recipe with a scorer (``eval_family``, ``recipes/tasks.py``): the mean exact score of greedy answers to the
    family's validation prompts (``eval_n``, ``eval_seed``, ``max_new_tokens`` tokens): the very figure the gate
    records as ``eval_reward`` (and a train step's ``base_reward`` for its parent), read from the chain where the
    settings it was made with are today's, measured through the engine where not.
  - A weights recipe without one: the scores users reported on the scenario's reserved recorded prompts (the held-out
    check's share, ``heldout_share``: never trained on) that this release served (``source: reports``). Reef
    cannot score a new answer with a user's own scorer, so this is what the user's scorer said of this release's
    answers to held-out prompts; none reported: n/a.
  - A harness release: its gate's recorded score (``eval_reward``, or its child's ``base_reward``); else n/a.
- **probes** (forgetting): accuracy on the held-out check's probe set (the shipped one or ``heldout_probes``),
  greedy, ``heldout_max_tokens``; recorded at gate time as ``heldout_probe_accuracy`` (and a train step's
  ``heldout_head_probe_accuracy`` for its parent) where the settings match and the check asked every probe (it
  passes a clean candidate on every other one: ``heldout_probes`` says how many), measured where not. ``forgetting`` is
  a release's probe accuracy minus the base's (the chain's first release): below 0, it lost what the base knew. A
  harness release's probes are the scenario's model's answers under the release's rules file (``AGENTS.md`` as the
  system prompt, as agents load it; the held-out check records them at the gate the same way).
- **transfer** (``transfer=OTHER``): on OTHER's reserved recorded prompts (the most recent ``heldout.RECORDED``,
  by OTHER's ``heldout_share``), the share of this release's greedy answers that say something (not empty: the
  held-out check's ``empty``). Not "not degenerate": a small base model's own answers are often loops (the tiny
  model's always are), and a figure the base already scores 0 on cannot show a release that stopped answering.
  OTHER's scorer, where it has one, scores answers made for OTHER, not these: Reef cannot run a user's scorer.

Measuring loads a release beside the serving ones under a key no request names (``eval:<content id>``; the head
already loaded is used as it is), asks all its prompts at once through ``heldout.answers`` and drops it, within
``heldout_timeout_s``. What was measured is cached by content id and exactly what was asked (prompts, tokens,
what is accepted) in ``$REEF_HOME/eval/cache.json``, so a second ``reef eval`` reads it (a rollback's content
was measured already); a failure is not cached, so the next run tries again. The cache holds figures only, no
prompt or answer text.

``POST`` measures (progress as JSON Lines and ``eval`` events); ``GET`` (and the release page) reads only what
is known (recorded at the gate, cached, reported): what needs measuring says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from daemon.errors import BadRequest, NotFound, ReefError
from daemon.gating import heldout
from daemon.layout import rules_of

OK, NA, FAILED = "ok", "n/a", "failed"
SERVES_WEIGHTS = ("weights", "bundle")  # daemon/releases/manifest.py's (not imported: ``reef --help`` reads this module)
FIGURES = ("reward", "probes", "forgetting", "transfer")
MAX_CACHE = 4096  # cached figures kept (the oldest go first)
NOT_MEASURED = "not measured yet (reef eval measures it)"


@dataclass(frozen=True)
class Figure:
    """One cell of the table."""

    status: str  # ok | n/a | failed
    value: float | None = None
    n: int = 0  # prompts, tasks or reports behind the value
    source: str = ""  # gate (recorded at gate time) | measured | cached | reports
    reason: str = ""  # n/a or failed: why

    def to_dict(self) -> dict[str, Any]:
        if self.status == OK:
            assert self.value is not None
            return {"status": OK, "value": round(self.value, 4), "n": self.n, "source": self.source}
        return {"status": self.status, "reason": self.reason}


def ok(value: float, n: int, source: str) -> Figure:
    return Figure(OK, float(value), n, source)


def na(reason: str) -> Figure:
    return Figure(NA, reason=reason)


def failed(reason: str) -> Figure:
    return Figure(FAILED, reason=reason)


def cell(fig: dict[str, Any] | None, *, signed: bool = False) -> str:
    """A figure (``Figure.to_dict``) as the table shows it: the value, ``n/a``, or ``failed: reason``."""
    if not fig:
        return "n/a"
    if fig.get("status") == OK:
        return f"{fig['value']:+.2f}" if signed else f"{fig['value']:.2f}"
    if fig.get("status") == FAILED:
        return f"failed: {fig.get('reason')}"
    return "n/a"


# --- what is asked ------------------------------------------------------------------------------------------------


@dataclass
class Ask:
    """A figure to measure: prompts asked greedily, and the value of the answers."""

    figure: str
    prompts: list[str]
    max_tokens: int
    value: Callable[[list[heldout.Answer]], float]
    what: dict[str, Any]  # what else decides the value (accepted answers, the family): part of the cache key

    def key(self, content_id: str) -> str:
        raw = json.dumps([self.figure, content_id, self.prompts, self.max_tokens, self.what], sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()


@dataclass
class Plan:
    """How each figure is had for this scenario (read once per eval)."""

    settings: dict[str, Any]  # the recipe's settings today (asdict)
    kind: str  # weights | harness | none
    scorer: Ask | None = None  # reward by a scorer (eval_family)
    reward_na: str | None = None
    reported: dict[str, list[float]] | None = None  # reward from reports: release id -> scores on reserved prompts
    probes: Ask | None = None
    probes_na: str | None = None
    transfer: Ask | None = None
    transfer_na: str | None = None
    reward_how: str = ""


SCORER_KEYS = ("eval_family", "eval_n", "eval_seed", "max_new_tokens")
PROBE_KEYS = ("heldout_probes", "heldout_max_tokens")


def _same(recorded: dict[str, Any] | None, today: dict[str, Any], keys: Sequence[str]) -> bool:
    """Whether a release's recorded settings asked what today's settings ask (so its gate figures stand)."""
    if not recorded:
        return False
    return all(recorded.get(k) == today.get(k) for k in keys)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


async def reserved_prompts(store: Any, scenario: str, share: float, n: int = heldout.RECORDED) -> list[str]:
    """The user prompts of the scenario's most recent ``n`` reserved scored exchanges (distinct prompts, oldest
    first): the prompts the held-out check asks, read from the record store (``daemon/learning.py`` keeps them in
    memory for the scenario it trains)."""
    if share <= 0:
        return []
    rows, _ = await store.reports.scored_exchanges(scenario, after=0)
    latest: OrderedDict[str, str] = OrderedDict()
    for r in rows:
        if heldout.reserved(r.prompt_token_ids, share):
            key = ",".join(map(str, r.prompt_token_ids))
            latest.pop(key, None)
            latest[key] = r.id
    out: list[str] = []
    for receipt in reversed(latest.values()):
        if len(out) >= n:
            break
        try:
            text = heldout.user_prompt(await store.exchanges.get(receipt))
        except NotFound:  # forgotten meanwhile
            text = None
        if text and text not in out:
            out.append(text)
    return out[::-1]


async def reported(store: Any, scenario: str, share: float) -> dict[str, list[float]]:
    """Release id -> the latest score reported on each reserved exchange it served."""
    rows, _ = await store.reports.scored_exchanges(scenario, after=0)
    latest: dict[str, tuple[str | None, float]] = {}
    for r in rows:  # in report order: a receipt scored again keeps its latest score
        if heldout.reserved(r.prompt_token_ids, share):
            latest[r.id] = (r.release_id, r.score)
    out: dict[str, list[float]] = {}
    for release_id, score in latest.values():
        if release_id:
            out.setdefault(release_id, []).append(score)
    return out


# --- the cache ----------------------------------------------------------------------------------------------------


class Cache:
    """Measured figures by key (``Ask.key``): a JSON file written whole (temp file, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data: OrderedDict[str, list[Any]] | None = None

    def _load(self) -> OrderedDict[str, list[Any]]:
        if self._data is None:
            try:
                raw = json.loads(self.path.read_text(encoding="utf-8"))
                self._data = OrderedDict((k, v) for k, v in raw.get("figures", {}).items()
                                         if isinstance(v, list) and len(v) == 2)
            except (OSError, ValueError, AttributeError):  # none yet, or unreadable: measured again
                self._data = OrderedDict()
        return self._data

    def get(self, key: str) -> tuple[float, int] | None:
        v = self._load().get(key)
        return (float(v[0]), int(v[1])) if v is not None else None

    def put(self, key: str, value: float, n: int) -> None:
        data = self._load()
        data.pop(key, None)
        data[key] = [value, n]
        while len(data) > MAX_CACHE:
            data.popitem(last=False)

    async def save(self) -> None:
        from daemon.durable import mkdirs, write_atomic

        blob = json.dumps({"version": 1, "figures": self._load()}).encode()

        def write() -> None:
            mkdirs(self.path.parent)
            write_atomic(self.path, blob)

        await asyncio.to_thread(write)


# --- the evaluation -----------------------------------------------------------------------------------------------


Progress = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Evaluations:
    """``reef eval`` for the daemon: what it reads (the store, the chains, the engine, the recipe's settings)."""

    home: Path
    store: Any
    chains: Any
    events: Any
    engine: Callable[[str], Awaitable[Any]]
    make_recipe: Callable[[str, dict[str, Any]], Any]
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cache = Cache(self.home / "eval" / "cache.json")

    async def check(self, name: str, transfer: str | None, last: int | None) -> Any:
        """The scenario (``NotFound``), and the arguments: a transfer scenario that does not exist, or is this one,
        is a ``BadRequest`` naming ``transfer``."""
        scen = await self.store.scenarios.get(name)
        if transfer is not None:
            if transfer == scen.name:
                raise BadRequest("transfer must name another scenario than the one evaluated", param="transfer")
            try:
                await self.store.scenarios.get(transfer)
            except NotFound:
                raise BadRequest(f"no scenario named {transfer!r} to measure transfer on", param="transfer",
                                 scenario=transfer) from None
        if last is not None and last < 1:
            raise BadRequest("last must be at least 1", param="last")
        return scen

    async def evaluate(self, name: str, *, transfer: str | None = None, last: int | None = None,
                       measure: bool = True, progress: Progress | None = None) -> dict[str, Any]:
        """The table (``rows`` oldest first, the last ``last`` releases), measuring what is neither recorded nor
        cached when ``measure``."""
        scen = await self.check(name, transfer, last)
        if not measure:  # reads only: never waits behind a measurement (a release page, the TUI's first look)
            return await self._evaluate(scen, transfer, last, measure, progress)
        lock = self._locks.setdefault(scen.name, asyncio.Lock())
        async with lock:  # one measurement of a scenario at a time: the second reads what the first measured
            return await self._evaluate(scen, transfer, last, measure, progress)

    async def _evaluate(self, scen: Any, transfer: str | None, last: int | None, measure: bool,
                        progress: Progress | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        chain = list(reversed(await self.chains.history(scen.name)))  # oldest first
        if not chain:
            chain = [await self.chains.head(scen)]
        plan = await self._plan(scen, transfer)
        base = chain[0]
        shown = chain[-last:] if last else chain
        todo = [base, *(r for r in shown if r.release_id != base.release_id)]
        counts = {"measured": 0, "cached": 0}
        figures: dict[str, dict[str, Figure]] = {}
        if measure:  # a look (GET, a release page) is no event
            self.events.publish("eval", scenario=scen.name, state="started", releases=len(todo), transfer=transfer)
        for i, rel in enumerate(todo):
            figs, asks = self._known(plan, chain, rel, counts, measure)
            if asks:
                if progress is not None:
                    await progress({"release_id": rel.release_id, "step": rel.step, "done": i, "total": len(todo),
                                    "measuring": [a.figure for a in asks]})
                self.events.publish("eval", scenario=scen.name, state="measuring", release_id=rel.release_id,
                                    step=rel.step, done=i, total=len(todo), figures=[a.figure for a in asks])
                figs.update(await self._measure(scen, rel, asks, plan, counts))
            figures[rel.release_id] = figs
        if counts["measured"]:
            await self.cache.save()
        base_figs = figures[base.release_id]
        head = await self.chains.head_id(scen.name)
        rows = [self._row(r, figures[r.release_id], base_figs, head) for r in shown]
        out = {
            "scenario": scen.name, "recipe": scen.recipe, "kind": plan.kind, "head": head, "transfer": transfer,
            "base": {"release_id": base.release_id, "step": base.step,
                     **{k: v.to_dict() for k, v in base_figs.items()}},
            "reward_how": plan.reward_how,
            "probes_how": (f"{len(plan.probes.prompts)} probes, greedy, {plan.probes.max_tokens} tokens"
                           if plan.probes else plan.probes_na),
            "transfer_how": (f"{len(plan.transfer.prompts)} reserved prompts of {transfer}, the share answered (not empty)"
                             if plan.transfer else plan.transfer_na),
            "rows": rows, "measured": counts["measured"], "cached": counts["cached"],
            "seconds": round(time.perf_counter() - t0, 3),
        }
        if measure:
            self.events.publish("eval", scenario=scen.name, state="done", measured=counts["measured"],
                                cached=counts["cached"], seconds=out["seconds"])
        return out

    async def _plan(self, scen: Any, transfer: str | None) -> Plan:
        recipe = self.make_recipe(scen.recipe, scen.settings)
        s = recipe.settings
        today = asdict(s) if hasattr(s, "__dataclass_fields__") else {}
        plan = Plan(settings=today, kind=recipe.kind)
        check = heldout.CheckSettings.of(s)
        weights = recipe.kind == "weights" or (recipe.kind == "none" and await self._weights_chain(scen))
        plan.kind = "weights" if weights else "harness"
        family = getattr(s, "eval_family", None)
        if weights and family:
            from recipes.tasks import get_family

            fam = get_family(family)
            tasks = fam.validation(int(s.eval_n), seed=int(s.eval_seed))
            plan.scorer = Ask("reward", [t.prompt for t in tasks], int(s.max_new_tokens),
                              lambda answers: _mean([fam.exact(t, a.text) for t, a in zip(tasks, answers,
                                                                                          strict=True)]),
                              {"family": family, "answers": [t.answer for t in tasks]})
            plan.reward_how = (f"the {family} scorer on {len(tasks)} validation prompts (never trained on), greedy, "
                               f"{s.max_new_tokens} tokens: the gate's eval_reward")
        elif weights and recipe.kind == "weights":
            share = check.share if check.on else 0.0
            if share > 0:
                plan.reported = await reported(self.store, scen.name, share)
                plan.reward_how = (f"the scores reported on the reserved recorded prompts (heldout_share {share:g}, "
                                   "never trained on) that each release served")
            else:
                plan.reward_na = "nothing is held out (heldout_check is off), and the recipe has no scorer"
                plan.reward_how = plan.reward_na
        elif weights:
            plan.reward_na = f"recipe {scen.recipe} does not learn: no reward"
            plan.reward_how = plan.reward_na
        else:
            plan.reward_how = "the gate's recorded score (eval_reward) where it has one"
        plan.probes = Ask("probes", [p.prompt for p in check.probes], check.max_tokens,
                          lambda answers: _mean([p.right(a.text) for p, a in zip(check.probes, answers,
                                                                                  strict=True)]),
                          {"accept": [list(p.accept) for p in check.probes],
                           # a harness release's probes: the scenario's model under the release's rules
                           **({} if weights else {"rules_of": scen.model})})
        if transfer is None:
            plan.transfer_na = "no transfer scenario asked (--transfer OTHER)"
        elif not weights:
            plan.transfer_na = "a harness release: transfer asks weights"
        else:
            other = await self.store.scenarios.get(transfer)
            try:
                other_check = heldout.CheckSettings.of(self.make_recipe(other.recipe, other.settings).settings)
            except ReefError as e:
                other_check, plan.transfer_na = None, f"scenario {transfer}'s settings cannot be read: {e.message}"
            if other_check is not None:
                share = other_check.share if other_check.on else 0.0
                prompts = await reserved_prompts(self.store, transfer, share)
                if prompts:
                    plan.transfer = Ask("transfer", prompts, check.max_tokens,
                                        lambda answers: _mean([bool(a.text.strip()) for a in answers]),
                                        {"scenario": transfer})
                else:
                    plan.transfer_na = (f"scenario {transfer} has no reserved recorded prompts yet (its heldout_share "
                                        f"{share:g} of its scored exchanges)")
        return plan

    async def _weights_chain(self, scen: Any) -> bool:
        head = await self.chains.head(scen)
        return head.kind in SERVES_WEIGHTS

    def _known(self, plan: Plan, chain: list[Any], rel: Any, counts: dict[str, int],
               measure: bool) -> tuple[dict[str, Figure], list[Ask]]:
        """The figures of ``rel`` known without the engine, and what is left to measure."""
        figs: dict[str, Figure] = {}
        asks: list[Ask] = []
        child = next((c for c in chain if c.parent == rel.release_id and c.operation == "train"), None)

        def recorded(own: str, from_child: str, keys: Sequence[str], n: int = 0,
                     asked: str | None = None) -> Figure | None:
            """The figure as the gate recorded it: the release's own, or its train child's of its head; made with
            today's settings (``keys``) and, with ``asked``, on all ``n`` of today's prompts (the held-out check
            passes a clean candidate on half its probes: a figure on half is not one on all)."""
            for r, key in ((rel, own), (child, from_child)):
                v = r.metrics.get(key) if r is not None else None
                if (r is not None and isinstance(v, (int, float)) and not isinstance(v, bool)
                        and (not keys or _same(r.settings, plan.settings, keys))
                        and (asked is None or r.metrics.get(asked) == n)):
                    return ok(v, n, "gate")
            return None

        def known(name: str, ask: Ask | None, na_reason: str | None, rec: Figure | None) -> None:
            if ask is None:
                figs[name] = na(na_reason or "n/a")
                return
            if rec is not None:
                figs[ask.figure] = rec
                return
            hit = self.cache.get(ask.key(rel.content_id))
            if hit is not None:
                counts["cached"] += 1
                figs[ask.figure] = ok(hit[0], hit[1], "cached")
            elif measure:
                asks.append(ask)
            else:
                figs[ask.figure] = na(NOT_MEASURED)

        if rel.kind not in SERVES_WEIGHTS:
            figs["reward"] = recorded("eval_reward", "base_reward", ()) or na("no gate score recorded for it")
            figs["transfer"] = na("a harness release: transfer asks weights")
        elif plan.scorer is not None:
            known("reward", plan.scorer, None, recorded("eval_reward", "base_reward", SCORER_KEYS,
                                                                len(plan.scorer.prompts)))
        elif plan.reported is not None:
            scores = plan.reported.get(rel.release_id, [])
            figs["reward"] = (ok(_mean(scores), len(scores), "reports") if scores
                              else na("no reported answer to a reserved prompt was served by it"))
        else:
            figs["reward"] = na(plan.reward_na or "no scorer")
        known("probes", plan.probes, plan.probes_na,
              recorded("heldout_probe_accuracy", "heldout_head_probe_accuracy", PROBE_KEYS,
                       len(plan.probes.prompts) if plan.probes else 0, asked="heldout_probes"))
        if "transfer" not in figs:
            known("transfer", plan.transfer, plan.transfer_na, None)
        return figs, asks

    async def _measure(self, scen: Any, rel: Any, asks: list[Ask], plan: Plan,
                       counts: dict[str, int]) -> dict[str, Figure]:
        """Load ``rel``, ask what ``asks`` ask, drop it: the figures, or each ``failed`` with the reason."""
        from daemon.engines.base import ReleaseRef

        timeout = heldout.CheckSettings.of(self.make_recipe(scen.recipe, scen.settings).settings).timeout_s
        loaded: Any = None
        engine: Any = None
        system = ""  # a harness release: the model itself, its rules file as the system prompt (as agents load it)
        try:
            engine = await self.engine(scen.model)
            if rel.kind not in SERVES_WEIGHTS:
                use, system = None, rules_of(await self.chains.harness_tree(rel))
            elif rel.content_id in engine.resident:
                use = await self.chains.ref(scen, rel)  # loaded already (the head): used as it is, and left loaded
            else:  # under a key no request names, so no request is served from it, and dropped afterwards
                ref = await self.chains.ref(scen, rel)
                key = f"eval:{rel.content_id}"
                use = loaded = ReleaseRef(key, key, ref.path, ref.base)

            async def ask_all() -> dict[tuple[int, str], heldout.Answer]:
                got: dict[tuple[int, str], heldout.Answer] = {}
                for tokens in sorted({a.max_tokens for a in asks}):
                    prompts = list(dict.fromkeys(p for a in asks if a.max_tokens == tokens for p in a.prompts))
                    answers = await heldout.answers(engine, scen.model, prompts, use, tokens, system=system)
                    got.update({(tokens, p): a for p, a in zip(prompts, answers, strict=True)})
                return got

            got = await asyncio.wait_for(ask_all(), timeout)
        except TimeoutError:
            return {a.figure: failed(f"it took longer than heldout_timeout_s {timeout:g}") for a in asks}
        except ReefError as e:
            return {a.figure: failed(e.message) for a in asks}
        except Exception as e:  # noqa: BLE001 - whatever the engine raised: the figure could not be measured
            return {a.figure: failed(f"{type(e).__name__}: {e}") for a in asks}
        finally:
            if loaded is not None and engine is not None:
                try:
                    await engine.unload(loaded)
                except Exception:  # noqa: BLE001 - left loaded: the engine's budget evicts it later
                    pass
        out: dict[str, Figure] = {}
        for a in asks:
            value = a.value([got[(a.max_tokens, p)] for p in a.prompts])
            self.cache.put(a.key(rel.content_id), value, len(a.prompts))
            counts["measured"] += 1
            out[a.figure] = ok(value, len(a.prompts), "measured")
        return out

    @staticmethod
    def _row(rel: Any, figs: dict[str, Figure], base: dict[str, Figure], head: str | None) -> dict[str, Any]:
        probes, base_probes = figs.get("probes"), base.get("probes")
        if probes is not None and base_probes is not None and probes.status == OK and base_probes.status == OK:
            assert probes.value is not None and base_probes.value is not None
            forgetting = ok(probes.value - base_probes.value, probes.n, "against the base")
        elif probes is not None and probes.status == FAILED:
            forgetting = failed(probes.reason)
        elif base_probes is not None and base_probes.status == FAILED:
            forgetting = failed(f"the base's probes: {base_probes.reason}")
        else:
            forgetting = na((probes.reason if probes is not None and probes.status == NA else "")
                            or "the base's probe accuracy is not known")
        return {"release_id": rel.release_id, "step": rel.step, "operation": rel.operation,
                "content_id": rel.content_id, "kind": rel.kind, "created_at": rel.created_at,
                "head": rel.release_id == head,
                **{k: figs[k].to_dict() for k in ("reward", "probes", "transfer")},
                "forgetting": forgetting.to_dict()}
