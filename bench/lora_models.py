"""Models and adapters the LoRA benchmarks build locally (nothing can be downloaded where they run).

``smollm2_shaped(dest)``: a model of SmolLM2-135M's architecture (30 layers, width 576, 9 heads with 3 KV heads,
MLP 1536, 49152-token vocabulary, tied embeddings, 8192-token context) with random weights and the tiny model's
tokenizer, saved in bf16 (270 MB). ``random_adapter``: a LoRA adapter on a model directory, saved the way the
trainer saves one (``recipes/online_rl.py``). ``adapter_variant``: a copy of an adapter with its tensors
perturbed (new content, the same shapes) in milliseconds, for benchmarks that publish many adapters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def smollm2_shaped(dest: Path, seed: int = 0) -> Path:
    """Build (once) a random-weight model of SmolLM2-135M's shape at ``dest``; returns ``dest``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from daemon.models import init_tiny, is_complete

    if is_complete(dest):
        return dest
    tok_dir = init_tiny(dest.parent / f".{dest.name}-tokenizer", seed=seed)
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ids = {k: v for k, v in json.loads((tok_dir / "config.json").read_text()).items()
           if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(**SMOLLM2_135M, **ids, dtype="bfloat16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copyfile(f, tmp / f.name)
    tmp.rename(dest)
    return dest


def random_adapter(base_dir: Path, dest: Path, manifest: Any, *, seed: int = 0, rank: int = 8,
                   std: float = 0.02) -> Path:
    """A LoRA adapter (``rank``, the trainer's target modules) on the model in ``base_dir`` with random weights."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from recipes.online_rl import OnlineRLSettings, save_adapter, wrap_lora

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = wrap_lora(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                          OnlineRLSettings(lora_rank=rank))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    dest.mkdir(parents=True)
    save_adapter(model, dest, manifest)
    return dest


def adapter_variant(src: Path, dest: Path, seed: int) -> Path:
    """``src``'s adapter with every tensor perturbed a little: another release's content, the same base."""
    import torch
    from safetensors.torch import load_file, save_file

    from daemon import lora

    shutil.copytree(src, dest)
    tensors = load_file(src / lora.WEIGHTS)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: v + 0.01 * v.std() * torch.randn(v.shape, generator=g) for k, v in sorted(tensors.items())}
    (dest / lora.WEIGHTS).unlink()
    save_file(tensors, dest / lora.WEIGHTS, metadata={"format": "pt"})
    return dest


def model_options(ap: Any) -> None:
    """The model options the LoRA benches share: ``--model DIR`` or ``--small`` (default: SmolLM2's shape, random)."""
    ap.add_argument("--model", type=Path, help="a local HF model directory (default: SmolLM2-135M's shape, random)")
    ap.add_argument("--small", action="store_true", help="the tiny model instead (a quick check of the mechanics)")


def chosen_model(args: Any, work: Path) -> Path:
    """The model ``model_options`` chose, built under ``work`` where it is not a given directory."""
    from daemon.models import init_tiny

    if args.model:
        model = args.model.resolve()
    elif args.small:
        model = init_tiny(work / "tiny")
    else:
        print("building a random model of SmolLM2-135M's shape ...", flush=True)
        model = smollm2_shaped(work / "smollm2-shaped")
    print(f"model: {model}")
    return model
