"""Where a decoded token's time goes on the embedded engine at concurrency 1 (SmolLM2, one torch thread).

CPU time of the generation thread (``time.thread_time``), so the figures mean something on a shared machine where
wall time mostly measures the others; the load average is printed beside them. Rounds alternate between the
variants, so they see the same load.

1. A greedy decode step, per path: transformers over bf16 (the reference: ``fast_path`` and ``pack_int4`` off),
   the fast forward over bf16, the fast forward over int4 layers (the default); and the same with the profiler's
   split: matmuls (``aten::mm``, the int4 kernel) against everything else.
2. The parts: the 210 projections of one token alone (30 layers x 7, weights out of cache) in bf16 and int4; the
   output head; per-token Python cost (a model of SmolLM2's 30 layers at width 64, where the matmuls cost nothing);
   choosing a token (sampling and its log-prob).

Run: ``.venv/bin/python bench/decode_profile.py [--model DIR] [--tokens 32] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "<|im_start|>user\nWrite a long story about a cat who learns to program.<|im_end|>\n<|im_start|>assistant\n"


def per_token(load: Any, tokens: int, profile: bool = False) -> tuple[float, float]:
    """CPU ms per greedy decode step, and the share of it in matmul kernels (profiled runs only)."""
    import torch

    with torch.inference_mode():
        cache = load.new_cache()
        token = int(load.forward(torch.tensor([load.encode_text(PROMPT)]), cache).argmax())
        if not profile:
            t0 = time.thread_time()
            for _ in range(tokens):
                token = int(load.forward(torch.tensor([[token]]), cache).argmax())
            return (time.thread_time() - t0) / tokens * 1e3, float("nan")
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as run

        with run(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(tokens):
                token = int(load.forward(torch.tensor([[token]]), cache).argmax())
    rows = prof.key_averages()
    total = sum(r.self_cpu_time_total for r in rows)
    mm = sum(r.self_cpu_time_total for r in rows if r.key in ("aten::mm", "aten::_weight_int4pack_mm_for_cpu"))
    return total / tokens / 1e3, mm / total


def cpu_ms(fn: Any, n: int) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".cache" / "bench" / "smollm2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from daemon.engines.decode import Int4Linear, _grid
    from daemon.engines.prompts import SamplingParams
    from daemon.engines.transformers import Load, _choose
    from daemon.models import TinyConfig, init_tiny
    from daemon.smollm2 import init_smollm2

    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f} at start ({os.cpu_count()} CPUs, 1 torch thread)")
    cpu = torch.device("cpu")
    model = init_smollm2(args.model)
    loads = {"transformers, bf16 (reference)": Load.open(model, "p:1", cpu, fast=False, pack=False),
             "fast forward, bf16": Load.open(model, "p:2", cpu, fast=True, pack=False),
             "fast forward, int4 (default)": Load.open(model, "p:3", cpu)}
    times: dict[str, list[float]] = {name: [] for name in loads}
    for _ in range(args.rounds):
        for name, load in loads.items():
            times[name].append(per_token(load, args.tokens)[0])
    print("\n1. a decode step (CPU ms per token, median of rounds; profiled: the share in matmul kernels)")
    for name, load in loads.items():
        _, share = per_token(load, 8, profile=True)
        print(f"  {name:32} {statistics.median(times[name]):6.1f} ms   matmuls {share:.0%} of the profiled step")

    print("\n2. the parts (CPU ms per token)")
    ref = loads["transformers, bf16 (reference)"].model
    layers = [m.weight.detach() for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    packed = []
    for w in layers:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        linear.weight.data = w
        grid = _grid(w)
        if grid is not None:
            packed.append(Int4Linear(linear, *grid))
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {w.shape[1] for w in layers}}
    with torch.inference_mode():
        dense = cpu_ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in layers], 10)
        print(f"  {len(layers)} projections, bf16            {dense:6.1f}")
        if len(packed) == len(layers):
            int4 = cpu_ms(lambda: [m(xs[m.in_features]) for m in packed], 10)
            print(f"  {len(layers)} projections, int4            {int4:6.1f}")
        head = ref.lm_head.weight
        print(f"  output head ({head.shape[0]} x {head.shape[1]}, bf16) "
              f"{cpu_ms(lambda: torch.nn.functional.linear(xs[head.shape[1]], head), 20):6.1f}")
    thin = init_tiny(ROOT / ".cache" / "bench" / "tiny-30-layers", config=TinyConfig(
        num_hidden_layers=30, hidden_size=64, num_attention_heads=4, intermediate_size=128))
    for name, fast in (("transformers", False), ("fast forward", True)):
        load = Load.open(thin, "p:4", cpu, fast=fast, pack=False)
        ms = statistics.median(per_token(load, args.tokens)[0] for _ in range(args.rounds))
        print(f"  Python per token, {name:13}   {ms:6.1f}  (30 layers of width 64)")
    logits = torch.randn(1, head.shape[0], dtype=torch.bfloat16) * 3

    class Seq:
        params = SamplingParams(max_tokens=1)
        generator = torch.Generator().manual_seed(0)

    print(f"  choosing a token (temperature 1)  {cpu_ms(lambda: _choose(logits, [Seq()]), 50):6.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
