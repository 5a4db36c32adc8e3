"""How long the tiny model takes to prefill a Claude Code sized first request and sample 16 tokens, and how much
the event loop lags meanwhile (DESIGN.md: under 1 s on one core; the loop stays responsive).

The tests check that such a prompt fits and answers and that the loop runs during the prefill
(tests/test_engine.py); how fast is measured here, since absolute times on a shared machine drift.

Run: ``.venv/bin/python bench/prefill_tiny.py [--runs N] [--threads N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def claude_code_like() -> object:
    """A first request shaped like Claude Code's (the one tests/test_engine.py uses): long system text and 24 tool
    schemas, about 80 kB of JSON."""
    from daemon.exchange import Exchange, Message, Part, Sampling, Tool

    para = (
        "You are an interactive CLI tool that helps users with software engineering tasks. Use the instructions "
        "below and the tools available to you to assist the user. IMPORTANT: Assist with defensive security tasks "
        "only. When you run a non-trivial bash command, explain what it does and why. Keep responses concise.\n"
    )
    tools = [
        Tool(name=f"Tool{i}", description=para * 3, parameters={
            "type": "object",
            "properties": {f"arg_{k}": {"type": "string", "description": f"The absolute path or pattern number {k}."}
                           for k in range(8)},
            "required": ["arg_0"], "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        })
        for i in range(24)
    ]
    system = para * 80 + "\n".join(f"- {k}: {json.dumps({'file': f'/src/m{k}.py', 'lines': k})}" for k in range(200))
    return Exchange(format="openai-chat", model="tiny", tools=tools,
                    messages=[Message("system", [Part("text", system)]),
                              Message("user", [Part("text", "Fix the failing test in tests/test_api.py")])],
                    sampling=Sampling(seed=0, max_tokens=16))


async def measure(model: Path, runs: int, threads: int) -> None:
    from daemon.config import ModelEntry
    from daemon.engines.transformers import TransformersEngine
    from daemon.exchange import Finish

    engine = TransformersEngine(ModelEntry(name="tiny", path=model, threads=threads, max_batch=8))
    await engine.start()
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    times, prompt_tokens = [], 0
    tick = asyncio.create_task(ticker())
    try:
        for _ in range(runs + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            async for ev in engine.generate(claude_code_like()):  # type: ignore[arg-type]
                if isinstance(ev, Finish):
                    prompt_tokens = ev.completion.usage.input_tokens
            times.append(time.perf_counter() - t0)
    finally:
        tick.cancel()
        await engine.close()
    times = times[1:]
    print(f"prompt {prompt_tokens} tokens, {threads} thread(s): prefill + 16 tokens median "
          f"{statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f}, {runs} runs); "
          f"event loop lag max {max(lags) * 1000:.0f} ms (goal: under 1 s, the loop responsive)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from daemon.models import init_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "tiny")
        asyncio.run(measure(model, args.runs, args.threads))


if __name__ == "__main__":
    main()
