"""The trainer's peak resident memory for a weights recipe's default step on SmolLM2-135M-Instruct (issue 23): the
batch in micro-batches sized from ``memory_budget_mb`` (now) against the whole batch at once (before), as a ratio.

Each run is a fresh trainer worker process (``daemon/trainer/worker.py``, the daemon's own) given a real
``TrainJob``: first a warm-up step on a short batch (imports, the model, its LoRA adapters, the optimizer), then
the recipe's default batch (``--recipe``: online-rl 4 x 8 = 32 samples, openclaw-rl 8 turns, sao 1 rollout,
ttt-discover 16 sibling attempts) with prompts of ``--prompt`` tokens (an agent's request is a few hundred) and
answers of ``--answer`` tokens, at the recipe's default settings (LoRA, as on every real model). The worker
reports its peak RSS (``trainer_peak_rss_mb``); the step's own cost is the rise of that peak over the warm-up's.

"before" is the same step with the whole batch in one micro-batch, as every step ran before (the output head was
already applied at the completion positions only in online-rl; ``--full-logits`` also puts back the
full-vocabulary logits over every position, as sao had). The whole default batch that way needs far more than
this machine has (the kernel killed the worker at 23 GB on a 24 GiB machine), so by default "before" runs
``--before-samples`` samples and scales its rise linearly to the batch (activations are per sample; said in the
output). ``--before-samples N`` with N the batch measures it whole where the memory exists.

Run: ``python bench/trainer_memory.py [--recipe online-rl] [--model DIR] [--prompt 300] [--answer 60]
[--skip-before]``. Measured so (300 + 60 tokens, one thread, 2 cores at load 2-4, 2026-12-04):

    online-rl   : peak 1912 MB (warm 1149 MB, the step +763 MB) in 32 micro-batches, 192 s
                  before: peak 14887 MB, the whole batch at once (4 samples measured (+1700 MB), scaled to 32)
                  ratio : before / after peak = 7.8x; the step's own rise 18x
    openclaw-rl : peak 1984 MB (warm 1311 MB, the step +673 MB) in 8 micro-batches, 76 s
    sao         : peak 1886 MB (warm 1298 MB, the step +588 MB) in 1 micro-batch, 4 s
    ttt-discover: peak 1916 MB (warm 1288 MB, the step +629 MB) in 16 micro-batches, 50 s
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FULL_LOGITS = '''
import recipes.logprobs as logprobs
from recipes.online_rl import OnlineRL


class FullLogits(OnlineRL):
    """online-rl with the output head over every position (the full-vocabulary logits), for the bench only."""

    def train(self, job, state):
        logprobs._decoder_and_head = lambda model: None
        return super().train(job, state)
'''


def records(n: int, prompt: int, answer: int, vocab: int, seed: int = 0, group: int = 8) -> list[Any]:
    """``n`` scored exchanges, ``group`` samples per prompt, rewards alternating (every group carries signal)."""
    from recipes.base import FeedbackReport, ScoredExchange

    rng = random.Random(seed)
    group = max(1, group)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt)] for _ in range(max(1, -(-n // group)))]
    return [ScoredExchange(id=f"r{i}", release_id=None, prompt_token_ids=prompts[(i // group) % len(prompts)],
                           token_ids=[rng.randrange(100, vocab) for _ in range(answer)], logprobs=[-10.0] * answer,
                           report=FeedbackReport(id=f"rep_{i}", seq=i + 1, score=float(i % 2)))
            for i in range(n)]


def default_batch(recipe: str) -> tuple[int, int]:
    """The samples of one default training step of ``recipe`` and the samples per prompt group."""
    from recipes import load_recipe

    s = load_recipe(recipe).Settings()
    if recipe == "sao":
        return s.batch_size, 1
    if recipe == "ttt-discover":
        return s.group_size * s.groups_per_step, s.group_size
    return s.batch_prompts * s.group_size, s.group_size


def run(model: Path, out: Path, *, samples: int, prompt: int, answer: int, threads: int, settings: dict[str, Any],
        recipe: str = "online-rl", recipe_paths: list[str] | None = None) -> dict[str, float]:
    """A fresh worker: a warm-up step, then the measured one. Its peak RSS after each (MB), the rise, the time."""
    from daemon.trainer.worker import TrainerClient
    from recipes import load_recipe
    from recipes.base import TrainJob

    config = __import__("json").loads((model / "config.json").read_text())
    settings_class = load_recipe("online-rl" if recipe_paths else recipe).Settings
    full = dataclasses.asdict(settings_class(**settings))
    _, group = default_batch("online-rl" if recipe_paths else recipe)
    trainer = TrainerClient(threads=threads, recipe_paths=recipe_paths)

    def job(n: int, batch: list[dict[str, Any]], base: str) -> TrainJob:
        return TrainJob(id=f"job{n}", recipe=recipe, settings=full, batch=batch, base_key=base,
                        base_path=str(model), head_key="base", head_path=str(model), candidate_key=f"c{n}",
                        model_key="base", model_release="base", model_path=str(model),
                        recipe_paths=list(recipe_paths or []))

    try:
        warm = trainer._run(job(1, records(8, 16, 4, config["vocab_size"], seed=1), "base"), out / "warm")
        t0 = time.perf_counter()
        step = trainer._run(job(2, records(samples, prompt, answer, config["vocab_size"], group=group), "c1"),
                            out / "step")
        seconds = time.perf_counter() - t0
    finally:
        trainer.close()
    w, p = warm.metrics["trainer_peak_rss_mb"], step.metrics["trainer_peak_rss_mb"]
    return {"warm_mb": w, "peak_mb": p, "rise_mb": max(0.0, p - w), "seconds": seconds,
            "micro_batches": step.metrics.get("micro_batches", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="online-rl", choices=["online-rl", "openclaw-rl", "sao", "ttt-discover"],
                    help="the weights recipe whose default step is measured")
    ap.add_argument("--model", type=Path, help="a SmolLM2 model directory (default: made here, about 30 s)")
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens per sample")
    ap.add_argument("--answer", type=int, default=60, help="answer tokens per sample")
    ap.add_argument("--threads", type=int, default=1, help="the worker's torch threads (the daemon's default: 1)")
    ap.add_argument("--steps-per-batch", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--before-samples", type=int, default=4, help="samples 'before' runs at once (then scaled)")
    ap.add_argument("--full-logits", action="store_true", help="'before' also computes full-vocabulary logits")
    ap.add_argument("--skip-before", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="reef-trainer-memory-"))
    try:
        measure(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(args: argparse.Namespace, tmp: Path) -> None:
    from recipes import load_recipe

    model = args.model
    if model is None:
        from daemon.smollm2 import init_smollm2

        model = init_smollm2(tmp / "smollm2")
    defaults = load_recipe(args.recipe).Settings()
    batch, group = default_batch(args.recipe)
    extra = {} if args.steps_per_batch is None else {"steps_per_batch": args.steps_per_batch}
    common = {"prompt": args.prompt, "answer": args.answer, "threads": args.threads}
    print(f"{args.recipe} defaults on {model.name}: {batch} samples of {args.prompt} prompt + {args.answer} answer "
          f"tokens, LoRA rank {defaults.lora_rank}, memory_budget_mb {defaults.memory_budget_mb}, "
          f"{args.threads} threads", flush=True)
    after = run(model, tmp / "after", samples=batch, settings=extra, recipe=args.recipe, **common)
    print(f"after : peak {after['peak_mb']:.0f} MB (warm {after['warm_mb']:.0f} MB, the step +{after['rise_mb']:.0f}"
          f" MB) in {after['micro_batches']:.0f} micro-batches, {after['seconds']:.0f} s", flush=True)
    if args.skip_before:
        return
    n = min(args.before_samples, batch)
    recipe, paths = args.recipe, None
    if args.full_logits:
        if args.recipe != "online-rl":
            raise SystemExit("--full-logits is for online-rl only")
        (tmp / "bench_recipes").mkdir()
        (tmp / "bench_recipes" / "full_logits.py").write_text(textwrap.dedent(FULL_LOGITS))
        recipe, paths = "full_logits:FullLogits", [str(tmp / "bench_recipes")]
    before = run(model, tmp / "before", samples=n, settings={**extra, "memory_budget_mb": 1 << 30}, recipe=recipe,
                 recipe_paths=paths, **common)
    scaled = before["warm_mb"] + before["rise_mb"] * batch / n
    how = "measured" if n == batch else f"{n} samples measured (+{before['rise_mb']:.0f} MB), scaled to {batch}"
    print(f"before: peak {scaled:.0f} MB, the whole batch at once{' with full logits' if args.full_logits else ''}"
          f" ({how}), {before['seconds']:.0f} s for {n}", flush=True)
    print(f"ratio : before / after peak = {scaled / after['peak_mb']:.1f}x; "
          f"the step's own rise {before['rise_mb'] * batch / n / max(after['rise_mb'], 1):.0f}x")


if __name__ == "__main__":
    main()
