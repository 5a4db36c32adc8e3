"""Config for daemons that serve the demo model (the ``tiny_demo_model`` fixture in ``conftest.py``), for the tests
that show a recipe learning (``test_sao.py``, ``test_ttt_discover.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def demo_config(path: Path, recipe: str, **settings: Any) -> str:
    """Config lines that serve ``tiny-demo`` from ``path`` and set ``recipe``'s settings (a weights recipe's: its
    candidates go straight to the head, as these tests are about learning, not the canary it has by default)."""
    settings = {"canary_share": 0, **settings}
    lines = f'\n[models.tiny-demo]\nengine = "transformers"\npath = "{path}"\n\n[recipes.{recipe}]\n'
    return lines + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
