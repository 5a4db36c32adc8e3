"""What a full or failing disk does to the release chains and the daemon (TESTING.md item 2), with real faults
where this machine can make them: a tmpfs of a few MiB (``unshare -rm``, then ``mount -t tmpfs``) filled by a
file written until ENOSPC, and ``/dev/full`` behind the pid file.

- No ref moves to a commit that does not read back: libgit2 hands back the id of a commit a full disk never
  took, and a head naming it made every read of the scenario fail.
- A ref update the disk fails part-way leaves no reflog line behind (libgit2 writes it before the ref), so
  ``git fsck --strict`` keeps passing, and the store's own check says what git says.
- A dangling head left by an older version is moved back to the newest commit that exists, at start-up, said
  in the log as an error; ``reef doctor`` reports it and changes nothing.
- Rollback and promote on a full disk answer 507 in the canonical shape and the CLI exits 6 with one line; the
  chain is untouched and works again once space returns.
- A daemon that cannot start for want of space says so in one line and exits 6, never with a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pygit2
import pytest

from daemon.errors import StorageError
from daemon.records import SQLiteStore
from daemon.releases import MANIFEST, SCENARIOS_REF, ReleaseStore, files_from_dir, find_damage
from tests.conftest import ROOT, assert_canonical_error, make_home
from tests.disk_full_worker import fill

WORKER = Path(__file__).resolve().parent / "disk_full_worker.py"
HARNESS = {"AGENTS.md": "Be brief.\n", "skills/tests/SKILL.md": "Run the tests first.\n"}
BODY = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}


def in_tmpfs(mount: Path, size: str, argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own with a fresh tmpfs of ``size`` on ``mount``."""
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", script, "sh", size, str(mount), *argv]


def git_fsck(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "--git-dir", str(repo), "fsck", "--full", "--strict"], capture_output=True,
                          text=True, timeout=60)


def assert_both_checks_pass(repo: Path) -> None:
    res = git_fsck(repo)
    assert res.returncode == 0 and "error" not in res.stderr.lower(), res.stdout + res.stderr
    report = ReleaseStore(repo).fsck()
    assert report["ok"], report["errors"]


def loose(repo: Path, oid: str) -> Path:
    return repo / "objects" / oid[:2] / oid[2:]


def reflog(repo: Path, scenario: str) -> list[list[str]]:
    return [line.split()[:2] for line in (repo / "logs" / SCENARIOS_REF / scenario).read_text().splitlines()]


def dangle(repo: Path, scenario: str) -> str:
    """Do to the store what the disk-full race did: point the head at a commit that was never written, with the
    reflog line libgit2 writes for it. Returns the missing id."""
    missing = secrets.token_hex(20)
    ref = repo / SCENARIOS_REF / scenario
    old = ref.read_text().strip()
    ref.write_text(missing + "\n")
    with open(repo / "logs" / SCENARIOS_REF / scenario, "a") as f:
        f.write(f"{old} {missing} reef <reef@localhost> 1800000000 +0000\treef train: {scenario} step 9\n")
    return missing


def chain(store: ReleaseStore, scenario: str = "demo", n: int = 3) -> list[str]:
    """A harness chain of ``n`` releases, oldest first."""
    ids = [store.publish(scenario, HARNESS, expected_head=None, operation="init", kind="harness",
                         recipe="lessons").release_id]
    for i in range(1, n):
        ids.append(store.publish(scenario, {**HARNESS, "AGENTS.md": f"Be brief {i}.\n"}, expected_head=ids[-1],
                                 operation="train", kind="harness", recipe="lessons").release_id)
    return ids


# --- the compare-and-swap refuses a commit that does not read back ---------------------------------------


@pytest.mark.parametrize("lost", ["commit", "tree", "manifest"])
def test_no_ref_moves_to_a_commit_that_does_not_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          lost: str) -> None:
    store = ReleaseStore(tmp_path / "artifacts.git")
    r0, r1 = chain(store, n=2)
    real = pygit2.Repository.create_commit

    def create_commit(self: pygit2.Repository, *args: Any) -> pygit2.Oid:
        """The write "succeeds" and hands back an id, but the object is not on disk (or only half of it is)."""
        oid = real(self, *args)
        commit = pygit2.Repository(str(store.path))[oid]
        victim = {"tree": str(commit.tree_id), "manifest": str(commit.tree[MANIFEST].id)}.get(lost, str(oid))
        loose(store.path, victim).unlink()
        return oid

    monkeypatch.setattr(pygit2.Repository, "create_commit", create_commit)
    with pytest.raises(StorageError) as e:
        store.rollback("demo", r0, expected_head=r1)
    assert e.value.status == 507 and e.value.exit_code == 6 and "was not moved" in e.value.message
    monkeypatch.undo()
    fresh = ReleaseStore(store.path)
    assert fresh.head("demo") == r1 and [r.release_id for r in fresh.history("demo")] == [r1, r0]
    assert reflog(store.path, "demo")[-1][1] == r1  # no line claims a move that did not happen
    assert find_damage(store.path) == []
    # the chain goes on: the next rollback, with the disk healthy, is published
    assert store.rollback("demo", r0, expected_head=r1).step == 2


TRUNCATED = """
import json, os, sys
import pygit2
from daemon.errors import StorageError
from daemon.releases import ReleaseStore
store = ReleaseStore(sys.argv[1])
r0 = store.publish("demo", {"a": "0"}, expected_head=None, operation="init", kind="harness", recipe="lessons")
r1 = store.publish("demo", {"a": "1"}, expected_head=r0.release_id, operation="train", kind="harness", recipe="lessons")
real = pygit2.Repository.create_commit
def create_commit(self, *args):
    oid = real(self, *args)
    path = store.path / "objects" / str(oid)[:2] / str(oid)[2:]
    path.chmod(0o644)
    os.truncate(path, path.stat().st_size // 2)  # half of it reached the disk
    return oid
pygit2.Repository.create_commit = create_commit
try:
    store.rollback("demo", r0.release_id, expected_head=r1.release_id)
    error = None
except StorageError as e:
    error = e.message
print(json.dumps({"error": error, "head": ReleaseStore(sys.argv[1]).head("demo"), "before": r1.release_id}))
"""


def test_a_half_written_commit_is_refused_without_hanging(tmp_path: Path) -> None:
    """Its own process: libgit2 1.9 never returns from inflating a truncated loose object (holding the GIL, so no
    in-process timeout can stop it); the store must find the truncation itself before libgit2 reads the object."""
    try:
        res = subprocess.run([sys.executable, "-c", TRUNCATED, str(tmp_path / "artifacts.git")], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail("the rollback hung: libgit2 was left to read a truncated object")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["error"] and "truncated" in out["error"] and out["head"] == out["before"], out
    assert_both_checks_pass(tmp_path / "artifacts.git")


def test_a_held_candidate_that_does_not_read_back_is_not_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    store = ReleaseStore(tmp_path / "artifacts.git")
    (r0,) = chain(store, n=1)
    real = pygit2.Repository.create_commit

    def create_commit(self: pygit2.Repository, *args: Any) -> pygit2.Oid:
        oid = real(self, *args)
        loose(store.path, str(oid)).unlink()
        return oid

    monkeypatch.setattr(pygit2.Repository, "create_commit", create_commit)
    with pytest.raises(StorageError):
        store.hold("demo", {"AGENTS.md": "held\n"}, kind="harness", recipe="lessons")
    monkeypatch.undo()
    assert store.pending("demo") == [] and store.head("demo") == r0


# --- the reflog: what git fsck checks, the store's check checks too; recovery repairs both -----------------


def test_the_store_check_agrees_with_git_fsck_on_a_reflog_naming_a_lost_commit(tmp_path: Path) -> None:
    repo = tmp_path / "artifacts.git"
    store = ReleaseStore(repo)
    r0, r1 = chain(store, n=2)
    assert_both_checks_pass(repo)
    # what a failed ref update left before this fix: the line libgit2 appends before the ref write that failed,
    # naming a commit the full disk never took; the head itself is fine
    lost = secrets.token_hex(20)
    with open(repo / "logs" / SCENARIOS_REF / "demo", "a") as f:
        f.write(f"{r1} {lost} reef <reef@localhost> 1800000000 +0000\treef rollback: demo step 2\n")
    res = git_fsck(repo)
    assert res.returncode != 0 and "invalid reflog entry" in res.stderr, res.stderr
    report = store.fsck()
    assert not report["ok"] and any("reflog of refs/reef/scenarios/demo" in e for e in report["errors"]), report
    [damage] = find_damage(repo)
    assert damage.target is None and damage.bad_reflog_entries == 1 and "git fsck" in damage.describe()

    result = ReleaseStore(repo).recover()
    assert result["reflog_trimmed"] == {SCENARIOS_REF + "demo": 1} and result["repaired"] == []
    assert_both_checks_pass(repo)
    assert reflog(repo, "demo") == [["0" * 40, r0], [r0, r1]] and store.head("demo") == r1


def test_the_store_check_agrees_with_git_fsck_on_a_corrupt_object_nothing_names(tmp_path: Path) -> None:
    repo = tmp_path / "artifacts.git"
    store = ReleaseStore(repo)
    chain(store, n=1)
    blob = str(pygit2.Repository(str(repo)).create_blob(b"half of a file nobody names\n"))
    assert_both_checks_pass(repo)  # unreferenced is fine: dangling
    path = loose(repo, blob)
    path.chmod(0o644)
    os.truncate(path, path.stat().st_size - 4)
    res = git_fsck(repo)
    assert res.returncode != 0 and blob in res.stderr, res.stderr
    report = store.fsck()
    assert not report["ok"] and any(blob in e and "truncated" in e for e in report["errors"]), report


def test_recover_leaves_a_healthy_store_as_it_is(tmp_path: Path) -> None:
    repo = tmp_path / "artifacts.git"
    store = ReleaseStore(repo)
    chain(store, n=3)
    store.hold("demo", {"AGENTS.md": "held\n"}, kind="harness", recipe="lessons")
    store.record_rejection("demo", verdict="rejected", reason="worse")

    def snapshot() -> dict[str, bytes]:
        return {str(p.relative_to(repo)): p.read_bytes() for d in ("refs", "logs") for p in (repo / d).rglob("*")
                if p.is_file()}

    before = snapshot()
    result = store.recover()
    assert result["repaired"] == [] and result["reflog_trimmed"] == {} and result["unrepaired"] == []
    assert snapshot() == before and find_damage(repo) == []


@pytest.mark.parametrize("how", ["missing commit", "missing tree, no reflog"])
def test_recover_moves_a_dangling_head_back_to_the_newest_commit_that_exists(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    repo = tmp_path / "artifacts.git"
    store = ReleaseStore(repo)
    r0, r1, r2 = chain(store, n=3)
    if how == "missing commit":
        bad = dangle(repo, "demo")
    else:  # the commit is there but its tree was lost; no reflog to read, so recovery walks the parents
        r3 = store.publish("demo", {"AGENTS.md": "lost\n"}, expected_head=r2, operation="train", kind="harness",
                           recipe="lessons").release_id
        loose(repo, str(pygit2.Repository(str(repo))[r3].tree_id)).unlink()
        shutil.rmtree(repo / "logs")
        bad = r3
    with pytest.raises(Exception):  # noqa: B017 - what the user saw: every read of the scenario failed
        ReleaseStore(repo).history("demo")
    [damage] = find_damage(repo)
    assert (damage.ref, damage.target, damage.restore) == (SCENARIOS_REF + "demo", bad, r2)
    assert not ReleaseStore(repo).fsck()["ok"] and git_fsck(repo).returncode != 0

    with caplog.at_level(logging.ERROR, logger="reef.releases"):
        result = ReleaseStore(repo).recover()
    assert [(r["ref"], r["was"], r["now"]) for r in result["repaired"]] == [(SCENARIOS_REF + "demo", bad, r2)]
    loud = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(bad in m and r2 in m and "back to" in m for m in loud), loud
    fresh = ReleaseStore(repo)
    assert fresh.head("demo") == r2 and [r.release_id for r in fresh.history("demo")] == [r2, r1, r0]
    assert_both_checks_pass(repo)
    assert find_damage(repo) == []
    assert fresh.rollback("demo", r0, expected_head=r2).step == 3  # and the chain goes on from there


def test_a_chain_whose_only_commit_was_lost_starts_again(tmp_path: Path) -> None:
    repo = tmp_path / "artifacts.git"
    store = ReleaseStore(repo)
    (r0,) = chain(store, n=1)
    loose(repo, r0).unlink()
    [damage] = find_damage(repo)
    assert damage.target == r0 and damage.restore is None and "removes it" in damage.describe()
    result = ReleaseStore(repo).recover()
    assert result["repaired"] == [{"ref": SCENARIOS_REF + "demo", "was": r0, "now": None,
                                   "problem": damage.problem}]
    fresh = ReleaseStore(repo)
    assert fresh.head("demo") is None
    assert_both_checks_pass(repo)
    assert chain(fresh, n=1)  # the next first use publishes a new init


# --- real full disks: a tmpfs filled at the moment that matters ---------------------------------------------


@pytest.mark.parametrize("mode", ["commit", "commit-then-space", "ref"])
def test_a_rollback_the_disk_fills_under_fails_whole(tmp_path: Path, mode: str) -> None:
    """``commit``: libgit2 returns an id for the commit it could not write; ``commit-then-space``: and space is
    back for the ref update (the head would name a missing commit); ``ref``: the ref update itself fails after
    libgit2 wrote its reflog line."""
    mount, out = tmp_path / "mnt", tmp_path / "out"
    mount.mkdir()
    out.mkdir()
    res = subprocess.run(in_tmpfs(mount, "1m", [sys.executable, str(WORKER), mode, str(mount), str(out)]),
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads(res.stdout.splitlines()[-1])
    assert r["error"] is not None and r["error"]["class"] == "StorageError" and r["error"]["status"] == 507, r
    assert r["after"] == r["before"], r
    repo = out / "artifacts.git"
    assert reflog(repo, "demo")[-1] == [r["init"], r["before"]]  # the reflog says what the ref did, no more
    assert_both_checks_pass(repo)
    assert find_damage(repo) == []


class TmpfsDaemon:
    """``python -m daemon`` with its state dir on a tmpfs of its own; the test reaches its files through
    ``/proc/<pid>/root`` (the tmpfs lives in the daemon's mount namespace) and the daemon over TCP."""

    def __init__(self, tiny_model: Path, tmp_path: Path, size: str = "24m") -> None:
        self.seed, self.port, self.env = make_home(tiny_model)
        self.token = "reef-" + secrets.token_urlsafe(16)
        token = self.seed / "token"
        token.write_text(self.token + "\n")
        token.chmod(0o600)
        self.home = Path(tempfile.mkdtemp(prefix="reef-t-", dir="/tmp"))
        self.env["REEF_HOME"] = str(self.home)
        self.size = size
        self.stderr_path = tmp_path / "daemon.stderr"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self, *daemon_args: str, fill_first: bool = False) -> list[str]:
        script = 'cp -a "$1"/. "$2"/ && ' + ('{ cat /dev/zero > "$2/fill"; } 2>/dev/null; ' if fill_first else "") \
            + 'exec "$3" -m daemon ' + " ".join(daemon_args)
        return in_tmpfs(self.home, self.size, ["sh", "-c", script, "sh", str(self.seed), str(self.home),
                                               sys.executable])

    @property
    def root(self) -> Path:
        assert self.proc is not None
        return Path(f"/proc/{self.proc.pid}/root") / self.home.relative_to("/")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TmpfsDaemon:
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.command(), env=self.env, stdout=err, stderr=err, cwd="/")
        deadline = time.monotonic() + 120  # a hang guard, not a speed claim
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("the daemon did not come up:\n" + self.stderr())

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=60)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.seed, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture
def tmpfs_daemon(tiny_model: Path, tmp_path: Path) -> Any:
    made: list[TmpfsDaemon] = []

    def make(size: str = "24m") -> TmpfsDaemon:
        made.append(TmpfsDaemon(tiny_model, tmp_path, size))
        return made[-1]

    yield make
    for d in made:
        d.cleanup()


def test_rollback_and_promote_on_a_full_disk_are_507_and_the_cli_exits_6(tmpfs_daemon: Any, tiny_model: Path,
                                                                        tmp_path: Path) -> None:
    d = tmpfs_daemon()
    # the chain and a held candidate, made before the daemon copies its state dir onto its tmpfs (libgit2 cannot
    # open a repository through /proc/<pid>/root: it resolves the link to this namespace's /)
    seed = ReleaseStore(d.seed / "artifacts.git")
    head = seed.publish("full", files_from_dir(tiny_model), expected_head=None, operation="init", kind="weights",
                        recipe="record").release_id
    held = seed.hold("full", files_from_dir(tiny_model), kind="weights", recipe="record")
    d.start()
    with d.http() as c:
        assert c.post("/s/full/v1/chat/completions", json=BODY).headers["x-reef-release-id"] == head
        fill(d.root / "fill")

        for op, release in (("rollback", head), ("promote", held.release_id)):
            resp = c.post(f"/reef/scenarios/full/{op}", json={"release_id": release, "expected_head": head})
            err = assert_canonical_error(resp, 507)
            assert err["type"] == "storage_error" and "No space left" in err["message"], err
        cli = subprocess.run([sys.executable, "-m", "reef_cli.main", "releases", "rollback", head, "-s", "full",
                              "--yes"], env={**d.env, "REEF_URL": d.url, "REEF_TOKEN": d.token},
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 6, cli.stdout + cli.stderr
        lines = cli.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("reef: ") and "No space left" in lines[0], cli.stderr
        assert c.get("/reef/scenarios/full/releases").json()["head"] == head  # nothing changed

        (d.root / "fill").unlink()  # space is back: so is full service
        resp = c.post("/reef/scenarios/full/rollback", json={"release_id": head, "expected_head": head})
        assert resp.status_code == 201, resp.text
        resp = c.post("/reef/scenarios/full/promote", json={"release_id": held.release_id,
                                                            "expected_head": resp.json()["release_id"]})
        assert resp.status_code == 201 and resp.json()["step"] == 2, resp.text
        assert c.post("/s/full/v1/chat/completions", json=BODY).status_code == 200
    shutil.copytree(d.root / "artifacts.git", tmp_path / "copy.git", symlinks=True)  # the kernel follows the link
    assert_both_checks_pass(tmp_path / "copy.git")
    assert d.stop() == 0
    assert "Traceback" not in d.stderr(), d.stderr()


# --- a daemon that cannot start for want of space: one line, exit 6 ----------------------------------------


@pytest.mark.parametrize("args", [(), ("--log-file",)])
def test_a_start_on_a_full_disk_is_one_line_and_exit_6(tmpfs_daemon: Any, args: tuple[str, ...]) -> None:
    d = tmpfs_daemon("2m")
    res = subprocess.run(d.command(*args, fill_first=True), env=d.env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 6, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reef: ") and "full" in lines[0], res.stderr
    assert "Traceback" not in res.stdout + res.stderr


def test_a_pid_file_that_cannot_be_written_is_one_line_and_exit_6(tiny_model: Path) -> None:
    home, _, env = make_home(tiny_model)
    try:
        (home / ".reef.pid.tmp").symlink_to("/dev/full")  # every write to it: ENOSPC
        res = subprocess.run([sys.executable, "-m", "daemon"], env=env, capture_output=True, text=True, timeout=180)
        assert res.returncode == 6, res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "pid file" in lines[0] and "No space left" in lines[0], res.stderr
        assert not (home / "reef.pid").exists() and not (home / "reef.sock").exists()  # nothing left behind
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_last_checkpoint_failing_at_shutdown_stays_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    full = threading.Event()

    class FullDisk(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
            if full.is_set() and "wal_checkpoint" in sql:
                raise sqlite3.OperationalError("database or disk is full")
            return super().execute(sql, *args)

    store = SQLiteStore(tmp_path / "records.sqlite3", connect=lambda p: sqlite3.connect(
        p, check_same_thread=False, isolation_level=None, factory=FullDisk))
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    full.set()
    store.close()
    assert raised == []


# --- reef doctor reports, start-up recovery repairs ---------------------------------------------------------


def test_doctor_reports_a_dangling_head_and_start_up_recovery_repairs_it(daemon_factory: Any,
                                                                         tiny_model: Path) -> None:
    d = daemon_factory()
    with d.http() as c:
        assert c.post("/s/dangle/v1/chat/completions", json=BODY).status_code == 200
        head = c.get("/reef/scenarios/dangle/releases").json()["head"]
    repo = d.home / "artifacts.git"
    store = ReleaseStore(repo)
    files = {**files_from_dir(tiny_model), "note.txt": b"a second release\n"}  # not the head's content again
    good = store.publish("dangle", files, expected_head=head, operation="train",
                         kind="weights", recipe=store.get(head).recipe).release_id
    d.stop()
    missing = dangle(repo, "dangle")

    def doctor() -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        out = subprocess.run([sys.executable, "-m", "reef_cli.main", "doctor", "--json"], env=d.env,
                             capture_output=True, text=True, timeout=120)
        return out, {c["name"]: c for c in json.loads(out.stdout)["checks"]}

    out, checks = doctor()
    check = checks["releases"]
    assert check["status"] == "fail" and out.returncode == 1, check
    assert missing in check["detail"] and good in check["detail"] and "reef daemon start" in check["fix"], check
    assert (repo / SCENARIOS_REF / "dangle").read_text().strip() == missing  # doctor changed nothing

    d.start()
    with d.http() as c:
        chain = c.get("/reef/scenarios/dangle/releases").json()
        assert chain["head"] == good and [r["release_id"] for r in chain["releases"]] == [good, head]
        assert c.post("/s/dangle/v1/chat/completions", json=BODY).headers["x-reef-release-id"] == good
    log = d.log_tail(400)
    assert any("ERROR" in line and missing in line and good in line for line in log.splitlines()), log
    _, checks = doctor()
    assert checks["releases"]["status"] == "ok", checks["releases"]
    assert_both_checks_pass(repo)


def test_a_log_line_the_disk_refuses_prints_no_traceback(tiny_model: Path) -> None:
    home, _, env = make_home(tiny_model)
    try:
        (home / "logs" / "daemon.log").symlink_to("/dev/full")  # every write to the log: ENOSPC
        code = ("import logging\nfrom daemon.config import load_config\nfrom daemon.server import setup_logging\n"
                "setup_logging(load_config(), to_file=True)\nlogging.getLogger('reef').warning('a line')\n")
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stderr == "", res.stderr  # not "--- Logging error ---" and a traceback
    finally:
        shutil.rmtree(home, ignore_errors=True)


# --- a damaged object on the read paths: a clear error, never a read that does not return (issue 22) ----------

READS = """
import json, os, sys
import pygit2
from daemon.errors import StorageError
from daemon.releases import ReleaseStore
path, which = sys.argv[1], sys.argv[2]
store = ReleaseStore(path)
r0 = store.publish("demo", {"d/AGENTS.md": "0\\n"}, expected_head=None, operation="init", kind="harness",
                   recipe="lessons").release_id
r1 = store.publish("demo", {"d/AGENTS.md": "1\\n" * 1000}, expected_head=r0, operation="train", kind="harness",
                   recipe="lessons").release_id
repo = pygit2.Repository(path)
commit = repo[r1]
victim = {"blob": commit.tree["d"]["AGENTS.md"].id, "tree": commit.tree["d"].id, "commit": commit.id}[which]
loose = os.path.join(path, "objects", str(victim)[:2], str(victim)[2:])
os.chmod(loose, 0o644)
os.truncate(loose, os.path.getsize(loose) // 2)
out = {"victim": str(victim)}
reads = {
    "checkout": lambda s: s.checkout(r1, os.path.join(path + "-co", "x")),
    "read_file": lambda s: s.read_file(r1, "d/AGENTS.md"),
    "files": lambda s: s.files(r1),
    "diff": lambda s: s.diff(r1),
    "history": lambda s: s.history("demo"),
}
for name, read in reads.items():
    try:
        read(ReleaseStore(path))  # a fresh store: nothing from a cache
        out[name] = None
    except StorageError as e:
        out[name] = e.message
    print(name, file=sys.stderr, flush=True)  # how far it got, should it hang
print(json.dumps(out))
"""


@pytest.mark.parametrize("which", ["blob", "tree", "commit"])
def test_a_truncated_object_is_a_clear_error_on_every_read_path(tmp_path: Path, which: str) -> None:
    """Its own process, as above: checkout, read_file, files, diff and history of a release whose blob, subtree or
    commit is a truncated loose object each end in a ``StorageError`` naming the object (libgit2 1.9 would loop for
    good inside the read, holding the GIL)."""
    try:
        res = subprocess.run([sys.executable, "-c", READS, str(tmp_path / "artifacts.git"), which],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"a read hung on a truncated {which}; it got past: {e.stderr!r}")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    victim = out.pop("victim")
    expect_ok = {"history"} if which != "commit" else set()  # history reads commits and manifests only
    for name, error in out.items():
        if name in expect_ok:
            assert error is None, (name, error)
        else:
            assert error is not None and victim in error and "truncated" in error, (name, error)


def test_a_truncated_object_leaves_the_daemon_answering(tmp_path: Path, tiny_model: Path) -> None:
    """The probe's freeze: a read of a release with a truncated loose object, through the daemon. The request is a
    507 naming the object; ``/healthz`` answers within a second all the while, and after."""
    home, port, env = make_home(tiny_model)
    from tests.conftest import Daemon

    d = Daemon(home=home, port=port, env=env).start()
    failed = True
    try:
        store = ReleaseStore(home / "artifacts.git")
        r0 = store.publish("frozen", {"AGENTS.md": "0\n"}, expected_head=None, operation="init", kind="harness",
                           recipe="lessons").release_id
        r1 = store.publish("frozen", {"AGENTS.md": "1\n" * 1000}, expected_head=r0, operation="train",
                           kind="harness", recipe="lessons").release_id
        blob = str(pygit2.Repository(str(store.path))[r1].tree["AGENTS.md"].id)
        path = store.path / "objects" / blob[:2] / blob[2:]
        path.chmod(0o644)
        os.truncate(path, path.stat().st_size // 2)
        answers: list[httpx.Response] = []

        def read() -> None:
            with d.http() as c:
                answers.append(c.get(f"/reef/releases/{r1}"))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        with httpx.Client(base_url=d.url, timeout=1.0) as c:
            while reader.is_alive():
                assert c.get("/healthz").status_code == 200  # a ReadTimeout here: the daemon froze
                time.sleep(0.05)
            reader.join()
            err = assert_canonical_error(answers[0], 507)
            assert err["type"] == "storage_error" and blob in err["message"] and "truncated" in err["message"], err
            assert c.get("/healthz").status_code == 200
            with d.http() as ok:  # what is whole still reads
                assert ok.get(f"/reef/releases/{r0}?diff=0").status_code == 200
        failed = False
    finally:
        if failed and d.proc is not None and d.proc.poll() is None:
            d.kill9()  # a frozen daemon answers no SIGTERM
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
