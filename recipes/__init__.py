"""Learning recipes. A scenario's recipe is named by a built-in name or ``module:Class``; ``load_recipe`` turns
the name into the class (``recipes/base.py`` is the interface every recipe implements)."""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.errors import RecipeError

if TYPE_CHECKING:
    from recipes.base import Recipe

BUILTIN: dict[str, str] = {
    "record": "recipes.record:RecordOnly",
    "online-rl": "recipes.online_rl:OnlineRL",
    "lessons": "recipes.lessons:Lessons",
    "openclaw-rl": "recipes.openclaw_rl:OpenClawRL",
    "sao": "recipes.sao:SAO",
    "ttt-discover": "recipes.ttt_discover:TTTDiscover",
    "harness-search": "recipes.harness_search:HarnessSearch",
}

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_loaded: dict[str, type[Recipe]] = {}


def check_recipe_name(name: object) -> str:
    """Validate a recipe name's form: a built-in one or ``module:Class`` (``load_recipe`` checks the rest)."""
    if not isinstance(name, str) or not (name in BUILTIN or _IMPORT_PATH.fullmatch(name)):
        raise RecipeError(
            f"unknown recipe {name!r}; built-in recipes: {', '.join(sorted(BUILTIN))}, or give module:Class",
            recipe=str(name),
        )
    return name


def add_recipe_paths(paths: Iterable[str | Path]) -> None:
    """Put configured recipe directories on the import path (first, so they win over installed modules)."""
    for p in paths:
        p = str(Path(p).expanduser())
        if p not in sys.path:
            sys.path.insert(0, p)


def check_api_recipe(name: object, *, paths: Iterable[str | Path] = (), allowed: Iterable[str] = ()) -> str:
    """A recipe name the HTTP API may bind, checked before anything is imported: a built-in one, one the config
    names (``allowed``: its ``allowed_recipes``, ``default_recipe``, ``harness_recipe``), or a ``module:Class``
    whose top-level module lies in a configured recipe directory (``paths``). Importing a module runs its code,
    so a name from a request never imports an arbitrary installed module (``this:X`` printed the Zen of Python
    into the log); the config file, which only the user writes, may name any module."""
    name = check_recipe_name(name)
    if name in BUILTIN or name in set(allowed):
        return name
    top = name.partition(":")[0].split(".")[0]
    for p in paths:
        d = Path(p).expanduser()
        if (d / f"{top}.py").is_file() or (d / top / "__init__.py").is_file():
            return name
    raise RecipeError(
        f"recipe {name}: the API binds built-in recipes, and module:Class recipes whose module is in a configured "
        f"recipe directory (recipe_paths) or named in allowed_recipes in config.toml; {top!r} is in neither",
        recipe=name)


def load_recipe(name: str, paths: Iterable[str | Path] = ()) -> type[Recipe]:
    """The recipe class a name binds to; a ``RecipeError`` that says what is wrong when it cannot be used."""
    check_recipe_name(name)  # before the cache: a name that is not even a string (``{}``) is a 400, not a TypeError
    got = _loaded.get(name)
    if got is not None:
        return got
    try:
        cls = _load(name, paths)
    except RecipeError as e:  # the user sees it at once; the daemon's log says it too
        logging.getLogger("reef.recipes").warning("%s", e.message)
        raise
    _loaded[name] = cls
    return cls


def _load(name: str, paths: Iterable[str | Path]) -> type[Recipe]:
    from recipes.base import Recipe

    check_recipe_name(name)
    add_recipe_paths(paths)
    module_name, _, cls_name = BUILTIN.get(name, name).partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a syntax error or a failing import inside the recipe's module counts too
        raise RecipeError(f"recipe {name}: cannot import module {module_name}: {type(e).__name__}: {e}",
                          recipe=name) from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise RecipeError(f"recipe {name}: module {module_name} has no {cls_name}", recipe=name)
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise RecipeError(f"recipe {name}: {cls_name} does not implement the recipe interface "
                          "(subclass recipes.base.Recipe)", recipe=name)
    try:
        cls.check_class()
    except TypeError as e:
        raise RecipeError(f"recipe {name}: {cls_name} does not implement the recipe interface: {e}",
                          recipe=name) from None
    return cls


def report_schemas() -> bool:
    """Whether any recipe loaded so far declares a report schema (the report path skips the check otherwise)."""
    return any(cls.Report is not None for cls in _loaded.values())
