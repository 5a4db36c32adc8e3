"""The release chains: every published version of every scenario, in one bare git repository.

Design choices:
- One bare repo (``$REEF_HOME/artifacts.git``), driven through pygit2 only (needs pygit2 >= 1.19 for
  ``Repository.transaction``). A scenario's chain is the ref ``refs/reef/scenarios/<name>``; a release is a
  commit whose root tree is the artifact's files plus ``reef-artifact.json`` (the manifest: kind, recipe,
  scenario, step, operation, metrics, parent, receipts, source, settings, created_at, content_id, lfs). The
  message is a summary line and the trailers ``Reef-Scenario``, ``Reef-Step``, ``Reef-Operation``,
  ``Reef-Kind``, ``Reef-Content`` (and ``Reef-Source`` for rollback / promote), so ``git log`` reads as history.
  The author and committer are ``reef <reef@localhost>``; a chain is linear and starts with an ``init`` (step 0).
- ``release_id`` is the commit id. ``content_id`` is the id of the tree of the artifact files *without* the
  manifest: that tree is written to the object database as is (it is what the release tree is built from), and
  the release tree is that tree plus the manifest entry, so its entries are shared. The content tree itself
  is not referenced by any commit (``git fsck`` lists it as dangling, and ``git gc`` may prune it after its
  grace period); it is always recomputable from a release (its tree minus the manifest) and is recorded in
  the manifest.
- Files larger than ``lfs_threshold`` (1 MiB) live outside the object database in the Git LFS layout: the
  tree holds a standard pointer file, the bytes are at ``lfs/objects/<aa>/<bb>/<sha256>`` (mode 0444), hashed
  first (content already stored costs no write), else copied to ``lfs/tmp`` + fsync + rename + fsync of the
  directory: stored once however many releases share them. ``checkout(..., link=True)`` hard-links them.
  Which paths are pointers is recorded in the manifest (``lfs``), so a small text file that happens to look
  like a pointer is never mistaken for one.
- Publishing is compare-and-swap on the ref, under git's own ref lock: a libgit2 reference transaction takes
  ``<ref>.lock`` (O_EXCL, the protocol git itself uses, so ``git update-ref`` and Reef exclude each other),
  the ref is read again under the lock, compared with the expected head, and written (fsync, rename, reflog)
  only if it matches; otherwise ``HeadMoved`` and nothing changes. The objects are written before the lock is
  taken, so the lock is held for milliseconds and a crash before the rename leaves only unreferenced objects.
  A busy lock is retried with jittered exponential backoff up to ``lock_timeout``, then ``LockBusy``.
- Stale locks. The lock files carry no owner, so every Reef ref update also holds a *shared* ``flock`` on
  ``reef-refs.guard`` in the repo while it holds ref locks; the kernel drops it when the process dies. A lock
  is stale when its remover can take that flock *exclusively* (no live Reef process is inside a ref update,
  so no Reef process owns any ``*.lock``) and its mtime is older than ``stale_lock_after`` seconds (5 s; this
  spares a git binary process, which does not take the flock and holds its locks for milliseconds).
  ``recover()`` (at start-up) applies this to every ``*.lock`` under ``refs/`` and ``logs/`` and to
  ``packed-refs.lock``, ``HEAD.lock``, ``config.lock``, ``index.lock``, and removes temp files older than an
  hour; a publisher that keeps finding a lock busy applies it to that lock, so a crash never blocks for long.
- Durability: libgit2's fsync of objects and refs is switched on (a process-wide option) and the repo config
  asks the same of git (``core.fsync=objects,reference``); ``core.logAllRefUpdates=always`` keeps a reflog for
  every ``refs/reef/*`` ref; LFS objects and checkouts go through ``daemon.durable`` (temp + fsync + rename +
  fsync of the directory). libgit2's init syncs nothing, so a new repo is made and synced in a temp dir and
  renamed into place. Its config writes are not synced either; a config a power cut empties is set again at
  the next open.
- Lost writes. On a full disk libgit2 can return the id of a commit it never wrote, and it appends the reflog line
  before renaming the new ref into place. So no ref moves to a commit that does not read back whole through a
  freshly opened repository (``_check_written``: commit, tree, manifest, files; a half-written object of ours is
  removed, since libgit2 never rewrites an object it finds present), a failed ref update truncates the reflog
  line it left (``_drop_unapplied``), and ``recover()`` moves a dangling ref back to the newest intact commit of
  its reflog or first parents (or removes it when none is left) and drops reflog entries naming commits that do
  not read back whole, logging each as an error; ``find_damage`` reports the same without changing anything
  (``reef doctor``). Loose objects are checked in Python before libgit2 reads them: libgit2 1.9 never returns
  from inflating a truncated one. ``fsck()`` reads reflogs and every loose object as ``git fsck --full`` does.
  Object writes that fail are ``StorageError`` (507, exit 6).
- LoRA adapter releases (``daemon/lora.py``) hold only the adapter and ``reef-adapter.json`` naming their base
  by content id; ``publish`` refuses one whose base is not the model the scenario's head serves (``BaseMismatch``,
  before anything is written), and ``diff`` compares what a release serves (an adapter over its base's files).
- History is never rewritten. Rollback and promote publish existing content as a new release (step + 1).
  A pending candidate (review-mode gates) is a commit on ``refs/reef/pending/<scenario>/<id>`` whose parent
  is the head it was built on; promoting it moves that ref to ``refs/reef/promoted/<scenario>/<id>`` in the
  same transaction as the chain update, so it stays reachable. Rejected candidates are a chain of their own,
  ``refs/reef/rejected/<scenario>`` (one commit per verdict, with ``reef-rejection.json``, and the
  candidate's content as ``candidate/`` when it was held).
- A git remote (``remote``, ``daemon/chain_remote.py``): every ref update under ``refs/reef/`` is pushed to the
  remote first, compare-and-swap on the remote's refs, and made locally only once the remote took it; ``follow``
  takes in what others pushed (LFS objects first, then the local ref, by the same local compare-and-swap).
- Threads: a ``pygit2.Repository`` per thread (libgit2 objects must not be shared across threads); processes
  exclude each other through the ref locks. Releases are immutable, so their manifests are cached by id.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pygit2

from daemon import durable, lora
from daemon.chain_remote import MIRROR_REF, ChainRemote, RefPush
from daemon.errors import (
    BadRequest,
    BaseMismatch,
    Conflict,
    HeadMoved,
    LockBusy,
    NotFound,
    ReefError,
    RemoteReleaseRefused,
    StorageError,
    Unchanged,
)
from daemon.names import check_scenario  # the one validator of scenario names

log = logging.getLogger("reef.releases")

MANIFEST = "reef-artifact.json"
REJECTION = "reef-rejection.json"
KINDS = ("weights", "harness")
OPERATIONS = ("init", "train", "rollback", "promote")
SCENARIOS_REF = "refs/reef/scenarios/"
_FRESH_S = 0.001  # a head checked this recently is not checked again: see ReleaseStore.head
_RACY_NS = 100_000_000  # a ref file younger than this (0.1 s) is looked up again: see ReleaseStore.head
PENDING_REF = "refs/reef/pending/"
PROMOTED_REF = "refs/reef/promoted/"
REJECTED_REF = "refs/reef/rejected/"
IDENT = ("reef", "reef@localhost")
GUARD = "reef-refs.guard"
LFS_VERSION = "https://git-lfs.github.com/spec/v1"
DEFAULT_LFS_THRESHOLD = 1 << 20

_HEX_RE = re.compile(r"^[0-9a-f]{4,40}$")
_OID_RE = re.compile(r"[0-9a-f]{40}")  # a full git object id (fullmatch)
_SHA256_RE = re.compile(r"[0-9a-f]{64}")  # an LFS object id (fullmatch)
# libgit2's two messages for GIT_ELOCKED (the lock file seen first, or lost in the O_EXCL race)
_LOCK_MSG = re.compile(r"failed to (?:lock file|create locked file) '(.+?\.lock)'")
_REFLOG_LINE = re.compile(rb"([0-9a-f]{40}) ([0-9a-f]{40}) ")  # "<old> <new> <ident> <when>\t<message>"
_ZERO = "0" * 40
_BLOB = int(pygit2.enums.FileMode.BLOB)
_EXEC = int(pygit2.enums.FileMode.BLOB_EXECUTABLE)
_TREE = int(pygit2.enums.FileMode.TREE)
_CHUNK = 4 << 20
_LOOSE_READ = 1 << 20  # bytes read, and at most inflated, per step of a loose object check
_DIFF_TEXT_MAX = 4 << 20  # files above this are reported as binary (sizes), not diffed as text
_DIFF_OUT_MAX = 256 << 10  # per-file cap on a unified diff

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


@dataclass
class _RefUpdate:
    name: str
    new: str | None  # None: delete the ref
    expected: str | None  # None: the ref must not exist
    conflict: Callable[[str | None], ReefError]


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


def unsafe_name(name: str) -> bool:
    """Whether ``name`` may not be one component of a path written to disk: empty, ``.``, ``..``, ``.git`` (any
    case), or holding a separator or NUL. Git's tree format allows most of these in a crafted tree (git itself
    refuses them at checkout), so every tree read from the store is held to this as well as every path published."""
    return name in ("", ".", "..") or name.lower() == ".git" or any(c in name for c in "/\\\0")


def _check_path(path: str) -> list[str]:
    parts = path.split("/") if isinstance(path, str) else []
    if not parts or any(unsafe_name(p) for p in parts) or path in (MANIFEST, REJECTION):
        raise BadRequest(f"invalid artifact path {path!r}", param="files")
    return parts


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


@dataclass(frozen=True)
class Damage:
    """A ref under ``refs/reef/`` whose commit does not read back (a dangling head), or a reflog with entries naming
    objects that are not there (``git fsck``: "invalid reflog entry"): what a write lost to a full or failing disk
    leaves behind. ``ReleaseStore.recover()`` repairs both; ``find_damage`` only looks."""

    ref: str
    target: str | None  # what a damaged ref points at (None: the ref is fine, only its reflog is damaged)
    problem: str | None
    restore: str | None  # the newest intact commit in the ref's reflog or history: where it goes back to
    bad_reflog_entries: int

    def describe(self) -> str:
        """One sentence for people: what is wrong and what start-up recovery does about it."""
        parts = []
        if self.target is not None:
            what = f"the head of {self.ref[len(SCENARIOS_REF):]!r}" if self.ref.startswith(SCENARIOS_REF) else self.ref
            fix = f"moves it back to {self.restore}, the newest commit of it that exists" if self.restore else (
                "removes it (no commit of it exists)")
            parts.append(f"{what} names {self.target}, which does not read back ({self.problem}): recovery {fix}")
        if self.bad_reflog_entries:
            parts.append(f"the reflog of {self.ref} has {self.bad_reflog_entries} entries naming missing objects "
                         "(git fsck rejects them): recovery drops them")
        return "; ".join(parts)


def _reflogs(path: Path) -> Iterator[tuple[str, Path]]:
    """(ref name, reflog file) for every reflog in the repository."""
    logs = path / "logs"
    if not logs.is_dir():
        return
    for f in sorted(logs.rglob("*")):
        if f.is_file() and not f.name.endswith(".lock"):
            yield f.relative_to(logs).as_posix(), f


def _entry_ok(line: bytes, readable: Callable[[str], bool]) -> bool:
    """A reflog line git accepts: well formed, and naming only objects that read back (or the zero id)."""
    m = _REFLOG_LINE.match(line)
    return m is not None and all(o == _ZERO or readable(o) for o in (m.group(1).decode(), m.group(2).decode()))


def _readable_in(repo: pygit2.Repository) -> Callable[[str], bool]:
    """Whether a commit named by a reflog reads back whole (``_intact``): git fsck takes reflog entries as roots,
    so an entry naming a commit whose tree is gone fails it as surely as one naming a missing commit."""
    known: dict[str, bool] = {}
    whole: set[pygit2.Oid] = set()

    def readable(oid: str) -> bool:
        if oid not in known:
            known[oid] = _intact(repo, oid, whole) is None
        return known[oid]

    return readable


def _restore_point(repo: pygit2.Repository, reflog: Path, ref: str, target: str) -> str | None:
    """The newest intact commit a damaged ref held before (its reflog, newest first; else its commit's first
    parents when the commit itself reads); None for refs named after their commit (pending, promoted)."""
    if ref.startswith((PENDING_REF, PROMOTED_REF)):
        return None
    candidates: list[str] = []
    with contextlib.suppress(OSError):
        for line in reversed(reflog.read_bytes().splitlines()):
            m = _REFLOG_LINE.match(line)
            if m is not None:
                candidates += [m.group(2).decode(), m.group(1).decode()]
    with contextlib.suppress(Exception):
        commit = _object(repo, target)
        while commit.parent_ids:
            candidates.append(str(commit.parent_ids[0]))
            commit = _object(repo, commit.parent_ids[0])
    for c in candidates:
        if c not in (_ZERO, target) and _intact(repo, c) is None:
            return c
    return None


def find_damage(path: str | os.PathLike[str]) -> list[Damage]:
    """Dangling refs and damaged reflogs of the store at ``path`` (see ``Damage``). Changes nothing: ``reef
    doctor`` calls it on a store it must leave alone."""
    path = Path(path)
    repo = pygit2.Repository(str(path))  # fresh: no object comes from a cache
    readable = _readable_in(repo)
    found: dict[str, Damage] = {}
    for name in repo.listall_references():
        if not name.startswith("refs/reef/"):
            continue
        oid = repo.references[name].target
        if not isinstance(oid, pygit2.Oid):  # a symbolic ref: Reef makes none
            continue
        target = str(oid)
        problem = _intact(repo, target)
        if problem is not None:
            found[name] = Damage(name, target, problem, _restore_point(repo, path / "logs" / name, name, target), 0)
    for name, f in _reflogs(path):
        try:
            bad = sum(not _entry_ok(line, readable) for line in f.read_bytes().splitlines())
        except OSError:
            continue
        if bad:
            d = found.get(name) or Damage(name, None, None, None, 0)
            found[name] = Damage(d.ref, d.target, d.problem, d.restore, bad)
    return [found[k] for k in sorted(found)]


def _json(value: Any) -> str:
    try:
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise BadRequest(f"release metadata must be finite JSON: {e}", param="metrics") from e


def _one_line(text: str, limit: int = 120) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class ReleaseStore:
    """The release chains of all scenarios. Safe to use from many threads and many processes at once."""

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
            raise StorageError(f"pygit2 {pygit2.__version__} lacks reference transactions; need pygit2 >= 1.19")
        self.path = Path(path).absolute()
        self.lfs_threshold = lfs_threshold
        self.lock_timeout = lock_timeout
        self.stale_lock_after = stale_lock_after
        self.remote = remote
        self._seeded = False  # local refs the remote lacks were pushed to it (the first follow does it)
        self._follow_lock = threading.Lock()
        self.lfs_dir = self.path / "lfs" / "objects"
        self._lfs_tmp = self.path / "lfs" / "tmp"
        self._guard_path = self.path / GUARD
        self._local = threading.local()
        self._heads: dict[str, tuple[tuple[int, int, int], str | None]] = {}  # ref -> (stat key, target)
        self._fresh: dict[str, tuple[float, str | None]] = {}  # ref -> (monotonic time of the check, target)
        self._cache: dict[str, tuple[str, bytes, str]] = {}
        self._cache_lock = threading.Lock()
        self._whole: set[str] = set()  # loose objects read back whole once (immutable: not checked again)
        self._taken: set[str] = set()  # commits from the remote that passed ``_incoming``
        self._refused: dict[str, str] = {}  # commits from the remote refused, and why (said once, not re-checked)
        pygit2.settings.enable_fsync_gitdir(True)
        try:
            self._open_or_create()
        except (pygit2.GitError, OSError) as e:
            raise StorageError(f"cannot open release store {self.path}: {e}", path=str(self.path)) from e

    # --- repository ----------------------------------------------------------------------------------------

    def _open_or_create(self) -> None:
        if not (self.path / "HEAD").exists():
            self._create()
        repo = self._repo()
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
        for d in (self.lfs_dir, self._lfs_tmp):
            durable.mkdirs(d)
        os.close(os.open(self._guard_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))

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

    def _repo(self) -> pygit2.Repository:
        repo = getattr(self._local, "repo", None)
        if repo is None:
            repo = pygit2.Repository(str(self.path))
            repo.set_ident(*IDENT)
            self._local.repo = repo
        return repo

    def _signature(self, when: float) -> pygit2.Signature:
        return pygit2.Signature(IDENT[0], IDENT[1], int(when), 0)

    # --- reading objects: every read of the object database goes through ``_read`` ------------------------

    def _read(self, oid: str | pygit2.Oid) -> pygit2.Object:
        """``repo[oid]``, its loose file (if it has one) checked first, as ``_object`` does: a damaged object is a
        ``StorageError`` naming it and its file, never a read that libgit2 does not return from (libgit2 1.9 loops
        for good, holding the GIL, on a truncated loose object: the daemon would stop answering). ``KeyError`` when
        the store has no such object. Objects are immutable, so one found whole is not checked again."""
        key = str(oid)
        repo = self._repo()
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

    def _tree(self, commit: pygit2.Commit) -> pygit2.Tree:
        """A commit's root tree, read through ``_read`` (``commit.tree`` would let libgit2 read it unchecked)."""
        tree = self._read(commit.tree_id)
        assert isinstance(tree, pygit2.Tree)
        return tree

    def _size(self, oid: str | pygit2.Oid, max_size: int | None = None) -> int:
        """The size of an object, from its header where it is packed; a loose one is checked whole as it is streamed
        (``_check_loose``), in bounded memory. Over ``max_size``: ``_TooLarge``, before the rest is read."""
        key = str(oid)
        try:
            size = _check_loose(_loose(self._repo(), key), key, max_size)[1]
        except FileNotFoundError:
            size = int(self._repo().odb.read_header(key)[1])  # packed: libgit2 reads only the entry's header
            if max_size is not None and size > max_size:
                raise _TooLarge(f"object {key} is {size} bytes, over the bound of {max_size}") from None
            return size
        except _Corrupt as e:
            raise StorageError(f"the release store {self.path} is damaged: {e} (file {e.path})", path=str(e.path),
                               object=key) from None
        self._whole.add(key)
        return size

    def _walk(self, tree_id: str | pygit2.Oid, prefix: str = "", max_size: int | None = None
              ) -> Iterator[tuple[str, str, int]]:
        """``(path, blob id, mode)`` of every file under the tree ``tree_id``, each tree read through ``_read``
        (with ``max_size``: its size checked first). An entry whose name is not safe on disk (``unsafe_name``:
        ``..``, ``.git``, a separator...) or that is not a file or a directory (a symlink, a submodule) is a
        ``StorageError``: no tree Reef writes holds one, so it can only come from a crafted release."""
        if max_size is not None:
            self._size(tree_id, max_size)
        tree = self._read(tree_id)
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
                yield from self._walk(entry.id, f"{prefix}{name}/", max_size)
            else:
                yield f"{prefix}{name}", str(entry.id), mode

    def _descends(self, new: str, old: str) -> bool:
        """Whether ``old`` is an ancestor of ``new`` (every commit read through ``_read``)."""
        stack, seen = [new], set()
        while stack:
            rid = stack.pop()
            if rid in seen:
                continue
            seen.add(rid)
            parents = [str(p) for p in self._read(rid).parent_ids]
            if old in parents:
                return True
            stack.extend(parents)
        return False

    def _resolve(self, release_id: str, what: str = "release") -> str:
        """Full commit id for a (possibly abbreviated) hex id; NotFound / BadRequest naming it."""
        rid = release_id.strip().lower() if isinstance(release_id, str) else ""
        if not _HEX_RE.match(rid):
            raise BadRequest(f"invalid {what} id {release_id!r}: expected hex", param="release_id")
        repo = self._repo()
        try:
            oid = repo.expand_id(rid) if len(rid) < 40 else pygit2.Oid(hex=rid)
            obj = self._read(oid)
        except pygit2.AmbiguousError:
            raise BadRequest(f"ambiguous {what} id {release_id!r}", param="release_id") from None
        except (KeyError, ValueError, pygit2.GitError):
            obj = None
        if obj is None or not isinstance(obj, pygit2.Commit):
            raise NotFound(f"unknown {what} {release_id!r}", release_id=release_id)
        return str(obj.id)

    # --- reading -------------------------------------------------------------------------------------------

    def head(self, scenario: str) -> str | None:
        """The scenario's head as git has it now, so that a publish by another process is live at once.

        The serve path asks once per request; libgit2's lookup costs several times a ``stat`` of the loose ref
        file, so the answer is kept per ref and reused while the file's inode, mtime and size are unchanged
        (every ref update renames a new file into place). As in git's "racy" index rule, a file modified less
        than ``_RACY_NS`` before it was looked at is never trusted from the cache: two updates within one
        timestamp tick could otherwise look alike. A ref git has packed (no loose file) is always looked up. Requests
        within ``_FRESH_S`` of a check share it (a burst of requests served in one turn of the event loop costs one
        ``stat``); this store's own ref updates drop it at once."""
        name = SCENARIOS_REF + check_scenario(scenario)
        now = time.monotonic()
        fresh = self._fresh.get(name)
        if fresh is not None and now - fresh[0] < _FRESH_S:
            return fresh[1]
        target = self._head(name)
        self._fresh[name] = (now, target)
        return target

    def _head(self, name: str) -> str | None:
        try:
            st = os.stat(f"{self.path}/{name}")
        except OSError:
            st = None
        key = None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)
        if key is not None:
            hit = self._heads.get(name)
            if hit is not None and hit[0] == key:
                return hit[1]
        ref = self._repo().references.get(name)
        target = None if ref is None else str(ref.target)
        if st is not None and time.time_ns() - st.st_mtime_ns > _RACY_NS:
            self._heads[name] = (key, target)
        else:
            self._heads.pop(name, None)
        return target

    def scenarios(self) -> list[str]:
        return sorted(
            name[len(SCENARIOS_REF) :] for name in self._repo().listall_references() if name.startswith(SCENARIOS_REF)
        )

    def get(self, release_id: str) -> Release:
        """One release (a full or abbreviated id). Each call returns a fresh object; the raw manifest of an
        immutable release is cached."""
        raw = self._cache.get(release_id) if isinstance(release_id, str) else None
        if raw is None:
            rid = self._resolve(release_id)
            raw = self._cache.get(rid)
            if raw is None:
                commit = self._read(rid)
                try:
                    data = self._manifest_blob(commit, MANIFEST)
                    content_id = json.loads(data)["content_id"]
                except (KeyError, ValueError, TypeError):
                    raise NotFound(f"{rid} is not a release (no {MANIFEST})", release_id=rid) from None
                if not isinstance(content_id, str) or not _OID_RE.fullmatch(content_id):
                    # it names the release's checkout directory: a crafted one (``../../x``) must never be a path
                    raise StorageError(f"release {rid}: its manifest's content_id {content_id!r} is not a git tree "
                                       "id; not read", release_id=rid)
                raw = (rid, data, commit.message)
                with self._cache_lock:
                    if len(self._cache) > 8192:
                        self._cache.clear()
                    self._cache[rid] = raw
        rid, data, message = raw
        manifest = json.loads(data)
        return Release(
            release_id=rid,
            content_id=manifest["content_id"],
            scenario=manifest["scenario"],
            step=int(manifest["step"]),
            operation=manifest["operation"],
            kind=manifest["kind"],
            recipe=manifest["recipe"],
            parent=manifest.get("parent"),
            source=manifest.get("source"),
            metrics=manifest.get("metrics") or {},
            receipts=manifest.get("receipts") or [],
            settings=manifest.get("settings") or {},
            created_at=float(manifest["created_at"]),
            message=message,
            lfs=manifest.get("lfs") or {},
        )

    def history(self, scenario: str, limit: int | None = None) -> list[Release]:
        """The chain, newest first (first-parent walk from the head)."""
        out: list[Release] = []
        rid = self.head(scenario)
        while rid is not None and (limit is None or len(out) < limit):
            out.append(self.get(rid))
            parents = self._read(rid).parent_ids
            rid = str(parents[0]) if parents else None
        return out

    def belongs(self, scenario: str, release_id: str) -> bool:
        """Whether the release is on the scenario's chain (the head or one of its ancestors)."""
        head = self.head(scenario)
        try:
            rid = self._resolve(release_id)
        except ReefError:
            return False
        return head is not None and (rid == head or self._descends(head, rid))

    is_ancestor = belongs

    def files(self, release_id: str) -> list[FileEntry]:
        """The artifact's files (the manifest excluded), with sizes of the real bytes for LFS files."""
        release = self.get(release_id)
        out = []
        for path, blob_id, mode in self._walk(self._read(release.release_id).tree_id):
            if path == MANIFEST:
                continue
            lfs = release.lfs.get(path)
            if lfs is not None:
                out.append(FileEntry(path, int(lfs["size"]), mode, blob_id, lfs["oid"].split(":", 1)[1]))
            else:
                out.append(FileEntry(path, self._size(blob_id), mode, blob_id, None))
        return out

    def read_file(self, release_id: str, path: str) -> bytes:
        """The bytes of one file of a release (LFS pointers resolved)."""
        release = self.get(release_id)
        node: pygit2.Object = self._tree(self._read(release.release_id))
        try:
            for part in path.split("/"):  # each tree on the way read through _read
                if not isinstance(node, pygit2.Tree):
                    raise KeyError(path)
                node = self._read(node[part].id)
        except KeyError:
            raise NotFound(f"release {release.release_id} has no file {path!r}", path=path) from None
        if not isinstance(node, pygit2.Blob):
            raise NotFound(f"{path!r} is a directory in release {release.release_id}", path=path)
        lfs = release.lfs.get(path)
        if lfs is None:
            return node.data
        return self._lfs_object(lfs).read_bytes()

    def lfs_path(self, sha256: str) -> Path:
        if not isinstance(sha256, str) or not _SHA256_RE.fullmatch(sha256):  # it becomes a path
            raise StorageError(f"{sha256!r} is not an LFS object id (sha256 hex)", path=str(self.lfs_dir))
        return self.lfs_dir / sha256[:2] / sha256[2:4] / sha256

    def checkout(self, release_id: str, dest: str | os.PathLike[str], *, link: bool = False) -> Path:
        """Materialise a release's artifact (without the manifest) into the new directory ``dest``, atomically.

        With ``link=True`` large files are hard links to the store's read-only LFS objects (no copy; never
        write to them). ``dest`` must not exist."""
        release = self.get(release_id)
        dest = Path(dest)
        if dest.exists():
            raise BadRequest(f"checkout destination {dest} already exists", param="dest")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        except OSError as e:
            raise StorageError(f"checkout of {release.release_id} into {dest} failed: {e}", path=str(dest)) from e
        root = tmp.resolve()
        try:
            for path, blob_id, mode in self._walk(self._read(release.release_id).tree_id):
                if path == MANIFEST:
                    continue
                target = tmp / path
                if not target.resolve().is_relative_to(root):  # _walk refuses such names; this is the last word
                    raise StorageError(f"release {release.release_id}: {path!r} would be written outside {dest}; "
                                       "not checked out", path=str(dest))
                target.parent.mkdir(parents=True, exist_ok=True)
                lfs = release.lfs.get(path)
                if lfs is None:
                    target.write_bytes(self._read(blob_id).data)
                else:
                    obj = self._lfs_object(lfs)
                    try:
                        if not link or mode == _EXEC:  # a link shares the object's inode and mode
                            raise OSError(errno.EXDEV, "copy asked")
                        os.link(obj, target)
                    except OSError:
                        shutil.copyfile(obj, target)
                if mode == _EXEC:
                    os.chmod(target, 0o755)
            durable.sync_tree(tmp)  # the contents are durable before the name is (the caller syncs dest.parent)
            os.rename(tmp, dest)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                if dest.exists():  # a concurrent checkout got there first
                    raise BadRequest(f"checkout destination {dest} already exists", param="dest") from e
                raise StorageError(f"checkout of {release.release_id} into {dest} failed: {e}", path=str(dest)) from e
            raise
        return dest

    def pending(self, scenario: str) -> list[Release]:
        """Candidates held for review (``hold``), newest first."""
        prefix = f"{PENDING_REF}{check_scenario(scenario)}/"
        ids = [n[len(prefix) :] for n in self._repo().listall_references() if n.startswith(prefix)]
        return sorted((self.get(i) for i in ids), key=lambda r: r.created_at, reverse=True)

    def rejections(self, scenario: str, limit: int | None = None) -> list[Rejection]:
        """Rejected candidates, newest first."""
        ref = self._repo().references.get(REJECTED_REF + check_scenario(scenario))
        out: list[Rejection] = []
        rid = None if ref is None else str(ref.target)
        while rid is not None and (limit is None or len(out) < limit):
            commit = self._read(rid)
            d = json.loads(self._manifest_blob(commit, REJECTION))
            out.append(
                Rejection(
                    rejection_id=rid,
                    scenario=d["scenario"],
                    step=int(d["step"]),
                    verdict=d["verdict"],
                    reason=d["reason"],
                    metrics=d.get("metrics") or {},
                    base=d.get("base"),
                    candidate=d.get("candidate"),
                    content_id=d.get("content_id"),
                    kind=d.get("kind"),
                    recipe=d.get("recipe"),
                    receipts=d.get("receipts") or [],
                    created_at=float(d["created_at"]),
                )
            )
            rid = str(commit.parent_ids[0]) if commit.parent_ids else None
        return out

    # --- publishing ----------------------------------------------------------------------------------------

    def publish(
        self,
        scenario: str,
        files: Mapping[str, FileSource],
        *,
        expected_head: str | None,
        operation: str,
        kind: str,
        recipe: str,
        metrics: Mapping[str, Any] | None = None,
        receipts: list[str] | None = None,
        source: str | None = None,
        settings: Mapping[str, Any] | None = None,
        summary: str | None = None,
    ) -> Release:
        """Publish ``files`` as the next release of ``scenario`` if its head is still ``expected_head``.

        ``expected_head=None`` means the chain must not exist yet (and then ``operation`` must be ``init``).
        Raises ``HeadMoved`` (nothing changed) if the head is not ``expected_head``, ``LockBusy`` if another
        writer held the ref lock past ``lock_timeout``."""
        check_scenario(scenario)
        self._check_meta(operation, kind, expected_head, source)
        expected = self._expected(expected_head)
        self._precheck(scenario, expected)
        if source is not None:
            source = self._resolve(source)
        if kind == "weights" and lora.MANIFEST in files:
            self._check_adapter(scenario, files, expected)
        content, lfs = self._write_content(files)
        if operation == "train" and expected is not None and content == self._content_tree(expected):
            raise Unchanged(scenario, content)  # a release that changes nothing is no release
        return self._publish_tree(
            scenario,
            content,
            lfs,
            expected=expected,
            operation=operation,
            kind=kind,
            recipe=recipe,
            metrics=metrics,
            receipts=receipts,
            source=source,
            settings=settings,
            summary=summary,
        )

    def adapter(self, release_id: str) -> lora.AdapterManifest | None:
        """The base an adapter release applies to (``daemon/lora.py``), or None for a release of whole weights."""
        rel = self.get(release_id)
        try:
            data = self._manifest_blob(self._read(rel.release_id), lora.MANIFEST)
        except KeyError:
            return None
        return lora.AdapterManifest.parse(data, f"release {rel.release_id}: {lora.MANIFEST}")

    def base_model(self, scenario: str) -> str | None:
        """The content id of the whole model the scenario's head serves: the head's own content, or the base its
        adapter applies to; None for a chain that does not exist yet."""
        head = self.head(scenario)
        if head is None:
            return None
        adapter = self.adapter(head)
        return adapter.base_content_id if adapter is not None else self.get(head).content_id

    def _check_adapter(self, scenario: str, files: Mapping[str, FileSource], expected: str | None) -> None:
        """An adapter is published only on the model it was trained on: its manifest names a release of whole
        weights by id and content id, and (unless this is the chain's first release) that content is the model
        the scenario's head serves. Otherwise ``BaseMismatch``: nothing is written."""
        src = files[lora.MANIFEST]
        data = Path(src).read_bytes() if isinstance(src, os.PathLike) else src.encode() if isinstance(src, str) \
            else bytes(src)
        manifest = lora.AdapterManifest.parse(data)
        lora.check_layout(files)
        try:
            base = self.get(manifest.base_release_id)
        except NotFound:
            raise BaseMismatch(f"the adapter's base release {manifest.base_release_id} is not in the store; "
                               "not published", expected=None, actual=manifest.base_content_id) from None
        if base.content_id != manifest.base_content_id or base.kind != "weights" or self.adapter(base.release_id):
            raise BaseMismatch(
                f"the adapter names base content {manifest.base_content_id}, but release {base.release_id} holds "
                f"{'an adapter' if self.adapter(base.release_id) else base.content_id}; not published",
                expected=base.content_id, actual=manifest.base_content_id)
        serving = self.base_model(scenario) if expected is not None else manifest.base_content_id
        if serving != manifest.base_content_id:
            raise BaseMismatch(
                f"the adapter was trained on base {manifest.base_content_id}, but scenario {scenario!r} serves base "
                f"{serving}; not published", expected=serving, actual=manifest.base_content_id, scenario=scenario)

    def rollback(
        self, scenario: str, release_id: str, *, expected_head: str | None = None, summary: str | None = None
    ) -> Release:
        """Publish the content of an earlier release of this chain as a new release (step + 1).

        ``expected_head=None``: the head as read now (still compare-and-swapped against that read)."""
        check_scenario(scenario)
        rid = self._resolve(release_id)
        head = self.head(scenario)
        if head is None:
            raise NotFound(f"scenario {scenario!r} has no releases", scenario=scenario)
        if not self.belongs(scenario, rid):
            raise BadRequest(
                f"release {rid} is not on the release chain of scenario {scenario!r}",
                param="release_id",
                release_id=rid,
                scenario=scenario,
            )
        expected = head if expected_head is None else self._expected(expected_head)
        src = self.get(rid)
        return self._publish_tree(
            scenario,
            self._content_tree(rid),
            src.lfs,
            expected=expected,
            operation="rollback",
            kind=src.kind,
            recipe=src.recipe,
            metrics=src.metrics,
            receipts=[],
            source=rid,
            settings=src.settings,
            summary=summary or f"roll back to step {src.step} ({rid[:12]})",
        )

    def hold(
        self,
        scenario: str,
        files: Mapping[str, FileSource],
        *,
        kind: str,
        recipe: str,
        base: str | None = None,
        metrics: Mapping[str, Any] | None = None,
        receipts: list[str] | None = None,
        settings: Mapping[str, Any] | None = None,
        summary: str | None = None,
    ) -> Release:
        """Store a candidate for review without releasing it: a commit on ``refs/reef/pending/<s>/<id>`` whose
        parent is ``base`` (default: the current head). ``promote`` releases it; ``record_rejection`` with
        ``candidate=`` discards it."""
        check_scenario(scenario)
        self._check_meta("train", kind, "0" * 40, None)
        head = self.head(scenario)
        if head is None:
            raise NotFound(f"scenario {scenario!r} has no releases", scenario=scenario)
        base_id = head if base is None else self._resolve(base)
        if not self.belongs(scenario, base_id):
            raise BadRequest(f"base {base_id} is not on the chain of scenario {scenario!r}", param="base")
        content, lfs = self._write_content(files)
        commit_id, _ = self._write_release_commit(
            scenario,
            content,
            lfs,
            parent=base_id,
            operation="train",
            kind=kind,
            recipe=recipe,
            metrics=metrics,
            receipts=receipts,
            source=None,
            settings=settings,
            summary=summary or "candidate held for review",
        )
        ref = f"{PENDING_REF}{scenario}/{commit_id}"
        self._update_refs(
            [_RefUpdate(ref, commit_id, None, lambda actual: Conflict(f"{ref} already exists", ref=ref))],
            message=f"reef hold: {scenario}",
        )
        return self.get(commit_id)

    def promote(
        self, scenario: str, pending_id: str, *, expected_head: str | None = None, summary: str | None = None
    ) -> Release:
        """Release a held candidate: its content becomes the next release (operation ``promote``)."""
        check_scenario(scenario)
        pid = self._resolve(pending_id, "pending candidate")
        pending_ref = f"{PENDING_REF}{scenario}/{pid}"
        if self._repo().references.get(pending_ref) is None:
            raise NotFound(f"no pending candidate {pid} in scenario {scenario!r}", release_id=pid, scenario=scenario)
        head = self.head(scenario)
        expected = head if expected_head is None else self._expected(expected_head)
        cand = self.get(pid)
        promoted_ref = f"{PROMOTED_REF}{scenario}/{pid}"

        def gone(actual: str | None) -> ReefError:
            return Conflict(f"pending candidate {pid} was promoted or discarded meanwhile", release_id=pid)

        return self._publish_tree(
            scenario,
            self._content_tree(pid),
            cand.lfs,
            expected=expected,
            operation="promote",
            kind=cand.kind,
            recipe=cand.recipe,
            metrics=cand.metrics,
            receipts=cand.receipts,
            source=pid,
            settings=cand.settings,
            summary=summary or f"promote candidate {pid[:12]}",
            extra=[_RefUpdate(pending_ref, None, pid, gone), _RefUpdate(promoted_ref, pid, None, gone)],
        )

    def record_rejection(
        self,
        scenario: str,
        *,
        verdict: str,
        reason: str,
        metrics: Mapping[str, Any] | None = None,
        step: int | None = None,
        base: str | None = None,
        candidate: str | None = None,
        content_id: str | None = None,
        kind: str | None = None,
        recipe: str | None = None,
        receipts: list[str] | None = None,
    ) -> Rejection:
        """Write down a candidate the gate (or a reviewer) rejected, on ``refs/reef/rejected/<scenario>``.

        ``step`` defaults to the step the candidate would have had (head step + 1); ``base`` to the head.
        ``candidate`` names a held candidate: its content is kept in the rejection (``candidate/``) and it
        leaves the pending list."""
        check_scenario(scenario)
        head = self.head(scenario)
        base_id = head if base is None else self._resolve(base)
        if step is None:
            step = self.get(base_id).step + 1 if base_id else 0
        repo = self._repo()
        cand_tree = None
        pending_ref = None
        if candidate is not None:
            cand = self.get(candidate)
            candidate = cand.release_id
            cand_tree = self._content_tree(candidate)
            content_id = cand.content_id
            kind, recipe = kind or cand.kind, recipe or cand.recipe
            metrics = metrics if metrics is not None else cand.metrics
            receipts = receipts if receipts is not None else cand.receipts
            ref = f"{PENDING_REF}{scenario}/{candidate}"
            pending_ref = ref if repo.references.get(ref) is not None else None
        now = time.time()
        record = {
            "scenario": scenario,
            "step": int(step),
            "verdict": verdict,
            "reason": reason,
            "metrics": dict(metrics or {}),
            "base": base_id,
            "candidate": candidate,
            "content_id": content_id,
            "kind": kind,
            "recipe": recipe,
            "receipts": list(receipts or []),
            "created_at": now,
        }
        record_bytes = _json(record).encode()
        with _storing("writing the rejection", self.path):
            tb = repo.TreeBuilder()
            tb.insert(REJECTION, repo.create_blob(record_bytes), _BLOB)
            if cand_tree is not None:
                tb.insert("candidate", pygit2.Oid(hex=cand_tree), _TREE)
            tree = tb.write()
        message = (
            f"reject {scenario} step {step}: {_one_line(verdict, 40)}: {_one_line(reason, 80)}\n\n"
            f"Reef-Scenario: {scenario}\nReef-Step: {step}\nReef-Verdict: {_one_line(verdict, 40)}\n"
            + (f"Reef-Candidate: {candidate}\n" if candidate else "")
        )
        rej_ref = REJECTED_REF + scenario
        sig = self._signature(now)
        for _ in range(100):  # an append-only log: a lost race just re-parents onto the new tip
            tip_ref = repo.references.get(rej_ref)
            tip = None if tip_ref is None else str(tip_ref.target)
            with _storing("writing the rejection", self.path):
                commit_id = str(repo.create_commit(None, sig, sig, message, tree, [tip] if tip else []))
            updates = [_RefUpdate(rej_ref, commit_id, tip, lambda a, t=tip: HeadMoved(scenario, t, a))]
            if pending_ref is not None:
                updates.append(
                    _RefUpdate(
                        pending_ref,
                        None,
                        candidate,
                        lambda a: Conflict(f"pending candidate {candidate} was promoted or discarded meanwhile"),
                    )
                )
            try:
                self._update_refs(updates, message=f"reef reject: {scenario} step {step}")
            except HeadMoved:
                if self.remote is not None:  # another daemon appended to the shared log: take its tip in
                    self.follow()
                continue
            return self.rejections(scenario, limit=1)[0]
        raise Conflict(f"the rejection log of {scenario!r} kept moving; nothing was recorded", scenario=scenario)

    # --- internals of publishing ---------------------------------------------------------------------------

    @staticmethod
    def _check_meta(operation: str, kind: str, expected_head: str | None, source: str | None) -> None:
        if operation not in OPERATIONS:
            raise BadRequest(f"unknown operation {operation!r}: one of {', '.join(OPERATIONS)}", param="operation")
        if kind not in KINDS:
            raise BadRequest(f"unknown artifact kind {kind!r}: one of {', '.join(KINDS)}", param="kind")
        if (operation == "init") != (expected_head is None):
            raise BadRequest(
                "an init release starts a chain (expected_head must be None), and only an init may",
                param="expected_head",
            )
        if operation in ("rollback", "promote") and source is None:
            raise BadRequest(f"a {operation} release names its source", param="source")

    @staticmethod
    def _expected(expected_head: str | None) -> str | None:
        if expected_head is None:
            return None
        if not isinstance(expected_head, str) or not re.fullmatch(r"[0-9a-f]{40}", expected_head.strip().lower()):
            raise BadRequest(f"expected_head must be a full release id, not {expected_head!r}", param="expected_head")
        return expected_head.strip().lower()

    def _precheck(self, scenario: str, expected: str | None) -> None:
        """Fail before writing objects when the head has visibly moved already (the CAS decides anyway)."""
        actual = self.head(scenario)
        if actual != expected:
            raise HeadMoved(scenario, expected, actual)

    def _publish_tree(
        self,
        scenario: str,
        content: str,
        lfs: Mapping[str, dict[str, Any]],
        *,
        expected: str | None,
        operation: str,
        kind: str,
        recipe: str,
        metrics: Mapping[str, Any] | None,
        receipts: list[str] | None,
        source: str | None,
        settings: Mapping[str, Any] | None,
        summary: str | None,
        extra: list[_RefUpdate] | None = None,
    ) -> Release:
        self._precheck(scenario, expected)
        commit_id, step = self._write_release_commit(
            scenario,
            content,
            lfs,
            parent=expected,
            operation=operation,
            kind=kind,
            recipe=recipe,
            metrics=metrics,
            receipts=receipts,
            source=source,
            settings=settings,
            summary=summary,
        )
        update = _RefUpdate(SCENARIOS_REF + scenario, commit_id, expected, lambda a: HeadMoved(scenario, expected, a))
        self._update_refs([update, *(extra or [])], message=f"reef {operation}: {scenario} step {step}")
        return self.get(commit_id)

    def _write_release_commit(
        self,
        scenario: str,
        content: str,
        lfs: Mapping[str, dict[str, Any]],
        *,
        parent: str | None,
        operation: str,
        kind: str,
        recipe: str,
        metrics: Mapping[str, Any] | None,
        receipts: list[str] | None,
        source: str | None,
        settings: Mapping[str, Any] | None,
        summary: str | None,
    ) -> tuple[str, int]:
        repo = self._repo()
        step = 0 if parent is None else self.get(parent).step + 1
        now = time.time()
        manifest = {
            "version": 1,
            "scenario": scenario,
            "kind": kind,
            "recipe": recipe,
            "step": step,
            "operation": operation,
            "metrics": dict(metrics or {}),
            "parent": parent,
            "receipts": [str(r) for r in (receipts or [])],
            "source": source,
            "settings": dict(settings or {}),
            "created_at": now,
            "content_id": content,
            "lfs": {k: dict(v) for k, v in sorted(lfs.items())},
        }
        manifest_bytes = _json(manifest).encode()
        with _storing("writing the release manifest", self.path):
            tb = repo.TreeBuilder(repo[content])
            tb.insert(MANIFEST, repo.create_blob(manifest_bytes), _BLOB)
            tree = tb.write()
        default = {"init": "base artifact", "train": "new candidate"}.get(operation, operation)
        trailers = [
            f"Reef-Scenario: {scenario}",
            f"Reef-Step: {step}",
            f"Reef-Operation: {operation}",
            f"Reef-Kind: {kind}",
            f"Reef-Content: {content}",
        ]
        if source is not None:
            trailers.append(f"Reef-Source: {source}")
        message = (
            f"{operation} {scenario} step {step}: {_one_line(summary or default)}\n\n" + "\n".join(trailers) + "\n"
        )
        sig = self._signature(now)
        with _storing("writing the release commit", self.path):
            commit_id = repo.create_commit(None, sig, sig, message, tree, [parent] if parent else [])
        return str(commit_id), step

    def _write_content(self, files: Mapping[str, FileSource]) -> tuple[str, dict[str, dict[str, Any]]]:
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
            raise StorageError(f"writing artifact failed: {e}", path=str(self.path)) from e
        except pygit2.GitError as e:
            raise StorageError(f"writing artifact failed: {e}", path=str(self.path)) from e

    def _write_tree(self, node: dict[str, Any]) -> pygit2.Oid:
        repo = self._repo()
        tb = repo.TreeBuilder()
        for name, value in node.items():
            if isinstance(value, dict):
                tb.insert(name, self._write_tree(value), _TREE)
            else:
                tb.insert(name, value[0], value[1])
        return tb.write()

    def _write_file(self, path: str, src: FileSource) -> tuple[pygit2.Oid, int, dict[str, Any] | None]:
        repo = self._repo()
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
            if st.st_size > self.lfs_threshold:
                sha, size = self._store_lfs(p)
            else:
                return repo.create_blob(p.read_bytes()), mode, None
        elif isinstance(src, bytes | bytearray | memoryview):
            data = bytes(src)
            if len(data) <= self.lfs_threshold:
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
        final = self.lfs_path(sha)
        if final.exists() and final.stat().st_size == size:
            return sha, size
        fd, tmp = tempfile.mkstemp(dir=self._lfs_tmp, prefix="obj-")
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

    def _lfs_object(self, lfs: Mapping[str, Any]) -> Path:
        sha = str(lfs["oid"]).split(":", 1)[-1]
        path = self.lfs_path(sha)
        if not path.exists():
            raise StorageError(f"LFS object {sha} is missing from {self.lfs_dir}", path=str(path))
        return path

    # --- refs: compare-and-swap under git's ref locks -----------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, *, exclusive: bool, blocking: bool) -> Iterator[bool]:
        """The flock that tells live Reef ref writers (shared) from a stale-lock remover (exclusive)."""
        fd = os.open(self._guard_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _update_refs(self, updates: list[_RefUpdate], *, message: str, push: bool = True) -> None:
        """Apply ref updates all-or-nothing-checked: lock each ref, re-read it under the lock, compare with the
        expected value, then write. A busy lock is retried with backoff until ``lock_timeout``.

        No ref is moved to a commit that does not read back (``_check_written``), and a write that fails part-way
        takes back the reflog line libgit2 appended before it failed (``_drop_unapplied``). With a remote (and
        ``push``), the updates are pushed first, compare-and-swap on the remote's refs (``_push``)."""
        self._check_written(updates)
        if push and self.remote is not None:
            self._push(updates, message)
        else:
            self._apply_local(updates, message)

    def _push(self, updates: list[_RefUpdate], message: str) -> None:
        """Push ``updates`` to the remote (their LFS objects first); the remote's refs must be at the expected
        values. Then the same updates locally (or, when a follow took the remote's refs in meanwhile, a follow)."""
        assert self.remote is not None
        scenario = next((u.name.rsplit("/", 1)[-1] for u in updates if u.name.startswith(SCENARIOS_REF)),
                        updates[0].name)
        self.remote.upload(self._lfs_between([(u.new, u.expected) for u in updates if u.new is not None]))
        try:
            self.remote.push([RefPush(u.name, u.new, u.expected) for u in updates], scenario)
        except HeadMoved:
            with contextlib.suppress(ReefError):  # take in what won, so the caller can serve it at once
                self.follow()
            raise
        try:
            self._apply_local(updates, message)
        except Conflict:  # a follow took the remote's refs in meanwhile: match the remote again
            self.follow()

    def _lfs_between(self, ranges: list[tuple[str, str | None]]) -> list[tuple[str, int, Path]]:
        """The local LFS objects ``(sha256, size, path)`` the releases from each ``new`` back to (not including)
        ``stop`` name, first parents only."""
        out: dict[str, tuple[str, int, Path]] = {}
        for new, stop in ranges:
            rid: str | None = new
            while rid is not None and rid != stop:
                commit = self._read(rid)
                if MANIFEST in self._tree(commit):
                    for entry in (json.loads(self._manifest_blob(commit, MANIFEST)).get("lfs") or {}).values():
                        sha = str(entry["oid"]).split(":", 1)[-1]
                        out[sha] = (sha, int(entry["size"]), self._lfs_object(entry))
                rid = str(commit.parent_ids[0]) if commit.parent_ids else None
        return list(out.values())

    def follow(self) -> list[str]:
        """Take in what the remote has: fetch its ``refs/reef/*``, then move each local ref that differs to the
        remote's value (its LFS objects copied in first). Returns the refs moved. On the first call, local refs
        the remote lacks (chains made before it was configured) are pushed to it. ``RemoteRefused`` when the
        remote cannot be read; nothing local changes then.

        Every commit a ref would newly reach is checked first (``_incoming``): a ref whose new releases fail is
        left where it is (the rest are taken in) and the follow ends in ``RemoteReleaseRefused`` naming each."""
        if self.remote is None:
            return []
        with self._follow_lock:
            repo = self._repo()
            # the local refs before the fetch: each was on the remote before it was here (pushes come first), so
            # one the fetch does not bring was removed there, not made here meanwhile
            local = {n: str(repo.references[n].target) for n in repo.listall_references() if n.startswith("refs/reef/")}
            remote = self.remote.fetch()
            moved: list[str] = []
            refused: list[str] = []
            checked: set[str] = set()
            for name, oid in sorted(remote.items()):
                cur = local.get(name)
                if cur == oid:
                    continue
                why = self._refused.get(oid) or self._incoming_range(oid, cur, checked)
                if why is not None:
                    if oid not in self._refused:
                        log.error("not taking in %s = %s from the chain remote %s: %s", name, oid, self.remote.shown,
                                  why)
                        if len(self._refused) > 1024:
                            self._refused.clear()
                        self._refused[oid] = why
                    refused.append(f"{why} (ref {name})")
                    continue
                rid: str | None = oid
                while rid is not None and rid != cur:  # LFS objects first: a head never names missing bytes
                    commit = self._read(rid)
                    if MANIFEST in self._tree(commit):
                        for entry in (json.loads(self._manifest_blob(commit, MANIFEST)).get("lfs") or {}).values():
                            sha = str(entry["oid"]).split(":", 1)[-1]
                            if not self.lfs_path(sha).exists():
                                self.remote.download(sha, int(entry["size"]), self.lfs_path(sha))
                    rid = str(commit.parent_ids[0]) if commit.parent_ids else None
                if cur is not None and not self._descends(oid, cur):
                    log.warning("%s: local %s is not an ancestor of the remote's %s; following the remote", name,
                                cur, oid)
                try:
                    self._update_refs([_RefUpdate(name, oid, cur, lambda a: Conflict("moved meanwhile"))],
                                      message="reef follow", push=False)
                except Conflict:
                    continue  # moved meanwhile (a publish of ours): the next follow looks again
                moved.append(name)
            if not self._seeded:
                for name, cur in sorted(local.items()):
                    if name not in remote:
                        with contextlib.suppress(HeadMoved):  # another daemon seeded it first: followed next time
                            self.remote.upload(self._lfs_between([(cur, None)]))
                            self.remote.push([RefPush(name, cur, None)], name.rsplit("/", 1)[-1])
                self._seeded = True
            else:  # every local ref is on the remote since the seeding: a pending one gone there was promoted or
                # discarded by another daemon
                for name, cur in sorted(local.items()):
                    if name not in remote and name.startswith(PENDING_REF):
                        with contextlib.suppress(Conflict):
                            self._update_refs([_RefUpdate(name, None, cur, lambda a: Conflict("moved meanwhile"))],
                                              message="reef follow", push=False)
                            moved.append(name)
            if refused:
                raise RemoteReleaseRefused(self.remote.shown, refused, moved)
            return moved

    def _incoming_range(self, new: str, cur: str | None, checked: set[str]) -> str | None:
        """Why the ref may not move from ``cur`` to ``new`` (fetched from the remote), or None: each commit from
        ``new`` back to ``cur`` (first parents; ones taken in before are not checked again) through ``_incoming``."""
        rid: str | None = new
        passed = []
        while rid is not None and rid != cur and rid not in self._taken:
            why = self._incoming(rid, checked)
            if why is not None:
                return f"release {rid}: {why}"
            passed.append(rid)
            parents = self._read(rid).parent_ids
            rid = str(parents[0]) if parents else None
        if len(self._taken) > 65536:
            self._taken.clear()
        self._taken.update(passed)
        return None

    def _incoming(self, rid: str, checked: set[str]) -> str | None:
        """Why the commit ``rid``, fetched from the remote, must not be taken in, or None. Nothing it holds is
        read before its size is known: every object's header is checked against the remote's ``max_blob_bytes``
        (so a small pack that inflates to gigabytes is refused without being inflated), every LFS object it names
        against ``max_lfs_bytes``. Every tree entry name must be safe on disk (``_walk``), the manifest's
        ``content_id`` must be the commit's content tree (it names a checkout directory), and LFS ids must be
        sha256 ids (they name files). A chain is linear: a merge is refused."""
        assert self.remote is not None
        max_blob, max_lfs = self.remote.max_blob_bytes, self.remote.max_lfs_bytes
        try:
            self._size(rid, max_blob)
            commit = self._read(rid)
            if not isinstance(commit, pygit2.Commit):
                return "it is not a commit"
            if len(commit.parent_ids) > 1:
                return "it has more than one parent (a release chain is linear)"
            for _path, blob_id, _mode in self._walk(commit.tree_id, max_size=max_blob):
                if blob_id not in checked:
                    self._size(blob_id, max_blob)
                    checked.add(blob_id)
            tree = self._tree(commit)
            if MANIFEST in tree:
                manifest = json.loads(self._manifest_blob(commit, MANIFEST))
                if not isinstance(manifest, dict):
                    return f"its {MANIFEST} is not a JSON object"
                cid = manifest.get("content_id")
                if not isinstance(cid, str) or not _OID_RE.fullmatch(cid):
                    return f"its content_id {cid!r} is not a git tree id"
                actual = self._content_tree(rid)
                if cid != actual:
                    return f"its content_id {cid} is not its content ({actual})"
                lfs = manifest.get("lfs") or {}
                if not isinstance(lfs, dict):
                    return f"its {MANIFEST} lfs table is not an object"
                for path, entry in lfs.items():
                    oid = entry.get("oid") if isinstance(entry, dict) else None
                    size = entry.get("size") if isinstance(entry, dict) else None
                    sha = oid[len("sha256:"):] if isinstance(oid, str) and oid.startswith("sha256:") else ""
                    if not _SHA256_RE.fullmatch(sha) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
                        return f"its large file {path!r} has no valid LFS id and size"
                    if any(unsafe_name(part) for part in str(path).split("/")):
                        return f"its large file {path!r} is not a safe path"
                    if size > max_lfs:
                        return (f"its large file {path!r} is {size} bytes, over the bound of {max_lfs} "
                                "(chain_max_lfs_bytes)")
                self.get(rid)  # and reads as a release
            if REJECTION in tree:
                cid = json.loads(self._manifest_blob(commit, REJECTION)).get("content_id")
                if cid is not None and (not isinstance(cid, str) or not _OID_RE.fullmatch(cid)):
                    return f"its {REJECTION} content_id {cid!r} is not a git tree id"
        except _TooLarge as e:
            return f"{e} (chain_max_blob_bytes)"
        except ReefError as e:
            return e.message
        except (KeyError, ValueError, TypeError, AttributeError, pygit2.GitError) as e:
            return f"it does not read as a release: {type(e).__name__}: {e}"
        return None

    def _apply_local(self, updates: list[_RefUpdate], message: str) -> None:
        repo = self._repo()
        start = time.monotonic()
        delay = 0.002
        while True:
            busy: str | None = None
            failed: Exception | None = None
            with self._guard(exclusive=False, blocking=True):
                tx = repo.transaction()
                try:
                    with tx:
                        for u in sorted(updates, key=lambda u: u.name):
                            tx.lock_ref(u.name)
                        for u in updates:
                            ref = repo.references.get(u.name)
                            actual = None if ref is None else str(ref.target)
                            if actual != u.expected:
                                raise u.conflict(actual)
                        for u in updates:
                            if u.new is None:
                                tx.remove(u.name)
                            else:
                                tx.set_target(u.name, u.new, message=message)
                    for u in updates:  # committed when the with-block closed
                        self._fresh.pop(u.name, None)
                    return
                except (pygit2.GitError, OSError) as e:
                    m = _LOCK_MSG.search(str(e))
                    if m is None:
                        failed = e
                    else:
                        busy = m.group(1)
                finally:
                    # A commit that failed inside __exit__ leaves the transaction unfreed, and with it any ref
                    # locks it still holds; free it now, before sleeping, not whenever it is collected.
                    tx.__exit__(RuntimeError, None, None)
            if failed is not None:  # a full or failing disk (the transaction is freed: its locks are released)
                for u in updates:
                    self._fresh.pop(u.name, None)
                self._drop_unapplied(updates)
                raise StorageError(f"updating {updates[0].name} failed: {failed}", path=str(self.path)) from failed
            assert busy is not None
            waited = time.monotonic() - start
            if waited >= self.lock_timeout:
                raise LockBusy(updates[0].name, busy, waited)
            self._clear_if_stale(Path(busy))
            time.sleep(min(delay, max(0.0, self.lock_timeout - waited)) * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 0.1)

    def _clear_if_stale(self, lock: Path) -> bool:
        with self._guard(exclusive=True, blocking=False) as alone:
            if not alone:
                return False
            try:
                if time.time() - lock.stat().st_mtime < self.stale_lock_after:
                    return False
                lock.unlink()
            except FileNotFoundError:
                return False
            return True

    # --- what a full or failing disk can leave: checked before a ref moves, repaired at start-up ---------

    def _check_written(self, updates: list[_RefUpdate]) -> None:
        """Refuse to point a ref at a commit that does not read back whole (commit, tree, manifest, files): on a
        full disk libgit2 can return the id of a commit it never wrote, and a head naming it makes every read of
        the scenario fail. Read through a freshly opened repository, so nothing comes from a cache."""
        new = sorted({u.new for u in updates if u.new is not None})
        if not new:
            return
        try:
            repo = pygit2.Repository(str(self.path))
        except (pygit2.GitError, OSError) as e:
            raise StorageError(f"cannot read back the release store {self.path}: {e}", path=str(self.path)) from e
        for commit_id in new:
            corrupt: list[Path] = []
            problem = _intact(repo, commit_id, corrupt=corrupt)
            if problem is not None:
                # A half-written object must go: libgit2 never rewrites an object it finds present, so the same
                # content written again would stay broken (and git fsck fails on it, referenced or not).
                for path in corrupt:
                    with contextlib.suppress(OSError):
                        path.unlink()
                raise StorageError(
                    f"{problem}: the write did not reach the disk (full or failing?); {updates[0].name} was not moved",
                    path=str(self.path), release_id=commit_id,
                )

    @contextlib.contextmanager
    def _ref_locked(self, name: str) -> Iterator[None]:
        """Hold git's lock on ``name`` (``<ref>.lock``) without changing the ref, for an edit of its reflog (git
        edits reflogs under the same lock). Busy: retried with backoff until ``lock_timeout``, then ``LockBusy``."""
        repo = self._repo()
        start = time.monotonic()
        delay = 0.002
        while True:
            busy: str | None = None
            with self._guard(exclusive=False, blocking=True):
                tx = repo.transaction()
                try:
                    try:
                        tx.lock_ref(name)
                    except pygit2.GitError as e:
                        m = _LOCK_MSG.search(str(e))
                        if m is None:
                            raise StorageError(f"locking {name} failed: {e}", path=str(self.path)) from e
                        busy = m.group(1)
                    else:
                        yield
                        return
                finally:
                    tx.__exit__(RuntimeError, None, None)  # frees it: the lock goes, nothing is applied
            waited = time.monotonic() - start
            if waited >= self.lock_timeout:
                raise LockBusy(name, busy, waited)
            self._clear_if_stale(Path(busy))
            time.sleep(min(delay, max(0.0, self.lock_timeout - waited)) * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 0.1)

    def _drop_unapplied(self, updates: list[_RefUpdate]) -> None:
        """After a ref update failed: libgit2 appends the reflog line before it renames the new ref into place, so
        a full disk can fail the rename after the line is written, leaving a reflog that claims a move that never
        happened (and, if the commit was lost too, one that ``git fsck`` rejects). Truncate that last line away
        (truncating needs no free space); what cannot be fixed now ``recover()`` fixes at start-up."""
        for u in updates:
            if u.new is None:
                continue
            path = self.path / "logs" / u.name
            try:
                with self._ref_locked(u.name):
                    ref = self._repo().references.get(u.name)
                    if ref is not None and str(ref.target) == u.new:
                        continue  # this one did apply
                    data = path.read_bytes()
                    lines = data.splitlines(keepends=True)
                    m = _REFLOG_LINE.match(lines[-1]) if lines else None
                    if m is None or m.group(2).decode() != u.new:
                        continue
                    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                    try:
                        os.ftruncate(fd, len(data) - len(lines[-1]))
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    log.warning("dropped the reflog line of a failed update of %s to %s", u.name, u.new)
            except (ReefError, OSError, pygit2.GitError) as e:
                log.warning("could not drop the reflog line of a failed update of %s: %s (start-up recovery will)",
                            u.name, e)

    def _repair(self) -> dict[str, Any]:
        """Move each dangling ref back to the newest intact commit it held (or remove it when none is left), then
        drop reflog entries naming missing objects. Every change is a compare-and-swap or done under the ref's
        lock, so a live writer elsewhere loses nothing; each is logged as an error, since it means a write was
        lost."""
        repaired: list[dict[str, Any]] = []
        failed: list[str] = []
        try:
            damage = find_damage(self.path)
        except (pygit2.GitError, OSError) as e:
            log.error("release store: cannot look for damage in %s: %s", self.path, e)
            return {"repaired": [], "reflog_trimmed": {}, "unrepaired": [str(e)]}
        for d in damage:
            if d.target is None:
                continue
            how = f"back to {d.restore}" if d.restore else "removed"
            update = _RefUpdate(d.ref, d.restore, d.target, lambda a, r=d.ref: Conflict(f"{r} moved meanwhile"))
            try:
                # local damage, repaired locally: the remote's copy is whole, and the next follow takes it in again
                self._update_refs([update], message=f"reef repair: {d.target} does not read back; {how}", push=False)
            except ReefError as e:
                if isinstance(e, Conflict) and not isinstance(e, LockBusy):
                    continue  # another writer moved it meanwhile: no longer this damage
                failed.append(f"{d.ref}: {e.message}")
                log.error("release store: %s points at %s, which does not read back (%s); could not repair it: %s",
                          d.ref, d.target, d.problem, e.message)
                continue
            repaired.append({"ref": d.ref, "was": d.target, "now": d.restore, "problem": d.problem})
            log.error("release store: %s pointed at %s, which does not read back (%s: a write lost to a full or "
                      "failing disk); moved it %s", d.ref, d.target, d.problem,
                      f"back to {d.restore}, the newest commit of it that exists" if d.restore else
                      "away: removed, since no commit of it exists")
        trimmed: dict[str, int] = {}
        readable = _readable_in(pygit2.Repository(str(self.path)))  # fresh: what is on disk, not in a cache
        for name, path in _reflogs(self.path):
            try:
                if not any(not _entry_ok(line, readable) for line in path.read_bytes().splitlines()):
                    continue
                with self._ref_locked(name):  # read again under the lock: a writer may have appended meanwhile
                    lines = path.read_bytes().splitlines(keepends=True)
                    keep = [line for line in lines if _entry_ok(line, readable)]
                    tmp = path.with_name(f"{path.name}.lock")  # git's own name for a reflog being rewritten
                    with open(tmp, "xb") as f:
                        f.writelines(keep)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                    durable.sync_dir(path.parent)
            except (ReefError, OSError) as e:
                failed.append(f"reflog of {name}: {e}")
                log.error("release store: the reflog of %s names missing objects; could not trim it: %s", name, e)
                continue
            trimmed[name] = len(lines) - len(keep)
            log.error("release store: dropped %d reflog entries of %s naming objects that are not there (a write "
                      "lost to a full or failing disk; git fsck rejects such entries)", trimmed[name], name)
        return {"repaired": repaired, "reflog_trimmed": trimmed, "unrepaired": failed}

    # --- maintenance ---------------------------------------------------------------------------------------

    def _lock_files(self) -> list[Path]:
        found = [p for d in ("refs", "logs") for p in (self.path / d).rglob("*.lock")]
        found += [self.path / n for n in ("packed-refs.lock", "HEAD.lock", "config.lock", "index.lock")]
        return [p for p in found if p.exists()]

    def recover(self, *, stale_after: float | None = None, tmp_after: float = 3600.0) -> dict[str, Any]:
        """Remove stale ``*.lock`` files (see the module docstring for how staleness is decided) and temp files
        older than ``tmp_after`` left by killed writers. Locks of live Reef writers are never touched: if one
        is inside a ref update the exclusive guard is not granted and nothing is removed (``busy``).

        Then repair what a write lost to a full or failing disk left (``Damage``): a ref pointing at a commit
        that does not read back goes back to the newest intact commit it held (``repaired``: ref, was, now),
        and reflog entries naming missing objects are dropped (``reflog_trimmed``: ref -> count), each logged
        as an error."""
        stale_after = self.stale_lock_after if stale_after is None else stale_after
        removed: list[str] = []
        kept: list[str] = []
        deadline = time.monotonic() + 2.0
        while True:
            with self._guard(exclusive=True, blocking=False) as alone:
                if alone:
                    now = time.time()
                    for lock in self._lock_files():
                        try:
                            if now - lock.stat().st_mtime >= stale_after:
                                lock.unlink()
                                removed.append(str(lock))
                            else:
                                kept.append(str(lock))
                        except FileNotFoundError:
                            pass
                    break
            if time.monotonic() >= deadline:
                return {"removed": [], "kept": [str(p) for p in self._lock_files()], "temp_removed": [], "busy": True,
                        **self._repair()}
            time.sleep(0.01)
        temp_removed: list[str] = []
        now = time.time()
        candidates = list(self._lfs_tmp.glob("obj-*")) + list((self.path / "objects").glob("**/tmp_*"))
        for tmp in candidates:
            with contextlib.suppress(FileNotFoundError):
                if now - tmp.stat().st_mtime >= tmp_after:
                    tmp.unlink()
                    temp_removed.append(str(tmp))
        return {"removed": removed, "kept": kept, "temp_removed": temp_removed, "busy": False, **self._repair()}

    def fsck(self) -> dict[str, Any]:
        """Read back every object reachable from every ref (libgit2 verifies object hashes on read), check each
        manifest, each chain's linearity and steps, and the sha256 and size of every LFS object referenced."""
        repo = self._repo()
        errors: list[str] = []
        seen: set[str] = set()
        lfs_ok: dict[str, bool] = {}
        counts = {"commits": 0, "trees": 0, "blobs": 0, "lfs_objects": 0}

        def walk_tree(tree_id: pygit2.Oid) -> None:
            stack = [tree_id]
            while stack:
                oid = stack.pop()
                key = str(oid)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    obj = _object(repo, oid)  # not repo[oid]: a truncated loose object hangs libgit2
                    if isinstance(obj, pygit2.Tree):
                        counts["trees"] += 1
                        stack.extend(e.id for e in obj)
                    else:
                        counts["blobs"] += 1
                        _ = obj.read_raw()
                except Exception as e:  # a corrupt object is a finding, not a crash
                    errors.append(f"object {key}: {e}")

        for name in repo.listall_references():
            if not name.startswith("refs/") or name.startswith(MIRROR_REF):
                continue  # the mirror is what the remote has; only what passed ``_incoming`` is the store's
            try:
                stack = [repo.references[name].target]
            except Exception as e:
                errors.append(f"ref {name}: {e}")
                continue
            while stack:
                oid = stack.pop()
                key = str(oid)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    commit = _object(repo, oid)
                    counts["commits"] += 1
                    walk_tree(commit.tree_id)
                    stack.extend(commit.parent_ids)
                    if MANIFEST in self._tree(commit):
                        self._check_release(commit, lfs_ok, errors)
                except Exception as e:
                    errors.append(f"commit {key} (from {name}): {e}")
        for name in self.scenarios():
            try:
                chain = self.history(name)
                for newer, older in zip(chain, chain[1:], strict=False):
                    if newer.parent != older.release_id or newer.step != older.step + 1:
                        errors.append(f"chain {name}: {newer.release_id} does not follow {older.release_id}")
                if chain and (chain[-1].operation != "init" or chain[-1].step != 0 or chain[-1].parent is not None):
                    errors.append(f"chain {name}: does not start with an init at step 0")
            except Exception as e:
                errors.append(f"chain {name}: {e}")
        for obj_dir in sorted((self.path / "objects").glob("[0-9a-f][0-9a-f]")):  # every loose one, as git fsck
            for f in sorted(obj_dir.iterdir()):
                key = obj_dir.name + f.name
                if key in seen or len(key) != 40 or not _HEX_RE.fullmatch(key):
                    continue
                try:
                    _check_loose(f, key)
                except (_Corrupt, OSError) as e:
                    errors.append(f"object {key}: {e}")
        readable = _readable_in(pygit2.Repository(str(self.path)))  # fresh: what is on disk, not in a cache
        for name, path in _reflogs(self.path):
            try:
                lines = path.read_bytes().splitlines()
            except OSError as e:
                errors.append(f"reflog of {name}: {e}")
                continue
            for n, line in enumerate(lines, 1):
                if not _entry_ok(line, readable):  # git fsck: "invalid reflog entry", or a broken link from it
                    errors.append(f"reflog of {name}, entry {n}: malformed, or names a commit that does not read back whole")
        counts["lfs_objects"] = len(lfs_ok)
        return {"ok": not errors, "errors": errors, **counts}

    def _check_release(self, commit: pygit2.Commit, lfs_ok: dict[str, bool], errors: list[str]) -> None:
        rid = str(commit.id)
        manifest = json.loads(self._manifest_blob(commit, MANIFEST))
        parent = str(commit.parent_ids[0]) if commit.parent_ids else None
        if len(commit.parent_ids) > 1 or manifest.get("parent") != parent:
            errors.append(f"release {rid}: manifest parent {manifest.get('parent')} vs commit parent {parent}")
        if manifest.get("content_id") != self._content_tree(rid):
            errors.append(f"release {rid}: content_id does not match its tree")
        for path, entry in (manifest.get("lfs") or {}).items():
            sha = str(entry["oid"]).split(":", 1)[-1]
            try:
                blob = self._read(self._tree(commit)[path].id)
                if not isinstance(blob, pygit2.Blob) or blob.data != lfs_pointer(sha, int(entry["size"])):
                    errors.append(f"release {rid}: {path} is not the LFS pointer of {sha}")
            except KeyError:
                errors.append(f"release {rid}: LFS path {path} missing from the tree")
            if sha not in lfs_ok:
                lfs_ok[sha] = self._verify_lfs(sha, int(entry["size"]))
                if not lfs_ok[sha]:
                    errors.append(f"LFS object {sha} (release {rid}, {path}) is missing or corrupt")

    def _verify_lfs(self, sha: str, size: int) -> bool:
        path = self.lfs_path(sha)
        try:
            h = hashlib.sha256()
            n = 0
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
            return n == size and h.hexdigest() == sha
        except OSError:
            return False

    # --- diff ----------------------------------------------------------------------------------------------

    def diff(self, release_id: str, base: str | None = None) -> dict[str, Any]:
        """What changed from ``base`` (default: the release's parent) to the release: added / removed / changed
        paths; per changed file a unified diff (text), per-tensor change norms (safetensors), or sizes."""
        release = self.get(release_id)
        base_id = self._resolve(base) if base is not None else release.parent
        new = self._file_map(release)
        old = self._file_map(self.get(base_id)) if base_id else {}
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
        tree_id = self._read(release.release_id).tree_id
        files = {p: (b, m, release.lfs.get(p)) for p, b, m in self._walk(tree_id) if p != MANIFEST}
        adapter = self.adapter(release.release_id)
        if adapter is None:
            return files
        # what an adapter release serves is its base with the adapter on top: diffed as such, an adapter against
        # its base adds the adapter's files, two adapters differ in their tensors, a rollback to the base removes them
        return {**self._file_map(self.get(adapter.base_release_id)), **files}

    def _side(self, side: tuple[str, int, dict[str, Any] | None] | None) -> tuple[int, Any]:
        """(size, bytes-or-Path) of one side of a diff; LFS objects stay on disk as a Path."""
        if side is None:
            return 0, b""
        blob_id, _, lfs = side
        if lfs is not None:
            return int(lfs["size"]), self._lfs_object(lfs)
        data = self._read(blob_id).data
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

    # --- small helpers -------------------------------------------------------------------------------------

    def _manifest_blob(self, commit: pygit2.Commit, name: str) -> bytes:
        """The bytes of the top-level file ``name`` of a commit (``KeyError`` when it has none)."""
        blob = self._read(self._tree(commit)[name].id)
        if not isinstance(blob, pygit2.Blob):
            raise KeyError(name)
        return blob.data

    def _content_tree(self, commit_id: str) -> str:
        """The id of a release's content: its tree without the manifest."""
        tree = self._tree(self._read(commit_id))
        with _storing("writing the content tree", self.path):  # it exists already but for a lost write
            tb = self._repo().TreeBuilder(tree)
            if tb.get(MANIFEST) is not None:
                tb.remove(MANIFEST)
            return str(tb.write())


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
        return {k: (lambda k=k: f.get_tensor(k)) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    from safetensors.torch import load

    loaded = load(bytes(src))
    return {k: (lambda v=v: v) for k, v in loaded.items()}
