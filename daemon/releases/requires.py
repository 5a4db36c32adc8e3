"""What a release needs to run (``requires`` in its manifest), and whether this machine has it.

An item is a string ``KIND:NAME`` or ``KIND:NAME>=VERSION``:

    agent:NAME[>=V]    a coding agent Reef installed (``reef agents install``: pi, claude, opencode, codex), at least V
    env:NAME           an environment variable set, not empty, in the daemon's environment (its value is never shown)
    tool:NAME          an executable named NAME on the daemon's PATH
    provider:NAME      a model the daemon has configured under that name (``[models.NAME]``, or ``--provider NAME``)
    model:NAME         a configured local model whose files are on this machine (its directory holds config.json):
                       what a weights release trained on it needs, where ``provider`` is met by any configured model
    engine:NAME[>=V]   an engine of this Reef (transformers, upstream, vllm, sglang); with V, its Python package in
                       the daemon's environment at least V

Design choices:

- Items are parsed when a ``Manifest`` is made (``parse_all``), so an unknown kind, a malformed version or a kind
  that takes none is a ``BadRequest`` naming the item before anything is written; the manifest keeps the canonical
  spelling (``agent:claude>=2.0``). A release read back is never re-parsed strictly: an item this Reef cannot read
  (a newer Reef's kind, a chain remote's) is checked as not met, so such a release is refused rather than loaded.
- Versions compare as tuples of their leading numbers (``2.1.197`` >= ``2.0``; ``5.0.0rc1`` reads as ``5.0.0``);
  only a minimum is expressed, as a release needs "at least" what it was made with.
- ``Machine`` is what the daemon has, gathered from the one ``Config`` (environment variable names and PATH as they
  were at start, the configured models, Reef's agents directory): the checks read the file system (PATH, the agents'
  ``package.json``) at the time of the check, so a tool installed later counts at once; an engine's package version
  is read once per process (what the daemon runs until it restarts). A check of a few items costs 0.05-0.2 ms here.
- ``offer`` picks, for a refusal, the newest release of a chain whose needs are all met: what the message names.
"""

from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from daemon.errors import BadRequest

if TYPE_CHECKING:
    from daemon.config import Config

# kind -> whether it takes a minimum version
KINDS: Mapping[str, bool] = {"agent": True, "env": False, "tool": False, "provider": False, "engine": True,
                             "model": False}
_ITEM = re.compile(r"(?P<kind>[a-z]+):(?P<name>[A-Za-z0-9_.+-]{1,100})(?:>=(?P<version>\d+(?:\.\d+){0,5}))?")
_LEADING = re.compile(r"\d+(?:\.\d+)*")


class Needing(Protocol):
    """What ``offer`` and ``refusal`` read of a release (``manifest.Release`` is one; named here, not imported, as
    the manifest imports this module)."""

    @property
    def release_id(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def requires(self) -> Sequence[str]: ...


R = TypeVar("R", bound=Needing)


def _version(text: str) -> tuple[int, ...] | None:
    m = _LEADING.match(text.strip().lstrip("v"))
    return tuple(int(p) for p in m.group(0).split(".")) if m else None


@dataclass(frozen=True)
class Requirement:
    """One parsed item: its kind, name and minimum version (None: any)."""

    kind: str
    name: str
    version: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" + (f">={self.version}" if self.version else "")

    @classmethod
    def parse(cls, item: object, param: str = "requires") -> Requirement:
        """``item`` as a ``Requirement``; ``BadRequest`` naming it (and ``param``) when it is not one."""
        if not isinstance(item, str):
            raise BadRequest(f"a requires item is a string like 'tool:git', not {item!r}", param=param)
        m = _ITEM.fullmatch(item.strip())
        if m is None:
            kind = item.split(":", 1)[0] if ":" in item else ""
            if kind and kind not in KINDS:
                raise BadRequest(_unknown(item, kind), param=param, item=item)
            raise BadRequest(f"requires item {item!r} is not KIND:NAME or KIND:NAME>=VERSION (kinds: "
                             f"{', '.join(KINDS)})", param=param, item=item)
        kind, name, version = m.group("kind"), m.group("name"), m.group("version")
        if kind not in KINDS:
            raise BadRequest(_unknown(item, kind), param=param, item=item)
        if version is not None and not KINDS[kind]:
            raise BadRequest(f"requires item {item!r}: a {kind} takes no version (only agent and engine do)",
                             param=param, item=item)
        return cls(kind, name, version)


def _unknown(item: str, kind: str) -> str:
    return f"requires item {item!r} is of unknown kind {kind!r}; kinds: {', '.join(KINDS)}"


def parse_all(items: object, param: str = "requires") -> tuple[str, ...]:
    """A list of items (``None``: none) as their canonical strings, each checked; ``BadRequest`` naming the first
    bad one. The same item twice is kept once."""
    if items is None:
        return ()
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise BadRequest(f"requires must be a list of items like 'tool:git', not {items!r}", param=param)
    out: dict[str, None] = {}
    for item in items:
        out[str(Requirement.parse(item, param))] = None
    return tuple(out)


@dataclass(frozen=True)
class Check:
    """One item checked on this machine: met or not, and what was found (never an environment variable's value)."""

    item: str
    kind: str
    met: bool
    found: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Machine:
    """What the daemon has, as the checks see it."""

    env_names: frozenset[str]  # the environment variables set and not empty
    search_path: str | None  # PATH (None: the process's own, as shutil.which reads it)
    models: Mapping[str, str]  # configured model name -> its engine
    agents_dir: Path  # where ``reef agents install`` puts the agents
    package_version: Callable[[str], str | None]  # an installed Python package's version, or None
    model_paths: Mapping[str, Path | None] = field(default_factory=dict)  # a configured model's directory (local)

    @classmethod
    def of(cls, config: Config) -> Machine:
        return cls(env_names=frozenset(config.env_names), search_path=config.search_path,
                   models={name: e.engine for name, e in config.models.items()}, agents_dir=config.agents_path,
                   package_version=_package_version,
                   model_paths={name: e.path for name, e in config.models.items()})


@functools.lru_cache(maxsize=64)
def _package_version(name: str) -> str | None:
    """Read once per process (3 ms a read here): an engine's package upgraded under a running daemon is not what
    it runs until it restarts."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _at_least(found: str | None, wanted: str | None) -> bool:
    if wanted is None:
        return True
    have, need = _version(found or ""), _version(wanted)
    return have is not None and need is not None and have >= need


def check(item: str, machine: Machine) -> Check:
    """``item`` on ``machine``. An item that does not parse (a newer Reef's kind) is not met."""
    try:
        req = Requirement.parse(item)
    except BadRequest as e:
        return Check(str(item), str(item).split(":", 1)[0], False, f"not understood by this Reef: {e.message}")
    kind, name, version = req.kind, req.name, req.version
    if kind == "env":
        met = name in machine.env_names
        return Check(item, kind, met, "set" if met else "not set in the daemon's environment")
    if kind == "tool":
        path = shutil.which(name, path=machine.search_path)
        return Check(item, kind, path is not None, path or "not found on the daemon's PATH")
    if kind == "provider":
        engine = machine.models.get(name)
        if engine is None:
            return Check(item, kind, False, f"no model named {name!r} is configured (configured: "
                                            f"{', '.join(sorted(machine.models)) or 'none'})")
        return Check(item, kind, True, f"model {name} (engine {engine})")
    if kind == "model":
        files = machine.model_paths.get(name)
        if name not in machine.models:
            return Check(item, kind, False, f"no model named {name!r} is configured (configured: "
                                            f"{', '.join(sorted(machine.models)) or 'none'})")
        if files is None:
            return Check(item, kind, False, f"model {name} is served by engine {machine.models[name]}: no local files")
        met = (files / "config.json").is_file()
        return Check(item, kind, met, f"model {name} at {files}" if met else f"model {name}: no model files at "
                     f"{files} (reef model init {name}, where it is a built-in one)")
    if kind == "agent":
        from adapters import ADAPTERS

        adapter = ADAPTERS.get(name)
        if adapter is None:
            return Check(item, kind, False, f"no agent named {name!r} (agents: {', '.join(ADAPTERS)})")
        installed = adapter.installed_version(machine.agents_dir)
        if installed is None:
            return Check(item, kind, False, f"{name} is not installed (reef agents install {name})")
        return Check(item, kind, _at_least(installed, version), f"{name} {installed}")
    # engine
    from daemon.engines.registry import engine_names

    if name not in engine_names():
        return Check(item, kind, False, f"this Reef has no engine {name!r} (engines: {', '.join(engine_names())})")
    if version is None:
        return Check(item, kind, True, f"engine {name}")
    found = machine.package_version(name)
    if found is None:
        return Check(item, kind, False, f"the Python package {name} is not installed in the daemon's environment")
    return Check(item, kind, _at_least(found, version), f"{name} {found}")


def check_all(items: Iterable[str], machine: Machine) -> list[Check]:
    return [check(item, machine) for item in items]


def first_unmet(items: Iterable[str], machine: Machine) -> Check | None:
    """The first item not met on ``machine``, or None when all are."""
    return next((c for c in (check(i, machine) for i in items) if not c.met), None)


def offer(chain: Iterable[R], machine: Machine) -> R | None:
    """The newest release of ``chain`` (newest first) whose needs are all met on ``machine``."""
    return next((r for r in chain if first_unmet(r.requires, machine) is None), None)


def refusal(what: str, scenario: str, unmet: Check, offered: Needing | None, head: str | None = None) -> str:
    """The message of a refusal to ``what`` (``loading release ...``, ``rolling back to release ...``): the item,
    what was found, and the release of ``scenario`` offered instead (``head``: its head here, which serves on)."""
    said = f"{what} is refused: it requires {unmet.item} ({unmet.found})"
    if offered is None:
        return f"{said}; no release of {scenario!r} has all its needs met here"
    newest = f"the newest release that needs nothing more is {offered.release_id[:12]} (step {offered.step})"
    if offered.release_id == head:
        return f"{said}; {newest}, the head, which serves on"
    return f"{said}; {newest}: reef releases rollback {offered.release_id[:12]} -s {scenario}"
