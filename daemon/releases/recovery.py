"""What a crash or a full or failing disk leaves behind, found and repaired: start-up recovery and ``fsck``.

- ``recover()`` (at start-up) removes stale ``*.lock`` files under ``refs/`` and ``logs/`` and ``packed-refs.lock``,
  ``HEAD.lock``, ``config.lock``, ``index.lock`` (stale as ``refs.py`` decides it), and temp files older than an
  hour.
- It then moves a dangling ref back to the newest intact commit of its reflog or first parents (or removes it when
  none is left) and drops reflog entries naming commits that do not read back whole, logging each as an error;
  ``find_damage`` reports the same without changing anything (``reef doctor``).
- ``fsck()`` reads reflogs and every loose object as ``git fsck --full`` does, and checks every manifest, chain and
  LFS object (one a retention policy pruned, ``pruning.py``, is missing by design: not an error).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pygit2

from daemon import durable
from daemon.chain_remote import MIRROR_REF
from daemon.errors import Conflict, LockBusy, ReefError
from daemon.releases.content import _CHUNK, lfs_pointer
from daemon.releases.manifest import MANIFEST, PENDING_REF, PROMOTED_REF, SCENARIOS_REF
from daemon.releases.objects import _HEX_RE, _check_loose, _commit_at, _Corrupt, _intact, _object
from daemon.releases.reads import Reads
from daemon.releases.refs import _REFLOG_LINE, Refs, _RefUpdate
from daemon.releases.remote import Remote
from daemon.releases.repo import Repository

log = logging.getLogger("reef.releases")

_ZERO = "0" * 40


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
        commit = _commit_at(repo, target)
        while commit.parent_ids:
            candidates.append(str(commit.parent_ids[0]))
            commit = _commit_at(repo, commit.parent_ids[0])
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



class Recovery:
    """Start-up recovery (stale locks, temp files, damage a lost write left) and ``fsck``."""

    def __init__(self, repo: Repository, refs: Refs, sync: Remote, reads: Reads) -> None:
        self.repo, self.refs, self.sync, self.reads = repo, refs, sync, reads

    def _repair(self) -> dict[str, Any]:
        """Move each dangling ref back to the newest intact commit it held (or remove it when none is left), then
        drop reflog entries naming missing objects. Every change is a compare-and-swap or done under the ref's
        lock, so a live writer elsewhere loses nothing; each is logged as an error, since it means a write was
        lost."""
        repaired: list[dict[str, Any]] = []
        failed: list[str] = []
        try:
            damage = find_damage(self.repo.path)
        except (pygit2.GitError, OSError) as e:
            log.error("release store: cannot look for damage in %s: %s", self.repo.path, e)
            return {"repaired": [], "reflog_trimmed": {}, "unrepaired": [str(e)]}
        for d in damage:
            if d.target is None:
                continue
            how = f"back to {d.restore}" if d.restore else "removed"
            update = _RefUpdate(d.ref, d.restore, d.target, functools.partial(_moved, d.ref))
            try:
                # local damage, repaired locally: the remote's copy is whole, and the next follow takes it in again
                self.sync.update_refs([update], message=f"reef repair: {d.target} does not read back; {how}", push=False)
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
        readable = _readable_in(pygit2.Repository(str(self.repo.path)))  # fresh: what is on disk, not in a cache
        for name, path in _reflogs(self.repo.path):
            try:
                if not any(not _entry_ok(line, readable) for line in path.read_bytes().splitlines()):
                    continue
                with self.refs.locked(name):  # read again under the lock: a writer may have appended meanwhile
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
        found = [p for d in ("refs", "logs") for p in (self.repo.path / d).rglob("*.lock")]
        found += [self.repo.path / n for n in ("packed-refs.lock", "HEAD.lock", "config.lock", "index.lock")]
        return [p for p in found if p.exists()]

    def recover(self, *, stale_after: float | None = None, tmp_after: float = 3600.0) -> dict[str, Any]:
        """Remove stale ``*.lock`` files (see the module docstring for how staleness is decided) and temp files
        older than ``tmp_after`` left by killed writers. Locks of live Reef writers are never touched: if one
        is inside a ref update the exclusive guard is not granted and nothing is removed (``busy``).

        Then repair what a write lost to a full or failing disk left (``Damage``): a ref pointing at a commit
        that does not read back goes back to the newest intact commit it held (``repaired``: ref, was, now),
        and reflog entries naming missing objects are dropped (``reflog_trimmed``: ref -> count), each logged
        as an error."""
        stale_after = self.repo.stale_lock_after if stale_after is None else stale_after
        removed: list[str] = []
        kept: list[str] = []
        deadline = time.monotonic() + 2.0
        while True:
            with self.refs.guard(exclusive=True, blocking=False) as alone:
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
        candidates = list(self.repo.lfs_tmp.glob("obj-*")) + list((self.repo.path / "objects").glob("**/tmp_*"))
        for tmp in candidates:
            with contextlib.suppress(FileNotFoundError):
                if now - tmp.stat().st_mtime >= tmp_after:
                    tmp.unlink()
                    temp_removed.append(str(tmp))
        return {"removed": removed, "kept": kept, "temp_removed": temp_removed, "busy": False, **self._repair()}

    def fsck(self) -> dict[str, Any]:
        """Read back every object reachable from every ref (libgit2 verifies object hashes on read), check each
        manifest, each chain's linearity and steps, and the sha256 and size of every LFS object referenced."""
        repo = self.repo.git()
        errors: list[str] = []
        seen: set[str] = set()
        lfs_ok: dict[str, bool] = {}
        counts = {"commits": 0, "trees": 0, "blobs": 0, "lfs_objects": 0}

        for name in repo.listall_references():
            if not name.startswith("refs/") or name.startswith(MIRROR_REF):
                continue  # the mirror is what the remote has; only what passed ``_incoming`` is the store's
            try:
                stack: list[tuple[pygit2.Oid | str, bool]] = [(repo.references[name].target, True)]  # (oid, a commit?)
            except Exception as e:
                errors.append(f"ref {name}: {e}")
                continue
            while stack:  # depth first: a commit's whole tree before its parents
                oid, is_commit = stack.pop()
                key = str(oid)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    if is_commit:
                        commit = _commit_at(repo, oid)
                        counts["commits"] += 1
                        stack += [(p, True) for p in commit.parent_ids] + [(commit.tree_id, False)]
                        if MANIFEST in self.repo.tree(commit):
                            self._check_release(commit, lfs_ok, errors)
                        continue
                    obj = _object(repo, oid)  # not repo[oid]: a truncated loose object hangs libgit2
                    if isinstance(obj, pygit2.Tree):
                        counts["trees"] += 1
                        stack += [(e.id, False) for e in obj]
                    else:
                        counts["blobs"] += 1
                        _ = obj.read_raw()
                except Exception as e:  # a corrupt object is a finding, not a crash
                    errors.append(f"commit {key} (from {name}): {e}" if is_commit else f"object {key}: {e}")
        for name in self.reads.scenarios():
            try:
                chain = self.reads.history(name)
                for newer, older in zip(chain, chain[1:], strict=False):
                    if newer.parent != older.release_id or newer.step != older.step + 1:
                        errors.append(f"chain {name}: {newer.release_id} does not follow {older.release_id}")
                if chain and (chain[-1].operation != "init" or chain[-1].step != 0 or chain[-1].parent is not None):
                    errors.append(f"chain {name}: does not start with an init at step 0")
            except Exception as e:
                errors.append(f"chain {name}: {e}")
        for obj_dir in sorted((self.repo.path / "objects").glob("[0-9a-f][0-9a-f]")):  # every loose one, as git fsck
            for f in sorted(obj_dir.iterdir()):
                key = obj_dir.name + f.name
                if key in seen or len(key) != 40 or not _HEX_RE.fullmatch(key):
                    continue
                try:
                    _check_loose(f, key)
                except (_Corrupt, OSError) as e:
                    errors.append(f"object {key}: {e}")
        readable = _readable_in(pygit2.Repository(str(self.repo.path)))  # fresh: what is on disk, not in a cache
        for name, path in _reflogs(self.repo.path):
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
        manifest = json.loads(self.repo.manifest_blob(commit, MANIFEST))
        parent = str(commit.parent_ids[0]) if commit.parent_ids else None
        if len(commit.parent_ids) > 1 or manifest.get("parent") != parent:
            errors.append(f"release {rid}: manifest parent {manifest.get('parent')} vs commit parent {parent}")
        if manifest.get("content_id") != self.repo.content_tree(rid):
            errors.append(f"release {rid}: content_id does not match its tree")
        for path, entry in (manifest.get("lfs") or {}).items():
            sha = str(entry["oid"]).split(":", 1)[-1]
            try:
                blob = self.repo.read(self.repo.tree(commit)[path].id)
                if not isinstance(blob, pygit2.Blob) or blob.data != lfs_pointer(sha, int(entry["size"])):
                    errors.append(f"release {rid}: {path} is not the LFS pointer of {sha}")
            except KeyError:
                errors.append(f"release {rid}: LFS path {path} missing from the tree")
            if sha not in lfs_ok:
                lfs_ok[sha] = self._verify_lfs(sha, int(entry["size"]))
                if not lfs_ok[sha] and not self.repo.pruned(sha):  # pruned by a retention policy: not damage
                    errors.append(f"LFS object {sha} (release {rid}, {path}) is missing or corrupt")

    def _verify_lfs(self, sha: str, size: int) -> bool:
        path = self.repo.lfs_path(sha)
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


def _moved(ref: str, actual: str | None) -> ReefError:
    """A repair's conflict: ``ref`` moved while it was repaired."""
    return Conflict(f"{ref} moved meanwhile")
