"""Learning recipes. A scenario's recipe is named by a built-in name or ``module:Class``."""

from __future__ import annotations

import re

from daemon.errors import BadRequest

BUILTIN: dict[str, str] = {
    "record": "recipes.record:RecordOnly",
    "online-rl": "recipes.online_rl",
    "lessons": "recipes.lessons",
}

# what each built-in recipe's releases hold; ``record`` follows its model (weights locally, else a harness)
KINDS: dict[str, str] = {"online-rl": "weights", "lessons": "harness"}

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def check_recipe_name(name: object) -> str:
    """Validate a recipe name: a built-in one or ``module:Class``."""
    if not isinstance(name, str) or not (name in BUILTIN or _IMPORT_PATH.match(name)):
        raise BadRequest(
            f"unknown recipe {name!r}; built-in recipes: {', '.join(sorted(BUILTIN))}, or give module:Class",
            param="recipe",
        )
    return name


def recipe_kind(name: str) -> str | None:
    """``weights`` or ``harness`` for recipes that make one kind of release; None when the model decides."""
    if name in KINDS:
        return KINDS[name]
    if name in BUILTIN:
        return None
    import importlib

    module, _, cls = name.partition(":")
    try:
        return getattr(getattr(importlib.import_module(module), cls), "kind", None)
    except (ImportError, AttributeError):
        return None
