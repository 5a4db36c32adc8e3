"""Tune online RL on a real model's preference, in-process (no daemon), on one torch thread.

Loads a Hugging Face model directory (SmolLM2: ``reef model init smollm2``, then ``~/.reef/models/smollm2``),
puts LoRA adapters on it as the ``online-rl`` recipe does, and loops: ``batch_prompts`` training questions of a
task family, ``group_size`` answers each at temperature 1 from the current weights, scored by the family's
verifier, one ``train_step``; every ``--eval-every`` steps the greedy exact reward on held-out questions. Prints
the curve with wall time and the load average (the machine may be shared).

    .venv/bin/python bench/preference_offline.py --model-dir ~/.reef/models/smollm2 --family yes-no --lr 3e-3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from recipes.online_rl import (  # noqa: E402
    OnlineRLSettings,
    Sample,
    eos_ids,
    evaluate,
    generate,
    make_optimizer,
    render_prompt,
    train_step,
    wrap_lora,
)
from recipes.tasks import get_family  # noqa: E402


class PreferWord:
    """Another family's prompts, scored by whether the answer contains ``word`` (punctuation and case ignored)."""

    def __init__(self, prompts: object, word: str) -> None:
        self.prompts, self.word = prompts, word.lower()

    def __getattr__(self, name: str) -> object:  # sample, held_out, ...: the prompts' family
        return getattr(self.prompts, name)

    def score(self, task: object, completion: str) -> float:
        return float(self.word in {w.strip(".,;:!?\"'`*").lower() for w in completion.split()})

    def exact(self, task: object, completion: str) -> float:
        return self.score(task, completion)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--family", default="yes-no")
    p.add_argument("--prefer-word", default="", help="score the family's prompts by another preference instead: "
                   "1 when the answer contains this word (an untuned verifier, as tests/test_demo_real_model.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=300, help="wall-clock limit, evaluation included")
    p.add_argument("--held-out", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    for f in dataclasses.fields(OnlineRLSettings):
        if f.type in ("float", "int"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=float if f.type == "float" else int)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(OnlineRLSettings)
                 if getattr(args, f.name, None) is not None}
    settings = OnlineRLSettings(**overrides)
    print(f"settings: {settings}", flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = wrap_lora(AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32), settings)
    optimizer = make_optimizer(model, settings)
    family = get_family(args.family)
    if args.prefer_word:
        family = PreferWord(family, args.prefer_word)
    held = family.held_out(args.held_out, seed=args.seed)
    eos = eos_ids(model, tokenizer)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.monotonic()
    start = evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens)
    print(f"   0.0s step    0 held-out {start:.3f} load {os.getloadavg()[0]:.2f}", flush=True)
    step = 0
    while time.monotonic() - t0 < args.seconds:
        tasks = [family.sample(rng) for _ in range(settings.batch_prompts)]
        prompts = [render_prompt(tokenizer, t.prompt) for t in tasks]
        rows = [i for i in range(len(tasks)) for _ in range(settings.group_size)]
        ts = time.monotonic()
        outs = generate(model, [prompts[i] for i in rows], eos=eos, max_new_tokens=settings.max_new_tokens,
                        temperature=1.0, generator=gen)
        batch = [Sample(prompts[i], ids, lps, family.score(tasks[i], tokenizer.decode(ids, skip_special_tokens=True)),
                        group=f"{step}:{i}") for i, (ids, lps) in zip(rows, outs, strict=True)]
        tt = time.monotonic()
        m = train_step(model, batch, settings, optimizer)
        step += 1
        line = (f"step {step:4d} reward {m['reward_mean']:.3f} degenerate {m['degenerate_groups']:.0f}/"
                f"{m['groups']:.0f} kl {m.get('kl', 0):.4f} sample {tt - ts:.1f}s train {time.monotonic() - tt:.1f}s")
        if step % args.eval_every == 0:
            score = evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens)
            line += f" | held-out {score:.3f}"
        print(f"{time.monotonic() - t0:6.1f}s {line} load {os.getloadavg()[0]:.2f}", flush=True)
    outs = generate(model, [render_prompt(tokenizer, t.prompt) for t in held[:4]], eos=eos, max_new_tokens=24,
                    temperature=0)
    for t, (ids, _) in zip(held, outs, strict=False):
        print(f"  {t.prompt!r} -> {tokenizer.decode(ids, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
