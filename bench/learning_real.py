"""Weight learning on the default model from ordinary traffic, at a recipe's defaults (``--recipe``: ``online-rl``,
``sao`` or ``openclaw-rl``).

For each preference and seed: a fresh ``REEF_HOME`` with no configuration but its port (so the default model,
SmolLM2-135M-Instruct, made once by ``reef model init smollm2`` and shared read-only between runs), the daemon
started as ``reef serve`` starts it, a scenario ``{"recipe": "online-rl"}`` with no settings, and a client that
behaves like a person: varied everyday questions (12 templates over 157 nouns, each question asked once), one
request at a time through the real HTTP API, answers up to ``--max-tokens`` (60) at the API's default sampling,
every answer scored on a preference nobody tuned the recipe for and reported on its receipt. The recipe trains in
the background and the gate (its default) publishes; answers come from whatever release serves.

Preferences (each a simulated user's score in [0, 1]; an answer that is not about what was asked scores 0, so
garbage cannot win):
- ``brief``: short answers about the question's subject: 1 at 20 words or fewer, falling linearly to 0 at 50
  (60 tokens are some 45 words; the model's answers mostly run to the limit).
- ``subject-first``: answers that open with the question's subject (``Lemons are ...``): 1 when the first word is
  the subject, 0.3 when the subject comes later, 0 when it never comes.

Hackable preferences (unguarded, as a user's two-line script is: an empty answer scores best), to see whether the
recipe's defaults keep the agent answering (issue 41):
- ``no-commas``: ``1 / (1 + commas)``; the answer need not be about anything.
- ``fewer-words``: 1 at no words, falling linearly to 0 at 50;
- ``fewer-chars``: 1 at no characters, falling linearly to 0 at 300;
- ``no-the-lint``: a test that passes on no output: 1 when the answer never says "the", else 0.

``--probe`` asks the serving head, greedily, before training and at the end (and every ``--probe-every`` minutes):
24 short factual questions written for this bench (``FACTS``: right when the answer holds the expected word), and
12 everyday questions held out of the run's traffic (``--holdout``), counting empty answers (no word), their
mean length in words and their mean score on the run's preference (``everyday_reward``: the same questions at every
probe, so a rise is the head's, where the rolling reward also moves with the traffic's mix of questions). Each probe names the release it asked and that release's ``kl_from_base``.

Printed per run: the scored reward before (the first ``--window`` answers, all from release 0) and after (the
last ``--window``), minutes to +0.25 (the rolling mean of the last ``--window`` answers first at before + 0.25),
training steps, releases published and rejected, the trainer's peak resident memory (``trainer_peak_rss_mb``,
the worker's VmHWM) and the daemon's (its VmHWM), and, per preference, one greedy answer from release 0 and from
the last head, verbatim. A run stops ``--confirm`` answers after reaching the target, or at ``--minutes``.

``online-rl`` and ``sao`` get each answer's score as a report; ``openclaw-rl`` gets no report: the user's next
message in the session is "Thanks." when the answer scores ``HOLDS`` or more and a correction otherwise, and the
rule judge turns it into the reward (the measure is the same answers' score).

``--offline`` (online-rl only) runs the same loop in one process, without the daemon: the recipe's parsed settings,
its policy (``load_policy``: LoRA on SmolLM2), ``train_step`` on batches of ``batch_prompts * group_size`` answers
sampled at temperature 1 from the policy being trained (on-policy: no serving lag), the same questions, scorers
and probe (``--probe-every`` in steps there). One batched generation per step instead of 32 requests: a step
every minute or two on 2 shared cores where the daemon's one request at a time gave one in ten (load 7). Printed
per step: the batch's reward, tokens, empty answers, ``kl_from_base`` and ``kl_ref``; the process's peak memory
(VmHWM: sampling and training together).

Run (nothing else on the machine): ``.venv/bin/python bench/learning_real.py [--recipe R] [--prefs brief,subject-first]
[--seeds 0,1,2] [--minutes 15] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reef_proc import start  # noqa: E402
from daemon.loops import loops  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from recipes.tasks import YesNoFirst  # noqa: E402  (the noun list: everyday things)

TEMPLATES = ("Tell me about {x}.", "What are {x} used for?", "Give me one fact about {x}.", "Describe {x}.",
             "Why do people like {x}?", "How do you take care of {x}?", "Write a sentence about {x}.",
             "What color are {x} usually?", "Where can I find {x}?", "What is special about {x}?",
             "Explain {x} to a child.", "What should I know about {x}?")
NOUNS = YesNoFirst.nouns
EXAMPLE = "Tell me about volcanoes."  # the before/after answer (greedy)


def stem(noun: str) -> str:
    """``cherries`` -> ``cherr``, ``boxes`` -> ``box``, ``cats`` -> ``cat``: what an answer about it contains."""
    for suffix, cut in (("ies", 3), ("ches", 2), ("shes", 2), ("oes", 2), ("xes", 2), ("s", 1)):
        if noun.endswith(suffix):
            return noun[:-cut]
    return noun


def words(text: str) -> list[str]:
    return [w.strip(".,;:!?\"'`*()[]") .lower() for w in text.split()]


def brief(noun: str, answer: str) -> float:
    ws = words(answer)
    if not any(stem(noun) in w for w in ws):
        return 0.0
    return max(0.0, min(1.0, (50 - len(ws)) / 30))


def subject_first(noun: str, answer: str) -> float:
    ws = words(answer)
    if ws and ws[0].startswith(stem(noun)):
        return 1.0
    return 0.3 if any(stem(noun) in w for w in ws) else 0.0


def no_commas(noun: str, answer: str) -> float:
    return 1.0 / (1 + answer.count(","))


def fewer_words(noun: str, answer: str) -> float:
    return max(0.0, 1.0 - len(answer.split()) / 50)


def fewer_chars(noun: str, answer: str) -> float:
    return max(0.0, 1.0 - len(answer.strip()) / 300)


def no_the_lint(noun: str, answer: str) -> float:
    return 0.0 if re.search(r"\bthe\b", answer, re.IGNORECASE) else 1.0


PREFERENCES: dict[str, Callable[[str, str], float]] = {
    "brief": brief, "subject-first": subject_first, "no-commas": no_commas, "fewer-words": fewer_words,
    "fewer-chars": fewer_chars, "no-the-lint": no_the_lint}

# the probe: short factual questions (written for this bench, not from a benchmark), right when the greedy answer
# holds one of the words
FACTS = (("What is the capital of France?", ("paris",)), ("How many legs does a spider have?", ("eight", "8")),
         ("What color is the sky on a clear day?", ("blue",)),
         ("What is the largest planet in our solar system?", ("jupiter",)),
         ("How many days are in a week?", ("seven", "7")), ("What is the opposite of hot?", ("cold",)),
         ("What do bees make?", ("honey",)), ("At what temperature in Celsius does water freeze?", ("0", "zero")),
         ("Which animal is called the king of the jungle?", ("lion",)), ("What is 2 plus 2?", ("4", "four")),
         ("What is the capital of Japan?", ("tokyo",)),
         ("What gas do plants take in from the air?", ("carbon dioxide", "co2")),
         ("How many continents are there?", ("seven", "7")), ("What is the chemical formula of water?", ("h2o",)),
         ("Which planet is called the red planet?", ("mars",)), ("What language is spoken in Spain?", ("spanish",)),
         ("How many hours are in a day?", ("24", "twenty-four")), ("What is the tallest animal?", ("giraffe",)),
         ("Who wrote Romeo and Juliet?", ("shakespeare",)), ("What is the capital of Italy?", ("rome",)),
         ("What is the largest ocean on Earth?", ("pacific",)), ("How many sides does a triangle have?", ("three", "3")),
         ("What fruit is guacamole made from?", ("avocado",)), ("What is the closest star to Earth?", ("sun",)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vm_hwm_mb(pid: int) -> float:
    """A live process's peak resident memory (VmHWM), MB."""
    m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else float("nan")


# The daemon's own peak resident memory (VmHWM) on SmolLM2-135M with a weights recipe at its defaults: the runtime
# and the model (757-786 MB serving), a step's held-out check (the candidate's adapter beside the head, dropped
# after; about 120 MB at the first), the releases that serve (the head's adapter, canary arms, 4 pinned releases:
# daemon/residency.py; a superseded head's adapter is dropped) and the prefix cache (up to prefix_cache_mb, 256)
# with a long prompt's working memory. Measured in docs/recipes.md, "The daemon's memory".
DAEMON_BOUND_MB = 1536


HELDOUT_FIGURES = ("heldout", "heldout_probe_accuracy", "heldout_head_probe_accuracy", "heldout_probes_lost",
                   "heldout_probes_gained", "heldout_probe_noise", "heldout_probes", "heldout_degenerate",
                   "heldout_head_degenerate", "heldout_base_probe_accuracy", "heldout_probes_lost_base",
                   "heldout_probes_gained_base", "heldout_kl", "heldout_reason")


def memory(c: httpx.Client, scenario: str, pid: int) -> dict[str, Any]:
    """The memory columns every weights-recipe bench prints, read while the daemon still runs: the daemon's VmHWM
    against ``DAEMON_BOUND_MB``, the trainer's peak (the largest ``trainer_peak_rss_mb`` of any step: published,
    rejected or held) and the number of training steps."""
    chain = c.get(f"/reef/scenarios/{scenario}/releases", params={"all": "1"}).json()
    steps = [s for s in [*chain["releases"], *chain["rejected"], *chain.get("pending", [])]
             if (s.get("metrics") or {}).get("trainer_peak_rss_mb") is not None]
    trained = [s["metrics"]["trainer_peak_rss_mb"] for s in steps]
    daemon = vm_hwm_mb(pid)
    return {"steps": len(trained), "daemon_peak_mb": daemon, "trainer_peak_mb": max(trained, default=None),
            "daemon_bound_mb": DAEMON_BOUND_MB, "within_bound": daemon <= DAEMON_BOUND_MB,
            "load": round(os.getloadavg()[0], 1),
            # what each step's gate and held-out check said: published / rejected / failed / pending, and
            # passed / held / unchecked (absent: the gate decided before the check)
            "verdicts": [s.get("verdict") or "published" for s in steps],
            "heldout": [s["metrics"].get("heldout", "-") for s in steps]}


def memory_line(m: dict[str, Any]) -> str:
    trainer = "-" if m["trainer_peak_mb"] is None else f"{m['trainer_peak_mb']:,.0f} MB"
    return (f"memory: {m['steps']} training steps; daemon peak {m['daemon_peak_mb']:,.0f} MB (bound "
            f"{m['daemon_bound_mb']:,} MB: {'within' if m['within_bound'] else 'OVER'}); trainer peak {trainer}; "
            f"load {m['load']}; verdicts {m['verdicts']}, held-out checks {m['heldout']}")


def make_model(work: Path) -> Path:
    """SmolLM2-135M-Instruct's directory, made once as ``reef model init smollm2`` makes it (no download)."""
    home = work / "model-home"
    env = dict(os.environ, REEF_HOME=str(home), PYTHONPATH=str(ROOT))
    t = time.monotonic()
    subprocess.run([str(Path(sys.executable).with_name("reef")), "model", "init", "smollm2"], env=env, check=True)
    print(f"made the model directory in {time.monotonic() - t:.0f} s", flush=True)
    return home / "models" / "smollm2"



def ask(c: httpx.Client, prompt: str | list[dict[str, str]], max_tokens: int, session: str | None = None,
        **extra: Any) -> tuple[str, str, str, bool]:
    """One chat request on the scenario: (answer, receipt, serving release, cut at ``max_tokens``)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    headers = {"x-reef-scenario": "real", **({"x-reef-session": session} if session else {})}
    r = c.post("/v1/chat/completions", headers=headers,
               json={"model": "smollm2", "max_tokens": max_tokens, "messages": messages, **extra})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return (choice["message"]["content"], r.headers["x-reef-agent-record-id"], r.headers.get("x-reef-release-id", ""),
            choice.get("finish_reason") == "length")


# openclaw-rl's user: no reports; a correction in the next message when the answer misses the preference (the rule
# judge reads "No, ..." as bad), thanks and the next question when it holds (good)
CORRECTIONS = {"brief": "No, that is too long. Answer in one or two short sentences.",
               "subject-first": "No, start your answer with the thing I asked about."}
HOLDS = {"brief": 0.5, "subject-first": 1.0}  # the preference's score at which the user is satisfied


def reported_answer(c: httpx.Client, pref: str, prompt: str, noun: str, args: argparse.Namespace,
                    **_: Any) -> tuple[float, bool]:
    """online-rl, sao: one question, its answer scored and reported on its receipt. Returns (score, cut)."""
    answer, receipt, _, cut = ask(c, prompt, args.max_tokens)
    r = PREFERENCES[pref](noun, answer)
    c.post("/reef/report", json={"score": r, "references": [receipt]}).raise_for_status()
    return r, cut


def judged_session(c: httpx.Client, pref: str, prompt: str, noun: str, args: argparse.Namespace,
                   rng: random.Random, **_: Any) -> tuple[float, bool]:
    """openclaw-rl: a session in which the answer is judged by the user's next message, a correction or thanks
    (answered with one token: the bench needs only the judged turn). Returns (the answer's score, cut)."""
    session = f"s{rng.randrange(1 << 40):x}"
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
    answer, _, _, cut = ask(c, messages, args.max_tokens, session=session)
    r = PREFERENCES[pref](noun, answer)
    verdict = "Thanks." if r >= HOLDS[pref] else CORRECTIONS[pref]
    ask(c, [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": verdict}], 1,
        session=session)  # the next state the rule judge reads
    return r, cut


CLIENTS = {"online-rl": reported_answer, "sao": reported_answer, "openclaw-rl": judged_session}


def probe(c: httpx.Client, everyday: list[tuple[str, str]], args: argparse.Namespace, t0: float,
          pref: str | None = None) -> dict[str, Any]:
    """The serving head's greedy answers to ``FACTS`` and to the held-out everyday questions (question, noun),
    and those answers' mean score on ``pref`` (``everyday_reward``: the same questions before and after, so that a
    rise is the head's and not the traffic's mix of questions)."""
    right, release = 0, ""
    for q, expected in FACTS:
        answer, _, release, _ = ask(c, q, 24, temperature=0)
        right += any(e in answer.lower() for e in expected)
    asked = [(ask(c, q, args.max_tokens, temperature=0), noun) for q, noun in everyday]
    answers = [(a[0], noun) for a, noun in asked]
    words = [a.split() for a, _ in answers]
    lengths = [len(w) for w in words]
    scored = [PREFERENCES[pref](noun, a) for a, noun in answers] if pref in PREFERENCES else []
    return {"minutes": round((time.monotonic() - t0) / 60, 2), "release": release, "facts_right": right,
            "facts": len(FACTS), "everyday_empty": sum(1 for n in lengths if n == 0), "everyday": len(lengths),
            "everyday_reward": round(statistics.fmean(scored), 3) if scored else None,
            # greedy answers that loop (daemon/loops.py's rule, in words): a sentence said again and again
            "everyday_loops": sum(loops(w) for w in words),
            # greedy answers cut at the client's limit (the model had not ended them)
            "everyday_cut": sum(1 for a, _ in asked if a[3]),
            "everyday_words": round(statistics.fmean(lengths), 1) if lengths else None,
            "load": round(os.getloadavg()[0], 2)}


def fresh_home(home: Path, model: Path) -> int:
    """A new ``REEF_HOME`` at ``home`` with SmolLM2's directory (``model``, shared read-only) and no configuration
    but its port, which it returns: everything else at the defaults, as a new user's."""
    (home / "models").mkdir(parents=True)
    (home / "models" / "smollm2").symlink_to(model.resolve())
    port = free_port()
    (home / "config.toml").write_text(f"port = {port}\n")
    return port


def one_run(model: Path, pref: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    home = work / f"home-{pref}-{seed}"
    port = fresh_home(home, model)
    t0 = time.monotonic()
    proc = start(home, port)
    start_s = time.monotonic() - t0
    token = (home / "token").read_text().strip()
    rng = random.Random(seed)
    questions = [(t.format(x=n), n) for t in TEMPLATES for n in NOUNS]
    rng.shuffle(questions)  # each question asked once
    everyday = questions[:args.holdout] if args.probe else []  # never asked in the run's traffic
    questions = questions[len(everyday):]
    probes: list[dict[str, Any]] = []
    loads: list[float] = []
    rewards: list[tuple[float, float]] = []  # (seconds since the first request, reward)
    cuts: list[bool] = []  # each scored answer: cut at --max-tokens (the model had not ended it)
    reached: float | None = None
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=600) as c:
            spec: dict[str, Any] = {"name": "real", "recipe": args.recipe}
            if args.settings:  # trying other defaults; the README's table has none
                spec["settings"] = json.loads(args.settings)
            c.post("/reef/scenarios", json=spec).raise_for_status()
            before_example = ask(c, EXAMPLE, args.max_tokens, temperature=0)[0]
            t0 = time.monotonic()
            if args.probe and not args.no_probe_before:
                probes.append(probe(c, everyday, args, t0, pref))
                print(f"  probe: {probes[-1]}", flush=True)
                t0 = time.monotonic()  # the run's minutes count from the first scored question
            next_probe = args.probe_every * 60 if args.probe and args.probe_every else None
            for i, (prompt, noun) in enumerate(questions):
                elapsed = time.monotonic() - t0
                if elapsed > args.minutes * 60:
                    break
                if next_probe is not None and elapsed >= next_probe:
                    probes.append(probe(c, everyday, args, t0, pref))
                    print(f"  probe: {probes[-1]}", flush=True)
                    next_probe += args.probe_every * 60
                r, cut = CLIENTS[args.recipe](c, pref, prompt, noun, args, rng=rng)
                rewards.append((time.monotonic() - t0, r))
                cuts.append(cut)
                base = statistics.fmean(x for _, x in rewards[:args.window])
                if len(rewards) >= 2 * args.window and reached is None:
                    if statistics.fmean(x for _, x in rewards[-args.window:]) >= base + 0.25:
                        reached = rewards[-1][0]
                        stop_at = i + args.confirm
                if reached is not None and i >= stop_at:
                    break
                if args.steps and i % 4 == 3 and memory(c, "real", proc.pid)["steps"] >= args.steps:
                    break
                if i % 16 == 15:
                    loads.append(os.getloadavg()[0])
                    last = statistics.fmean(x for _, x in rewards[-args.window:])
                    print(f"  {pref} seed {seed}: {elapsed / 60:5.1f} min, {i + 1} answers, rolling reward "
                          f"{last:.3f} (before {base:.3f}), load {os.getloadavg()[0]:.1f}", flush=True)
            after_example = ask(c, EXAMPLE, args.max_tokens, temperature=0)[0]
            if args.probe:
                probes.append(probe(c, everyday, args, t0, pref))
                print(f"  probe: {probes[-1]}", flush=True)
            chain = c.get("/reef/scenarios/real/releases", params={"all": "1"}).json()
            mem = memory(c, "real", proc.pid)
            daemon_peak = mem["daemon_peak_mb"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    steps = [*chain["releases"], *chain["rejected"],
             *({"verdict": "pending", **s} for s in chain.get("pending", []))]  # held or a running canary
    trained = [s for s in steps if (s.get("metrics") or {}).get("trainer_peak_rss_mb") is not None]
    drift = {s.get("release_id"): s["metrics"].get("kl_from_base") for s in trained}
    for p in probes:
        p["kl_from_base"] = drift.get(p["release"])
    # each step's own figures, and what its held-out check measured (why a step that forgot passed or was held)
    per_step = [{"verdict": s.get("verdict") or "published"}
                | {k: s["metrics"].get(k) for k in ("reward_mean", "tokens", "degenerate_groups", "kl_from_base",
                                                     "kl_ref", "loss", "step_s", "train_s", "trainer_peak_rss_mb",
                                                     "steps_ahead", "trained_ahead_of", *HELDOUT_FIGURES)}
                for s in sorted(trained, key=lambda s: s.get("created_at") or 0)]
    return {
        "recipe": args.recipe, "preference": pref, "seed": seed, "daemon_start_s": start_s, "answers": len(rewards),
        "before": statistics.fmean(x for _, x in rewards[:args.window]),
        "after": statistics.fmean(x for _, x in rewards[-args.window:]),
        # the share of the first and last windows' answers cut at --max-tokens: a length scorer can only be won
        # by ending answers sooner where few are cut
        "cut_before": round(statistics.fmean(cuts[:args.window]), 3) if cuts else None,
        "cut_after": round(statistics.fmean(cuts[-args.window:]), 3) if cuts else None,
        "minutes_to_target": None if reached is None else reached / 60,
        "minutes": rewards[-1][0] / 60 if rewards else 0.0,
        "training_steps": len(trained), "releases": len(chain["releases"]) - 1, "rejected": len(chain["rejected"]),
        "failed": [s["reason"] for s in chain["rejected"] if s.get("verdict") == "failed"],
        "held": len(chain.get("pending", [])),
        "trainer_peak_mb": max((s["metrics"]["trainer_peak_rss_mb"] for s in trained), default=None),
        "daemon_peak_mb": daemon_peak, "memory": mem, "example_before": before_example, "example_after": after_example,
        "load_mean": round(statistics.fmean(loads), 2) if loads else None, "probes": probes, "steps": per_step,
    }


def offline_run(model_dir: Path, pref: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """``--offline``: the recipe's training step in this process on answers it samples itself (module docstring).
    With ``--compare-kl C``: two arms from the same start, ``kl_coef`` 0 and C; their first step is the same (the
    KL term and its gradient are 0 at the base), so it is taken once and the arms branch after it."""
    import copy
    import hashlib

    import torch
    from transformers import AutoTokenizer

    from recipes import load_recipe
    from recipes.online_rl import (
        Sample,
        eos_ids,
        generate,
        kl_from_base,
        load_policy,
        make_optimizer,
        render_prompt,
        train_step,
    )

    cls = load_recipe(args.recipe)
    given = json.loads(args.settings) if args.settings else {}
    settings = cls.parse_settings(given)
    cls.check_settings(settings)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_policy(model_dir, None, settings, trainable=True)
    eos = eos_ids(model, tok)
    rng = random.Random(seed)
    questions = [(t.format(x=n), n) for t in TEMPLATES for n in NOUNS]
    rng.shuffle(questions)
    everyday = [q for q, _ in questions[:args.holdout]]
    questions = questions[len(everyday):]
    n = settings.batch_prompts * settings.group_size
    arms: list[dict[str, Any]] = []
    for coef in ([0.0, args.compare_kl] if args.compare_kl is not None else [settings.kl_coef]):
        arm_settings = cls.parse_settings({**given, "kl_coef": coef})
        arms.append({"kl_coef": coef, "settings": arm_settings, "steps": [], "probes": []})
    arms[0].update(model=model, optimizer=make_optimizer(model, arms[0]["settings"]),
                   gen=torch.Generator().manual_seed(seed))

    def answer(arm: dict[str, Any], prompts: list[str], max_tokens: int, greedy: bool
               ) -> list[tuple[list[int], list[float], str]]:
        outs = generate(arm["model"], [render_prompt(tok, q) for q in prompts], eos=eos, max_new_tokens=max_tokens,
                        temperature=0 if greedy else 1.0, generator=None if greedy else arm["gen"])
        return [(ids, lps, tok.decode(ids, skip_special_tokens=True)) for ids, lps in outs]

    def offline_probe(arm: dict[str, Any]) -> dict[str, Any]:
        facts = answer(arm, [q for q, _ in FACTS], 24, greedy=True)
        right = sum(any(e in text.lower() for e in exp) for (_, exp), (_, _, text) in zip(FACTS, facts, strict=True))
        lengths = [len(text.split()) for _, _, text in answer(arm, everyday, args.max_tokens, greedy=True)]
        return {"step": len(arm["steps"]), "facts_right": right, "facts": len(FACTS),
                "everyday_empty": sum(1 for x in lengths if x == 0), "everyday": len(lengths),
                "everyday_words": round(statistics.fmean(lengths), 1), "load": round(os.getloadavg()[0], 2)}

    def step(arm: dict[str, Any], k: int) -> None:
        asked = questions[k:k + n]
        t_step = time.monotonic()
        outs = answer(arm, [q for q, _ in asked], args.max_tokens, greedy=False)
        samples = [Sample(prompt_token_ids=render_prompt(tok, q), token_ids=ids, logprobs=lps,
                          reward=PREFERENCES[pref](noun, text), group=hashlib.sha1(q.encode()).hexdigest())
                   for (q, noun), (ids, lps, text) in zip(asked, outs, strict=True)]
        t_train = time.monotonic()
        arm["model"].train()
        m = train_step(arm["model"], samples, arm["settings"], arm["optimizer"])
        arm["model"].eval()
        kl = kl_from_base(arm["model"], samples) if hasattr(arm["model"], "peft_config") else None
        arm["steps"].append({
            "step": len(arm["steps"]) + 1, "kl_coef": arm["kl_coef"], "reward_mean": round(m["reward_mean"], 3),
            "tokens": m["tokens"], "empty": sum(1 for *_, text in outs if not text.split()),
            "kl_from_base": None if kl is None else round(kl, 4),
            "kl_ref": round(m["kl_ref"], 4) if "kl_ref" in m else None, "sample_s": round(t_train - t_step, 1),
            "train_s": round(time.monotonic() - t_train, 1), "load": round(os.getloadavg()[0], 2)})
        print(f"  step {arm['steps'][-1]}", flush=True)

    if not args.no_probe_before:
        arms[0]["probes"].append(offline_probe(arms[0]))
        print(f"  probe: {arms[0]['probes'][-1]}", flush=True)
    t0 = time.monotonic()
    k = 0
    while time.monotonic() - t0 < args.minutes * 60 and k + n <= len(questions) and \
            len(arms[-1]["steps"]) < args.max_steps:
        for arm in arms:
            if "model" not in arm:  # the first step is the same for every arm: branch after it
                src = arms[0]
                arm.update(model=copy.deepcopy(src["model"]), gen=torch.Generator().manual_seed(0),
                           steps=[dict(st, kl_coef=arm["kl_coef"]) for st in src["steps"]],
                           probes=list(src["probes"]))
                arm["gen"].set_state(src["gen"].get_state())
                arm["optimizer"] = make_optimizer(arm["model"], arm["settings"])
                arm["optimizer"].load_state_dict(src["optimizer"].state_dict())
                continue
            step(arm, k)
        k += n
        for arm in arms:
            if args.probe_every and arm["steps"] and len(arm["steps"]) % int(args.probe_every) == 0:
                arm["probes"].append(offline_probe(arm))
                print(f"  probe (kl_coef {arm['kl_coef']}): {arm['probes'][-1]}", flush=True)
    for arm in arms:
        if not arm["probes"] or arm["probes"][-1]["step"] != len(arm["steps"]):
            arm["probes"].append(offline_probe(arm))
            print(f"  probe (kl_coef {arm['kl_coef']}): {arm['probes'][-1]}", flush=True)
    return {"recipe": args.recipe, "preference": pref, "seed": seed, "settings": given,
            "arms": [{k: v for k, v in arm.items() if k in ("kl_coef", "steps", "probes")} for arm in arms],
            "peak_mb": round(vm_hwm_mb(os.getpid()), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="a made SmolLM2 directory (default: made here, once)")
    ap.add_argument("--recipe", default="online-rl", choices=tuple(CLIENTS),
                    help="the recipe, at its defaults: online-rl and sao learn from reported scores, "
                    "openclaw-rl from the user's next messages (no reports)")
    ap.add_argument("--prefs", default="brief,subject-first")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--steps", type=int, default=0, help="stop once this many training steps are on the chain "
                    "(0: run to --minutes or the target)")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--window", type=int, default=32, help="answers in the before / after / rolling means")
    ap.add_argument("--confirm", type=int, default=16, help="answers asked after the target is reached")
    ap.add_argument("--probe", action="store_true", help="ask the head FACTS and held-out everyday questions "
                    "(greedy) before and after")
    ap.add_argument("--no-probe-before", action="store_true", help="skip the probe before training (release 0's "
                    "greedy answers are the same in every run of a seed)")
    ap.add_argument("--probe-every", type=float, default=0.0, help="minutes between probes during the run (0: none)")
    ap.add_argument("--holdout", type=int, default=12, help="everyday questions held out of the traffic for --probe")
    ap.add_argument("--settings", help="recipe settings (JSON) to try instead of the defaults (tuning only)")
    ap.add_argument("--offline", action="store_true", help="online-rl's step in this process, no daemon (module "
                    "docstring); --probe-every counts steps")
    ap.add_argument("--compare-kl", type=float, help="--offline: two arms, kl_coef 0 and this, branching after "
                    "their common first step")
    ap.add_argument("--max-steps", type=int, default=1_000_000, help="--offline: stop after this many steps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for pref in args.prefs.split(","):  # refused before a 15-minute run, not in the middle of one
        if pref not in PREFERENCES:
            raise SystemExit(f"unknown preference {pref!r}: one of {', '.join(PREFERENCES)}")
        if args.recipe == "openclaw-rl" and pref not in HOLDS:
            raise SystemExit(f"openclaw-rl's simulated user judges only {', '.join(HOLDS)} (it needs a correction "
                             f"to say): not {pref!r}")
    if args.offline:
        if args.model_dir is None:
            raise SystemExit("--offline needs --model-dir (a made SmolLM2 directory)")
        for pref in args.prefs.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                run = offline_run(args.model_dir.resolve(), pref, seed, args)
                print(json.dumps(run), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="reef-bench-learning-real-"))
    try:
        model = args.model_dir.resolve() if args.model_dir else make_model(work)
        runs = []
        for pref in args.prefs.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                run = one_run(model, pref, seed, args, work)
                runs.append(run)
                print(json.dumps(run) if args.json else
                      f"{pref} seed {seed}: reward {run['before']:.3f} -> {run['after']:.3f} "
                      f"({run['after'] - run['before']:+.3f}) in {run['minutes']:.1f} min, +0.25 at "
                      f"{'-' if run['minutes_to_target'] is None else format(run['minutes_to_target'], '.1f')} min; "
                      f"{run['answers']} answers, {run['training_steps']} steps, {run['releases']} releases, "
                      f"{run['rejected']} rejected; peak trainer {run['trainer_peak_mb']} MB, daemon "
                      f"{run['daemon_peak_mb']:.0f} MB; daemon start {run['daemon_start_s']:.1f} s; load "
                      f"{run['load_mean']}; cut at the limit {run['cut_before']} -> {run['cut_after']}", flush=True)
                if not args.json:
                    print(f"  {memory_line(run['memory'])}", flush=True)
                for p in run["probes"]:
                    print(f"    probe at {p['minutes']} min, release {p['release'][:12]} (kl_from_base "
                          f"{p['kl_from_base']}): facts {p['facts_right']}/{p['facts']}, everyday empty "
                          f"{p['everyday_empty']}/{p['everyday']}, looping {p.get('everyday_loops')}/{p['everyday']}, "
                          f"cut {p.get('everyday_cut')}/{p['everyday']}, "
                          f"{p['everyday_words']} words, scored {p.get('everyday_reward')}; load {p['load']}")
                for st in run["steps"]:
                    print(f"    step: {st}")
        print("\n| preference | seed | reward before | after | minutes to +0.25 | answers | steps | releases | "
              "trainer peak MB | daemon peak MB |\n|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            mt = "not reached" if r["minutes_to_target"] is None else f"{r['minutes_to_target']:.1f}"
            print(f"| {r['preference']} | {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | {mt} | {r['answers']} "
                  f"| {r['training_steps']} | {r['releases']} | {r['trainer_peak_mb'] or 0:.0f} | {r['daemon_peak_mb']:.0f} |")
        for r in runs:
            if r["seed"] == runs[0]["seed"]:
                print(f"\n{r['preference']}, {EXAMPLE!r} (greedy):\n  before: {r['example_before']!r}\n"
                      f"  after:  {r['example_after']!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
