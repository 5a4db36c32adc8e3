"""Model directories moved through Ray's object store (``daemon/trainer/ray_trainer.py``'s actor and
``daemon/trainer/ray_parallel.py``'s workers both read and write them): a directory read to a dict of files, written
back all or nothing, and a per-node scratch directory for the copies."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from daemon import durable


def _read_dir(path: str) -> dict[str, bytes]:
    base = Path(path)
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


def _write_dir(files: dict[str, bytes], dest: Path) -> None:
    """``files`` under ``dest``, all or nothing: written in a temp directory beside it, synced, renamed."""
    with durable.staged_dir(dest) as tmp:
        for rel, data in files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        durable.publish_dir(tmp, dest)


def _node_dir() -> Path:
    """A directory for this worker's (or actor's) copies of the model directories: under its node's Ray session directory when
    there is one (removed with the node's temp dir even if the worker is killed), else the system temp dir."""
    base = None
    with contextlib.suppress(Exception):
        import ray

        node = ray._private.worker.global_worker.node  # no public API names its session directory
        base = node.get_session_dir_path() if node is not None else None
    return Path(tempfile.mkdtemp(prefix="reef-ray-", dir=base))


def _safe(key: str) -> str:
    return key.replace(":", "_").replace("/", "_")
