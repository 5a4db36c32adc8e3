"""Data-parallel training steps: what a weights recipe's step does differently when it runs as one of several
workers (``trainer_workers``: Ray Train's ``TorchTrainer`` sets up ``torch.distributed``, gloo on CPU, NCCL on GPU;
``daemon/trainer/ray_parallel.py``). Outside such a group every function here is the identity, so the local worker,
one Ray actor and N workers run the same recipe code.

Design choices:
- A plain all-reduce of the trained parameters' gradients (one flat tensor, summed), not DDP: a step accumulates
  micro-batches of its own (``recipes/memory.py``) and clips the global gradient norm, and LoRA leaves almost every
  weight frozen. The summed gradient before the clip is the one a single worker would have accumulated over the
  whole batch, so the clip and the optimizer step are the same on every worker and their weights stay equal without
  being sent (a LoRA step on SmolLM2 sums 9.8 MB: 2.4M float32 gradients).
- Each worker takes its share of the rows (longest first, dealt round-robin, so the token counts stay even); the
  loss is divided by the whole batch's token count, so a share's gradient is its part of the sum.
- Advantages, which rows carry signal, and the batch's summary are computed on the whole batch by every worker
  (no forward pass); only the forward and backward passes are split.
- The trained weights are broadcast from rank 0 once a worker loads its policy (as DDP does at construction): the
  workers start equal whatever their random state.
- Only rank 0 evaluates for the gate (``primary``); its candidate is the step's (the others' are checked equal to
  it, ``daemon/trainer/ray_parallel.py``).
"""

from __future__ import annotations

from typing import Any

import torch

SUMMED = ("pg_loss", "entropy", "ratio", "clipped", "kl", "kl_ref")  # metric sums over a step's tokens
LARGEST = ("ratio_max",)


def _dist() -> Any:
    """``torch.distributed`` when this process is one worker of a group, else None."""
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def world() -> tuple[int, int]:
    """(this worker's rank, the number of workers); (0, 1) outside a group."""
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


def primary() -> bool:
    """Whether this worker's candidate is the step's (rank 0, or the only worker)."""
    return world()[0] == 0


def shard(lengths: list[int]) -> list[int]:
    """The rows (indices into ``lengths``, each a row's token count) this worker trains on: every row once across
    the workers, the longest dealt first, round-robin."""
    rank, size = world()
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return sorted(order[rank::size])


def all_reduce_grads(params: list[torch.Tensor]) -> int:
    """Sum the gradients of ``params`` over the workers (a worker whose share was empty adds zeros); returns the
    bytes this worker sent into the reduction (0 outside a group)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1 or not params:
        return 0
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n
    return flat.numel() * flat.element_size()


def all_reduce_sums(sums: dict[str, float], device: Any = "cpu") -> None:
    """The step's metric sums over every worker's rows (``SUMMED`` added, ``LARGEST`` the largest), in place;
    ``device``: the model's."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return
    added = torch.tensor([float(sums.get(k, 0.0)) for k in SUMMED], dtype=torch.float64, device=device)
    dist.all_reduce(added, op=dist.ReduceOp.SUM)
    largest = torch.tensor([float(sums.get(k, 0.0)) for k in LARGEST], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    for key, value in zip(SUMMED + LARGEST, [*added.tolist(), *largest.tolist()], strict=True):
        if key in sums or value:
            sums[key] = value


def total(values: list[float], device: Any = "cpu") -> list[float]:
    """Each of ``values`` summed over the workers (as they are outside a group); ``device``: the model's (NCCL
    reduces tensors on the GPU only)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return values
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return [float(v) for v in summed.tolist()]


def broadcast_params(model: Any) -> None:
    """Rank 0's trained weights on every worker (once, after loading the policy)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return
    for p in model.parameters():
        if p.requires_grad:
            dist.broadcast(p.data, src=0)
