"""LoRA adapter hot swaps: time from publishing an adapter release to the first answer from it, and request latency
while an adapter release is published or rolled back every second, against the same load without swaps, in one
run (as ``bench/hot_swap.py`` does for whole-model releases).

On a model of SmolLM2-135M's shape with random weights, built locally (``bench/lora_models.py``; or any local
HF model directory, ``--model``), on the CPU:
1. the base is served (its init release stores it once); random LoRA adapters on it (rank 8, attention and MLP
   projections, as the trainer makes them) are published by another process, as a trainer would: we time the
   publish (a few MB), then from the moment the head moved to the first answer that names the new release;
2. two clients send short requests for a fixed time without swaps, then for the same time while an adapter
   release (a new one, or a rollback to an earlier adapter or to the base) is published every second; we print
   p50/p99 of both and the p99 ratio (goal <= 1.5x).

Run: ``.venv/bin/python bench/hot_swap_lora.py [--model DIR | --small] [--seconds N]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.hot_swap import BODY, first_answers, load, report, serve  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(model: Path, work: Path, seconds: float, swaps: int) -> None:
    from bench.lora_models import adapter_variant, random_adapter
    from daemon.lora import AdapterManifest

    proc, url, token, store = serve(work / "home", model)
    try:
        with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=120) as c:
            c.post("/s/swap/v1/chat/completions", json=BODY).raise_for_status()  # the init release: the base
            init = store.get(store.head("swap"))
            first = random_adapter(model, work / "adapter-0", AdapterManifest(init.content_id, init.release_id))
            adapters = [first] + [adapter_variant(first, work / f"adapter-{i}", i) for i in range(1, swaps + 4)]
            size = sum(f.stat().st_size for f in first.iterdir()) / 2**20
            print(f"adapter: {size:.1f} MiB (rank 8, attention + MLP projections)")
            publish_s, first_answer_s = first_answers(c, store, adapters[:3])
        print(f"publish (git + LFS write of the adapter): median {statistics.median(publish_s):.3f} s; "
              f"head moved -> first answer from the new release: median {statistics.median(first_answer_s):.3f} s,"
              f" max {max(first_answer_s):.3f} s")
        fresh = iter(adapters[3:])  # each swap that publishes: a new adapter, never loaded before
        still = load(url, token, store, seconds)
        swapped = load(url, token, store, seconds, swap=lambda i: next(fresh))
        report("", "an adapter swap", still, swapped)
        lfs = sum(f.stat().st_size for f in (work / "home" / "artifacts.git" / "lfs" / "objects").rglob("*")
                  if f.is_file())
        print(f"chain: {len(store.history('swap'))} releases, LFS store {lfs / 2**20:.0f} MiB "
              f"(the base once, then adapters)")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)



def main() -> None:
    from bench.lora_models import chosen_model, model_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_options(ap)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="reef-bench-swap-lora-"))
    try:
        model = chosen_model(args, work)
        run(model, work, args.seconds, swaps=int(args.seconds) + 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
