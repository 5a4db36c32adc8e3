"""Live release swaps: time from a publish to the first answer from the new release, and request latency while
releases are swapped, against the same load without swaps, in one run.

For the tiny model and for a randomly initialised model of about 100M parameters (built locally: 12 layers,
width 768), on the CPU:
1. a new release is published (weights changed) by another process, as a trainer would; we time the publish,
   then from the moment the head moved to the first answer that names the new release (goal <= 1 s for 100M);
2. two clients send short requests for a fixed time without swaps, then for the same time while a release is
   published or rolled back every second; we print p50/p99 of both and the p99 ratio (goal <= 1.5x).

Run: ``.venv/bin/python bench/hot_swap.py [--only tiny|100m] [--seconds N]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import free_port, start  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BODY = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def variant(model: Path, dest: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    for weights in dest.glob("*.safetensors"):
        tensors = load_file(weights)
        name = next(n for n in sorted(tensors) if "embed" in n)
        g = torch.Generator().manual_seed(seed)
        tensors[name] = tensors[name] + 0.01 * torch.randn(tensors[name].shape, generator=g)
        weights.unlink()
        save_file(tensors, weights, metadata={"format": "pt"})
    return dest



def serve(home: Path, model: Path) -> tuple[subprocess.Popen[bytes], str, str, Any]:
    """A daemon serving ``model`` as ``m`` under ``home``: (its process, base URL, token, its release store)."""
    from daemon.releases import ReleaseStore

    port = free_port()
    home.mkdir(parents=True)
    (home / "config.toml").write_text(
        f'port = {port}\ndefault_model = "m"\n[models.m]\nengine = "transformers"\npath = "{model}"\n'
        "memory_budget_mb = 8192\n"
    )
    proc = start(home, port)
    return proc, f"http://127.0.0.1:{port}", (home / "token").read_text().strip(), ReleaseStore(home / "artifacts.git")


def first_answers(c: httpx.Client, store: Any, dirs: list[Path]) -> tuple[list[float], list[float]]:
    """Publish each of ``dirs`` in turn, as a trainer would, and ask until an answer names it: the publish times and
    the times from the head's move to that first answer (s)."""
    from daemon.releases import files_from_dir

    publish_s, first_answer_s = [], []
    for d in dirs:
        t0 = time.perf_counter()
        rel = store.publish("swap", files_from_dir(d), expected_head=store.head("swap"), operation="train",
                            kind="weights", recipe="record")
        t1 = time.perf_counter()
        while c.post("/s/swap/v1/chat/completions", json=BODY).headers["x-reef-release-id"] != rel.release_id:
            pass
        first_answer_s.append(time.perf_counter() - t1)
        publish_s.append(t1 - t0)
    return publish_s, first_answer_s


def load(url: str, token: str, store: Any, duration: float, swap: Callable[[int], Path] | None = None) -> list[float]:
    """Latencies (ms) of two clients asking for ``duration`` seconds; with ``swap``, every second in turn a rollback
    to an earlier release of the chain and a publish of the directory ``swap(i)``."""
    from daemon.errors import Unchanged
    from daemon.releases import files_from_dir

    lat: list[float] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=120) as cc:
            while not stop.is_set():
                t = time.perf_counter()
                cc.post("/s/swap/v1/chat/completions", json=BODY).raise_for_status()
                lat.append((time.perf_counter() - t) * 1e3)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for th in threads:
        th.start()
    end, i = time.monotonic() + duration, 0
    with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=120) as c:
        while time.monotonic() < end:
            time.sleep(1.0)
            if swap is not None:
                history = store.history("swap")
                head = history[0].release_id
                if i % 2 == 0:  # back to an earlier release (for adapters: an earlier one, or the base)
                    target = history[1 + i % (len(history) - 1)].release_id
                    c.post("/reef/scenarios/swap/rollback", json={"release_id": target, "expected_head": head})
                else:  # (a variant the rollback just went back to is no new release: that second swaps nothing)
                    with contextlib.suppress(Unchanged):
                        store.publish("swap", files_from_dir(swap(i)), expected_head=head, operation="train",
                                      kind="weights", recipe="record")
            i += 1
    stop.set()
    for th in threads:
        th.join()
    return lat


def report(label: str, what: str, still: list[float], swapped: list[float]) -> None:
    print(f"{label}latency without swaps: p50 {statistics.median(still):.1f} ms, p99 {pct(still, 0.99):.1f} ms "
          f"({len(still)} requests)")
    print(f"{label}latency with {what} every second: p50 {statistics.median(swapped):.1f} ms, "
          f"p99 {pct(swapped, 0.99):.1f} ms ({len(swapped)} requests); "
          f"p99 ratio {pct(swapped, 0.99) / pct(still, 0.99):.2f}x (goal <= 1.5x)")


def run_size(label: str, model: Path, work: Path, seconds: float) -> None:
    variants = [variant(model, work / f"{label}-v{i}", i) for i in range(3)]
    proc, url, token, store = serve(work / f"home-{label}", model)
    try:
        with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=120) as c:
            c.post("/s/swap/v1/chat/completions", json=BODY).raise_for_status()
            publish_s, first_answer_s = first_answers(c, store, variants)
        print(f"[{label}] publish (git + LFS write): median {statistics.median(publish_s):.3f} s; "
              f"head moved -> first answer from the new release: median {statistics.median(first_answer_s):.3f} s,"
              f" max {max(first_answer_s):.3f} s")
        still = load(url, token, store, seconds)
        swapped = load(url, token, store, seconds, swap=lambda i: variants[i % 3])
        report(f"[{label}] ", "a swap", still, swapped)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tiny", "100m"])
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    from daemon.models import TinyConfig, init_tiny

    work = Path(tempfile.mkdtemp(prefix="reef-bench-swap-"))
    try:
        sizes = {
            "tiny": TinyConfig(),
            "100m": TinyConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                               num_attention_heads=12, max_position_embeddings=4096),
        }
        for label, cfg in sizes.items():
            if args.only and args.only != label:
                continue
            model = init_tiny(work / f"model-{label}", config=cfg)
            size = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
            print(f"[{label}] model: {size:.0f} MiB of weights")
            run_size(label, model, work, args.seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
