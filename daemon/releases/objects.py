"""Reading git objects back without trusting them: the checks every read of the object database goes through.

- Loose objects are checked in Python before libgit2 reads them (``_check_loose``: complete, as long as their
  header says, hashing to their id, streamed in bounded memory): libgit2 1.9 never returns from inflating a
  truncated one, holding the GIL, so a half-written object must never reach it (``_object``; the store's guarded
  ``read`` in ``repo.py`` does the same with a cache of objects found whole).
- ``_intact``: whether a commit and everything under it read back, through a freshly opened repository (on a full
  disk libgit2 can hand back the id of an object it never wrote).
- ``unsafe_name``: the tree entry names no tree read from the store may hold (``..``, ``.git``, separators).
- Object writes that fail are ``StorageError`` (507, exit 6): ``_storing``.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pygit2

from daemon.errors import StorageError

_HEX_RE = re.compile(r"^[0-9a-f]{4,40}$")
_OID_RE = re.compile(r"[0-9a-f]{40}")  # a full git object id (fullmatch)
_SHA256_RE = re.compile(r"[0-9a-f]{64}")  # an LFS object id (fullmatch)
_BLOB = int(pygit2.enums.FileMode.BLOB)
_EXEC = int(pygit2.enums.FileMode.BLOB_EXECUTABLE)
_TREE = int(pygit2.enums.FileMode.TREE)
_LOOSE_READ = 1 << 20  # bytes read, and at most inflated, per step of a loose object check


def unsafe_name(name: str) -> bool:
    """Whether ``name`` may not be one component of a path written to disk: empty, ``.``, ``..``, ``.git`` (any
    case), or holding a separator or NUL. Git's tree format allows most of these in a crafted tree (git itself
    refuses them at checkout), so every tree read from the store is held to this as well as every path published."""
    return name in ("", ".", "..") or name.lower() == ".git" or any(c in name for c in "/\\\0")



@contextlib.contextmanager
def _storing(what: str, path: Path) -> Iterator[None]:
    """Turn a failed write into ``StorageError`` (507, exit 6): libgit2 reports a full disk, a quota, an I/O error
    or a read-only file system as ``OSError`` (often with no errno) or ``GitError``."""
    try:
        yield
    except (OSError, pygit2.GitError) as e:
        raise StorageError(f"{what} failed: {e}", path=str(path)) from e


class _Corrupt(ValueError):
    """A loose object file that is truncated, corrupt, or hashes to another id."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class _TooLarge(ValueError):
    """An object larger than a bound (``_check_loose``'s ``max_size``), found from its header alone."""


def _check_loose(path: Path, key: str, max_size: int | None = None) -> tuple[str, int]:
    """``(type, size)`` of a loose object file, or ``_Corrupt`` unless it inflates completely, holds as many bytes
    as its header says and hashes to ``key``; ``FileNotFoundError`` when there is no such file. Streamed (bounded
    memory whatever the object's size, and whatever the compression ratio); with ``max_size``, an object whose
    header says it is larger is ``_TooLarge`` before the rest of it is inflated."""
    inflate = zlib.decompressobj()
    sha = hashlib.sha1()
    head = b""
    kind, size, seen = "", -1, 0
    with open(path, "rb") as f:
        while True:
            pending = inflate.unconsumed_tail or f.read(_LOOSE_READ)
            if not pending:
                break
            try:
                out = inflate.decompress(pending, _LOOSE_READ)
            except zlib.error as e:
                raise _Corrupt(f"object {key} is corrupt: {e}", path) from None
            sha.update(out)
            if size < 0:
                head += out
                if b"\0" in head:
                    kind, size = _parse_header(head[: head.index(b"\0")], key, path)
                    if max_size is not None and size > max_size:
                        raise _TooLarge(f"{kind} {key} is {size} bytes, over the bound of {max_size}")
                    seen = len(head) - head.index(b"\0") - 1
                elif len(head) > 64:
                    raise _Corrupt(f"object {key} has no valid header", path)
            else:
                seen += len(out)
            if inflate.eof:
                break
    if not inflate.eof:
        raise _Corrupt(f"object {key} is truncated ({path.stat().st_size} bytes on disk)", path)
    if size < 0 or seen != size:
        raise _Corrupt(f"object {key} holds {seen} bytes, not the {size} its header says", path)
    if sha.hexdigest() != key:
        raise _Corrupt(f"object {key} does not hash to its id", path)
    return kind, size


def _parse_header(header: bytes, key: str, path: Path) -> tuple[str, int]:
    kind, _, size = header.partition(b" ")
    if kind not in (b"blob", b"tree", b"commit", b"tag") or not size.isdigit():
        raise _Corrupt(f"object {key} has no valid header", path)
    return kind.decode(), int(size)


def _loose(repo: pygit2.Repository, key: str) -> Path:
    return Path(repo.path) / "objects" / key[:2] / key[2:]


def _object(repo: pygit2.Repository, oid: str | pygit2.Oid) -> pygit2.Object:
    """``repo[oid]``, its loose file (if it has one) checked first: complete, and hashing to its id. libgit2 1.9
    never returns from inflating a truncated loose object, so a half-written one must not reach it."""
    key = str(oid)
    with contextlib.suppress(FileNotFoundError):  # packed, or not there: libgit2 says which
        _check_loose(_loose(repo, key), key)
    return repo[oid]


_Kind = TypeVar("_Kind")  # pygit2.Commit, Tree or Blob (its stubs do not derive Commit from Object)


def _expect(obj: object, kind: type[_Kind], key: str) -> _Kind:
    """``obj`` when it is a ``kind`` (a commit, a tree, a blob); else a ``StorageError`` naming it: a ref or a tree
    entry naming an object of another kind can only come from a crafted or damaged store."""
    if not isinstance(obj, kind):
        raise StorageError(f"object {key} is a {type(obj).__name__.lower()} where a {kind.__name__.lower()} "
                           "belongs", object=key)
    return obj


def _commit_at(repo: pygit2.Repository, oid: str | pygit2.Oid) -> pygit2.Commit:
    """``_object``, which must be a commit."""
    return _expect(_object(repo, oid), pygit2.Commit, str(oid))


def _intact(repo: pygit2.Repository, commit_id: str, whole: set[pygit2.Oid] | None = None,
            corrupt: list[Path] | None = None) -> str | None:
    """None when the commit, its tree and every object under it (the manifest among them) read back from ``repo``'s
    object database; else what does not. Give it a freshly opened repository, so that nothing comes from its
    object cache: libgit2 can hand back the id of an object whose write a full disk lost. ``whole``, shared
    between calls, remembers the objects already found whole with everything under them (releases share trees);
    the files of corrupt loose objects met are added to ``corrupt``."""
    try:
        commit = _object(repo, commit_id)
    except KeyError:
        return f"commit {commit_id} is not in the object database"
    except Exception as e:  # corrupt or truncated: a finding, not a crash
        if isinstance(e, _Corrupt) and corrupt is not None:
            corrupt.append(e.path)
        return f"commit {commit_id} does not read back: {e}"
    if not isinstance(commit, pygit2.Commit):
        return f"{commit_id} is not a commit"
    whole = set() if whole is None else whole
    stack, seen = [commit.tree_id], set()
    while stack:
        oid = stack.pop()
        if oid in seen or oid in whole:
            continue
        seen.add(oid)
        try:
            obj = _object(repo, oid)
        except KeyError:
            return f"object {oid} of commit {commit_id} is not in the object database"
        except Exception as e:
            if isinstance(e, _Corrupt) and corrupt is not None:
                corrupt.append(e.path)
            return f"object {oid} of commit {commit_id} does not read back: {e}"
        if isinstance(obj, pygit2.Tree):
            stack.extend(e.id for e in obj)
    whole |= seen  # only now: a tree counts as whole once everything under it was read
    return None


