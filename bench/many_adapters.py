"""Many adapter releases on one base: requests pinned at random to far more adapter releases than the engine keeps
resident, and the time from publishing an adapter release to the first answer from it.

On a model of SmolLM2-135M's shape with random weights, built locally (``bench/lora_models.py``; or any local HF
model directory, ``--model``), on the CPU, through a daemon as ``reef serve`` starts it:
1. ``--releases`` (50) random LoRA adapter releases (rank 8, attention and MLP projections, as the trainer makes
   them) are published on the base by another process, as a trainer would; for the last ``--publishes`` (20) of
   them, the time from the head's move to the first answer that names the new release (p50 / p99);
2. one client sends ``--requests`` (150) short requests, each pinned (``x-reef-release-id``) to one of those
   releases at random, one at a time; the engine keeps the base, the head and the 4 newest pins
   (``daemon/residency.py``), so most requests find their adapter dropped and load it again. Before each
   request the daemon's status says whether the release is resident: the latency of those that reloaded against
   those that did not (the baseline, measured in the same run) gives the added latency of a reload (p50 / p99
   and their ratio); the daemon's resident memory (VmRSS, and its peak VmHWM) and the failed requests (goal 0).

Run: ``.venv/bin/python bench/many_adapters.py [--model DIR | --small] [--releases 50] [--requests 150]``
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.hot_swap import BODY, first_answers, pct, serve  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def memory_mb(pid: int) -> tuple[float, float]:
    """A process's resident memory and its peak (MB)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def run(model: Path, work: Path, releases: int, publishes: int, requests: int, seed: int) -> None:
    from bench.lora_models import adapter_variant, random_adapter
    from daemon.lora import AdapterManifest
    from daemon.releases import files_from_dir

    proc, url, token, store = serve(work / "home", model)
    try:
        with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=300) as c:
            c.post("/s/swap/v1/chat/completions", json=BODY).raise_for_status()  # the init release: the base
            init = store.get(store.head("swap"))
            first = random_adapter(model, work / "adapter-0", AdapterManifest(init.content_id, init.release_id))
            dirs = [first] + [adapter_variant(first, work / f"adapter-{i}", i) for i in range(1, releases)]
            size = sum(f.stat().st_size for f in first.iterdir()) / 2**20
            print(f"adapter: {size:.1f} MiB (rank 8, attention + MLP projections); {releases} releases", flush=True)
            ids = []
            for d in dirs[:releases - publishes]:
                ids.append(store.publish("swap", files_from_dir(d), expected_head=store.head("swap"),
                                         operation="train", kind="weights", recipe="record").release_id)
            publish_s, first_answer_s = first_answers(c, store, dirs[releases - publishes:])
            ids += [r.release_id for r in store.history("swap")[:publishes]][::-1]
            print(f"publish (git + LFS write of the adapter): p50 {statistics.median(publish_s):.3f} s; head moved "
                  f"-> first answer from the new release over {publishes} publishes: p50 "
                  f"{statistics.median(first_answer_s):.3f} s, p99 {pct(first_answer_s, 0.99):.3f} s (goal p99 < 1 s)",
                  flush=True)
            contents = {r: store.get(r).content_id for r in ids}
            assert len(set(contents.values())) == releases, "each release its own adapter"
            picks = random.Random(seed).choices(ids, k=requests)
            reload_ms, resident_ms, failed = [], [], []
            for i, rel in enumerate(picks):
                resident = contents[rel] in c.get("/reef/status").json()["models"]["m"]["resident"]
                body = {**BODY, "messages": [{"role": "user", "content": f"say something about number {i}"}]}
                t = time.perf_counter()
                r = c.post("/s/swap/v1/chat/completions", json=body, headers={"x-reef-release-id": rel})
                ms = (time.perf_counter() - t) * 1e3
                if r.status_code != 200 or r.headers.get("x-reef-release-id") != rel:
                    failed.append(f"{r.status_code} {r.text[:120]}")
                    continue
                (resident_ms if resident else reload_ms).append(ms)
        rss, peak = memory_mb(proc.pid)
        print(f"{requests} requests pinned at random to {len(set(picks))} of {releases} releases: "
              f"{len(reload_ms)} reloaded an adapter, {len(resident_ms)} found it resident, {len(failed)} failed "
              f"(goal 0)")
        if resident_ms and reload_ms:
            base50, base99 = statistics.median(resident_ms), pct(resident_ms, 0.99)
            p50, p99 = statistics.median(reload_ms), pct(reload_ms, 0.99)
            print(f"latency, adapter resident (baseline): p50 {base50:.1f} ms, p99 {base99:.1f} ms")
            print(f"latency, adapter reloaded: p50 {p50:.1f} ms, p99 {p99:.1f} ms; added by a reload: p50 "
                  f"{p50 - base50:.1f} ms, p99 {p99 - base99:.1f} ms (ratio p50 {p50 / base50:.2f}x, p99 "
                  f"{p99 / base99:.2f}x)")
        print(f"daemon memory: {rss:.0f} MB resident at the end, peak {peak:.0f} MB")
        for f in failed[:5]:
            print(f"  failed: {f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> None:
    from bench.lora_models import chosen_model, model_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_options(ap)
    ap.add_argument("--releases", type=int, default=50)
    ap.add_argument("--publishes", type=int, default=20, help="of them, the last ones timed to their first answer")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not 0 < args.publishes <= args.releases:
        ap.error("--publishes must be within [1, --releases]")

    work = Path(tempfile.mkdtemp(prefix="reef-bench-many-adapters-"))
    try:
        model = chosen_model(args, work)
        run(model, work, args.releases, args.publishes, args.requests, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
