"""The per-token forward every weights recipe uses: a batch of scored samples through a model, read at the
positions that predict a completion token (``completion_logprobs``): the log-softmax over the vocabulary there, the
sampled tokens' log-probs, their mask, and on request the last hidden states (sao's critic reads them).

The output head runs only at those positions when the model is a plain decoder plus head (``_decoder_and_head``):
a real vocabulary (SmolLM2: 49,152) over every prompt position was 7 GB for a batch of 64 answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass
class Sample:
    """One scored exchange, as the daemon records it."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # sampled, EOS included when the model stopped
    logprobs: list[float]  # behaviour log-probs of ``token_ids`` (raw logits, temperature 1)
    reward: float
    group: str  # same prompt, same group
    # per-token additions to the advantage (hindsight hints: teacher minus behaviour log-prob), or None
    token_bonus: list[float] | None = None


def _padded(batch: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids [B, L] (right-padded), attention mask, and for the completion tokens: targets, starts."""
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in batch]
    width = max(lengths)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        seq = s.prompt_token_ids + s.token_ids
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    starts = torch.tensor([len(s.prompt_token_ids) for s in batch])
    return ids, mask, starts, torch.tensor(lengths)


class Completions(NamedTuple):
    """A batch's completion tokens under a model (``completion_logprobs``), every recipe's one per-token forward."""

    log_softmax: torch.Tensor  # [B, T, V] over the vocabulary, at each position predicting a completion token
    logp: torch.Tensor  # [B, T] the log-prob of the token sampled there (with grad)
    mask: torch.Tensor  # [B, T] real (not padding) positions
    hidden: torch.Tensor | None  # [B, T, H] the last hidden state at those positions (``hidden=True``), else None

    def entropy(self, grad: bool = True) -> torch.Tensor:
        """[B, T]; ``grad=False``: no grad (nothing vocabulary-wide is kept for it)."""
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            return -(self.log_softmax.exp() * self.log_softmax).sum(-1)


def completion_logprobs(model: Any, batch: list[Sample], *, hidden: bool = False) -> Completions:
    """One forward of ``model`` over the batch, read at the positions that predict a completion token."""
    pad = model.config.pad_token_id or 0
    dev = model.device
    ids, mask, starts, lengths = (t.to(dev) for t in _padded(batch, pad))
    longest = max(len(s.token_ids) for s in batch)
    # positions predicting completion token t of row b: starts[b] - 1 + t
    pos = starts[:, None] - 1 + torch.arange(longest, device=dev)[None, :]
    tmask = pos < (lengths[:, None] - 1)
    pos = pos.clamp(max=ids.shape[1] - 2)
    rows = torch.arange(len(batch), device=dev)[:, None]
    parts = _decoder_and_head(model)
    if parts is None:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=hidden, use_cache=False)
        picked = out.logits.float()[rows, pos]  # [B, T, V]
        states = out.hidden_states[-1][rows, pos] if hidden else None
    else:  # the output head only where a completion token is predicted (not over every prompt position)
        decoder, head = parts
        states = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[rows, pos]  # [B, T, H]
        picked = head(states).float()
    log_softmax = torch.log_softmax(picked, dim=-1)
    logp = log_softmax.gather(-1, ids[rows, pos + 1][..., None])[..., 0]
    return Completions(log_softmax, logp, tmask, states if hidden else None)


def _decoder_and_head(model: Any) -> tuple[Any, Any] | None:
    """The decoder body and output head of a causal LM whose logits are just ``head(decoder(...))`` (no logit
    scaling or soft-capping), or None. Why: a real model's vocabulary is large (SmolLM2: 49152), and the logits
    of every prompt position (a chat template's system prompt included) cost more memory and time than the
    completion tokens' that training needs (measured: 7 GB for a batch of 64 SmolLM2 answers)."""
    base = model.get_base_model() if is_adapter(model) else model
    config = base.config
    if getattr(config, "final_logit_softcapping", None) is not None or getattr(config, "logit_scale", None) is not None:
        return None
    get_decoder, head = getattr(base, "get_decoder", None), base.get_output_embeddings()
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


def is_adapter(model: Any) -> bool:
    return hasattr(model, "peft_config")
