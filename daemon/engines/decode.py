"""The embedded engine's fast path for Llama-family models on the CPU: a hand-written forward, a KV cache that grows
in place, and 4-bit weights where the model's weights already are 4-bit.

Measured on SmolLM2-135M-Instruct (bf16, one torch thread, 2-core machine; docs/benchmarks.md has the figures and
``bench/decode_profile.py`` prints them): a decode step through transformers costs about 70 ms of CPU, of which the
matmuls are about 45 ms (the bf16 weights, 270 MB, do not stay in the cache between tokens) and transformers'
per-layer Python 10-15 ms; sampling and log-probs under 1 ms (load average 7-13: absolute figures high). So:

- **Weights packed to int4 where that loses nothing** (``pack_int4``): a linear layer whose bf16 weights lie on a
  4-bit grid per group of 32 inputs (SmolLM2 is made from a Q4_1 GGUF: every attention and MLP weight is
  ``d * q + m``) is replaced, in the model itself, by an ``Int4Linear`` over torch's int4 CPU kernel. The grid is
  recovered exactly (each weight within 0.05 of a grid step: the bf16 rounding of ``d * q + m``), so the served
  weights differ from the stored ones by that rounding: teacher-forced token log-probs differ from the bf16 path's
  by 0.022 on average (KL 0.0013), as much as a float32 forward of the same weights differs from bf16 (0.021,
  KL 0.0009), and float32 is what the trainer computes in. Layers off any such grid (the tiny models, a release
  of trained whole weights) stay as they are. The output head (tied to the 8-bit embedding) stays bf16: a grouped
  int8 head was no faster. Every forward of the engine (serving, the divergence check, the held-out checks) runs
  through the same modules, so what is served is what is checked. The projections take a third of their bf16 time (11.4
  against 37.5 ms of CPU per token) and SmolLM2's tensors take 117 MiB instead of 257. A long prefill is 11-20%
  slower through the int4 kernel than in bf16 (unpacking to bf16 for it cost as much as it saved).
- **A forward written for decoding** (``FastLlama``): the same operations as transformers' Llama in the same
  dtypes (so answers on an unpacked model match the reference path's token for token), without its mask
  building, cache classes, output dataclasses and keyword plumbing (6.8 against 10-15 ms of Python per token).
  The int4 q/k/v and gate/up of a layer run as one kernel call each (``_Fused``: 5% less per token, bitwise the
  separate calls). LoRA adapters still apply: a projection with an adapter's hooks on it is called as a module
  (fused calls give way), so the hooks (``daemon/engines/lora.py``) run as before.
- **A KV cache that grows in place** (``KVCache``): transformers' ``DynamicLayer`` concatenates on every step, a
  copy of the whole cache per token (35 MB at a pi-sized 1,500-token context); here each layer keeps headroom and
  writes the new column into it. Its layers expose ``keys`` / ``values`` (the filled part) and ``update`` as
  ``DynamicLayer`` does, so batching, the prefix cache and row removal work on it unchanged.

Anything else (another architecture, a rope scaling that changes with length, biases, a GPU) takes transformers'
own forward, as before.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

GROUP = 32  # inputs per int4 scale/zero pair (Q4_0 / Q4_1 blocks are 32 wide)
OFF_GRID = 0.1  # a weight further than this fraction of a grid step from the grid is not on it


# --- int4 weights -------------------------------------------------------------------------------------------------


def _grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``w`` [out, in] as ``q * scale + low`` per group of ``GROUP`` inputs, q in 0..15; None when it is not on such a
    grid. Returns q [out, in] int32, scale and low [out, in / GROUP] float32."""
    n, k = w.shape
    if n > 16 and _grid(w[:16]) is None:  # most weights are off any grid: tell from a few rows first
        return None
    b = w.float().reshape(n, k // GROUP, GROUP)
    low, high = b.amin(-1), b.amax(-1)
    scale = (high - low) / 15
    step = scale.clamp(min=torch.finfo(torch.float32).tiny)
    x = (b - low[..., None]) / step[..., None]
    q = x.round().clamp(0, 15)
    if float((x - q).abs().max()) > OFF_GRID:
        return None
    return q.to(torch.int32).reshape(n, k), scale, low


class Int4Linear(torch.nn.Linear):
    """A bias-free linear layer over 4-bit weights (torch's int4 CPU kernel, bf16 activations). ``weight`` gives the
    dequantized weights back on demand; ``in_features`` / ``out_features`` are the original layer's."""

    packed: torch.Tensor  # uint8, the kernel's layout of q
    scale_zero: torch.Tensor  # [in / GROUP, out, 2] in the activations' dtype

    def __init__(self, linear: torch.nn.Linear, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("bias", None)
        # the kernel's form: w = (q - 8) * scale + zero, with zero = low + 8 * scale; [in / GROUP, out, 2]
        zero = low + 8 * scale
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(
            linear.weight.dtype))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]  # torch: a Parameter attribute in nn.Linear
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype)
        return self.forward(eye).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zero)
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_int4(model: Any) -> int:
    """Replace every bf16 CPU linear layer of ``model`` whose weights lie on a 4-bit grid (but the output head) by an
    ``Int4Linear``; returns how many were replaced."""
    head = model.get_output_embeddings()
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child is head or child.bias is not None:
                continue
            w = child.weight
            if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.shape[1] % GROUP or w.shape[0] % 16:
                continue
            grid = _grid(w.detach())
            if grid is None:
                continue
            setattr(parent, name, Int4Linear(child, *grid))
            del grid
            packed += 1
            if packed % 16 == 0:  # the float32 temporaries of packing, back to the system as it goes
                _trim()
    return packed


def _trim() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # glibc only; elsewhere the memory is just kept for reuse
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _Fused:
    """Several ``Int4Linear`` layers over one input as one kernel call: their packed rows concatenated (the CPU
    layout keeps each block of 64 outputs contiguous, so each layer's ``packed`` becomes a view into the whole and
    nothing is held twice; the output columns are exactly the separate calls')."""

    def __init__(self, layers: list[Int4Linear]) -> None:
        self.layers = layers
        self.packed = torch.cat([m.packed for m in layers])
        self.scale_zero = torch.cat([m.scale_zero for m in layers], dim=1)
        self.splits = [m.out_features for m in layers]
        start = 0
        for m in layers:
            m.packed = self.packed[start : start + m.out_features]
            start += m.out_features

    @staticmethod
    def of(layers: list[Any]) -> _Fused | None:
        if not all(type(m) is Int4Linear and m.in_features == layers[0].in_features and m.out_features % 64 == 0
                   for m in layers) or not _blocks_concatenate():
            return None
        return _Fused(layers)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The layers' outputs, or None when a forward hook (a LoRA adapter) is on one of them."""
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.layers):
            return None
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zero)
        return list(out.reshape(*x.shape[:-1], -1).split(self.splits, dim=-1))


_BLOCKS: list[bool] = []


def _blocks_concatenate() -> bool:
    """Whether this CPU's int4 packing of stacked weights is the stack of their packings (asked once)."""
    if not _BLOCKS:
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randint(0, 16, (64, 64), dtype=torch.int32, generator=g) for _ in range(2))
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        _BLOCKS.append(torch.equal(pack(torch.cat([a, b]), 2), torch.cat([pack(a, 2), pack(b, 2)])))
    return _BLOCKS[0]


# --- the KV cache -----------------------------------------------------------------------------------------------


class _Layer:
    """One layer's keys and values [rows, kv_heads, tokens, head_dim], with headroom for more tokens. ``keys`` and
    ``values`` are the filled parts; each is set on its own (the engine replaces them one after the other when rows
    join or leave a batch), so each keeps its own length."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._nk = self._nv = 0

    @property
    def n(self) -> int:
        return self._nk

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self._nk]

    @keys.setter
    def keys(self, t: torch.Tensor) -> None:  # a whole new tensor (batch rows added or removed): no headroom yet
        self._k, self._nk = t, t.shape[2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self._nv]

    @values.setter
    def values(self, t: torch.Tensor) -> None:
        self._v, self._nv = t, t.shape[2]

    @staticmethod
    def _append(buf: torch.Tensor | None, n: int, x: torch.Tensor) -> torch.Tensor:
        new = x.shape[2]
        if buf is None or n + new > buf.shape[2]:
            room = n + new + max(64, n // 4)  # amortised: a copy every quarter of the length
            grown = x.new_empty(x.shape[0], x.shape[1], room, x.shape[3])
            if n:
                assert buf is not None  # n rows were appended to it
                grown[:, :, :n] = buf[:, :, :n]
            buf = grown
        buf[:, :, n : n + new] = x
        return buf

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` [rows, kv_heads, new, head_dim]; return all keys and values so far (views)."""
        assert self._nk == self._nv, "keys and values of one layer cover the same tokens"
        self._k = self._append(self._k, self._nk, k)
        self._v = self._append(self._v, self._nv, v)
        self._nk = self._nv = self._nk + k.shape[2]
        return self._k[:, :, : self._nk], self._v[:, :, : self._nv]


class KVCache:
    """The fast path's cache: the layers' keys and values, as ``DynamicCache`` offers them to the engine."""

    def __init__(self, layers: int) -> None:
        self.layers = [_Layer() for _ in range(layers)]

    def get_seq_length(self) -> int:
        return self.layers[0].n


# --- the forward ------------------------------------------------------------------------------------------------


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a bias-free linear layer, without ``nn.Module.__call__`` unless hooks (LoRA adapters) are on
    it."""
    if module._forward_hooks or module._forward_pre_hooks:
        return module(x)  # type: ignore[no-any-return]  # torch types a module's call as Any
    if type(module) is torch.nn.Linear:
        return F.linear(x, module.weight)
    return module.forward(x)  # type: ignore[no-any-return]  # torch: Module.forward is Any


class FastLlama:
    """``LlamaForCausalLM``'s forward for serving: the last position's logits, the cache extended in place."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.head = model.lm_head
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.layers[0].self_attn.scaling
        self.eps = cfg.rms_norm_eps
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scale = rotary.attention_scaling
        self.dtype = self.embed.weight.dtype
        self._cos = self._sin = torch.empty(0)
        # q/k/v and gate/up of each layer as one int4 call each, where they are packed
        self.fused = [(_Fused.of([a.q_proj, a.k_proj, a.v_proj]), _Fused.of([m.gate_proj, m.up_proj]))
                      for a, m in ((layer.self_attn, layer.mlp) for layer in self.layers)]
        half = self.head_dim // 2
        self._swap = torch.cat((torch.arange(half, self.head_dim), torch.arange(half)))

    @staticmethod
    def supports(model: Any) -> bool:
        """Whether this forward computes what transformers' does for ``model``."""
        cfg = getattr(model, "config", None)
        if type(model).__name__ != "LlamaForCausalLM" or cfg is None:
            return False
        rope = getattr(cfg, "rope_parameters", None) or {}
        return (rope.get("rope_type", "default") == "default" and cfg.hidden_act == "silu"
                and not cfg.attention_bias and not getattr(cfg, "mlp_bias", False)
                and not getattr(cfg, "pretraining_tp", 1) > 1
                and model.model.rotary_emb.rope_type == "default"
                and next(model.parameters()).device.type == "cpu")

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows, n, head_dim] for ``positions`` [rows, n], from a table (computed as transformers does)."""
        top = int(positions.max()) + 1
        if top > len(self._cos):
            size = max(top, 2 * len(self._cos), 256)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * self.rope_scale).to(self.dtype)
            sin = (emb.sin() * self.rope_scale).to(self.dtype)
            # rotate_half(x) * sin == x[..., swap] * (sin with its first half negated): negation is exact
            self._sin = torch.cat((-sin[:, : sin.shape[1] // 2], sin[:, sin.shape[1] // 2 :]), dim=-1)
        return self._cos[positions], self._sin[positions]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def __call__(self, ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab] after ``ids`` [rows, n]. ``attention_mask`` [rows, cache + n] (1 real, 0 padding) is
        given for left-padded batches; ``position_ids`` [rows, n] default to continuing the cache."""
        rows, n = ids.shape
        past = cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + n).expand(rows, n)
        cos, sin = self._rope(position_ids)
        cos, sin = cos[:, None], sin[:, None]
        swap = self._swap
        # the attention kernels as transformers picks them (sdpa_attention_forward), so the sums run in the same order
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.bool()[:, None, None, :]  # [rows, 1, 1, keys]
        if n > 1 and (past or mask is not None):
            causal = torch.ones(n, past + n, dtype=torch.bool).tril(past)
            mask = causal if mask is None else mask & causal
        hidden = F.embedding(ids, self.embed.weight)
        gqa = self.heads // self.kv_heads
        for layer, kv, (qkv, gate_up) in zip(self.layers, cache.layers, self.fused, strict=True):
            attn = layer.self_attn
            x = self._rms(hidden, layer.input_layernorm.weight)
            outs = qkv(x) if qkv is not None else None
            if outs is None:
                outs = [_linear(attn.q_proj, x), _linear(attn.k_proj, x), _linear(attn.v_proj, x)]
            q = outs[0].reshape(rows, n, self.heads, self.head_dim).transpose(1, 2)
            k = outs[1].reshape(rows, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = outs[2].reshape(rows, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + q.index_select(-1, swap) * sin
            k = k * cos + k.index_select(-1, swap) * sin
            keys, values = kv.update(k, v)
            if mask is None:  # a whole prompt from the start (causal) or one query without padding
                out = F.scaled_dot_product_attention(q, keys, values, is_causal=n > 1, scale=self.scaling,
                                                     enable_gqa=gqa > 1)
            elif n == 1 and gqa > 1:  # one query: the heads sharing a key/value head become its query rows
                out = F.scaled_dot_product_attention(q.reshape(rows, self.kv_heads, gqa, self.head_dim), keys, values,
                                                     attn_mask=mask, scale=self.scaling)
            else:
                if gqa > 1:
                    keys = keys.repeat_interleave(gqa, dim=1)
                    values = values.repeat_interleave(gqa, dim=1)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            out = out.reshape(rows, self.heads, n, self.head_dim).transpose(1, 2).reshape(rows, n, -1)
            hidden = hidden + _linear(attn.o_proj, out)
            mlp = layer.mlp
            x = self._rms(hidden, layer.post_attention_layernorm.weight)
            gu = gate_up(x) if gate_up is not None else None
            if gu is None:
                gu = [_linear(mlp.gate_proj, x), _linear(mlp.up_proj, x)]
            hidden = hidden + _linear(mlp.down_proj, F.silu(gu[0]) * gu[1])
        hidden = self._rms(hidden[:, -1:], self.norm.weight)
        logits: torch.Tensor = self.head(hidden)
        return logits[:, -1]


def prepare(model: Any, *, fast: bool, pack: bool) -> FastLlama | None:
    """Set ``model`` up for serving: int4 layers where lossless (``pack``), and the fast forward when it applies
    (``fast``); None: serve with transformers' own forward."""
    if not FastLlama.supports(model):
        return None
    if pack and pack_int4(model):
        _own_memory(model)
    return FastLlama(model) if fast else None


def _own_memory(model: Any) -> None:
    """Copy the tensors left unpacked (embedding, norms) out of the weights file's memory map, so the map (all of it
    read while packing: 257 MB of SmolLM2's file counted as resident) goes away, and hand the packing's freed
    temporaries back to the system (``pack_int4`` does so as it goes). Measured on SmolLM2, one process, after 16
    decoded tokens: 544 MB resident (peak 757, while packing) against 750 without this, and 666 (peak the same) for
    the bf16 reference path."""
    import gc

    for param in model.parameters():
        param.data = param.data.clone()
    gc.collect()
    _trim()
