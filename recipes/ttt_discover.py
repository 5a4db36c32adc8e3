"""TTT-Discover: test-time training on one problem through many scored attempts. The client asks the same problem
again and again and scores every attempt; each step learns from a group of sibling attempts with an entropic
advantage that pushes toward the best of them, and the release that matters is the one whose attempts score best.

Design choices (compact; the numbers are ``TTTSettings`` defaults, measured with ``bench/ttt_discover.py``):

- **Report.** A report's ``score`` is the attempt's score (higher is better; the reward trained on). Its typed
  ``metadata`` (``TTTReport``, checked at ingress: a wrong type is a 400 naming the field) may carry ``group`` (the
  sibling attempts it belongs to: attempts of one round, or of one starting state) and ``attempt_score`` (the
  attempt's score on the problem's own scale when the reward is a transform of it; the best attempt is ranked on
  it, and it defaults to ``score``).
- **Groups.** Siblings are the attempts of one ``group`` when the client names it, otherwise of one prompt (the same
  problem, token for token). A step takes the first ``groups_per_step`` groups that have ``group_size`` attempts;
  attempts served more than ``max_staleness`` releases behind the head are dropped (their policy is gone).
- **Entropic advantage.** As the source computes it by default (test-time-training/discover,
  ``entropic_adaptive_beta``): within a group of k attempts with rewards r, the inverse temperature beta whose tilt
  ``q ~ exp(beta * r)`` is ln 2 from uniform (KL; doubling, then bisection: ``adaptive_beta``), then leave-one-out
  weights ``w_i = e_i / mean_{j != i} e_j`` with ``e = exp(beta * (r - max r))`` and the advantage ``A = w - 1``: the
  best attempt pulled up hardest and, unlike mean baselines (GRPO), an attempt just above the mean but far below the
  best pushed *down*. This is the gradient of the entropic objective ``log E[exp(beta * r)] / beta``, which tends to
  the max as beta grows. Adaptive, it is scale-free: a user's own scorer in any units gets the same advantages,
  with nothing to tune. A group of two reaches ln 2 only at an infinite beta (an unbounded advantage), so its target
  is half. ``adv_temperature = tau`` fixes it instead: ``A = k * softmax(r / tau) - 1`` (zero mean, at most k - 1;
  leave-one-out at a fixed beta is unbounded when one attempt stands far above the rest), tau in reward units. A
  group whose rewards are all equal has no signal and is counted (``degenerate_groups``), not faked.
- **Objective.** online-rl's clipped surrogate on the behaviour log-probs recorded at serving time (the ratio
  corrects for staleness, the clip bounds it), per-token mean, AdamW on all but the tied embeddings, gradient
  clipping; ``steps_per_batch`` optimizer steps per group. Measured on ``longest-word``: at lr 2e-3 with 2 steps a
  group of 8, the demo model collapsed onto its first good answer in 5 steps and never searched again; lr 2e-4, one
  step, groups of 16 and tau 0.05 keep it searching while the mean climbs. LoRA adapters (every real model) move
  less per step: at 2e-4 SmolLM2's mean attempt stayed flat over 12 rounds, at 2e-3 it rose (README), so ``lr``
  unset is 2e-4 for whole weights and 2e-3 for adapters (``learning_rate``).
- **Gate: best so far.** With a scorer, built in (``problem``, ``recipes/tasks.py``) or the user's own (``scorer``:
  a command given each attempt on stdin that prints its score; a scorer that fails, times out or prints no number
  fails the step naming it, and no attempt is scored 0 for it: ``recipes/tasks.py CommandScorer``), the trainer samples
  ``eval_attempts`` attempts from the candidate and from the serving head on the problem's prompt as the client
  asks it (the batch's prompt tokens), at temperature 1 with the same random stream for both (common
  random numbers: a paired comparison), fresh for each step, and scores them. The candidate is turned away only
  when its attempts are shown worse than the head's at error rate ``alpha`` (0.05; the exact sign test on the
  paired attempts; ``daemon/gate.py`` says why this side) and its mean is more than ``margin`` below: a candidate
  as good as the head is turned away at most ``alpha`` of the time. Measured: reusing the head's scores from the
  step it won compared every later candidate with a lucky draw (the winner's curse), and from step 25 of 100
  nearly all were rejected with the head stuck at 0.37; with fresh streams the head climbed to 0.83. So the head
  is the latest release not shown worse than its parent (the best attempt found, whichever release sampled it, is
  in the scenario's status); a rejected candidate leaves the head serving and the lineage goes on from it, back to the head after ``restart_after`` rejections in a row. Without a scorer (the
  client alone can score its problem) a candidate cannot be scored before it serves, so every candidate is
  published and the best attempt stays visible in the scenario's status (serve it again with ``x-reef-release-id``
  or roll back to it).
- **What trains: LoRA on real models**, as online-rl and sao: adapters (``lora_rank`` on the attention and MLP
  projections) for models of ``LORA_AUTO_PARAMS`` parameters or more, all weights below; ``lora`` decides when set.
  A release is then the adapter alone on the whole model (``daemon/lora.py``), a few MB on SmolLM2, and the gate's
  head is that adapter on the same base.
- **Status.** Each step's metrics carry its batch's best attempt (score, receipt, the release that served it);
  ``status`` folds them over the whole chain (releases and rejected steps alike, since a rejected step's attempts
  were real attempts): the best attempt found, by which release, and the number of attempts learned from.
- **State reuse** (the source's PUCT): each step keeps its best ``ARCHIVE_PER_STEP`` attempts as states
  (``archive`` in its metrics, JSON), and the status offers ``next_start``, the state maximising
  ``Q + puct_c * P * sqrt(1 + N) / (1 + n)`` (``next_start``). The client writes the prompt from it and names it in
  its reports (``metadata.start``): that is how visits and children's scores are counted.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from daemon.errors import BadRequest
from daemon.gate import GATES, Verdict, check, judge_best
from recipes.base import Candidate, FeedbackReport, GateSettings, Head, Recipe, ScoredExchange, Scores, TrainJob
from recipes.logprobs import Sample, is_adapter
from recipes.memory import check_budget
from recipes.online_rl import (
    WeightsSettings,
    check_drift_bound,
    check_lora,
    check_pull,
    eos_ids,
    generate,
    kl_from_base,
    load_policy,
    make_optimizer,
    save_adapter_candidate,
    train_step,
)
from recipes.sao import save_weights


@dataclass
class TTTReport:
    """The typed fields of a ttt-discover report's ``metadata`` (all optional)."""

    group: str | None = None  # the sibling attempts this one belongs to (default: its prompt)
    attempt_score: float | None = None  # the attempt's score on the problem's own scale (default: the report's score)
    start: str | None = None  # state reuse: the receipt of the earlier attempt this one started from (next_start)


LR_WHOLE = 2e-4  # all weights (the built-in tiny models), measured on longest-word (module docstring)
LR_LORA = 2e-3  # LoRA adapters: on SmolLM2 through the daemon, 2e-4 left the mean flat over 12 rounds (README)


def learning_rate(settings: TTTSettings, model: Any) -> float:
    """The set ``lr``, or the default for what trains: adapters move less per step than whole weights."""
    if settings.lr is not None:
        return settings.lr
    return LR_LORA if is_adapter(model) else LR_WHOLE


@dataclass
class TTTSettings(GateSettings, WeightsSettings):
    gate: str = "best"  # best (turned away only when shown worse than the head at alpha) | always | review
    # best: a candidate shown worse is still published when its mean is this close (None: 0; set with another gate,
    # refused: only best reads it)
    margin: float | None = None
    adv_temperature: float | None = None  # None: adaptive (the source's); tau in reward units: smaller pushes harder
    group_size: int = 16  # sibling attempts per group (more attempts per step: more search)
    groups_per_step: int = 1  # groups per training step
    # AdamW learning rate; None: LR_WHOLE when training all weights (higher collapsed the demo model onto its first
    # good attempt), LR_LORA with LoRA adapters (every real model: at LR_WHOLE SmolLM2's mean did not move)
    lr: float | None = None
    weight_decay: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    entropy_coef: float = 0.0
    grad_clip: float = 1.0
    steps_per_batch: int = 1
    max_staleness: int = 1  # releases: attempts served by a release older than head - this are not used
    max_new_tokens: int = 8
    train_embeddings: bool = False
    # the held-out check's reserve of recorded prompts (GateSettings): 0 here, since a problem is one prompt asked
    # again and again, and a reserved prompt is never trained on: one in ten problems would never learn at 0.1
    # (SmolLM2's "Say one long word." is one: no step in 15 minutes). The check still runs, on its probe set
    heldout_share: float = 0.0
    problem: str | None = None  # a built-in problem scorer for the gate (recipes/tasks.py PROBLEMS)
    # the user's own scorer for the gate: a command (argv list, or a string split like a shell's) given the attempt
    # on stdin that prints its score; one that fails fails the step (recipes/tasks.py CommandScorer)
    scorer: list[str] | str | None = None
    scorer_timeout_s: float = 30.0
    eval_attempts: int = 32  # attempts the gate samples from the candidate and from the head
    puct_c: float = 1.0  # state reuse: the exploration weight of the PUCT rule that picks the next start
    eval_seed: int = 0
    restart_after: int = 3  # rejections in a row after which training restarts from the head (0: never)
    memory_budget_mb: int = 1024  # memory (MB) one micro-batch may keep besides the model (recipes/memory.py)
    # and online-rl's lora, lora_rank, lora_alpha, kl_coef, max_kl (WeightsSettings)


def group_key(record: ScoredExchange) -> str:
    """The sibling group of an attempt: its report's ``group``, else its prompt (the same problem, same tokens)."""
    group = (record.report.metadata or {}).get("group")
    if isinstance(group, str):
        return "g:" + group
    return "p:" + hashlib.sha1(repr(record.prompt_token_ids).encode()).hexdigest()


KL_TARGET = math.log(2)  # the adaptive tilt's KL from uniform over the group (the source's delta)
BETA_MAX = 1e6


def _tilt_kl(rewards: list[float], beta: float) -> float:
    """KL(q || uniform) of ``q ~ exp(beta * r)`` over one group."""
    top = max(rewards)
    logits = [beta * (r - top) for r in rewards]
    log_z = math.log(sum(math.exp(x) for x in logits))
    return sum(math.exp(x - log_z) * (x - log_z + math.log(len(rewards))) for x in logits)


def adaptive_beta(rewards: list[float]) -> float:
    """The source's adaptive inverse temperature: the ``beta`` whose tilt ``exp(beta * r)`` is ``KL_TARGET`` (ln 2)
    from uniform over the group, by doubling then bisection (``BETA_MAX`` when even that cannot reach it: all
    equal, or tied at the top); scale-free, so no reward unit to tune. A group of two can come only infinitely
    close to ln 2 (its maximum) and its leave-one-out advantage would be unbounded, so its target is half that (the
    source's groups are 64)."""
    if len(rewards) < 2:
        return 0.0
    target = KL_TARGET if len(rewards) > 2 else KL_TARGET / 2
    lo, hi = 0.0, 1.0
    while hi < BETA_MAX and _tilt_kl(rewards, hi) < target:
        lo, hi = hi, hi * 2
    if _tilt_kl(rewards, hi) < target:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _tilt_kl(rewards, mid) < target else (lo, mid)
    return hi


def entropic_advantages(rewards: list[float], tau: float | None) -> list[float]:
    """The entropic advantage over one group, the best attempt highest and one above the mean but far below the
    best pushed down (see the module doc). Adaptive (``tau`` None), as the source computes it: leave-one-out,
    ``w_i = e_i / mean_{j != i} e_j - 1`` with ``e = exp(beta * (r - max r))`` at ``adaptive_beta``. A fixed
    ``tau``: ``n * softmax(r / tau) - 1`` (zero mean, at most ``n - 1``; leave-one-out at a fixed beta is unbounded
    when one attempt stands far above the rest, as ``exp(-beta * gap)`` goes to 0)."""
    k = len(rewards)
    if k < 2:
        return [0.0] * k
    top = max(rewards)
    if tau is not None:
        e = [math.exp((r - top) / tau) for r in rewards]  # shifted by the max: no overflow for small tau
        total = sum(e)
        return [k * x / total - 1 for x in e]
    beta = adaptive_beta(rewards)
    e = [math.exp(beta * (r - top)) for r in rewards]
    total = sum(e)
    return [x / ((total - x) / (k - 1) + 1e-12) - 1 for x in e]


def attempt_score(record: ScoredExchange) -> float:
    value = (record.report.metadata or {}).get("attempt_score")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else record.score


ARCHIVE_PER_STEP = 4  # a step's best attempts kept as states to start from (state reuse)
MAX_STATE_CHARS = 1000  # of an attempt's text kept in the archive


def start_of(record: ScoredExchange) -> str | None:
    start = (record.report.metadata or {}).get("start")
    return start if isinstance(start, str) else None


def archive_entries(batch: list[ScoredExchange], scores: list[float], tokenizer: Any) -> str:
    """A step's contribution to the archive of states (JSON text: a release's metrics hold scalars): its best
    ``ARCHIVE_PER_STEP`` attempts (receipt, score, text) and every attempt's start, so that the archive's visit
    counts and children's scores add up over steps."""
    best = sorted(range(len(batch)), key=lambda i: -scores[i])[:ARCHIVE_PER_STEP]
    states = [{"receipt": batch[i].id, "score": scores[i],
               "text": tokenizer.decode(batch[i].token_ids, skip_special_tokens=True)[:MAX_STATE_CHARS]}
              for i in best]
    children = [{"start": start, "score": scores[i]} for i, r in enumerate(batch) if (start := start_of(r))]
    return json.dumps({"states": states, "children": children}, separators=(",", ":"))


def next_start(steps: list[dict[str, Any]], c: float) -> dict[str, Any] | None:
    """State reuse as the source's PUCT: over the archive of states (the best attempts of every step), the one
    maximising ``Q(s) + c * P(s) * sqrt(1 + N) / (1 + n(s))``, where ``Q(s)`` is the best score among the attempts
    started from ``s`` (its own score before any), ``P(s)`` a prior by rank (the best state the most), ``n(s)`` the
    attempts started from it and ``N`` all attempts started from a state. None while the archive is empty."""
    states: dict[str, dict[str, Any]] = {}
    visits: Counter[str] = Counter()
    best_child: dict[str, float] = {}
    for step in steps:
        raw = (step.get("metrics") or {}).get("archive")
        if not isinstance(raw, str):
            continue
        try:
            part = json.loads(raw)
        except ValueError:
            continue
        for st in part.get("states", []):
            states.setdefault(st["receipt"], st)
        for ch in part.get("children", []):
            visits[ch["start"]] += 1
            best_child[ch["start"]] = max(best_child.get(ch["start"], -math.inf), ch["score"])
    if not states:
        return None
    ranked = sorted(states.values(), key=lambda st: -st["score"])
    weights = [len(ranked) - i for i in range(len(ranked))]
    total = sum(weights)
    n_all = sum(visits.values())

    def puct(i: int) -> float:
        st = ranked[i]
        q: float = max(st["score"], best_child.get(st["receipt"], -math.inf))
        return q + c * weights[i] / total * math.sqrt(1 + n_all) / (1 + visits[st["receipt"]])

    pick = max(range(len(ranked)), key=puct)
    return {**ranked[pick], "visits": visits[ranked[pick]["receipt"]], "puct": round(puct(pick), 6),
            "archive_size": len(ranked)}


class TTTDiscover(Recipe):
    """``ttt-discover``: one problem, many attempts; entropic advantage over groups of sibling attempts; the head
    stays on the release whose attempts score best."""

    name = "ttt-discover"
    kind = "weights"
    source = "scores"
    behaviour_logprobs = True
    held_out_eval = False  # the gate samples the problem trained on: the watchdog reads no reward hacking into it
    Settings = TTTSettings
    Report = TTTReport

    @classmethod
    def check_settings(cls, settings: Any) -> None:
        if settings.gate != "best" and settings.gate not in GATES:
            raise BadRequest(f"unknown gate {settings.gate!r}; gates: best, {', '.join(GATES)}",
                             param="settings.gate")
        if settings.gate in ("floor", "compare", "regression"):
            raise BadRequest(f"recipe ttt-discover judges with gate best, always or review, not {settings.gate!r}",
                             param="settings.gate")
        for key in ("alpha", "margin"):  # read by gate best only: set with another, they would do nothing
            if getattr(settings, key) is not None and settings.gate != "best":
                raise BadRequest(f"recipe ttt-discover's gate {settings.gate} does not read {key} (gate best does)",
                                 param=f"settings.{key}")
        check("best", alpha=settings.alpha, margin=settings.margin)  # the range of alpha, as every gate's
        if not settings.puct_c >= 0:
            raise BadRequest("recipe ttt-discover setting puct_c must be at least 0", param="settings.puct_c")
        if settings.lr is not None and not settings.lr > 0:
            raise BadRequest("recipe ttt-discover setting lr must be positive", param="settings.lr")
        if settings.scorer is None and settings.scorer_timeout_s != TTTSettings.scorer_timeout_s:
            raise BadRequest("recipe ttt-discover setting scorer_timeout_s is read only with a scorer command",
                             param="settings.scorer_timeout_s")
        if settings.margin is not None and not settings.margin >= 0:
            raise BadRequest(f"margin (gate best's tolerated drop, in the problem's score units) must be at least 0, "
                             f"got {settings.margin}", param="settings.margin")
        if settings.problem is not None:
            from recipes.tasks import get_problem

            try:
                get_problem(settings.problem)
            except ValueError as e:
                raise BadRequest(str(e), param="settings.problem") from None
        if settings.scorer is not None:
            import shutil

            if settings.problem is not None:
                raise BadRequest("recipe ttt-discover: set problem (a built-in scorer) or scorer (your command), not "
                                 "both", param="settings.scorer")
            argv = scorer_argv(settings)
            if not argv or not all(isinstance(a, str) and a for a in argv):
                raise BadRequest("recipe ttt-discover setting scorer must be a command: a list of non-empty strings "
                                 "or a string", param="settings.scorer")
            if shutil.which(argv[0]) is None:
                raise BadRequest(f"recipe ttt-discover setting scorer: {argv[0]} not found (an executable on PATH or "
                                 "a path)", param="settings.scorer")
            if not settings.scorer_timeout_s > 0:
                raise BadRequest("recipe ttt-discover setting scorer_timeout_s must be positive",
                                 param="settings.scorer_timeout_s")
        if settings.adv_temperature is not None and not settings.adv_temperature > 0:
            raise BadRequest("recipe ttt-discover setting adv_temperature must be above 0 (or unset: adaptive)",
                             param="settings.adv_temperature")
        for key in ("group_size", "groups_per_step", "steps_per_batch", "eval_attempts", "max_new_tokens"):
            if getattr(settings, key) < 1:
                raise BadRequest(f"recipe ttt-discover setting {key} must be at least 1", param=f"settings.{key}")
        check_budget(cls.name, settings.memory_budget_mb)
        check_lora(cls.name, settings)
        check_pull(cls.name, settings)
        if settings.group_size < 2:
            raise BadRequest("recipe ttt-discover setting group_size must be at least 2 (siblings to compare)",
                             param="settings.group_size")

    def eligible(self, record: ScoredExchange | FeedbackReport, *, head: Head, served_step: int | None) -> bool:
        return served_step is not None and head.step - served_step <= self.settings.max_staleness

    def batch(self, records: list[ScoredExchange]) -> list[ScoredExchange] | None:
        groups: dict[str, list[ScoredExchange]] = {}
        for r in records:
            groups.setdefault(group_key(r), []).append(r)
        full = [g[: self.settings.group_size] for g in groups.values() if len(g) >= self.settings.group_size]
        if len(full) < self.settings.groups_per_step:
            return None
        return [r for g in full[: self.settings.groups_per_step] for r in g]

    def judge(self, candidate: Candidate, *, best: float | None) -> Verdict:
        s: TTTSettings = self.settings
        if s.gate == "always":
            return Verdict(True, "accepted", "gate always", {})
        if s.gate == "review":
            return Verdict(False, "pending", "held for review: reef releases promote ID publishes it", {})
        ev = candidate.eval
        if ev is None or not ev.candidate or not ev.base:
            return Verdict(True, "accepted", "gate best: no problem scorer, so every candidate serves (the best "
                           "attempt is in the scenario's status)", {})
        return judge_best(ev.candidate, ev.base, margin=0.0 if s.margin is None else s.margin, alpha=s.alpha)

    def status(self, releases: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> dict[str, Any] | None:
        best: dict[str, Any] | None = None
        attempts = 0
        for step in [*releases, *rejected]:
            m = step.get("metrics") or {}
            attempts += int(m.get("samples") or 0)
            score = m.get("batch_best")
            if isinstance(score, (int, float)) and (best is None or score > best["best_attempt"]):
                best = {"best_attempt": score, "best_attempt_receipt": m.get("batch_best_receipt"),
                        "best_attempt_release": m.get("batch_best_release"), "best_attempt_step": step.get("step")}
        head = releases[0] if releases else {}
        out: dict[str, Any] = {"attempts_learned_from": attempts, "head_step": head.get("step")}
        if best is not None:
            out.update(best)
        if isinstance((head.get("metrics") or {}).get("eval_reward"), (int, float)):
            out["head_attempt_score"] = head["metrics"]["eval_reward"]
        start = next_start([*releases, *rejected], self.settings.puct_c)
        if start is not None:
            out["next_start"] = start
        return out

    def train(self, job: TrainJob, state: dict[str, Any]) -> Candidate:
        from transformers import AutoTokenizer

        s: TTTSettings = self.settings
        t0 = time.perf_counter()
        if state.get("key") != job.base_key:
            state.clear()
            state["tokenizer"] = AutoTokenizer.from_pretrained(job.model_path or job.base_path)
            # a whole model, or LoRA on it (a release that is an adapter goes on training that adapter)
            model = load_policy(job.base_path, job.model_path or None, s, trainable=True, device=job.device)
            # online-rl's optimizer and step on TTTSettings, which has what they read but is not OnlineRLSettings
            # (a project typing gap: their settings would need a Protocol of a dozen fields)
            state.update(model=model, optimizer=make_optimizer(model, replace(s, lr=learning_rate(s, model))),  # type: ignore[arg-type]
                         key=job.base_key)
        model, tokenizer = state["model"], state["tokenizer"]
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(job.batch):
            groups.setdefault(group_key(r), []).append(i)
        adv = [0.0] * len(job.batch)
        degenerate = 0
        for members in groups.values():
            rewards = [job.batch[i].score for i in members]
            if max(rewards) == min(rewards):
                degenerate += 1
                continue
            for i, a in zip(members, entropic_advantages(rewards, s.adv_temperature), strict=True):
                adv[i] = a
        samples = [Sample(prompt_token_ids=r.prompt_token_ids, token_ids=r.token_ids, logprobs=r.logprobs,
                          reward=r.score, group=group_key(r)) for r in job.batch]
        scores = [attempt_score(r) for r in job.batch]
        top = max(range(len(scores)), key=scores.__getitem__)
        found = {"batch_best": scores[top], "batch_mean": sum(scores) / len(scores),
                 "batch_best_receipt": job.batch[top].id, "batch_best_release": job.batch[top].release_id,
                 "archive": archive_entries(job.batch, scores, tokenizer)}
        judged = s.gate == "best" and (s.problem is not None or s.scorer is not None)
        prompt = Counter(tuple(r.prompt_token_ids) for r in job.batch).most_common(1)[0][0]
        base_scores, eval_s = None, 0.0
        # fresh common random numbers for each comparison: reusing the head's own scores from when it won would
        # compare every candidate with a lucky draw (the winner's curse) and reject them all
        seed = (s.eval_seed * 1_000_003 + zlib.crc32(job.id.encode())) % 2**63
        if judged:  # the head's attempts, before this step trains the model in memory (which may be the head)
            t_eval = time.perf_counter()
            head = model if job.head_key == state["key"] else load_policy(
                job.head_path, job.model_path or None, s, trainable=False, device=job.device)
            base_scores = attempt_scores(head, tokenizer, list(prompt), s, seed)
            eval_s = time.perf_counter() - t_eval
        metrics: dict[str, Any] = train_step(model, samples, s, state["optimizer"], adv=(adv, degenerate))  # type: ignore[arg-type]
        model.eval()
        metrics.update(found)
        if is_adapter(model) and not metrics.get("skipped"):  # how far the policy moved from its base (watchdog)
            metrics["kl_from_base"] = round(kl_from_base(model, samples), 6)
        check_drift_bound(model, s)
        if metrics.get("skipped"):
            metrics["train_s"] = round(time.perf_counter() - t0, 3)
            return Candidate(metrics=metrics, skipped="no signal: every group's attempts scored alike")
        t_save = time.perf_counter()
        out = Path(job.work_dir)
        if is_adapter(model):  # the adapter alone, naming the whole model it applies to
            metrics["adapter_bytes"] = save_adapter_candidate(model, out, job)
        else:
            save_weights(model, out, Path(job.model_path or job.base_path),  # tokenizer files: never an adapter dir
                         frozen_embeddings=not s.train_embeddings)
        state["key"] = job.candidate_key
        metrics["save_s"] = round(time.perf_counter() - t_save, 3)
        ev = None
        if judged:
            t_eval = time.perf_counter()
            cand_scores = attempt_scores(model, tokenizer, list(prompt), s, seed)
            ev = Scores(candidate=cand_scores, base=base_scores)
            metrics.update(eval_s=round(eval_s + time.perf_counter() - t_eval, 3), eval_best=max(cand_scores))
        metrics["train_s"] = round(time.perf_counter() - t0, 3)
        return Candidate(path=str(out), metrics=metrics, eval=ev)


def scorer_argv(settings: TTTSettings) -> list[str]:
    """The ``scorer`` setting as an argv list (a string is split as a shell would, without running one)."""
    import shlex

    if isinstance(settings.scorer, str):
        try:
            return shlex.split(settings.scorer)
        except ValueError as e:
            raise BadRequest(f"recipe ttt-discover setting scorer: {e}", param="settings.scorer") from None
    return list(settings.scorer or [])


def attempt_scores(model: Any, tokenizer: Any, prompt: list[int], settings: TTTSettings, seed: int) -> list[float]:
    """The problem's scores of ``eval_attempts`` attempts sampled from ``model`` with the random stream ``seed``
    (by the built-in ``problem``, or the user's ``scorer`` command; one that fails raises, failing the step)."""
    from recipes.tasks import CommandScorer, Problem, get_problem

    problem: Problem
    if settings.scorer is not None:
        problem = CommandScorer(scorer_argv(settings), settings.scorer_timeout_s)
    else:
        assert settings.problem is not None
        problem = get_problem(settings.problem)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    outs = generate(model, [prompt] * settings.eval_attempts, eos=eos_ids(model, tokenizer),
                    max_new_tokens=settings.max_new_tokens, temperature=1.0, generator=gen)
    return [problem.score(tokenizer.decode(ids, skip_special_tokens=True)) for ids, _ in outs]
