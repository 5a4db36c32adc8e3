"""``openclaw-rl``: learning from ordinary use. Nobody files a report: each assistant turn is judged by what came
next (the user's next message, or the tool results after it), and the verdicts train the weights.

Design choices:

- **Sessions and next states** are the daemon's (``daemon/sessions.py``): a request that continues an earlier
  turn (its messages start with that turn's request and answer) judges it by what follows; a request in the same
  session that asks the last user message again is a retry of that turn.
- **Judges.** ``judge = "<model>"`` names any configured model (the served one, another local one, an upstream
  provider); it is asked with ``JUDGE_PROMPT`` (below, fixed) and its answer is parsed strictly: the first
  non-empty line must be ``GOOD: <reason>``, ``BAD: <reason>`` or ``NEUTRAL: <reason>``; anything else is neutral
  and counted as unparseable. Without a judge model the rule judge (``rule_verdict``) decides: a retry, a
  correction ("no", "that's wrong", "you forgot ..."), or a failing tool result is bad; thanks, or moving on (a new
  request, tool results without errors) is good; nothing to go by is neutral. A judge that fails or takes longer
  than ``judge_timeout_s`` is neutral: it never blocks serving and never becomes a reward.
- **Rewards.** A verdict is stored as a report on the judged receipt (metadata ``source = "judge"``, the reason as
  feedback), so it shows in ``reef records show``, lineage and consumption work as for explicit reports, and an
  explicit report on the same receipt takes precedence. Good scores 1, bad 0; neutral carries no score.
- **Objective.** online-rl's clipped policy gradient (``recipes/online_rl.py``). Turns of a session are not
  samples of one prompt, so there are no groups: each sample is baselined by the batch mean (the group-of-one rule
  of ``advantages``), over ``batch_prompts`` turns (``group_size`` 1).
- **Hindsight hints** (``hints = true``, on-policy distillation): when a correction says what was wrong ("use
  snake_case"), the serving model with that hint in its context is the teacher; the turn's sampled tokens get a
  per-token advantage ``hint_coef * (log p_teacher - log p_behaviour)`` added to the reward's, so tokens the hinted
  model would not have written are pushed down and the ones it agrees with are kept. The hint goes in as a user
  message just before the answer, rendered with the model's own chat template; a prompt that does not end with the
  template's generation prompt gets no hint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from daemon.errors import BadRequest
from daemon.sessions import NextState, Turn
from recipes.base import HarnessContext, ScoredExchange, TurnVerdict
from recipes.online_rl import OnlineRL, OnlineRLSettings, Sample

JUDGE_PROMPT = (
    "You grade one turn of an AI assistant by what happened right after it. Answer with exactly one line of the "
    "form VERDICT: reason, where VERDICT is GOOD (the user or the tools accepted the turn and moved on), BAD (the "
    "user corrected it or asked again, or a tool failed because of it) or NEUTRAL (there is no way to tell)."
)
JUDGE_QUESTION = "THE ASSISTANT'S TURN:\n{turn}\n\nWHAT CAME NEXT:\n{next}"
_ANSWER = re.compile(r"(GOOD|BAD|NEUTRAL):\s*(\S.*)")

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


@dataclass
class OpenClawRLSettings(OnlineRLSettings):
    batch_prompts: int = 8  # judged turns per training batch
    group_size: int = 1  # turns of a session are no groups: each is baselined by the batch mean
    lr: float = 2e-3  # its measured rate (online-rl's default is 3e-3, measured on scored answers)
    steps_per_batch: int = 2
    judge: str | None = None  # a configured model that judges turns; None: the rule judge
    judge_timeout_s: float = 30.0  # a judge slower than this is neutral
    judge_max_tokens: int = 64
    hints: bool = False  # hindsight hints: train bad turns toward the hint-conditioned teacher's log-probs
    hint_coef: float = 1.0  # weight of the teacher's per-token advantage


class OpenClawRL(OnlineRL):
    """``openclaw-rl``: the policy gradient of online-rl on turns judged by their next state."""

    name = "openclaw-rl"
    judges = True
    Settings = OpenClawRLSettings

    @classmethod
    def check_settings(cls, settings: Any) -> None:
        super().check_settings(settings)
        if not settings.judge_timeout_s > 0:
            raise BadRequest("recipe openclaw-rl setting judge_timeout_s must be positive",
                             param="settings.judge_timeout_s")

    def models_used(self) -> list[str]:
        return [self.settings.judge] if self.settings.judge else []

    async def judge_turn(self, turn: Turn, next_state: NextState, ctx: HarnessContext) -> TurnVerdict | None:
        if self.settings.judge is None:
            return rule_verdict(next_state)
        question = JUDGE_QUESTION.format(turn=turn.answer_text() or "(no text)",
                                         next=next_state.describe() or "(nothing)")
        answer = await ctx.answer(self.settings.judge, JUDGE_PROMPT, question, self.settings.judge_max_tokens)
        return parse_judge_answer(answer, self.settings.judge)

    def samples(self, batch: list[ScoredExchange], model: Any, tokenizer: Any) -> list[Sample]:
        samples = super().samples(batch, model, tokenizer)
        if not self.settings.hints:
            return samples
        import torch

        from recipes.online_rl import token_logprobs

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
        return samples


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
