"""Reading the chains: heads (cheaply, so a publish by any process is live at the next request), releases and
their manifests (immutable, so cached by id), files, checkouts, pending candidates and rejections.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pygit2

from daemon import durable, lora
from daemon.errors import BadRequest, NotFound, ReefError, StorageError
from daemon.names import check_scenario  # the one validator of scenario names
from daemon.releases.manifest import (
    MANIFEST,
    PENDING_REF,
    REJECTED_REF,
    REJECTION,
    SCENARIOS_REF,
    FileEntry,
    Rejection,
    Release,
)
from daemon.releases.objects import _EXEC, _OID_RE
from daemon.releases.repo import Repository

_FRESH_S = 0.001  # a head checked this recently is not checked again: see ReleaseStore.head
_RACY_NS = 100_000_000  # a ref file younger than this (0.1 s) is looked up again: see ReleaseStore.head


class Reads:
    """What the chains hold: heads, releases, their files and checkouts, pending candidates, rejections."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self._heads: dict[str, tuple[tuple[int, int, int], str | None]] = {}  # ref -> (stat key, target)
        self._fresh: dict[str, tuple[float, str | None]] = {}  # ref -> (monotonic time of the check, target)
        self._cache: dict[str, tuple[str, bytes, str]] = {}  # release id -> (id, manifest bytes, message)
        self._cache_lock = threading.Lock()

    def moved(self, ref: str) -> None:
        """``ref`` was moved (or a move of it failed): the next ``head`` looks again."""
        self._fresh.pop(ref, None)

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
            st = os.stat(f"{self.repo.path}/{name}")
        except OSError:
            st = None
        key = None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)
        if key is not None:
            hit = self._heads.get(name)
            if hit is not None and hit[0] == key:
                return hit[1]
        ref = self.repo.git().references.get(name)
        target = None if ref is None else str(ref.target)
        if key is not None and time.time_ns() - key[1] > _RACY_NS:  # key[1]: the file's mtime (ns)
            self._heads[name] = (key, target)
        else:
            self._heads.pop(name, None)
        return target

    def scenarios(self) -> list[str]:
        return sorted(
            name[len(SCENARIOS_REF) :] for name in self.repo.git().listall_references() if name.startswith(SCENARIOS_REF)
        )

    def get(self, release_id: str) -> Release:
        """One release (a full or abbreviated id). Each call returns a fresh object; the raw manifest of an
        immutable release is cached."""
        raw = self._cache.get(release_id) if isinstance(release_id, str) else None
        if raw is None:
            rid = self.repo.resolve(release_id)
            raw = self._cache.get(rid)
            if raw is None:
                commit = self.repo.commit(rid)
                try:
                    data = self.repo.manifest_blob(commit, MANIFEST)
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
            origin=manifest.get("origin"),
            requires=[str(r) for r in manifest.get("requires") or []],
        )

    def history(self, scenario: str, limit: int | None = None) -> list[Release]:
        """The chain, newest first (first-parent walk from the head)."""
        head = self.head(scenario)
        return [] if head is None else list(itertools.islice(self.chain_from(head), limit))

    def chain_from(self, release_id: str) -> Iterator[Release]:
        """The releases from ``release_id`` back to its chain's first, newest first (first parents), read lazily."""
        rid: str | None = release_id
        while rid is not None:
            yield self.get(rid)
            parents = self.repo.commit(rid).parent_ids
            rid = str(parents[0]) if parents else None

    def belongs(self, scenario: str, release_id: str) -> bool:
        """Whether the release is on the scenario's chain (the head or one of its ancestors)."""
        head = self.head(scenario)
        try:
            rid = self.repo.resolve(release_id)
        except ReefError:
            return False
        return head is not None and (rid == head or self.repo.descends(head, rid))

    def files(self, release_id: str) -> list[FileEntry]:
        """The artifact's files (the manifest excluded), with sizes of the real bytes for LFS files."""
        release = self.get(release_id)
        out = []
        for path, blob_id, mode in self.repo.walk(self.repo.commit(release.release_id).tree_id):
            if path == MANIFEST:
                continue
            lfs = release.lfs.get(path)
            if lfs is not None:
                out.append(FileEntry(path, int(lfs["size"]), mode, blob_id, lfs["oid"].split(":", 1)[1]))
            else:
                out.append(FileEntry(path, self.repo.size(blob_id), mode, blob_id, None))
        return out

    def read_file(self, release_id: str, path: str) -> bytes:
        """The bytes of one file of a release (LFS pointers resolved)."""
        release = self.get(release_id)
        node: pygit2.Object = self.repo.tree(self.repo.commit(release.release_id))
        try:
            for part in path.split("/"):  # each tree on the way read through _read
                if not isinstance(node, pygit2.Tree):
                    raise KeyError(path)
                node = self.repo.read(node[part].id)
        except KeyError:
            raise NotFound(f"release {release.release_id} has no file {path!r}", path=path) from None
        if not isinstance(node, pygit2.Blob):
            raise NotFound(f"{path!r} is a directory in release {release.release_id}", path=path)
        lfs = release.lfs.get(path)
        if lfs is None:
            return node.data
        return self.repo.lfs_object(lfs).read_bytes()

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
            for path, blob_id, mode in self.repo.walk(self.repo.commit(release.release_id).tree_id):
                if path == MANIFEST:
                    continue
                target = tmp / path
                if not target.resolve().is_relative_to(root):  # _walk refuses such names; this is the last word
                    raise StorageError(f"release {release.release_id}: {path!r} would be written outside {dest}; "
                                       "not checked out", path=str(dest))
                target.parent.mkdir(parents=True, exist_ok=True)
                lfs = release.lfs.get(path)
                if lfs is None:
                    target.write_bytes(self.repo.blob(blob_id).data)
                else:
                    obj = self.repo.lfs_object(lfs)
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
        ids = [n[len(prefix) :] for n in self.repo.git().listall_references() if n.startswith(prefix)]
        return sorted((self.get(i) for i in ids), key=lambda r: r.created_at, reverse=True)

    def rejections(self, scenario: str, limit: int | None = None) -> list[Rejection]:
        """Rejected candidates, newest first."""
        ref = self.repo.git().references.get(REJECTED_REF + check_scenario(scenario))
        out: list[Rejection] = []
        rid = None if ref is None else str(ref.target)
        while rid is not None and (limit is None or len(out) < limit):
            commit = self.repo.commit(rid)
            d = json.loads(self.repo.manifest_blob(commit, REJECTION))
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
                    origin=d.get("origin"),
                )
            )
            rid = str(commit.parent_ids[0]) if commit.parent_ids else None
        return out

    def adapter(self, release_id: str) -> lora.AdapterManifest | None:
        """The base an adapter release applies to (``daemon/lora.py``), or None for a release of whole weights."""
        rel = self.get(release_id)
        try:
            data = self.repo.manifest_blob(self.repo.commit(rel.release_id), lora.MANIFEST)
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

