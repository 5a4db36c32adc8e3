"""``openclaw-rl``: learning from ordinary use. Nobody files a report: each assistant turn is judged by what came
next (the user's next message, or the tool results after it), and the verdicts train the weights.

Design choices:

- **Sessions and next states** are the daemon's (``daemon/sessions.py``): a request that continues an earlier
  turn (its messages start with that turn's request and answer) judges it by what follows; a request in the same
  session that asks the last user message again is a retry of that turn.
- **Judges.** ``judge = "<model>"`` names any configured model (the served one, another local one, an upstream
  provider); it is asked with ``JUDGE_PROMPT`` (below, fixed) and its answer is parsed strictly: the first
  non-empty line must be ``GOOD: <reason>``, ``BAD: <reason>`` or ``NEUTRAL: <reason>``; anything else is
  unparseable. Without a judge model the rule judge (``rule_verdict``) decides: a retry, a
  correction ("no", "that's wrong", "you forgot ..."), or a failing tool result is bad; thanks, or moving on (a new
  request, tool results without errors) is good; nothing to go by is neutral.
- **Votes** (OpenClaw-RL's process reward, ``openclaw-rl/openclaw_api_server.py``: ``_majority_vote``, ``PRM_M=3``,
  ``prm_temperature 0.6``). A judge model is asked ``judge_votes`` times at once (default 3), each sampled at
  ``judge_temperature`` (0.6); the most frequent verdict wins, a tie for the most is neutral. A vote that fails,
  takes longer than ``judge_timeout_s`` or does not parse abstains, as the source's failed query does; no vote left
  is neutral (counted as unparseable): a judge never blocks serving and never becomes a reward. The votes are in the
  report's metadata. The rule judge is deterministic: ``judge_votes > 1`` without a judge model is refused, and so
  are several greedy votes (``judge_temperature = 0``).
- **Rewards.** A verdict is stored as a report on the judged receipt (metadata ``source = "judge"``, the reason as
  feedback), so it shows in ``reef records show``, lineage and consumption work as for explicit reports, and an
  explicit report on the same receipt takes precedence. Good scores 1, bad 0; neutral carries no score.
- **Objective.** online-rl's clipped policy gradient (``recipes/online_rl.py``). Turns of a session are not
  samples of one prompt, so there are no groups: each sample is baselined by the batch mean (the group-of-one rule
  of ``advantages``), over ``batch_prompts`` turns (``group_size`` 1).
- **Hindsight hints** (``hints = true``, on-policy distillation; the source's ``openclaw-opd`` and
  ``openclaw-combine``): the serving model with a hint in its context is the teacher; the turn's sampled tokens get
  a per-token advantage ``hint_coef * (log p_teacher - log p_behaviour)`` added to the reward's (the combined
  method's ``w_opd = 1``), so tokens the hinted model would not have written are pushed down and the ones it agrees
  with are kept. The rule judge's hint is a correction's text ("use snake_case"); a judge model's comes from the
  hint judge: ``HINT_PROMPT`` asked ``judge_votes`` times beside the verdict's votes, in the source's format
  (``\\boxed{1}`` and a hint between ``[HINT_START]`` and ``[HINT_END]``, or ``\\boxed{-1}``), the longest hint of
  more than 10 characters kept (``_select_best_hint``). A turn without a hint trains on its reward alone, as the
  combined method's RL-only sample (its distillation-only method drops it): ``hinted`` and ``unhinted`` count them
  per step. The hint goes in as a user message just before the answer, rendered with the model's own chat template
  (the source appends it to the last user message); a prompt that does not end with the template's generation
  prompt gets no hint.
- **KL to the base** (``kl_coef``; the source's ``--use-kl-loss --kl-loss-type low_var_kl --ref-load`` the initial
  checkpoint): online-rl's pull toward the base, on by default as in every weights recipe (``recipes/online_rl.py``):
  ``kl_coef * KL(policy || base)`` per completion token joins the loss, exact over the vocabulary (the source
  estimates it on the sampled token, k3 clamped at 10), the base being the model the LoRA adapter applies to (the
  adapter off); ``kl_ref`` in the step's metrics. The source's launch scripts run ``--kl-loss-coef 0.0`` (its
  README states 0.02); here the default is online-rl's, measured on SmolLM2 with scorers an empty answer satisfies
  (docs/recipes.md). A policy training all its weights has no fixed base in the trainer: there the default is inert
  and another value refused.
- **Left out.** A turn the votes call neutral does not train even with a hint (the combined method makes it a
  distillation-only sample; Reef's batches are scored exchanges). The source's top-K logit distillation (its OPD
  option B). Its advantage is the raw reward (+1 / -1, no normalisation); here online-rl's (1 / 0, baselined by the
  batch mean).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from daemon.errors import BadRequest
from daemon.sessions import NextState, Turn
from recipes.base import Candidate, HarnessContext, ScoredExchange, TrainJob, TurnVerdict
from recipes.logprobs import Sample
from recipes.online_rl import OnlineRL, OnlineRLSettings

JUDGE_PROMPT = (
    "You grade one turn of an AI assistant by what happened right after it. Answer with exactly one line of the "
    "form VERDICT: reason, where VERDICT is GOOD (the user or the tools accepted the turn and moved on), BAD (the "
    "user corrected it or asked again, or a tool failed because of it) or NEUTRAL (there is no way to tell)."
)
JUDGE_QUESTION = "THE ASSISTANT'S TURN:\n{turn}\n\nWHAT CAME NEXT:\n{next}"
_ANSWER = re.compile(r"(GOOD|BAD|NEUTRAL):\s*(\S.*)")
# the hint judge (hints = true with a judge model), asked JUDGE_QUESTION too; its answer format is OpenClaw-RL's
# (openclaw-opd/openclaw_opd_api_server.py): a decision \boxed{1} or \boxed{-1}, and with 1 a hint between markers
HINT_PROMPT = (
    "You read one turn of an AI assistant and what happened right after it, and decide whether what came next "
    "shows, in hindsight, what the assistant should have done differently (a correction, a stated preference, an "
    "error that names the fix). If it does, answer \\boxed{1} followed by a hint for the assistant: one to three "
    "concrete, actionable sentences between [HINT_START] and [HINT_END]. If it does not, answer \\boxed{-1} and "
    "no hint. A tool result that succeeded is no hint: it did not exist before the assistant acted."
)
_BOXED = re.compile(r"\\boxed\{([-+]?\d)\}")
_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)
MIN_HINT_CHARS = 11  # a shorter hint is trivial and dropped (the source keeps hints of more than 10 characters)

_CORRECTION = re.compile(
    r"(?i)^\W*(no\b|nope\b|wrong\b|incorrect\b|not (that|what|quite|right)\b|that'?s (wrong|not|incorrect)\b|"
    r"you (forgot|missed|didn'?t|did not|should)\b|(it|this|that) (doesn'?t|does not|didn'?t) work\b|try again\b|"
    r"still (wrong|broken|failing)\b|instead\b|actually\b|please (use|don'?t|do not)\b|don'?t\b|do not\b|stop\b)"
)
_THANKS = re.compile(r"(?i)\b(thanks|thank you|great|perfect|works now|that works|looks good|lgtm|nice)\b")
_TOOL_FAILED = re.compile(r"(?i)(\btraceback\b|\berror\b|\bexception\b|\bfailed\b|\bfailure\b|exit code [1-9])")


def rule_verdict(nxt: NextState) -> TurnVerdict:
    """The built-in judge: corrections, retries and failing tools are bad; thanks and moving on are good."""
    if nxt.retry:
        return TurnVerdict("bad", "the user asked the same thing again", judge="rules")
    user = nxt.user_text.strip()
    if user and _CORRECTION.search(user):
        return TurnVerdict("bad", f"the user corrected it: {user[:200]}", judge="rules", hint=user[:500])
    failed = [text for text, is_error in nxt.tool_results if is_error or _TOOL_FAILED.search(text)]
    if failed:
        return TurnVerdict("bad", f"a tool failed: {failed[0][:200]}", judge="rules")
    if user and _THANKS.search(user):
        return TurnVerdict("good", "the user thanked it", judge="rules")
    if user:
        return TurnVerdict("good", "the user moved on", judge="rules")
    if nxt.tool_results:
        return TurnVerdict("good", "its tool calls succeeded", judge="rules")
    return TurnVerdict("neutral", "nothing came next to judge it by", judge="rules")


def parse_judge_answer(answer: str, judge: str) -> TurnVerdict:
    """A judge model's answer, strictly: ``GOOD|BAD|NEUTRAL: reason`` on its first non-empty line."""
    line = next((x.strip() for x in answer.splitlines() if x.strip()), "")
    m = _ANSWER.fullmatch(line)
    if m is None:
        return TurnVerdict("neutral", f"unparseable judge answer: {line[:200]!r}", judge=judge, unparseable=True)
    return TurnVerdict(m.group(1).lower(), m.group(2)[:500], judge=judge)


def parse_hint_answer(answer: str) -> str | None:
    """The hint in a hint judge's answer, as OpenClaw-RL reads it: the last ``\\boxed{..}`` must be 1, and the last
    ``[HINT_START]...[HINT_END]`` block, stripped, at least ``MIN_HINT_CHARS`` long; else None."""
    boxed = _BOXED.findall(answer)
    blocks = _HINT.findall(answer)
    hint = blocks[-1].strip() if blocks else ""
    return hint[:500] if boxed and int(boxed[-1]) == 1 and len(hint) >= MIN_HINT_CHARS else None


def best_hint(answers: Sequence[str | BaseException]) -> str | None:
    """The longest hint among the hint judge's votes (``parse_hint_answer``), as OpenClaw-RL's
    ``_select_best_hint``; None when no vote gave one (failed votes give none)."""
    hints = [h for a in answers if isinstance(a, str) and (h := parse_hint_answer(a))]
    return max(hints, key=len) if hints else None


def majority(votes: list[TurnVerdict | BaseException], judge: str) -> TurnVerdict:
    """One verdict from a judge model's votes, as OpenClaw-RL's ``_majority_vote``: votes that failed, timed out or
    did not parse abstain; the most frequent verdict among the rest wins; a tie for the most, or no vote left, is
    neutral. The reason is the first winning vote's; ``votes`` lists each vote."""
    labels = tuple(("timed out" if isinstance(v, TimeoutError) else "failed") if isinstance(v, BaseException)
                   else "unparseable" if v.unparseable else v.verdict for v in votes)
    counted = [v for v in votes if isinstance(v, TurnVerdict) and not v.unparseable]
    if not counted:  # every vote abstained: the first one's reason (what it said, or how it failed)
        first = votes[0]
        reason = first.reason if isinstance(first, TurnVerdict) else (
            "the judge failed: " + ("timed out" if isinstance(first, TimeoutError) else f"{type(first).__name__}: "
                                    f"{first}"))
        return TurnVerdict("neutral", reason, judge=judge, unparseable=True, votes=labels)
    tally = Counter(v.verdict for v in counted).most_common()
    if len(tally) > 1 and tally[0][1] == tally[1][1]:
        return TurnVerdict("neutral", "the judge's votes tied: " + ", ".join(f"{k} {n}" for k, n in tally),
                           judge=judge, votes=labels)
    winner = next(v for v in counted if v.verdict == tally[0][0])
    return dataclasses.replace(winner, votes=labels)


async def bounded(calls: Sequence[Awaitable[str]], timeout_s: float) -> list[str | BaseException]:
    """Each call's answer, or its exception (``TimeoutError`` for one still running after ``timeout_s``)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    finally:  # past the timeout, or this call cancelled: no call outlives it
        for t in tasks:
            t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [TimeoutError() if t in pending else (t.exception() or t.result()) for t in tasks]


@dataclass
class OpenClawRLSettings(OnlineRLSettings):
    batch_prompts: int = 8  # judged turns per training batch
    group_size: int = 1  # turns of a session are no groups: each is baselined by the batch mean
    lr: float = 2e-3  # its measured rate (online-rl's default is 3e-3, measured on scored answers)
    steps_per_batch: int = 2
    judge: str | None = None  # a configured model that judges turns; None: the rule judge
    # a judge model's votes per turn, the majority decides (OpenClaw-RL's m); None: 3 with a judge model, the
    # source's PRM_M. The rule judge is deterministic: more than 1 without a judge model is refused
    judge_votes: int | None = None
    judge_temperature: float = 0.6  # each vote is sampled at this (the source's prm_temperature); 0: greedy
    judge_timeout_s: float = 30.0  # a vote slower than this abstains; every vote abstaining is neutral
    judge_max_tokens: int = 64
    hints: bool = False  # hindsight hints: train judged turns toward the hint-conditioned teacher's log-probs
    hint_coef: float = 1.0  # weight of the teacher's per-token advantage
    hint_max_tokens: int = 256  # the hint judge's answer (decision and a hint of 1-3 sentences)
    # kl_coef and max_kl: online-rl's (the pull toward the base on by default; the source's scripts run 0)


class OpenClawRL(OnlineRL):
    """``openclaw-rl``: the policy gradient of online-rl on turns judged by their next state."""

    name = "openclaw-rl"
    judges = True
    # its hinted teacher forward runs on every worker before the split, so the step would be correct data-parallel;
    # not yet checked against one worker by a test: one worker, as sao's and ttt-discover's steps
    data_parallel = False
    Settings = OpenClawRLSettings

    @classmethod
    def check_settings(cls, settings: Any) -> None:
        super().check_settings(settings)

        def refuse(key: str, why: str) -> BadRequest:
            return BadRequest(f"recipe openclaw-rl setting {key} {why}", param=f"settings.{key}")

        if not settings.judge_timeout_s > 0:
            raise refuse("judge_timeout_s", "must be positive")
        for key in ("judge_max_tokens", "hint_max_tokens"):
            if getattr(settings, key) < 1:
                raise refuse(key, "must be at least 1")
        if settings.judge_votes is not None and settings.judge_votes < 1:
            raise refuse("judge_votes", "must be at least 1")
        if settings.judge is None and (settings.judge_votes or 1) > 1:
            raise refuse("judge_votes", "needs a judge model (setting judge): the rule judge is deterministic, so "
                         "its votes would all be one vote")
        if not settings.judge_temperature >= 0:
            raise refuse("judge_temperature", "must be 0 or more")
        if settings.judge is not None and cls.votes(settings) > 1 and settings.judge_temperature == 0:
            raise refuse("judge_temperature", f"0 (greedy) makes the {cls.votes(settings)} judge_votes one answer "
                         "asked again: set it above 0 (the source samples its votes at 0.6), or judge_votes = 1")
        if settings.hints and not settings.hint_coef > 0:
            raise refuse("hint_coef", "must be above 0 with hints = true (0 gives the hints no weight)")

    @staticmethod
    def votes(settings: Any) -> int:
        """The judge's votes per turn: 1 for the rule judge, ``judge_votes`` (default 3) for a judge model."""
        if settings.judge is None:
            return 1
        return settings.judge_votes if settings.judge_votes is not None else 3

    def models_used(self) -> list[str]:
        return [self.settings.judge] if self.settings.judge else []

    async def judge_turn(self, turn: Turn, next_state: NextState, ctx: HarnessContext) -> TurnVerdict | None:
        s = self.settings
        if s.judge is None:
            return rule_verdict(next_state)
        question = JUDGE_QUESTION.format(turn=turn.answer_text() or "(no text)",
                                         next=next_state.describe() or "(nothing)")
        n = self.votes(s)
        calls = [ctx.answer(s.judge, JUDGE_PROMPT, question, s.judge_max_tokens, temperature=s.judge_temperature)
                 for _ in range(n)]
        if s.hints:  # the source asks its hint judge m times beside the verdict's m votes, at once
            calls += [ctx.answer(s.judge, HINT_PROMPT, question, s.hint_max_tokens, temperature=s.judge_temperature)
                      for _ in range(n)]
        answers = await bounded(calls, s.judge_timeout_s)
        verdict = majority([parse_judge_answer(a, s.judge) if isinstance(a, str) else a for a in answers[:n]],
                           s.judge)
        return dataclasses.replace(verdict, hint=best_hint(answers[n:]))

    def samples(self, batch: list[ScoredExchange], model: Any, tokenizer: Any) -> list[Sample]:
        samples = super().samples(batch, model, tokenizer)
        self._counts: dict[str, float] = {}
        import torch

        from recipes.online_rl import token_logprobs

        if not self.settings.hints:
            return samples
        for s, r in zip(samples, batch, strict=True):
            hint = r.report.hint
            hinted = hinted_prompt(tokenizer, s.prompt_token_ids, hint) if hint else None
            if hinted is None:
                continue
            teacher = Sample(prompt_token_ids=hinted, token_ids=s.token_ids, logprobs=s.logprobs, reward=0.0,
                             group="teacher")
            with torch.no_grad():
                logp, _, mask = token_logprobs(model, [teacher])
            t = logp[0][mask[0]].tolist()
            s.token_bonus = [self.settings.hint_coef * (a - b) for a, b in zip(t, s.logprobs, strict=True)]
        # a turn without a hint has no teacher: it trains on its reward alone (the source's combined method emits
        # it as an RL-only sample; its distillation-only method drops it): counted per step
        used = sum(1 for s in samples if s.token_bonus is not None)
        self._counts = {"hinted": float(used), "unhinted": float(len(samples) - used)}
        return samples

    def train(self, job: TrainJob, state: dict[str, Any]) -> Candidate:
        candidate = super().train(job, state)
        candidate.metrics.update(getattr(self, "_counts", {}))
        return candidate


def hinted_prompt(tokenizer: Any, prompt: list[int], hint: str) -> list[int] | None:
    """``prompt`` with ``hint`` as a user message just before the answer, in the model's own chat template; None
    when the prompt does not end with the template's generation prompt."""
    probe = [{"role": "user", "content": "x"}]
    bare = tokenizer.apply_chat_template(probe, tokenize=False)
    open_ = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    with_hint = tokenizer.apply_chat_template([*probe, {"role": "user", "content": f"Hint: {hint}"}], tokenize=False)
    if not (open_.startswith(bare) and with_hint.startswith(bare)):
        return None
    enc = tokenizer.backend_tokenizer

    def ids(text: str) -> list[int]:
        return list(enc.encode(text, add_special_tokens=False).ids)

    gen = ids(open_[len(bare):])
    if not gen or prompt[-len(gen):] != gen:
        return None
    return prompt[: -len(gen)] + ids(with_hint[len(bare):]) + gen
