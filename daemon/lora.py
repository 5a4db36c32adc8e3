"""LoRA adapter releases: what a weights release holds when it is an adapter on a base model.

An adapter release's artifact is peft's own two files plus Reef's manifest, and nothing else:

    adapter_config.json        peft's LoraConfig (``base_model_name_or_path`` is ``reef:<base content id>``)
    adapter_model.safetensors  the adapter tensors (a few MB: Git LFS when over 1 MiB)
    reef-adapter.json          {"format": "peft-lora", "base_content_id": ..., "base_release_id": ...}

and, optionally, the trainer's own state that a recipe resumes from (``STATE_FILES``: sao's critic,
``value_head.pt``, a few kB). Engines never read it; it is content like the rest, so the same adapter with another
critic is another release (the next step from it would differ).

The base model's files are stored once, in the release that holds them (a scenario's ``init``), never again per
step. ``base_content_id`` is the identity of the base (the content id of the release holding its files: equal
files, equal id); ``base_release_id`` is where to find those files. The manifest is part of the content, so the
same adapter tensors on another base are other content.

Who checks what: the release store refuses to publish an adapter whose base is not the model its scenario
serves (``BaseMismatch``, nothing published); the chains view resolves an adapter release to its base release
for the engine; the engine refuses to attach an adapter whose manifest names another base than the resident
one it was given, or whose tensors do not fit that base. No torch here: the store and the CLI import this.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from daemon.errors import BadRequest

MANIFEST = "reef-adapter.json"
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
FILES = (CONFIG, WEIGHTS, MANIFEST)
# trainer state an adapter release may carry beside the adapter (recipes/sao.py's critic); no engine reads it
STATE_FILES = ("value_head.pt",)
FORMAT = "peft-lora"
_ID_CHARS = set("0123456789abcdef")


def _is_id(value: object) -> bool:
    return isinstance(value, str) and len(value) == 40 and set(value) <= _ID_CHARS


@dataclass(frozen=True)
class AdapterManifest:
    """The base an adapter applies to: its content id (identity) and a release that holds its files."""

    base_content_id: str
    base_release_id: str

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "base_content_id": self.base_content_id, "base_release_id": self.base_release_id}
        return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()

    def to_dict(self) -> dict[str, str]:
        return {"base_content_id": self.base_content_id, "base_release_id": self.base_release_id}

    @classmethod
    def parse(cls, data: bytes, where: str = MANIFEST) -> AdapterManifest:
        """The manifest from its bytes; a ``BadRequest`` saying what is wrong and where."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"{where}: not JSON: {e}", param="files") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise BadRequest(f"{where}: expected an object with \"format\": \"{FORMAT}\"", param="files")
        for key in ("base_content_id", "base_release_id"):
            if not _is_id(body.get(key)):
                raise BadRequest(f"{where}: {key} must be a full id (40 hex digits), got {body.get(key)!r}",
                                 param="files")
        return cls(body["base_content_id"], body["base_release_id"])


def read_dir(path: str | os.PathLike[str]) -> AdapterManifest | None:
    """The manifest of a directory holding an adapter, or None when it holds a whole model."""
    p = Path(path) / MANIFEST
    return AdapterManifest.parse(p.read_bytes(), str(p)) if p.is_file() else None


def write_dir(path: str | os.PathLike[str], manifest: AdapterManifest) -> None:
    """Write the manifest into a candidate directory beside peft's files (the trainer fsyncs the directory)."""
    (Path(path) / MANIFEST).write_bytes(manifest.to_bytes())


def check_layout(paths: Iterable[str]) -> None:
    """An adapter release holds peft's two files and the manifest, and at most the trainer's state
    (``STATE_FILES``), nothing more (no copy of any base file)."""
    have = set(paths)
    missing = [f for f in FILES if f not in have]
    extra = sorted(have - set(FILES) - set(STATE_FILES))
    if missing or extra:
        raise BadRequest(
            f"an adapter release holds exactly {', '.join(FILES)} (and optionally {', '.join(STATE_FILES)})"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unexpected {', '.join(extra[:5])}" if extra else ""),
            param="files",
        )
