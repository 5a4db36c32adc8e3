"""Pruned weights: the LFS objects a retention policy removed from the store, and what the chain says of them.

The policy itself (which releases keep their weights) is the daemon's, ``daemon/retention.py``; this part removes
what it is told to and answers, for any release, whether its weights are still here.

- The chain stays append-only: pruning removes LFS objects only (files over ``lfs_threshold``: the weights), never
  a commit, tree, manifest, pointer or ref. A pruned release stays listed, with its manifest, metrics and receipts;
  small files (configs, a tokenizer, an adapter under 1 MiB) live in git and are never pruned.
- Before an object is removed, a tombstone ``lfs/pruned/<sha256>`` is written (temp file, fsync, rename), then the
  object is unlinked and the directory synced. A missing object with a tombstone reads as pruned; one without, as
  damage (``fsck``). An object stored again later (the same weights published again, a chain remote's copy taken in)
  is simply present again: a release's weights are pruned while one of its LFS objects is missing and tombstoned.
- ``prune(drop)`` removes the objects that the releases in ``drop`` name and nothing else in the store names: not
  another release of any chain, a pending candidate, a rejected candidate left out of ``drop``, or the base of an
  adapter release left out of ``drop``. Each chain's head and every pending candidate are never pruned, whatever
  ``drop`` says. A promoted candidate's commit names the same objects as its ``promote`` release and is not counted.
- ``lock``: ``prune`` holds it, and so do the store's rollback and promote from their check of the source's weights
  to their publish, so that in one process a rollback never publishes weights a prune is removing. A rollback by
  another process (a script on the same store) in that instant is not excluded: the daemon is the only pruner.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Collection, Iterator
from typing import Any

from daemon import durable
from daemon.errors import NotFound, ReefError, WeightsPruned
from daemon.releases.manifest import PENDING_REF, Release
from daemon.releases.reads import Reads
from daemon.releases.repo import Repository


def _sha(entry: dict[str, Any]) -> str:
    return str(entry["oid"]).split(":", 1)[-1]


class Pruning:
    """Which releases' weights are gone, and removing the weights of releases a retention policy lets go."""

    def __init__(self, repo: Repository, reads: Reads) -> None:
        self.repo, self.reads = repo, reads
        self.lock = threading.RLock()

    def pruned(self, release: Release) -> list[str]:
        """The paths of ``release`` whose weights were pruned, sorted (empty: every file is here)."""
        return sorted(p for p, e in release.lfs.items() if self.repo.pruned(_sha(e)))

    def refusal(self, release: Release, what: str, gone: list[str]) -> WeightsPruned:
        """The error refusing to ``what`` a release whose files ``gone`` were pruned: what happened and what to do."""
        head = self.reads.head(release.scenario)
        kept = next((r for r in self.reads.history(release.scenario) if r.release_id != head and not self.pruned(r)),
                    None)
        offer = (f"roll back to a release whose weights are kept: the newest before the head is "
                 f"{kept.release_id[:12]} (step {kept.step}), reef releases rollback {kept.release_id[:12]} "
                 f"--scenario {release.scenario}" if kept is not None else
                 "the head serves on; no other release of this chain has its weights here")
        return WeightsPruned(
            f"cannot {what} release {release.release_id[:12]} (step {release.step}) of scenario {release.scenario!r}: "
            f"its weights ({', '.join(gone)}) were pruned by the scenario's retention policy (keep_releases); the "
            f"release stays on the chain, its weights are gone from this store. Instead {offer}; to keep more "
            f"releases' weights from now on: reef scenarios update {release.scenario} --settings "
            f"'{{\"keep_releases\": N}}'",
            release_id=release.release_id, offered=kept.release_id if kept is not None else None)

    def check(self, release_id: str, what: str) -> None:
        """``WeightsPruned`` (``refusal``) unless every weights file of the release is here."""
        release = self.reads.get(release_id)
        gone = self.pruned(release)
        if gone:
            raise self.refusal(release, what, gone)

    # --- pruning -----------------------------------------------------------------------------------------------

    def protected(self) -> set[str]:
        """What is never pruned: each chain's head and every pending candidate."""
        out = {h for s in self.reads.scenarios() if (h := self.reads.head(s)) is not None}
        out.update(name.rsplit("/", 1)[-1] for name in self.repo.git().listall_references()
                   if name.startswith(PENDING_REF))
        return out

    def _everything(self) -> Iterator[Release]:
        """Every release and candidate whose objects count: each chain's releases, pending candidates, and the
        rejected candidates whose commits are still readable."""
        for scenario in self.reads.scenarios():
            yield from self.reads.history(scenario)
            yield from self.reads.pending(scenario)
            for rejection in self.reads.rejections(scenario):
                if rejection.candidate is not None:
                    with contextlib.suppress(NotFound, ReefError):
                        yield self.reads.get(rejection.candidate)

    def prune(self, drop: Collection[str]) -> dict[str, Any]:
        """Remove the LFS objects only releases in ``drop`` name (heads and pending candidates excepted): tombstone
        first, then the object. Returns ``{"objects", "bytes", "releases"}``: how many objects and bytes went, and
        which releases of ``drop`` now have pruned weights."""
        with self.lock:
            dropped = {self.repo.resolve(r) for r in drop} - self.protected()
            live: set[str] = set()
            named: dict[str, int] = {}
            seen: set[str] = set()
            for rel in self._everything():
                if rel.release_id in seen:
                    continue
                seen.add(rel.release_id)
                shas = {_sha(e): int(e["size"]) for e in rel.lfs.values()}
                if rel.release_id in dropped:
                    named.update(shas)
                    continue
                live.update(shas)
                adapter = self.reads.adapter(rel.release_id)
                if adapter is not None:  # its base's weights serve with it
                    with contextlib.suppress(NotFound):
                        live.update(_sha(e) for e in self.reads.get(adapter.base_release_id).lfs.values())
            gone: list[tuple[str, int]] = []
            for sha, size in sorted(named.items()):
                if sha in live:
                    continue
                path = self.repo.lfs_path(sha)
                if not path.exists():
                    continue
                durable.mkdirs(self.repo.pruned_dir)
                durable.write_atomic(self.repo.pruned_dir / sha, f"{size}\n".encode())
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    gone.append((sha, size))
            for parent in {self.repo.lfs_path(sha).parent for sha, _ in gone}:
                durable.sync_dir(parent)
            now = [r for r in sorted(dropped) if self.pruned(self.reads.get(r))]
            return {"objects": len(gone), "bytes": sum(size for _, size in gone), "releases": now}
