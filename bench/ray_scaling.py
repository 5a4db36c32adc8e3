"""Data-parallel training steps on a Ray cluster (``trainer_workers``): step time for 1 and 2 workers on the same
batch, and the bytes a step moves.

For each worker count the script runs online-rl's step the way the daemon's trainer does (``RayDriver`` with
``workers``: one Ray Train session, ``daemon/trainer/ray_parallel.py``) twice on the same batch: a first step, which
starts the session and loads the model (shipped to each node through Ray's object store, once), then a step that
continues the lineage with the model and optimizer in the workers' memory (the steady state). It prints the wall
times, the step's own ``train_s`` / ``step_s``, and the bytes: the model directories in (once per node), the
adapter out (every step), and the gradients each worker sends into the sum (every optimizer step). The adapters of
1 and 2 workers are compared as a check (``tests/test_ray_parallel.py`` does it against the local worker).

Without ``--address`` it starts a two-node cluster on this machine (``tests/ray_cluster.py``: a head and one joined
node, one CPU each, loopback only) and stops it at the end; with ``--address`` it joins an existing cluster and runs
unchanged on any number of nodes (``--workers 1 2 4 8``). On a 2-core machine no speedup is expected: the figures
are for the design.

Run: ``.venv/bin/python bench/ray_scaling.py [--tiny] [--model-dir DIR] [--address HOST:PORT] [--workers 1 2]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_model(args: argparse.Namespace, work: Path) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    if args.tiny:
        from daemon.models import init_tiny

        init_tiny(work / "tiny", seed=0)
        return work / "tiny"
    from daemon.smollm2 import init_smollm2

    cache = Path(tempfile.gettempdir()) / "reef-bench-smollm2"
    if not cache.is_dir():
        init_smollm2(cache)
    return cache


def batch(model_dir: Path, prompts: int, group: int, max_tokens: int) -> list[Any]:
    """Answers the model samples (``group`` to each of ``prompts`` prompts), scored so every group has signal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.base import FeedbackReport, ScoredExchange
    from recipes.online_rl import eos_ids, generate, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    asks = [render_prompt(tokenizer, f"Name a {w} in one word.") for w in ("colour", "fruit", "river", "tool",
                                                                          "planet", "bird", "tree", "metal")]
    rows = [i % len(asks) for i in range(prompts) for _ in range(group)]
    outs = generate(model, [asks[i] for i in rows], eos=eos_ids(model, tokenizer), max_new_tokens=max_tokens,
                    generator=torch.Generator().manual_seed(0))
    return [ScoredExchange(id=f"r{n}", release_id=None, prompt_token_ids=asks[i], token_ids=ids, logprobs=lps,
                           report=FeedbackReport(id=f"p{n}", seq=n + 1, score=float(n % 2)))
            for n, (i, (ids, lps)) in enumerate(zip(rows, outs, strict=True))]


def job(model_dir: Path, records: list[Any], name: str, base: tuple[str, str] | None = None) -> Any:
    from recipes.base import TrainJob
    from recipes.online_rl import OnlineRLSettings

    key, path = base or ("base", str(model_dir))
    return TrainJob(id=name, recipe="online-rl", settings=OnlineRLSettings(lora=True).to_dict(), batch=records,
                    base_key=key, base_path=path, head_key="base", head_path=str(model_dir), candidate_key=name,
                    model_key="m" * 40, model_release="r" * 40, model_path=str(model_dir), data_parallel=True)


def run(address: str, workers: int, model_dir: Path, records: list[Any], out: Path, threads: int) -> dict[str, Any]:
    from daemon.trainer.ray_trainer import RayDriver

    driver = RayDriver(address, threads=threads, workers=workers)
    try:
        t0 = time.perf_counter()
        first = driver.run(job(model_dir, records, f"w{workers}-a"), out / f"w{workers}-a")
        t1 = time.perf_counter()
        warm = driver.run(job(model_dir, records, f"w{workers}-b", base=(f"w{workers}-a", first.path or "")),
                          out / f"w{workers}-b")
        t2 = time.perf_counter()
    finally:
        driver.close()
    return {"workers": workers, "first_s": t1 - t0, "warm_s": t2 - t1, "first": first, "warm": warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="an existing Ray cluster (default: start a two-node one here)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tiny", action="store_true", help="the tiny model (LoRA on it) instead of SmolLM2")
    ap.add_argument("--model-dir", help="a model directory (default: SmolLM2-135M-Instruct, made once)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reef-ray-scaling-"))
    cluster = None
    try:
        model_dir = make_model(args, work)
        records = batch(model_dir, args.prompts, args.group, args.max_tokens)
        address = args.address
        if address is None:
            from tests.ray_cluster import RAY_ENV, Cluster

            os.environ.update(RAY_ENV)
            cluster = Cluster(object_store=max(2 * dir_bytes(model_dir), 80 << 20))
            cluster.head()
            for _ in range(max(args.workers) - 1):
                cluster.join()
            cluster.wait_cpus(max(args.workers))
            address = cluster.address
        model_mb = dir_bytes(model_dir) / 1e6
        tokens = sum(len(r.token_ids) for r in records)
        print(f"model {model_dir.name}: {model_mb:.1f} MB; batch {len(records)} answers, {tokens} answer tokens; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        results = [run(address, w, model_dir, records, work, args.threads) for w in args.workers]
        for r in results:
            m, mw = r["first"].metrics, r["warm"].metrics
            adapter = dir_bytes(Path(r["warm"].path))
            grads = mw.get("allreduce_bytes", 0.0)
            print(f"{r['workers']} worker(s): first step {r['first_s']:.1f} s wall (session start, model load; "
                  f"the recipe's step {m['worker_step_s']:.1f} s), next step {r['warm_s']:.1f} s wall (the recipe's "
                  f"step {mw['worker_step_s']:.2f} s: forward and backward {mw['step_s']:.2f} s, the drift "
                  f"measure and the save the rest); moved: model in "
                  f"{model_mb:.1f} MB once per node, adapter out {adapter / 1e6:.2f} MB a step, gradients into the "
                  f"sum {grads / 1e6:.2f} MB a worker a step", flush=True)
        if len(results) > 1:
            from safetensors.torch import load_file

            from daemon import lora

            a, b = (load_file(str(Path(r["first"].path) / lora.WEIGHTS)) for r in results[:2])
            moved = sum(float(a[k].norm() ** 2) for k in a if "lora_B" in k) ** 0.5
            gap = sum(float((a[k] - b[k]).norm() ** 2) for k in a if "lora_B" in k) ** 0.5
            print(f"adapter of {results[1]['workers']} workers vs {results[0]['workers']}: {gap / moved:.1e} of the "
                  f"step; load {os.getloadavg()[0]:.1f}")
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
