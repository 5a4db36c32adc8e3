"""The supervised warm-up that gives the tiny model a starting skill on a task family (the ``reef demo`` model,
``tiny-demo``): it lives next to the task families it trains on, and builds on ``daemon/models.py``'s builder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

BUILT_IN = {"tiny": None, "tiny-demo": "say"}  # the models Reef builds itself, and the family each is warmed on


def init_built_in(dest: Path, name: str, *, seed: int = 0, progress: Callable[[str], None] | None = None) -> Path:
    """Build a built-in model (``tiny``, or ``tiny-demo``: the demo shape warmed up on its family) into ``dest``."""
    from daemon.models import DEMO_CONFIG, init_tiny

    family = BUILT_IN[name]
    if family is None:
        return init_tiny(dest, seed=seed, progress=progress)

    def warm(tokenizer: Any, model: Any) -> None:
        warm_up(tokenizer, model, family, seed=seed, progress=progress)

    return init_tiny(dest, seed=seed, progress=progress, config=DEMO_CONFIG, transform=warm)


WARMUP_STEPS = 400  # the most supervised steps; ``WARMUP_TARGET`` usually stops it well before


WARMUP_TARGET = 0.1  # greedy exact-match on the family's validation prompts at which the warm-up stops


def warm_up(
    tokenizer: Any,
    model: Any,
    family: Any,
    *,
    steps: int = WARMUP_STEPS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    target: float | None = WARMUP_TARGET,
    batch_size: int = 32,
    lr: float = 3e-3,
    embed_std: float | None = 0.5,
    threads: int = 1,
) -> dict[str, Any]:
    """A short supervised fine-tune on ``family``'s training prompts (a task family or its name), in place.

    It gives the random model a small starting skill that reinforcement learning can then grow (policy gradient
    from random weights finds no reward to learn from). Answers are the family's reference answers tokenised
    plainly plus ``<|im_end|>``, prompts rendered with the chat template exactly as the engine does; the loss is
    cross-entropy on the answer tokens. It stops after ``steps`` steps, or earlier once greedy exact-match on 64
    training prompts (checked every 10 steps) reaches ``target`` (None: never), so a seed's start is a skill
    level rather than a step count that lands on either side of a fast learning phase.

    The token embeddings (tied with the output head) are rescaled to std ``embed_std`` first and never trained:
    words the model never sees in training keep the same footing as the trained ones, so the skill (copy, then
    stop) transfers to them; at the default init (std 0.02) frozen embeddings give logits too flat for
    temperature-1 sampling to hit an answer. Runs on ``threads`` torch threads (the process-wide setting is
    restored after): the model is too small for more threads to help, and on a busy 2-core machine two threads
    made it ten times slower (128 s against 11 s). Deterministic for a seed; about 10 s for the demo model.
    Returns what it did (steps, seconds, loss, probe_exact).
    """
    import time

    import torch

    from recipes.online_rl import evaluate, render_prompt
    from recipes.tasks import TaskFamily, get_family

    fam: TaskFamily = get_family(family) if isinstance(family, str) else family
    say = progress or (lambda _msg: None)
    start = time.monotonic()
    tasks = fam.train_tasks(seed)
    try:
        probe = fam.validation(64, seed)
    except NotImplementedError:
        probe = tasks[:64]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = model.config.pad_token_id or 0
    embeddings = model.get_input_embeddings().weight
    if embed_std is not None:
        with torch.no_grad():
            embeddings.mul_(embed_std / float(embeddings.std()))
    embeddings.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    done, loss, exact = 0, float("nan"), 0.0
    encoded: dict[Any, tuple[list[int], list[int]]] = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
            model.train()
            for step in range(steps):
                batch = [tasks[(step * batch_size + k) % len(tasks)] for k in range(batch_size)]
                seqs = []
                for task in batch:
                    if task not in encoded:  # the chat template is slow next to a step of this model
                        answer = tokenizer.backend_tokenizer.encode(fam.target(task), add_special_tokens=False).ids
                        encoded[task] = (render_prompt(tokenizer, task.prompt), answer + [eos])
                    seqs.append(encoded[task])
                width = max(len(p) + len(a) for p, a in seqs)
                ids = torch.full((batch_size, width), pad, dtype=torch.long)
                mask = torch.zeros((batch_size, width), dtype=torch.long)
                labels = torch.full((batch_size, width), -100, dtype=torch.long)
                for row, (p, a) in enumerate(seqs):
                    ids[row, : len(p) + len(a)] = torch.tensor(p + a)
                    mask[row, : len(p) + len(a)] = 1
                    labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                optimizer.step()
                done, loss = step + 1, out.loss.item()
                if target is not None and done % 5 == 0:
                    exact = evaluate(model, tokenizer, probe, fam)
                    say(f"warm-up step {done}: loss {loss:.3f}, validation exact {exact:.2f}")
                    if exact >= target:
                        break
                    model.train()
        if target is None:
            exact = evaluate(model, tokenizer, probe, fam)
    finally:
        torch.set_num_threads(threads_before)
        embeddings.requires_grad_(True)
        model.eval()
    return {
        "family": fam.name,
        "steps": done,
        "seconds": round(time.monotonic() - start, 2),
        "loss": loss,
        "probe_exact": exact,
        "embed_std": embed_std,
    }
