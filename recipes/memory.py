"""The training step's memory: what one sample's forward and backward keep, and micro-batches that fit a budget.

Why: the activations a step keeps for backward grow with every token of every sample. online-rl's default batch
(8 prompts x 8 samples) of agent-like prompts (300 tokens) with 60-token answers on SmolLM2-135M (LoRA) keeps
about 2 MB a token, some 45 GB for the whole batch at once; the kernel killed the trainer at 23 GB. A step now
runs its batch in micro-batches whose estimated cost fits the recipe's ``memory_budget_mb`` and accumulates their
gradients: the loss is a sum over the batch's tokens divided by their count, so the update is the same. Measured
with ``bench/trainer_memory.py`` (the default batch, 300 + 60 tokens, SmolLM2, LoRA): the trainer's peak RSS
1.93 GB at the default ``memory_budget_mb = 1024`` (1.15 GB of it the model, its adapters and the runtime),
against 3.1 GB more for every 4 samples at once before (51 GB for the batch, scaled).

The estimate, float32, for a row padded to ``width`` tokens with ``answer`` completion positions:

- per token and decoder layer, what a Llama-style layer keeps for backward: about 12 hidden-wide vectors (norm
  inputs and outputs, q/k/v/o, the rotary copies, the residuals) and 4 MLP-wide ones (gate, up, activation,
  product); with eager attention also the attention weights (heads x width, with their softmax and dropout);
- per completion position, the output head's logits, their log-softmax and one transient (vocabulary-wide): the
  head runs only where a completion token is predicted (``recipes/online_rl.py``);
- ``SLACK`` over that count: the allocator's and what the count misses (measured on SmolLM2 a token took 1.7-2.2
  MB where the count says 1.6 MB).

Micro-batches are filled longest row first (less padding), as many rows as fit. A row too long for the budget on
its own (an agent's prompt of thousands of tokens) runs with gradient checkpointing: each layer keeps only its
input (one hidden-wide vector per token) and is recomputed during backward, one layer's activations alive at a time
(about a third more compute, for those rows only; measured on SmolLM2 with a 300-token prompt: +212 MB a sample
instead of +625 MB). A row that does not fit even so is a ``BudgetTooSmall`` naming both numbers: the step fails
with that reason rather than being killed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MB = 1 << 20
SLACK = 1.5  # measured bytes over counted bytes, rounded up (see the module docstring)
# below this not even one short exchange fits on the smallest model Reef trains: a 32-token prompt and an 8-token
# answer are 1.4 MB on the tiny test model by this estimate (on SmolLM2-135M: 96 MB; 360 tokens: 860 MB)
MIN_BUDGET_MB = 2


class BudgetTooSmall(ValueError):
    """One sample alone needs more than the memory budget."""


@dataclass(frozen=True)
class Shape:
    """What the estimate reads from a causal LM's config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    eager: bool  # eager attention keeps the attention weights (heads x width per token and layer)

    @classmethod
    def of(cls, model: Any) -> Shape:
        c = model.config
        hidden = int(c.hidden_size)
        return cls(layers=int(c.num_hidden_layers), hidden=hidden,
                   intermediate=int(getattr(c, "intermediate_size", None) or 4 * hidden),
                   heads=int(getattr(c, "num_attention_heads", 1)), vocab=int(c.vocab_size),
                   eager=getattr(c, "_attn_implementation", "eager") == "eager")  # pragma: no mutate (no implementation sorts before eager: <= is ==)


def row_bytes(shape: Shape, width: int, answer: int, checkpoint: bool = False) -> int:
    """Estimated bytes one row of ``width`` tokens (``answer`` of them completion positions) keeps for backward;
    ``checkpoint``: with gradient checkpointing (every layer's input kept, one layer's activations at a time)."""
    layer = 12 * shape.hidden + 4 * shape.intermediate + (3 * shape.heads * width if shape.eager else 0)
    per_token = shape.layers * shape.hidden + layer if checkpoint else shape.layers * layer
    return int(SLACK * 4 * (width * per_token + answer * 3 * shape.vocab))


@dataclass
class MicroBatch:
    rows: list[int]  # indices into the batch
    checkpoint: bool  # run with gradient checkpointing (its rows are too long for the budget without)


def check_budget(recipe: str, budget_mb: int) -> None:
    """The settings check: a budget below ``MIN_BUDGET_MB`` holds no sample at all."""
    from daemon.errors import BadRequest

    if budget_mb < MIN_BUDGET_MB:
        raise BadRequest(f"recipe {recipe} setting memory_budget_mb {budget_mb} is too small for even one sample "
                         f"(at least {MIN_BUDGET_MB} MB; SmolLM2 needs about 2 MB per token of prompt and answer)",
                         param="settings.memory_budget_mb")


def micro_batches(rows: list[tuple[int, int]], shape: Shape, budget_mb: int) -> list[MicroBatch]:
    """Split rows ``(prompt tokens, answer tokens)`` into micro-batches whose padded cost fits ``budget_mb``,
    longest first; rows too long for it run with gradient checkpointing. Raises ``BudgetTooSmall`` when a row
    does not fit even so."""
    budget = budget_mb * MB
    order = sorted(range(len(rows)), key=lambda i: (-(rows[i][0] + rows[i][1]), i))
    out: list[MicroBatch] = []
    width = answer = 0  # pragma: no mutate (set by the first row before any read)
    for i in order:
        p, a = rows[i]
        checkpoint = row_bytes(shape, p + a, a) > budget
        if checkpoint and row_bytes(shape, p + a, a, checkpoint=True) > budget:
            need = -(-row_bytes(shape, p + a, a, checkpoint=True) // MB)
            raise BudgetTooSmall(
                f"memory_budget_mb {budget_mb} is too small for one sample of this batch: {p} prompt and {a} answer "
                f"tokens need about {need} MB on this model (raise memory_budget_mb, or shorten the prompts)")
        if out and out[-1].checkpoint == checkpoint:  # pragma: no mutate (a plain row never fits at a checkpointed batch's width and answer, nor one after a plain batch: >= is ==; is between bools is ==)
            w, t = max(width, p + a), max(answer, a)  # pragma: no mutate (rows come longest first: the first row's width is the widest)
            if (len(out[-1].rows) + 1) * row_bytes(shape, w, t, checkpoint) <= budget:
                out[-1].rows.append(i)
                width, answer = w, t
                continue
        out.append(MicroBatch([i], checkpoint))
        width, answer = p + a, a
    return out


@contextlib.contextmanager
def checkpointing(model: Any, on: bool) -> Iterator[None]:
    """Gradient checkpointing on ``model`` (a peft model's base) for the forward and backward inside, if ``on``."""
    if not on:
        yield
        return
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    kwargs = {"use_reentrant": False}  # no need for inputs that require grad (the embeddings are frozen)
    if hasattr(base, "activation_checkpointing_enable"):  # transformers 5.2x's name; the older one warns there
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        disable = base.activation_checkpointing_disable
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        disable = base.gradient_checkpointing_disable
    try:
        yield
    finally:
        disable()
