"""The chain remote as the store uses it (the transport is ``daemon/chain_remote.py``).

- Every ref update under ``refs/reef/`` is pushed to the remote first, compare-and-swap on the remote's refs, and
  made locally only once the remote took it (``update_refs``, ``_push``).
- ``follow`` takes in what others pushed: LFS objects first, then the local ref, by the same local
  compare-and-swap. Every commit a ref would newly reach is checked before it is taken in (``_incoming``: sizes
  from headers before anything is inflated, safe names, content ids that are the commit's content, a linear
  chain); a ref whose new releases fail stays where it is. A scenario's new head whose ``requires`` this machine does
  not meet (``needs``, set by the daemon) is not taken in either: checked again at every follow, since the machine
  may come to have it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pygit2

from daemon.chain_remote import RefPush
from daemon.errors import Conflict, HeadMoved, ReefError, RemoteReleaseRefused
from daemon.releases import bundle
from daemon.releases.manifest import MANIFEST, PENDING_REF, REJECTION, SCENARIOS_REF
from daemon.releases.objects import _OID_RE, _SHA256_RE, _TooLarge, unsafe_name
from daemon.releases.reads import Reads
from daemon.releases.refs import Refs, _RefUpdate
from daemon.releases.repo import Repository

log = logging.getLogger("reef.releases")


class Remote:
    """Every ref update goes through ``update_refs``: pushed to the chain remote first when there is one; and
    ``follow``, which takes in what the remote has, each new commit checked before any ref names it."""

    def __init__(self, repo: Repository, refs: Refs, reads: Reads) -> None:
        self.repo, self.refs, self.reads = repo, refs, reads
        self._seeded = False  # local refs the remote lacks were pushed to it (the first follow does it)
        self._follow_lock = threading.Lock()
        self._taken: set[str] = set()  # commits from the remote that passed ``_incoming``
        self._refused: dict[str, str] = {}  # commits from the remote refused, and why (said once, not re-checked)
        # why this machine cannot run a release (its unmet ``requires``), or None; None: every release is taken in
        self.needs: Callable[[str], str | None] | None = None
        self._unmet: dict[str, str] = {}  # ref -> the unmet need last logged for it (logged once per change)

    def update_refs(self, updates: list[_RefUpdate], *, message: str, push: bool = True) -> None:
        """Apply ref updates all-or-nothing-checked: lock each ref, re-read it under the lock, compare with the
        expected value, then write. A busy lock is retried with backoff until ``lock_timeout``.

        No ref is moved to a commit that does not read back (``check_written``), and a write that fails part-way
        takes back the reflog line libgit2 appended before it failed (``_drop_unapplied``). With a remote (and
        ``push``), the updates are pushed first, compare-and-swap on the remote's refs (``_push``)."""
        self.refs.check_written(updates)
        if push and self.repo.remote is not None:
            self._push(updates, message)
        else:
            self.refs.apply(updates, message)

    def _push(self, updates: list[_RefUpdate], message: str) -> None:
        """Push ``updates`` to the remote (their LFS objects first); the remote's refs must be at the expected
        values. Then the same updates locally (or, when a follow took the remote's refs in meanwhile, a follow)."""
        assert self.repo.remote is not None
        scenario = next((u.name.rsplit("/", 1)[-1] for u in updates if u.name.startswith(SCENARIOS_REF)),
                        updates[0].name)
        self.repo.remote.upload(self._lfs_between([(u.new, u.expected) for u in updates if u.new is not None]))
        try:
            self.repo.remote.push([RefPush(u.name, u.new, u.expected) for u in updates], scenario)
        except HeadMoved:
            with contextlib.suppress(ReefError):  # take in what won, so the caller can serve it at once
                self.follow()
            raise
        try:
            self.refs.apply(updates, message)
        except Conflict:  # a follow took the remote's refs in meanwhile: match the remote again
            self.follow()

    def _lfs_named(self, new: str, stop: str | None) -> Iterator[tuple[str, int]]:
        """``(sha256, size)`` of each LFS object the releases from ``new`` back to (not including) ``stop`` name,
        first parents only."""
        rid: str | None = new
        while rid is not None and rid != stop:
            commit = self.repo.commit(rid)
            if MANIFEST in self.repo.tree(commit):
                for entry in (json.loads(self.repo.manifest_blob(commit, MANIFEST)).get("lfs") or {}).values():
                    yield str(entry["oid"]).split(":", 1)[-1], int(entry["size"])
            rid = str(commit.parent_ids[0]) if commit.parent_ids else None

    def _lfs_between(self, ranges: list[tuple[str, str | None]]) -> list[tuple[str, int, Path]]:
        """The local LFS objects ``(sha256, size, path)`` the releases of each range ``(new, stop)`` name; those a
        retention policy pruned here are not sent (a chain seeded after a prune lacks them on the remote too)."""
        return list({sha: (sha, size, self.repo.lfs_object({"oid": sha})) for new, stop in ranges
                     for sha, size in self._lfs_named(new, stop) if not self.repo.pruned(sha)}.values())

    def follow(self) -> list[str]:
        """Take in what the remote has: fetch its ``refs/reef/*``, then move each local ref that differs to the
        remote's value (its LFS objects copied in first). Returns the refs moved. On the first call, local refs
        the remote lacks (chains made before it was configured) are pushed to it. ``RemoteRefused`` when the
        remote cannot be read; nothing local changes then.

        Every commit a ref would newly reach is checked first (``_incoming``): a ref whose new releases fail is
        left where it is (the rest are taken in) and the follow ends in ``RemoteReleaseRefused`` naming each."""
        if self.repo.remote is None:
            return []
        with self._follow_lock:
            repo = self.repo.git()
            # the local refs before the fetch: each was on the remote before it was here (pushes come first), so
            # one the fetch does not bring was removed there, not made here meanwhile
            local = {n: str(repo.references[n].target) for n in repo.listall_references() if n.startswith("refs/reef/")}
            remote = self.repo.remote.fetch()
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
                        log.error("not taking in %s = %s from the chain remote %s: %s", name, oid, self.repo.remote.shown,
                                  why)
                        if len(self._refused) > 1024:
                            self._refused.clear()
                        self._refused[oid] = why
                    refused.append(f"{why} (ref {name})")
                    continue
                unmet = self.needs(oid) if self.needs is not None and name.startswith(SCENARIOS_REF) else None
                if unmet is not None:  # not cached as refused: a tool installed meanwhile lets the next follow take it
                    if self._unmet.get(name) != unmet:
                        log.error("not taking in %s = %s from the chain remote %s: %s", name, oid,
                                  self.repo.remote.shown, unmet)
                        self._unmet[name] = unmet
                    refused.append(f"{unmet} (ref {name})")
                    continue
                self._unmet.pop(name, None)
                for sha, size in self._lfs_named(oid, cur):  # LFS objects first: a head never names missing bytes
                    if not self.repo.lfs_path(sha).exists():
                        self.repo.remote.download(sha, size, self.repo.lfs_path(sha))
                if cur is not None and not self.repo.descends(oid, cur):
                    log.warning("%s: local %s is not an ancestor of the remote's %s; following the remote", name,
                                cur, oid)
                try:
                    self.update_refs([_RefUpdate(name, oid, cur, lambda a: Conflict("moved meanwhile"))],
                                      message="reef follow", push=False)
                except Conflict:
                    continue  # moved meanwhile (a publish of ours): the next follow looks again
                moved.append(name)
            if not self._seeded:
                for name, cur in sorted(local.items()):
                    if name not in remote:
                        with contextlib.suppress(HeadMoved):  # another daemon seeded it first: followed next time
                            self.repo.remote.upload(self._lfs_between([(cur, None)]))
                            self.repo.remote.push([RefPush(name, cur, None)], name.rsplit("/", 1)[-1])
                self._seeded = True
            else:  # every local ref is on the remote since the seeding: a pending one gone there was promoted or
                # discarded by another daemon
                for name, cur in sorted(local.items()):
                    if name not in remote and name.startswith(PENDING_REF):
                        with contextlib.suppress(Conflict):
                            self.update_refs([_RefUpdate(name, None, cur, lambda a: Conflict("moved meanwhile"))],
                                              message="reef follow", push=False)
                            moved.append(name)
            if refused:
                raise RemoteReleaseRefused(self.repo.remote.shown, refused, moved)
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
            parents = self.repo.commit(rid).parent_ids
            rid = str(parents[0]) if parents else None
        if len(self._taken) > 65536:
            self._taken.clear()
        self._taken.update(passed)
        return None

    def _policy(self, rel: Any, commit: Any) -> str | None:
        """Why a fetched harness release breaks the harness policy (``daemon/harness_policy.py``), or None: nothing
        in its tree the policy refuses, and what only a person may admit (a tool grant) only in files that a person's
        ``promote`` changed. A remote says which releases exist; it cannot grant an agent more than this daemon
        would."""
        from daemon import harness_policy

        # a large (LFS) file is not here before the follow copies it in; the render checks it (check_served)
        def tree_of(rid: str) -> dict[str, bytes]:  # a bundle's harness/ only: its adapter is no harness file
            return bundle.harness_part(self.reads.get(rid).kind, {f.path: self.reads.read_file(rid, f.path)
                                                                  for f in self.reads.files(rid) if f.lfs_oid is None})

        tree = tree_of(rel.release_id)
        bad = harness_policy.refused(harness_policy.findings(tree, allow_executable=True))
        if not bad and rel.operation != "promote":
            parent: dict[str, bytes] = {}
            if commit.parent_ids:
                with contextlib.suppress(ReefError, KeyError, ValueError):
                    pid = str(commit.parent_ids[0])
                    parent = tree_of(pid)
            bad = harness_policy.held(harness_policy.findings(tree, parent, allow_executable=True))
        if bad:
            return f"the harness policy refuses it: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        return None

    def _incoming(self, rid: str, checked: set[str]) -> str | None:
        """Why the commit ``rid``, fetched from the remote, must not be taken in, or None. Nothing it holds is
        read before its size is known: every object's header is checked against the remote's ``max_blob_bytes``
        (so a small pack that inflates to gigabytes is refused without being inflated), every LFS object it names
        against ``max_lfs_bytes``. Every tree entry name must be safe on disk (``walk``), the manifest's
        ``content_id`` must be the commit's content tree (it names a checkout directory), and LFS ids must be
        sha256 ids (they name files). A chain is linear: a merge is refused."""
        assert self.repo.remote is not None
        max_blob, max_lfs = self.repo.remote.max_blob_bytes, self.repo.remote.max_lfs_bytes
        try:
            self.repo.size(rid, max_blob)
            commit = self.repo.read(rid)
            if not isinstance(commit, pygit2.Commit):
                return "it is not a commit"
            if len(commit.parent_ids) > 1:
                return "it has more than one parent (a release chain is linear)"
            for _path, blob_id, _mode in self.repo.walk(commit.tree_id, max_size=max_blob):
                if blob_id not in checked:
                    self.repo.size(blob_id, max_blob)
                    checked.add(blob_id)
            tree = self.repo.tree(commit)
            if MANIFEST in tree:
                manifest = json.loads(self.repo.manifest_blob(commit, MANIFEST))
                if not isinstance(manifest, dict):
                    return f"its {MANIFEST} is not a JSON object"
                cid = manifest.get("content_id")
                if not isinstance(cid, str) or not _OID_RE.fullmatch(cid):
                    return f"its content_id {cid!r} is not a git tree id"
                actual = self.repo.content_tree(rid)
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
                rel = self.reads.get(rid)  # and reads as a release
                if rel.carries_harness:
                    why = self._policy(rel, commit)
                    if why is not None:
                        return why
            if REJECTION in tree:
                cid = json.loads(self.repo.manifest_blob(commit, REJECTION)).get("content_id")
                if cid is not None and (not isinstance(cid, str) or not _OID_RE.fullmatch(cid)):
                    return f"its {REJECTION} content_id {cid!r} is not a git tree id"
        except _TooLarge as e:
            return f"{e} (chain_max_blob_bytes)"
        except ReefError as e:
            return e.message
        except (KeyError, ValueError, TypeError, AttributeError, pygit2.GitError) as e:
            return f"it does not read as a release: {type(e).__name__}: {e}"
        return None

