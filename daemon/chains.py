"""Release chains as the daemon serves them: which release a request is frozen to, where its artifact is
checked out, and publishing (init, rollback, promote, and later train) with events, metrics and preloading.

``daemon/releases/`` is the git-backed store; this module is the daemon's view of it:

- Each request reads its scenario's head (a loose-ref read, tens of microseconds) so that a publish by any
  process (the daemon, a trainer, a test) is picked up by the next request, and freezes to that release.
  Release metadata is immutable and cached by id.
- A weights release is checked out once per ``content_id`` under ``$REEF_HOME/cache/releases/<content_id>``
  (large files hard-linked from the store, so a checkout costs milliseconds) and loaded by the engine beside
  what is serving.
- A LoRA adapter release (``daemon/lora.py``) is checked out the same way (a few MB); its ``ReleaseRef`` names the
  release holding its base (checked out too), which the engine keeps resident once for all releases on it.
- A scenario's chain starts with an ``init`` release of its base artifact, published on first use: for a local
  model the model directory (weights stored once per distinct content), for an upstream model an empty harness.
- With ``chain_remote``, publishing is compare-and-swap against the remote's refs (``daemon/chain_remote.py``),
  and a follow task fetches the remote's heads every ``chain_fetch_s``: a release another daemon published is
  taken in (LFS objects, then the local head), so the next request here serves it, as any local publish.
  A remote that cannot be reached is logged (once per outage) and shown in ``status()``; serving goes on.
- A release's ``requires`` (``daemon/releases/requires.py``) are checked on this machine before it is loaded for a
  request (``resolve``: the result kept a second per release), rolled back to, promoted, published or held, and
  before a chain remote's new head is followed; refused with the item named and the newest release that needs
  nothing more offered (``RequirementUnmet``). Candidates say what their scenario's settings ``requires``.
- Store calls run in worker threads (pygit2 releases the GIL for I/O); the store handles its own locking. The
  store is this module's own: the rest of the daemon reads and writes chains through ``Chains``, and every write
  takes one ``Manifest`` (``manifest`` fills in the scenario's kind and recipe).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from daemon import lora
from daemon.config import Config
from daemon.engines.base import Engine, ReleaseRef
from daemon.engines.registry import engine_kind
from daemon.errors import BadRequest, EngineError, HeadMoved, NotFound, RequirementUnmet, StorageError
from daemon.events import EventBus
from daemon.metrics import Metrics
from daemon.records import Scenario
from daemon.releases import Manifest, Rejection, Release, ReleaseStore, bundle, files_from_dir, requires

log = logging.getLogger("reef.chains")
_NEEDS_TTL_S = 1.0  # how long a request reuses a release's requirement check (a tool installed counts after this)


def artifact_kind(config: Config, scenario: Scenario) -> str:
    """What a scenario's releases hold: its recipe's kind, or (recipes that never train) what its model's engine
    serves (``daemon/engines/registry.py``: weights, else a harness)."""
    from recipes import load_recipe

    kind = load_recipe(scenario.recipe).kind
    if kind != "none":
        return kind
    return "weights" if engine_kind(config.model(scenario.model).engine).weights else "harness"


def _files(candidate: str | Path | Mapping[str, bytes]) -> Mapping[str, Any]:
    """A candidate as release files: a directory (weights) or a mapping of paths to bytes (a harness tree)."""
    return candidate if isinstance(candidate, Mapping) else files_from_dir(candidate)


class Chains:
    def __init__(self, config: Config, events: EventBus, metrics: Metrics,
                 ensure_model: Callable[[str], Awaitable[Any]] | None = None) -> None:
        self.config = config
        self.ensure_model = ensure_model  # builds a built-in model on first use, before its init release
        self.events = events
        self.metrics = metrics
        remote = None
        if config.chain_remote is not None:
            from daemon.chain_remote import ChainRemote

            remote = ChainRemote(config.artifacts_path, config.chain_remote, lfs_store=config.chain_lfs,
                                 max_blob_bytes=config.chain_max_blob_bytes, max_lfs_bytes=config.chain_max_lfs_bytes)
        self._store = ReleaseStore(config.artifacts_path, remote=remote, needs=self._unmet_remote)
        self._needs: dict[str, tuple[float, RequirementUnmet | None]] = {}  # release id -> (checked at, refusal)
        self._follow: asyncio.Task[None] | None = None
        self.remote_state: dict[str, Any] = {} if remote is None else {"url": remote.shown, "last_fetch": None,
                                                                       "error": None}
        self.cache_dir = config.home / "cache" / "releases"
        self._releases: dict[str, Release] = {}
        self._checkouts: dict[str, Path] = {}
        self._bases: dict[str, ReleaseRef | None] = {}  # content id -> the base of an adapter release (or None)
        self._checkout_locks: dict[str, asyncio.Lock] = {}
        self._init_locks: dict[str, asyncio.Lock] = {}
        self._announced: dict[str, str | None] = {}  # scenario -> the head last announced on /reef/events
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        report = await asyncio.to_thread(self._store.recover)
        if report.get("removed"):
            log.warning("removed stale release-chain locks left by a crash: %s", report["removed"])
        if self._store.remote is not None:
            await self._follow_once()  # serve what the remote has from the first request on
            self._follow = asyncio.ensure_future(self._follow_remote())
        self._announced = await asyncio.to_thread(self.heads)
        self._watch = asyncio.ensure_future(self._watch_heads())

    async def _follow_once(self) -> list[str]:
        import time

        from daemon.errors import ReefError, RemoteReleaseRefused

        try:
            moved = await asyncio.to_thread(self._store.follow)
        except RemoteReleaseRefused as e:  # fetched, but some releases refused: the rest were taken in
            if self.remote_state.get("error") != e.message:
                log.warning("following the chain remote: %s", e.message)
            self.remote_state.update(error=e.message, last_fetch=time.time())
            return e.moved
        except ReefError as e:
            if self.remote_state.get("error") != e.message:
                log.warning("following the chain remote: %s", e.message)
            self.remote_state["error"] = e.message
            return []
        if self.remote_state.get("error"):
            log.warning("the chain remote %s answers again", self.remote_state["url"])
        self.remote_state.update(error=None, last_fetch=time.time())
        return moved

    async def _follow_remote(self) -> None:
        """Fetch the remote's heads every ``chain_fetch_s``; a moved scenario head is announced at once."""
        while True:
            await asyncio.sleep(self.config.chain_fetch_s)
            try:
                for name in await self._follow_once():
                    if name.startswith("refs/reef/scenarios/"):
                        self._announce(name[len("refs/reef/scenarios/"):], await asyncio.to_thread(
                            self._store.head, name[len("refs/reef/scenarios/"):]))
            except Exception:  # never let the follower die: the next round looks again
                log.warning("following the chain remote", exc_info=True)

    def _announce(self, name: str, head: str | None) -> None:
        if head is None or self._announced.get(name) == head:
            return
        self._announced[name] = head
        rel = self._store.get(head)
        self.events.publish(
            "release", scenario=rel.scenario, release_id=rel.release_id, content_id=rel.content_id,
            step=rel.step, operation=rel.operation, source=rel.source, metrics=rel.metrics, external=True,
        )

    async def close(self) -> None:
        for task in (self._watch, self._follow):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def heads(self) -> dict[str, str | None]:
        """Every scenario's head as git has it now (blocking: run it off the loop)."""
        return {name: self._store.head(name) for name in self._store.scenarios()}

    async def _watch_heads(self, every: float = 1.0) -> None:
        """Announce heads moved by other processes (a trainer, a tool writing to git, another daemon) as
        ``release`` events, so followers of ``/reef/events`` (the TUI) see every change, not only this
        daemon's own publishes. A stat per scenario per second."""
        seen: dict[str, str | None] = {}
        while True:
            await asyncio.sleep(every)
            try:
                heads = await asyncio.to_thread(self.heads)
                # a head counts once two looks agree: this daemon's own publish is announced by its publisher
                # in the meantime, never twice
                stable = {name: head for name, head in heads.items() if seen.get(name) == head}
                seen = heads
                for name, head in stable.items():
                    if head is not None and self._announced.get(name) != head:
                        self._announced[name] = head
                        rel = await self.release(head)
                        self.events.publish(
                            "release", scenario=rel.scenario, release_id=rel.release_id, content_id=rel.content_id,
                            step=rel.step, operation=rel.operation, source=rel.source, metrics=rel.metrics,
                            external=True,
                        )
            except Exception:  # a torn read while another process writes: look again next time
                log.debug("watching release heads", exc_info=True)

    # --- reading -------------------------------------------------------------------------------------------

    async def release(self, release_id: str) -> Release:
        rel = self._releases.get(release_id)
        if rel is None:
            rel = await asyncio.to_thread(self._store.get, release_id)
            self._releases[rel.release_id] = rel
        return rel

    async def head(self, scenario: Scenario, *, base: str | None = None) -> Release:
        """The release serving the scenario now, publishing its ``init`` release (from ``base``) on first use."""
        head = self._store.head(scenario.name)
        if head is None:
            return await self._init(scenario, base)
        return await self.release(head)

    async def resolve(self, scenario: Scenario, pinned: str | None) -> Release:
        """The release a request is frozen to: the head, or a release of this scenario the client pinned; refused
        (``RequirementUnmet``) when this machine does not have what it requires."""
        rel = await self._resolve(scenario, pinned)
        await self.check_needs(rel)
        return rel

    async def _resolve(self, scenario: Scenario, pinned: str | None) -> Release:
        if not pinned:
            return await self.head(scenario)
        try:
            rel = await self.release(pinned)
        except NotFound:
            raise NotFound(f"unknown release {pinned!r}", release_id=pinned, param="x-reef-release-id") from None
        if rel.scenario != scenario.name or not await asyncio.to_thread(self._store.belongs, scenario.name,
                                                                        rel.release_id):
            raise BadRequest(
                f"release {pinned} is not on the release chain of scenario {scenario.name!r}",
                release_id=pinned, param="x-reef-release-id",
            )
        return rel

    async def ref(self, scenario: Scenario, rel: Release) -> ReleaseRef:
        if not rel.serves_weights:
            return ReleaseRef(rel.release_id, rel.content_id, None)
        return ReleaseRef(rel.release_id, rel.content_id, await self.checkout(rel), await self._adapter_base(rel))

    async def _adapter_base(self, rel: Release) -> ReleaseRef | None:
        """For an adapter release, the release of whole weights it applies to (checked out); None otherwise.
        A function of the content (the manifest is part of it), so it is looked up once per content id."""
        if rel.content_id in self._bases:
            return self._bases[rel.content_id]
        manifest = await asyncio.to_thread(self._store.adapter, rel.release_id)
        base = None
        if manifest is not None:
            try:
                base_rel = await self.release(manifest.base_release_id)
            except NotFound:
                raise EngineError(f"release {rel.release_id} is an adapter on release {manifest.base_release_id}, "
                                  "which is not in the store; not served") from None
            if base_rel.content_id != manifest.base_content_id or (
                    await asyncio.to_thread(self._store.adapter, base_rel.release_id)) is not None:
                raise EngineError(f"release {rel.release_id} is an adapter on base {manifest.base_content_id}, but "
                                  f"release {base_rel.release_id} does not hold that model; not served")
            base = ReleaseRef(base_rel.release_id, base_rel.content_id, await self.checkout(base_rel))
        self._bases[rel.content_id] = base
        return base

    async def checkout(self, rel: Release) -> Path:
        path = self._checkouts.get(rel.content_id)
        if path is not None:
            return path
        lock = self._checkout_locks.setdefault(rel.content_id, asyncio.Lock())
        async with lock:
            dest = self.cache_dir / rel.content_id
            done = self.cache_dir / f"{rel.content_id}.ok"
            # the store reads only a tree id as a content id; a path that resolves elsewhere is never removed
            if not re.fullmatch(r"[0-9a-f]{40}", rel.content_id) or dest.resolve().parent != self.cache_dir.resolve():
                raise StorageError(f"release {rel.release_id}: content id {rel.content_id!r} is not a checkout "
                                   f"directory under {self.cache_dir}; not served", release_id=rel.release_id)
            if not done.exists():
                if dest.exists():
                    await asyncio.to_thread(shutil.rmtree, dest)  # a checkout a crash left half-done
                await asyncio.to_thread(self._store.checkout, rel.release_id, dest, link=True)
                done.touch()
            self._checkouts[rel.content_id] = dest
            return dest

    async def head_id(self, name: str) -> str | None:
        """The scenario's head as git has it now (None: no chain yet); unlike ``head``, never publishes."""
        return self._store.head(name)

    async def history(self, name: str, limit: int | None = None) -> list[Release]:
        """The scenario's chain, newest first."""
        return await asyncio.to_thread(self._store.history, name, limit)

    async def pending(self, name: str) -> list[Release]:
        """Candidates held for review, newest first."""
        return await asyncio.to_thread(self._store.pending, name)

    async def rejections(self, name: str, limit: int | None = None) -> list[Rejection]:
        """Candidates written down as not released, newest first."""
        return await asyncio.to_thread(self._store.rejections, name, limit)

    async def pruned_of(self, releases: Iterable[Release]) -> dict[str, list[str]]:
        """Per release, its files whose weights a retention policy pruned (``daemon/retention.py``; empty: all here)."""
        return await asyncio.to_thread(lambda: {r.release_id: self._store.pruned(r) for r in releases})

    async def rejected_candidates(self, name: str) -> list[Release]:
        """The candidates on the scenario's rejection log whose commits are still readable, newest first."""
        def read() -> list[Release]:
            out = []
            for c in dict.fromkeys(r.candidate for r in self._store.rejections(name) if r.candidate is not None):
                with contextlib.suppress(NotFound, StorageError):
                    out.append(self._store.get(c))
            return out

        return await asyncio.to_thread(read)

    async def prune(self, drop: list[str]) -> dict[str, Any]:
        """Prune the weights only the releases ``drop`` name (``ReleaseStore.prune``), and their checkouts."""
        out = await asyncio.to_thread(self._store.prune, drop)
        for rid in out["releases"]:
            cid = (await self.release(rid)).content_id
            self._checkouts.pop(cid, None)
            (self.cache_dir / f"{cid}.ok").unlink(missing_ok=True)  # first: a half-removed one is checked out again
            await asyncio.to_thread(shutil.rmtree, self.cache_dir / cid, True)
        return out

    async def adapter(self, release_id: str) -> lora.AdapterManifest | None:
        """The base a LoRA adapter release applies to; None for a release of whole weights or a harness."""
        return await asyncio.to_thread(self._store.adapter, release_id)

    async def diff(self, release_id: str) -> dict[str, Any]:
        """What changed from the release's parent to the release."""
        return await asyncio.to_thread(self._store.diff, release_id)

    async def consumed(self, name: str) -> set[str]:
        """Receipts listed in a release or a rejection of the scenario's chain."""
        def read() -> set[str]:
            out: set[str] = set()
            for rel in self._store.history(name):
                out.update(rel.receipts)
            for rej in self._store.rejections(name):
                out.update(rej.receipts)
            return out

        return await asyncio.to_thread(read)

    async def harness_tree(self, rel: Release) -> dict[str, bytes]:
        """The harness files of a release: all of a harness release's, a bundle's ``harness/``, none of weights."""
        def read() -> dict[str, bytes]:
            paths = bundle.harness_part(rel.kind, {f.path: f.path for f in self._store.files(rel.release_id)})
            return {path: self._store.read_file(rel.release_id, full) for path, full in paths.items()}

        return await asyncio.to_thread(read)

    # --- publishing ----------------------------------------------------------------------------------------

    async def _init(self, scenario: Scenario, base: str | None = None) -> Release:
        lock = self._init_locks.setdefault(scenario.name, asyncio.Lock())
        async with lock:
            head = self._store.head(scenario.name)
            if head is not None:
                return await self.release(head)
            kind = artifact_kind(self.config, scenario)
            entry = self.config.model(scenario.model)
            files: dict[str, Any] = {}
            source = None
            if base is not None:  # start from another release's content (any scenario's)
                base_rel = await self.release(base)
                if base_rel.kind != kind:
                    raise BadRequest(f"base_release {base} holds {base_rel.kind}, scenario {scenario.name!r} "
                                     f"serves {kind}", param="base_release")
                files = files_from_dir(await self.checkout(base_rel)) if kind == "weights" else {
                    f.path: await asyncio.to_thread(self._store.read_file, base_rel.release_id, f.path)
                    for f in await asyncio.to_thread(self._store.files, base_rel.release_id)
                }
                source = base_rel.release_id
            elif kind == "weights" and entry.path is not None:
                if self.ensure_model is not None:
                    await self.ensure_model(scenario.model)
                files = files_from_dir(entry.path)
                if not files:
                    raise EngineError(f"model {scenario.model}: no files in {entry.path}")
            manifest = Manifest(scenario.name, "init", kind, scenario.recipe, settings={"model": scenario.model},
                                source=source, summary=f"init {scenario.name} from {source or scenario.model}")
            try:
                rel = await asyncio.to_thread(self._store.publish, manifest, files, expected_head=None)
            except HeadMoved as e:  # another process published the init first: serve that
                assert e.actual is not None
                return await self.release(e.actual)
            self._published(rel)
            return rel

    async def rollback(self, scenario: Scenario, release_id: str, expected_head: str | None,
                       engine: Engine | None) -> Release:
        return await self._steer("rollback", scenario, release_id, expected_head, engine)

    async def promote(self, scenario: Scenario, release_id: str, expected_head: str | None,
                      engine: Engine | None, *, summary: str | None = None,
                      metrics: Mapping[str, Any] | None = None) -> Release:
        return await self._steer("promote", scenario, release_id, expected_head, engine, summary=summary,
                                 metrics=metrics)

    async def _steer(self, op: str, scenario: Scenario, release_id: str, expected_head: str | None,
                     engine: Engine | None, **extra: Any) -> Release:
        await self.head(scenario)  # a chain to steer exists
        with contextlib.suppress(NotFound, BadRequest):  # an unknown id: the store's own step says which
            target = await self.release(release_id)
            if target.carries_harness:  # never steer to a harness the policy refuses (one from before it, say)
                from daemon.harness_policy import check_served

                check_served(await self.harness_tree(target), release=target.release_id)
            what = "rolling back to" if op == "rollback" else "promoting"
            await self.check_needs(target, f"{what} release {target.release_id[:12]} (step {target.step})", fresh=True)
        fn = self._store.rollback if op == "rollback" else self._store.promote
        extra = {k: v for k, v in extra.items() if v is not None}
        return await self._append(scenario, engine, functools.partial(fn, scenario.name, release_id,
                                                                      expected_head=expected_head, **extra))

    async def bundle(self, scenario: Scenario, weights: str, harness: str, expected_head: str | None,
                     engine: Engine | None) -> Release:
        """Publish on ``scenario`` one release holding the adapter of release ``weights``, the harness of release
        ``harness`` and the evidence for both (``daemon/releases/bundle.py``), loaded before a request needs it. The
        scenario does not train (a learning step would publish weights alone) and serves the adapter's base; the
        harness passes the harness policy without anything a person must admit."""
        from daemon import harness_policy
        from daemon.layout import check_tree
        from recipes import load_recipe

        if load_recipe(scenario.recipe).kind != "none":
            raise BadRequest(f"scenario {scenario.name!r} learns ({scenario.recipe}): its next step would publish "
                             "weights without the harness. Publish bundles on a scenario that does not train: "
                             "reef scenarios create NAME --recipe record", param="scenario")
        head = await self.head(scenario)
        if not head.serves_weights:
            raise BadRequest(f"scenario {scenario.name!r} serves a harness on an upstream model; a bundle's adapter "
                             "needs a scenario serving a local model's weights", param="scenario")
        parts = {}
        for role, rid, kinds in (("weights", weights, ("weights",)), ("harness", harness, ("harness", "bundle"))):
            if not isinstance(rid, str) or not rid:
                raise BadRequest(f"{role} is required: the id of the {role} release to bundle", param=role)
            try:
                rel = await self.release(rid)
            except (NotFound, BadRequest):
                raise NotFound(f"unknown {role} release {rid!r}", release_id=rid, param=role) from None
            if rel.kind not in kinds:
                raise BadRequest(f"release {rel.release_id[:12]} holds {rel.kind}, not {role}", param=role)
            parts[role] = rel
        if await self.adapter(parts["weights"].release_id) is None:
            raise BadRequest(f"release {parts['weights'].release_id[:12]} holds whole weights, not a LoRA adapter; a "
                             "bundle carries an adapter on the scenario's base", param="weights")
        tree = await self.harness_tree(parts["harness"])
        check_tree(tree)
        found = harness_policy.findings(tree, allow_executable=True)
        if found:  # what a person admitted for one scenario is not carried into another by a command
            raise BadRequest(f"the harness of release {parts['harness'].release_id[:12]} holds what the harness "
                             f"policy refuses or holds for review: {found[0]}", param="harness")
        files = bundle.files(files_from_dir(await self.checkout(parts["weights"])), tree,
                             bundle.evidence(parts["weights"], parts["harness"]))
        manifest = Manifest(scenario.name, "bundle", "bundle", scenario.recipe,
                            receipts=(*parts["weights"].receipts, *parts["harness"].receipts),
                            origin={"kind": "bundle", "weights": parts["weights"].release_id,
                                    "harness": parts["harness"].release_id},
                            summary=f"bundle: weights {parts['weights'].release_id[:12]} (step "
                                    f"{parts['weights'].step} of {parts['weights'].scenario}), harness "
                                    f"{parts['harness'].release_id[:12]} (step {parts['harness'].step} of "
                                    f"{parts['harness'].scenario})",
                            requires=tuple(dict.fromkeys((*parts["weights"].requires, *parts["harness"].requires))))
        await self._check_candidate(manifest, "bundling")
        return await self._append(scenario, engine, functools.partial(
            self._store.publish, manifest, files, expected_head=expected_head or head.release_id))

    def manifest(self, scenario: Scenario, *, metrics: Mapping[str, Any] | None = None,
                 receipts: Iterable[str] = (), settings: Mapping[str, Any] | None = None,
                 origin: Mapping[str, Any] | None = None) -> Manifest:
        """The ``Manifest`` of a trained candidate of ``scenario``: its kind (``artifact_kind``) and recipe filled in,
        so a candidate's release can never say another kind than the chain serves; ``origin``: an agent's proposal
        that made it (``daemon/proposals.py``)."""
        wanted = {**self.config.recipes.get(scenario.recipe, {}), **scenario.settings}.get("requires")
        return Manifest(scenario.name, "train", artifact_kind(self.config, scenario), scenario.recipe,
                        metrics=metrics or {}, receipts=tuple(receipts), settings=settings or {}, origin=origin,
                        summary=_origin_summary(origin), requires=tuple(wanted or ()))

    async def publish_candidate(self, scenario: Scenario, manifest: Manifest,
                                path: str | Path | Mapping[str, bytes], *, expected_head: str,
                                engine: Engine | None = None) -> Release:
        """Publish a trained candidate (a model directory or a harness tree) as the next release, compare-and-swap
        on the base; with ``engine``, loaded before the first request needs it."""
        if manifest.scenario != scenario.name:
            raise ValueError(f"a manifest of {manifest.scenario!r} published on {scenario.name!r}")
        await self._check_candidate(manifest, "publishing")
        return await self._append(scenario, engine, functools.partial(self._store.publish, manifest, _files(path),
                                                                      expected_head=expected_head))

    async def _append(self, scenario: Scenario, engine: Engine | None, cas: Callable[[], Release]) -> Release:
        """The one after-publish path: ``cas`` (a publish, rollback or promote) run off the loop, a lost race
        counted, the new release announced, and with ``engine`` loaded before the first request needs it."""
        try:
            rel = await asyncio.to_thread(cas)
        except HeadMoved:
            self.metrics.conflicts.inc()
            raise
        self._published(rel)
        if engine is not None:
            await self.preload(scenario, rel, engine)
        return rel

    async def hold(self, manifest: Manifest, path: str | Path | Mapping[str, bytes], *, base: str) -> Release:
        """Keep a candidate for review (``reef releases promote``) without releasing it."""
        await self._check_candidate(manifest, "holding")
        rel = await asyncio.to_thread(self._store.hold, manifest, _files(path), base=base)
        self.events.publish("release.pending", scenario=manifest.scenario, release_id=rel.release_id, step=rel.step,
                            metrics=dict(manifest.metrics))
        return rel

    async def reject(self, manifest: Manifest, *, verdict: str, reason: str, base: str,
                     candidate: str | None = None) -> None:
        """Write down a candidate that was not released (rejected, skipped, failed) on the scenario's rejection
        log, with its receipts, so they count as consumed; ``candidate``: a held one, discarded with it."""
        await asyncio.to_thread(functools.partial(self._store.record_rejection, manifest, verdict=verdict,
                                                  reason=reason, base=base, candidate=candidate))

    # --- what releases require (daemon/releases/requires.py) ---------------------------------------------------

    def requirements(self, rel: Release) -> list[dict[str, Any]]:
        """Each item ``rel`` requires, checked on this machine now: ``{item, kind, met, found}`` (``releases show``)."""
        machine = requires.Machine.of(self.config)
        return [c.to_dict() for c in requires.check_all(rel.requires, machine)]

    async def check_needs(self, rel: Release, what: str | None = None, *, fresh: bool = False) -> None:
        """Refuse (``RequirementUnmet``) to ``what`` ``rel`` when this machine lacks an item it requires, naming it and
        the newest release of its chain that needs nothing more. A release that requires nothing costs nothing; the
        answer for one that does is kept ``_NEEDS_TTL_S`` for requests (``fresh``: checked now)."""
        if not rel.requires:
            return
        now = time.monotonic()
        request = what is None  # only a request's check is kept (its message says "loading")
        kept = self._needs.get(rel.release_id) if request and not fresh else None
        if kept is not None and now - kept[0] < _NEEDS_TTL_S:
            refusal = kept[1]
        else:
            what = what or f"loading release {rel.release_id[:12]} (step {rel.step})"
            refusal = await asyncio.to_thread(self._refusal, rel.scenario, rel.release_id, rel.requires, what)
            if request:
                if len(self._needs) > 4096:
                    self._needs.clear()
                self._needs[rel.release_id] = (now, refusal)
        if refusal is not None:  # a new one each time: a kept exception re-raised would grow its traceback
            raise RequirementUnmet(refusal.message, release_id=refusal.release_id, requirement=refusal.requirement,
                                   found=refusal.found, offered=refusal.offered)

    async def _check_candidate(self, manifest: Manifest, what: str) -> None:
        """A candidate this machine could not run is not made: never a head (or a canary) that cannot serve here."""
        if manifest.requires:
            refusal = await asyncio.to_thread(self._refusal, manifest.scenario, None, manifest.requires,
                                              f"{what} a candidate of {manifest.scenario!r}")
            if refusal is not None:
                raise refusal

    def _refusal(self, scenario: str, release_id: str | None, needs: Iterable[str], what: str,
                 chain_from: str | None = None) -> RequirementUnmet | None:
        """The refusal of ``needs`` on this machine, or None when all are met (in a worker thread)."""
        machine = requires.Machine.of(self.config)
        unmet = requires.first_unmet(needs, machine)
        if unmet is None:
            return None
        head = self._store.head(scenario)
        start = chain_from or head
        offered = requires.offer(self._store.chain_from(start) if start else (), machine)
        return RequirementUnmet(requires.refusal(what, scenario, unmet, offered, head), release_id=release_id,
                                requirement=unmet.item, found=unmet.found,
                                offered=offered.release_id if offered else None)

    def _unmet_remote(self, release_id: str) -> str | None:
        """Why a chain remote's new head ``release_id`` is not followed here: what it requires that this machine
        lacks, and the newest release of the remote's chain that needs nothing more; None when nothing."""
        rel = self._store.get(release_id)
        if not rel.requires:
            return None
        refusal = self._refusal(rel.scenario, release_id, rel.requires,
                                f"following release {release_id[:12]} (step {rel.step})", chain_from=release_id)
        return None if refusal is None else refusal.message

    def _published(self, rel: Release) -> None:
        self._releases[rel.release_id] = rel
        self._announced[rel.scenario] = rel.release_id
        self.metrics.publishes.labels(rel.operation).inc()
        self.events.publish(
            "release", scenario=rel.scenario, release_id=rel.release_id, content_id=rel.content_id,
            step=rel.step, operation=rel.operation, source=rel.source, metrics=rel.metrics,
        )

    async def preload(self, scenario: Scenario, rel: Release, engine: Engine) -> None:
        """Load a freshly published release so the first request on it does not wait for the load."""
        with contextlib.suppress(Exception):
            load_id = await engine.preload(await self.ref(scenario, rel))
            if load_id is not None:
                self.metrics.loads.labels(scenario.model).inc()
                self.events.publish("engine.load", model=scenario.model, scenario=scenario.name,
                                    release_id=rel.release_id, content_id=rel.content_id, runtime_load_id=load_id)



def _origin_summary(origin: Mapping[str, Any] | None) -> str | None:
    """The commit summary of a candidate an agent proposed (None: the operation's default)."""
    if origin is None or origin.get("kind") != "proposal":
        return None
    return f"agent proposal: {origin.get('op')} {origin.get('target')}: {origin.get('reason')}"[:120]
