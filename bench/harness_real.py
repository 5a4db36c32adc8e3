"""The harness side on the embedded model: does a ``lessons`` release, made from one written feedback, move SmolLM2's
answers on held-out prompts in the asked direction, without costing what it knew (issue 48)?

No stand-in anywhere: one daemon started as ``reef serve`` starts it, serving SmolLM2-135M-Instruct (made once by
``reef model init smollm2``, no download), and for each feedback kind and seed a fresh scenario ``{"recipe":
"lessons"}`` at its defaults (the held-out check of the rules on, the ``always`` gate). A run:

1. reads the head's rules (``GET /reef/scenarios/S/harness``: ``AGENTS.md``) and asks the held-out prompts of its
   kind with those rules as the system prompt (as every wrapped agent loads them), greedily, through the real
   HTTP API, and the 24 factual questions of ``bench/learning_real.py`` (``FACTS``) the same way;
2. asks one prompt of the kind on the scenario, and reports it with score 0 and the feedback text, as ``reef-pi
   report --score 0 --feedback "..."`` does: ``lessons`` steps inside the report (its answer says what it did and
   the held-out check's figures), timed;
3. reads the rules again and asks the same held-out prompts and facts under them.

Feedback kinds (each with three phrasings, one per seed, and a scorer that passes or fails each answer):
- ``one-sentence``: "Answer in one sentence." on everyday questions; passes when the answer is one sentence (at
  most one sentence end followed by more text) and was not cut at the token limit.
- ``answer-first``: "Start with the answer." on short factual questions (not the ``FACTS`` ones); passes when an
  accepted answer is among the answer's first five words.
- ``short``: "Keep answers under 25 words." on everyday questions; passes at 25 words or fewer, not cut.

Seeds choose the phrasing and which held-out prompts are asked (``--prompts`` of the kind's pool). Printed per run:
the pass rate before and after with Wilson 95% intervals, the paired difference with a bootstrap interval over the
prompts, facts right before and after, the verdict, the rule as written, the check's probe accuracy against the
head's, and the report's seconds (the lessons step and its check, issue 48: at most 2 minutes); then per kind the
mean over seeds. ``--proposer`` lets the served model phrase the rule (``proposer = "smollm2"``); the default is
the recipe's: the feedback's own words. ``--search-proposals N`` also asks the served model N times as
harness-search's proposer (its system prompt, a proposer prompt holding one bad run per feedback kind) and counts
the answers that parse as the strict mutation form and apply.

Run (nothing else on the machine): ``.venv/bin/python bench/harness_real.py [--kinds one-sentence,answer-first,short]
[--seeds 0,1,2] [--model-dir DIR] [--json]``
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.learning_real import FACTS, NOUNS, TEMPLATES, fresh_home, make_model, vm_hwm_mb  # noqa: E402
from bench.reef_proc import start  # noqa: E402

FEEDBACK = {
    "one-sentence": ("Answer in one sentence.", "Your answers are too long: reply with a single sentence.",
                     "Use one sentence only in every answer."),
    "answer-first": ("Start with the answer.", "Give the answer first, then explain.",
                     "Put the answer in your first words."),
    "short": ("Keep answers under 25 words.", "Too long. Answer in fewer than 25 words.",
              "Be brief: at most 25 words per answer."),
}
ANSWER_FIRST = (("What is the capital of Germany?", ("berlin",)), ("What is the capital of Spain?", ("madrid",)),
                ("What is the capital of Egypt?", ("cairo",)), ("What is the largest desert in the world?",
                                                                  ("sahara", "antarctic", "antarctica")),
                ("What metal is liquid at room temperature?", ("mercury",)), ("How many legs does an insect have?",
                                                                              ("six", "6")),
                ("What is the freezing point of water in Fahrenheit?", ("32",)),
                ("Which planet is closest to the Sun?", ("mercury",)), ("What is the hardest natural material?",
                                                                        ("diamond", "diamonds")),
                ("What is the capital of Canada?", ("ottawa",)), ("How many minutes are in an hour?", ("60", "sixty")),
                ("What is the main language of Brazil?", ("portuguese",)), ("Who painted the Mona Lisa?",
                                                                            ("leonardo", "da vinci", "vinci")),
                ("What is the capital of Australia?", ("canberra",)), ("How many players are on a soccer team?",
                                                                       ("11", "eleven")),
                ("What is the boiling point of water in Celsius?", ("100",)),
                ("What is the smallest prime number?", ("2", "two")), ("What animal says moo?", ("cow", "cows")),
                ("What is the capital of Russia?", ("moscow",)), ("How many months are in a year?", ("12", "twelve")))
MAX_TOKENS = {"one-sentence": 80, "answer-first": 48, "short": 80}
FACT_TOKENS = 32


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def sentences(text: str) -> int:
    """Sentences: ends (``.``, ``!``, ``?``) followed by more text, plus the last one."""
    parts = [p for p in re.split(r"(?<=[.!?])\s+", text.strip()) if words(p)]
    return len(parts)


def one_sentence(answer: str, cut: bool, _: tuple[str, ...]) -> bool:
    return not cut and sentences(answer) == 1


def answer_first(answer: str, cut: bool, accept: tuple[str, ...]) -> bool:
    opening = " " + " ".join(w.lower() for w in words(answer)[:5]) + " "
    return any(f" {a} " in opening for a in accept)


def short(answer: str, cut: bool, _: tuple[str, ...]) -> bool:
    return not cut and 0 < len(words(answer)) <= 25


SCORERS: dict[str, Callable[[str, bool, tuple[str, ...]], bool]] = {
    "one-sentence": one_sentence, "answer-first": answer_first, "short": short}


def pool(kind: str) -> list[tuple[str, tuple[str, ...]]]:
    if kind == "answer-first":
        return list(ANSWER_FIRST)
    return [(t.format(x=n), ()) for t in TEMPLATES for n in NOUNS]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def bootstrap(diffs: list[int], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    """A 95% interval of the mean paired difference, resampling the prompts."""
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


class Asker:
    """Greedy answers through the daemon's chat API, the rules as the system prompt, a few at a time (the engine
    batches them); kept by (rules, prompt, tokens): every run's "before" is the same first release's rules."""

    def __init__(self, c: httpx.Client) -> None:
        self.c, self.kept = c, {}  # type: ignore[var-annotated]

    def one(self, scenario: str, rules: str, prompt: str, max_tokens: int) -> tuple[str, bool]:
        key = (rules, prompt, max_tokens)
        if key not in self.kept:
            messages = ([{"role": "system", "content": rules}] if rules.strip() else []) + [
                {"role": "user", "content": prompt}]
            r = self.c.post("/v1/chat/completions", headers={"x-reef-scenario": scenario},
                            json={"model": "smollm2", "max_tokens": max_tokens, "temperature": 0, "messages": messages})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            self.kept[key] = (choice["message"]["content"] or "", choice.get("finish_reason") == "length")
        return self.kept[key]  # type: ignore[no-any-return]

    def many(self, scenario: str, rules: str, prompts: list[str], max_tokens: int) -> list[tuple[str, bool]]:
        with ThreadPoolExecutor(8) as pool_:
            return list(pool_.map(lambda p: self.one(scenario, rules, p, max_tokens), prompts))


def facts_right(answers: list[tuple[str, bool]]) -> int:
    return sum(any(re.search(rf"\b{re.escape(a)}\b", ans.lower()) for a in accept)
               for (ans, _), (_, accept) in zip(answers, FACTS, strict=True))


def one_run(c: httpx.Client, asker: Asker, kind: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"{kind}-{seed}"
    rng = random.Random(seed)
    items = rng.sample(pool(kind), args.prompts + 1)
    asked, told = items[:-1], items[-1]  # the held-out prompts; the one the feedback is given on
    feedback = FEEDBACK[kind][seed % len(FEEDBACK[kind])]
    settings = {"proposer": "smollm2"} if args.proposer else {}
    c.post("/reef/scenarios", json={"name": name, "recipe": "lessons", "settings": settings}).raise_for_status()
    rules_before = c.get(f"/reef/scenarios/{name}/harness").json()["files"].get("AGENTS.md", "")
    prompts, tokens, score = [p for p, _ in asked], MAX_TOKENS[kind], SCORERS[kind]
    before = asker.many(name, rules_before, prompts, tokens)
    facts_before = asker.many(name, rules_before, [q for q, _ in FACTS], FACT_TOKENS)
    answer = c.post("/v1/chat/completions", headers={"x-reef-scenario": name}, json={
        "model": "smollm2", "max_tokens": tokens, "messages": [{"role": "user", "content": told[0]}]})
    answer.raise_for_status()
    t = time.monotonic()
    report = c.post("/reef/report", json={"score": 0, "references": [answer.headers["x-reef-agent-record-id"]],
                                          "feedback": feedback})
    report.raise_for_status()
    report_s = time.monotonic() - t
    learning = report.json().get("learning") or {}
    rules_after = c.get(f"/reef/scenarios/{name}/harness").json()["files"].get("AGENTS.md", "")
    after = asker.many(name, rules_after, prompts, tokens)
    facts_after = asker.many(name, rules_after, [q for q, _ in FACTS], FACT_TOKENS)
    passed_before = [score(a, cut, acc) for (a, cut), (_, acc) in zip(before, asked, strict=True)]
    passed_after = [score(a, cut, acc) for (a, cut), (_, acc) in zip(after, asked, strict=True)]
    n = len(prompts)
    metrics = learning.get("metrics") or {}
    applied = learning.get("applied") or [{}]
    return {
        "kind": kind, "seed": seed, "feedback": feedback, "rule": applied[0].get("rule"),
        "verdict": learning.get("verdict"), "reason": learning.get("reason"), "report_s": round(report_s, 1),
        "prompts": n, "before": sum(passed_before) / n, "after": sum(passed_after) / n,
        "before_ci": [round(x, 3) for x in wilson(sum(passed_before), n)],
        "after_ci": [round(x, 3) for x in wilson(sum(passed_after), n)],
        "diff_ci": [round(x, 3) for x in bootstrap([int(a) - int(b) for a, b in zip(passed_after, passed_before,
                                                                                     strict=True)], rng)],
        "words_before": round(statistics.fmean(len(words(a)) for a, _ in before), 1),
        "words_after": round(statistics.fmean(len(words(a)) for a, _ in after), 1),
        "empty_after": sum(not words(a) for a, _ in after),
        "facts_before": facts_right(facts_before), "facts_after": facts_right(facts_after), "facts": len(FACTS),
        "heldout": metrics.get("heldout"), "probe_accuracy": metrics.get("heldout_probe_accuracy"),
        "head_probe_accuracy": metrics.get("heldout_head_probe_accuracy"),
        "heldout_seconds": metrics.get("heldout_seconds"),
        "example_before": before[0][0][:160], "example_after": after[0][0][:160],
    }


def search_proposals(c: httpx.Client, n: int) -> dict[str, Any]:
    """harness-search's proposer on the served model: ``n`` calls with the recipe's own system prompt and a proposer
    prompt built as a step builds it (one bad run per feedback kind, a task), at temperature 0.7 (the recipe asks
    greedily; sampled, to see more than one answer); how many answers parse as the strict mutation form and apply."""
    from recipes.harness_search.mutations import Limits, Refused, apply, parse
    from recipes.harness_search.proposer import PROPOSER_SYSTEM, proposer_prompt

    bad = [{"report": f"rep_{i}", "score": 0.0, "feedback": FEEDBACK[k][0], "exchanges": []}
           for i, k in enumerate(FEEDBACK)]
    prompt = proposer_prompt({}, bad, [], [{"id": "greet", "prompt": "Say hello to the user."}])
    parsed = applied = 0
    reasons: dict[str, int] = {}
    for _ in range(n):
        r = c.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 400, "temperature": 0.7,
                                                 "messages": [{"role": "system", "content": PROPOSER_SYSTEM},
                                                              {"role": "user", "content": prompt}]})
        r.raise_for_status()
        answer = r.json()["choices"][0]["message"]["content"] or ""
        try:
            mutations = parse(answer, Limits())
            parsed += 1
            apply({}, mutations, Limits())
            applied += 1
        except Refused as e:
            why = e.reason.split(":")[0][:60]
            reasons[why] = reasons.get(why, 0) + 1
    return {"calls": n, "parsed": parsed, "applied": applied, "refused": reasons}


def line(r: dict[str, Any]) -> str:
    return (f"{r['kind']:<13} seed {r['seed']}  pass {r['before']:.2f} {r['before_ci']} -> {r['after']:.2f} "
            f"{r['after_ci']}  diff {r['after'] - r['before']:+.2f} {r['diff_ci']}  words {r['words_before']} -> "
            f"{r['words_after']}  facts {r['facts_before']} -> {r['facts_after']} of {r['facts']}  {r['verdict']}"
            f" (check {r['heldout']}: probes {r['probe_accuracy']} vs head {r['head_probe_accuracy']}, "
            f"{r['heldout_seconds']} s)  report {r['report_s']} s  rule {r['rule']!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="one-sentence,answer-first,short")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts a run asks (of its kind's pool)")
    ap.add_argument("--model-dir", type=Path, help="SmolLM2's directory (default: made here by reef model init)")
    ap.add_argument("--proposer", action="store_true", help="the served model phrases each rule")
    ap.add_argument("--json", action="store_true", help="one JSON line per run as well")
    ap.add_argument("--search-proposals", type=int, default=0, metavar="N",
                    help="also ask the served model N times as harness-search's proposer and count usable answers")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(FEEDBACK)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)} (known: {', '.join(FEEDBACK)})")
    work = Path(tempfile.mkdtemp(prefix="reef-harness-real-"))
    runs: list[dict[str, Any]] = []
    try:
        model = args.model_dir or make_model(work)
        home = work / "home"
        port = fresh_home(home, model)
        proc = start(home, port)
        token = (home / "token").read_text().strip()
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=900) as c:
                asker = Asker(c)
                for kind in kinds:
                    for seed in (int(s) for s in args.seeds.split(",")):
                        r = one_run(c, asker, kind, seed, args)
                        runs.append(r)
                        print(line(r), flush=True)
                        if args.json:
                            print(json.dumps(r), flush=True)
                if args.search_proposals:
                    got = search_proposals(c, args.search_proposals)
                    print(f"harness-search proposer (the served model): {json.dumps(got)}", flush=True)
            print(f"daemon peak {vm_hwm_mb(proc.pid):.0f} MB")
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nper kind, mean over seeds (pass rate before -> after; facts right before -> after):")
    for kind in kinds:
        rs = [r for r in runs if r["kind"] == kind]
        print(f"  {kind:<13} {statistics.fmean(r['before'] for r in rs):.2f} -> "
              f"{statistics.fmean(r['after'] for r in rs):.2f}  facts {statistics.fmean(r['facts_before'] for r in rs):.1f}"
              f" -> {statistics.fmean(r['facts_after'] for r in rs):.1f}  published {sum(r['verdict'] == 'accepted' for r in rs)}"
              f" of {len(rs)}  report {max(r['report_s'] for r in rs):.0f} s at most")


if __name__ == "__main__":
    main()
