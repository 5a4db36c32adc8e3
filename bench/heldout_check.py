"""What the held-out check (``daemon/gating/heldout.py``) adds to a weights step's wall time, on the default model
(SmolLM2-135M-Instruct) at online-rl's defaults, and what it measured.

One daemon as ``reef serve`` starts it (no configuration but its port), one scenario ``{"recipe": "online-rl"}``
with no settings (the check on, at its defaults), and the client of ``bench/learning_real.py``: everyday
questions asked once each, answers up to ``--max-tokens`` (60), each scored on a preference and reported. After
``--steps`` steps, the step events on ``/reef/events`` give, per step: the step's wall time (``train.start`` to
``gate``), the check's own time (``heldout_seconds``, which the check measures around its answers and KL), the
step without it (the difference), the ratio of the check to the step without it (the budget: at most 0.25), and
the check's figures and verdict. The head's answers are kept per head release, so a step whose head did not move
since the last check samples only the candidate: both kinds are printed.

``--pref`` picks the scorer: ``brief`` (guarded: an answer not about the question scores 0) or ``fewer-words``
(unguarded: fewer words score higher, the empty answer best: the kind of scorer issue 41 saw collapse a policy).

At the defaults a passing candidate serves as a canary (``canary_share`` 0.5) and the loop waits for its verdict
(some 400 paired reports) before the next step; ``--canary-share 0`` publishes it at once, so several steps come
within the hour (the check and the training cost the same either way).

Run (nothing else on the machine): ``.venv/bin/python bench/heldout_check.py [--steps 4] [--pref brief]
[--canary-share 0] [--settings JSON] [--json]``
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import learning_real as lr  # noqa: E402  (the daemon, the model, the questions and the scorers)


def fewer_words(noun: str, answer: str) -> float:
    return max(0.0, 1.0 - len(answer.split()) / 50)


SCORERS = {"brief": lr.brief, "fewer-words": fewer_words}


def events(c: httpx.Client) -> list[dict[str, Any]]:
    out = []
    with c.stream("GET", "/reef/events", params={"after": 0}, timeout=5) as resp:
        try:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    out.append(json.loads(line[6:]))
        except httpx.ReadTimeout:  # the history is read; the stream waits for news
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pref", choices=sorted(SCORERS), default="brief")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=40)
    ap.add_argument("--model", type=Path, help="a SmolLM2 directory made before (default: made here, ~90 s)")
    ap.add_argument("--canary-share", type=float, help="the scenario's canary_share (default: the recipe's, 0.5); "
                    "0 publishes a passing candidate at once: at 0.5 the loop waits for the canary's verdict, some "
                    "400 paired reports, before its next step")
    ap.add_argument("--settings", default="{}", help="more of the scenario's settings, as JSON (e.g. "
                    "'{\"heldout_max_tokens\": 48}')")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reef-heldout-bench-"))
    model = args.model or lr.make_model(work)
    home = work / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "smollm2").symlink_to(model)
    port = lr.free_port()
    (home / "config.toml").write_text(f"port = {port}\n")
    proc = lr.start(home, port)
    token = (home / "token").read_text().strip()
    rng = random.Random(args.seed)
    questions = [(t.format(x=n), n) for t in lr.TEMPLATES for n in lr.NOUNS]
    rng.shuffle(questions)
    score = SCORERS[args.pref]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=600) as c:
            settings = {} if args.canary_share is None else {"canary_share": args.canary_share}
            settings.update(json.loads(args.settings))
            c.post("/reef/scenarios", json={"name": "real", "recipe": "online-rl", "settings": settings}
                   ).raise_for_status()
            t0 = time.monotonic()
            for i, (prompt, noun) in enumerate(questions):
                answer, receipt, _, _ = lr.ask(c, prompt, args.max_tokens)
                c.post("/reef/report", json={"score": score(noun, answer), "references": [receipt]}).raise_for_status()
                gates = [e for e in events(c) if e["kind"] == "gate"] if i % 8 == 7 else []
                if len(gates) >= args.steps or time.monotonic() - t0 > args.minutes * 60:
                    break
                if i % 16 == 15:
                    print(f"  {(time.monotonic() - t0) / 60:5.1f} min, {i + 1} answers, {len(gates)} steps", flush=True)
            deadline = time.monotonic() + 600  # the step under way ends
            while c.get("/reef/status").json()["learning"].get("real") == "training" and time.monotonic() < deadline:
                time.sleep(1)
            evs = events(c)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    rows = []
    starts = {e["job"]: e for e in evs if e["kind"] == "train.start"}
    for gate in (e for e in evs if e["kind"] == "gate" and e.get("job") in starts):
        m = gate.get("metrics") or {}
        wall = gate["time"] - starts[gate["job"]]["time"]
        check = m.get("heldout_seconds")
        rows.append({"job": gate["job"], "verdict": gate["verdict"], "step_s": round(wall, 2),
                     "check_s": check, "without_check_s": None if check is None else round(wall - check, 2),
                     "ratio": None if check is None else round(check / max(1e-9, wall - check), 3),
                     **{k: v for k, v in m.items() if k.startswith("heldout") and k != "heldout_seconds"},
                     "kl_from_base": m.get("kl_from_base"), "batch_reward": m.get("batch_reward")})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"\nonline-rl at its defaults on SmolLM2, scorer {args.pref}: {len(rows)} steps")
    print(f"{'step':>4} {'verdict':>9} {'step s':>8} {'check s':>8} {'without':>8} {'ratio':>6}  figures")
    for n, r in enumerate(rows, 1):
        fig = (f"empty {r.get('heldout_empty')} (head {r.get('heldout_head_empty')}), degenerate "
               f"{r.get('heldout_degenerate')} (head {r.get('heldout_head_degenerate')}), probes "
               f"{r.get('heldout_probe_accuracy')} (head {r.get('heldout_head_probe_accuracy')}), KL "
               f"{r.get('heldout_kl')}, length x{r.get('heldout_length_ratio')}, recorded {r.get('heldout_recorded')}")
        print(f"{n:>4} {r['verdict']:>9} {r['step_s']:>8} {str(r['check_s']):>8} {str(r['without_check_s']):>8} "
              f"{str(r['ratio']):>6}  {fig}")
        if r.get("heldout_reason"):
            print(f"     {r['heldout_reason']}")


if __name__ == "__main__":
    main()
