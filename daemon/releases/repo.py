"""The repository under the release chains: opening or creating it durably, and reading its objects back safely.

- One bare repo (``$REEF_HOME/artifacts.git``), driven through pygit2 only (needs pygit2 >= 1.19 for
  ``Repository.transaction``). The author and committer are ``reef <reef@localhost>``.
- Durability: libgit2's fsync of objects and refs is switched on (a process-wide option) and the repo config
  asks the same of git (``core.fsync=objects,reference``); ``core.logAllRefUpdates=always`` keeps a reflog for
  every ``refs/reef/*`` ref. libgit2's init syncs nothing, so a new repo is made and synced in a temp dir and
  renamed into place. Its config writes are not synced either; a config a power cut empties is set again at
  the next open.
- Every read of the object database goes through ``read`` (a loose object is checked whole first, see
  ``objects.py``); trees are walked through ``walk``, which refuses entries no tree Reef writes holds.
- Threads: a ``pygit2.Repository`` per thread (libgit2 objects must not be shared across threads); processes
  exclude each other through the ref locks (``refs.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pygit2

from daemon import durable
from daemon.chain_remote import ChainRemote
from daemon.errors import BadRequest, NotFound, StorageError, WeightsPruned
from daemon.releases.manifest import MANIFEST
from daemon.releases.objects import (
    _BLOB,
    _EXEC,
    _HEX_RE,
    _SHA256_RE,
    _TREE,
    _check_loose,
    _Corrupt,
    _expect,
    _loose,
    _storing,
    _TooLarge,
    unsafe_name,
)

IDENT = ("reef", "reef@localhost")
GUARD = "reef-refs.guard"
DEFAULT_LFS_THRESHOLD = 1 << 20


class Repository:
    """The bare repository of the release chains: opened or created durably, one ``pygit2.Repository`` per
    thread, and every read of its object database checked first (``read``). Each part of ``ReleaseStore``
    holds it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lfs_threshold: int = DEFAULT_LFS_THRESHOLD,
        lock_timeout: float = 10.0,
        stale_lock_after: float = 5.0,
        remote: ChainRemote | None = None,
    ) -> None:
        if not hasattr(pygit2.Repository, "transaction"):
            from importlib.metadata import version

            raise StorageError(f"pygit2 {version('pygit2')} lacks reference transactions; need pygit2 >= 1.19")
        self.path = Path(path).absolute()
        self.lfs_threshold = lfs_threshold
        self.lock_timeout = lock_timeout
        self.stale_lock_after = stale_lock_after
        self.remote = remote
        self.lfs_dir = self.path / "lfs" / "objects"
        self.lfs_tmp = self.path / "lfs" / "tmp"
        self.pruned_dir = self.path / "lfs" / "pruned"  # tombstones of objects a retention policy removed (pruning.py)
        self.guard_path = self.path / GUARD
        self._local = threading.local()
        self._whole: set[str] = set()  # loose objects read back whole once (immutable: not checked again)
        pygit2.settings.enable_fsync_gitdir(True)
        try:
            self._open_or_create()
        except (pygit2.GitError, OSError) as e:
            raise StorageError(f"cannot open release store {self.path}: {e}", path=str(self.path)) from e


    def _open_or_create(self) -> None:
        if not (self.path / "HEAD").exists():
            self._create()
        repo = self.git()
        wanted = {"core.logAllRefUpdates": "always", "core.fsync": "objects,reference"}
        for attempt in range(50):
            try:
                for key, value in wanted.items():
                    if key not in repo.config or repo.config[key] != value:
                        repo.config[key] = value
                break
            except pygit2.GitError:  # config.lock held by a process configuring the same new repo
                if attempt == 49:
                    raise
                time.sleep(0.02)
        for d in (self.lfs_dir, self.lfs_tmp):
            durable.mkdirs(d)
        os.close(os.open(self.guard_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))

    def _create(self) -> None:
        """Create the repository all or nothing: made and synced in a temp dir beside it, renamed into place.

        libgit2's init fsyncs nothing, so a power cut soon after would leave a repo with an empty HEAD or config
        that opens later and breaks git (found by tests/test_power_loss.py)."""
        durable.mkdirs(self.path.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent))
        try:
            pygit2.init_repository(str(tmp), bare=True)
            durable.sync_tree(tmp)
            try:
                os.rename(tmp, self.path)  # replaces nothing but a missing or empty directory
            except OSError:
                if not (self.path / "HEAD").exists():
                    raise
                return  # another process created it first
            durable.sync_dir(self.path.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def git(self) -> pygit2.Repository:
        repo = getattr(self._local, "repo", None)
        if repo is None:
            repo = pygit2.Repository(str(self.path))
            repo.set_ident(*IDENT)
            self._local.repo = repo
        return repo

    def signature(self, when: float) -> pygit2.Signature:
        return pygit2.Signature(IDENT[0], IDENT[1], int(when), 0)


    # --- reading objects: every read of the object database goes through ``read`` ------------------------

    def read(self, oid: str | pygit2.Oid) -> pygit2.Object:
        """``repo[oid]``, its loose file (if it has one) checked first, as ``_object`` does: a damaged object is a
        ``StorageError`` naming it and its file, never a read that libgit2 does not return from (libgit2 1.9 loops
        for good, holding the GIL, on a truncated loose object: the daemon would stop answering). ``KeyError`` when
        the store has no such object. Objects are immutable, so one found whole is not checked again."""
        key = str(oid)
        repo = self.git()
        if key not in self._whole:
            try:
                _check_loose(_loose(repo, key), key)
            except FileNotFoundError:
                return repo[oid]  # packed, or not there: libgit2 says which
            except _Corrupt as e:
                raise StorageError(f"the release store {self.path} is damaged: {e} (file {e.path})", path=str(e.path),
                                   object=key) from None
            except OSError as e:
                raise StorageError(f"cannot read object {key} of the release store {self.path}: {e}",
                                   path=str(self.path), object=key) from e
            if len(self._whole) > 65536:
                self._whole.clear()
            self._whole.add(key)
        return repo[oid]

    def tree(self, commit: pygit2.Commit) -> pygit2.Tree:
        """A commit's root tree, read through ``read`` (``commit.tree`` would let libgit2 read it unchecked)."""
        return _expect(self.read(commit.tree_id), pygit2.Tree, str(commit.tree_id))

    def commit(self, oid: str | pygit2.Oid) -> pygit2.Commit:
        """``read``, which must be a commit (a release, a rejection)."""
        return _expect(self.read(oid), pygit2.Commit, str(oid))

    def blob(self, oid: str | pygit2.Oid) -> pygit2.Blob:
        """``read``, which must be a blob (a file)."""
        return _expect(self.read(oid), pygit2.Blob, str(oid))

    def size(self, oid: str | pygit2.Oid, max_size: int | None = None) -> int:
        """The size of an object, from its header where it is packed; a loose one is checked whole as it is streamed
        (``_check_loose``), in bounded memory. Over ``max_size``: ``_TooLarge``, before the rest is read."""
        key = str(oid)
        try:
            size = _check_loose(_loose(self.git(), key), key, max_size)[1]
        except FileNotFoundError:
            size = int(self.git().odb.read_header(key)[1])  # packed: libgit2 reads only the entry's header
            if max_size is not None and size > max_size:
                raise _TooLarge(f"object {key} is {size} bytes, over the bound of {max_size}") from None
            return size
        except _Corrupt as e:
            raise StorageError(f"the release store {self.path} is damaged: {e} (file {e.path})", path=str(e.path),
                               object=key) from None
        self._whole.add(key)
        return size

    def walk(self, tree_id: str | pygit2.Oid, prefix: str = "", max_size: int | None = None
              ) -> Iterator[tuple[str, str, int]]:
        """``(path, blob id, mode)`` of every file under the tree ``tree_id``, each tree read through ``read``
        (with ``max_size``: its size checked first). An entry whose name is not safe on disk (``unsafe_name``:
        ``..``, ``.git``, a separator...) or that is not a file or a directory (a symlink, a submodule) is a
        ``StorageError``: no tree Reef writes holds one, so it can only come from a crafted release."""
        if max_size is not None:
            self.size(tree_id, max_size)
        tree = _expect(self.read(tree_id), pygit2.Tree, str(tree_id))
        for entry in tree:
            mode = int(entry.filemode)
            try:
                name = entry.name
            except UnicodeDecodeError:
                name = ""
            if not isinstance(name, str) or unsafe_name(name) or mode not in (_BLOB, _EXEC, _TREE):
                raise StorageError(f"tree {tree_id} holds the entry {prefix}{entry.raw_name!r} (mode {mode:o}), which "
                                   "is not a plain file or directory Reef would write; not read", path=str(self.path))
            if mode == _TREE:
                yield from self.walk(entry.id, f"{prefix}{name}/", max_size)
            else:
                yield f"{prefix}{name}", str(entry.id), mode

    def descends(self, new: str, old: str) -> bool:
        """Whether ``old`` is an ancestor of ``new`` (every commit read through ``read``)."""
        stack, seen = [new], set()
        while stack:
            rid = stack.pop()
            if rid in seen:
                continue
            seen.add(rid)
            parents = [str(p) for p in self.commit(rid).parent_ids]
            if old in parents:
                return True
            stack.extend(parents)
        return False

    def resolve(self, release_id: str, what: str = "release") -> str:
        """Full commit id for a (possibly abbreviated) hex id; NotFound / BadRequest naming it."""
        rid = release_id.strip().lower() if isinstance(release_id, str) else ""
        if not _HEX_RE.match(rid):
            raise BadRequest(f"invalid {what} id {release_id!r}: expected hex", param="release_id")
        repo = self.git()
        try:
            oid = repo.expand_id(rid) if len(rid) < 40 else pygit2.Oid(hex=rid)
            obj = self.read(oid)
        except pygit2.AmbiguousError:
            raise BadRequest(f"ambiguous {what} id {release_id!r}", param="release_id") from None
        except (KeyError, ValueError, pygit2.GitError):
            obj = None
        if obj is None or not isinstance(obj, pygit2.Commit):
            raise NotFound(f"unknown {what} {release_id!r}", release_id=release_id)
        return str(obj.id)

    def manifest_blob(self, commit: pygit2.Commit, name: str) -> bytes:
        """The bytes of the top-level file ``name`` of a commit (``KeyError`` when it has none)."""
        blob = self.read(self.tree(commit)[name].id)
        if not isinstance(blob, pygit2.Blob):
            raise KeyError(name)
        return blob.data

    def content_tree(self, commit_id: str) -> str:
        """The id of a release's content: its tree without the manifest."""
        tree = self.tree(self.commit(commit_id))
        with _storing("writing the content tree", self.path):  # it exists already but for a lost write
            tb = self.git().TreeBuilder(tree)
            if tb.get(MANIFEST) is not None:
                tb.remove(MANIFEST)
            return str(tb.write())



    def lfs_path(self, sha256: str) -> Path:
        if not isinstance(sha256, str) or not _SHA256_RE.fullmatch(sha256):  # it becomes a path
            raise StorageError(f"{sha256!r} is not an LFS object id (sha256 hex)", path=str(self.lfs_dir))
        return self.lfs_dir / sha256[:2] / sha256[2:4] / sha256


    def lfs_object(self, lfs: Mapping[str, Any]) -> Path:
        sha = str(lfs["oid"]).split(":", 1)[-1]
        path = self.lfs_path(sha)
        if not path.exists():
            if self.pruned(sha):
                raise WeightsPruned(f"LFS object {sha} was pruned by a retention policy (daemon/retention.py)",
                                    release_id=None)
            raise StorageError(f"LFS object {sha} is missing from {self.lfs_dir}", path=str(path))
        return path

    def pruned(self, sha256: str) -> bool:
        """Whether the LFS object was removed by a retention policy: missing, with its tombstone (``pruning.py``)."""
        return not self.lfs_path(sha256).exists() and (self.pruned_dir / sha256).exists()

