"""An artifact's content: its files as git blobs and one tree (the ``content_id``), large files as LFS objects.

- Files larger than ``lfs_threshold`` (1 MiB) live outside the object database in the Git LFS layout: the
  tree holds a standard pointer file, the bytes are at ``lfs/objects/<aa>/<bb>/<sha256>`` (mode 0444), hashed
  first (content already stored costs no write), else copied to ``lfs/tmp`` + fsync + rename + fsync of the
  directory (``daemon.durable``): stored once however many releases share them. ``checkout(..., link=True)``
  hard-links them. Which paths are pointers is recorded in the manifest (``lfs``), so a small text file that
  happens to look like a pointer is never mistaken for one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pygit2

from daemon import durable
from daemon.errors import BadRequest, StorageError
from daemon.releases.manifest import MANIFEST, REJECTION, FileSource
from daemon.releases.objects import _BLOB, _EXEC, _TREE, unsafe_name
from daemon.releases.repo import Repository

LFS_VERSION = "https://git-lfs.github.com/spec/v1"
_CHUNK = 4 << 20


def files_from_dir(root: str | os.PathLike[str]) -> dict[str, Path]:
    """The regular files under ``root`` as ``{relative posix path: Path}`` (for ``publish``); symlinks skipped."""
    base = Path(root)
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                out[p.relative_to(base).as_posix()] = p
    return out


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version {LFS_VERSION}\noid sha256:{sha256}\nsize {size}\n".encode()



def _check_path(path: str) -> list[str]:
    parts = path.split("/") if isinstance(path, str) else []
    if not parts or any(unsafe_name(p) for p in parts) or path in (MANIFEST, REJECTION):
        raise BadRequest(f"invalid artifact path {path!r}", param="files")
    return parts



class Content:
    """Writing an artifact's files: blobs, LFS objects, and the content tree."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo

    def write(self, files: Mapping[str, FileSource]) -> tuple[str, dict[str, dict[str, Any]]]:
        """Write the artifact's blobs (and LFS objects) and its tree; returns (content tree id, lfs map)."""
        if not isinstance(files, Mapping):
            raise BadRequest("files must map paths to bytes, text or file paths", param="files")
        root: dict[str, Any] = {}
        lfs: dict[str, dict[str, Any]] = {}
        try:
            for path in sorted(files):
                parts = _check_path(path)
                node = root
                for part in parts[:-1]:
                    node = node.setdefault(part, {})
                    if not isinstance(node, dict):
                        raise BadRequest(f"artifact path {path!r} runs through a file", param="files")
                if parts[-1] in node:
                    raise BadRequest(f"artifact path {path!r} is both a file and a directory", param="files")
                blob_id, mode, pointer = self._write_file(path, files[path])
                node[parts[-1]] = (blob_id, mode)
                if pointer is not None:
                    lfs[path] = pointer
            return str(self._write_tree(root)), lfs
        except OSError as e:
            raise StorageError(f"writing artifact failed: {e}", path=str(self.repo.path)) from e
        except pygit2.GitError as e:
            raise StorageError(f"writing artifact failed: {e}", path=str(self.repo.path)) from e

    def _write_tree(self, node: dict[str, Any]) -> pygit2.Oid:
        repo = self.repo.git()
        tb = repo.TreeBuilder()
        for name, value in node.items():
            if isinstance(value, dict):
                tb.insert(name, self._write_tree(value), _TREE)
            else:
                tb.insert(name, value[0], value[1])
        return tb.write()

    def _write_file(self, path: str, src: FileSource) -> tuple[pygit2.Oid, int, dict[str, Any] | None]:
        repo = self.repo.git()
        mode = _BLOB
        if isinstance(src, str):
            src = src.encode()
        if isinstance(src, os.PathLike):
            p = Path(src)
            if not p.is_file():
                raise BadRequest(f"artifact file {path!r}: {p} is not a regular file", param="files")
            st = p.stat()
            if st.st_mode & 0o111:
                mode = _EXEC
            if st.st_size > self.repo.lfs_threshold:
                sha, size = self._store_lfs(p)
            else:
                return repo.create_blob(p.read_bytes()), mode, None
        elif isinstance(src, bytes | bytearray | memoryview):
            data = bytes(src)
            if len(data) <= self.repo.lfs_threshold:
                return repo.create_blob(data), mode, None
            sha, size = self._store_lfs(data)
        else:
            raise BadRequest(f"artifact file {path!r}: expected bytes, str or a path", param="files")
        return repo.create_blob(lfs_pointer(sha, size)), mode, {"oid": f"sha256:{sha}", "size": size}

    def _store_lfs(self, src: Path | bytes) -> tuple[str, int]:
        """Store bytes (or a file's bytes) as an LFS object unless already stored; returns (sha256, size).

        Hash first (a read), so content already stored costs no write; otherwise copy to ``lfs/tmp`` (a kernel
        copy for files), fsync, rename into place, fsync the directory. A source file must not change while
        it is published: its size, mtime and inode are compared before and after."""
        if isinstance(src, Path):
            before = os.stat(src)
            h = hashlib.sha256()
            with open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            sha, size = h.hexdigest(), before.st_size
        else:
            sha, size = hashlib.sha256(src).hexdigest(), len(src)
        final = self.repo.lfs_path(sha)
        if final.exists() and final.stat().st_size == size:
            return sha, size
        fd, tmp = tempfile.mkstemp(dir=self.repo.lfs_tmp, prefix="obj-")
        try:
            try:
                if isinstance(src, Path):
                    shutil.copyfile(src, tmp)  # sendfile / copy_file_range: the bytes stay in the kernel
                    after = os.stat(src)
                    if (after.st_size, after.st_mtime_ns, after.st_ino) != (
                        before.st_size,
                        before.st_mtime_ns,
                        before.st_ino,
                    ) or os.fstat(fd).st_size != size:
                        raise BadRequest(f"{src} changed while it was being published", param="files")
                else:
                    with open(fd, "wb", closefd=False) as out:
                        out.write(src)
                durable.sync_fd(fd)
            finally:
                os.close(fd)
            os.chmod(tmp, 0o444)
            durable.mkdirs(final.parent)
            os.rename(tmp, final)
            durable.sync_dir(final.parent)
            return sha, size
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

