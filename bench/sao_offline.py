"""SAO's learning core alone, in-process (no daemon), on one torch thread: how many scored rollouts until the
demo model's held-out reward reaches the target, one rollout per step?

Per seed: build and warm up the demo model exactly as ``bench/learning_offline.py`` does, then loop: sample one
training task, sample one answer from the serving weights (temperature 1, raw-logit log-probs as the engine records
them), score it, ``sao_step``; the serving weights are the trained ones of ``--lag`` steps before (``--lag 1``: the
record was served by the previous release, as under the daemon's staleness bound of 1). Every ``--eval-every``
rollouts, greedy exact-match on held-out prompts.

    .venv/bin/python bench/sao_offline.py --seeds 0 1 2 --lr 5e-4
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from daemon.models import DEMO_CONFIG, build_tiny  # noqa: E402
from recipes.online_rl import Sample, eos_ids, evaluate, generate, render_prompt  # noqa: E402
from recipes.sao import SAOSettings, make_learner, sao_step  # noqa: E402
from recipes.tasks import get_family  # noqa: E402
from recipes.warmup import warm_up  # noqa: E402


def run(seed: int, args: argparse.Namespace, settings: SAOSettings) -> dict:
    family = get_family("say")
    t0 = time.monotonic()
    cached = Path(args.cache) / f"tiny-demo-{seed}" if args.cache else None
    if cached is not None and cached.exists():  # the warm-up is deterministic for a seed: reuse it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cached)
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
        info = {"steps": "cached"}
    else:
        tokenizer, model = build_tiny(seed=seed, config=DEMO_CONFIG)
        info = warm_up(tokenizer, model, family, seed=seed)
        if cached is not None:
            from daemon.models import save_model

            save_model(tokenizer, model, cached)
    held = family.held_out(args.held_out, seed=seed)
    start = evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens)
    print(f"seed {seed}: build+warm-up {time.monotonic() - t0:.1f}s ({info['steps']} steps); held-out {start:.3f}",
          flush=True)
    learner = make_learner(model, settings)
    past: deque = deque(maxlen=args.lag + 1)
    serving = copy.deepcopy(model)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    eos = eos_ids(model, tokenizer)
    reached, score, t_train, t_eval = None, start, time.monotonic(), 0.0
    ema: dict[str, float] = {}
    cache: dict[str, list[int]] = {}
    for n in range(1, args.max_samples + 1):
        task = family.sample(rng)
        prompt = cache.setdefault(task.prompt, render_prompt(tokenizer, task.prompt))
        (ids, logprobs), = generate(serving, [prompt], eos=eos, max_new_tokens=settings.max_new_tokens,
                                    temperature=1.0, generator=gen)
        reward = family.score(task, tokenizer.decode(ids, skip_special_tokens=True))
        m = sao_step(model, [Sample(prompt, ids, logprobs, reward, group=str(n))], settings, learner)
        for k in ("reward_mean", "value_loss", "iw_mean", "kl_behaviour", "entropy", "grad_norm", "value"):
            if k in m:  # a skipped step (reward equal to the value) has no policy metrics
                ema[k] = m[k] if k not in ema else 0.98 * ema[k] + 0.02 * m[k]
        past.append({k: v.clone() for k, v in model.state_dict().items()})
        serving.load_state_dict(past[0])  # the weights of `lag` steps ago serve the next rollout
        if n % args.eval_interval == 0:
            te = time.monotonic()
            score = evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens)
            t_eval += time.monotonic() - te
            print(f"  {time.monotonic() - t_train - t_eval:6.1f}s rollouts {n:6d} held-out {score:.3f} | "
                  + " ".join(f"{k} {v:.3f}" for k, v in ema.items()), flush=True)
            if score >= args.target:
                reached = n
                break
    print(f"seed {seed}: " + (f"reached {args.target} after {reached} rollouts" if reached else
                              f"did not reach {args.target} in {args.max_samples} rollouts (last {score:.3f})"))
    return {"seed": seed, "start": start, "final": score, "reached": reached}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-samples", type=int, default=20000)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=250, help="rollouts between held-out evaluations")
    p.add_argument("--lag", type=int, default=1)
    p.add_argument("--cache", default="", help="directory to keep warmed-up models in between runs")
    for f in dataclasses.fields(SAOSettings):
        if f.type in ("float", "int", "float | None") and not f.name.startswith("eval"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=int if f.type == "int" else float)
        elif f.type == "str" and f.name == "optimizer":
            p.add_argument("--optimizer")
        elif f.type == "bool":
            p.add_argument(f"--{f.name.replace('_', '-')}", type=lambda x: x in ("1", "true", "yes"))
    args = p.parse_args()
    torch.set_num_threads(1)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SAOSettings)
                 if getattr(args, f.name, None) is not None}
    settings = SAOSettings(**overrides)
    print(f"settings: {settings}", flush=True)
    results = [run(seed, args, settings) for seed in args.seeds]
    print("\nseed  start  final  rollouts-to-target")
    for r in results:
        print(f"{r['seed']:4d}  {r['start']:.3f}  {r['final']:.3f}  {r['reached'] or '-'}")


if __name__ == "__main__":
    main()
