"""The demo model (``tiny-demo``: the tiny model warmed up on the ``say`` family) built once per test session, and
daemons that serve it, for the tests that show a recipe learning (``test_sao.py``, ``test_ttt_discover.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built as ``reef model init tiny-demo`` builds it (seed 0; deterministic, 15-60 s on a busy 2-core machine)."""
    from recipes.warmup import init_built_in

    return init_built_in(tmp_path_factory.mktemp("models") / "tiny-demo", "tiny-demo", seed=0)


def demo_config(path: Path, recipe: str, **settings: Any) -> str:
    """Config lines that serve ``tiny-demo`` from ``path`` and set ``recipe``'s settings."""
    lines = f'\n[models.tiny-demo]\nengine = "transformers"\npath = "{path}"\n\n[recipes.{recipe}]\n'
    return lines + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
