"""The learning core alone, in-process (no daemon): does online RL take the demo model's held-out reward from
<= 0.3 to >= 0.8, and how fast, on one torch thread?

Per seed: build the tiny model, ``warm_up`` it on the family's training prompts, then loop: sample
``batch_prompts`` training tasks, sample ``group_size`` answers to each from the serving weights (temperature 1,
raw-logit log-probs per sampled token, as the engine records them), score them with the family's verifier,
``train_step``, and every ``--eval-every`` steps evaluate greedy exact-match on held-out tasks (words never
trained on). ``--release-every K`` serves from a copy of the weights refreshed every K steps (a new release every
K training steps, as in the daemon), so samples are up to K-1 steps stale and the importance ratio matters.

    .venv/bin/python bench/learning_offline.py --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from daemon.models import DEMO_CONFIG, TinyConfig, build_tiny  # noqa: E402
from recipes.online_rl import (  # noqa: E402
    OnlineRLSettings,
    Sample,
    eos_ids,
    evaluate,
    generate,
    make_optimizer,
    render_prompt,
    train_step,
)
from recipes.tasks import get_family  # noqa: E402
from recipes.warmup import warm_up  # noqa: E402


def run(seed: int, args: argparse.Namespace, settings: OnlineRLSettings) -> dict:
    family = get_family(args.family)
    t0 = time.monotonic()
    shape = TinyConfig(hidden_size=args.width, intermediate_size=args.intermediate, num_attention_heads=args.heads)
    tokenizer, model = build_tiny(seed=seed, config=shape)
    info = warm_up(
        tokenizer, model, family, seed=seed, target=args.warmup_target, steps=args.warmup_steps, embed_std=args.embed_std
    )
    held = family.held_out(args.held_out, seed=seed)
    start = evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens)
    print(
        f"seed {seed}: build+warm-up {time.monotonic() - t0:.1f}s (warm-up {info['steps']} steps, {info['seconds']}s,"
        f" probe exact {info['probe_exact']:.2f}); held-out exact {start:.3f}",
        flush=True,
    )
    if args.freeze:
        for name, param in model.named_parameters():
            if any(f in name for f in args.freeze.split(",")):
                param.requires_grad_(False)
    optimizer = make_optimizer(model, settings)
    serving = copy.deepcopy(model) if args.release_every > 1 else model
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    eos = eos_ids(model, tokenizer)
    reward = family.exact if args.exact_reward else family.score
    curve = [(0.0, 0, 0, start)]
    t_train = time.monotonic()
    t_eval = 0.0
    reached = None
    samples = 0
    step = 0
    reward_avg = None
    last_print = -1e9
    while time.monotonic() - t_train - t_eval < args.seconds:
        tasks = [family.sample(rng) for _ in range(settings.batch_prompts)]
        prompts = [render_prompt(tokenizer, t.prompt) for t in tasks]
        rows = [i for i in range(len(tasks)) for _ in range(settings.group_size)]
        outs = generate(
            serving,
            [prompts[i] for i in rows],
            eos=eos,
            max_new_tokens=settings.max_new_tokens,
            temperature=1.0,
            generator=gen,
        )
        batch = []
        for i, (ids, logprobs) in zip(rows, outs, strict=True):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            batch.append(Sample(prompts[i], ids, logprobs, reward(tasks[i], text), group=f"{step}:{i}"))
        metrics = train_step(model, batch, settings, optimizer)
        samples += len(batch)
        step += 1
        reward_avg = metrics["reward_mean"] if reward_avg is None else 0.9 * reward_avg + 0.1 * metrics["reward_mean"]
        if args.release_every > 1 and step % args.release_every == 0:
            serving.load_state_dict(model.state_dict())
        if step % args.eval_every == 0:
            te = time.monotonic()
            score = evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens)
            t_eval += time.monotonic() - te
            elapsed = time.monotonic() - t_train - t_eval
            curve.append((elapsed, step, samples, score))
            if score < args.target and elapsed - last_print < args.print_every:
                continue
            last_print = elapsed
            print(
                f"  {elapsed:6.1f}s step {step:4d} samples {samples:6d} held-out {score:.3f} | train reward"
                f" {reward_avg:.3f} degenerate {metrics['degenerate_groups']:.0f}/{metrics['groups']:.0f}"
                f" ratio {metrics.get('ratio_mean', 1):.3f} clip {metrics.get('clip_frac', 0):.3f}"
                f" kl {metrics.get('kl', 0):.4f} entropy {metrics.get('entropy', 0):.2f}",
                flush=True,
            )
            if reached is None and score >= args.target:
                reached = (elapsed, step, samples)
                if not args.keep_going:
                    break
    final = curve[-1][3]
    result = {"seed": seed, "start": start, "final": final, "reached": reached, "warmup": info}
    if reached:
        print(f"seed {seed}: reached {args.target} after {reached[0]:.1f}s, {reached[1]} steps, {reached[2]} samples")
    else:
        print(f"seed {seed}: did not reach {args.target} in {args.seconds}s (final {final:.3f})")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--family", default="say")
    p.add_argument("--width", type=int, default=DEMO_CONFIG.hidden_size, help="model width (default: the demo model's)")
    p.add_argument("--heads", type=int, default=DEMO_CONFIG.num_attention_heads)
    p.add_argument("--intermediate", type=int, default=DEMO_CONFIG.intermediate_size, help="MLP width")
    p.add_argument("--seconds", type=float, default=180, help="training time limit per seed (evaluation excluded)")
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--keep-going", action="store_true", help="train until --seconds even after the target")
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--print-every", type=float, default=10, help="seconds between progress lines")
    p.add_argument("--release-every", type=int, default=1, help="refresh the serving weights every K steps")
    p.add_argument("--warmup-target", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--exact-reward", action="store_true", help="reward 1/0 only (no partial credit)")
    p.add_argument("--embed-std", type=float, default=0.5)
    p.add_argument("--freeze", default="", help="comma-separated parameter name parts to keep frozen (experiments)")
    p.add_argument("--threads", type=int, default=1)
    for f in dataclasses.fields(OnlineRLSettings):
        if f.type in ("float", "int"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=float if f.type == "float" else int)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(OnlineRLSettings) if getattr(args, f.name, None) is not None}
    settings = OnlineRLSettings(**overrides)
    if args.warmup_target is None:
        args.warmup_target = warm_up.__kwdefaults__["target"]
    if args.warmup_steps is None:
        args.warmup_steps = warm_up.__kwdefaults__["steps"]
    print(f"settings: {settings}", flush=True)
    results = [run(seed, args, settings) for seed in args.seeds]
    print("\nseed  start  final  time-to-target  steps  samples")
    for r in results:
        t = f"{r['reached'][0]:6.1f}s  {r['reached'][1]:5d}  {r['reached'][2]:7d}" if r["reached"] else "   -"
        print(f"{r['seed']:4d}  {r['start']:.3f}  {r['final']:.3f}  {t}")


if __name__ == "__main__":
    main()
