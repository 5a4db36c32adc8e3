"""openclaw-rl learning from ordinary use, with no reports at all: a scripted user (a bench client, not part of
the product) holds a preference the model lacks, corrects the agent in its next message whenever it is broken and
moves on when it holds; the rule judge turns those next messages into rewards. Prints the correction rate per
window of judged turns: it should fall.

The user: each session asks for one word (the ``say`` task family, on ``tiny-demo``: "Say file.", "Echo window
back." ...). An exact answer gets "Thanks. <the next request>" (the rule judge: good); anything else gets "No, just
say the word <w>." (bad) and the session goes on with that correction, at most 3 turns. Sessions run 8 at a time,
at temperature 1, through the real HTTP API.

At the end: the training steps, the daemon's peak resident memory (VmHWM) against the bound
``bench/learning_real.py`` states, and the trainer's peak (``trainer_peak_rss_mb``). ``--model smollm2 --defaults``
runs the recipe at its own defaults (no settings: the rule judge, the gate ``regression`` with the held-out check)
on SmolLM2-135M-Instruct (made here, no download); ``--steps N`` stops after N training steps.

Run: ``.venv/bin/python bench/openclaw_rl.py [--minutes 6] [--seed 0] [--model smollm2 --defaults] [--steps N]``
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import cli_home  # noqa: E402

SETTINGS = {"batch_prompts": 32, "lr": 2e-3, "gate": "regression", "margin": 0.05, "eval_family": "say",
            "eval_n": 128}


def session(c: httpx.Client, family: object, rng: random.Random, log: list[bool], stop: threading.Event,
            model: str = "tiny-demo") -> None:
    tasks = family.train_tasks(0)  # type: ignore[attr-defined]
    task = rng.choice(tasks)
    messages = [{"role": "user", "content": task.prompt}]
    for _turn in range(3):
        if stop.is_set():
            return
        r = c.post("/s/oc/v1/chat/completions", json={"model": model, "max_tokens": 8, "temperature": 1,
                                                      "seed": rng.randrange(1 << 30), "messages": messages})
        r.raise_for_status()
        answer = r.json()["choices"][0]["message"]["content"]
        right = family.exact(task, answer) == 1.0  # type: ignore[attr-defined]
        log.append(not right)
        messages.append({"role": "assistant", "content": answer})
        if right:
            task = rng.choice(tasks)
            messages.append({"role": "user", "content": f"Thanks. {task.prompt}"})
        else:
            messages.append({"role": "user", "content": f"No, just say the word {family.target(task)}."})  # type: ignore[attr-defined]
    # the session's last answer is judged by nothing: it ends there (neutral, no reward)


def main() -> None:
    from recipes.tasks import get_family

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=200)
    ap.add_argument("--model", default="tiny-demo", choices=("tiny-demo", "smollm2"))
    ap.add_argument("--defaults", action="store_true", help="the recipe's own defaults, not this bench's settings")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many training steps (0: --minutes only)")
    ap.add_argument("--model-dir", type=Path, help="the model's directory, made before (default: made here)")
    args = ap.parse_args()
    home, port, env, reef = cli_home("reef-bench-openclaw-")
    family = get_family("say")
    log: list[bool] = []
    stop = threading.Event()
    try:
        # the model first: a daemon started without it builds it itself (first use), and that build, not the
        # recipe, would be the daemon's peak memory
        if args.model_dir:  # made before (``reef model init``), shared read-only
            (home / "models").mkdir()
            (home / "models" / args.model).symlink_to(args.model_dir.resolve())
        else:
            subprocess.run([*reef, "model", "init", args.model], env=env, check=True, capture_output=True)
        subprocess.run([*reef, "daemon", "start"], env=env, check=True, capture_output=True)
        token = (home / "token").read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=120) as c:
            c.post("/reef/scenarios", json={"name": "oc", "recipe": "openclaw-rl", "model": args.model,
                                            "settings": {} if args.defaults else SETTINGS}).raise_for_status()
            from bench.learning_real import memory, memory_line

            pid = int((home / "reef.pid").read_text())

            def worker(i: int) -> None:
                rng = random.Random(args.seed * 1000 + i)
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token},
                                  timeout=120) as wc:
                    while not stop.is_set():
                        session(wc, family, rng, log, stop, args.model)

            threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            shown = 0
            while time.monotonic() - t0 < args.minutes * 60:
                time.sleep(1)
                if args.steps and memory(c, "oc", pid)["steps"] >= args.steps:
                    break
                while len(log) - shown >= args.window:
                    window = log[shown: shown + args.window]
                    shown += args.window
                    status = c.get("/reef/scenarios/oc/releases").json()
                    print(f"{time.monotonic() - t0:6.0f} s  turns {shown:6d}  correction rate "
                          f"{sum(window) / len(window):.2f}  head step {status['releases'][0]['step']}", flush=True)
            stop.set()
            for t in threads:
                t.join(30)
            reports = c.get("/reef/status").json()
            print(memory_line(memory(c, "oc", pid)), flush=True)
        first, last = log[: args.window], log[-args.window:]
        print(f"correction rate: first {sum(first) / max(len(first), 1):.2f}, last {sum(last) / max(len(last), 1):.2f}"
              f" over {len(log)} turns, no explicit reports ({reports.get('reports', '?')} judge reports stored)")
    finally:
        stop.set()
        subprocess.run([*reef, "daemon", "stop"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
