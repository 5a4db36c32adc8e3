"""The tiny model builder and the embedded transformers engine (CPU, tiny model built once per session)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.config import ModelEntry
from daemon.engines.transformers import Load, SamplingParams, TransformersEngine, _Seq
from daemon.errors import BadRequest, ContextLengthExceeded, Unsupported
from daemon.exchange import Completion, Exchange, Finish, Message, Part, Sampling, TextDelta, Tool
from daemon.hf import no_progress_bars
from daemon.models import init_tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t0 = time.perf_counter()
    path = init_tiny(tmp_path_factory.mktemp("models") / "tiny")
    print(f"\ntiny model built in {time.perf_counter() - t0:.2f}s")
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="session")
def reference_model(tiny: Path):
    from transformers import AutoModelForCausalLM

    with no_progress_bars():
        return AutoModelForCausalLM.from_pretrained(tiny).eval()


@pytest.fixture
async def engine(tiny: Path):
    eng = TransformersEngine(ModelEntry(name="tiny", path=tiny, threads=1, max_batch=8, max_new_tokens=24))
    await eng.start()
    yield eng
    await eng.close()


def chat(text: str = "Write a haiku about caches.", *, tools: list[Tool] | None = None, **sampling) -> Exchange:
    return Exchange(
        format="openai-chat",
        model="tiny",
        messages=[Message("system", [Part("text", "You are terse.")]), Message("user", [Part("text", text)])],
        tools=tools or [],
        sampling=Sampling(**sampling),
    )


async def run(engine: TransformersEngine, exchange: Exchange) -> tuple[list[str], Completion]:
    deltas, finish = [], None
    async for event in engine.generate(exchange):
        assert finish is None, "Finish must be the last event"
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        else:
            assert isinstance(event, Finish)
            finish = event.completion
    assert finish is not None
    return deltas, finish


# --- the builder and the tokenizer --------------------------------------------------------------------------------


def test_tokenizer_round_trips_unicode_and_json(tokenizer) -> None:
    assert 2000 <= len(tokenizer) <= 4096
    samples = [
        "plain ascii, with  double spaces\tand tabs\n",
        json.dumps({"path": "/tmp/ä.py", "lines": [1, 2], "ok": None, "emoji": "🚀🙂", "cjk": "日本語"}),
        json.dumps({"zh": "中文", "ru": "Привет"}, ensure_ascii=False, indent=2),
        "def f(x):\n    return x ** 2  # ±½°\n",
        "\u00e9 vs e\u0301, zero\u200bwidth, \U0001f9ea",
    ]
    for s in samples:
        ids = tokenizer.encode(s, add_special_tokens=False)
        assert tokenizer.decode(ids) == s
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


def test_chat_template_renders_system_tools_and_tool_history(tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "SYSTEM RULES"},
        {"role": "user", "content": "read a.py"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "Read", "arguments": '{"p": 1}'}}],
        },
        {"role": "tool", "content": "print(1)", "tool_call_id": "c1"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nSYSTEM RULES\n\n# Tools")
    assert '{"type": "function", "function": {"name": "Read"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "Read", "arguments": {"p": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\nprint(1)<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert plain == "<|im_start|>system\nSYSTEM RULES<|im_end|>\n<|im_start|>user\nread a.py<|im_end|>\n"


def test_build_is_idempotent_atomic_and_reproducible(tiny: Path, tmp_path: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    assert init_tiny(tiny) == tiny
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before
    again = init_tiny(tmp_path / "tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temp dir left behind
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name


# --- detokenising and stop strings (the generation thread's per-sequence logic, driven by hand) --------------------


def byte_tokens(tokenizer, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte, so multi-byte characters are split across tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    return [tokenizer.convert_tokens_to_ids(alphabet[b]) for b in text.encode()]


def drive(load: Load, ids: list[int], **params) -> tuple[list[str], Completion]:
    events: list = []
    seq = _Seq(load, "tiny", [1], SamplingParams(**params), torch.Generator(), events.extend)
    for token in ids:
        if seq.push(token, -1.0):
            break
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert isinstance(events[-1], Finish)
    return deltas, events[-1].completion


def test_detokeniser_never_splits_a_character(tiny: Path, tokenizer) -> None:
    load = Load.open(tiny, "t:1", torch.device("cpu"))
    text = "é🚀 日本 ok"
    ids = byte_tokens(tokenizer, text) + [tokenizer.eos_token_id]
    deltas, c = drive(load, ids, max_tokens=100)
    assert "".join(deltas) == c.text == text and c.stop_reason == "stop"
    assert not any("\ufffd" in d for d in deltas)
    assert len(deltas) == 8  # one per complete character
    # a stop string is held back while it may still complete, and never streamed
    deltas, c = drive(load, byte_tokens(tokenizer, "abc<END>def"), max_tokens=100, stop=("<END>", "xyz"))
    assert c.text == "".join(deltas) == "abc" and c.stop_sequence == "<END>"
    deltas, c = drive(load, byte_tokens(tokenizer, "a<ENx"), max_tokens=5, stop=("<END>",))
    assert c.text == "".join(deltas) == "a<ENx" and c.stop_reason == "length"
    assert deltas[:2] == ["a", "<ENx"]  # "<EN" waited until "x" ruled the stop out


# --- generation ---------------------------------------------------------------------------------------------------


async def test_generation_streams_exact_tokens_and_logprobs(engine: TransformersEngine, tokenizer) -> None:
    deltas, c = await run(engine, chat(seed=7))
    assert "".join(deltas) == c.text
    assert all(deltas)
    assert c.stop_reason in ("stop", "length")
    assert tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text
    assert len(c.logprobs) == len(c.token_ids) == c.usage.output_tokens
    assert all(lp <= 0 for lp in c.logprobs)
    assert c.usage.input_tokens == len(c.prompt_token_ids) == await engine.count_tokens(chat())
    assert c.model == "tiny"
    assert c.runtime_load_id == engine.runtime_load_id
    incarnation, seq = c.runtime_load_id.split(":")
    assert incarnation and seq == "1"
    assert engine.info.context_length == 65536


async def test_seed_repeats_sampling_and_greedy_is_deterministic(engine: TransformersEngine) -> None:
    a, b, other = [(await run(engine, chat(seed=s, max_tokens=16)))[1] for s in (1, 1, 2)]
    # b's prompt comes from a's prefix cache: its log-probs agree up to float rounding, its tokens exactly
    assert b.usage.cache_read_tokens > 0
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert a.token_ids != other.token_ids
    g1, g2 = [(await run(engine, chat(temperature=0, max_tokens=16)))[1] for _ in range(2)]
    assert g1.token_ids == g2.token_ids


async def test_top_k_1_is_greedy(engine: TransformersEngine) -> None:
    greedy = (await run(engine, chat(temperature=0, max_tokens=12)))[1]
    top1 = (await run(engine, chat(top_k=1, seed=3, max_tokens=12)))[1]
    tiny_p = (await run(engine, chat(top_p=1e-9, seed=4, max_tokens=12)))[1]
    assert greedy.token_ids == top1.token_ids == tiny_p.token_ids


async def test_stop_sequence_trims_and_never_streams_the_stop(engine: TransformersEngine) -> None:
    full = (await run(engine, chat(temperature=0, max_tokens=40)))[1].text
    assert len(full) > 20
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    deltas, c = await run(engine, chat(temperature=0, max_tokens=40, stop=["\x00never", stop]))
    assert c.stop_reason == "stop_sequence" and c.stop_sequence == stop
    assert c.text == full[: full.index(stop)] == "".join(deltas)


async def test_max_tokens_ends_with_length(engine: TransformersEngine) -> None:
    _, c = await run(engine, chat(seed=1, max_tokens=5))
    assert c.stop_reason == "length" and len(c.token_ids) == 5
    # a client that asks no limit gets the entry's default, and an answer it ends is a normal stop: the client set
    # no limit to take it for (Codex exits 1 on "incomplete", reason max_output_tokens)
    _, c = await run(engine, chat(seed=1))
    assert c.stop_reason == "stop" and len(c.token_ids) == 24


async def test_context_overflow_raises_before_any_event(engine: TransformersEngine) -> None:
    huge = chat(" word" * 70_000)
    assert await engine.count_tokens(huge) > 65536
    gen = engine.generate(huge)
    with pytest.raises(ContextLengthExceeded) as info:
        await gen.__anext__()
    assert info.value.data["context_length"] == 65536


async def test_images_and_bad_sampling_are_rejected_before_any_event(engine: TransformersEngine) -> None:
    ex = chat()
    ex.messages[1].parts.append(Part("image", media_type="image/png", source="data:image/png;base64,AAAA"))
    with pytest.raises(Unsupported, match="text-only") as info:
        await engine.generate(ex).__anext__()
    assert info.value.status == 400 and info.value.param == "messages"
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}):
        with pytest.raises(BadRequest) as info:
            await engine.generate(chat(**bad)).__anext__()
        assert info.value.param == next(iter(bad))


async def test_tools_and_tool_history_reach_the_prompt(engine: TransformersEngine, tokenizer) -> None:
    ex = chat(tools=[Tool("Read", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"}}})])
    ex.messages += [
        Message("assistant", [Part("tool_call", id="c1", name="Read", arguments='{"path": "a.py"}')]),
        Message("tool", [Part("tool_result", text="print(1)", tool_call_id="c1")]),
    ]
    _, c = await run(engine, ex)
    prompt = tokenizer.decode(c.prompt_token_ids)
    assert '"name": "Read", "description": "Read a file."' in prompt
    assert '<tool_call>\n{"name": "Read", "arguments": {"path": "a.py"}}\n</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>tool\nprint(1)<|im_end|>\n<|im_start|>assistant\n")


async def test_concurrent_requests_batch_correctly(engine: TransformersEngine, reference_model) -> None:
    """8 requests of different lengths decode together; every recorded log-prob matches a solo teacher-forced pass."""
    prompts = [chat("x " * (5 + 37 * i), seed=i, max_tokens=20 + 3 * i) for i in range(8)]
    results = await asyncio.gather(*(run(engine, p) for p in prompts))
    for i, (deltas, c) in enumerate(results):
        assert "".join(deltas) == c.text
        assert c.stop_reason == "stop" or len(c.token_ids) == 20 + 3 * i
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.inference_mode():
            logp = torch.log_softmax(reference_model(ids).logits[0].float(), -1)
        n = len(c.prompt_token_ids)
        expected = [float(logp[n - 1 + k, t]) for k, t in enumerate(c.token_ids)]
        assert c.logprobs == pytest.approx(expected, abs=1e-4)


async def test_cancelled_requests_leave_the_batch(engine: TransformersEngine) -> None:
    """8 endless generations fill the batch; once their consumers go away, a 9th request is served."""
    gens = [engine.generate(chat(seed=i, max_tokens=60_000)) for i in range(8)]
    for g in gens:
        assert isinstance(await g.__anext__(), TextDelta | Finish)
    for g in gens:
        await g.aclose()
    _, c = await asyncio.wait_for(run(engine, chat(max_tokens=4)), timeout=20)
    assert len(c.token_ids) == 4


async def test_a_request_keeps_the_load_it_started_with(engine: TransformersEngine, tiny: Path) -> None:
    first = engine.runtime_load_id
    gen = engine.generate(chat(seed=1, max_tokens=200))
    await gen.__anext__()
    second = await engine.load(tiny)
    assert second == engine.runtime_load_id != first and second.endswith(":2")
    _, fresh = await run(engine, chat(seed=1, max_tokens=3))
    old = [e async for e in gen][-1].completion
    assert old.runtime_load_id == first and fresh.runtime_load_id == second


def claude_code_like(n_tools: int = 24) -> Exchange:
    """A first request shaped like Claude Code's: long system text and 24 tool schemas, about 80 kB of JSON."""
    para = (
        "You are an interactive CLI tool that helps users with software engineering tasks. Use the instructions "
        "below and the tools available to you to assist the user. IMPORTANT: Assist with defensive security tasks "
        "only. When you run a non-trivial bash command, explain what it does and why. Keep responses concise.\n"
    )
    tools = [
        Tool(
            name=f"Tool{i}",
            description=para * 3,
            parameters={
                "type": "object",
                "properties": {
                    f"arg_{k}": {"type": "string", "description": f"The absolute path or pattern number {k} to use."}
                    for k in range(8)
                },
                "required": ["arg_0"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        )
        for i in range(n_tools)
    ]
    system = para * 80 + "\n".join(f"- {k}: {json.dumps({'file': f'/src/m{k}.py', 'lines': k})}" for k in range(200))
    ex = chat("Fix the failing test in tests/test_api.py", tools=tools, seed=0, max_tokens=16)
    ex.messages[0] = Message("system", [Part("text", system)])
    return ex


async def test_claude_code_sized_prompt_prefills_while_the_event_loop_runs(engine: TransformersEngine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Claude Code sized prompt fits and answers, and its prefill runs off the event loop: the loop runs while
    the long forward is in progress (how fast is bench/prefill_tiny.py's to say)."""
    ex = claude_code_like()
    size = len(json.dumps([t.__dict__ for t in ex.tools])) + len(ex.messages[0].text)
    assert size > 75_000
    in_prefill = threading.Event()
    forward = Load.forward

    def watched(self: Load, ids: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        long = ids.shape[-1] > 10_000
        if long:
            in_prefill.set()
        try:
            return forward(self, ids, *args, **kw)
        finally:
            if long:
                in_prefill.clear()

    monkeypatch.setattr(Load, "forward", watched)
    seen_during_prefill = 0

    async def ticker() -> None:  # counts the loop's turns that happen while the prefill is running
        nonlocal seen_during_prefill
        while True:
            await asyncio.sleep(0.001)
            seen_during_prefill += in_prefill.is_set()

    tick = asyncio.create_task(ticker())
    try:
        _, c = await run(engine, ex)
    finally:
        tick.cancel()
    n = c.usage.input_tokens
    assert 10_000 < n < engine.info.context_length
    assert len(c.token_ids) == 16
    assert seen_during_prefill > 0, "the event loop did not run while the prefill was in progress"
