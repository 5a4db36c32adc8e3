"""Durability beyond kill -9: a power cut at any moment keeps everything a client was told (TESTING.md item 1).

A real daemon serves a bounded workload (chat requests, streamed and not, from three clients at once; reports;
a publish from another process; a rollback) under the power-loss double (``tests/powerloss.py``), which logs
every file operation under its state dir. Each acknowledgement is noted with the log position at which the
client saw it. Afterwards the durable state is rebuilt at several cut points, in three flavours of crash, and
each image must hold: every receipt and report acknowledged before the cut, exactly once; a record store that
passes ``PRAGMA integrity_check``; release chains whose heads and every commit behind them are readable, with
their LFS objects intact, holding every release acknowledged before the cut and every release a durable record
names. The final images must pass ``git fsck`` and serve again: a daemon started on one answers for every
receipt and serves the acknowledged head.

The double earns its place by failing: with SQLite's ``synchronous=OFF`` (on every connection, or only on the
checkpointer's), with the file fsync skipped in ``daemon/durable.py``, or with libgit2's fsync left off, the
same checks find the losses (the mutations run in the daemon through a ``sitecustomize`` in its
``PYTHONPATH``; the daemon's own code is unchanged).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, make_home, sse_events
from tests.powerloss import FLAVOURS, Op, Snapshot, Trace, build_shim, log_position, quiesced, traced_env, wait_until

SCENARIO = "power"
REF = f"refs/reef/scenarios/{SCENARIO}"

# the mutations, each a sitecustomize the daemon (and its children) import at start-up
MUTATIONS = {
    "synchronous-off": """
        import daemon.records.sqlite
        daemon.records.sqlite.SYNCHRONOUS = "OFF"
    """,
    "no-file-fsync": """
        import daemon.durable
        daemon.durable.sync_fd = lambda fd: None
    """,
    "checkpoint-unsynced": """
        import daemon.records.sqlite
        _open = daemon.records.sqlite.SQLiteStore._open
        def _open_unsynced(self, *, write):
            conn = _open(self, write=write)
            if not write:
                conn.execute("PRAGMA synchronous=OFF")
            return conn
        daemon.records.sqlite.SQLiteStore._open = _open_unsynced
    """,
    "no-libgit2-fsync": """
        import pygit2
        type(pygit2.settings).enable_fsync_gitdir = lambda self, value=True: None
    """,
}
APPLIED = "\nopen(__file__ + '.applied', 'w').close()\n"  # a sitecustomize that fails is only a warning


@dataclass
class Ack:
    pos: int  # the log position when the client saw the acknowledgement
    kind: str  # "record" (a receipt or a report id) or "release"
    id: str


@dataclass
class Run:
    home: Path
    port: int
    env: dict[str, str]
    trace: Trace
    acks: list[Ack]


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("powerloss"))


@pytest.fixture(scope="module")
def new_weights(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.test_release_serving import make_weights

    return make_weights(tiny_model, tmp_path_factory.mktemp("weights") / "w", 3)


@pytest.fixture
def homes() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for p in made:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _receipt(resp: httpx.Response, stream: bool) -> str | None:
    if resp.status_code != 200:
        raise AssertionError(f"{resp.status_code}: {resp.text[:300]}")
    if not stream:
        return resp.headers["x-reef-agent-record-id"]
    events = sse_events(resp.text)
    assert events and events[-1][1] == "[DONE]", resp.text[-300:]
    reef = next(e["reef"] for _, e in events if isinstance(e, dict) and "reef" in e)
    return reef.get("agent_record_id") or reef["record_id"]


def _chat(c: httpx.Client, log: Path, acks: list[Ack], lock: threading.Lock, rng: random.Random) -> str:
    stream = rng.random() < 0.5
    body = {"model": "tiny", "max_tokens": rng.randint(1, 4), "stream": stream,
            "messages": [{"role": "user", "content": f"power {rng.random()}"}]}
    resp = c.post(f"/s/{SCENARIO}/v1/chat/completions", json=body)
    receipt = _receipt(resp, stream)
    assert receipt
    with lock:
        acks.append(Ack(log_position(log), "record", receipt))
    return resp.headers["x-reef-release-id"]


def _checkpointed(ops: list[Op]) -> bool:
    """The database file was written (a checkpoint) after the last commit wrote or synced the WAL."""
    wal = [i for i, op in enumerate(ops) if op[1] in "WS" and op[7].endswith("/records.sqlite3-wal")]
    return bool(wal) and any(op[1] == "W" and op[7].endswith("/records.sqlite3") for op in ops[wal[-1] + 1 :])


def _workload(d: Daemon, log: Path, weights: Path, acks: list[Ack], requests: int, publishes: bool) -> None:
    lock = threading.Lock()
    rng = random.Random(12)
    with d.unix() as c:
        init = _chat(c, log, acks, lock, rng)  # first use publishes the init release

        def client(seed: int) -> None:
            r = random.Random(seed)
            with d.unix() as cc:
                for _ in range(requests // 3):
                    _chat(cc, log, acks, lock, r)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # let the checkpointer copy the WAL into the database file: the next commit then reuses the WAL from
        # its start, and the records it held live only in the database file (synced, or lost)
        wait_until(log, _checkpointed, "a checkpoint after the last commit")
        for a in [a for a in acks if a.kind == "record"][:4]:
            resp = c.post("/reef/report", json={"score": 1, "references": [a.id], "feedback": "ok"})
            assert resp.status_code == 201, resp.text
            acks.append(Ack(log_position(log), "record", resp.json()["report_id"]))
        if not publishes:
            return
        # a publish from another process (traced too), as a trainer or `reef` CLI would make
        code = textwrap.dedent(f"""
            from daemon.releases import ReleaseStore, files_from_dir
            store = ReleaseStore({str(d.home / 'artifacts.git')!r})
            rel = store.publish({SCENARIO!r}, files_from_dir({str(weights)!r}), expected_head=store.head({SCENARIO!r}),
                                operation="train", kind="weights", recipe="record", metrics={{"reward": 0.5}})
            print(rel.release_id)
        """)
        out = subprocess.run([sys.executable, "-c", code], env=d.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        trained = out.stdout.strip()
        acks.append(Ack(log_position(log), "release", trained))
        for _ in range(200):  # the daemon notices the moved head (its watcher) and serves the new release
            if _chat(c, log, acks, lock, rng) == trained:
                break
        else:
            raise AssertionError("the daemon never served the published release")
        resp = c.post(f"/reef/scenarios/{SCENARIO}/rollback", json={"release_id": init, "expected_head": trained})
        assert resp.status_code == 201, resp.text
        acks.append(Ack(log_position(log), "release", resp.json()["release_id"]))
        for _ in range(3):
            _chat(c, log, acks, lock, rng)


def traced_run(tiny_model: Path, shim: Path, weights: Path, homes: list[Path], mutation: str | None = None,
               requests: int = 24, publishes: bool = True) -> Run:
    """Run the workload on a fresh daemon under the recorder; ``kill -9`` it at the end (the power cut).

    Without ``publishes`` only the init release is published (the first request makes it)."""
    home, port, env = make_home(tiny_model)
    homes.append(home)
    log = Path(str(home) + ".powerloss")
    homes.append(log)
    (home / "logs" / "daemon.log").touch()  # the fixture's stdout: it must exist in the snapshot
    if mutation is not None:
        site = home.with_name(home.name + ".site")
        homes.append(site)
        site.mkdir()
        (site / "sitecustomize.py").write_text(textwrap.dedent(MUTATIONS[mutation]) + APPLIED)
        env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    snapshot = Snapshot(home)
    d = Daemon(home=home, port=port, env=traced_env(env, shim, home, log))
    acks: list[Ack] = []
    try:
        d.start()
        _workload(d, log, weights, acks, requests, publishes)
    finally:
        with quiesced(log):
            if d.proc is not None and d.proc.poll() is None:
                d.kill9()
    if mutation is not None:
        assert (site / "sitecustomize.py.applied").exists(), d.log_tail()
    trace = Trace(snapshot, log)
    trace.check_complete()
    return Run(home, port, env, trace, acks)


# --- what an image must hold ---------------------------------------------------------------------------------


def _chain(repo: Any, image: Path, problems: list[str]) -> set[str]:
    """The release ids on the scenario's chain, checking every commit, tree, manifest and LFS object on it."""
    import pygit2

    ref = repo.references.get(REF)
    if ref is None:
        return set()
    seen: set[str] = set()
    oid: Any = ref.target
    while oid is not None:
        try:
            commit = repo[oid]
            manifest = json.loads(commit.tree["reef-artifact.json"].data)
        except (KeyError, ValueError, pygit2.GitError) as e:
            problems.append(f"release {oid} on {REF} is unreadable: {e!r}")
            return seen
        seen.add(str(commit.id))
        for path, lfs in (manifest.get("lfs") or {}).items():
            sha = str(lfs["oid"]).split(":", 1)[-1]
            obj = image / "artifacts.git" / "lfs" / "objects" / sha[:2] / sha[2:4] / sha
            if not obj.is_file() or hashlib.sha256(obj.read_bytes()).hexdigest() != sha:
                problems.append(f"release {commit.id}: LFS object of {path} is "
                                f"{'missing' if not obj.is_file() else 'corrupt'}")
        oid = commit.parent_ids[0] if commit.parent_ids else None
    return seen


def check_image(image: Path, acks: list[Ack]) -> list[str]:
    """What is wrong with a power-cut image, given what clients were told before the cut (empty: nothing)."""
    import sqlite3

    import pygit2

    problems: list[str] = []
    want_records = [a.id for a in acks if a.kind == "record"]
    counts: dict[str, int] = {}
    named: set[str] = set()
    db_path = image / "records.sqlite3"
    if db_path.exists():
        db = sqlite3.connect(db_path)
        try:
            ok = db.execute("PRAGMA integrity_check").fetchone()[0]
            if ok != "ok":
                problems.append(f"records.sqlite3 integrity_check: {ok}")
            counts = dict(db.execute("SELECT id, COUNT(*) FROM records GROUP BY id").fetchall())
            named = {r for (r,) in db.execute("SELECT DISTINCT release_id FROM records WHERE release_id IS NOT NULL")}
        except sqlite3.OperationalError as e:
            if "no such table" not in str(e):  # a database whose schema was never committed holds nothing yet
                problems.append(f"records.sqlite3: {e}")
        except sqlite3.DatabaseError as e:
            problems.append(f"records.sqlite3: {e}")
        finally:
            db.close()
    lost = [r for r in want_records if r not in counts]
    if lost:
        problems.append(f"{len(lost)} of {len(want_records)} acknowledged receipts lost, e.g. {lost[:3]}")
    if any(n != 1 for n in counts.values()):
        problems.append("a record is stored twice")
    want_releases = {a.id for a in acks if a.kind == "release"}
    chain: set[str] = set()
    if want_releases or named or (image / "artifacts.git").exists():
        try:
            chain = _chain(pygit2.Repository(str(image / "artifacts.git")), image, problems)
        except pygit2.GitError as e:
            problems.append(f"artifacts.git does not open: {e}")
    if (image / "artifacts.git").exists():
        fsck = subprocess.run(["git", "--git-dir", str(image / "artifacts.git"), "fsck", "--full", "--strict",
                               "--no-progress"], capture_output=True, text=True, timeout=60)
        if fsck.returncode != 0:
            problems.append(f"git fsck: {(fsck.stderr or fsck.stdout).strip()[-300:]}")
    if want_releases - chain:
        problems.append(f"acknowledged releases missing from {REF}: {sorted(want_releases - chain)}")
    if named - chain:
        problems.append(f"records name releases missing from {REF}: {sorted(named - chain)}")
    return problems


def cuts(run: Run, n: int, seed: int = 5) -> list[tuple[int, str]]:
    """(log position, flavour): ``n`` random record boundaries in turn through the flavours, then the end in each."""
    ends = [r[0] for r in run.trace.records]
    rng = random.Random(seed)
    picked = sorted(rng.sample(ends, min(n, len(ends))))
    end = log_position(run.trace.log)
    return [(p, FLAVOURS[i % len(FLAVOURS)]) for i, p in enumerate(picked)] + [(end, f) for f in FLAVOURS]


def check_cuts(run: Run, where: Path, n: int) -> tuple[list[str], list[tuple[int, str, Any]]]:
    """Rebuild and check the images of ``cuts``; the problems found, and each cut's statistics."""
    problems: list[str] = []
    stats = []
    for i, (pos, flavour) in enumerate(cuts(run, n)):
        image = where / f"cut{i}-{flavour}"
        st = run.trace.image(pos, image, flavour, seed=i)
        stats.append((pos, flavour, st))
        found = check_image(image, [a for a in run.acks if a.pos <= pos])
        problems += [f"cut at {pos} ({flavour}): {p}" for p in found]
        if not found:  # a few MB each: keep only the images that show a problem
            shutil.rmtree(image)
    return problems, stats


def serve_again(run: Run, flavour: str, homes: list[Path]) -> list[str]:
    """Start a daemon on the image of the final cut: it must answer for every receipt and serve the last head."""
    image = Path(tempfile.mkdtemp(prefix="reef-cut-", dir="/tmp")) / "h"  # short: the socket path is limited
    homes.append(image.parent)
    run.trace.image(log_position(run.trace.log), image, flavour)
    d = Daemon(home=image, port=run.port, env={**run.env, "REEF_HOME": str(image)})
    problems: list[str] = []
    try:
        d.start()
        with d.unix() as c:
            for a in run.acks:
                if a.kind == "record" and c.get(f"/reef/records/{a.id}").status_code != 200:
                    problems.append(f"{flavour}: after restart, receipt {a.id} is not served")
            resp = c.post(f"/s/{SCENARIO}/v1/chat/completions",
                          json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "again"}]})
            head = [a.id for a in run.acks if a.kind == "release"][-1]
            if resp.status_code != 200 or resp.headers.get("x-reef-release-id") != head:
                problems.append(f"{flavour}: after restart, a request got {resp.status_code} "
                                f"{resp.headers.get('x-reef-release-id')} (want 200 from {head}): {resp.text[:200]}")
    except RuntimeError as e:  # the daemon did not start on the image
        problems.append(f"{flavour}: the daemon does not start on the image: {e}")
    finally:
        d.stop()
    return problems


# --- the tests -------------------------------------------------------------------------------------------------


def test_a_power_cut_keeps_everything_acknowledged(tiny_model: Path, shim: Path, new_weights: Path,
                                                   homes: list[Path], tmp_path: Path) -> None:
    run = traced_run(tiny_model, shim, new_weights, homes)
    assert sum(a.kind == "release" for a in run.acks) == 2 and len(run.acks) > 24
    problems, stats = check_cuts(run, tmp_path, 9)
    for pos, flavour, st in stats:
        print(f"cut at {pos} ({flavour}): dropped {st.dropped_writes} writes and {st.dropped_names} name ops,"
              f" kept {st.kept_writes} synced writes")
    print("operations logged:", run.trace.counts)
    for flavour in ("fsync", "journal"):
        problems += serve_again(run, flavour, homes)
    assert not problems, "\n".join(problems)
    # not vacuous: the cuts dropped writes that were not synced yet (the final one too: log lines, the pid file)
    assert stats[-1][2].dropped_writes > 0 and sum(st.dropped_writes + st.dropped_names for _, _, st in stats) > 20


@pytest.mark.parametrize(("mutation", "finds"), [
    pytest.param("synchronous-off", r"acknowledged receipts lost", id="synchronous-off"),
    pytest.param("checkpoint-unsynced", r"acknowledged receipts lost|malformed", id="checkpoint-unsynced"),
    pytest.param("no-file-fsync", r"LFS object of model.safetensors is corrupt", id="no-file-fsync"),
    pytest.param("no-libgit2-fsync", r"missing from refs/reef|unreadable|git fsck", id="no-libgit2-fsync"),
])
def test_the_double_catches_a_missing_fsync(tiny_model: Path, shim: Path, new_weights: Path, homes: list[Path],
                                            tmp_path: Path, mutation: str, finds: str) -> None:
    """Negative controls: each mutation, put into a daemon, loses something a client was told."""
    run = traced_run(tiny_model, shim, new_weights, homes, mutation=mutation, requests=6, publishes=False)
    problems, _ = check_cuts(run, tmp_path, 3)
    assert any(re.search(finds, p) for p in problems), "\n".join(problems) or "no problem found"
    print(f"{mutation}: {len(problems)} problems, e.g.", *problems[:3], sep="\n  ")
