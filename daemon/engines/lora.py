"""LoRA adapters on a resident base model, for the embedded engine.

A base model is loaded once; each adapter release adds its low-rank weights beside the others, and every row of
a forward says which adapter (or none) it runs with, so requests frozen to different releases of one base share
the base's memory and one decode batch. Reading an adapter (``read_adapter``) happens off the generation thread;
attaching, selecting and detaching happen in it, between two steps (it owns the models).

Design choices:

- **Our own application of peft's files, not peft's injection.** The files are peft's (``adapter_config.json``,
  ``adapter_model.safetensors``; the trainer writes them with peft) and the arithmetic is peft's LoRA
  (``out + B(A(x)) * alpha / r``, ``alpha / sqrt(r)`` with rsLoRA; the adapter's own dtype, then cast back), but
  a forward hook on each targeted ``nn.Linear`` applies it. Measured on SmolLM2-135M (7 projections x 30
  layers), peft's ``load_adapter`` takes 1.4 s on this machine (module-tree walks per target), which would stop
  every stream at each publish; attaching here is a dict insert per module (milliseconds). peft's mixed-batch
  forward (``adapter_names``) does what the hook does, with hook registration on every call.
- **Rows.** ``select(rows)`` names each row's adapter for one forward (None: the base); rows of one adapter are
  gathered by an index, a batch of one adapter needs none. With no adapter attached there are no hooks at all,
  so the base alone runs at plain-model speed.
- **Only plain LoRA on linear layers** is served (no DoRA, biases, ``modules_to_save``, embeddings or
  ``alpha_pattern``); anything else, or a tensor that does not fit the base's module, is refused when read.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from daemon import lora
from daemon.errors import EngineError

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "alpha_pattern": "alpha_pattern",
            "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases", "layer_replication": "layer_replication",
            "trainable_token_indices": "trainable tokens", "use_qalora": "QALoRA"}


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter as read from disk and checked against a base model: per module name, (A, B, scale)."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    nbytes: int


def read_adapter(path: Path, model: Any, device: torch.device) -> AdapterWeights:
    """Read the adapter in ``path`` for ``model``; an ``EngineError`` naming the path when it is not a plain LoRA
    adapter whose tensors fit the model's linear layers."""
    from safetensors.torch import load_file

    try:
        config = json.loads((path / lora.CONFIG).read_text())
        tensors = load_file(path / lora.WEIGHTS, device="cpu")
    except Exception as e:  # safetensors' own error for a cut-off file is no OSError: one line, no traceback
        raise EngineError(f"{path}: not a readable LoRA adapter: {type(e).__name__}: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise EngineError(f"{path / lora.CONFIG}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    refused = [what for key, what in _REFUSED.items() if config.get(key) not in (None, False, {}, [])]
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config['bias']!r}")
    if refused:
        raise EngineError(f"{path}: the engine serves plain LoRA on linear layers, not {', '.join(refused)}")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise EngineError(f"{path / lora.WEIGHTS}: unexpected tensor {key!r} (only lora_A / lora_B weights)")
        parts.setdefault(m["module"], {})[m["part"]] = t
    alpha = float(config.get("lora_alpha", 8))
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, ab in sorted(parts.items()):
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None
        if not isinstance(layer, torch.nn.Linear):
            raise EngineError(f"{path}: the adapter targets {name!r}, which is not a linear layer of the base model")
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] \
                or a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise EngineError(f"{path}: the adapter's tensors for {name!r} do not fit the base model's layer "
                              f"({layer.in_features} -> {layer.out_features})")
        rank = a.shape[0]
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[name] = (a.to(device), b.to(device), scale)
    if not modules:
        raise EngineError(f"{path / lora.WEIGHTS}: the adapter holds no tensors")
    nbytes = sum(t.numel() * t.element_size() for a, b, _ in modules.values() for t in (a, b))
    return AdapterWeights(modules, nbytes)


class _Layer:
    """The adapters of one linear layer, applied by a forward hook to the rows that name them."""

    def __init__(self, owner: Adapters, module: torch.nn.Linear) -> None:
        self.owner = owner
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.handle = module.register_forward_hook(self)

    def __call__(self, module: Any, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        x = args[0]
        for name, rows in self.owner.groups:
            w = self.adapters.get(name)
            if w is None:  # this adapter does not target this layer
                continue
            a, b, scale = w
            xs = x if rows is None else x[rows]
            delta = (F.linear(F.linear(xs.to(a.dtype), a), b) * scale).to(out.dtype)
            out = out + delta if rows is None else out.index_add(0, rows, delta)
        return out


class Adapters:
    """The LoRA adapters attached to one base model. Every method but ``__len__`` runs in the generation thread."""

    def __init__(self) -> None:
        self._layers: dict[str, _Layer] = {}
        self._names: set[str] = set()
        self.groups: list[tuple[str, torch.Tensor | None]] = []  # (adapter, its rows or None for all) this forward

    def __len__(self) -> int:
        return len(self._names)

    def attach(self, model: Any, name: str, weights: AdapterWeights) -> None:
        for module, w in weights.modules.items():
            layer = self._layers.get(module)
            if layer is None:
                layer = self._layers[module] = _Layer(self, model.get_submodule(module))
            layer.adapters[name] = w
        self._names.add(name)

    def detach(self, name: str) -> None:
        self._names.discard(name)
        for module, layer in list(self._layers.items()):
            layer.adapters.pop(name, None)
            if not layer.adapters:
                layer.handle.remove()
                del self._layers[module]

    @contextlib.contextmanager
    def select(self, rows: Sequence[str | None], device: torch.device) -> Iterator[None]:
        """Run the forward inside with row ``i`` on adapter ``rows[i]`` (None: the base weights)."""
        names = {r for r in rows if r is not None}
        if not names:
            yield
            return
        if len(names) == 1 and None not in rows:
            self.groups = [(next(iter(names)), None)]
        else:
            self.groups = [(n, torch.tensor([i for i, r in enumerate(rows) if r == n], device=device))
                           for n in sorted(names)]
        try:
            yield
        finally:
            self.groups = []
