"""Learning recipes. A scenario's recipe is named by a built-in name or ``module:Class``."""

from __future__ import annotations

import re

from daemon.errors import BadRequest

BUILTIN: dict[str, str] = {
    "record": "recipes.record:RecordOnly",
    "online-rl": "recipes.online_rl",
}

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def check_recipe_name(name: object) -> str:
    """Validate a recipe name: a built-in one or ``module:Class``."""
    if not isinstance(name, str) or not (name in BUILTIN or _IMPORT_PATH.match(name)):
        raise BadRequest(
            f"unknown recipe {name!r}; built-in recipes: {', '.join(sorted(BUILTIN))}, or give module:Class",
            param="recipe",
        )
    return name
