"""The embedded engine's prefix cache: an agent's next turn reuses the KV cache of the previous one, exactly.

Exactness is checked against things computed differently: an engine with the cache turned off (one cold forward
over the whole prompt) and a teacher-forced pass of the model itself over prompt + answer.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from daemon.config import ModelEntry
from daemon.engines.prefix_cache import PrefixCache
from daemon.engines.transformers import TransformersEngine
from daemon.exchange import Completion, Exchange, Finish, Message, Part, Sampling
from daemon.hf import no_progress_bars
from daemon.models import init_tiny, save_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEM = "You are a coding agent. Read the files, run the tests, keep changes small and explain them. " * 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def reference_model(tiny: Path):
    from transformers import AutoModelForCausalLM

    with no_progress_bars():
        return AutoModelForCausalLM.from_pretrained(tiny).eval()


async def make_engine(path: Path, **kw) -> TransformersEngine:
    eng = TransformersEngine(ModelEntry(name="tiny", path=path, threads=1, max_batch=8, max_new_tokens=24, **kw))
    await eng.start()
    return eng


def conversation(*turns: str, **sampling) -> Exchange:
    """System prompt, then alternating user / assistant texts (ending with a user turn)."""
    messages = [Message("system", [Part("text", SYSTEM)])]
    for i, text in enumerate(turns):
        messages.append(Message("user" if i % 2 == 0 else "assistant", [Part("text", text)]))
    return Exchange(format="openai-chat", model="tiny", messages=messages, tools=[], sampling=Sampling(**sampling))


async def complete(engine: TransformersEngine, exchange: Exchange) -> Completion:
    async for event in engine.generate(exchange):
        if isinstance(event, Finish):
            return event.completion
    raise AssertionError("no Finish")


def teacher_forced(model, c: Completion) -> list[float]:
    ids = torch.tensor([c.prompt_token_ids + c.token_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(c.prompt_token_ids)
    return [float(logp[n - 1 + k, t]) for k, t in enumerate(c.token_ids)]


async def test_next_turn_reuses_the_previous_turn_and_matches_a_cold_prefill(tiny: Path, reference_model) -> None:
    """Turn 1 finishes while a longer request still decodes beside it (so its row in the batch cache is padded);
    turn 2 (turn 1 + its answer + a new question) then prefills only the new part, and its answer and log-probs
    equal those of an engine without the cache and of a teacher-forced pass."""
    warm, cold = await make_engine(tiny), await make_engine(tiny, prefix_cache_mb=0)
    try:
        other = conversation("word " * 300, temperature=0, max_tokens=40)
        first, _ = await asyncio.gather(
            complete(warm, conversation("Fix the failing test in tests/test_api.py", temperature=0, max_tokens=12)),
            complete(warm, other),
        )
        assert first.usage.cache_read_tokens == 0
        second_ex = conversation("Fix the failing test in tests/test_api.py", first.text, "Now run it again.",
                                 temperature=0, max_tokens=16)
        second = await complete(warm, second_ex)
        reference = await complete(cold, second_ex)
    finally:
        await warm.close()
        await cold.close()
    # the whole of turn 1 up to its answer is shared (the answer may re-tokenise differently: the match stops there)
    assert len(first.prompt_token_ids) <= second.usage.cache_read_tokens < len(second.prompt_token_ids)
    assert reference.usage.cache_read_tokens == 0 and cold.prefix_cache.stats.hits == 0
    assert warm.prefix_cache.stats.reused_tokens == second.usage.cache_read_tokens
    assert second.prompt_token_ids == reference.prompt_token_ids
    assert second.token_ids == reference.token_ids
    assert second.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    assert second.logprobs == pytest.approx(teacher_forced(reference_model, second), abs=1e-4)


async def test_a_repeated_prompt_reuses_all_but_its_last_token(tiny: Path, reference_model) -> None:
    """The same prompt again (a retry): everything but the last prompt token comes from the cache; sampling with
    the same seed gives the same tokens."""
    engine = await make_engine(tiny)
    try:
        ex = conversation("List the files.", seed=5, max_tokens=10)
        a = await complete(engine, ex)
        b = await complete(engine, ex)
    finally:
        await engine.close()
    assert a.usage.cache_read_tokens == 0
    assert b.usage.cache_read_tokens == len(b.prompt_token_ids) - 1
    assert b.token_ids == a.token_ids
    assert b.logprobs == pytest.approx(teacher_forced(reference_model, b), abs=1e-4)


async def test_the_cache_never_serves_another_load(tiny: Path, tmp_path: Path) -> None:
    """After a new load (other weights, same tokenizer) the same prompt is prefilled from scratch, and its
    log-probs are the new weights' own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    save_model(AutoTokenizer.from_pretrained(tiny), model, tmp_path / "other")
    engine = await make_engine(tiny)
    try:
        ex = conversation("List the files.", temperature=0, max_tokens=10)
        await complete(engine, ex)
        await engine.load(tmp_path / "other")
        c = await complete(engine, ex)
    finally:
        await engine.close()
    assert c.usage.cache_read_tokens == 0
    assert c.logprobs == pytest.approx(teacher_forced(model, c), abs=1e-4)


# --- the cache itself -----------------------------------------------------------------------------------------


def layers(n: int, fill: float = 0.0, n_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, n, 4), fill), torch.full((1, 2, n, 4), fill)) for _ in range(n_layers)]


def test_lookup_takes_the_longest_match_of_the_same_load() -> None:
    cache = PrefixCache(budget_bytes=2**20, min_tokens=4)
    cache.store("a", list(range(20)), layers(20, 1.0))
    cache.store("a", list(range(10)) + [99] * 20, layers(30, 2.0))
    cache.store("b", list(range(40)), layers(40, 3.0))
    n, kv = cache.lookup("a", list(range(25)))
    assert n == 20 and float(kv[0][0].mean()) == 1.0 and kv[0][0].shape[2] == 20
    n, kv = cache.lookup("a", list(range(10)) + [99] * 5 + [7])
    assert n == 15 and float(kv[1][1].mean()) == 2.0
    assert cache.lookup("a", list(range(3)) + [5] * 10) == (0, [])  # 3 tokens match: under min_tokens
    assert cache.lookup("c", list(range(25))) == (0, [])  # no entry of that load
    n, _ = cache.lookup("a", list(range(20)))  # the whole prompt cached: its last token is still run
    assert n == 19
    assert cache.stats.hits == 3 and cache.stats.misses == 2


def test_entries_are_bounded_by_bytes_and_count_least_recently_used_first() -> None:
    one = sum(k.nbytes + v.nbytes for k, v in layers(20))
    cache = PrefixCache(budget_bytes=2 * one, max_entries=8, min_tokens=4)
    for start in (100, 200, 300):
        cache.lookup("a", list(range(100, 120)))  # 100.. is used again before 300 comes in: 200 is the oldest
        cache.store("a", list(range(start, start + 20)), layers(20))
    assert len(cache) == 2 and cache.nbytes == 2 * one
    assert cache.lookup("a", list(range(200, 230)))[0] == 0
    assert cache.lookup("a", list(range(100, 130)))[0] == 20 and cache.lookup("a", list(range(300, 330)))[0] == 20
    small = PrefixCache(budget_bytes=2**20, max_entries=2, min_tokens=4)
    for start in (100, 200, 300):
        small.store("a", list(range(start, start + 20)), layers(20))
    assert len(small) == 2 and small.lookup("a", list(range(100, 130)))[0] == 0
    assert PrefixCache(budget_bytes=one - 1, min_tokens=4).store("a", list(range(20)), layers(20)) is None


def test_an_extension_replaces_its_prefix_and_forget_drops_a_load() -> None:
    cache = PrefixCache(budget_bytes=2**20, min_tokens=4)
    cache.store("a", list(range(20)), layers(20))
    cache.store("a", list(range(30)), layers(30))  # turn 2 extends turn 1: turn 1's entry is dropped
    assert len(cache) == 1
    cache.store("a", list(range(25)), layers(25))  # already held by the longer entry: not stored again
    assert len(cache) == 1
    cache.store("b", list(range(30)), layers(30))
    cache.forget("a")
    assert len(cache) == 1 and cache.lookup("a", list(range(30))) == (0, [])
    assert cache.lookup("b", list(range(30)))[0] == 29
    assert PrefixCache(budget_bytes=0).lookup("a", list(range(30))) == (0, [])  # prefix_cache_mb = 0: off


async def test_a_long_prefill_gives_its_working_memory_back(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After prefilling TRIM_AFTER_TOKENS new tokens or more, the engine returns the heap's free pages (freed, a
    long prefill's working memory stayed with the process between the cache's blocks: 1,689 MB for SmolLM2's
    daemon with 3,000-token prompts, over its bound); a short prompt, or a long one mostly read from the prefix
    cache, does not pay for a trim. The trim itself is glibc's, and answers."""
    from daemon.engines import prefix_cache, transformers

    def rss_mb() -> float:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

    blocks = [b"\x01" * 65536 for _ in range(1600)]  # 100 MB in heap blocks (under any mmap threshold), written
    top = blocks[-1]  # kept: what is freed below it is no top of the heap that malloc gives back by itself
    del blocks
    before = rss_mb()
    prefix_cache.give_back()
    assert rss_mb() < before - 50, (before, rss_mb())
    del top
    calls: list[int] = []
    monkeypatch.setattr(transformers, "give_back", lambda: calls.append(1))
    engine = await make_engine(tiny)
    try:
        long_turn = " ".join(f"file{i}.py changed" for i in range(600))
        ex = conversation(long_turn, max_tokens=2, temperature=0)
        n = len(engine._current.encode(ex))
        assert transformers.TRIM_AFTER_TOKENS == 1024 < n
        monkeypatch.setattr(transformers, "TRIM_AFTER_TOKENS", n)  # exactly this prompt's length: on the edge
        first = await complete(engine, ex)
        assert len(first.prompt_token_ids) == n and first.usage.cache_read_tokens == 0 and calls == [1]
        again = await complete(engine, conversation(long_turn, "ok", "and now?", max_tokens=2, temperature=0))
        assert again.usage.cache_read_tokens > n - 50 and calls == [1]  # the rest is short: no trim
        await complete(engine, conversation("a short question", max_tokens=2))
        assert calls == [1]
    finally:
        await engine.close()
