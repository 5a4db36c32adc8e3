"""The release store against real git repositories: the git binary reads what pygit2 wrote, real processes
contend for one chain, and publishers are killed with SIGKILL mid-write (TESTING.md items 1 and 4)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from daemon.errors import BadRequest, HeadMoved, InvalidName, LockBusy, NotFound
from daemon.releases import MANIFEST, SCENARIOS_REF, ReleaseStore, files_from_dir, lfs_pointer
from daemon.releases import reads as release_reads

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "release_worker.py"
HARNESS = {"AGENTS.md": "Be brief.\n", "skills/tests/SKILL.md": "Run the tests first.\n"}


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check, timeout=60)


def assert_git_fsck(repo: Path) -> None:
    res = git(repo, "fsck", "--full", "--strict", check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "error" not in res.stderr.lower(), res.stderr


def assert_no_locks(repo: Path) -> None:
    locks = [p for d in ("refs", "logs") for p in (repo / d).rglob("*.lock")]
    assert not locks, locks


def assert_linear(store: ReleaseStore, scenario: str) -> list:
    chain = store.history(scenario)
    assert chain and chain[-1].operation == "init" and chain[-1].step == 0 and chain[-1].parent is None
    for newer, older in zip(chain, chain[1:], strict=False):
        assert newer.parent == older.release_id and newer.step == older.step + 1
        commit_parents = git(store.path, "rev-list", "--parents", "-n", "1", newer.release_id).stdout.split()[1:]
        assert commit_parents == [older.release_id]
    report = store.fsck()
    assert report["ok"], report["errors"]
    return chain


def worker_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def store(tmp_path: Path) -> ReleaseStore:
    return ReleaseStore(tmp_path / "artifacts.git")


def init(store: ReleaseStore, scenario: str = "demo", files: dict | None = None) -> str:
    rel = store.publish(
        scenario, files or HARNESS, expected_head=None, operation="init", kind="harness", recipe="lessons"
    )
    return rel.release_id


def train(store: ReleaseStore, scenario: str, head: str, files: dict, **kw) -> str:
    rel = store.publish(scenario, files, expected_head=head, operation="train", kind="harness", recipe="lessons", **kw)
    return rel.release_id


def test_publish_history_manifest_and_git_log(store: ReleaseStore) -> None:
    r0 = init(store)
    changed = {**HARNESS, "AGENTS.md": "Be brief. Cite files.\n"}
    r1 = store.publish(
        "demo",
        changed,
        expected_head=r0,
        operation="train",
        kind="harness",
        recipe="lessons",
        metrics={"score": 0.75},
        receipts=["rec_a", "rec_b"],
        settings={"max_lessons": 3},
        summary="one lesson from two reports",
    )
    r2 = train(store, "demo", r1.release_id, dict(HARNESS))  # the same content as the init

    assert store.head("demo") == r2 and store.scenarios() == ["demo"]
    a, b, c = store.get(r0), store.get(r1.release_id), store.get(r2)
    assert a.content_id == c.content_id != b.content_id and len({a.release_id, b.release_id, c.release_id}) == 3
    assert [r.step for r in store.history("demo")] == [2, 1, 0]
    assert store.belongs("demo", r0) and store.belongs("demo", r0[:10]) and not store.belongs("demo", "f" * 40)

    manifest = json.loads(store.read_file(r1.release_id, MANIFEST))
    assert manifest["kind"] == "harness" and manifest["recipe"] == "lessons" and manifest["step"] == 1
    assert manifest["operation"] == "train" and manifest["parent"] == r0 and manifest["source"] is None
    assert manifest["metrics"] == {"score": 0.75} and manifest["receipts"] == ["rec_a", "rec_b"]
    assert manifest["settings"] == {"max_lessons": 3} and manifest["content_id"] == b.content_id
    assert isinstance(manifest["created_at"], float)
    assert store.read_file(r1.release_id, "AGENTS.md") == b"Be brief. Cite files.\n"

    # content_id is the git tree of the artifact without the manifest: git itself agrees.
    assert git(store.path, "ls-tree", "--name-only", "-r", b.content_id).stdout.split() == sorted(changed)
    assert git(store.path, "rev-parse", f"{r1.release_id}^{{tree}}").stdout.strip() != b.content_id

    log = git(
        store.path,
        "log",
        "--format=%H|%s|%(trailers:key=Reef-Step,valueonly,separator=)|%(trailers:key=Reef-Operation,valueonly,separator=)|%an <%ae>",
        SCENARIOS_REF + "demo",
    ).stdout.splitlines()
    assert [line.split("|")[0] for line in log] == [r2, r1.release_id, r0]
    assert [line.split("|")[2:4] for line in log] == [["2", "train"], ["1", "train"], ["0", "init"]]
    assert "one lesson from two reports" in log[1] and log[0].endswith("reef <reef@localhost>")
    assert len(git(store.path, "reflog", "show", SCENARIOS_REF + "demo").stdout.splitlines()) == 3
    assert git(store.path, "config", "core.logAllRefUpdates").stdout.strip() == "always"
    assert_git_fsck(store.path)
    assert store.fsck()["ok"]

    # A second store object over the same repo (another process would do the same) sees everything.
    assert ReleaseStore(store.path).history("demo")[0].release_id == r2


def test_lfs_pointer_dedup_checkout_and_git_show(tmp_path: Path) -> None:
    store = ReleaseStore(tmp_path / "artifacts.git")  # default threshold: 1 MiB
    weights = os.urandom((1 << 20) + 12345)
    src = tmp_path / "model"
    src.mkdir()
    (src / "model.safetensors").write_bytes(weights)
    (src / "config.json").write_text('{"n_layer": 2}\n')
    r0 = store.publish(
        "w", files_from_dir(src), expected_head=None, operation="init", kind="weights", recipe="online_rl"
    )
    r1 = store.publish(
        "w",
        {"model.safetensors": weights, "config.json": '{"n_layer": 2, "note": 1}\n'},
        expected_head=r0.release_id,
        operation="train",
        kind="weights",
        recipe="online_rl",
    )
    import hashlib

    sha = hashlib.sha256(weights).hexdigest()
    objects = [p for p in (store.path / "lfs" / "objects").rglob("*") if p.is_file()]
    assert objects == [store.path / "lfs" / "objects" / sha[:2] / sha[2:4] / sha]  # stored once
    assert r0.lfs == r1.lfs == {"model.safetensors": {"oid": f"sha256:{sha}", "size": len(weights)}}
    assert not list((store.path / "lfs" / "tmp").iterdir())

    shown = git(store.path, "show", f"{r1.release_id}:model.safetensors").stdout
    assert shown.encode() == lfs_pointer(sha, len(weights))
    assert shown.startswith("version https://git-lfs.github.com/spec/v1\noid sha256:")
    assert git(store.path, "show", f"{r1.release_id}:config.json").stdout == '{"n_layer": 2, "note": 1}\n'
    assert store.read_file(r1.release_id, "model.safetensors") == weights
    assert {f.path: (f.size, f.lfs_oid) for f in store.files(r1.release_id)}["model.safetensors"] == (len(weights), sha)

    copy = store.checkout(r1.release_id, tmp_path / "co" / "r1")
    linked = store.checkout(r0.release_id, tmp_path / "co" / "r0", link=True)
    assert sorted(p.name for p in copy.iterdir()) == ["config.json", "model.safetensors"]
    assert (copy / "model.safetensors").read_bytes() == weights == (linked / "model.safetensors").read_bytes()
    assert (linked / "model.safetensors").stat().st_ino == objects[0].stat().st_ino
    assert (copy / "model.safetensors").stat().st_ino != objects[0].stat().st_ino
    assert not (copy / MANIFEST).exists()
    with pytest.raises(BadRequest):
        store.checkout(r1.release_id, copy)
    assert store.fsck()["ok"] and store.fsck()["lfs_objects"] == 1
    assert_git_fsck(store.path)


def test_compare_and_swap(store: ReleaseStore) -> None:
    r0 = init(store)
    r1 = train(store, "demo", r0, {"AGENTS.md": "v1\n"})
    reflog = git(store.path, "reflog", "show", SCENARIOS_REF + "demo").stdout
    with pytest.raises(HeadMoved) as err:
        train(store, "demo", r0, {"AGENTS.md": "stale\n"})
    assert err.value.expected == r0 and err.value.actual == r1 and err.value.status == 409
    assert r0 in err.value.message and r1 in err.value.message
    with pytest.raises(HeadMoved) as err:
        init(store)
    assert err.value.expected is None and err.value.actual == r1
    assert store.head("demo") == r1 and len(store.history("demo")) == 2
    assert git(store.path, "reflog", "show", SCENARIOS_REF + "demo").stdout == reflog
    with pytest.raises(BadRequest):
        train(store, "demo", r1[:8], {"AGENTS.md": "short ids are not heads\n"})
    with pytest.raises(BadRequest):  # a chain starts with an init and only with one
        store.publish("fresh", HARNESS, expected_head=None, operation="train", kind="harness", recipe="lessons")
    assert store.head("fresh") is None


def test_git_binary_locks_and_updates_interoperate(tmp_path: Path) -> None:
    store = ReleaseStore(tmp_path / "artifacts.git", lock_timeout=0.3)
    ref = SCENARIOS_REF + "demo"
    r0 = init(store)
    cand = store.hold("demo", {"AGENTS.md": "from git\n"}, kind="harness", recipe="lessons")
    # git's own ref transaction holds <ref>.lock between "prepare" and "commit".
    proc = subprocess.Popen(
        ["git", "-C", str(store.path), "update-ref", "--stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"start\nupdate {ref} {cand.release_id} {r0}\nprepare\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "start: ok"
    assert proc.stdout.readline().strip() == "prepare: ok"
    with pytest.raises(LockBusy) as err:
        train(store, "demo", r0, {"AGENTS.md": "reef\n"})
    assert err.value.lock_path.endswith("refs/reef/scenarios/demo.lock")
    assert store.recover()["kept"]  # a young lock of a live git process is left alone
    proc.stdin.write("commit\n")
    proc.stdin.flush()
    proc.communicate(timeout=10)
    assert proc.returncode == 0
    with pytest.raises(HeadMoved) as moved:
        train(store, "demo", r0, {"AGENTS.md": "reef\n"})
    assert moved.value.actual == cand.release_id
    r2 = train(store, "demo", cand.release_id, {"AGENTS.md": "reef after git\n"})
    assert [r.release_id for r in store.history("demo")] == [r2, cand.release_id, r0]
    assert_git_fsck(store.path)


def test_contention_between_processes(tmp_path: Path) -> None:
    repo = tmp_path / "artifacts.git"
    store = ReleaseStore(repo)
    base = init(store)
    n, rounds = 8, 4
    start_at = time.time() + 3.0
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "contend",
                str(repo),
                "demo",
                str(i),
                str(start_at),
                str(rounds),
                "0.35",
                "0" if i % 2 else "1.0",
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_env(),
        )
        for i in range(n)
    ]
    outcomes = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outcomes += [json.loads(line) for line in out.splitlines()]
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert len(outcomes) == n * rounds
    assert {o["outcome"] for o in outcomes} <= {"win", "head_moved", "lock_busy"}
    wins = [o for o in outcomes if o["outcome"] == "win"]
    chain = assert_linear(store, "demo")
    assert len(chain) == len(wins) + 1 and chain[-1].release_id == base
    assert {w["release_id"] for w in wins} == {r.release_id for r in chain[:-1]}
    for w in wins:
        assert store.get(w["release_id"]).parent == w["read"]
    assert len({w["read"] for w in wins}) == len(wins)  # no two wins share a parent
    assert len({o["outcome"] for o in outcomes}) >= 2, outcomes  # there was contention
    assert_no_locks(repo)
    assert_git_fsck(repo)


def test_kill9_during_publish_loop(tmp_path: Path) -> None:
    repo = tmp_path / "artifacts.git"
    init(ReleaseStore(repo))
    rng = random.Random(1234)
    stale_seen = 0
    for i in range(15):
        ready = tmp_path / f"ready{i}"
        p = subprocess.Popen(
            [sys.executable, str(WORKER), "loop", str(repo), "demo", str(ready)],
            env=worker_env(),
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                assert p.poll() is None, p.communicate()[1]
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.15))
        finally:
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=10)
        stale_seen += len([q for d in ("refs", "logs") for q in (repo / d).rglob("*.lock")])

        if i % 2 == 0:  # recovery at start-up...
            store = ReleaseStore(repo, lfs_threshold=4096)
            report = store.recover(stale_after=0)
            assert not report["busy"] and not report["kept"]
        else:  # ...or a publisher that finds an old lock clears it itself
            store = ReleaseStore(repo, lfs_threshold=4096, stale_lock_after=0.2, lock_timeout=10)
        assert_linear(store, "demo")
        head = store.head("demo")
        after = train(store, "demo", head, {"AGENTS.md": f"after kill {i}\n", "weights.bin": os.urandom(8192)})
        assert store.head("demo") == after and store.get(after).parent == head
        assert_no_locks(repo)
        if i % 5 == 4:
            assert_git_fsck(repo)
    chain = assert_linear(store, "demo")
    assert len(chain) > 15 + 15
    print(f"kill -9 loop: {len(chain)} releases, {stale_seen} stale locks met")


def test_stale_lock_cleared_but_live_lock_kept(tmp_path: Path) -> None:
    repo = tmp_path / "artifacts.git"
    store = ReleaseStore(repo, lock_timeout=0.2, stale_lock_after=30)
    r0 = init(store)
    lock = repo / "refs/reef/scenarios/demo.lock"
    lock.write_text("left by a killed process\n")
    with pytest.raises(LockBusy):
        train(store, "demo", r0, {"AGENTS.md": "x\n"})
    assert store.recover()["kept"] == [str(lock)]  # too young for the default
    old = time.time() - 60
    os.utime(lock, (old, old))
    leftover = repo / "lfs" / "tmp" / "obj-killed"
    leftover.write_bytes(b"half an object")
    os.utime(leftover, (old - 7200, old - 7200))
    report = store.recover()
    assert report["removed"] == [str(lock)] and report["temp_removed"] == [str(leftover)]
    r1 = train(store, "demo", r0, {"AGENTS.md": "x\n"})

    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [sys.executable, str(WORKER), "hold-lock", str(repo), "demo", str(ready)], env=worker_env()
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        os.utime(lock, (old, old))  # even an old-looking lock is kept while its owner lives
        report = store.recover(stale_after=0)
        assert report["busy"] and lock.exists()
        with pytest.raises(LockBusy):
            train(store, "demo", r1, {"AGENTS.md": "y\n"})
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert store.recover(stale_after=0)["removed"] == [str(lock)]
    train(store, "demo", r1, {"AGENTS.md": "y\n"})
    assert_linear(store, "demo")


def test_rollback(store: ReleaseStore) -> None:
    r0 = init(store)
    r1 = train(store, "demo", r0, {"AGENTS.md": "v1\n"}, metrics={"score": 0.1})
    r2 = train(store, "demo", r1, {"AGENTS.md": "v2\n"})
    back = store.rollback("demo", r0[:12], expected_head=r2)
    assert back.operation == "rollback" and back.step == 3 and back.source == r0 and back.parent == r2
    assert back.content_id == store.get(r0).content_id and back.release_id != r0
    assert store.read_file(back.release_id, "AGENTS.md") == HARNESS["AGENTS.md"].encode()
    assert [r.step for r in store.history("demo")] == [3, 2, 1, 0]  # history is never rewritten
    trailers = git(store.path, "log", "-1", "--format=%(trailers)", back.release_id).stdout
    assert f"Reef-Source: {r0}" in trailers and "Reef-Operation: rollback" in trailers

    other = init(store, "other", {"AGENTS.md": "other\n"})
    with pytest.raises(BadRequest) as err:
        store.rollback("demo", other)
    assert other in err.value.message
    with pytest.raises(NotFound) as nf:
        store.rollback("demo", "abcdef1234")
    assert "abcdef1234" in nf.value.message
    with pytest.raises(HeadMoved) as moved:
        store.rollback("demo", r1, expected_head=r2)
    assert moved.value.actual == back.release_id
    again = store.rollback("demo", r1)  # no expected head: the head as read now
    assert again.metrics == {"score": 0.1} and again.content_id == store.get(r1).content_id
    assert_linear(store, "demo")
    assert_git_fsck(store.path)


def test_diff_text_and_weights(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save

    store = ReleaseStore(tmp_path / "artifacts.git", lfs_threshold=4096)
    r0 = init(store, "h", {"AGENTS.md": "line one\nline two\n", "old.txt": "bye\n"})
    r1 = train(store, "h", r0, {"AGENTS.md": "line one\nline 2\n", "new.txt": "hi\n"})
    d = store.diff(r1)
    assert d["base"] == r0 and d["added"] == ["new.txt"] and d["removed"] == ["old.txt"]
    assert d["changed"] == ["AGENTS.md"]
    text = {f["path"]: f for f in d["files"]}["AGENTS.md"]
    assert text["kind"] == "text" and "-line two\n+line 2\n" in text["diff"] and "--- a/AGENTS.md" in text["diff"]
    assert {f["path"]: f for f in d["files"]}["new.txt"]["diff"].endswith("+hi\n")

    g = torch.Generator().manual_seed(0)
    small = {"a": torch.randn(4, 4, generator=g), "b": torch.randn(8, generator=g)}
    big = {"emb": torch.randn(64, 32, generator=g), "head": torch.randn(32, 16, generator=g)}  # > 4 KiB: LFS
    w0 = store.publish(
        "w",
        {"small.safetensors": save(small), "model.safetensors": save(big), "config.json": "{}\n"},
        expected_head=None,
        operation="init",
        kind="weights",
        recipe="online_rl",
    )
    assert "model.safetensors" in w0.lfs and "small.safetensors" not in w0.lfs
    small2 = {**small, "b": small["b"] + 0.5}
    big2 = {**big, "head": big["head"] * 1.1}
    w1 = store.publish(
        "w",
        {"small.safetensors": save(small2), "model.safetensors": save(big2), "config.json": "{}\n"},
        expected_head=w0.release_id,
        operation="train",
        kind="weights",
        recipe="online_rl",
    )
    d = store.diff(w1.release_id)
    assert d["changed"] == ["model.safetensors", "small.safetensors"] and not d["added"] and not d["removed"]
    files = {f["path"]: f for f in d["files"]}
    for path, name, expected in (
        ("small.safetensors", "b", float(torch.linalg.vector_norm(torch.full((8,), 0.5)))),
        ("model.safetensors", "head", 0.1 * float(torch.linalg.vector_norm(big["head"]))),
    ):
        f = files[path]
        assert f["kind"] == "safetensors" and f["unchanged_tensors"] == 1
        (t,) = f["tensors"]
        assert t["name"] == name and t["status"] == "changed" and t["diff_norm"] > 0
        assert t["diff_norm"] == pytest.approx(expected, rel=1e-4) and t["old_norm"] > 0
    first = store.diff(w0.release_id)  # an init diffs against nothing: every tensor is added
    assert first["base"] is None and sorted(first["added"]) == ["config.json", "model.safetensors", "small.safetensors"]
    assert {t["name"] for t in {f["path"]: f for f in first["files"]}["model.safetensors"]["tensors"]} == {
        "emb",
        "head",
    }


def test_pending_promote_and_rejections(store: ReleaseStore) -> None:
    r0 = init(store)
    cand = store.hold("demo", {"AGENTS.md": "candidate\n"}, kind="harness", recipe="lessons", metrics={"win_rate": 0.6})
    assert [p.release_id for p in store.pending("demo")] == [cand.release_id]
    assert cand.parent == r0 and cand.step == 1 and not store.belongs("demo", cand.release_id)
    assert store.head("demo") == r0

    promoted = store.promote("demo", cand.release_id, expected_head=r0)
    assert promoted.operation == "promote" and promoted.source == cand.release_id and promoted.step == 1
    assert promoted.content_id == cand.content_id and promoted.metrics == {"win_rate": 0.6}
    assert store.head("demo") == promoted.release_id and store.pending("demo") == []
    assert git(store.path, "rev-parse", f"refs/reef/promoted/demo/{cand.release_id}").stdout.strip() == cand.release_id
    with pytest.raises(NotFound):
        store.promote("demo", cand.release_id)

    bad = store.hold("demo", {"AGENTS.md": "worse\n"}, kind="harness", recipe="lessons", metrics={"win_rate": 0.2})
    stale = store.hold("demo", {"AGENTS.md": "late\n"}, kind="harness", recipe="lessons")
    train(store, "demo", promoted.release_id, {"AGENTS.md": "moved on\n"})
    with pytest.raises(HeadMoved):
        store.promote("demo", stale.release_id, expected_head=promoted.release_id)
    assert {p.release_id for p in store.pending("demo")} == {bad.release_id, stale.release_id}

    rej = store.record_rejection("demo", verdict="rejected", reason="win rate 0.2 < 0.5", candidate=bad.release_id)
    assert rej.candidate == bad.release_id and rej.content_id == bad.content_id and rej.metrics == {"win_rate": 0.2}
    assert rej.step == 3 and [p.release_id for p in store.pending("demo")] == [stale.release_id]
    gate = store.record_rejection(
        "demo", verdict="regression", reason="fails 2 held-out tasks", metrics={"pass": 3}, kind="weights"
    )
    assert [r.rejection_id for r in store.rejections("demo")] == [gate.rejection_id, rej.rejection_id]
    assert store.rejections("demo")[0].reason == "fails 2 held-out tasks" and store.rejections("other") == []
    shown = git(store.path, "show", f"{rej.rejection_id}:candidate/AGENTS.md").stdout
    assert shown == "worse\n"
    assert store.fsck()["ok"]
    assert_git_fsck(store.path)


def test_threads_share_a_store(store: ReleaseStore) -> None:
    init(store)
    wins: list[str] = []
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        for j in range(6):
            head = store.head("demo")
            try:
                wins.append(train(store, "demo", head, {"AGENTS.md": f"{k}/{j}\n"}))
            except (HeadMoved, LockBusy):
                pass
            except BaseException as e:  # surfaced below
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    chain = assert_linear(store, "demo")
    assert len(chain) == len(wins) + 1 and {r.release_id for r in chain[:-1]} == set(wins)


def test_bad_input_is_refused(store: ReleaseStore) -> None:
    for name in ("", "a/b", "a..b", "x.lock", "-x", "a b", "ü"):
        with pytest.raises(InvalidName):
            init(store, name)
    for path in ("/abs", "a//b", "../x", "a/./b", MANIFEST, ".git/config"):
        with pytest.raises(BadRequest):
            init(store, "demo", {path: "x"})
    with pytest.raises(BadRequest):
        init(store, "demo", {"a": "x", "a/b": "y"})
    with pytest.raises(BadRequest):
        store.publish("demo", HARNESS, expected_head=None, operation="init", kind="model", recipe="r")
    with pytest.raises(BadRequest):
        store.publish(
            "demo",
            HARNESS,
            expected_head=None,
            operation="init",
            kind="harness",
            recipe="r",
            metrics={"x": float("nan")},
        )
    assert store.scenarios() == [] and store.head("demo") is None
    with pytest.raises(NotFound):
        store.get("0" * 40)
    with pytest.raises(BadRequest):
        store.get("not-hex")
    r0 = init(store)
    with pytest.raises(NotFound):
        store.read_file(r0, "missing.md")
    with pytest.raises(NotFound):
        store.promote("demo", r0)


def test_head_checks_are_shared_briefly_and_dropped_by_own_publishes(store: ReleaseStore,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of requests shares one look at the head; this store's own publish is seen at once, another
    process's change once the short window has passed."""
    monkeypatch.setattr(release_reads, "_FRESH_S", 0.2)
    r0 = init(store)
    assert store.head("demo") == r0
    r1 = train(store, "demo", r0, {"AGENTS.md": "v1\n"})
    assert store.head("demo") == r1  # own publish: the shared look is dropped, not waited out
    git(store.path, "update-ref", SCENARIOS_REF + "demo", r0, r1)  # another process moves the head back
    time.sleep(0.25)
    assert store.head("demo") == r0
