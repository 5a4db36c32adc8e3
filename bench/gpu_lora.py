"""The LoRA path end to end on one machine, meant for a lent GPU (``device = "auto"``): serve a local HF model
directory, train LoRA steps from scored traffic through the real HTTP API, hot-swap the adapter releases, and
print decode tokens/s, training step time and swap time. Unattended, one go, bounded by ``--minutes``.

What it does, against a real daemon it starts (its own ``REEF_HOME`` in a temp dir):
1. serves ``--model`` (default: a model of SmolLM2-135M's shape with random weights, built here, since nothing
   can be downloaded where it runs), and measures decode tokens/s at concurrency 1 and 8;
2. creates an ``online-rl`` scenario with ``lora = true`` and drives scored traffic: each prompt asked
   ``group_size`` times at temperature 1, every answer scored by a fixed reward (the share of its letters in
   a-m: it varies between samples, so every group teaches something; the point is the mechanics, not the skill)
   and reported by receipt, until ``--steps`` adapter releases are published or the time is up;
3. prints the step times the trainer recorded (``train_s`` with loading and evaluation, ``step_s`` the
   optimizer steps alone), the adapter size, and each swap: from the release's publication to the first answer
   that names it, taken from the traffic itself.

Run on a GPU: ``python bench/gpu_lora.py [--model DIR] [--minutes 7]``
Check on a CPU: ``python bench/gpu_lora.py --cpu --small`` (the tiny model, a few steps, about 2 minutes)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import start  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [f"Tell me about {w}." for w in ("caches", "files", "tests", "locks", "queues", "graphs", "builds",
                                           "streams", "tokens", "shells", "hashes", "trees")]


def reward(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c <= "m" for c in letters) / len(letters) if letters else 0.0



def throughput(url: str, token: str, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Completion tokens per second of ``concurrency`` clients sending requests for ``seconds``."""
    tokens = [0] * concurrency
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=300) as c:
            while time.monotonic() < end:
                r = c.post("/s/speed/v1/chat/completions", json={
                    "model": "m", "max_tokens": max_tokens, "temperature": 1,
                    "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]})
                r.raise_for_status()
                tokens[k] += r.json()["usage"]["completion_tokens"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.monotonic() - t0)


def learn(url: str, token: str, *, clients: int, group_size: int, max_tokens: int, steps: int,
          until: float) -> list[tuple[float, float, str]]:
    """Scored traffic on scenario ``gpu`` until ``steps`` train releases exist or ``until``; (sent, answered,
    release id) of every answer."""
    served: list[tuple[float, float, str]] = []
    stop = threading.Event()
    errors: list[str] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=300) as c:
            i = k
            while not stop.is_set() and time.monotonic() < until:
                prompt = PROMPTS[i % len(PROMPTS)]
                for _ in range(group_size):
                    sent = time.time()
                    r = c.post("/s/gpu/v1/chat/completions", json={
                        "model": "m", "max_tokens": max_tokens, "temperature": 1,
                        "messages": [{"role": "user", "content": prompt}]})
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                        continue
                    served.append((sent, time.time(), r.headers["x-reef-release-id"]))
                    c.post("/reef/report", json={"score": reward(r.json()["choices"][0]["message"]["content"] or ""),
                                                 "references": [r.headers["x-reef-agent-record-id"]]})
                i += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=60) as c:
        while time.monotonic() < until and not stop.is_set():
            time.sleep(2)
            chain = c.get("/reef/scenarios/gpu/releases").json()["releases"]
            done = sum(r["operation"] == "train" for r in chain)
            print(f"  {done} adapter releases, {len(served)} answers", flush=True)
            if done >= steps:
                stop.set()
    stop.set()
    for t in threads:
        t.join()
    if errors:
        print(f"  {len(errors)} failed requests, first: {errors[0]}")
    return served


def med(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} s, max {max(xs):.3f} s" if xs else "none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a local HF model directory (default: SmolLM2-135M's shape, random)")
    ap.add_argument("--cpu", action="store_true", help='serve and train on the CPU (device = "cpu", not "auto")')
    ap.add_argument("--small", action="store_true", help="the tiny model and a few short steps (a CPU check)")
    ap.add_argument("--minutes", type=float, default=7.0, help="the whole run, building the model included")
    ap.add_argument("--steps", type=int, default=None, help="adapter releases to train (default 20; 3 --small)")
    args = ap.parse_args()
    t_start = time.monotonic()
    deadline = t_start + args.minutes * 60
    small = args.small
    steps = args.steps or (3 if small else 20)
    max_tokens = 8 if small else 48
    group_size, batch_prompts = (2, 2) if small else (4, 8)

    import torch

    from bench.lora_models import smollm2_shaped
    from daemon.models import init_tiny

    gpu = torch.cuda.is_available() and not args.cpu
    print(f"device: {torch.cuda.get_device_name() if gpu else 'cpu'} (torch {torch.__version__})", flush=True)
    work = Path(tempfile.mkdtemp(prefix="reef-bench-gpu-lora-"))
    proc = None
    try:
        if args.model:
            model = args.model.resolve()
        elif small:
            model = init_tiny(work / "tiny")
        else:
            t0 = time.monotonic()
            model = smollm2_shaped(work / "smollm2-shaped")
            print(f"built a random model of SmolLM2-135M's shape in {time.monotonic() - t0:.0f} s", flush=True)
        home = work / "home"
        (home / "logs").mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cores = os.cpu_count() or 2
        (home / "config.toml").write_text(
            f'port = {port}\ndefault_model = "m"\ntrainer_threads = {max(1, cores // 2)}\n'
            f'[models.m]\nengine = "transformers"\npath = "{model}"\ndevice = "{"cpu" if args.cpu else "auto"}"\n'
            f"threads = {max(1, cores // 2)}\nmax_batch = 16\nmemory_budget_mb = 16384\n"
            f'[recipes.online-rl]\nlora = true\nbatch_prompts = {batch_prompts}\ngroup_size = {group_size}\n'
            f'gate = "always"\nlr = 0.001\nmax_staleness = 4\n'
        )
        proc = start(home, port, timeout_s=max(1.0, deadline - time.monotonic()))
        url, token = f"http://127.0.0.1:{port}", (home / "token").read_text().strip()
        with httpx.Client(base_url=url, headers={"x-api-key": token}, timeout=300) as c:
            c.post("/s/speed/v1/chat/completions", json={"model": "m", "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": "hi"}]})
            tps = {n: throughput(url, token, n, 6 if small else 15, max_tokens) for n in (1, 8)}
            print(f"decode: {tps[1]:.0f} tokens/s at concurrency 1, {tps[8]:.0f} at 8", flush=True)
            created = c.post("/reef/scenarios", json={"name": "gpu", "recipe": "online-rl"})
            assert created.status_code == 201, created.text
            left = deadline - time.monotonic() - 30  # room to report and stop
            print(f"learning for up to {left:.0f} s ({steps} adapter releases wanted)", flush=True)
            served = learn(url, token, clients=8, group_size=group_size, max_tokens=max_tokens, steps=steps,
                           until=time.monotonic() + max(0.0, left))
            chain = c.get("/reef/scenarios/gpu/releases").json()["releases"]
            rejected = c.get("/reef/scenarios/gpu/releases", params={"all": "1"}).json().get("rejected", [])
        trained = [r for r in chain if r["operation"] == "train"]
        train_s = [float(r["metrics"]["train_s"]) for r in trained if "train_s" in r["metrics"]]
        step_s = [float(r["metrics"]["step_s"]) for r in trained if "step_s" in r["metrics"]]
        swaps = []
        for r in trained:
            answers = [t for _, t, rid in served if rid == r["release_id"]]
            if answers:
                swaps.append(min(answers) - float(r["created_at"]))
        size = max((r["metrics"].get("adapter_bytes", 0) for r in trained), default=0) / 2**20
        print(f"adapter releases: {len(trained)} ({len(rejected)} steps not published), adapter {size:.1f} MiB each")
        print(f"training step (the worker's optimizer steps, {batch_prompts * group_size} samples): {med(step_s)}; "
              f"with loading: {med(train_s)}")
        print(f"swap (release published -> first answer from it, under load): {med(swaps)}; one answer took "
              f"{med([end - sent for sent, end, _ in served])}")
        print(f"answers: {len(served)}; total {time.monotonic() - t_start:.0f} s")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
