"""Online RL on weights from scored exchanges: the pure training step, its optimizer, sampling and evaluation.

Design choices (compact; the numbers are ``OnlineRLSettings`` defaults, measured in ``bench/learning_offline.py``):

- **Data.** Only what a record holds: ``prompt_token_ids``, the sampled ``token_ids`` (EOS included), their
  behaviour ``logprobs`` (raw logits, temperature 1, under the serving weights) and the report's ``reward``.
  Nothing is re-tokenised. ``group`` keys samples of the same prompt.
- **Advantage.** Group-normalised (GRPO): ``(r - mean(group)) / max(std(group), min_std)``. The ``min_std``
  floor keeps near-uniform groups (rewards differing by partial-credit crumbs) from being blown up to unit
  scale. A group of one sample (the rest not reported yet) is baselined by the batch mean instead.
- **All-wrong / all-right groups** carry no group-normalised signal (advantage 0, so they cost compute and
  nothing else); they are counted (``degenerate``) rather than faked. What keeps them rare is upstream: the
  verifier gives partial credit below the "right" bar (a near-miss beats garbage), the model starts with a
  warm-up skill, and each prompt gets ``group_size`` samples at temperature 1.
- **Objective.** PPO-style clipped surrogate on the per-token importance ratio ``exp(logp_now - logp_behaviour)``
  (asymmetric clip ``[1 - clip_low, 1 + clip_high]``), averaged over all completion tokens of the batch (each
  token weighs the same, long answers do not dilute short ones' tokens). The ratio corrects for staleness: the
  records were sampled by the serving release, which may be up to ``max_staleness`` releases behind.
  Optional entropy bonus.
- **A pull toward the base, on by default** (issue 41: without one, an unguarded scorer that an empty answer
  satisfies drove SmolLM2 to answering nothing). ``kl_coef * KL(policy || base)`` per completion token joins the
  loss (averaged over the batch's answer tokens as the policy loss), the base being the whole model the LoRA adapter
  applies to: the same forward with the adapter switched off (peft's ``disable_adapter``, no gradient). Exact over
  the vocabulary at each position, not the usual estimate on the sampled token (k3): that one's gradient on a token
  is at most ``kl_coef``, too weak against an advantage of 1-2 that pulls the end token forward, and it never sees
  the mass an unsampled end token took; the exact term's gradient grows with the drift. ``kl_ref`` (the term) and
  ``kl_from_base`` (the watchdog's measure, ``max_kl``) are the same quantity. A policy training all its weights
  has no base in the trainer: the defaults are inert there, another value is refused (``pull_coef``).
- **Anti-collapse in the loss, read.** The token mean (not GRPO's per-answer 1/length) already keeps a one-token
  empty answer from carrying a whole answer's weight on its end token; a batch whose answers all score alike (all
  empty) has no signal and is skipped, so a collapsed policy is not pushed further but not back either; the
  advantage of an empty answer is the scorer's. Capping an empty answer's advantage at 0 would stop exactly the
  empty string and nothing near it (one word, a dot); the pull acts on every way of leaving the base.
- **Steps.** ``steps_per_batch`` optimizer steps on one batch (later steps are off-policy, hence the clip);
  AdamW, gradient-norm clipping.
- **What trains.** LoRA adapters (peft, rank ``lora_rank`` on the attention and MLP projections) for every model
  of ``LORA_AUTO_PARAMS`` parameters or more, all weights below (the built-in tiny models, 0.4M parameters,
  whose demo was tuned with full fine-tuning); the ``lora`` setting decides instead when set. An adapter
  candidate holds only the adapter and names the whole model it applies to (``daemon/lora.py``); the next step
  of a lineage goes on training that adapter.
- **Defaults: real models, ordinary traffic.** lr 3e-3, batches of 32 scored answers (4 prompts x 8; with
  prompts asked once, each is baselined by the batch mean), one step per batch: on SmolLM2 through the daemon,
  two preferences nobody tuned for rose by +0.25 within 15 minutes on 2 cores (``bench/learning_real.py``,
  README). The built-in tiny models train all their weights and keep their demo's measured lr 2e-3, 8 x 8, two
  steps (``DEMO_SETTINGS`` in ``reef_cli/demo.py``); openclaw-rl keeps them too (its batches are judged turns).
  The log-probs: ``recipes/logprobs.py`` (the output head only where a completion token is predicted).
- **Memory.** A batch runs in micro-batches whose estimated activations fit ``memory_budget_mb`` (longest
  samples first, gradients accumulated: the same update), and a sample too long for the budget alone runs with
  gradient checkpointing (``recipes/memory.py``). The whole default batch at once kept about 2 MB a token on
  SmolLM2 (64 samples of 360 tokens: some 45 GB; the kernel killed the trainer at 23 GB). No entropy gradient is
  kept unless ``entropy_coef`` is set.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import shutil
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from daemon import lora
from daemon.errors import BadRequest
from recipes import parallel
from recipes.base import (
    Candidate,
    FeedbackReport,
    GateSettings,
    Head,
    Recipe,
    RetentionSettings,
    ScoredExchange,
    Scores,
    SpendSettings,
    TrainJob,
    check_eval_size,
    explicit,
)
from recipes.logprobs import Sample, completion_logprobs, is_adapter
from recipes.memory import Shape, check_budget, checkpointing, micro_batches
from recipes.tasks import Task, TaskFamily

# the defaults of the pull toward the base and of the drift bound, for LoRA policies (every real model); measured on
# SmolLM2 with bench/learning_real.py --offline (docs/recipes.md, "A pull toward the base"): with an unguarded scorer
# (fewer words) and no pull, 4 default steps took the drift to 1.25 nats/token and the greedy head to 1 of 24 facts
# and 1-word answers; with 0.3 the drift levelled at 0.11, 17 of 24 facts, 35-word answers, and the honest `brief`
# rose as fast as without a pull (+0.21 in 4 steps); 1.0 held the drift at 0.02 but stalled `brief` (+0.07)
KL_COEF = 0.3
MAX_KL = 0.5


@dataclass
class WeightsSettings(SpendSettings, RetentionSettings):
    """What every weights recipe's settings share (online-rl's, openclaw-rl's, sao's, ttt-discover's): LoRA, the
    pull toward the base and the drift bound; both on by default (docs/recipes.md); the cap on trainer time
    (``SpendSettings``) and how many releases keep their weights (``RetentionSettings``)."""

    # train LoRA adapters (peft) instead of all weights; releases then hold only the adapter (daemon/lora.py).
    # None: adapters for models of LORA_AUTO_PARAMS parameters or more (every real model), all weights below
    lora: bool | None = None
    lora_rank: int = 8
    lora_alpha: int = 16
    # the pull toward the reference: kl_coef * KL(policy || base) per completion token joins the loss, the base
    # being the whole model the LoRA adapter applies to (the adapter off). 0: none. A policy training all its
    # weights has no base in the trainer: there the default is inert and another value refused (pull_coef)
    kl_coef: float = KL_COEF
    # the watchdog holds a candidate for review whose policy moved more than this from the whole model its
    # adapter applies to (kl_from_base, nats per token, in every LoRA step's metrics); None: measured, never held.
    # Inert, as kl_coef, on a policy training all its weights
    max_kl: float | None = MAX_KL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EvalSettings(Protocol):
    """What the gate's evaluation (``_eval_scores``) reads of a recipe's settings (online-rl's, sao's)."""

    eval_family: str | None
    eval_n: int
    eval_seed: int
    max_new_tokens: int


@dataclass
class OnlineRLSettings(GateSettings, WeightsSettings):
    # the defaults are for real models learning from ordinary traffic (bench/learning_real.py: two preferences
    # nobody tuned for, SmolLM2, LoRA): batches of 32 scored answers, one optimizer step each, LoRA's usual rate
    lr: float = 3e-3  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    batch_prompts: int = 4  # prompts per training batch (a batch: batch_prompts * group_size scored answers)
    group_size: int = 8  # samples per prompt (the client asks each prompt this many times)
    clip_low: float = 0.2  # PPO clip: ratio kept >= 1 - clip_low for negative advantages
    clip_high: float = 0.28  # ratio kept <= 1 + clip_high for positive advantages
    min_std: float = 0.1  # floor of the group std in the advantage denominator (reward units)
    entropy_coef: float = 0.0  # bonus on the mean token entropy (nats)
    grad_clip: float = 1.0  # max global gradient norm
    steps_per_batch: int = 1  # optimizer steps per batch
    # optimizer steps of a fresh optimizer (a lineage started from the head, or a restarted daemon) over which
    # the rate rises linearly to lr. Adam's first step moves every weight by about lr, whatever its gradient's size
    # (the second moment is that one gradient's square): measured on SmolLM2 at 3e-3, a first step took the policy
    # 0.17 nats per token from its base and lost 6 of 24 probes; with 4 warm-up steps 0.008 and 1 (docs/recipes.md)
    warmup_steps: int = 4
    max_staleness: int = 2  # releases: records served by a release older than head - this are not used
    max_new_tokens: int = 8  # tokens per answer in the demo
    train_embeddings: bool = False  # also train the token embeddings (tied with the output head)
    # the gate's evaluation (floor, compare and regression gates): greedy answers to a task family's
    # validation prompts (recipes/tasks.py), scored by the trainer for the candidate and the serving head
    eval_family: str | None = None
    eval_n: int = 64  # evaluation tasks
    eval_seed: int = 0
    restart_after: int = 3  # rejections in a row after which training restarts from the head (0: never)
    # memory (MB) one micro-batch's forward and backward may keep, besides the model and optimizer: the batch is
    # split into micro-batches that fit and their gradients accumulated (recipes/memory.py). 1024: SmolLM2 with
    # 300-token prompts and 60-token answers then peaks under 2 GB (bench/trainer_memory.py)
    memory_budget_mb: int = 1024


# --- the training step ----------------------------------------------------------------------------------------


def make_optimizer(model: Any, settings: OnlineRLSettings) -> torch.optim.Optimizer:
    """AdamW over the trained weights; unless ``train_embeddings``, marks the token embeddings frozen."""
    if not settings.train_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.99), weight_decay=settings.weight_decay)


LORA_AUTO_PARAMS = 20_000_000  # ``lora`` unset: adapters from this size up (the built-in tiny models are 0.4M)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise RuntimeError("online-rl with lora = true needs peft: pip install peft") from e
    return peft


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    with warnings.catch_warnings():  # peft asks transformers a question its newer versions deprecate
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def wrap_lora(model: Any, settings: WeightsSettings) -> Any:
    """The model with LoRA adapters on its attention and MLP projections (needs ``peft``)."""
    LoraConfig, get_peft_model = _peft().LoraConfig, _peft().get_peft_model
    config = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules=LORA_TARGETS,
    )
    with _quiet_peft():
        return get_peft_model(model, config)


def advantages(batch: list[Sample], settings: OnlineRLSettings) -> tuple[list[float], int]:
    """Group-normalised advantage per sample, and how many groups carried no signal (all rewards equal)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(batch):
        groups[s.group].append(i)
    rewards = [s.reward for s in batch]
    batch_mean = sum(rewards) / len(rewards)
    batch_std = _std(rewards)
    adv = [0.0] * len(batch)
    degenerate = 0
    for members in groups.values():
        rs = [rewards[i] for i in members]
        if len(rs) == 1:  # the rest of the group is not here: baseline by the batch
            adv[members[0]] = (rs[0] - batch_mean) / max(batch_std, settings.min_std)
            continue
        mean, std = sum(rs) / len(rs), _std(rs)
        if std == 0:
            degenerate += 1
        for i in members:
            adv[i] = (rewards[i] - mean) / max(std, settings.min_std)
    return adv, degenerate


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def token_logprobs(model: Any, batch: list[Sample], *, entropy_grad: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs (with grad) and entropies of each sample's completion tokens under ``model``, [B, T], and a mask.
    ``entropy_grad=False``: the entropies carry no grad (nothing vocabulary-wide is kept for them)."""
    out = completion_logprobs(model, batch)
    return out.logp, out.entropy(entropy_grad), out.mask


def warm_up(optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Set the rate of the optimizer's next step: its own rate times (steps taken + 1) / ``steps``, up to 1 (0: the
    rate as it is). The steps taken are counted on the optimizer, so a lineage that goes on keeps its count and a
    fresh optimizer starts again."""
    taken = getattr(optimizer, "reef_steps", 0)
    for group in optimizer.param_groups:
        full = group.setdefault("initial_lr", group["lr"])
        group["lr"] = full * min(1.0, (taken + 1) / steps) if steps > 0 else full
    optimizer.reef_steps = taken + 1  # type: ignore[attr-defined]


def train_step(
    model: Any, batch: list[Sample], settings: OnlineRLSettings, optimizer: torch.optim.Optimizer | None = None,
    adv: tuple[list[float], int] | None = None,
) -> dict[str, float]:
    """``settings.steps_per_batch`` clipped policy-gradient steps on ``batch``; returns metrics of the first.
    ``adv``: per-sample advantages and the count of groups without signal, when the caller computes its own
    (another recipe's baseline); group-normalised ones by default."""
    if not batch:
        raise ValueError("train_step needs at least one sample")
    for s in batch:
        if len(s.token_ids) != len(s.logprobs) or not s.token_ids or not s.prompt_token_ids:
            raise ValueError(f"sample of group {s.group!r}: needs a prompt and one logprob per sampled token")
    optimizer = optimizer or make_optimizer(model, settings)
    adv_list, degenerate = adv if adv is not None else advantages(batch, settings)
    rewards = [s.reward for s in batch]
    summary = {
        "reward_mean": sum(rewards) / len(rewards),
        "samples": float(len(batch)),
        "groups": float(len({s.group for s in batch})),
        "degenerate_groups": float(degenerate),
        "signal_frac": sum(1 for a in adv_list if a != 0) / len(batch),
        "tokens": float(sum(len(s.token_ids) for s in batch)),
    }
    # zero-advantage samples (all-equal groups) would only add compute and dilute the token mean: leave them out
    used = [(s, a) for s, a in zip(batch, adv_list, strict=True) if a != 0 or s.token_bonus]
    if not used:
        return {**summary, "skipped": 1.0}
    batch = [s for s, _ in used]
    adv_of = [a for _, a in used]
    coef = pull_coef(model, settings)
    n = float(sum(len(s.token_ids) for s in batch))  # every completion token of the batch weighs the same
    # one of several data-parallel workers: its share of the rows; the gradients are summed below (recipes/parallel.py)
    mine = parallel.shard([len(s.prompt_token_ids) + len(s.token_ids) for s in batch])
    batch, adv_of = [batch[i] for i in mine], [adv_of[i] for i in mine]
    # micro-batches that fit the memory budget, their gradients accumulated (recipes/memory.py)
    parts = micro_batches([(len(s.prompt_token_ids), len(s.token_ids)) for s in batch], pull_shape(model, coef),
                          settings.memory_budget_mb) if batch else []
    params = [p for p in model.parameters() if p.requires_grad]
    workers = parallel.world()[1]
    moved = 0
    was_training = model.training
    model.train()
    metrics: dict[str, float] = {}
    try:
        for step in range(settings.steps_per_batch):
            optimizer.zero_grad(set_to_none=True)
            sums: defaultdict[str, float] = defaultdict(float)
            for part in parts:
                with checkpointing(model, part.checkpoint):
                    _accumulate(model, [batch[i] for i in part.rows], [adv_of[i] for i in part.rows], settings, n,
                                sums, coef)
            moved += parallel.all_reduce_grads(params)  # the whole batch's gradient on every worker
            parallel.all_reduce_sums(sums, model.device)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            warm_up(optimizer, int(getattr(settings, "warmup_steps", 0) or 0))
            optimizer.step()
            if step == 0:
                metrics = {
                    "loss": sums["pg_loss"] - settings.entropy_coef * sums["entropy"] + coef * sums["kl_ref"],
                    "pg_loss": sums["pg_loss"],
                    "entropy": sums["entropy"],
                    "ratio_mean": sums["ratio"],
                    "ratio_max": sums["ratio_max"],
                    "clip_frac": sums["clipped"],
                    # k3 estimator of KL(behaviour || current) per token
                    "kl": sums["kl"],
                    "grad_norm": float(grad_norm),
                    "micro_batches": float(len(parts)),
                    "checkpointed": float(sum(len(p.rows) for p in parts if p.checkpoint)),
                    # the pull toward the base: its coefficient as applied (0: none), and KL(current || base) per
                    # completion token, exact over the vocabulary, the loss's term before its weight
                    "kl_coef": coef,
                    **({"kl_ref": sums["kl_ref"]} if coef > 0 else {}),
                }
    finally:
        model.train(was_training)
    if workers > 1:  # this worker's share of the rows, and the gradient bytes it sent into the sums
        metrics.update(shard_samples=float(len(mine)), allreduce_bytes=float(moved))
    return {**summary, **metrics, "skipped": 0.0}


def _accumulate(model: Any, batch: list[Sample], adv_of: list[float], settings: OnlineRLSettings, n: float,
                sums: defaultdict[str, float], coef: float = 0.0) -> None:
    """Forward and backward of one micro-batch, its loss a share of the whole batch's (divided by the batch's
    token count ``n``, not its own): the accumulated gradient is the whole batch's. ``coef``: the weight of the
    pull toward the base (``pull_coef``). Adds its share of the step's metrics to ``sums``."""
    dev = model.device
    longest = max(len(s.token_ids) for s in batch)
    old = torch.zeros(len(batch), longest, device=dev)
    bonus = torch.zeros(len(batch), longest, device=dev)
    for row, s in enumerate(batch):
        old[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
        if s.token_bonus:
            bonus[row, : len(s.token_bonus)] = torch.tensor(s.token_bonus)
    adv = torch.tensor(adv_of, device=dev)[:, None] + bonus  # [B, T]
    out = completion_logprobs(model, batch)
    logp, entropy, tmask = out.logp, out.entropy(settings.entropy_coef != 0), out.mask
    log_ratio = (logp - old).masked_fill(~tmask, 0.0)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    pg_loss = -(surrogate * tmask).sum() / n
    mean_entropy = (entropy * tmask).sum() / n
    loss = pg_loss - settings.entropy_coef * mean_entropy
    if coef > 0:  # the pull toward the base: exact KL(current || base) at each completion position
        kl_ref = (kl_per_position(out.log_softmax, reference_log_softmax(model, batch)) * tmask).sum() / n
        loss = loss + coef * kl_ref
        sums["kl_ref"] += float(kl_ref.detach())
    loss.backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward is unannotated
    with torch.no_grad():
        is_clipped = ((ratio < 1 - settings.clip_low) & (adv < 0)) | ((ratio > 1 + settings.clip_high) & (adv > 0))
        sums["pg_loss"] += float(pg_loss)
        sums["entropy"] += float(mean_entropy)
        sums["ratio"] += float((ratio * tmask).sum() / n)
        sums["ratio_max"] = max(sums["ratio_max"], float(ratio.masked_fill(~tmask, 0).max()))
        sums["clipped"] += float((is_clipped & tmask).sum() / n)
        sums["kl"] += float((k3(log_ratio) * tmask).sum() / n)


def check_eval_family(settings: Any) -> None:
    """A gate that evaluates (floor, compare, regression) needs evaluation tasks, and ``eval_family`` must name a
    family of ``recipes/tasks.py``: else ``BadRequest`` naming the setting."""
    if settings.gate in ("floor", "compare", "regression") and not settings.eval_family:
        raise BadRequest(f"gate {settings.gate!r} needs evaluation tasks (recipe setting eval_family)",
                         param="settings.eval_family")
    if settings.eval_family:
        from recipes.tasks import get_family

        try:
            get_family(settings.eval_family)
        except ValueError as e:
            raise BadRequest(str(e), param="settings.eval_family") from None


def pull_coef(model: Any, settings: Any) -> float:
    """The weight of the pull toward the base that a step of ``model`` applies: the settings' ``kl_coef`` on a LoRA
    policy (the base is the model its adapter applies to). A policy training all its weights has no base in the
    trainer: there the recipe's default is inert (0) and any other value above 0 a ``ValueError``."""
    coef = float(getattr(settings, "kl_coef", 0.0))
    if coef == 0 or is_adapter(model):
        return coef
    if not explicit(settings, "kl_coef"):
        return 0.0
    raise ValueError("kl_coef pulls toward the model a LoRA adapter applies to, and this model trains all its weights "
                     "(it is below the size that gets adapters by default): set lora = true, or kl_coef = 0")


def pull_shape(model: Any, coef: float) -> Shape:
    """The memory estimate's shape of a step: with the pull toward the base, each completion position keeps twice
    the vocabulary-wide tensors (the base's log-softmax, the KL's terms for backward)."""
    shape = Shape.of(model)
    return replace(shape, vocab=2 * shape.vocab) if coef > 0 else shape


@torch.no_grad()
def reference_log_softmax(model: Any, batch: list[Sample]) -> torch.Tensor:
    """The base's log-softmax at each position predicting a completion token [B, T, V], as
    ``completion_logprobs``: the LoRA policy with its adapter switched off, no gradient."""
    with model.disable_adapter():
        return completion_logprobs(model, batch).log_softmax


def kl_per_position(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``KL(p || ref)`` in nats at each position [B, T] from log-softmaxes [B, T, V], exact over the vocabulary:
    unlike an estimate on the sampled token, it sees the mass an unsampled token (an early end) took from the base,
    and its gradient grows with the drift."""
    return (logp.exp() * (logp - ref)).sum(-1)


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator ``exp(x) - 1 - x`` of a KL per token, ``x = log q - log p`` on tokens sampled from
    ``p``: an unbiased, never-negative estimate of KL(p || q)."""
    return log_ratio.exp() - 1 - log_ratio


# --- sampling and evaluation ------------------------------------------------------------------------------------


def render_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt token ids exactly as the embedded engine makes them (chat template, generation prompt)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids  # tokenizer: Any
    return ids


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def generate(
    model: Any,
    prompts: list[list[int]],
    *,
    eos: set[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], list[float]]]:
    """Batched decoding like the engine's: for each prompt the sampled ids (EOS included) and their log-probs
    under the raw logits (temperature 1). ``temperature == 0`` is greedy."""
    from transformers import DynamicCache

    was_training = model.training
    model.eval()
    pad = model.config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    # (a peft model's forward takes **kwargs: ask the model it wraps which name its cache argument has)
    inner = model.get_base_model() if is_adapter(model) else model
    cache_arg = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
    live = torch.ones(len(prompts), dtype=torch.bool)
    step_ids, step_pos = ids, positions
    for _ in range(max_new_tokens):
        logits = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            use_cache=True,
            logits_to_keep=1,
            **{cache_arg: cache},
        ).logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        if temperature == 0:
            tokens = logits.argmax(-1)
        else:
            tokens = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        picked = logp.gather(-1, tokens[:, None])[:, 0]
        for row in torch.nonzero(live)[:, 0].tolist():
            t = int(tokens[row])
            out[row][0].append(t)
            out[row][1].append(float(picked[row]))
            if t in eos:
                live[row] = False
        if not live.any():
            break
        # finished rows keep decoding (cheaper than reshaping the cache for a few steps); their output is ignored
        step_ids = tokens[:, None]
        step_pos = step_pos[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
    model.train(was_training)
    return out


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: list[Task],
    family: TaskFamily,
    *,
    max_new_tokens: int = 8,
    exact: bool = True,
    batch_size: int = 64,
) -> float:
    """Mean score of greedy answers to ``tasks`` (through the engine's chat template). ``exact``: count only
    right answers (1/0, the stated metric); otherwise the verifier's score with partial credit."""
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    eos = eos_ids(model, tokenizer)
    total = 0.0
    for i in range(0, len(tasks), batch_size):
        chunk = tasks[i : i + batch_size]
        outs = generate(
            model, [render_prompt(tokenizer, t.prompt) for t in chunk], eos=eos, max_new_tokens=max_new_tokens,
            temperature=0,
        )
        for task, (ids, _) in zip(chunk, outs, strict=True):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            total += family.exact(task, text) if exact else family.score(task, text)
    return total / len(tasks)


# --- the recipe -------------------------------------------------------------------------------------------------


def _eval_scores(model: Any, tokenizer: Any, settings: EvalSettings) -> list[float]:
    """The gate's evaluation: greedy exact answers to the family's validation prompts (never trained on, and not
    the held-out ones a demo or benchmark reports at the end)."""
    from recipes.tasks import get_family

    assert settings.eval_family is not None
    family = get_family(settings.eval_family)
    tasks = family.validation(settings.eval_n, seed=settings.eval_seed)
    outs = generate(model, [render_prompt(tokenizer, t.prompt) for t in tasks], eos=eos_ids(model, tokenizer),
                    max_new_tokens=settings.max_new_tokens, temperature=0)
    return [family.exact(t, tokenizer.decode(ids, skip_special_tokens=True))
            for t, (ids, _) in zip(tasks, outs, strict=True)]


class OnlineRL(Recipe):
    """``online-rl``: the clipped, group-normalised policy gradient above, on explicitly scored exchanges.

    Eligible: a scored exchange served by a release at most ``max_staleness`` steps behind the head. A batch is
    the oldest ``batch_prompts * group_size`` of them. The worker keeps the model and optimizer of its last
    candidate in memory: when the next job's base is that candidate (the lineage goes on), training continues
    with the optimizer state intact; otherwise it loads the base release and starts a fresh optimizer. A batch
    whose groups all carry no signal is skipped (no optimizer step, nothing published, its receipts consumed:
    their rewards will not change)."""

    name = "online-rl"
    kind = "weights"
    source = "scores"
    behaviour_logprobs = True
    data_parallel = True  # recipes/parallel.py: train_step splits the rows and sums the gradients
    Settings = OnlineRLSettings

    @classmethod
    def check_settings(cls, settings: Any) -> None:
        super().check_settings(settings)
        check_eval_family(settings)
        for key in ("batch_prompts", "group_size", "steps_per_batch", "eval_n"):
            if getattr(settings, key) < 1:
                raise BadRequest(f"recipe online-rl setting {key} must be at least 1", param=f"settings.{key}")
        if settings.warmup_steps < 0:
            raise BadRequest("recipe online-rl setting warmup_steps must be 0 (none) or more",
                             param="settings.warmup_steps")
        check_eval_size(cls.name, settings, settings.eval_n, "eval_n")
        check_budget(cls.name, settings.memory_budget_mb)
        check_lora(cls.name, settings)
        check_pull(cls.name, settings)

    def eligible(self, record: ScoredExchange | FeedbackReport, *, head: Head, served_step: int | None) -> bool:
        return served_step is not None and head.step - served_step <= self.settings.max_staleness

    def batch(self, records: list[ScoredExchange]) -> list[ScoredExchange] | None:
        need = self.settings.batch_prompts * self.settings.group_size
        return records[:need] if len(records) >= need else None

    def samples(self, batch: list[ScoredExchange], model: Any, tokenizer: Any) -> list[Sample]:
        """The training samples of a batch of scored exchanges (a subclass may add per-token signal)."""
        return [Sample(prompt_token_ids=r.prompt_token_ids, token_ids=r.token_ids, logprobs=r.logprobs,
                       reward=r.score, group=hashlib.sha1(repr(r.prompt_token_ids).encode()).hexdigest())
                for r in batch]

    def train(self, job: TrainJob, state: dict[str, Any]) -> Candidate:
        from transformers import AutoTokenizer

        settings: OnlineRLSettings = self.settings
        t0 = time.perf_counter()
        if state.get("key") != job.base_key:
            state["tokenizer"] = AutoTokenizer.from_pretrained(job.model_path or job.base_path)
            with seeded(job.base_key):  # a fresh adapter's initial weights: the same wherever the step runs
                model = load_policy(job.base_path, job.model_path, settings, trainable=True, device=job.device)
            parallel.broadcast_params(model)  # data-parallel workers start from rank 0's weights
            state.update(model=model, optimizer=make_optimizer(model, settings), key=job.base_key)
        model, tokenizer = state["model"], state["tokenizer"]
        base_scores = None
        t_eval = time.perf_counter()
        evaluate = settings.eval_family and parallel.primary()  # one data-parallel worker evaluates for the gate
        if evaluate:  # the gate compares with the serving head, which the lineage may have moved past
            base_scores = job.head_scores or state.get("head_eval", {}).get(job.head_key)
            if base_scores is None:
                head = model if job.head_key == state["key"] else load_policy(
                    job.head_path, job.model_path, settings, trainable=False, device=job.device)
                base_scores = _eval_scores(head, tokenizer, settings)
                state["head_eval"] = {job.head_key: base_scores}  # only the head's is needed
        eval_s = time.perf_counter() - t_eval
        samples = self.samples(job.batch, model, tokenizer)
        t_train = time.perf_counter()
        model.train()
        metrics = train_step(model, samples, settings, state["optimizer"])  # its own steps_per_batch steps
        model.eval()
        t_save = time.perf_counter()
        metrics["train_s"] = round(t_save - t0, 3)  # loading and evaluating the base included
        if is_adapter(model) and not metrics.get("skipped"):  # how far the policy moved from its base (watchdog)
            metrics["kl_from_base"] = round(kl_from_base(model, samples), 6)
        check_drift_bound(model, settings)
        if metrics.get("skipped"):  # no sample carried signal: no optimizer step, the model in memory unchanged
            return Candidate(metrics=metrics, skipped="no signal: every group's rewards were equal")
        out = Path(job.work_dir)
        if is_adapter(model):  # a release holds only the adapter, naming the whole model it applies to
            metrics["adapter_bytes"] = save_adapter_candidate(model, out, job)
        else:
            model.save_pretrained(out, safe_serialization=True)
            source = Path(job.model_path or job.base_path)
            for f in source.iterdir():  # tokenizer and generation files travel with the weights
                if f.is_file() and not (out / f.name).exists() and not f.name.endswith((".safetensors", ".bin")):
                    shutil.copyfile(f, out / f.name)
        state["key"] = job.candidate_key  # if the lineage goes on, the next job continues from here
        metrics.update(step_s=round(t_save - t_train, 3), save_s=round(time.perf_counter() - t_save, 3))
        scores = None
        if evaluate:
            t_eval = time.perf_counter()
            scores = Scores(candidate=_eval_scores(model, tokenizer, settings), base=base_scores)
            metrics["eval_s"] = round(eval_s + time.perf_counter() - t_eval, 3)
        return Candidate(path=str(out), metrics=metrics, eval=scores)


# --- LoRA adapters as releases ------------------------------------------------------------------------------------


KL_ROWS = 8  # samples of the step's batch the drift is measured on (one at a time: V floats per token)


@torch.no_grad()
def kl_from_base(model: Any, samples: list[Sample]) -> float:
    """Mean per-token KL(policy || base) in nats over the completion positions of the first ``KL_ROWS`` samples
    of the step's batch, exact over the vocabulary: how far an adapter policy has moved from the whole model it
    applies to (its adapter switched off), on the kind of answers it is serving now. The watchdog holds candidates
    past the recipe's ``max_kl`` (daemon/watchdog.py). Data-parallel workers measure a share of the rows each."""
    total, tokens = 0.0, 0
    rows = samples[:KL_ROWS]
    for i in parallel.shard([len(s.prompt_token_ids) + len(s.token_ids) for s in rows]):
        out = completion_logprobs(model, [rows[i]])
        policy, mask = out.log_softmax, out.mask
        kl = kl_per_position(policy, reference_log_softmax(model, [rows[i]]))  # [1, T]
        total += float(kl[mask].sum())
        tokens += int(mask.sum())
    total, whole = parallel.total([total, float(tokens)], model.device)
    return total / max(whole, 1.0)


@contextlib.contextmanager
def seeded(key: str) -> Iterator[None]:
    """Torch's random state seeded from ``key`` (a content key) inside, restored after: a fresh LoRA adapter's
    initial weights are a function of the model it starts from, so the same base and batch make the same candidate
    in the local worker, one Ray actor or any number of data-parallel workers."""
    with torch.random.fork_rng():
        torch.manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") & (2**63 - 1))
        yield


def load_policy(path: str | Path, model_path: str | Path | None, settings: WeightsSettings, *,
                trainable: bool, device: str = "cpu") -> Any:
    """The policy a release or candidate directory holds, in float32: a whole model, or (``reef-adapter.json``)
    the whole model at ``model_path`` with that adapter, on ``device`` (``auto``: CUDA when there is one). With ``trainable``, the LoRA setting decides what
    trains: an adapter goes on training (the lineage continues it), a whole model gets fresh adapters when
    ``lora`` is true (or unset and the model has ``LORA_AUTO_PARAMS`` parameters or more); ``lora = false`` on an
    adapter merges it and trains all weights."""
    from transformers import AutoModelForCausalLM

    manifest = lora.read_dir(path)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # transformers wraps PreTrainedModel.to in a decorator whose type hides the signature (a device is valid)
    model = AutoModelForCausalLM.from_pretrained(Path(model_path or path) if manifest else Path(path),
                                                 dtype=torch.float32).to(device)  # type: ignore[arg-type]
    if manifest is not None:
        with _quiet_peft():
            model = _peft().PeftModel.from_pretrained(model, str(path),
                                                      is_trainable=trainable and settings.lora is not False)
        if settings.lora is False or not trainable:
            model = model.merge_and_unload()
    else:
        use = settings.lora if settings.lora is not None else sum(p.numel() for p in model.parameters()) >= \
            LORA_AUTO_PARAMS
        model = wrap_lora(model, settings) if trainable and use else model
    asked = [key for key in WHOLE_WEIGHTS_ONLY if getattr(settings, key, False)]
    if trainable and asked and is_adapter(model):  # an adapter leaves them frozen: refused, never inert
        raise ValueError(f"{asked[0]} = true trains whole weights, but this step trains a LoRA adapter (lora unset "
                         f"means adapters on models of {LORA_AUTO_PARAMS:,} parameters or more): set lora = false, "
                         f"or {asked[0]} = false")
    return model


# settings that train weights an adapter leaves frozen (a recipe refuses them with lora = true, a step with LoRA)
WHOLE_WEIGHTS_ONLY = ("train_embeddings", "train_final_norm")


def check_lora(recipe: str, settings: Any) -> None:
    """The LoRA settings a weights recipe shares with online-rl (``lora``, ``lora_rank``, ``lora_alpha``): a
    ``BadRequest`` naming the one that cannot work."""
    if settings.lora_rank < 1:
        raise BadRequest(f"recipe {recipe} setting lora_rank must be at least 1", param="settings.lora_rank")
    if not settings.lora_alpha > 0:
        raise BadRequest(f"recipe {recipe} setting lora_alpha must be above 0", param="settings.lora_alpha")
    for key in WHOLE_WEIGHTS_ONLY:
        if settings.lora is True and getattr(settings, key, False):
            raise BadRequest(f"recipe {recipe}: {key} trains whole weights, which lora = true leaves frozen; set "
                             f"lora = false to train them", param=f"settings.{key}")


def check_pull(recipe: str, settings: Any) -> None:
    """The pull toward the base and the drift bound every weights recipe shares (``kl_coef``, ``max_kl``): a
    ``BadRequest`` naming the one that cannot work. Both act on LoRA policies (the base is the model the adapter
    applies to): with ``lora = false`` their defaults are inert and another value is refused, never inert."""
    def refuse(key: str, why: str) -> BadRequest:
        return BadRequest(f"recipe {recipe} setting {key} {why}", param=f"settings.{key}")

    if not (settings.kl_coef >= 0 and math.isfinite(settings.kl_coef)):
        raise refuse("kl_coef", "must be a finite number, 0 or more (0: no pull toward the base)")
    if settings.max_kl is not None and not (settings.max_kl > 0 and math.isfinite(settings.max_kl)):
        raise refuse("max_kl", "must be a finite number above 0 (null: measured, never held)")
    if settings.lora is False:
        for key, off in (("kl_coef", "0"), ("max_kl", "null")):
            value = getattr(settings, key)
            if value and explicit(settings, key):
                raise refuse(key, f"needs LoRA adapters (the base it is measured against is the model they apply "
                                  f"to, with the adapter off): leave lora unset or true, or set {key} = {off}")


def check_drift_bound(model: Any, settings: Any) -> None:
    """A ``max_kl`` other than the default on a policy training all its weights (too small for adapters by
    default): a ``ValueError``, since nothing is measured there to hold it (the default is inert)."""
    bound = getattr(settings, "max_kl", None)
    if bound is not None and not is_adapter(model) and explicit(settings, "max_kl"):
        raise ValueError("max_kl is measured on LoRA policies only, and this model trains all its weights (it is "
                         "below the size that gets adapters by default): set lora = true, or max_kl = null")


def save_adapter_candidate(model: Any, out: Path, job: TrainJob) -> int:
    """Write an adapter candidate into ``out``, naming the whole model it applies to (``job.model_key``, a release
    holding it); returns the adapter tensors' size in bytes."""
    if not (job.model_key and job.model_release):
        raise ValueError("a LoRA candidate names its base model: the job has no model_key / model_release")
    save_adapter(model, out, lora.AdapterManifest(job.model_key, job.model_release))
    return (out / lora.WEIGHTS).stat().st_size


def save_adapter(model: Any, out: Path, manifest: lora.AdapterManifest) -> None:
    """peft's two files (written here so that they are a function of the adapter only: no model card, no local
    paths, sorted keys) and Reef's manifest."""
    from safetensors.torch import save_file

    peft = _peft()
    name = model.active_adapter
    tensors = {k: v.detach().contiguous() for k, v in peft.get_peft_model_state_dict(
        model, adapter_name=name, save_embedding_layers=False).items()}
    save_file(tensors, str(out / lora.WEIGHTS), metadata={"format": "pt"})
    config = model.peft_config[name].to_dict()
    config.update(base_model_name_or_path=f"reef:{manifest.base_content_id}", inference_mode=True, revision=None)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (out / lora.CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    lora.write_dir(out, manifest)
