"""The embedded engine's bulk work (``daemon/engines/bulk.py``), in-process on the tiny model: many answers decoded
as one batch are the answers each request gets alone (the whole weights and a LoRA adapter, in one prefill and in
many small ones); a user's request that arrives while a bulk job runs is prefilled at once, even with every slot
of ``max_batch`` free for it only (the job takes none), and is served between the job's forwards, finishing long
before the job; the KL of many pairs in a few forwards is each pair's own; a closing engine ends a job with
``Unavailable``."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.config import ModelEntry
from daemon.engines import bulk
from daemon.engines.base import ReleaseRef
from daemon.engines.transformers import TransformersEngine
from daemon.errors import Unavailable
from daemon.exchange import Completion, Exchange, Finish, internal_exchange
from daemon.lora import AdapterManifest
from tests.test_lora_engine import BASE, make_adapter

# prompts of many lengths (the batch is left-padded) that share the chat template's opening, and one that shares
# no system prompt with the others (the shared prefix is then only the template's first tokens)
PROMPTS = ["hi", "What is the capital of France?", "Name a colour.",
           "Write one sentence about the sea, the wind and the long grey rocks of the northern coast at dusk.",
           *(f"Tell me about caches number {i}." for i in range(10)), "x " * 60]


def exchanges(mixed: bool = False) -> list[Exchange]:
    """The prompts with one system prompt (a long shared prefix, as SmolLM2's template gives every prompt), or
    some without (``mixed``: little is shared); max_tokens from 1 (the answer ends at its first token, in the
    prefill) to 24: rows leave the batch at different steps."""
    return [internal_exchange("tiny", "" if mixed and i % 5 == 0 else "You are terse, kind and always right.", p,
                              [1, 3, 8, 24][i % 4]) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ReleaseRef]:
    base = ReleaseRef(BASE.release_id, BASE.content_id, tiny_model)
    root = tmp_path_factory.mktemp("bulk-adapters")
    manifest = AdapterManifest(BASE.content_id, BASE.release_id)
    return {"base": base,
            "a": ReleaseRef("1" * 40, "c" * 40, make_adapter(tiny_model, root / "a", 1, manifest), base),
            "b": ReleaseRef("2" * 40, "d" * 40, make_adapter(tiny_model, root / "b", 2, manifest), base)}


@pytest.fixture
async def engine(tiny_model: Path):
    eng = TransformersEngine(ModelEntry(name="tiny", path=tiny_model, threads=1, max_batch=8, max_new_tokens=24))
    await eng.start()
    yield eng
    await eng.close()


async def alone(engine: TransformersEngine, exchange: Exchange, release: ReleaseRef | None = None) -> Completion:
    """The answer a request gets with the engine to itself."""
    async for event in engine.generate(exchange, release):
        if isinstance(event, Finish):
            return event.completion
    raise AssertionError("no Finish")


def same(a: Completion, b: Completion) -> None:
    assert (a.text, a.token_ids, a.stop_reason, a.prompt_token_ids, a.runtime_load_id) == (
        b.text, b.token_ids, b.stop_reason, b.prompt_token_ids, b.runtime_load_id)
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("shape", ["default-bounds", "small-bounds", "little-shared"])
@pytest.mark.parametrize("which", ["base", "a"])
async def test_answers_in_one_batch_are_each_requests_own(engine: TransformersEngine, adapter: dict[str, ReleaseRef],
                                                          monkeypatch: pytest.MonkeyPatch, which: str,
                                                          shape: str) -> None:
    small = shape != "default-bounds"
    if small:  # a few rows a prefill, and a decode batch too small for them all: the rest wait for room
        monkeypatch.setattr(bulk, "PREFILL_TOKENS", 40)
        monkeypatch.setattr(bulk, "BATCH_TOKENS", 200)
    release = None if which == "base" else adapter[which]
    asked = exchanges(mixed=shape == "little-shared")
    want = [await alone(engine, e, release) for e in asked]
    forwards: list[int] = []
    cells: list[int] = []  # the decode batch's cache bound after each forward
    inputs: list[tuple[int, int]] = []  # each prefill's rows and input tokens a row
    advance, prefill = bulk.Answers.advance, bulk._prefill

    def advancing(self: bulk.Answers) -> None:
        advance(self)
        forwards.append(self.forwards)
        cells.append(self._cells(self.batch.seqs) if len(self.batch.seqs) > 1 else 0)

    def prefilling(load: Any, rows: Any, prefix: Any, adapters: Any, keep: int) -> Any:
        inputs.append((len(rows), max(len(r) for r in rows) - len(prefix.tokens)))
        return prefill(load, rows, prefix, adapters, keep)

    monkeypatch.setattr(bulk.Answers, "advance", advancing)
    monkeypatch.setattr(bulk, "_prefill", prefilling)
    got = await engine.answer_many(asked, release)
    # a stream waits at most one prefill of PREFILL_TOKENS (a longer prompt alone), the decode batch stays bounded
    assert all(n * s <= bulk.PREFILL_TOKENS or n == 1 for n, s in inputs) and max(cells) <= bulk.BATCH_TOKENS
    assert len(inputs) > (3 if small else 1) and (max(n for n, _ in inputs) > 1)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        same(a, b)
    assert {len(c.token_ids) for c in got} >= {1, 3, 8}  # rows ended at different steps
    # one prefix, the prefills, one decode step per token of the longest answer: far fewer than one a request
    if not small:
        assert forwards[-1] <= 10 + max(len(c.token_ids) for c in got) < sum(len(c.token_ids) for c in got)
    # a different model answers differently: the comparison can tell
    other = await engine.answer_many(asked, adapter["b"])
    assert [c.token_ids for c in other] != [c.token_ids for c in got]


async def test_a_users_request_is_served_between_the_jobs_forwards(tiny_model: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # one slot: a bulk job that took it (as the check's answers did, each a request) would keep the user waiting
    engine = TransformersEngine(ModelEntry(name="tiny", path=tiny_model, threads=1, max_batch=1, max_new_tokens=64))
    await engine.start()
    log: list[str] = []  # in the generation thread's order: "job" a forward of the job, "user" a step of the user's
    posted = threading.Event()  # a call for the generation thread (the job's next forward) was posted
    prefill, decode, advance, post = (TransformersEngine._prefill, TransformersEngine._decode, bulk.Answers.advance,
                                      engine._post)

    def decoding(self: TransformersEngine, batch: Any) -> None:
        if batch.seqs:
            if log.count("user") == 1:  # the user's first decode step waits until the job may go on too
                posted.wait(60)
            log.append("user")
        decode(self, batch)

    monkeypatch.setattr(TransformersEngine, "_prefill", lambda self, s, b: (log.append("user"), prefill(self, s, b)))
    monkeypatch.setattr(TransformersEngine, "_decode", decoding)
    monkeypatch.setattr(bulk.Answers, "advance", lambda self: (log.append("job"), advance(self)))
    monkeypatch.setattr(engine, "_post", lambda call: (post(call), posted.set()))
    # the job's driver pauses after its first forwards until the user's request is queued
    go, paused = asyncio.Event(), asyncio.Event()
    between = engine._between_steps

    async def gated(fn: Any) -> Any:
        if log.count("job") >= 3 and not go.is_set():
            paused.set()
            await go.wait()
        return await between(fn)

    monkeypatch.setattr(engine, "_between_steps", gated)
    try:
        job = asyncio.create_task(engine.answer_many(
            [internal_exchange("tiny", "", f"Tell me about caches number {i}.", 64) for i in range(24)]))
        await paused.wait()
        user = asyncio.create_task(alone(engine, internal_exchange("tiny", "", "Name a colour.", 24)))
        while not engine._pending and "user" not in log:
            await asyncio.sleep(0.001)
        posted.clear()
        go.set()
        answer = await user
        assert not job.done(), "the user's request waited for the whole job"
        served = log[log.index("user"): len(log) - log[::-1].index("user")]  # from its prefill to its last step
        assert served.count("user") == len(answer.token_ids) >= 8
        assert "job" in served and "job job" not in " ".join(served), served  # a forward of the job at most a step
        done = await job
        assert log[-1] == "job" and log.count("job") > served.count("job") + 10
        assert max(len(c.token_ids) for c in done) > len(answer.token_ids)
    finally:
        await engine.close()


def pause_after(engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch,
                forwards: int) -> tuple[asyncio.Event, asyncio.Event]:
    """Pause a job's driver once its ``forwards``-th forward has returned: (paused, go)."""
    paused, go = asyncio.Event(), asyncio.Event()
    between = engine._between_steps
    calls = 0

    async def gated(fn: Any) -> Any:
        nonlocal calls
        calls += 1
        result = await between(fn)
        if calls == forwards:
            paused.set()
            await go.wait()
        return result

    monkeypatch.setattr(engine, "_between_steps", gated)
    return paused, go


async def test_a_closing_engine_ends_a_job_with_unavailable(engine: TransformersEngine,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    paused, go = pause_after(engine, monkeypatch, 2)
    job = asyncio.create_task(engine.answer_many(exchanges()))
    await paused.wait()
    await engine.close()
    go.set()
    with pytest.raises(Unavailable):
        await job


async def test_a_jobs_load_stays_resident_while_it_runs(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no memory to spare: a load nothing runs on is dropped as soon as another one loads
    engine = TransformersEngine(ModelEntry(name="tiny", path=tiny_model, threads=1, memory_budget_mb=0))
    await engine.start()
    try:
        mine, other = ReleaseRef("1" * 40, "e" * 40, tiny_model), ReleaseRef("2" * 40, "f" * 40, tiny_model)
        paused, go = pause_after(engine, monkeypatch, 2)
        job = asyncio.create_task(engine.answer_many(exchanges(), mine))
        await paused.wait()
        await engine.preload(other)
        assert mine.content_id in engine.resident  # the job's is kept (the other, idle, goes), not reloaded
        go.set()
        assert len(await job) == len(PROMPTS)
        await engine.preload(ReleaseRef("3" * 40, "a" * 40, tiny_model))
        assert mine.content_id not in engine.resident  # once it ended, it may go
    finally:
        await engine.close()


async def test_the_kl_of_many_pairs_in_a_few_forwards_is_each_pairs_own(
        engine: TransformersEngine, adapter: dict[str, ReleaseRef], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "PREFILL_TOKENS", 60)  # several chunks, each on both loads
    done = [await alone(engine, e, adapter["a"]) for e in exchanges()]
    pairs = [(c.prompt_token_ids, c.token_ids) for c in done] + [([1, 2, 3], [])]
    want = [await engine.divergence(p, t, adapter["a"], adapter["base"]) for p, t in pairs]
    got = await engine.divergence_many(pairs, adapter["a"], adapter["base"])
    assert got is not None and len(got) == len(want) and got[-1] == []
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-3, abs=1e-5)
    assert sum(map(sum, got)) > 0.01  # the adapter moved the model: the figures are not all zero
    itself = await engine.divergence_many(pairs, adapter["a"], adapter["a"])  # both sides on the same rows
    assert itself is not None and all(x == 0 for kl in itself for x in kl)
    other = await engine.divergence_many(pairs, adapter["a"], adapter["b"])  # against another reference
    assert other is not None and sum(map(sum, other)) != pytest.approx(sum(map(sum, got)), rel=1e-2)


def test_the_shared_prefix_leaves_each_row_what_it_must_run() -> None:
    assert bulk.shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert bulk.shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter one keeps its last token to run
    assert bulk.shared_prefix([[1, 2, 3, 4, 5]], [3]) == 2  # and a scored row its last tokens, and one before
    assert bulk.shared_prefix([[7, 1], [8, 1]]) == 0 and bulk.shared_prefix([]) == 0


async def test_the_checks_answers_go_through_one_batch_and_are_the_requests_own(
        engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon.engines.base import Engine
    from daemon.gating import heldout

    prompts = [p.prompt for p in heldout.shipped_probes()[:24]]
    jobs: list[int] = []
    advance = bulk.Answers.advance
    monkeypatch.setattr(bulk.Answers, "advance", lambda self: (jobs.append(id(self)), advance(self)))
    got = await heldout.answers(engine, "tiny", prompts, None, 16)
    assert len(set(jobs)) == 1 and len(jobs) < len(prompts)  # one job, fewer forwards than prompts (16 tokens)
    monkeypatch.setattr(engine, "answer_many", lambda exchanges, release: Engine.answer_many(engine, exchanges,
                                                                                             release))
    want = await heldout.answers(engine, "tiny", prompts, None, 16)  # each a request, as before
    assert [(a.text, a.token_ids, a.prompt_token_ids) for a in got] == [
        (a.text, a.token_ids, a.prompt_token_ids) for a in want]


async def test_a_model_whose_caches_cannot_share_a_batch_answers_each_as_a_request(
        engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    load = engine._serving()
    monkeypatch.setattr(load, "batchable", False)  # as a sliding-window model's load says
    jobs: list[str] = []
    advance, kl = bulk.Answers.advance, bulk.Divergences.advance
    monkeypatch.setattr(bulk.Answers, "advance", lambda self: (jobs.append("answers"), advance(self)))
    monkeypatch.setattr(bulk.Divergences, "advance", lambda self: (jobs.append("kl"), kl(self)))
    asked = exchanges()[:6]
    got = await engine.answer_many(asked)
    for a, e in zip(got, asked, strict=True):
        same(a, await alone(engine, e))
    pairs = [(c.prompt_token_ids, c.token_ids) for c in got]
    assert await engine.divergence_many(pairs, None, None) == [[0.0] * len(t) for _, t in pairs]  # type: ignore[arg-type]
    assert jobs == []
