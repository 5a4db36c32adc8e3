"""ttt-discover on one problem through a real daemon: do the best and the mean attempt scores rise over steps?

One fresh daemon builds ``tiny-demo`` (the demo model, warmed up to say one word and stop), a ``ttt-discover``
scenario is created with a built-in problem scorer (``longest-word`` by default: "Say one long word.", scored by the
length of the known word answered over 12), and the bench plays the client: each round it asks the problem
``group_size`` times at once (temperature 1), scores every attempt with the problem's scorer, and reports each score
by receipt with the round as its ``group``; then it waits until the daemon has learned from that round (the step
published a release or was rejected) before the next round, so every round is served by the current head. It prints
one line per step: the round's mean and best attempt, the best attempt so far, and the gate's figures (the mean
score of the candidate's and the head's sampled attempts), then the scenario's status (the best attempt found and
the release that served it), and its memory: training steps, the daemon's peak resident memory (VmHWM) against
the bound ``bench/learning_real.py`` states, the trainer's peak (``trainer_peak_rss_mb``).

Run: ``.venv/bin/python bench/ttt_discover.py [--steps 60] [--problem longest-word] [--seed 0]``, or with your
own problem: ``--scorer "python3 bench/scorers/distinct_letters.py" --prompt "Say one long word."`` (the command
scores each attempt for the client, and the gate runs it too).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import cli_home  # noqa: E402


def main() -> None:
    from recipes.tasks import get_problem
    from recipes.ttt_discover import TTTSettings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--problem", default="longest-word")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny-demo", choices=("tiny-demo", "smollm2"),
                    help="the served model: the demo model, or SmolLM2-135M-Instruct (made here, no download)")
    ap.add_argument("--minutes", type=float, default=60.0, help="stop after this many minutes of rounds")
    ap.add_argument("--reuse", action="store_true", help="state reuse: each round starts from the attempt the "
                    "scenario's status offers (next_start, the source's PUCT), named in its reports' metadata")
    ap.add_argument("--settings", default="{}", help="extra recipe settings (JSON)")
    ap.add_argument("--scorer", help="your own scorer command instead of --problem (e.g. 'python3 "
                    "bench/scorers/distinct_letters.py'): the client and the gate both score with it")
    ap.add_argument("--prompt", default="Say one long word.", help="the problem's prompt, with --scorer")
    ap.add_argument("--model-dir", type=Path, help="the model's directory, made before (default: made here)")
    args = ap.parse_args()
    if args.scorer:
        from recipes.tasks import CommandScorer

        argv = [str(Path(a).resolve()) if Path(a).is_file() else a for a in shlex.split(args.scorer)]  # any cwd
        problem = CommandScorer(argv, 30.0)
        problem.prompt = args.prompt
        settings = {"scorer": argv, **json.loads(args.settings)}
    else:
        problem = get_problem(args.problem)
        settings = {"problem": args.problem, **json.loads(args.settings)}
    group = int(settings.get("group_size", TTTSettings.group_size))
    max_tokens = int(settings.get("max_new_tokens", TTTSettings.max_new_tokens))
    home, port, env, reef = cli_home("reef-bench-ttt-")
    try:
        t0 = time.monotonic()
        # the model first: a daemon started without it builds it itself (first use), and that build, not the
        # recipe, would be the daemon's peak memory
        if args.model_dir:  # made before (``reef model init``), shared read-only
            (home / "models").mkdir()
            (home / "models" / args.model).symlink_to(args.model_dir.resolve())
        else:
            subprocess.run([*reef, "model", "init", args.model], env=env, check=True, capture_output=True)
        subprocess.run([*reef, "daemon", "start"], env=env, check=True, capture_output=True)
        print(f"{args.model} made in {time.monotonic() - t0:.1f} s; problem {args.scorer or args.problem}: "
              f"{problem.prompt!r}")
        token = (home / "token").read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=300) as c, \
                ThreadPoolExecutor(group) as pool:
            c.post("/reef/scenarios", json={"name": "ttt", "recipe": "ttt-discover", "model": args.model,
                                            "settings": settings}).raise_for_status()

            prompt, start = problem.prompt, None

            def attempt(seed: int) -> tuple[str, str]:
                r = c.post("/s/ttt/v1/chat/completions", json={
                    "model": args.model, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
                    "messages": [{"role": "user", "content": prompt}]})
                r.raise_for_status()
                return r.headers["x-reef-agent-record-id"], r.json()["choices"][0]["message"]["content"] or ""

            best, started = 0.0, time.monotonic()
            print("step  mean   best-in-step  best-so-far  verdict   candidate  head   answer")
            means: list[float] = []
            for step in range(1, args.steps + 1):
                if time.monotonic() - started > args.minutes * 60:
                    break
                done = len(chain(c, all_=True))
                offered = (c.get("/reef/scenarios/ttt").json().get("recipe_status") or {}).get("next_start")
                if args.reuse and offered:  # the source's prompt shape: the state, then the problem again
                    start = offered["receipt"]
                    prompt = (f"A previous attempt scored {offered['score']:.2f}: {offered['text'].strip()}\n"
                              f"{problem.prompt} Do better than the previous attempt.")
                results = list(pool.map(attempt, [args.seed * 1_000_003 + step * group + i for i in range(group)]))
                scores = [problem.score(text) for _, text in results]
                for (receipt, _), score in zip(results, scores, strict=True):
                    c.post("/reef/report", json={"score": score, "references": [receipt],
                                                 "metadata": {"group": f"round-{step}",
                                                              **({"start": start} if start else {})}}
                           ).raise_for_status()
                deadline = time.monotonic() + 300
                while len(steps := chain(c, all_=True)) == done and time.monotonic() < deadline:
                    time.sleep(0.05)
                last = steps[0] if len(steps) > done else {}
                m = last.get("metrics") or {}
                best = max(best, *scores)
                means.append(sum(scores) / len(scores))
                top = max(zip(scores, (t for _, t in results), strict=True))[1]
                verdict = "accepted" if last.get("operation") == "train" and last.get("verdict") != "pending" \
                    else last.get("verdict", "?")
                print(f"{step:4d}  {sum(scores) / len(scores):.3f}  {max(scores):.3f}         {best:.3f}        "
                      f"{verdict:8s}  {fmt(m.get('eval_reward'))}      "
                      f"{fmt(m.get('base_reward'))}  {top.strip()!r}", flush=True)
            # a round whose step outlived its wait (300 s) is still learning: its step counts once it is written
            # down, within --minutes, so the memory read below covers every round's step
            while len(chain(c, all_=True)) < len(means) and time.monotonic() - started < args.minutes * 60:
                time.sleep(1)
            status = c.get("/reef/scenarios/ttt").json().get("recipe_status")
            k = min(5, len(means) // 2)
            if k:
                print(f"mean attempt score, first {k} rounds {sum(means[:k]) / k:.3f} -> last {k} rounds "
                      f"{sum(means[-k:]) / k:.3f}; best attempt {best:.3f}; {len(means)} rounds in "
                      f"{(time.monotonic() - started) / 60:.1f} min (seed {args.seed}, model {args.model})")
            print(f"{args.steps} steps in {time.monotonic() - started:.0f} s; scenario status: {json.dumps(status)}")
            from bench.learning_real import memory, memory_line

            print(memory_line(memory(c, "ttt", int((home / "reef.pid").read_text()))), flush=True)
    finally:
        subprocess.run([*reef, "daemon", "stop"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def chain(c: httpx.Client, all_: bool) -> list[dict]:
    """The scenario's steps, newest first: releases (but the init one), rejected or skipped candidates, and held ones
    (pending: a step held for review is a step too; waiting for it to publish would wait for a person)."""
    body = c.get("/reef/scenarios/ttt/releases", params={"all": "1"} if all_ else {}).json()
    steps = [r for r in body["releases"] if r["operation"] != "init"] + body.get("rejected", []) + \
        [{**r, "verdict": "pending"} for r in body.get("pending", [])]
    return sorted(steps, key=lambda r: r["created_at"], reverse=True)


def fmt(v: object) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "  -  "


if __name__ == "__main__":
    main()
