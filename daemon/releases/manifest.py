"""The names of a release chain and the types a release is read back as.

- A scenario's chain is the ref ``refs/reef/scenarios/<name>``; a release is a commit whose root tree is the
  artifact's files plus ``reef-artifact.json`` (the manifest: kind, recipe, scenario, step, operation, metrics,
  parent, receipts, source, settings, created_at, content_id, lfs; ``requires`` when the release needs anything,
  ``requires.py``). The message is a summary line and the trailers
  ``Reef-Scenario``, ``Reef-Step``, ``Reef-Operation``, ``Reef-Kind``, ``Reef-Content`` (and ``Reef-Source`` for
  rollback / promote), so ``git log`` reads as history. A chain is linear and starts with an ``init`` (step 0).
- ``release_id`` is the commit id. ``content_id`` is the id of the tree of the artifact files *without* the
  manifest: that tree is written to the object database as is (it is what the release tree is built from), and
  the release tree is that tree plus the manifest entry, so its entries are shared. The content tree itself
  is not referenced by any commit (``git fsck`` lists it as dangling, and ``git gc`` may prune it after its
  grace period); it is always recomputable from a release (its tree minus the manifest) and is recorded in
  the manifest.
- Pending candidates live on ``refs/reef/pending/<scenario>/<id>``, promoted ones on
  ``refs/reef/promoted/<scenario>/<id>``, rejected ones on ``refs/reef/rejected/<scenario>`` (``reef-rejection.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from daemon.errors import BadRequest
from daemon.names import check_scenario  # the one validator of scenario names
from daemon.releases import requires as _requires

MANIFEST = "reef-artifact.json"
REJECTION = "reef-rejection.json"
KINDS = ("weights", "harness", "bundle")  # a bundle: an adapter, a harness and their evidence (``bundle.py``)
SERVES_WEIGHTS = ("weights", "bundle")  # kinds an engine loads (``Release.serves_weights``)
CARRIES_HARNESS = ("harness", "bundle")  # kinds a wrapped run installs (``Release.carries_harness``)
OPERATIONS = ("init", "train", "rollback", "promote", "bundle")
SCENARIOS_REF = "refs/reef/scenarios/"
PENDING_REF = "refs/reef/pending/"
PROMOTED_REF = "refs/reef/promoted/"
REJECTED_REF = "refs/reef/rejected/"

FileSource = bytes | bytearray | memoryview | str | os.PathLike[str]


@dataclass(frozen=True)
class Manifest:
    """What a write says about the release it makes: every write of a release (publish, hold, rollback, promote)
    and of a rejection takes one. The store adds what it decides itself (``step``, ``parent``, ``created_at``,
    ``content_id``, ``lfs``) when it writes ``reef-artifact.json``; a ``Release`` is the two read back.

    Checked when it is made, so a ``Manifest`` that exists can be written: a valid scenario name, a known operation
    and kind, a source for a rollback or a promote, finite JSON metadata. Its mappings are read-only copies and its
    receipts a tuple: changing the caller's dict afterwards changes nothing. ``replace`` makes a changed copy,
    checked again."""

    scenario: str
    operation: str  # one of OPERATIONS
    kind: str  # one of KINDS
    recipe: str
    metrics: Mapping[str, Any] = field(default_factory=dict)
    receipts: tuple[str, ...] = ()  # the records that fed the release
    source: str | None = None  # the release whose content this one publishes (rollback, promote, init from a base)
    settings: Mapping[str, Any] = field(default_factory=dict)
    summary: str | None = None  # the commit message's summary (None: a default per operation)
    # where the candidate came from when not from the recipe's own step: an agent's proposal (daemon/proposals.py)
    # ``{"kind": "proposal", "id", "at", "op", "target", "reason", "run", "receipt"}``; None (the default) is not written
    origin: Mapping[str, Any] | None = None
    # what the release needs to run (``requires.py``: ``tool:git``, ``agent:claude>=2.0`` ...); an unknown kind is a
    # BadRequest here, before anything is written
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_scenario(self.scenario)
        if self.operation not in OPERATIONS:
            raise BadRequest(f"unknown operation {self.operation!r}: one of {', '.join(OPERATIONS)}", param="operation")
        if self.kind not in KINDS:
            raise BadRequest(f"unknown artifact kind {self.kind!r}: one of {', '.join(KINDS)}", param="kind")
        if self.operation in ("rollback", "promote") and self.source is None:
            raise BadRequest(f"a {self.operation} release names its source", param="source")
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics or {})))
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings or {})))
        object.__setattr__(self, "receipts", tuple(str(r) for r in (self.receipts or ())))
        object.__setattr__(self, "requires", _requires.parse_all(list(self.requires or ())))
        if self.origin is not None:
            object.__setattr__(self, "origin", MappingProxyType(dict(self.origin)))
        # finite JSON, or BadRequest now
        _json({"metrics": dict(self.metrics), "settings": dict(self.settings), "origin": dict(self.origin or {})})

    @classmethod
    def of(cls, manifest: Manifest | str, fields: Mapping[str, Any]) -> Manifest:
        """``manifest`` itself, or a ``Manifest`` of the scenario named ``manifest`` with ``fields``: for the store's
        keyword spelling (``publish("demo", files, expected_head=..., operation=..., kind=..., recipe=...)``)."""
        if isinstance(manifest, Manifest):
            if fields:
                raise TypeError(f"a Manifest is given; {', '.join(sorted(fields))} belong in it")
            return manifest
        return cls(manifest, **fields)

    def replace(self, **changes: Any) -> Manifest:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Release:
    release_id: str
    content_id: str
    scenario: str
    step: int
    operation: str
    kind: str
    recipe: str
    parent: str | None
    source: str | None
    metrics: dict[str, Any]
    receipts: list[str]
    settings: dict[str, Any]
    created_at: float
    message: str
    lfs: dict[str, dict[str, Any]] = field(default_factory=dict)
    origin: dict[str, Any] | None = None  # an agent's proposal that made it (``Manifest.origin``)
    requires: list[str] = field(default_factory=list)  # what it needs to run (``Manifest.requires``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def serves_weights(self) -> bool:
        """What an engine loads: whole weights, or an adapter (a weights release's or a bundle's)."""
        return self.kind in SERVES_WEIGHTS

    @property
    def carries_harness(self) -> bool:
        """What a wrapped agent's run installs: a harness release's files, or a bundle's ``harness/``."""
        return self.kind in CARRIES_HARNESS

    def manifest(self, **changes: Any) -> Manifest:
        """This release's ``Manifest`` (what was said when it was written), with ``changes``: what a rollback or a
        promote of it starts from."""
        return Manifest(scenario=self.scenario, operation=self.operation, kind=self.kind, recipe=self.recipe,
                        metrics=self.metrics, receipts=tuple(self.receipts), source=self.source,
                        settings=self.settings, origin=self.origin, requires=tuple(self.requires)).replace(**changes)


@dataclass(frozen=True)
class Rejection:
    rejection_id: str
    scenario: str
    step: int
    verdict: str
    reason: str
    metrics: dict[str, Any]
    base: str | None
    candidate: str | None
    content_id: str | None
    kind: str | None
    recipe: str | None
    receipts: list[str]
    created_at: float
    origin: dict[str, Any] | None = None  # an agent's proposal that made it (``Manifest.origin``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    mode: int
    blob_id: str
    lfs_oid: str | None  # sha256 hex when the bytes live in lfs/objects

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



def _json(value: Any) -> str:
    try:
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise BadRequest(f"release metadata must be finite JSON: {e}", param="metrics") from e


def _one_line(text: str, limit: int = 120) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


