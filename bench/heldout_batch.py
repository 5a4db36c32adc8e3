"""The held-out check's answers and KL (``daemon/gating/heldout.py``) on SmolLM2, as requests against as one batch
(``daemon/engines/bulk.py``), in alternating rounds on one engine, so drifting load from other work falls on both
alike; and what users' requests wait meanwhile.

One embedded engine as the daemon configures it (one thread, ``max_batch`` 8). The candidate is what online-rl
makes on SmolLM2 at its defaults: a LoRA adapter (rank 8, small random weights here) on the base, which the head
also is; users' requests run on the base. A round asks what a passing check's first stage asks at the defaults:
16 recorded prompts (everyday questions) and every other shipped probe (18), 16 tokens an answer, then the KL of 12
of those answers against the base. ``requests``: each answer a request through ``generate``
(``Engine.answer_many``'s default, the path before the bulk one), each KL its own two forwards (``divergence``);
``bulk``: ``TransformersEngine.answer_many`` and ``divergence_many``. Meanwhile ``--users`` clients (default 1, as
``bench/heldout_check.py``'s) each keep one request of 60 tokens in flight; their requests' mean wall time during
the check is printed beside it. Also printed: how many answers the two paths agree on, token for token (greedy in
bfloat16: the batch's shape moves the logits by rounding, and a near tie can flip).

Run: ``.venv/bin/python bench/heldout_batch.py --model DIR [--rounds 3] [--users 1]`` (DIR: a SmolLM2 directory,
as ``reef model init smollm2`` makes it)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
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
from daemon.lora import AdapterManifest  # noqa: E402


def adapter(model: Path, dest: Path, base: ReleaseRef) -> ReleaseRef:
    """A LoRA adapter as online-rl saves one at its defaults, its B matrices small and random (a step's worth)."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.online_rl import OnlineRLSettings, save_adapter, wrap_lora

    peft = wrap_lora(AutoModelForCausalLM.from_pretrained(model), OnlineRLSettings())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    dest.mkdir(parents=True)
    save_adapter(peft, dest, AdapterManifest(base.content_id, base.release_id))
    return ReleaseRef("candidate:bench", "candidate:bench", dest, base)


async def users(engine: TransformersEngine, base: ReleaseRef, n: int, stop: asyncio.Event) -> list[float]:
    """``n`` clients, each with one request of 60 tokens in flight until ``stop``: each request's wall time."""
    walls: list[float] = []

    async def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            t = time.perf_counter()
            exchange = internal_exchange("smollm2", "", f"Tell me about {lr.NOUNS[(i * 7 + k) % len(lr.NOUNS)]}.", 60)
            async for event in engine.generate(exchange, base):
                if isinstance(event, Finish):
                    break
            walls.append(time.perf_counter() - t)
            k += 1

    await asyncio.gather(*(client(i) for i in range(n)))
    return walls


async def check(engine: TransformersEngine, prompts: list[str], candidate: ReleaseRef, base: ReleaseRef,
                bulk: bool, n_users: int) -> tuple[float, float, float, list[Completion]]:
    """(answers' seconds, KL's seconds, users' requests' mean seconds, the answers)."""
    stop = asyncio.Event()
    traffic = asyncio.ensure_future(users(engine, base, n_users, stop))
    await asyncio.sleep(2.0)  # users' requests under way
    exchanges = [internal_exchange("smollm2", "", p, 16) for p in prompts]
    t = time.perf_counter()
    done = await (engine.answer_many(exchanges, candidate) if bulk
                  else Engine.answer_many(engine, exchanges, candidate))
    answers_s = time.perf_counter() - t
    pairs = [(c.prompt_token_ids, c.token_ids) for c in done][:: max(1, -(-len(done) // KL_ANSWERS))]
    t = time.perf_counter()
    many = engine.divergence_many if bulk else lambda *a: Engine.divergence_many(engine, *a)
    await many(pairs, candidate, base)
    kl_s = time.perf_counter() - t
    stop.set()
    walls = await traffic
    await engine.unload(candidate)  # as the check does: the next loads it afresh, with no prefix cache entries
    return answers_s, kl_s, statistics.mean(walls) if walls else float("nan"), done


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--users", type=int, default=1)
    args = ap.parse_args()
    engine = TransformersEngine(ModelEntry(name="smollm2", path=args.model))
    await engine.start()
    base = ReleaseRef("b" * 40, "a" * 40, args.model)
    candidate = adapter(args.model, Path(tempfile.mkdtemp(prefix="reef-heldout-batch-")) / "adapter", base)
    questions = [t.format(x=n) for t in lr.TEMPLATES for n in lr.NOUNS][::7][:16]
    prompts = [*questions, *(p.prompt for p in shipped_probes()[::2])]
    print(f"{len(prompts)} prompts x 16 tokens, KL on {KL_ANSWERS}; a LoRA candidate; {args.users} user(s); engine "
          f"threads {engine.entry.threads}, max_batch {engine.entry.max_batch}", flush=True)
    times: dict[str, list[tuple[float, float, float]]] = {"requests": [], "bulk": []}
    agree = []
    for r in range(args.rounds):
        got = {}
        for way in ("requests", "bulk") if r % 2 == 0 else ("bulk", "requests"):
            load = os.getloadavg()[0]
            a, k, u, done = await check(engine, prompts, candidate, base, way == "bulk", args.users)
            times[way].append((a, k, u))
            got[way] = done
            print(f"round {r + 1} {way:>8}: answers {a:6.1f} s, KL {k:5.1f} s, check {a + k:6.1f} s; a user's "
                  f"60 tokens meanwhile {u:5.1f} s (load {load:.1f})", flush=True)
        agree.append(sum(x.token_ids == y.token_ids for x, y in zip(got["requests"], got["bulk"], strict=True)))
    print()
    for way, rows in times.items():
        a, k, u = (statistics.median(x) for x in zip(*rows, strict=True))
        print(f"{way:>8}: median answers {a:.1f} s, KL {k:.1f} s, check {a + k:.1f} s, a user's request {u:.1f} s")
    ra = statistics.median(x[0] + x[1] for x in times["requests"])
    rb = statistics.median(x[0] + x[1] for x in times["bulk"])
    print(f"bulk / requests: {rb / ra:.2f}; answers the same token for token: {agree} of {len(prompts)}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
