"""The names of a release chain and the types a release is read back as.

- A scenario's chain is the ref ``refs/reef/scenarios/<name>``; a release is a commit whose root tree is the
  artifact's files plus ``reef-artifact.json`` (the manifest: kind, recipe, scenario, step, operation, metrics,
  parent, receipts, source, settings, created_at, content_id, lfs). The message is a summary line and the trailers
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

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from daemon.errors import BadRequest

MANIFEST = "reef-artifact.json"
REJECTION = "reef-rejection.json"
KINDS = ("weights", "harness")
OPERATIONS = ("init", "train", "rollback", "promote")
SCENARIOS_REF = "refs/reef/scenarios/"
PENDING_REF = "refs/reef/pending/"
PROMOTED_REF = "refs/reef/promoted/"
REJECTED_REF = "refs/reef/rejected/"

FileSource = bytes | bytearray | memoryview | str | os.PathLike[str]


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


