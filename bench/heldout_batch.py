"""The held-out check's answers and KL (``daemon/gating/heldout.py``) on SmolLM2, as requests against as one batch
(``daemon/engines/bulk.py``), in alternating rounds on one engine, so drifting load from other work falls on both
alike; and what a user's request waits meanwhile.

One embedded engine as the daemon configures it (one thread, ``max_batch`` 8); the candidate is the same weights
loaded again under another release (what it costs is the same). A round asks what a passing check's first stage
asks at the defaults: 16 recorded prompts (everyday questions) and every other shipped probe (18), 16 tokens an
answer, then the KL of 12 of those answers against the base. ``requests``: each answer a request through
``generate`` (``Engine.answer_many``'s default, the path before the bulk one), each KL its own two forwards
(``divergence``); ``bulk``: ``TransformersEngine.answer_many`` and ``divergence_many``. In each round a user's
request (16 tokens) starts once the check has begun; its wall time is printed beside the check's. Also printed:
how many answers the two paths agree on, token for token (greedy in bfloat16: the batch's shape moves the logits
by rounding, and a near tie can flip).

Run: ``.venv/bin/python bench/heldout_batch.py --model DIR [--rounds 3]`` (DIR: a SmolLM2 directory, as
``reef model init smollm2`` makes it)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import learning_real as lr  # noqa: E402  (the everyday questions)

from daemon.config import ModelEntry  # noqa: E402
from daemon.engines.base import Engine, ReleaseRef  # noqa: E402
from daemon.engines.transformers import TransformersEngine  # noqa: E402
from daemon.exchange import Completion, Finish, internal_exchange  # noqa: E402
from daemon.gating.heldout import KL_ANSWERS, shipped_probes  # noqa: E402


async def user(engine: TransformersEngine) -> float:
    t = time.perf_counter()
    async for event in engine.generate(internal_exchange("smollm2", "", "Tell me about volcanoes.", 16)):
        if isinstance(event, Finish):
            break
    return time.perf_counter() - t


async def check(engine: TransformersEngine, prompts: list[str], candidate: ReleaseRef, bulk: bool
                ) -> tuple[float, float, float, list[Completion]]:
    """(answers' seconds, KL's seconds, the user's request's seconds, the answers)."""
    exchanges = [internal_exchange("smollm2", "", p, 16) for p in prompts]
    t = time.perf_counter()
    answering = asyncio.ensure_future(engine.answer_many(exchanges, candidate) if bulk
                                      else Engine.answer_many(engine, exchanges, candidate))
    await asyncio.sleep(1.0)  # the check under way
    waited = await user(engine)
    done = await answering
    answers_s = time.perf_counter() - t
    pairs = [(c.prompt_token_ids, c.token_ids) for c in done][:: max(1, -(-len(done) // KL_ANSWERS))]
    t = time.perf_counter()
    if bulk:
        await engine.divergence_many(pairs, candidate, None)  # type: ignore[arg-type]
    else:
        await Engine.divergence_many(engine, pairs, candidate, None)  # type: ignore[arg-type]
    kl_s = time.perf_counter() - t
    await engine.unload(candidate)  # as the check does: the next loads it afresh, with no prefix cache entries
    return answers_s, kl_s, waited, done


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = TransformersEngine(ModelEntry(name="smollm2", path=args.model))
    await engine.start()
    candidate = ReleaseRef("candidate:bench", "candidate:bench", args.model)
    questions = [t.format(x=n) for t in lr.TEMPLATES for n in lr.NOUNS][::7][:16]
    prompts = [*questions, *(p.prompt for p in shipped_probes()[::2])]
    print(f"{len(prompts)} prompts x 16 tokens, KL on {KL_ANSWERS}; engine threads {engine.entry.threads}, "
          f"max_batch {engine.entry.max_batch}")
    times: dict[str, list[tuple[float, float, float]]] = {"requests": [], "bulk": []}
    agree = []
    for r in range(args.rounds):
        got = {}
        for way in ("requests", "bulk") if r % 2 == 0 else ("bulk", "requests"):
            load = os.getloadavg()[0]
            a, k, u, done = await check(engine, prompts, candidate, way == "bulk")
            times[way].append((a, k, u))
            got[way] = done
            print(f"round {r + 1} {way:>8}: answers {a:6.1f} s, KL {k:5.1f} s, check {a + k:6.1f} s; "
                  f"a user's 16 tokens meanwhile {u:5.1f} s (load {load:.1f})", flush=True)
        agree.append(sum(x.token_ids == y.token_ids for x, y in zip(got["requests"], got["bulk"], strict=True)))
    print()
    for way, rows in times.items():
        a, k, u = (statistics.median(x) for x in zip(*rows, strict=True))
        print(f"{way:>8}: median answers {a:.1f} s, KL {k:.1f} s, check {a + k:.1f} s, user's request {u:.1f} s")
    ra = statistics.median(x[0] + x[1] for x in times["requests"])
    rb = statistics.median(x[0] + x[1] for x in times["bulk"])
    print(f"bulk / requests: {rb / ra:.2f}; answers the same token for token: {agree} of {len(prompts)}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
