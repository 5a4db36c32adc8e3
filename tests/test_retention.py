"""Checkpoint retention (issue 49, ``daemon/retention.py``, ``daemon/releases/pruning.py``,
``daemon/learning_storage.py``): a weights scenario's
``keep_releases`` keeps the weights of its newest releases and of every release still served or pinned; the others'
weights are pruned while the chain keeps every entry (a pruned release stays listed, says so, and a rollback to it
is refused naming a release to roll back to instead); a bound below one checkpoint is refused naming the setting;
and a weights step with the disk short of its need waits, says why, and runs once space returns.

Real git stores and a real daemon on the tiny model over real sockets. Disk shortness is simulated, never made by
filling the disk: through ``storage_reserve_mb`` (a reserve no disk has) for the daemon, and through
``StorageGuard.free``, the injectable free-space reading, for the wait and its timer."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon import lora
from daemon.errors import BadRequest, StorageError, WeightsPruned
from daemon.events import EventBus
from daemon.learning_storage import StorageGuard
from daemon.releases import ReleaseStore
from daemon.retention import plan, protected_of
from recipes import load_recipe
from recipes.base import check_retention
from tests.conftest import Daemon, assert_canonical_error
from tests.test_learning import releases, serve_and_report, settings_toml, wait_for

BIG = 4096  # the stores here keep files over this as LFS objects (weights)


def weights(n: int) -> bytes:
    return bytes([n % 251]) * (BIG + 1 + n)


def chain(tmp_path: Path, n: int, scenario: str = "s") -> tuple[ReleaseStore, list[str]]:
    """A store whose ``scenario`` has an init and ``n`` train releases, each with its own weights; ids oldest first."""
    store = ReleaseStore(tmp_path / "artifacts.git", lfs_threshold=BIG)
    ids = [store.publish(scenario, {"model.bin": weights(0), "config.json": "{}"}, expected_head=None,
                         operation="init", kind="weights", recipe="online-rl").release_id]
    for i in range(1, n + 1):
        ids.append(store.publish(scenario, {"model.bin": weights(i), "config.json": "{}"}, expected_head=ids[-1],
                                 operation="train", kind="weights", recipe="online-rl").release_id)
    return store, ids


# --- the store: what pruning removes, what it never does -------------------------------------------------------


def test_pruning_removes_only_weights_no_kept_release_names_and_the_chain_keeps_every_entry(tmp_path: Path) -> None:
    """Pruned releases stay on the chain with their manifests and say which files were pruned; the objects shared
    with a kept release (another scenario's init on the same model) stay; ``fsck`` passes (a tombstone marks each
    removed object); loading or rolling back to a pruned release is ``WeightsPruned`` naming a kept one."""
    store, ids = chain(tmp_path, 3)
    other = store.publish("t", {"model.bin": weights(0), "config.json": "{}"}, expected_head=None, operation="init",
                          kind="weights", recipe="online-rl")  # the same base model: its object is shared
    out = store.prune([ids[0], ids[1]])
    assert out["objects"] == 1 and out["bytes"] == len(weights(1)) and out["releases"] == [ids[1]], out
    assert [r.release_id for r in store.history("s")] == ids[::-1]  # the chain keeps every entry
    assert store.pruned(store.get(ids[1])) == ["model.bin"]
    assert store.pruned(store.get(ids[0])) == [] and store.pruned(other) == []  # shared with t's head: kept
    assert [store.pruned(store.get(r)) for r in ids[2:]] == [[], []]
    assert store.read_file(ids[1], "config.json") == b"{}"  # small files live in git: never pruned
    assert store.fsck()["ok"], store.fsck()["errors"]
    with pytest.raises(WeightsPruned) as e:
        store.rollback("s", ids[1])
    message = e.value.message
    assert ids[1][:12] in message and "pruned by the scenario's retention policy" in message, message
    assert f"reef releases rollback {ids[2][:12]} --scenario s" in message and e.value.offered == ids[2], message
    assert "keep_releases" in message and store.head("s") == ids[3]  # nothing published
    with pytest.raises(WeightsPruned) as e:
        store.checkout(ids[1], tmp_path / "out")
    assert "cannot load release" in e.value.message and not (tmp_path / "out").exists()
    assert store.rollback("s", ids[2]).source == ids[2]  # a kept one rolls back as ever


def test_heads_and_pending_candidates_are_never_pruned_whatever_the_caller_asks(tmp_path: Path) -> None:
    """A chain's head serves and a pending candidate (a canary's arm, one held for review) may be promoted: asked to
    drop them, the store keeps their weights. Bugs caught: the store's guard without heads, or without pending."""
    store, ids = chain(tmp_path, 1)
    held = store.hold("s", {"model.bin": weights(9), "config.json": "{}"}, kind="weights", recipe="online-rl")
    out = store.prune([ids[1], held.release_id, ids[0]])
    assert out["releases"] == [ids[0]], out
    assert store.pruned(store.get(ids[1])) == [] and store.pruned(held) == []
    assert store.promote("s", held.release_id).operation == "promote"
    store.checkout(held.release_id, tmp_path / "held")  # its weights are all here
    assert (tmp_path / "held" / "model.bin").read_bytes() == weights(9)


def test_an_adapter_keeps_its_base_and_a_rejected_candidate_can_go(tmp_path: Path) -> None:
    """The base model an adapter release applies to is kept while the adapter is, even when the base's release is
    dropped; a rejected candidate's weights go when it is dropped."""
    store = ReleaseStore(tmp_path / "artifacts.git", lfs_threshold=BIG)
    base = store.publish("s", {"model.bin": weights(0)}, expected_head=None, operation="init", kind="weights",
                         recipe="online-rl")

    def adapter(n: int) -> dict[str, Any]:
        return {lora.CONFIG: "{}", lora.WEIGHTS: weights(100 + n),
                lora.MANIFEST: lora.AdapterManifest(base.content_id, base.release_id).to_bytes()}

    first = store.publish("s", adapter(1), expected_head=base.release_id, operation="train", kind="weights",
                          recipe="online-rl")
    second = store.publish("s", adapter(2), expected_head=first.release_id, operation="train", kind="weights",
                           recipe="online-rl")
    held = store.hold("s", adapter(3), kind="weights", recipe="online-rl")
    store.record_rejection("s", verdict="canary-ended", reason="a test", candidate=held.release_id)
    out = store.prune([base.release_id, first.release_id, held.release_id])
    assert sorted(out["releases"]) == sorted([first.release_id, held.release_id]), out
    assert store.pruned(store.get(base.release_id)) == []  # the head's adapter applies to it
    assert store.pruned(store.get(first.release_id)) == [lora.WEIGHTS] and store.pruned(second) == []
    assert store.fsck()["ok"]


def test_an_object_missing_without_a_tombstone_is_damage_not_pruning(tmp_path: Path) -> None:
    """Only a retention policy's removal reads as pruned: an object lost otherwise is a storage error and fsck
    names it (a tombstone per removed object tells the two apart)."""
    store, ids = chain(tmp_path, 1)
    sha = store.get(ids[1]).lfs["model.bin"]["oid"].split(":", 1)[1]
    store.lfs_path(sha).unlink()
    assert store.pruned(store.get(ids[1])) == []
    assert any(sha in e for e in store.fsck()["errors"])
    with pytest.raises(StorageError):
        store.checkout(ids[1], tmp_path / "out")


def test_weights_stored_again_are_no_longer_pruned(tmp_path: Path) -> None:
    store, ids = chain(tmp_path, 2)
    store.prune([ids[1]])
    assert store.pruned(store.get(ids[1])) == ["model.bin"]
    store.publish("s", {"model.bin": weights(1), "config.json": "{}"}, expected_head=ids[2], operation="train",
                  kind="weights", recipe="online-rl")  # the same weights published again
    assert store.pruned(store.get(ids[1])) == [] and store.rollback("s", ids[1]).source == ids[1]


def test_a_pruned_store_seeds_a_new_chain_remote_without_the_pruned_weights(tmp_path: Path) -> None:
    """A store pruned before a chain remote was configured pushes its chains there at the first follow, every LFS
    object but the pruned ones with them (it has no others to send). Bug caught: the seeding reading a pruned object
    and failing every follow."""
    from daemon.chain_remote import ChainRemote
    from tests.test_chain_remote import bare, remote_head

    store, ids = chain(tmp_path, 2)
    store.prune([ids[1]])
    remote = bare(tmp_path / "chains.git")
    path = tmp_path / "artifacts.git"
    synced = ReleaseStore(path, lfs_threshold=BIG, remote=ChainRemote(path, str(remote)))
    synced.follow()
    assert remote_head(remote, "s") == ids[2]
    sent = {p.name for p in (remote / "lfs" / "objects").rglob("*") if p.is_file()}
    shas = [store.get(r).lfs["model.bin"]["oid"].split(":", 1)[1] for r in ids]
    assert shas[0] in sent and shas[2] in sent and shas[1] not in sent, sent


# --- the policy ------------------------------------------------------------------------------------------------


def _rel(rid: str, content: str | None = None, lfs: bool = True, score: Any = None) -> Any:
    return SimpleNamespace(release_id=rid, content_id=content or f"c{rid}", metrics={"eval_reward": score},
                           lfs={"model.bin": {"oid": f"sha256:{rid}", "size": 1}} if lfs else {})


def test_the_plan_keeps_the_newest_n_and_what_is_protected() -> None:
    """Newest first: the first ``keep`` stay, the head always among them, and the chain's first release (its base);
    a protected release (by id or content) stays at any age; a release without LFS weights has nothing to prune. Bugs caught: an off-by-one in N either
    way, keeping the oldest instead of the newest, ignoring protection."""
    history = [_rel(str(i)) for i in range(6, -1, -1)]  # 6 (the head) .. 0 (the init: the base, always kept)
    assert plan(history, 3, set()) == ["3", "2", "1"]
    assert plan(history, 1, set()) == ["5", "4", "3", "2", "1"]  # the head stays at the least bound
    assert plan(history, 6, set()) == [] and plan(history, None, set()) == []
    assert plan(history, 3, {"2", "c1"}) == ["3"]
    assert plan(history, 3, set(), base=False) == ["3", "2", "1", "0"]  # rejected candidates have no base
    assert plan([_rel("2"), _rel("1", lfs=False), _rel("0")], 1, set()) == []


def test_the_best_policy_keeps_the_head_and_the_best_scored() -> None:
    """``keep_policy = "best"``: the head (whatever its score) and the ``keep - 1`` others of the highest gate score
    keep their weights, newest first among equals, a release without a finite score ranking last; the base stays.
    Bugs caught: the head dropped for a low score, ties kept oldest first, a missing score ranked first, the policy
    ignored."""
    scores = {6: 0.1, 5: 0.9, 4: float("nan"), 3: 0.5, 2: 0.9, 1: None, 0: 0.95}
    history = [_rel(str(i), score=scores[i]) for i in range(6, -1, -1)]
    assert plan(history, 3, set(), policy="best") == ["4", "3", "1"]  # kept: 6 (the head), 5 and 2 (0.9), 0 (base)
    assert plan(history, 2, set(), policy="best") == ["4", "3", "2", "1"]  # of two 0.9s, the newer
    assert plan(history, 4, set(), policy="best") == ["4", "1"]  # then 0.5; no score and NaN last
    assert plan(history, 1, set(), policy="best") == ["5", "4", "3", "2", "1"]
    assert plan(history, 3, set()) == ["3", "2", "1"]  # latest, the default
    for recipe in ("online-rl", "sao"):
        assert load_recipe(recipe).parse_settings({"keep_policy": "best", "keep_releases": 5}).keep_policy == "best"
        assert load_recipe(recipe).parse_settings({}).keep_policy == "latest"
        with pytest.raises(BadRequest) as e:
            load_recipe(recipe).parse_settings({"keep_policy": "worst"})
        assert e.value.data["param"] == "settings.keep_policy"


def test_protected_names_the_canary_arms_the_pins_and_the_forgetting_target() -> None:
    """What keeps its weights whatever its age: both arms of a running canary, what the engines keep for pinned
    and in-flight requests, and the release offered when the head was trained on forgotten data. Bugs caught:
    a canary arm, a pin or the rollback target left out."""
    residency = SimpleNamespace(heads={"s": "c-head"}, arms=frozenset({"c-arm"}), served={"s": {"c-served"}},
                                pins={"tiny": {"c-pinned": None}})
    canaries = {"s": {"release_id": "r-candidate", "base_id": "r-head"}}
    got = protected_of(canaries, residency, ["r-clean"])
    assert got == {"r-candidate", "r-head", "c-head", "c-arm", "c-served", "c-pinned", "r-clean"}


def test_a_scenarios_policy_is_read_from_its_settings() -> None:
    """What a pass reads of each scenario: its ``keep_releases`` and ``keep_policy`` as its settings say, nothing for
    one that keeps all or whose recipe trains no weights."""
    from daemon.retention import Retention

    def make_recipe(recipe: str, settings: dict[str, Any]) -> Any:
        cls = load_recipe(recipe)
        return cls(cls.parse_settings(settings))

    retention = Retention(SimpleNamespace(learner=SimpleNamespace(make_recipe=make_recipe)))  # type: ignore[arg-type]

    def policy(recipe: str, settings: dict[str, Any]) -> Any:
        return asyncio.run(retention.keep_of(SimpleNamespace(recipe=recipe, settings=settings)))  # type: ignore[arg-type]

    assert policy("online-rl", {"keep_releases": 3, "keep_policy": "best"}) == (3, "best")
    assert policy("sao", {}) is None  # the default: every release keeps its weights
    assert policy("sao", {"keep_releases": 20}) == (20, "latest")
    assert policy("online-rl", {"keep_releases": None}) is None
    assert policy("lessons", {}) is None


@pytest.mark.parametrize("recipe", ["online-rl", "sao", "ttt-discover", "openclaw-rl"])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bound_below_one_checkpoint_is_refused_naming_it(recipe: str, bad: Any) -> None:
    with pytest.raises(BadRequest) as e:
        load_recipe(recipe).parse_settings({"keep_releases": bad})
    assert e.value.data["param"] == "settings.keep_releases" and "keep_releases" in e.value.message


def test_every_weights_recipe_takes_the_bound_and_its_default() -> None:
    for recipe in ("online-rl", "sao", "ttt-discover", "openclaw-rl"):
        assert load_recipe(recipe).parse_settings({"keep_releases": 1}).keep_releases == 1
        assert load_recipe(recipe).parse_settings({}).keep_releases is None  # opt-in: any release can roll back
        assert load_recipe(recipe).parse_settings({"keep_releases": None}).keep_releases is None
        # a policy with no bound would choose among releases nothing prunes: refused, not taken and ignored
        with pytest.raises(BadRequest) as e:
            load_recipe(recipe).parse_settings({"keep_policy": "best"})
        assert e.value.data["param"] == "settings.keep_policy" and "needs keep_releases" in e.value.message
        assert load_recipe(recipe).parse_settings({"keep_policy": "best", "keep_releases": 3}).keep_policy == "best"
    check_retention(SimpleNamespace())  # a recipe without the setting: nothing to check
    with pytest.raises(BadRequest):
        load_recipe("lessons").parse_settings({"keep_releases": 3})


# --- a step with storage short waits, then runs ----------------------------------------------------------------


def test_a_short_disk_defers_the_step_once_and_it_runs_when_space_returns() -> None:
    """``StorageGuard`` with the free-space reading a test controls (``free``; the disk is never filled): short, the
    step waits (state ``storage``, one ``train.deferred`` event saying why, however often it looks again), its timer
    looks again after ``check_s``, and once the reading covers the need the step may start and the wait is over.
    Bugs caught: the comparison flipped, no timer (the step would wait for the next report), an event per look."""
    async def run() -> None:
        free = {"bytes": 10_000_000}
        notified = asyncio.Event()
        bus = EventBus(64)
        seen = bus.subscribe()
        model = SimpleNamespace(release_id="r" * 40, lfs={"model.safetensors": {"oid": "sha256:x", "size": 4_000_000}})

        async def head(scenario: Any) -> Any:
            return model

        async def adapter(release_id: str) -> None:
            return None

        learner = SimpleNamespace(chains=SimpleNamespace(head=head, adapter=adapter), events=bus)
        guard = StorageGuard(Path("/"), reserve_mb=1, check_s=0.01, notify=lambda name: notified.set(),
                             free=lambda path: free["bytes"])
        st = SimpleNamespace(name="s", state="idle")
        scenario = SimpleNamespace(name="s")
        try:
            outcome = await guard.short(learner, st, scenario)  # needs 2 x 4 MB + 1 MB = 9 MB of 10: it may start
            assert outcome is None and st.state == "idle" and not guard.waiting
            free["bytes"] = 8_999_999
            for _ in range(3):  # short: it waits, and its timer looks again
                notified.clear()
                outcome = await guard.short(learner, st, scenario)
                assert outcome is not None and outcome.verdict == "paused" and outcome.consumed == 0
                assert st.state == "storage" and "storage short" in (outcome.summary or "")
                await asyncio.wait_for(notified.wait(), 60)  # a hang guard: the timer fires in 10 ms
            events = [seen.get_nowait() for _ in range(seen.qsize())]
            deferred = [e for e in events if e and e["kind"] == "train.deferred"]
            assert len(deferred) == 1 and deferred[0]["need_bytes"] == 9_000_000, events
            assert deferred[0]["free_bytes"] == 8_999_999 and "storage short" in deferred[0]["summary"]
            assert guard.waiting["s"]["need_bytes"] == 9_000_000
            free["bytes"] = 9_000_000  # space returns
            assert await guard.short(learner, st, scenario) is None and not guard.waiting
        finally:
            guard.close()

    asyncio.run(run())


# --- a daemon: the policy on a live chain, and a step deferred --------------------------------------------------


def _publish_weights(home: Path, scenario: str, n: int, first: int = 1) -> list[str]:
    """Publish ``n`` train releases of slightly changed tiny-model weights on ``scenario``'s chain, as another
    process would (the daemon sees each head move): each one a model that loads and serves."""
    from safetensors.torch import load_file, save_file

    store = ReleaseStore(home / "artifacts.git")
    out = []
    head = store.head(scenario)
    assert head is not None
    src = home / f"w0-{first}"
    store.checkout(head, src)
    for i in range(first, first + n):
        dest = home / f"w{i}"
        shutil.copytree(src, dest)
        tensors = load_file(str(src / "model.safetensors"))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + 0.001 * i
        (dest / "model.safetensors").unlink()
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
        rel = store.publish(scenario, {p.relative_to(dest).as_posix(): p for p in dest.rglob("*") if p.is_file()},
                            expected_head=head, operation="train", kind="weights", recipe="online-rl")
        head = rel.release_id
        out.append(head)
    return out


def test_a_daemon_prunes_past_keep_releases_says_so_and_refuses_a_rollback_to_a_pruned_release(
        daemon_factory: Any) -> None:
    """``keep_releases = 2`` on a live chain: once three releases are published on top of the init, the first's weights
    are pruned (the retention pass runs after each release; the init, the base, is kept), it stays listed and says so (``reef
    releases list``, ``show``, ``GET``), ``reef status`` shows the weights kept; a request pinned to a pruned
    release and a rollback to it are refused (409, exit 5) naming the release to roll back to; a rollback to a kept
    one serves, and its content (now the head's) keeps its weights after the next pass. A bound of 0 is refused at
    create and update. Bugs caught: no pass after a release, an off-by-one in N, a head pruned."""
    d: Daemon = daemon_factory(settings_toml())
    with d.http() as c:
        for bad in (0, -2, True):
            r = c.post("/reef/scenarios", json={"name": "keepbad", "recipe": "online-rl",
                                                "settings": {"keep_releases": bad}})
            assert assert_canonical_error(r, 400)["param"] == "settings.keep_releases"
        assert c.post("/reef/scenarios", json={"name": "keep", "recipe": "online-rl",
                                               "settings": {"keep_releases": 2}}).status_code == 201
        r = c.post("/reef/scenarios/keep/settings", json={"settings": {"keep_releases": 0}})
        assert "keep_releases" in assert_canonical_error(r, 400)["message"]
        ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/s/keep/v1/chat/completions", json=ask).status_code == 200  # the init release
        init = releases(c, "keep")["releases"][0]["release_id"]
        ids = [init, *_publish_weights(d.home, "keep", 1)]
        served = c.post("/s/keep/v1/chat/completions", json=ask)  # the head's checkout, which pruning removes
        assert served.headers["x-reef-release-id"] == ids[1]
        checkout = d.home / "cache" / "releases" / releases(c, "keep")["releases"][0]["content_id"]
        assert checkout.is_dir()
        ids += _publish_weights(d.home, "keep", 2, first=2)

        def pruned() -> dict[str, Any] | None:
            chain = releases(c, "keep")
            marks = {r["release_id"]: bool(r["weights_pruned"]) for r in chain["releases"]}
            return chain if len(marks) == 4 and marks[ids[1]] else None

        chain = wait_for(pruned, what="the weights past keep_releases pruned")
        # newest first: the newest two kept, the first pruned, the init (the base) kept
        assert [bool(r["weights_pruned"]) for r in chain["releases"]] == [False, False, True, False], chain
        assert chain["head"] == ids[3] and [r["release_id"] for r in chain["releases"]] == ids[::-1]
        # its hard links go with it, just after the store's pass marks the weights pruned (the mark comes first)
        wait_for(lambda: not checkout.exists() and not checkout.with_suffix(".ok").exists(),
                 what="the pruned release's checkout removed")
        assert c.post("/s/keep/v1/chat/completions", json=ask).status_code == 200  # the head serves on
        shown = c.get(f"/reef/releases/{ids[1]}").json()
        assert shown["weights_pruned"] == ["model.safetensors"], shown
        assert any("pruned" in f.get("error", "") for f in shown["diff"]["files"]), shown["diff"]
        assert c.get(f"/reef/releases/{ids[1]}/page").status_code == 200  # its page still opens
        assert "weights pruned (retention)" in d.cli("releases", "list", "-s", "keep").stdout
        assert "weights pruned by the retention policy" in d.cli("releases", "show", ids[1][:12]).stdout
        assert "weights  keep:" in d.cli("status").stdout
        view = c.get("/reef/status").json()["retention"]["keep"]
        assert view["pruned"] == 1 and view["keep_releases"] == 2 and view["weights_bytes"] > 0, view
        r = c.post("/s/keep/v1/chat/completions", json=ask, headers={"x-reef-release-id": ids[1]})
        error = assert_canonical_error(r, 409, shape="openai")
        assert "pruned" in error["message"] and ids[2][:12] in error["message"], error
        r = c.post("/reef/scenarios/keep/rollback", json={"release_id": ids[1], "expected_head": ids[3]})
        error = assert_canonical_error(r, 409)
        assert error["offered"] == ids[2] and f"reef releases rollback {ids[2][:12]}" in error["message"], error
        refused = d.cli("releases", "rollback", ids[1][:12], "-s", "keep", "--yes", check=False)
        assert refused.returncode == 5 and "pruned" in refused.stderr, refused
        assert releases(c, "keep")["head"] == ids[3]  # nothing published
        back = c.post("/reef/scenarios/keep/rollback", json={"release_id": ids[2], "expected_head": ids[3]})
        assert back.status_code == 201, back.text
        assert c.post("/s/keep/v1/chat/completions", json=ask).status_code == 200
        wait_for(lambda: c.get("/reef/status").json()["retention"]["keep"]["releases"] == 5,
                 what="a pass after the rollback")
        chain = releases(c, "keep")
        assert [bool(r["weights_pruned"]) for r in chain["releases"]] == [False, False, False, True, False], chain
    fsck = ReleaseStore(d.home / "artifacts.git").fsck()
    assert fsck["ok"], fsck["errors"]


def test_a_step_with_storage_short_is_deferred_then_runs_when_space_returns(daemon_factory: Any) -> None:
    """Shortness simulated with ``storage_reserve_mb``, a reserve no disk has (the disk is never filled): the batch's
    step waits instead of training or failing, ``reef status`` and ``GET /reef/status`` say why, a
    ``train.deferred`` event and a log line say so once, nothing is written down on the chain and the receipts stay
    unconsumed. With the reserve back at 0 (space returned; a restart reads it), the same batch trains and publishes.
    Bugs caught: no storage check before a step, the comparison flipped, a deferral written down as failed."""
    d: Daemon = daemon_factory(settings_toml(), start=False)
    config = d.home / "config.toml"
    original = config.read_text()
    config.write_text("storage_reserve_mb = 1e12\nstorage_check_s = 0.5\n" + original)
    d.start()
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "short", "recipe": "online-rl"}).status_code == 201
        receipts = serve_and_report(c, "short", 4)
        status = wait_for(lambda: (s := c.get("/reef/status").json())["storage"].get("short")
                          and s["learning"].get("short") == "storage" and s, what="the step deferred")
        assert "storage short" in status["storage"]["short"]["summary"]
        events = []
        with c.stream("GET", "/reef/events", params={"after": 0}, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event.get("scenario") == "short":
                        events.append(event["kind"])
                        if event["kind"] == "train.deferred":
                            break
        assert "train.start" not in events, events
        chain = releases(c, "short", True)
        assert [r["operation"] for r in chain["releases"]] == ["init"] and chain["rejected"] == [], chain
    assert "storage  short: storage short" in d.cli("status").stdout
    assert "storage short" in (d.home / "logs" / "daemon.log").read_text()
    d.stop()
    config.write_text("storage_reserve_mb = 0\n" + original)
    d.start()
    with d.http() as c:
        chain = wait_for(lambda: (r := releases(c, "short"))["releases"][0]["operation"] == "train" and r,
                         what="the deferred batch trained once space returned")
        assert sorted(chain["releases"][0]["receipts"]) == sorted(receipts)
        assert "short" not in c.get("/reef/status").json()["storage"]
