"""Moving refs: compare-and-swap under git's own ref locks, and never onto a commit that does not read back.

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
  spares a git binary process, which does not take the flock and holds its locks for milliseconds). A publisher
  that keeps finding a lock busy applies this to that lock (``recovery.py`` applies it to all at start-up).
- Lost writes. On a full disk libgit2 can return the id of a commit it never wrote, and it appends the reflog line
  before renaming the new ref into place. So no ref moves to a commit that does not read back whole through a
  freshly opened repository (``check_written``: commit, tree, manifest, files; a half-written object of ours is
  removed, since libgit2 never rewrites an object it finds present), and a failed ref update truncates the reflog
  line it left (``_drop_unapplied``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pygit2

from daemon.errors import LockBusy, ReefError, StorageError
from daemon.releases.objects import _intact
from daemon.releases.reads import Reads
from daemon.releases.repo import Repository

log = logging.getLogger("reef.releases")

# libgit2's two messages for GIT_ELOCKED (the lock file seen first, or lost in the O_EXCL race)
_LOCK_MSG = re.compile(r"failed to (?:lock file|create locked file) '(.+?\.lock)'")
_REFLOG_LINE = re.compile(rb"([0-9a-f]{40}) ([0-9a-f]{40}) ")  # "<old> <new> <ident> <when>\t<message>"


@dataclass
class _RefUpdate:
    name: str
    new: str | None  # None: delete the ref
    expected: str | None  # None: the ref must not exist
    conflict: Callable[[str | None], ReefError]



class Refs:
    """Compare-and-swap ref updates under git's ref locks, and the checks around them."""

    def __init__(self, repo: Repository, reads: Reads) -> None:
        self.repo = repo
        self.reads = reads  # told of every ref moved, so its head cache never serves the old one

    @contextlib.contextmanager
    def guard(self, *, exclusive: bool, blocking: bool) -> Iterator[bool]:
        """The flock that tells live Reef ref writers (shared) from a stale-lock remover (exclusive)."""
        fd = os.open(self.repo.guard_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def apply(self, updates: list[_RefUpdate], message: str) -> None:
        repo = self.repo.git()
        start = time.monotonic()
        delay = 0.002
        while True:
            busy: str | None = None
            failed: Exception | None = None
            with self.guard(exclusive=False, blocking=True):
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
                        self.reads.moved(u.name)
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
                    self.reads.moved(u.name)
                self._drop_unapplied(updates)
                raise StorageError(f"updating {updates[0].name} failed: {failed}", path=str(self.repo.path)) from failed
            assert busy is not None
            delay = self._wait(updates[0].name, busy, start, delay)

    def _wait(self, name: str, busy: str, start: float, delay: float) -> float:
        """The lock ``busy`` on ``name`` was held: ``LockBusy`` once ``lock_timeout`` has passed since ``start``; else
        clear it if stale and sleep ``delay`` (jittered). Returns the next delay (doubling, up to 0.1 s)."""
        waited = time.monotonic() - start
        if waited >= self.repo.lock_timeout:
            raise LockBusy(name, busy, waited)
        self._clear_if_stale(Path(busy))
        time.sleep(min(delay, max(0.0, self.repo.lock_timeout - waited)) * random.uniform(0.5, 1.5))
        return min(delay * 2, 0.1)

    def _clear_if_stale(self, lock: Path) -> bool:
        with self.guard(exclusive=True, blocking=False) as alone:
            if not alone:
                return False
            try:
                if time.time() - lock.stat().st_mtime < self.repo.stale_lock_after:
                    return False
                lock.unlink()
            except FileNotFoundError:
                return False
            return True

    def check_written(self, updates: list[_RefUpdate]) -> None:
        """Refuse to point a ref at a commit that does not read back whole (commit, tree, manifest, files): on a
        full disk libgit2 can return the id of a commit it never wrote, and a head naming it makes every read of
        the scenario fail. Read through a freshly opened repository, so nothing comes from a cache."""
        new = sorted({u.new for u in updates if u.new is not None})
        if not new:
            return
        try:
            repo = pygit2.Repository(str(self.repo.path))
        except (pygit2.GitError, OSError) as e:
            raise StorageError(f"cannot read back the release store {self.repo.path}: {e}", path=str(self.repo.path)) from e
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
                    path=str(self.repo.path), release_id=commit_id,
                )

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold git's lock on ``name`` (``<ref>.lock``) without changing the ref, for an edit of its reflog (git
        edits reflogs under the same lock). Busy: retried with backoff until ``lock_timeout``, then ``LockBusy``."""
        repo = self.repo.git()
        start = time.monotonic()
        delay = 0.002
        while True:
            busy: str | None = None
            with self.guard(exclusive=False, blocking=True):
                tx = repo.transaction()
                try:
                    try:
                        tx.lock_ref(name)
                    except pygit2.GitError as e:
                        m = _LOCK_MSG.search(str(e))
                        if m is None:
                            raise StorageError(f"locking {name} failed: {e}", path=str(self.repo.path)) from e
                        busy = m.group(1)
                    else:
                        yield
                        return
                finally:
                    tx.__exit__(RuntimeError, None, None)  # frees it: the lock goes, nothing is applied
            delay = self._wait(name, busy, start, delay)

    def _drop_unapplied(self, updates: list[_RefUpdate]) -> None:
        """After a ref update failed: libgit2 appends the reflog line before it renames the new ref into place, so
        a full disk can fail the rename after the line is written, leaving a reflog that claims a move that never
        happened (and, if the commit was lost too, one that ``git fsck`` rejects). Truncate that last line away
        (truncating needs no free space); what cannot be fixed now ``recover()`` fixes at start-up."""
        for u in updates:
            if u.new is None:
                continue
            path = self.repo.path / "logs" / u.name
            try:
                with self.locked(u.name):
                    ref = self.repo.git().references.get(u.name)
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

