"""``ReleaseStore``: the release chains of all scenarios, and the operations that append to them.

- Publish, rollback, promote: each names the head it expects, and the ref moves by compare-and-swap
  (``refs.py``). History is never rewritten: rollback and promote publish existing content as a new release
  (step + 1). A release that changes nothing is no release (``Unchanged``).
- A pending candidate (review-mode gates) is a commit on ``refs/reef/pending/<scenario>/<id>`` whose parent
  is the head it was built on; promoting it moves that ref to ``refs/reef/promoted/<scenario>/<id>`` in the
  same transaction as the chain update, so it stays reachable. Rejected candidates are a chain of their own,
  ``refs/reef/rejected/<scenario>`` (one commit per verdict, with ``reef-rejection.json``, and the
  candidate's content as ``candidate/`` when it was held).
- A release whose weights a retention policy pruned (``pruning.py``) stays on its chain; rolling back to it,
  promoting it or checking it out is ``WeightsPruned``, naming the newest release whose weights are kept.
- LoRA adapter releases (``daemon/lora.py``) hold only the adapter and ``reef-adapter.json`` naming their base
  by content id; ``publish`` refuses one whose base is not the model the scenario's head serves (``BaseMismatch``,
  before anything is written). A bundle (``bundle.py``) is an adapter with a harness and their evidence beside it,
  checked the same way and its harness against the harness policy.

The store is composed of parts, one module each, every part holding the ones it uses: ``repo.py`` (the repository,
guarded reads) under ``reads.py`` and ``content.py``; ``refs.py`` over reads; ``remote.py`` over refs and reads;
``recovery.py`` over the remote; ``diff.py`` and ``pruning.py`` over reads; this module on top.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pygit2

from daemon import lora
from daemon.chain_remote import ChainRemote
from daemon.errors import (
    BadRequest,
    BaseMismatch,
    Conflict,
    HeadMoved,
    NotFound,
    ReefError,
    Unchanged,
    WeightsPruned,
)
from daemon.names import check_scenario  # the one validator of scenario names
from daemon.releases import bundle
from daemon.releases.content import Content
from daemon.releases.diff import Diffs
from daemon.releases.manifest import (
    MANIFEST,
    PENDING_REF,
    PROMOTED_REF,
    REJECTED_REF,
    REJECTION,
    SCENARIOS_REF,
    FileSource,
    Manifest,
    Rejection,
    Release,
    _json,
    _one_line,
)
from daemon.releases.objects import _BLOB, _TREE, _expect, _storing
from daemon.releases.pruning import Pruning
from daemon.releases.reads import Reads
from daemon.releases.recovery import Recovery
from daemon.releases.refs import Refs, _RefUpdate
from daemon.releases.remote import Remote
from daemon.releases.repo import DEFAULT_LFS_THRESHOLD, Repository


class ReleaseStore:
    """The release chains of all scenarios. Safe to use from many threads and many processes at once.

    It holds its parts (``repo``, ``reads``, ``content``, ``refs``, ``sync``, ``recovery``, ``diffs``, ``pruning``), each
    given the ones it stands on, and offers their public operations as its own."""

    def __init__(self, path: str | os.PathLike[str], *, lfs_threshold: int = DEFAULT_LFS_THRESHOLD,
                 lock_timeout: float = 10.0, stale_lock_after: float = 5.0, remote: ChainRemote | None = None,
                 needs: Callable[[str], str | None] | None = None) -> None:
        self.repo = repo = Repository(path, lfs_threshold=lfs_threshold, lock_timeout=lock_timeout,
                                      stale_lock_after=stale_lock_after, remote=remote)
        self.reads = reads = Reads(repo)
        self.content = Content(repo)
        self.refs = Refs(repo, reads)
        self.sync = Remote(repo, self.refs, reads)
        self.sync.needs = needs  # a remote head this machine cannot run (its ``requires``) is not followed
        self.recovery = Recovery(repo, self.refs, self.sync, reads)
        self.diffs = Diffs(repo, reads)
        self.pruning = Pruning(repo, reads)  # weights a retention policy removed (``daemon/retention.py``)
        self.path, self.lfs_dir, self.remote, self.lfs_path = repo.path, repo.lfs_dir, repo.remote, repo.lfs_path
        self.head, self.get, self.history, self.scenarios = reads.head, reads.get, reads.history, reads.scenarios
        self.chain_from = reads.chain_from
        self.belongs = reads.belongs
        self.files, self.read_file = reads.files, reads.read_file
        self.pruned, self.prune = self.pruning.pruned, self.pruning.prune
        self.pending, self.rejections = reads.pending, reads.rejections
        self.adapter, self.base_model = reads.adapter, reads.base_model
        self.follow, self.recover, self.fsck, self.diff = self.sync.follow, self.recovery.recover, \
            self.recovery.fsck, self.diffs.diff

    def checkout(self, release_id: str, dest: str | os.PathLike[str], *, link: bool = False) -> Path:
        """``Reads.checkout``; a release whose weights were pruned is ``WeightsPruned`` naming the newest release of
        its chain whose weights are kept (``pruning.py``)."""
        try:
            return self.reads.checkout(release_id, dest, link=link)
        except WeightsPruned:
            release = self.get(release_id)
            raise self.pruning.refusal(release, "load", self.pruned(release)) from None

    # --- publishing ----------------------------------------------------------------------------------------

    def publish(self, manifest: Manifest | str, files: Mapping[str, FileSource], *, expected_head: str | None,
                **fields: Any) -> Release:
        """Publish ``files`` as the next release of ``manifest.scenario`` if its head is still ``expected_head``.

        ``expected_head=None`` means the chain must not exist yet (and then the operation must be ``init``).
        Raises ``HeadMoved`` (nothing changed) if the head is not ``expected_head``, ``LockBusy`` if another
        writer held the ref lock past ``lock_timeout``. ``publish("demo", files, expected_head=h, operation=...,
        kind=..., recipe=...)`` spells the manifest's fields as keywords (scripts and tests)."""
        manifest = Manifest.of(manifest, fields)
        scenario = manifest.scenario
        if (manifest.operation == "init") != (expected_head is None):
            raise BadRequest(
                "an init release starts a chain (expected_head must be None), and only an init may",
                param="expected_head",
            )
        expected = self._expected(expected_head)
        self._precheck(scenario, expected)
        if manifest.source is not None:
            manifest = manifest.replace(source=self.repo.resolve(manifest.source))
        if manifest.kind == "bundle":  # an adapter, a harness and their evidence, each checked (``bundle.py``)
            self._check_adapter(scenario, bundle.check(files), expected)
        elif manifest.kind == "weights" and lora.MANIFEST in files:
            self._check_adapter(scenario, files, expected)
        content, lfs = self.content.write(files)
        if manifest.operation in ("train", "bundle") and expected is not None \
                and content == self.repo.content_tree(expected):
            raise Unchanged(scenario, content)  # a release that changes nothing is no release
        return self._publish_tree(manifest, content, lfs, expected=expected)

    def _check_adapter(self, scenario: str, files: Mapping[str, FileSource], expected: str | None) -> None:
        """An adapter is published only on the model it was trained on: its manifest names a release of whole
        weights by id and content id, and (unless this is the chain's first release) that content is the model
        the scenario's head serves. Otherwise ``BaseMismatch``: nothing is written."""
        manifest = lora.AdapterManifest.parse(bundle.read_bytes(files[lora.MANIFEST]))
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
        rid = self.repo.resolve(release_id)
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
        manifest = src.manifest(scenario=scenario, operation="rollback", receipts=(), source=rid,
                                summary=summary or f"roll back to step {src.step} ({rid[:12]})")
        with self.pruning.lock:  # never a head naming weights a prune removed (or is removing)
            self.pruning.check(rid, "roll back to")
            return self._publish_tree(manifest, self.repo.content_tree(rid), src.lfs, expected=expected)

    def hold(self, manifest: Manifest | str, files: Mapping[str, FileSource], *, base: str | None = None,
             **fields: Any) -> Release:
        """Store a candidate for review without releasing it: a commit on ``refs/reef/pending/<s>/<id>`` whose
        parent is ``base`` (default: the current head). ``promote`` releases it; ``record_rejection`` with
        ``candidate=`` discards it. The manifest's operation is ``train`` (the keyword spelling sets it)."""
        manifest = Manifest.of(manifest, {"operation": "train", **fields} if isinstance(manifest, str) else fields)
        if manifest.operation != "train":
            raise BadRequest(f"a held candidate is a train release, not {manifest.operation!r}", param="operation")
        scenario = manifest.scenario
        head = self.head(scenario)
        if head is None:
            raise NotFound(f"scenario {scenario!r} has no releases", scenario=scenario)
        base_id = head if base is None else self.repo.resolve(base)
        if not self.belongs(scenario, base_id):
            raise BadRequest(f"base {base_id} is not on the chain of scenario {scenario!r}", param="base")
        content, lfs = self.content.write(files)
        if manifest.summary is None:
            manifest = manifest.replace(summary="candidate held for review")
        commit_id, _ = self._write_release_commit(manifest, content, lfs, parent=base_id)
        ref = f"{PENDING_REF}{scenario}/{commit_id}"
        self.sync.update_refs(
            [_RefUpdate(ref, commit_id, None, lambda actual: Conflict(f"{ref} already exists", ref=ref))],
            message=f"reef hold: {scenario}",
        )
        return self.get(commit_id)

    def promote(
        self, scenario: str, pending_id: str, *, expected_head: str | None = None, summary: str | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> Release:
        """Release a held candidate: its content becomes the next release (operation ``promote``); ``metrics``
        are added to the candidate's own (a canary's verdict and figures)."""
        check_scenario(scenario)
        pid = self.repo.resolve(pending_id, "pending candidate")
        pending_ref = f"{PENDING_REF}{scenario}/{pid}"
        if self.repo.git().references.get(pending_ref) is None:
            raise NotFound(f"no pending candidate {pid} in scenario {scenario!r}", release_id=pid, scenario=scenario)
        head = self.head(scenario)
        expected = head if expected_head is None else self._expected(expected_head)
        cand = self.get(pid)
        promoted_ref = f"{PROMOTED_REF}{scenario}/{pid}"

        def gone(actual: str | None) -> ReefError:
            return Conflict(f"pending candidate {pid} was promoted or discarded meanwhile", release_id=pid)

        manifest = cand.manifest(scenario=scenario, operation="promote", source=pid,
                                 summary=summary or f"promote candidate {pid[:12]}",
                                 metrics={**cand.metrics, **(metrics or {})})
        with self.pruning.lock:
            self.pruning.check(pid, "promote")
            return self._publish_tree(
                manifest, self.repo.content_tree(pid), cand.lfs, expected=expected,
                extra=[_RefUpdate(pending_ref, None, pid, gone), _RefUpdate(promoted_ref, pid, None, gone)],
            )

    def record_rejection(
        self,
        rejected: Manifest | str,
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
        leaves the pending list. ``rejected`` is the candidate's ``Manifest`` (its scenario, kind, recipe, metrics
        and receipts are written down), or only the scenario's name with those as keywords."""
        if isinstance(rejected, Manifest):
            given = [k for k, v in (("metrics", metrics), ("kind", kind), ("recipe", recipe), ("receipts", receipts))
                     if v is not None]
            if given:
                raise TypeError(f"a Manifest is given; {', '.join(given)} belong in it")
            scenario, kind, recipe = rejected.scenario, rejected.kind, rejected.recipe
            metrics, receipts = dict(rejected.metrics), list(rejected.receipts)
            origin = dict(rejected.origin) if rejected.origin is not None else None
        else:
            origin = None
            scenario = check_scenario(rejected)
        head = self.head(scenario)
        base_id = head if base is None else self.repo.resolve(base)
        if step is None:
            step = self.get(base_id).step + 1 if base_id else 0
        repo = self.repo.git()
        cand_tree = None
        pending_ref = None
        # a candidate whose commit is lost (a canary's, found after a restart; recovery drops its pending ref at
        # start) is named, with nothing of it kept
        if candidate is not None and not self._lost(candidate):
            cand = self.get(candidate)
            candidate = cand.release_id
            cand_tree = self.repo.content_tree(candidate)
            content_id = cand.content_id
            kind, recipe = kind or cand.kind, recipe or cand.recipe
            metrics = metrics if metrics is not None else cand.metrics
            receipts = receipts if receipts is not None else cand.receipts
            origin = origin if origin is not None else cand.origin
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
            **({"origin": origin} if origin is not None else {}),
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
        sig = self.repo.signature(now)
        for _ in range(100):  # an append-only log: a lost race just re-parents onto the new tip
            tip_ref = repo.references.get(rej_ref)
            tip = None if tip_ref is None else str(tip_ref.target)
            with _storing("writing the rejection", self.path):
                commit_id = str(repo.create_commit(None, sig, sig, message, tree, [tip] if tip else []))
            updates = [_RefUpdate(rej_ref, commit_id, tip, functools.partial(HeadMoved, scenario, tip))]
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
                self.sync.update_refs(updates, message=f"reef reject: {scenario} step {step}")
            except HeadMoved:
                if self.remote is not None:  # another daemon appended to the shared log: take its tip in
                    self.follow()
                continue
            return self.rejections(scenario, limit=1)[0]
        raise Conflict(f"the rejection log of {scenario!r} kept moving; nothing was recorded", scenario=scenario)

    def _lost(self, candidate: str) -> bool:
        """A full candidate id whose commit the store can no longer read (a canary's candidate after a lost object)."""
        if not re.fullmatch(r"[0-9a-f]{40}", candidate):
            return False
        try:
            self.get(candidate)
        except ReefError:
            return True
        return False

    # --- internals of publishing ---------------------------------------------------------------------------

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

    def _publish_tree(self, manifest: Manifest, content: str, lfs: Mapping[str, dict[str, Any]], *,
                      expected: str | None, extra: list[_RefUpdate] | None = None) -> Release:
        scenario = manifest.scenario
        self._precheck(scenario, expected)
        commit_id, step = self._write_release_commit(manifest, content, lfs, parent=expected)
        update = _RefUpdate(SCENARIOS_REF + scenario, commit_id, expected, lambda a: HeadMoved(scenario, expected, a))
        self.sync.update_refs([update, *(extra or [])], message=f"reef {manifest.operation}: {scenario} step {step}")
        return self.get(commit_id)

    def _write_release_commit(self, m: Manifest, content: str, lfs: Mapping[str, dict[str, Any]], *,
                              parent: str | None) -> tuple[str, int]:
        """Write the release commit of ``m`` over the content tree ``content`` (not yet on any ref): the manifest
        file (``m`` and what the store decides: step, parent, time, content id, LFS table) and the message."""
        scenario, operation, kind, source = m.scenario, m.operation, m.kind, m.source
        repo = self.repo.git()
        step = 0 if parent is None else self.get(parent).step + 1
        now = time.time()
        manifest = {
            "version": 1,
            "scenario": scenario,
            "kind": kind,
            "recipe": m.recipe,
            "step": step,
            "operation": operation,
            "metrics": dict(m.metrics),
            "parent": parent,
            "receipts": list(m.receipts),
            "source": source,
            "settings": dict(m.settings),
            "created_at": now,
            "content_id": content,
            "lfs": {k: dict(v) for k, v in sorted(lfs.items())},
            **({"origin": dict(m.origin)} if m.origin is not None else {}),
            **({"requires": list(m.requires)} if m.requires else {}),
        }
        manifest_bytes = _json(manifest).encode()
        with _storing("writing the release manifest", self.path):
            tb = repo.TreeBuilder(_expect(repo[content], pygit2.Tree, content))
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
        if m.origin is not None:
            trailers.append(f"Reef-Origin: {_one_line(str(m.origin.get('kind')), 40)}")
        message = (
            f"{operation} {scenario} step {step}: {_one_line(m.summary or default)}\n\n" + "\n".join(trailers) + "\n"
        )
        sig = self.repo.signature(now)
        with _storing("writing the release commit", self.path):
            commit_id = repo.create_commit(None, sig, sig, message, tree, [parent] if parent else [])
        return str(commit_id), step

