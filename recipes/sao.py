"""SAO: single-rollout asynchronous optimisation. Each scored exchange is one training step, trained as soon as
its report arrives, and each step is a release that serves the next request.

Design choices (compact; the numbers are ``SAOSettings`` defaults, measured with ``bench/sao_offline.py`` on the
demo model and ``bench/learning.py`` through the daemon):

- **Data.** As online-rl: the record's ``prompt_token_ids``, sampled ``token_ids`` and their behaviour
  ``logprobs`` (raw logits, under the release that served it), and the report's ``score``. ``batch_size``
  rollouts per step (1 by default: no waiting for siblings, no group).
- **Baseline.** With no group to normalise against, a learned value baseline: a linear critic head on the policy's
  last hidden state at each completion position (the state a token is sampled from), plus the policy's own
  confidence there (entropy, top log-prob, the log-prob of the token just sampled: functions of the state only, so
  the baseline stays unbiased). The advantage of token ``t`` is the Monte-Carlo one, ``A_t = r - V(s_t)`` (one
  reward at the end, undiscounted): the stop token after a right word is judged against a state that already
  "knows" the word (GAE with ``gae_lambda`` below 1, or the source's length-adaptive lambda with ``lambda_alpha``,
  bootstraps from the critic instead: on the demo task the adaptive lambda, 0 on its short answers, collapsed the
  policy onto a zero-reward answer within 1,000 rollouts on two seeds, where lambda 1 learned; docs/recipes.md).
  Measured: the hidden state alone left the critic no better than a constant (value loss 0.2 at
  reward 0.4); with the confidence features it halved that, and held-out 0.8 came after 4750 rollouts instead of
  not by 4000 (0.40). The critic reads its features detached (its loss never shapes the policy), has its own AdamW
  at ``value_lr = 1e-3`` (at 1e-2 its own noise became the advantage's and the policy collapsed onto a zero-reward
  answer), is fit by squared error, and its bias starts at the first reward seen (that first report then carries no
  signal and is written down as skipped). It lives in the worker's state with the policy, and is saved beside each
  candidate (``value_head.pt``, a few hundred bytes) so that a restart, a rollback or another worker resumes it.
- **Off-policy correction (decoupled).** The record was sampled by the serving release, which may be up to
  ``max_staleness`` releases behind the weights being trained. Following decoupled PPO, the proximal policy is the
  trained weights before this step: the behaviour correction ``w_t = min(is_cap, pi_prox / mu)`` is a truncated
  importance weight (IMPALA's rho-bar: a stale sample counts at most ``is_cap`` times), and the update itself is
  PPO's clipped ratio ``pi / pi_prox`` (which only bites when ``steps_per_batch > 1``). Tokens whose behaviour
  log-prob is implausible (``pi_prox / mu`` below ``1 / is_cap**4``: the record no longer looks like this policy's)
  are counted and masked out rather than trained on with a vanishing weight.
- **Step size.** AdamW on all but the (tied) token embeddings and the last norm's scale (the policy's temperature
  knob: noise alone would sharpen it), ``lr = 5e-4``: 1e-3 collapsed, 2e-4 learned at half the speed. ``beta2 =
  0.999`` (a long second moment, so a small advantage makes a small step) and ``grad_clip = 10`` (a guard only:
  one rollout's gradient norm is 3-7, and clipping it at 1 made every step the same size whatever its advantage,
  which drove the policy to a zero-reward answer). ``beta1 = 0.95`` learned faster early on one seed and no better
  on another; SGD with momentum learned slower.
- **Gate: cheap, periodic.** Every step is a release, so the default gate (``periodic``) publishes each candidate
  without evaluating it, and every ``eval_every`` steps (and on the first step of a fresh start) runs the
  regression check: the trainer scores the candidate and the serving head greedily on ``eval_n`` validation prompts
  (``eval_family``; none by default, then there is nothing to check) and the candidate is published when it is
  shown not to fall ``margin`` (0.1) or more below the head at error rate ``alpha`` (0.05): the regression gate's
  non-inferiority test (``daemon/gate.py``; 0.1 rather than 0.05 so that the default 64 prompts can decide:
  0.05 needs 70, and at 128 turns an equal candidate away about half the time). A failed check puts the lineage on probation: the worker sees that its
  last candidate was not published (the head did not move) and checks every following step until one passes, so
  nothing unchecked follows a failure; after ``restart_after`` failures in a row training restarts from the head.
  The reference is the serving head, not the best so far: the unchecked steps between checks move the head, and
  measured through the daemon, an early dip of the head (validation 0.08 to 0.01, which offline runs recover from)
  left every later candidate below "best - margin", and the scenario checked and rejected every step from then on.
  So the check guards against a step that breaks the model, and slow drift is left to learning, as without a
  gate. The other gates (``always``, ``floor``,
  ``compare``, ``regression``, ``review``) also work and evaluate every step (costly at one release per step).
- **What trains: LoRA on real models**, as online-rl: adapters (peft, ``lora_rank`` on the attention and MLP
  projections) for models of ``LORA_AUTO_PARAMS`` parameters or more, all weights below (the built-in tiny models);
  the ``lora`` setting decides instead when set. A step's release is then the adapter alone on the whole model
  (``daemon/lora.py``; on SmolLM2 a few MB instead of a copy of the model), and the engine attaches it to the
  resident base instead of loading a model per step. The critic goes in the adapter release too, as
  ``value_head.pt`` beside peft's files (``lora.STATE_FILES``): it is trained with the policy and a restart, a
  rollback or another worker must resume both from the same release. Not inside the adapter's tensors: the engines
  (Reef's, vLLM's, peft's) serve plain LoRA files and refuse a tensor that is not ``lora_A`` / ``lora_B``; and not
  only in the worker's memory, which a restart loses (a fresh critic's first report teaches the policy nothing).
- **Worker state.** One entry per lineage (model, critic, both optimizers; keyed by its last candidate, up to
  ``MAX_LINEAGES``), so scenarios that share the worker do not reload each other's at every step.
"""

from __future__ import annotations

import math
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from daemon.errors import BadRequest
from daemon.gate import GATES, Verdict, judge
from recipes.base import (
    Candidate,
    FeedbackReport,
    GateSettings,
    Head,
    Recipe,
    ScoredExchange,
    Scores,
    TrainJob,
    check_alpha,
    check_eval_size,
)
from recipes.logprobs import Sample, completion_logprobs, is_adapter
from recipes.memory import check_budget, checkpointing, micro_batches
from recipes.online_rl import (
    WeightsSettings,
    _eval_scores,
    check_drift_bound,
    check_eval_family,
    check_lora,
    check_pull,
    kl_from_base,
    kl_per_position,
    load_policy,
    pull_coef,
    pull_shape,
    reference_log_softmax,
    save_adapter_candidate,
)

VALUE_FILE = "value_head.pt"
MAX_LINEAGES = 3  # lineages (scenarios) whose model, critic and optimizers the worker keeps in memory


@dataclass
class SAOSettings(GateSettings, WeightsSettings):
    gate: str = "periodic"  # periodic (regression check every eval_every steps) | always | floor | compare | ...
    # the periodic check (a regression gate: daemon/gate.py): published when shown not to fall this far below the
    # serving head at error rate alpha (None: 0.05); 0.1 so that eval_n = 64 can decide (0.05 needs 70 tasks)
    margin: float | None = 0.1
    lr: float = 5e-4  # policy AdamW learning rate
    value_lr: float = 1e-3  # critic AdamW learning rate (faster is noisier: its noise is the advantage's)
    # the policy's advantage by GAE over the critic's values (one reward at the end, undiscounted): 1 is the
    # Monte-Carlo r - V(s_t); below 1 bootstraps from the critic. lambda_alpha instead: the source's
    # length-adaptive lambda (VAPO), 1 - 1 / (lambda_alpha * answer length), at least 0, per rollout
    gae_lambda: float = 1.0
    lambda_alpha: float | None = None
    weight_decay: float = 0.0
    batch_size: int = 1  # scored rollouts per step
    max_staleness: int = 1  # releases: records served by a release older than head - this are not used
    is_cap: float = 2.0  # truncation of the behaviour importance weight pi_prox / mu
    clip_low: float = 0.2  # PPO clip of pi / pi_prox (steps_per_batch > 1)
    clip_high: float = 0.28
    steps_per_batch: int = 1  # optimizer steps per rollout
    beta1: float = 0.9  # AdamW momentum: averages about 1 / (1 - beta1) rollouts' gradients
    beta2: float = 0.999  # AdamW second-moment decay (long: small advantages must give small steps)
    entropy_coef: float = 0.0
    grad_clip: float = 10.0  # max gradient norm: a guard only (one rollout's is 3-7; see the module docstring)
    max_new_tokens: int = 8
    train_embeddings: bool = False
    train_final_norm: bool = False  # train the last norm's scale (the policy's temperature knob)
    eval_family: str | None = None  # validation prompts of the periodic check (recipes/tasks.py)
    eval_n: int = 64
    eval_seed: int = 0
    eval_every: int = 10  # steps between periodic checks (the first step after a restart is checked too)
    restart_after: int = 3  # failed checks in a row after which training restarts from the head
    memory_budget_mb: int = 1024  # memory (MB) one micro-batch may keep besides the model (recipes/memory.py)
    # and online-rl's lora, lora_rank, lora_alpha, kl_coef, max_kl (WeightsSettings): with LoRA, releases hold the
    # adapter and the critic


# --- the critic -------------------------------------------------------------------------------------------------


class ValueHead(torch.nn.Module):
    """``V(s) = w . f(s) + b`` on the critic's features of a state (``critic_features``), one value per position."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)
        self.seeded = False  # whether the bias has been set from a first reward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        values: torch.Tensor = self.linear(hidden)[..., 0]  # torch types a module's call as Any
        return values


@dataclass
class Learner:
    """What a SAO lineage keeps between steps (in the worker's state) besides its model: the critic, both optimizers."""

    value: ValueHead
    optimizer: torch.optim.Optimizer
    value_optimizer: torch.optim.Optimizer


def make_learner(model: Any, settings: SAOSettings, value: ValueHead | None = None) -> Learner:
    if not settings.train_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if not settings.train_final_norm:
        for name, p in model.named_parameters():
            if name.endswith("model.norm.weight"):
                p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    value = (value if value is not None else ValueHead(model.config.hidden_size + CONFIDENCE_FEATURES)).to(model.device)
    return Learner(
        value=value,
        optimizer=torch.optim.AdamW(params, lr=settings.lr, betas=(settings.beta1, settings.beta2),
                                    weight_decay=settings.weight_decay),
        value_optimizer=torch.optim.AdamW(value.parameters(), lr=settings.value_lr, betas=(0.9, 0.99)),
    )


def save_value(learner: Learner, directory: Path) -> None:
    torch.save({"state": {k: v.cpu() for k, v in learner.value.state_dict().items()},
                "seeded": learner.value.seeded}, directory / VALUE_FILE)


def load_value(directory: Path, width: int) -> ValueHead | None:
    """The critic saved beside a release, or None (an older release, another recipe's, a mismatched width)."""
    path = directory / VALUE_FILE
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
        value = ValueHead(width)
        value.load_state_dict(saved["state"])
    except Exception:  # unreadable or another shape: start the critic afresh rather than fail the step
        return None
    value.seeded = bool(saved.get("seeded", True))
    return value


def save_weights(model: Any, out: Path, base: Path, *, frozen_embeddings: bool) -> None:
    """The candidate's model directory: its weights, and the base's tokenizer and generation files. With frozen
    embeddings the weights are split so that the embeddings are a shard of their own, byte for byte the same in
    every release: the chain stores that shard once (an LFS object), and each release adds only the layers that
    changed (for the demo model 0.23 MB instead of 1.3 MB: one release per step adds up)."""
    split = {"max_shard_size": model.get_input_embeddings().weight.numel() * 4 - 1} if frozen_embeddings else {}
    model.save_pretrained(out, safe_serialization=True, **split)
    for f in base.iterdir():
        if f.is_file() and not (out / f.name).exists() and not f.name.endswith(
                (".safetensors", ".bin", ".pt", ".safetensors.index.json")):
            shutil.copyfile(f, out / f.name)


# --- the training step -------------------------------------------------------------------------------------------


def _forward(model: Any, batch: list[Sample], *, entropy_grad: bool = True, pull: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per completion token [B, T]: log-prob (with grad), entropy, the critic's features of the state it was
    sampled from, a mask, and with ``pull`` the exact KL(policy || base) at each position (with grad; None
    without), from the one per-token forward (``completion_logprobs``)."""
    out = completion_logprobs(model, batch, hidden=True)
    assert out.hidden is not None
    kl = kl_per_position(out.log_softmax, reference_log_softmax(model, batch)) if pull else None
    return out.logp, out.entropy(entropy_grad), critic_features(out.hidden, out.log_softmax, out.logp), out.mask, kl


CONFIDENCE_FEATURES = 4


def critic_features(hidden: torch.Tensor, logp_all: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """What the critic reads at each completion position [B, T, H + 4], all detached and functions of the state
    only (never of the token sampled there, which would bias the baseline): the hidden state, and the policy's own
    confidence there (entropy, top log-prob) and in the step before (the log-prob of the token it just sampled;
    0 and a first-position flag at t = 0). A likely answer is a confident one, so these predict reward well."""
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        top = logp_all.max(-1).values
        prev = torch.cat([torch.zeros_like(logp[:, :1]), logp[:, :-1]], dim=1)
        first = torch.zeros_like(prev)
        first[:, 0] = 1.0
        extra = torch.stack([entropy, top, prev, first], dim=-1)
        return torch.cat([hidden.detach().float(), extra], dim=-1)


def gae_lambda(settings: SAOSettings, length: int) -> float:
    """The rollout's lambda: ``gae_lambda``, or with ``lambda_alpha`` the source's length-adaptive one (VAPO:
    ``1 - 1 / (alpha * length)``, so that the bias of bootstrapping shrinks as answers grow), at least 0."""
    if settings.lambda_alpha is None:
        return settings.gae_lambda
    return max(0.0, 1.0 - 1.0 / (settings.lambda_alpha * max(1, length)))


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, tmask: torch.Tensor, lam: torch.Tensor
                   ) -> torch.Tensor:
    """GAE with one reward at the end and no discount [B, T]: ``delta_t = V(s_t+1) - V(s_t)`` inside an answer and
    ``r - V(s_last)`` at its last token, ``A_t = delta_t + lambda * A_t+1``. With lambda 1 it telescopes to the
    Monte-Carlo ``r - V(s_t)``; with 0 it is the one-step TD error. Rows are left-aligned (``tmask``)."""
    rows, width = values.shape
    lengths = tmask.sum(1)
    last = torch.arange(width, device=values.device)[None, :] == (lengths - 1)[:, None]
    following = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    delta = (torch.where(last, rewards.expand_as(values), following) - values).masked_fill(~tmask, 0.0)
    adv = torch.zeros_like(values)
    running = torch.zeros(rows, device=values.device, dtype=values.dtype)
    for t in range(width - 1, -1, -1):
        running = delta[:, t] + lam.to(values.dtype) * running
        adv[:, t] = running
    return adv.masked_fill(~tmask, 0.0)


def sao_step(model: Any, batch: list[Sample], settings: SAOSettings, learner: Learner) -> dict[str, float]:
    """One SAO update on ``batch`` (usually one rollout): critic baseline, truncated behaviour weights, clipped
    ratio; updates the policy and the critic in place and returns the step's metrics."""
    if not batch:
        raise ValueError("sao_step needs at least one sample")
    for s in batch:
        if len(s.token_ids) != len(s.logprobs) or not s.token_ids or not s.prompt_token_ids:
            raise ValueError(f"sample of group {s.group!r}: needs a prompt and one logprob per sampled token")
        if not math.isfinite(s.reward):
            raise ValueError("a reward must be a finite number")
    summary = {"reward_mean": sum(s.reward for s in batch) / len(batch), "samples": float(len(batch))}
    value = learner.value
    if not value.seeded:  # the first reward seeds the baseline: no early steps spent learning the reward's mean
        with torch.no_grad():
            value.linear.bias.fill_(sum(s.reward for s in batch) / len(batch))
        value.seeded = True
    # micro-batches that fit the memory budget (recipes/memory.py); one (the default single rollout): its forward
    # with grad serves the first step too, several: a forward without grad first, then each step's with grad
    coef = pull_coef(model, settings)  # the pull toward the base (LoRA policies; 0: none)
    micro = micro_batches([(len(s.prompt_token_ids), len(s.token_ids)) for s in batch], pull_shape(model, coef),
                          settings.memory_budget_mb)
    parts = [[batch[i] for i in p.rows] for p in micro]
    entropy_grad = settings.entropy_coef != 0
    was_training = model.training
    model.train()
    metrics: dict[str, float] = {}
    try:
        first = []
        for part, mb in zip(parts, micro, strict=True):
            with torch.set_grad_enabled(len(parts) == 1), checkpointing(model, mb.checkpoint and len(parts) == 1):
                first.append(_forward(model, part, entropy_grad=entropy_grad, pull=coef > 0 and len(parts) == 1))
        per: list[dict[str, Any]] = []
        for part, (logp, entropy, features, tmask, kl) in zip(parts, first, strict=True):
            behaviour = torch.zeros_like(logp)
            for row, s in enumerate(part):
                behaviour[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
            rewards = torch.tensor([s.reward for s in part], device=logp.device)[:, None]
            v = value(features)  # the critic's grads only: its features are detached
            lam = torch.tensor([gae_lambda(settings, len(s.token_ids)) for s in part], device=logp.device)
            per.append({"logp": logp, "entropy": entropy, "kl": kl, "tmask": tmask, "prox": logp.detach(), "v": v,
                        "rewards": rewards, "behaviour": behaviour, "lambda": lam,
                        "adv": gae_advantages(rewards, v.detach(), tmask, lam)})
        n = sum(p["tmask"].sum() for p in per).clamp(min=1)
        # --- the critic: fit V(s_t) to the reward, on detached features
        value_loss = sum((((p["v"] - p["rewards"]) ** 2) * p["tmask"]).sum() for p in per) / n
        # --- the advantage: reward minus the value before this update
        if max(float(p["adv"].abs().max()) for p in per) < 1e-6:  # the critic predicted the reward: nothing moves
            return {**summary, "value_loss": float(value_loss.detach()), "skipped": 1.0}
        learner.value_optimizer.zero_grad(set_to_none=True)
        value_loss.backward()
        learner.value_optimizer.step()
        # --- the behaviour correction: truncated weight pi_prox / mu, implausible tokens masked out
        for p in per:
            p["log_w"] = (p["prox"] - p["behaviour"]).masked_fill(~p["tmask"], 0.0)
            p["implausible"] = (p["log_w"] < -4 * math.log(settings.is_cap)) & p["tmask"]
            p["used"] = p["tmask"] & ~p["implausible"]
            p["w"] = p["log_w"].exp().clamp(max=settings.is_cap).masked_fill(~p["used"], 0.0)
        n_used = sum(p["used"].sum() for p in per).clamp(min=1)
        params = [q for q in model.parameters() if q.requires_grad]
        for step in range(settings.steps_per_batch):
            learner.optimizer.zero_grad(set_to_none=True)
            pg_total = entropy_total = kl_total = 0.0
            for part, mb, p in zip(parts, micro, per, strict=True):
                with checkpointing(model, mb.checkpoint):
                    if step or len(parts) > 1:
                        logp, entropy, _, _, kl = _forward(model, part, entropy_grad=entropy_grad, pull=coef > 0)
                    else:
                        logp, entropy, kl = p["logp"], p["entropy"], p["kl"]
                    ratio = (logp - p["prox"]).masked_fill(~p["used"], 0.0).exp()
                    clipped = ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
                    surrogate = torch.minimum(ratio * p["adv"], clipped * p["adv"])
                    pg_loss = -(p["w"] * surrogate * p["used"]).sum() / n_used
                    mean_entropy = (entropy * p["tmask"]).sum() / n
                    loss = pg_loss - settings.entropy_coef * mean_entropy
                    if kl is not None:  # the pull toward the base, per completion token as the entropy
                        kl_ref = (kl * p["tmask"]).sum() / n
                        loss = loss + coef * kl_ref
                        kl_total += float(kl_ref.detach())
                    loss.backward()
                pg_total += float(pg_loss.detach())
                entropy_total += float(mean_entropy.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            learner.optimizer.step()
            if step == 0:
                metrics = {"pg_loss": pg_total, "entropy": entropy_total, "grad_norm": float(grad_norm),
                           "micro_batches": float(len(parts)), "kl_coef": coef,
                           **({"kl_ref": kl_total} if coef > 0 else {})}
    finally:
        model.train(was_training)
    with torch.no_grad():
        iws = [(p["log_w"].exp(), p) for p in per]
        metrics.update(
            **summary,
            skipped=0.0,
            tokens=float(n),
            value_loss=float(value_loss),
            # the critic's value of the prompt (first position), and the advantage there
            value=sum(float(p["v"][:, 0].sum()) for p in per) / len(batch),
            advantage=sum(float(p["adv"][:, 0].sum()) for p in per) / len(batch),
            gae_lambda=sum(float(p["lambda"].sum()) for p in per) / len(batch),
            iw_mean=sum(float((iw * p["tmask"]).sum()) for iw, p in iws) / float(n),
            iw_max=max(float(iw.masked_fill(~p["tmask"], 0).max()) for iw, p in iws),
            iw_truncated=sum(float(((iw > settings.is_cap) & p["tmask"]).sum()) for iw, p in iws) / float(n),
            masked_tokens=sum(float(p["implausible"].sum()) for p in per),
            # k3 estimator of KL(behaviour || proximal) per token: how far the trained weights are from the server
            kl_behaviour=sum(float(((iw - 1 - p["log_w"]) * p["tmask"]).sum()) for iw, p in iws) / float(n),
        )
    return metrics


# --- the recipe -------------------------------------------------------------------------------------------------


class SAO(Recipe):
    """``sao``: one scored rollout per step, trained as soon as it is scored, each step a release.

    Eligible: a scored exchange served by a release at most ``max_staleness`` steps behind the head. A batch is the
    oldest ``batch_size`` of them. The worker keeps the model, the critic and both optimizers of its last candidate
    in memory (keyed by that candidate, as online-rl does) and continues from them while the lineage goes on."""

    name = "sao"
    kind = "weights"
    source = "scores"
    behaviour_logprobs = True
    Settings = SAOSettings

    @classmethod
    def check_settings(cls, settings: Any) -> None:
        if settings.gate != "periodic" and settings.gate not in GATES:
            raise BadRequest(f"unknown gate {settings.gate!r}; gates: periodic, {', '.join(GATES)}",
                             param="settings.gate")
        check_eval_family(settings)
        for key in ("batch_size", "steps_per_batch", "eval_n", "eval_every", "max_new_tokens"):
            if getattr(settings, key) < 1:
                raise BadRequest(f"recipe sao setting {key} must be at least 1", param=f"settings.{key}")
        # the periodic check is a regression gate: alpha and margin as that gate reads them; with a gate that reads
        # neither, a set alpha is refused (margin has a default here, so it cannot be told from one set)
        as_gate = replace(settings, gate="regression") if settings.gate == "periodic" else settings
        check_alpha(as_gate if as_gate.gate in ("compare", "regression") else replace(as_gate, margin=None))
        if settings.eval_family:
            check_eval_size(cls.name, as_gate, settings.eval_n, "eval_n")
        check_budget(cls.name, settings.memory_budget_mb)
        check_lora(cls.name, settings)
        check_pull(cls.name, settings)
        if settings.is_cap < 1:
            raise BadRequest("recipe sao setting is_cap must be at least 1", param="settings.is_cap")
        if not 0 <= settings.gae_lambda <= 1:
            raise BadRequest("recipe sao setting gae_lambda must be between 0 and 1", param="settings.gae_lambda")
        if settings.lambda_alpha is not None:
            if not settings.lambda_alpha > 0:
                raise BadRequest("recipe sao setting lambda_alpha must be positive", param="settings.lambda_alpha")
            if settings.gae_lambda != 1.0:
                raise BadRequest("recipe sao settings gae_lambda and lambda_alpha exclude each other (lambda_alpha "
                                 "computes each rollout's lambda from its length)", param="settings.gae_lambda")
        if settings.max_staleness < 0:
            raise BadRequest("recipe sao setting max_staleness must be at least 0", param="settings.max_staleness")

    def eligible(self, record: ScoredExchange | FeedbackReport, *, head: Head, served_step: int | None) -> bool:
        return served_step is not None and head.step - served_step <= self.settings.max_staleness

    def batch(self, records: list[ScoredExchange]) -> list[ScoredExchange] | None:
        n = self.settings.batch_size
        return records[:n] if len(records) >= n else None

    def judge(self, candidate: Candidate, *, best: float | None) -> Verdict:
        s: SAOSettings = self.settings
        if s.gate != "periodic":
            return super().judge(candidate, best=best)
        ev = candidate.eval
        if ev is None:
            why = f"not a check step (checks every {s.eval_every})" if s.eval_family else \
                "no eval_family to check on, so every step publishes"
            return Verdict(True, "accepted", f"periodic gate: {why}", {"checked": 0})
        # against the serving head, scored on the same prompts in the same step (not the best so far: see the
        # module docstring)
        verdict = judge("regression", candidate=ev.candidate, base=ev.base, best=None, margin=s.margin, alpha=s.alpha)
        return Verdict(verdict.publish, verdict.verdict, f"periodic check: {verdict.reason}",
                       {**verdict.metrics, "checked": 1})

    def train(self, job: TrainJob, state: dict[str, Any]) -> Candidate:
        from transformers import AutoTokenizer

        s: SAOSettings = self.settings
        t0 = time.perf_counter()
        # one entry per lineage (keyed by its last candidate), so that scenarios sharing the worker do not evict
        # each other's model, critic and optimizers at every step
        lineages: OrderedDict[str, dict[str, Any]] = state.setdefault("lineages", OrderedDict())
        lin = lineages.pop(job.base_key, None)
        # the last candidate was not published when the head has not moved since: probation, check this step
        probation = lin is not None and lin["head"] == job.head_key and lin["made"]
        if lin is None:
            base = Path(job.base_path)
            # a whole model, or LoRA on it (a release that is an adapter goes on training that adapter)
            model = load_policy(base, job.model_path or None, s, trainable=True,
                                device=job.device)
            learner = make_learner(model, s, load_value(base, model.config.hidden_size + CONFIDENCE_FEATURES))
            # a fresh start (the worker's first job, a restart from the head): its first step is checked
            lin = {"tokenizer": AutoTokenizer.from_pretrained(job.model_path or base), "model": model,
                   "learner": learner,
                   "since_check": s.eval_every, "made": False}
        model, tokenizer, learner = lin["model"], lin["tokenizer"], lin["learner"]
        lin["head"] = job.head_key
        samples = [Sample(prompt_token_ids=r.prompt_token_ids, token_ids=r.token_ids, logprobs=r.logprobs,
                          reward=r.score, group=r.id) for r in job.batch]
        t_train = time.perf_counter()
        metrics = sao_step(model, samples, s, learner)
        model.eval()
        if is_adapter(model) and not metrics["skipped"]:  # how far the policy moved from its base (watchdog)
            metrics["kl_from_base"] = round(kl_from_base(model, samples), 6)
        check_drift_bound(model, s)
        lineages[job.base_key if metrics["skipped"] else job.candidate_key] = lin
        while len(lineages) > MAX_LINEAGES:
            lineages.popitem(last=False)
        if metrics["skipped"]:  # reward equal to the value everywhere: neither the policy nor the critic moved
            lin["made"] = False
            metrics["train_s"] = round(time.perf_counter() - t0, 3)
            return Candidate(metrics=metrics, skipped="no signal: the reward equals the critic's value")
        t_save = time.perf_counter()
        out = Path(job.work_dir)
        if is_adapter(model):  # the adapter alone, on the whole model it applies to, and the critic beside it
            metrics["adapter_bytes"] = save_adapter_candidate(model, out, job)
        else:
            save_weights(model, out, Path(job.model_path or job.base_path),  # tokenizer files: never an adapter dir
                         frozen_embeddings=not s.train_embeddings)
        save_value(learner, out)
        lin["made"] = True
        lin["since_check"] += 1
        metrics.update(step_s=round(t_save - t_train, 3), save_s=round(time.perf_counter() - t_save, 3))
        scores = None
        evaluate = s.gate in ("floor", "compare", "regression") or (s.gate == "periodic" and (
            probation or lin["since_check"] >= s.eval_every))
        if evaluate and s.eval_family:
            t_eval = time.perf_counter()
            if job.head_scores is not None:
                base_scores = job.head_scores
            else:
                head = load_policy(job.head_path, job.model_path or None, s, trainable=False,
                                   device=job.device)
                base_scores = _eval_scores(head, tokenizer, s)
            scores = Scores(candidate=_eval_scores(model, tokenizer, s), base=base_scores)
            lin["since_check"] = 0
            metrics["eval_s"] = round(time.perf_counter() - t_eval, 3)
        metrics["train_s"] = round(time.perf_counter() - t0, 3)
        return Candidate(path=str(out), metrics=metrics, eval=scores)


def _mean(xs: list[float] | None) -> float | None:
    return None if not xs else sum(xs) / len(xs)
