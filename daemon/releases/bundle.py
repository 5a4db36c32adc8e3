"""Bundle releases: one release holding a LoRA adapter, a harness and the evidence for both.

A bundle's tree is an adapter release's (``daemon/lora.py``: peft's two files and ``reef-adapter.json`` at the
root, where every engine and the chains view already look for them) plus

    harness/<path>   the harness files, in the neutral layout (``daemon/layout.py``: AGENTS.md, skills/ ...)
    evidence.json    what justified each part: the weights release and the harness release it was made from,
                     their chains, steps and gate figures (each release's manifest metrics)

so the model a scenario serves and the rules its wrapped agents run with move together: a rollback to a bundle
moves both, a rollback past it removes both, and ``reef releases show --diff`` lists the adapter tensors and the
harness lines that changed. A bundle is published by ``reef releases bundle`` (``Chains.bundle``) on a scenario
that does not train (recipe ``record``), from a weights release and a harness release that each passed their own
chain's gate; a learning scenario's next step would publish weights alone and drop the harness.

Checked before anything is written (``check``): the adapter layout, the harness paths and the harness policy
(what no automatic path may grant an agent), and the evidence as a JSON object naming both parts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from daemon import lora
from daemon.errors import BadRequest
from daemon.releases.manifest import FileSource

HARNESS = "harness/"
EVIDENCE = "evidence.json"
T = TypeVar("T")


def harness_part(kind: str, files: Mapping[str, T]) -> dict[str, T]:
    """The harness files of a release's ``files`` (path -> anything) as a harness tree's paths: all of a harness
    release, the ``harness/`` folder of a bundle, none of a weights release."""
    if kind == "harness":
        return dict(files)
    if kind == "bundle":
        return {p[len(HARNESS):]: v for p, v in files.items() if p.startswith(HARNESS)}
    return {}


def read_bytes(src: object) -> bytes:
    """The bytes of one of a publish's file sources (bytes, text or a path)."""
    if isinstance(src, (os.PathLike, Path)):
        return Path(src).read_bytes()
    if isinstance(src, str):
        return src.encode()
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src)
    raise BadRequest(f"a release file must be bytes, text or a path, not {type(src).__name__}", param="files")


def check(files: Mapping[str, FileSource]) -> dict[str, FileSource]:
    """A bundle's files are an adapter, a harness and the evidence, nothing else; a ``BadRequest`` naming what is
    wrong otherwise. Returns the adapter's files (what the store checks against the scenario's base)."""
    from daemon import harness_policy
    from daemon.layout import check_tree

    if EVIDENCE not in files:
        raise BadRequest(f"a bundle holds {EVIDENCE}: the evidence for its weights and its harness", param="files")
    try:
        evidence = json.loads(read_bytes(files[EVIDENCE]))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"a bundle's {EVIDENCE} is not JSON: {e}", param="files") from None
    if not isinstance(evidence, dict) or not all(isinstance(evidence.get(k), dict) for k in ("weights", "harness")):
        raise BadRequest(f"a bundle's {EVIDENCE} is an object with the evidence for \"weights\" and for \"harness\"",
                         param="files")
    adapter = {p: v for p, v in files.items() if p != EVIDENCE and not p.startswith(HARNESS)}
    if lora.MANIFEST not in adapter:
        raise BadRequest(f"a bundle holds a LoRA adapter on its base ({lora.MANIFEST} naming the base); this one has "
                         f"none", param="files")
    lora.check_layout(adapter)
    tree = {p: read_bytes(v) for p, v in harness_part("bundle", files).items()}
    if not tree:
        raise BadRequest(f"a bundle holds a harness under {HARNESS}; this one has none", param="files")
    check_tree(tree)
    bad = harness_policy.refused(harness_policy.findings(tree, allow_executable=True))
    if bad:  # what no path may hand an agent (what a person may admit is for Chains.bundle to refuse or not)
        raise BadRequest(f"a bundle's harness is refused by the harness policy: {bad[0]}"
                         + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""), param="files")
    return adapter


def evidence(weights: Any, harness: Any) -> dict[str, Any]:
    """``evidence.json``: for each part, the release it was taken from, its chain and step, and the figures its own
    gate recorded (the release's manifest metrics: the held-out check's, the canary's, the evaluation's)."""
    def part(rel: Any) -> dict[str, Any]:
        return {"release_id": rel.release_id, "scenario": rel.scenario, "step": rel.step, "recipe": rel.recipe,
                "operation": rel.operation, "created_at": rel.created_at, "metrics": dict(rel.metrics)}

    return {"weights": part(weights), "harness": part(harness)}


def files(adapter: Mapping[str, Any], harness_tree: Mapping[str, bytes], proof: Mapping[str, Any]) -> dict[str, Any]:
    """A bundle's files: the adapter's (as its release's checkout gives them: paths, so its large file is not read
    into memory), the harness under ``harness/`` and the evidence."""
    out: dict[str, Any] = dict(adapter)
    out.update({HARNESS + path: data for path, data in harness_tree.items()})
    out[EVIDENCE] = (json.dumps(proof, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
    return out
