"""Release chains shared through a git remote: two real daemons (two homes, two ports, as if on two machines)
share one bare repository as ``chain_remote``. A publish on one is served by the other (weights too: their LFS
objects travel through the remote's LFS store); two publishes on one head are a compare-and-swap on the remote's
ref (one wins, the other is the same 409 as a local head move); a remote that refuses a push publishes nothing
and the scenario keeps serving its head. A ``git daemon`` on 127.0.0.1 serves the ``git://`` case."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from daemon.chain_remote import ChainRemote
from daemon.config import load_config
from daemon.errors import BadRequest, HeadMoved, LockBusy, RemoteRefused
from daemon.releases import ReleaseStore, files_from_dir
from tests.conftest import Daemon, assert_canonical_error, free_port
from tests.test_release_serving import chat, make_weights

HANG_GUARD_S = 60


def bare(path: Path) -> Path:
    subprocess.run(["git", "init", "-q", "--bare", str(path)], check=True)
    return path


def remote_head(remote: Path, scenario: str) -> str | None:
    proc = subprocess.run(["git", f"--git-dir={remote}", "rev-parse", "-q", "--verify",
                           f"refs/reef/scenarios/{scenario}"], capture_output=True, text=True)
    return proc.stdout.strip() or None


def served_by(c: httpx.Client, scenario: str) -> str:
    return chat(c, scenario).headers["x-reef-release-id"]


def wait_served(c: httpx.Client, scenario: str, release_id: str) -> None:
    """Ask until an answer comes from ``release_id`` (the follower fetched it); the deadline only guards a hang."""
    deadline = time.monotonic() + HANG_GUARD_S
    while (got := served_by(c, scenario)) != release_id:
        assert time.monotonic() < deadline, f"still served by {got}, not {release_id}"
        time.sleep(0.05)


def with_top_level(d: Daemon, toml: str) -> Daemon:
    """Start ``d`` with ``toml`` as top-level settings (``extra_config`` lands after the model table)."""
    path = d.home / "config.toml"
    path.write_text(toml + path.read_text())
    return d.start()


@pytest.fixture
def pair(daemon_factory, tmp_path: Path) -> Iterator[tuple[Daemon, Daemon, Path]]:
    remote = bare(tmp_path / "chains.git")
    config = f'chain_remote = "{remote}"\nchain_fetch_s = 0.2\n'
    yield (with_top_level(daemon_factory(start=False), config), with_top_level(daemon_factory(start=False), config),
           remote)


def publisher(d: Daemon, remote: Path) -> ReleaseStore:
    """What a trainer on machine A does: publish into A's store, which pushes to the remote."""
    path = d.home / "artifacts.git"
    return ReleaseStore(path, remote=ChainRemote(path, str(remote)))


def test_a_publish_on_one_daemon_is_served_by_the_other(pair, tiny_model: Path, tmp_path: Path) -> None:
    a, b, remote = pair
    with a.http() as ca, b.http() as cb:
        init = served_by(ca, "shared")
        assert remote_head(remote, "shared") == init
        assert served_by(cb, "shared") == init  # B's own init lost the CAS on the remote: it serves A's
        store = publisher(a, remote)
        new = store.publish("shared", files_from_dir(make_weights(tiny_model, tmp_path / "w1", seed=1)),
                            expected_head=init, operation="train", kind="weights", recipe="record").release_id
        wait_served(cb, "shared", new)
        # the new weights' bytes reached B through the remote's LFS store, not through a shared disk
        sha = store.get(new).lfs["model.safetensors"]["oid"].split(":")[1]
        assert (remote / "lfs" / "objects" / sha[:2] / sha[2:4] / sha).exists()
        assert ReleaseStore(b.home / "artifacts.git").lfs_path(sha).exists()
        # a publish by the daemon itself (a rollback through A's API) is served by B too
        rolled = ca.post("/reef/scenarios/shared/rollback", json={"release_id": init, "expected_head": new})
        assert rolled.status_code == 201, rolled.text
        wait_served(cb, "shared", rolled.json()["release_id"])
        history = cb.get("/reef/scenarios/shared/releases").json()["releases"]
        assert [r["release_id"] for r in history] == [rolled.json()["release_id"], new, init]
        status = cb.get("/reef/status").json()
        assert status["chain_remote"]["url"] == str(remote) and status["chain_remote"]["error"] is None
    for d in (a, b):
        assert ReleaseStore(d.home / "artifacts.git").fsck()["ok"]


def test_two_publishes_on_one_head_one_wins_the_other_is_409(pair) -> None:
    a, b, remote = pair
    with a.http() as ca, b.http() as cb:
        init = served_by(ca, "race")
        assert served_by(cb, "race") == init
        first = ca.post("/reef/scenarios/race/rollback", json={"release_id": init, "expected_head": init})
        assert first.status_code == 201, first.text
        head = first.json()["release_id"]
        wait_served(cb, "race", head)
        results: dict[str, httpx.Response] = {}

        def rollback(name: str, c: httpx.Client) -> None:
            results[name] = c.post("/reef/scenarios/race/rollback", json={"release_id": init, "expected_head": head})

        threads = [threading.Thread(target=rollback, args=(n, c)) for n, c in (("a", ca), ("b", cb))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_GUARD_S)
        statuses = sorted(r.status_code for r in results.values())
        assert statuses == [201, 409], {n: r.text for n, r in results.items()}
        won = next(r for r in results.values() if r.status_code == 201).json()
        lost = next(r for r in results.values() if r.status_code == 409)
        err = assert_canonical_error(lost, 409)
        assert err["expected_head"] == head and err["actual_head"] == won["release_id"]
        assert won["parent"] == head and remote_head(remote, "race") == won["release_id"]
        # the same 409 as a head that moved on this daemon alone
        local = ca.post("/reef/scenarios/race/rollback", json={"release_id": init, "expected_head": init})
        assert assert_canonical_error(local, 409)["type"] == err["type"]


def test_the_remote_refusing_a_push_publishes_nothing_and_serving_goes_on(pair, tmp_path: Path) -> None:
    a, _b, remote = pair
    with a.http() as ca:
        init = served_by(ca, "refused")
        moved = tmp_path / "moved.git"
        remote.rename(moved)  # the remote is gone (a wrong path, an unmounted share)
        resp = ca.post("/reef/scenarios/refused/rollback", json={"release_id": init, "expected_head": init})
        err = assert_canonical_error(resp, 502)
        assert err["type"] == "remote_error" and f"{remote} does not exist" in err["message"]  # its LFS store first
        assert remote_head(moved, "refused") == init
        assert ca.get("/reef/scenarios/refused/releases").json()["releases"][0]["release_id"] == init
        assert served_by(ca, "refused") == init
        moved.rename(remote)  # back: publishing works again
        resp = ca.post("/reef/scenarios/refused/rollback", json={"release_id": init, "expected_head": init})
        assert resp.status_code == 201, resp.text
        assert remote_head(remote, "refused") == resp.json()["release_id"]


def test_a_path_remote_never_runs_its_hooks_as_the_daemons_user(tmp_path: Path) -> None:
    """Whoever can write a shared path remote's ``hooks/`` would otherwise run code as every daemon pushing to it
    (git runs ``receive-pack`` in the remote repository, as the pushing user): a push runs none of them."""
    remote = bare(tmp_path / "r.git")
    ran = tmp_path / "hook-ran"
    for hook in ("pre-receive", "update", "post-receive", "post-update", "reference-transaction"):
        (remote / "hooks" / hook).write_text(f"#!/bin/sh\necho {hook} >> {ran}\nexit 1\n")
        (remote / "hooks" / hook).chmod(0o755)
    a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", str(remote)))
    init = a.publish("h", {"f.txt": "0"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
    assert remote_head(remote, "h") == init.release_id  # pre-receive would have refused it
    assert not ran.exists(), ran.read_text()


def test_store_compare_and_swap_is_against_the_remote_ref(tmp_path: Path) -> None:
    """Two stores that have not fetched each other's publishes: the loser learns of it from the remote's ref."""
    remote = bare(tmp_path / "r.git")
    a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", str(remote)))
    b = ReleaseStore(tmp_path / "b.git", remote=ChainRemote(tmp_path / "b.git", str(remote)))
    init = a.publish("s", {"f.txt": "0"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
    assert b.follow() == ["refs/reef/scenarios/s"] and b.head("s") == init.release_id
    won = a.publish("s", {"f.txt": "a"}, expected_head=init.release_id, operation="train", kind="harness",
                    recipe="lessons")
    with pytest.raises(HeadMoved) as e:
        b.publish("s", {"f.txt": "b"}, expected_head=init.release_id, operation="train", kind="harness",
                  recipe="lessons")
    assert (e.value.expected, e.value.actual) == (init.release_id, won.release_id)
    assert b.head("s") == won.release_id  # the loser took in what won, so it serves it at once
    assert remote_head(remote, "s") == won.release_id


def test_a_remote_ref_lock_held_by_another_writer_is_lock_busy_not_a_moved_head(tmp_path: Path) -> None:
    """The remote's ref is where the publisher expects, but its lock is held (another push under way, or one that
    died): git says "cannot lock ref", as for a moved head. Reef reads the remote's head back to tell the two
    apart: ``LockBusy`` (retry), not a 409 naming a head that did not move; nothing is published."""
    remote = bare(tmp_path / "r.git")
    a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", str(remote)))
    init = a.publish("l", {"f.txt": "0"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
    lock = remote / "refs" / "reef" / "scenarios" / "l.lock"
    lock.write_text("")
    with pytest.raises(LockBusy):
        a.publish("l", {"f.txt": "1"}, expected_head=init.release_id, operation="train", kind="harness",
                  recipe="lessons")
    assert a.head("l") == init.release_id and remote_head(remote, "l") == init.release_id
    lock.unlink()
    won = a.publish("l", {"f.txt": "1"}, expected_head=init.release_id, operation="train", kind="harness",
                    recipe="lessons")
    assert remote_head(remote, "l") == won.release_id


def test_held_candidates_and_rejections_travel_too(tmp_path: Path) -> None:
    """A candidate held for review on one daemon is pending on the other; promoted on one, it leaves the other's
    pending list; a rejection (the record of consumed receipts) is on both."""
    remote = bare(tmp_path / "r.git")
    a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", str(remote)))
    b = ReleaseStore(tmp_path / "b.git", remote=ChainRemote(tmp_path / "b.git", str(remote)))
    init = a.publish("p", {"f.txt": "0"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
    held = a.hold("p", {"f.txt": "1"}, kind="harness", recipe="lessons")
    a.record_rejection("p", verdict="rejected", reason="worse", receipts=["rec_1"])
    b.follow()
    assert [r.release_id for r in b.pending("p")] == [held.release_id]
    assert [r.receipts for r in b.rejections("p")] == [["rec_1"]]
    b.record_rejection("p", verdict="failed", reason="boom", receipts=["rec_2"])  # appended to the shared log
    promoted = a.promote("p", held.release_id, expected_head=init.release_id)
    b.follow()
    assert b.pending("p") == [] and b.head("p") == promoted.release_id
    a.follow()
    assert [r.receipts for r in a.rejections("p")] == [["rec_2"], ["rec_1"]]


def test_chains_made_before_the_remote_are_pushed_and_a_diverged_one_follows_the_remote(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that made chains before ``chain_remote`` was set: on its first follow, a chain the remote lacks is
    pushed to it (as an init would be), and one the remote has with another history is moved to the remote's
    (the shared truth), with a warning naming both."""
    remote = bare(tmp_path / "r.git")
    a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", str(remote)))
    shared = a.publish("both", {"f.txt": "a"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
    alone = ReleaseStore(tmp_path / "b.git")  # b, before its remote was configured
    only_b = alone.publish("only-b", {"f.txt": "b"}, expected_head=None, operation="init", kind="harness",
                           recipe="lessons")
    mine = alone.publish("both", {"f.txt": "b"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
    b = ReleaseStore(tmp_path / "b.git", remote=ChainRemote(tmp_path / "b.git", str(remote)))
    with caplog.at_level("WARNING", logger="reef.releases"):
        b.follow()
    assert b.head("both") == shared.release_id and remote_head(remote, "both") == shared.release_id
    assert f"local {mine.release_id} is not an ancestor of the remote's {shared.release_id}" in caplog.text
    assert remote_head(remote, "only-b") == only_b.release_id
    a.follow()
    assert a.head("only-b") == only_b.release_id and a.read_file(only_b.release_id, "f.txt") == b"b"


def test_git_daemon_remote(tmp_path: Path) -> None:
    """A ``git://`` remote served by ``git daemon`` on 127.0.0.1; no LFS store there: a large file is refused."""
    bare(tmp_path / "srv" / "chains.git")
    port = free_port()
    proc = subprocess.Popen(["git", "daemon", "--export-all", "--enable=receive-pack", "--reuseaddr",
                             f"--base-path={tmp_path / 'srv'}", "--listen=127.0.0.1", f"--port={port}",
                             str(tmp_path / "srv")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"git://127.0.0.1:{port}/chains.git"
        a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", url))
        b = ReleaseStore(tmp_path / "b.git", remote=ChainRemote(tmp_path / "b.git", url))
        deadline = time.monotonic() + HANG_GUARD_S
        while True:  # git daemon is up once it answers
            try:
                init = a.publish("g", {"f.txt": "0"}, expected_head=None, operation="init", kind="harness",
                                 recipe="lessons")
                break
            except RemoteRefused:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        b.follow()
        assert b.read_file(init.release_id, "f.txt") == b"0"
        with pytest.raises(RemoteRefused, match="set chain_lfs"):
            a.publish("g", {"big.bin": b"x" * (2 << 20)}, expected_head=init.release_id, operation="train",
                      kind="harness", recipe="lessons")
        assert a.head("g") == init.release_id
        b.publish("g", {"f.txt": "b"}, expected_head=init.release_id, operation="train", kind="harness",
                  recipe="lessons")
        with pytest.raises(HeadMoved):
            a.publish("g", {"f.txt": "a"}, expected_head=init.release_id, operation="train", kind="harness",
                      recipe="lessons")
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(("toml", "message"), [
    ('chain_remote = "ftp://host/x.git"', "unknown scheme"),
    ('chain_remote = "git@host:org/chains.git"', "scp-style; write it as the URL ssh://git@host/~/org/chains.git"),
    ('chain_remote = "host:/srv/chains.git"', "write it as the URL ssh://host/srv/chains.git"),
    ('chain_fetch_s = 1', "needs chain_remote"),
    ('chain_lfs = "/x"', "needs chain_remote"),
    ('chain_remote = "/r.git"\nchain_lfs = "https://lfs.example"', "must be a directory"),
    ('chain_remote = "/r.git"\nchain_fetch_s = 0', "chain_fetch_s"),
    ('trainer = "slurm"', "trainer must be local or ray"),
    ('ray_address = "10.0.0.1:6379"', 'needs trainer = "ray"'),
])
def test_settings_that_would_do_nothing_are_refused(tmp_path: Path, toml: str, message: str) -> None:
    (tmp_path / "config.toml").write_text(toml + "\n")
    with pytest.raises(BadRequest, match=message):
        load_config({"REEF_HOME": str(tmp_path)})


def test_path_remote_settings(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('chain_remote = "shared/chains.git"\nchain_lfs = "shared/lfs"\n')
    cfg = load_config({"REEF_HOME": str(tmp_path)})
    assert (cfg.chain_remote, cfg.chain_lfs) == (str(tmp_path / "shared/chains.git"), tmp_path / "shared/lfs")
    assert shutil.which("git")
