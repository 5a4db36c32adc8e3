"""Small helpers around Hugging Face libraries shared by the model builder and the embedded engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """No transformers tqdm bars on stderr (saving, loading weights): Reef reports progress itself."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
