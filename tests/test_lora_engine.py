"""LoRA adapters in the embedded engine, in-process: the base is resident once, adapter releases attach beside
each other on it, rows of different releases decode in one batch with their own adapter, a request keeps its
adapter however releases come and go, a dropped adapter is detached, and adapters that do not fit are refused.

Every log-prob is compared with peft's own loading of the same files (an independent implementation), and
with the other releases', which must differ."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.config import ModelEntry
from daemon.engines.base import ReleaseRef
from daemon.engines.transformers import Load, TransformersEngine
from daemon.errors import EngineError
from daemon.exchange import Completion, Exchange, Finish, Message, Part, Sampling, TextDelta
from daemon.lora import AdapterManifest

BASE = ReleaseRef("b" * 40, "a" * 40)  # the base release's ids (its path is the tiny model)


def make_adapter(base_dir: Path, dest: Path, seed: int, base: AdapterManifest, *, std: float = 0.5,
                 model: Any = None) -> Path:
    """A LoRA adapter on the model in ``base_dir`` with random (non-zero) weights, saved as the trainer saves one."""
    from transformers import AutoModelForCausalLM

    from recipes.online_rl import OnlineRLSettings, save_adapter, wrap_lora

    torch.manual_seed(seed)
    peft_model = wrap_lora(model or AutoModelForCausalLM.from_pretrained(base_dir), OnlineRLSettings(lora_rank=4))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    dest.mkdir(parents=True)
    save_adapter(peft_model, dest, base)
    return dest


def peft_model(base_dir: Path, adapter_dir: Path | None) -> Any:
    """The base with the adapter, loaded by peft itself (the reference)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    if adapter_dir is None:
        return model
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return PeftModel.from_pretrained(model, str(adapter_dir)).eval()


def rescored(model: Any, c: Completion) -> list[float]:
    ids = c.prompt_token_ids + c.token_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(c.prompt_token_ids)
    return [float(logp[n - 1 + k, t]) for k, t in enumerate(c.token_ids)]


def chat(i: int, max_tokens: int = 12) -> Exchange:
    return Exchange(format="openai-chat", model="tiny",
                    messages=[Message("user", [Part("text", f"tell me about caches number {i}")])],
                    sampling=Sampling(max_tokens=max_tokens, seed=i))


async def run(engine: TransformersEngine, exchange: Exchange, ref: ReleaseRef | None,
              started: asyncio.Event | None = None) -> Completion:
    async for event in engine.generate(exchange, ref):
        if isinstance(event, TextDelta) and started is not None:
            started.set()
        if isinstance(event, Finish):
            return event.completion
    raise AssertionError("no Finish")


async def until(cond: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a speed bound
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        gc.collect()
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ReleaseRef]:
    base = ReleaseRef(BASE.release_id, BASE.content_id, tiny_model)
    root = tmp_path_factory.mktemp("adapters")
    manifest = AdapterManifest(BASE.content_id, BASE.release_id)
    return {
        "base": base,
        "a": ReleaseRef("1" * 40, "c" * 40, make_adapter(tiny_model, root / "a", 1, manifest), base),
        "b": ReleaseRef("2" * 40, "d" * 40, make_adapter(tiny_model, root / "b", 2, manifest), base),
    }


@pytest.fixture
async def engine(tiny_model: Path):
    eng = TransformersEngine(ModelEntry(name="tiny", path=tiny_model, threads=1, max_batch=8, max_new_tokens=24))
    await eng.start()
    yield eng
    await eng.close()


def hooks(model: Any) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


async def test_adapter_releases_share_the_base_and_decode_in_one_batch_with_their_own_weights(
        engine: TransformersEngine, adapters: dict[str, ReleaseRef], tiny_model: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[list[str | None]] = []
    forward = Load.forward

    jobs = [(i, name) for i in range(2) for name in adapters]  # base, a, b, base, a, b: all in flight together
    exchanges = [chat(i) for i, _ in jobs]

    def spy(self: Load, ids: torch.Tensor, cache: Any, rows: Any = None, **kw: Any) -> torch.Tensor:
        # the first step waits (a hang guard, not a bound) until every request is queued: on a loaded machine the
        # first ones could otherwise finish before the last are tokenized, and the batch this is about never forms
        deadline = time.monotonic() + 30
        while not steps and any(e.progress is None for e in exchanges) and time.monotonic() < deadline:
            time.sleep(0.005)
        steps.append(list(rows or [self.adapter] * ids.shape[0]))
        return forward(self, ids, cache, rows, **kw)

    # every release resident first: an adapter still loading while the base rows decode would keep them apart
    await asyncio.gather(*(run(engine, chat(9, max_tokens=1), ref) for ref in adapters.values()))
    monkeypatch.setattr(Load, "forward", spy)
    done = await asyncio.gather(*(run(engine, e, adapters[name]) for e, (_, name) in zip(exchanges, jobs, strict=True)))
    loads = {name: engine._resident[ref.content_id] for name, ref in adapters.items()}
    # one base in memory: both adapter loads decode on the base load's model, each under its own load id
    assert loads["a"].model is loads["b"].model is loads["base"].model
    assert len({load.id for load in loads.values()}) == 3 and loads["base"].adapter is None
    assert {c.runtime_load_id for c, (_, n) in zip(done, jobs, strict=True) if n == "a"} == {loads["a"].id}
    # the premise: some decode step carried rows of all three releases
    assert any(len(set(rows)) == 3 for rows in steps), steps[:20]
    refs = {name: peft_model(tiny_model, ref.path if ref.base else None) for name, ref in adapters.items()}
    for c, (_, name) in zip(done, jobs, strict=True):
        assert len(c.token_ids) > 3
        assert c.logprobs == pytest.approx(rescored(refs[name], c), abs=1e-4), name
        for other in set(adapters) - {name}:  # every token after the first, decoded in the shared batch
            worst = max(abs(x - y) for x, y in zip(c.logprobs[1:], rescored(refs[other], c)[1:], strict=True))
            # the tiny model's small random embeddings bound its logits: 0.05 is still 500x the tolerance above
            assert worst > 0.05, (name, other, worst)


async def test_a_request_keeps_its_adapter_and_dropped_adapters_are_detached(
        tiny_model: Path, adapters: dict[str, ReleaseRef]) -> None:
    # budget 0: no load is kept for later; a load lives as long as a request holds it
    engine = TransformersEngine(ModelEntry(name="tiny", path=tiny_model, threads=1, memory_budget_mb=0))
    await engine.start()
    try:
        started = asyncio.Event()
        task = asyncio.ensure_future(run(engine, chat(3, max_tokens=40), adapters["a"], started))
        await started.wait()
        base = engine._resident[BASE.content_id]
        on_b = engine.generate(chat(5, max_tokens=40), adapters["b"])  # a new release while the request on a runs
        await on_b.__anext__()  # b is attached and decoding; this generator holds its load until it is closed
        c = await task
        assert c.logprobs == pytest.approx(rescored(peft_model(tiny_model, adapters["a"].path), c), abs=1e-4)
        layers = base.lora._layers
        del task
        await until(lambda: all(c.runtime_load_id not in layer.adapters for layer in layers.values()),
                    "a to be detached once its last request ended")
        assert len(base.lora) == 1 and hooks(base.model) == len(layers) > 0  # b's: one hook per targeted layer
        await on_b.aclose()
        await until(lambda: len(base.lora) == 0, "b to be detached")
        assert hooks(base.model) == 0  # the base alone runs as a plain model again
        plain = await run(engine, chat(4), adapters["base"])
        assert plain.logprobs == pytest.approx(rescored(peft_model(tiny_model, None), plain), abs=1e-4)
    finally:
        await engine.close()


async def test_adapters_that_do_not_fit_the_resident_base_are_never_served(
        engine: TransformersEngine, adapters: dict[str, ReleaseRef], tiny_model: Path, tmp_path: Path) -> None:
    from daemon.models import TinyConfig, build_tiny

    base = adapters["base"]
    other = AdapterManifest("f" * 40, "e" * 40)  # trained on another base
    wrong_base = make_adapter(tiny_model, tmp_path / "wrong-base", 5, other)
    _, narrow = build_tiny(config=TinyConfig(hidden_size=32, corpus_chars=20_000))
    misfit = make_adapter(tiny_model, tmp_path / "misfit", 6, AdapterManifest(BASE.content_id, BASE.release_id),
                          model=narrow)  # names the right base, but its tensors are another model's shapes
    dora = make_adapter(tiny_model, tmp_path / "dora", 7, AdapterManifest(BASE.content_id, BASE.release_id))
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    for n, (path, words) in enumerate([(wrong_base, "not the resident base"), (misfit, "do not fit"),
                                       (dora, "DoRA")]):
        ref = ReleaseRef(f"{n + 4}" * 40, f"{n + 4}" * 40, path, base)
        with pytest.raises(EngineError, match=words):
            await run(engine, chat(n), ref)
        assert ref.content_id not in engine.resident
    base_load = engine._resident[BASE.content_id]
    assert len(base_load.lora) == 0 and hooks(base_load.model) == 0  # nothing of them was attached


async def test_the_prefix_cache_is_kept_per_load_never_shared_between_adapters_on_one_base(
        engine: TransformersEngine, adapters: dict[str, ReleaseRef], tiny_model: Path) -> None:
    """The base and adapter release ``a`` answer the same prompt side by side (one batch on one model); each keeps
    its own cache entry. A request on ``b`` (no entry of its own) then prefills everything, and later requests on
    ``a`` and the base reuse only their own keys and values: every answer's log-probs are peft's for its release."""
    prompt = "You are a coding agent. Read the files, run the tests and explain the change. " * 6
    ex = Exchange(format="openai-chat", model="tiny", messages=[Message("user", [Part("text", prompt)])],
                  sampling=Sampling(max_tokens=8, temperature=0))
    first = dict(zip(["base", "a"], await asyncio.gather(run(engine, ex, adapters["base"]),
                                                         run(engine, ex, adapters["a"])), strict=True))
    loads = {name: c.runtime_load_id for name, c in first.items()}
    assert all(c.usage.cache_read_tokens == 0 for c in first.values())
    on_b = await run(engine, ex, adapters["b"])  # the same prompt on a third load: nothing of the others' is used
    again = {name: await run(engine, ex, adapters[name]) for name in ("a", "base")}
    n = len(on_b.prompt_token_ids)
    assert on_b.usage.cache_read_tokens == 0
    assert all(c.usage.cache_read_tokens == n - 1 for c in again.values())  # each reused its own entry
    assert all(c.runtime_load_id == loads[name] for name, c in again.items())
    # one entry per load (stored in the generation thread after the step that finished it: read once later steps ran)
    entries = sorted(e.load_id for e in engine.prefix_cache._entries.values())
    assert entries == sorted([*loads.values(), on_b.runtime_load_id])
    refs = {name: peft_model(tiny_model, ref.path if ref.base else None) for name, ref in adapters.items()}
    for name, c in [*first.items(), ("b", on_b), *again.items()]:
        assert c.logprobs == pytest.approx(rescored(refs[name], c), abs=1e-4), name
    # the premise: the releases' weights differ on this prompt (a shared entry would change the answer)
    assert max(abs(x - y) for x, y in zip(first["a"].logprobs, rescored(refs["base"], first["a"]), strict=True)) > 0.05


async def test_a_dropped_load_leaves_no_prefix_cache_entry(tiny_model: Path, adapters: dict[str, ReleaseRef]) -> None:
    """Budget 0: a release's load is dropped as soon as it is loaded, while its request runs on. That request's KV
    could only serve the same load, which no later request gets (the release loads again under a new id), so it is
    not kept; a load the engine keeps (the model's own) still keeps its entries."""
    engine = TransformersEngine(ModelEntry(name="tiny", path=tiny_model, threads=1, memory_budget_mb=0))
    await engine.start()
    try:
        prompt = "You are a coding agent. Read the files, run the tests and explain the change. " * 6
        ex = Exchange(format="openai-chat", model="tiny", messages=[Message("user", [Part("text", prompt)])],
                      sampling=Sampling(max_tokens=8, temperature=0))
        on_a = await run(engine, ex, adapters["a"])
        assert adapters["a"].content_id not in engine.resident
        again = await run(engine, ex, adapters["a"])  # runs after the first one's step: its entry would be in
        assert again.runtime_load_id != on_a.runtime_load_id and again.usage.cache_read_tokens == 0
        plain = [await run(engine, ex, None) for _ in range(2)]
        assert plain[1].usage.cache_read_tokens == len(plain[1].prompt_token_ids) - 1
        held = {e.load_id for e in engine.prefix_cache._entries.values()}
        assert on_a.runtime_load_id not in held and plain[0].runtime_load_id in held
    finally:
        await engine.close()


async def test_a_superseded_adapter_is_dropped_once_its_last_request_ends_and_a_kept_one_stays(
        engine: TransformersEngine, adapters: dict[str, ReleaseRef], tiny_model: Path) -> None:
    """``retain`` names the releases that serve new requests (the daemon's heads, canary arms and pins). Head ``a``
    is superseded by ``b`` while a request on ``a`` runs: that request ends on ``a``'s own weights, and only then
    is ``a`` dropped and its adapter detached; ``b`` stays, and so does a release kept by a pin (``a`` again, named
    in ``retain``), and a load for a look (a held-out candidate, never among the kept) is left to its owner."""
    base, a, b = adapters["base"], adapters["a"], adapters["b"]
    engine.retain({base.content_id, a.content_id})
    await run(engine, chat(1), a)  # served as the head: kept while it serves
    started = asyncio.Event()
    task = asyncio.ensure_future(run(engine, chat(3, max_tokens=40), a, started))
    await started.wait()
    await engine.preload(b)  # b published: loaded, then named the head instead of a
    engine.retain({base.content_id, b.content_id})
    assert a.content_id in engine.resident  # its request runs on
    base_load = engine._resident[base.content_id]
    on_a = await task
    assert on_a.logprobs == pytest.approx(rescored(peft_model(tiny_model, a.path), on_a), abs=1e-4)
    await until(lambda: set(engine.resident) == {base.content_id, b.content_id}, "a to be dropped")
    await until(lambda: len(base_load.lora) == 1, "a's adapter to be detached")
    assert on_a.runtime_load_id not in {n for layer in base_load.lora._layers.values() for n in layer.adapters}
    on_b = await run(engine, chat(4), b)
    assert on_b.logprobs == pytest.approx(rescored(peft_model(tiny_model, b.path), on_b), abs=1e-4)

    # a pinned old release, named beside the head: reloaded and kept after its request ends
    engine.retain({base.content_id, b.content_id, a.content_id})
    again = await run(engine, chat(5), a)
    assert again.runtime_load_id != on_a.runtime_load_id  # a new load: the old one was dropped
    await until(lambda: not engine._active, "the finished request's generator to close")
    assert set(engine.resident) == {base.content_id, a.content_id, b.content_id} and len(base_load.lora) == 2
    # a look under its own key: never among the kept, so never dropped here (its owner unloads it)
    look = ReleaseRef("candidate:1", "candidate:1", b.path, base)
    await run(engine, chat(6), look)
    await until(lambda: not engine._active, "the look's request to close")
    engine.retain({base.content_id, b.content_id})  # the pin is gone
    assert set(engine.resident) == {base.content_id, b.content_id, "candidate:1"}
    await engine.unload(look)
    await until(lambda: len(base_load.lora) == 1, "the pinned and the look's adapters to be detached")
    engine.retain({base.content_id})  # b (loaded before it was named) superseded too: the base alone serves
    assert set(engine.resident) == {base.content_id}
    await until(lambda: len(base_load.lora) == 0, "b's adapter to be detached")
