"""sao's steps per second against online-rl's, on the same model in the same daemon and run, each step trained,
published as a release and served: a scored answer (sao) or a batch of them (online-rl) reported, then timed from
the last report to the step's release (or its written-down rejection) on the chain.

On a model of SmolLM2-135M's shape with random weights, built locally (``bench/lora_models.py``; or a local HF
model directory, ``--model``, such as ``~/.reef/models/smollm2``), on the CPU. Both recipes train LoRA adapters
there (``lora`` unset: the model is past ``LORA_AUTO_PARAMS``) and publish adapter releases; ``--whole`` also
times sao with ``lora = false`` (a whole copy of the model per step, as sao did before it trained adapters).
Each recipe's first step is left out (the worker loads the model; sao's first report seeds its critic).

Measured 2026-12-03, 2 cores at load 5-6, ``--steps 4 --whole``: online-rl 0.353 steps/s (2.83 s a step, 4
answers), sao 0.434 steps/s (2.30 s, 1.23x online-rl's), sao with ``lora = false`` 0.131 steps/s (7.65 s, 0.37x);
releases 9.37 MiB (adapter), 9.37 MiB (adapter and critic), 513 MiB (whole weights, float32) of a 257 MiB model.

After each recipe: its training steps, the daemon's peak resident memory (VmHWM: the daemon's whole life so far,
so with ``--recipes sao`` alone it is sao's) against the bound ``bench/learning_real.py`` states, and the trainer's
peak (``trainer_peak_rss_mb``). ``--recipes sao --model ~/.reef/models/smollm2`` is sao at its defaults on
SmolLM2 (the gate ``periodic``, the held-out check on).

Run: ``.venv/bin/python bench/sao_lora.py [--model DIR] [--steps N] [--whole] [--recipes online-rl,sao]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import start  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ONLINE = {"batch_prompts": 2, "group_size": 2, "steps_per_batch": 1, "gate": "always"}  # 4 answers a step



def consumed(c: httpx.Client, scenario: str) -> tuple[set[str], dict[str, Any]]:
    chain = c.get(f"/reef/scenarios/{scenario}/releases", params={"all": "1"}).json()
    return {r for x in chain["releases"] + chain["rejected"] for r in x.get("receipts", [])}, chain


def steps(c: httpx.Client, scenario: str, recipe: str, settings: dict[str, Any], n: int, per_step: int,
          group: int) -> dict[str, Any]:
    """``n + 1`` steps of ``per_step`` answers (groups of ``group`` answers to one prompt, scored 0 and 1 in turn);
    the seconds from each step's last report to its release, the first left out."""
    c.post("/reef/scenarios", json={"name": scenario, "recipe": recipe, "settings": settings}).raise_for_status()
    times, i = [], 0
    for step in range(n + 1 + (recipe == "sao")):  # sao: one more, the report that seeds its critic
        receipts = []
        for k in range(per_step):
            r = c.post(f"/s/{scenario}/v1/chat/completions", json={
                "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": f"Say w{i + k // group}."}]})
            r.raise_for_status()
            receipts.append(r.headers["x-reef-agent-record-id"])
        i += per_step
        t0 = time.perf_counter()
        for k, receipt in enumerate(receipts):
            c.post("/reef/report", json={"score": float((k + step) % 2), "references": [receipt]}).raise_for_status()
        while not set(receipts) <= (got := consumed(c, scenario))[0]:
            time.sleep(0.05)
        if step >= 1 + (recipe == "sao"):
            times.append(time.perf_counter() - t0)
    head = got[1]["releases"][0]
    return {"times": times, "head": head, "released": sum(r["operation"] == "train" for r in got[1]["releases"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a local HF model directory (default: SmolLM2-135M's shape, random)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per recipe")
    ap.add_argument("--whole", action="store_true", help="also time sao with lora = false (whole weights)")
    ap.add_argument("--recipes", default="online-rl,sao", help="which of online-rl and sao to time")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reef-bench-sao-lora-"))
    proc = None
    try:
        if args.model is None:
            from bench.lora_models import smollm2_shaped

            args.model = smollm2_shaped(work / "model")
        home = work / "home"
        (home / "logs").mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        (home / "config.toml").write_text(
            f'port = {port}\ndefault_model = "m"\n[models.m]\nengine = "transformers"\npath = "{args.model}"\n')
        proc = start(home, port)
        token = (home / "token").read_text().strip()
        from bench.learning_real import memory, memory_line
        from daemon.releases import ReleaseStore

        store = ReleaseStore(home / "artifacts.git")
        runs = [r for r in [("online-rl", "online-rl", ONLINE, 4, 2), ("sao", "sao", {}, 1, 1)]
                if r[0] in args.recipes.split(",")]
        if args.whole:
            runs.append(("sao-whole", "sao", {"lora": False}, 1, 1))
        out: dict[str, dict[str, Any]] = {}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=600) as c:
            for scenario, recipe, settings, per_step, group in runs:
                r = steps(c, scenario, recipe, settings, args.steps, per_step, group)
                size = sum(f.size for f in store.files(r["head"]["release_id"]))
                init = store.history(scenario)[-1]
                whole = sum(f.size for f in store.files(init.release_id))
                adapter = store.adapter(r["head"]["release_id"]) is not None
                med = statistics.median(r["times"])
                out[scenario] = {"median": med, "per_step": per_step}
                print(f"{scenario:10s} {1 / med:6.3f} steps/s (median {med:.2f} s report -> release, "
                      f"{min(r['times']):.2f}-{max(r['times']):.2f}; {per_step} answer(s) a step, "
                      f"{per_step / med:.2f} answers/s); head release {size / 2**20:.2f} MiB "
                      f"({'LoRA adapter' if adapter else 'whole weights'}) against the model's {whole / 2**20:.0f} MiB",
                      flush=True)
                print(f"{scenario:10s} {memory_line(memory(c, scenario, proc.pid))}", flush=True)
        base = out["online-rl"]["median"] if "online-rl" in out else None
        for name in out:
            if name != "online-rl" and base is not None:
                print(f"{name} steps/s against online-rl's: {base / out[name]['median']:.2f}x (goal >= 0.5x)")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
