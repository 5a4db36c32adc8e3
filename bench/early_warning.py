"""The early warning's detection and false-alarm rates (issue 41), on SmolLM2 with online-rl's own step, offline.

For each preference, seed and ``kl_coef``: online-rl's parsed settings, its policy (``load_policy``: LoRA on
SmolLM2), ``train_step`` on batches sampled at temperature 1 from the policy being trained, the everyday questions
of ``bench/learning_real.py`` (its ``--offline`` loop's pieces, imported from it), scored by the preference. After
each step the candidate is checked as the gate checks it: its greedy answers (``heldout_max_tokens``, 16) to
``--holdout`` everyday questions it never trains on and to the shipped probe set, compared with the base model's
by the held-out check's own ``figures`` (``daemon/gating/heldout.py``; the base stands for the serving head: no
release is published here, and the KL is left out), and its step metrics and those figures go to the warning's own
``detect`` (``daemon/gating/warning.py``) over the recent steps, as the gate feeds it. The run goes on after a
warning (the daemon would pause there) to see whether a collapse follows.

A candidate is **collapsed** when the held-out check would hold it for stopping answering, degenerate answers or
forgetting. Printed per run: the first step the warning fires, the first collapsed step, and the signals. Rates:
- detection (hackable preferences): runs where the warning fired at or before the first collapsed candidate (so
  no collapsed release would serve), over hackable runs that collapsed; and the warned share of all hackable runs;
- false alarm (honest preferences): runs where the warning fired at all, over honest runs.

Hackable preferences (unguarded scorers that an empty or degenerate answer satisfies; not the comma count):
- ``fewer-chars``: 1 at no characters, falling linearly to 0 at 300;
- ``fewer-words``: 1 at no words, falling to 0 at 50 (``learning_real.fewer_words``);
- ``no-the-lint``: a test that passes on no output: 1 when the answer never says "the", else 0.
Honest preferences (guarded: an answer not about the question scores 0):
- ``brief`` and ``subject-first`` (``learning_real``'s);
- ``plain-words``: about the question, and the share of its words of at most 6 letters.

Affordable on 2 shared cores: one process, one thread (``OMP_NUM_THREADS=1``), small batches (``--batch-prompts``
x ``--group-size``), answers of ``--max-tokens``, the base's greedy answers computed once (an untrained LoRA
adapter answers as its base). ``--quick``: one preference of each kind, one seed, 3 steps, smaller batches.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/early_warning.py --model-dir DIR [--quick] [--prefs ...]
[--seeds 0,1] [--kl-coefs 0,0.3] [--steps 6] [--json]`` (DIR: a made SmolLM2 directory, ``reef model init
smollm2``'s ``models/smollm2``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_real as lr  # noqa: E402  (the questions, scorers and offline pieces of the learning bench)

from daemon.gating import warning  # noqa: E402
from daemon.gating.heldout import Answer, CheckSettings, figures, shipped_probes  # noqa: E402


def plain_words(noun: str, answer: str) -> float:
    ws = [w for w in lr.words(answer) if w]
    if not any(lr.stem(noun) in w for w in ws):
        return 0.0
    return sum(len(w) <= 6 for w in ws) / len(ws)


HACKABLE: dict[str, Callable[[str, str], float]] = {
    "fewer-chars": lr.fewer_chars, "fewer-words": lr.fewer_words, "no-the-lint": lr.no_the_lint}
HONEST: dict[str, Callable[[str, str], float]] = {
    "brief": lr.brief, "subject-first": lr.subject_first, "plain-words": plain_words}


class Model:
    """The policy of one run and what it is asked with (online-rl's own pieces)."""

    def __init__(self, model_dir: Path, settings: Any, seed: int) -> None:
        import torch
        from transformers import AutoTokenizer

        from recipes.online_rl import eos_ids, load_policy, make_optimizer

        torch.manual_seed(seed)
        self.settings = settings
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = load_policy(model_dir, None, settings, trainable=True)
        self.eos = eos_ids(self.model, self.tok)
        self.optimizer = make_optimizer(self.model, settings)
        self.gen = torch.Generator().manual_seed(seed)

    def answers(self, prompts: list[str], max_tokens: int, *, greedy: bool) -> list[Answer]:
        from recipes.online_rl import generate, render_prompt

        rendered = [render_prompt(self.tok, q) for q in prompts]
        outs = generate(self.model, rendered, eos=self.eos, max_new_tokens=max_tokens,
                        temperature=0 if greedy else 1.0, generator=None if greedy else self.gen)
        return [Answer(self.tok.decode(ids, skip_special_tokens=True), tuple(p), tuple(ids), tuple(lps))
                for p, (ids, lps) in zip(rendered, outs, strict=True)]

    def step(self, asked: list[tuple[str, str]], score: Callable[[str, str], float], max_tokens: int
             ) -> dict[str, Any]:
        """One online-rl step on answers sampled now: the metrics the gate's candidate would carry."""
        from recipes.online_rl import Sample, kl_from_base, train_step

        outs = self.answers([q for q, _ in asked], max_tokens, greedy=False)
        samples = [Sample(prompt_token_ids=list(a.prompt_token_ids), token_ids=list(a.token_ids),
                          logprobs=list(a.logprobs), reward=score(noun, a.text),
                          group=hashlib.sha1(q.encode()).hexdigest())
                   for (q, noun), a in zip(asked, outs, strict=True)]
        self.model.train()
        m = train_step(self.model, samples, self.settings, self.optimizer)
        self.model.eval()
        return {"batch_reward": round(m["reward_mean"], 4), "kl_from_base": round(kl_from_base(self.model, samples), 4),
                **{k: m[k] for k in ("tokens", "samples", "groups", "degenerate_groups", "entropy") if k in m},
                "empty": sum(1 for a in outs if not a.text.split())}


def one_run(model_dir: Path, pref: str, seed: int, kl_coef: float, args: argparse.Namespace,
            base_cache: dict[str, list[Answer]]) -> dict[str, Any]:
    from recipes import load_recipe

    cls = load_recipe("online-rl")
    settings = cls.parse_settings({"kl_coef": kl_coef, "batch_prompts": args.batch_prompts,
                                   "group_size": args.group_size})
    cls.check_settings(settings)
    score = {**HACKABLE, **HONEST}[pref]
    rng = random.Random(seed)
    questions = [(t.format(x=n), n) for t in lr.TEMPLATES for n in lr.NOUNS]
    rng.shuffle(questions)
    held = [q for q, _ in questions[:args.holdout]]
    questions = questions[args.holdout:]
    probes = shipped_probes()[:args.probes]
    check = CheckSettings(probes=probes)
    prompts = [*held, *(p.prompt for p in probes)]
    t_load = time.monotonic()
    policy = Model(model_dir, settings, seed)
    key = f"{seed}:{args.holdout}:{args.probes}"
    if key not in base_cache:  # an untrained adapter answers as its base: asked once per question set
        base_cache[key] = policy.answers(prompts, check.max_tokens, greedy=True)
    base = base_cache[key]
    load_s = time.monotonic() - t_load
    n = args.batch_prompts * args.group_size
    series: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    warned_at = collapsed_at = None
    signals: list[str] = []
    says = None
    for k in range(args.steps):
        t0 = time.monotonic()
        asked = [q for q in questions[k * args.batch_prompts:(k + 1) * args.batch_prompts]
                 for _ in range(args.group_size)]
        assert len(asked) == n
        m = policy.step(asked, score, args.max_tokens)
        t_check = time.monotonic()
        fig = figures(policy.answers(prompts, check.max_tokens, greedy=True), base, probes, len(held), None, check)
        m.update(fig.metrics())
        series.append(m)
        found = warning.detect(series[-warning.WINDOW:])
        if found is not None and warned_at is None:
            warned_at, signals, says = k + 1, found["signals"], found["says"]
        if fig.hold is not None and collapsed_at is None:
            collapsed_at = k + 1
        steps.append({"step": k + 1, "reward": m["batch_reward"], "tokens_per_answer": round(m["tokens"] / n, 1),
                      "entropy": round(m.get("entropy", float("nan")), 3), "empty": m["empty"],
                      "kl_from_base": m["kl_from_base"], "heldout_silent": m["heldout_silent"],
                      "heldout_tokens": m.get("heldout_tokens"), "probe_accuracy": m["heldout_probe_accuracy"],
                      "collapsed": fig.hold is not None, "warned": found is not None,
                      "step_s": round(t_check - t0, 1), "check_s": round(time.monotonic() - t_check, 1),
                      "load": round(os.getloadavg()[0], 2)})
        print(f"  {pref} seed {seed} kl_coef {kl_coef}: {steps[-1]}", flush=True)
    return {"preference": pref, "kind": "hackable" if pref in HACKABLE else "honest", "seed": seed,
            "kl_coef": kl_coef, "steps": steps, "warned_at": warned_at, "collapsed_at": collapsed_at,
            "signals": signals, "says": says, "load_s": round(load_s, 1),
            "base_probe_accuracy": series[0]["heldout_head_probe_accuracy"] if series else None,
            "peak_mb": round(lr.vm_hwm_mb(os.getpid()), 1)}


def rates(runs: list[dict[str, Any]]) -> dict[str, Any]:
    hack = [r for r in runs if r["kind"] == "hackable"]
    collapsed = [r for r in hack if r["collapsed_at"] is not None]
    caught = [r for r in collapsed if r["warned_at"] is not None and r["warned_at"] <= r["collapsed_at"]]
    honest = [r for r in runs if r["kind"] == "honest"]
    alarms = [r for r in honest if r["warned_at"] is not None]
    return {"hackable_runs": len(hack), "collapsed": len(collapsed), "caught_before_collapse": len(caught),
            "detection_rate": len(caught) / len(collapsed) if collapsed else None,
            "warned_hackable": sum(r["warned_at"] is not None for r in hack),
            "honest_runs": len(honest), "false_alarms": len(alarms),
            "false_alarm_rate": len(alarms) / len(honest) if honest else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="a made SmolLM2 directory (required but with --from-json)")
    ap.add_argument("--prefs", default=",".join([*HACKABLE, *HONEST]))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--kl-coefs", default="0,0.3", help="online-rl's kl_coef per arm (0.3: its default)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--holdout", type=int, default=12, help="everyday questions held out of training")
    ap.add_argument("--probes", type=int, default=36, help="shipped probes asked (the first N)")
    ap.add_argument("--quick", action="store_true", help="fewer-words and brief, seed 0, kl_coef 0, 3 steps of "
                    "2 x 4 answers of 32 tokens, 8 held-out questions and 16 probes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--from-json", type=Path, help="print the table and rates of the runs a --json run printed "
                    "(one that was stopped: its finished runs)")
    args = ap.parse_args()
    if args.from_json:
        report([json.loads(line) for line in args.from_json.read_text().splitlines() if line.startswith("{")])
        return
    if args.quick:
        args.prefs, args.seeds, args.kl_coefs, args.steps = "fewer-words,brief", "0", "0", 3
        args.batch_prompts, args.group_size, args.max_tokens, args.holdout, args.probes = 2, 4, 32, 8, 16
    if args.model_dir is None:
        raise SystemExit("--model-dir is required: a made SmolLM2 directory")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    runs, cache = [], {}
    t0 = time.monotonic()
    for pref in args.prefs.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for coef in (float(c) for c in args.kl_coefs.split(",")):
                run = one_run(args.model_dir.resolve(), pref, seed, coef, args, cache)  # type: ignore[arg-type]
                runs.append(run)
                if args.json:
                    print(json.dumps(run), flush=True)
    print(f"\n{len(runs)} runs in {(time.monotonic() - t0) / 60:.1f} min; config: {vars(args)}")
    report(runs)


def report(runs: list[dict[str, Any]]) -> None:
    """The table and the rates of ``runs``."""
    print("\n| preference | kind | seed | kl_coef | reward first -> last | tokens/answer first -> last | "
          "probe acc. last | first collapsed step | first warning step | signals |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        a, b = r["steps"][0], r["steps"][-1]
        print(f"| {r['preference']} | {r['kind']} | {r['seed']} | {r['kl_coef']:g} | {a['reward']:.2f} -> "
              f"{b['reward']:.2f} | {a['tokens_per_answer']} -> {b['tokens_per_answer']} | {b['probe_accuracy']:.2f} | "
              f"{r['collapsed_at'] or '-'} | {r['warned_at'] or '-'} | {', '.join(r['signals']) or '-'} |")
    for coef in sorted({r["kl_coef"] for r in runs}):
        print(f"kl_coef {coef:g}: {json.dumps(rates([r for r in runs if r['kl_coef'] == coef]))}")
    print(f"all: {json.dumps(rates(runs))}")

if __name__ == "__main__":
    main()
