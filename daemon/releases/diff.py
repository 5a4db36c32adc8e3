"""Diffs between releases: added, removed and changed paths; a unified diff per text file, per-tensor change
norms for safetensors files, sizes otherwise. An adapter release is diffed as what it serves (its base with the
adapter on top).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.errors import StorageError
from daemon.releases.manifest import MANIFEST, Release
from daemon.releases.reads import Reads
from daemon.releases.repo import Repository

_DIFF_TEXT_MAX = 4 << 20  # files above this are reported as binary (sizes), not diffed as text
_DIFF_OUT_MAX = 256 << 10  # per-file cap on a unified diff


class Diffs:
    """What changed between two releases."""

    def __init__(self, repo: Repository, reads: Reads) -> None:
        self.repo, self.reads = repo, reads

    def diff(self, release_id: str, base: str | None = None) -> dict[str, Any]:
        """What changed from ``base`` (default: the release's parent) to the release: added / removed / changed
        paths; per changed file a unified diff (text), per-tensor change norms (safetensors), or sizes."""
        release = self.reads.get(release_id)
        base_id = self.repo.resolve(base) if base is not None else release.parent
        new = self._file_map(release)
        old = self._file_map(self.reads.get(base_id)) if base_id else {}
        out: dict[str, Any] = {"release_id": release.release_id, "base": base_id, "added": [], "removed": [],
                               "changed": [], "files": []}  # fmt: skip
        for path in sorted(set(old) | set(new)):
            o, n = old.get(path), new.get(path)
            if o is not None and n is not None and o[:2] == n[:2]:
                continue
            status = "added" if o is None else "removed" if n is None else "changed"
            out[status].append(path)
            try:
                out["files"].append({"path": path, "status": status, **self._diff_file(path, o, n)})
            except StorageError:
                raise
            except Exception as e:  # a file we cannot interpret is reported, not fatal
                out["files"].append({"path": path, "status": status, "kind": "binary", "error": str(e)})
        return out

    def _file_map(self, release: Release) -> dict[str, tuple[str, int, dict[str, Any] | None]]:
        tree_id = self.repo.commit(release.release_id).tree_id
        files = {p: (b, m, release.lfs.get(p)) for p, b, m in self.repo.walk(tree_id) if p != MANIFEST}
        adapter = self.reads.adapter(release.release_id)
        if adapter is None:
            return files
        # what an adapter release serves is its base with the adapter on top: diffed as such, an adapter against
        # its base adds the adapter's files, two adapters differ in their tensors, a rollback to the base removes them
        return {**self._file_map(self.reads.get(adapter.base_release_id)), **files}

    def _side(self, side: tuple[str, int, dict[str, Any] | None] | None) -> tuple[int, Any]:
        """(size, bytes-or-Path) of one side of a diff; LFS objects stay on disk as a Path."""
        if side is None:
            return 0, b""
        blob_id, _, lfs = side
        if lfs is not None:
            return int(lfs["size"]), self.repo.lfs_object(lfs)
        data = self.repo.blob(blob_id).data
        return len(data), data

    def _diff_file(self, path: str, o: Any, n: Any) -> dict[str, Any]:
        old_size, old = self._side(o)
        new_size, new = self._side(n)
        sizes = {"old_size": old_size if o is not None else None, "new_size": new_size if n is not None else None}
        if path.endswith(".safetensors"):
            return {"kind": "safetensors", **sizes, **_tensor_diff(old if o else None, new if n else None)}
        if old_size <= _DIFF_TEXT_MAX and new_size <= _DIFF_TEXT_MAX:
            a = old.read_bytes() if isinstance(old, Path) else old
            b = new.read_bytes() if isinstance(new, Path) else new
            if b"\0" not in a and b"\0" not in b:
                try:
                    ta, tb = a.decode(), b.decode()
                except UnicodeDecodeError:
                    pass
                else:
                    text = "".join(
                        difflib.unified_diff(
                            ta.splitlines(keepends=True),
                            tb.splitlines(keepends=True),
                            fromfile="/dev/null" if o is None else f"a/{path}",
                            tofile="/dev/null" if n is None else f"b/{path}",
                        )
                    )
                    truncated = len(text) > _DIFF_OUT_MAX
                    return {"kind": "text", **sizes, "diff": text[:_DIFF_OUT_MAX], "truncated": truncated}
        return {"kind": "binary", **sizes}


def _tensor_diff(old: bytes | Path | None, new: bytes | Path | None) -> dict[str, Any]:
    """Which tensors changed between two safetensors files, with the L2 norm of the change and of the old tensor."""
    import torch  # lazily: only diffs of weights need it

    with contextlib.ExitStack() as stack:
        a = _open_tensors(old, stack)
        b = _open_tensors(new, stack)
        tensors: list[dict[str, Any]] = []
        unchanged = 0
        with torch.no_grad():
            for name in sorted(set(a) | set(b)):
                if name not in b:
                    t = a[name]()
                    tensors.append({"name": name, "status": "removed", "shape": list(t.shape), "dtype": str(t.dtype)})
                    continue
                tb = b[name]()
                if name not in a:
                    norm = float(torch.linalg.vector_norm(tb.float()))
                    tensors.append({"name": name, "status": "added", "shape": list(tb.shape), "dtype": str(tb.dtype),
                                    "norm": norm})  # fmt: skip
                    continue
                ta = a[name]()
                if ta.shape != tb.shape or ta.dtype != tb.dtype:
                    tensors.append({"name": name, "status": "changed", "shape": list(tb.shape), "dtype": str(tb.dtype),
                                    "old_shape": list(ta.shape), "old_dtype": str(ta.dtype)})  # fmt: skip
                    continue
                if torch.equal(ta, tb):
                    unchanged += 1
                    continue
                delta = tb.float() - ta.float()
                diff_norm = float(torch.linalg.vector_norm(delta))
                old_norm = float(torch.linalg.vector_norm(ta.float()))
                tensors.append(
                    {
                        "name": name,
                        "status": "changed",
                        "shape": list(tb.shape),
                        "dtype": str(tb.dtype),
                        "diff_norm": diff_norm,
                        "old_norm": old_norm,
                        "relative": diff_norm / old_norm if old_norm and math.isfinite(old_norm) else None,
                        "max_abs": float(delta.abs().max()) if delta.numel() else 0.0,
                    }
                )
        return {"tensors": tensors, "unchanged_tensors": unchanged}


def _open_tensors(src: bytes | Path | None, stack: contextlib.ExitStack) -> dict[str, Callable[[], Any]]:
    """name -> loader for the tensors of a safetensors file given as bytes or as a path (memory-mapped)."""
    if src is None:
        return {}
    if isinstance(src, Path):
        from safetensors import safe_open

        f = stack.enter_context(safe_open(str(src), framework="pt", device="cpu"))
        return {k: functools.partial(f.get_tensor, k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    from safetensors.torch import load

    loaded = load(bytes(src))
    return {k: functools.partial(_identity, v) for k, v in loaded.items()}


def _identity(value: Any) -> Any:
    return value
