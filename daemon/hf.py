"""Small helpers around Hugging Face libraries shared by the model builder and the embedded engine."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

# Every load through transformers (``from_pretrained``, a GGUF conversion, the lazy ``from transformers import``
# itself) holds this lock: loading patches process-global state (the default device and dtype, empty-weight
# initialisation, its lazy module table), so two loads in two threads at once left the process unable to load
# anything again ("Cannot copy out of meta tensor", "cannot import name AutoModelForCausalLM") until a restart.
# Building a model from a config (the tiny models) holds it too: a load in another thread patches torch's weight
# initialisers off meanwhile, and the lazy import of a name half done in one thread is an ImportError in another.
# Reentrant: a load may build or save under it.
LOAD_LOCK = threading.RLock()


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """No transformers tqdm bars on stderr (saving, loading weights): Reef reports progress itself."""
    with LOAD_LOCK:
        from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: unannotated
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: unannotated
