"""Forgetting: a user takes back the exchanges they gave. Checked where the bytes live (the SQLite file and its
WAL; PostgreSQL's table files after its checkpoint), through the daemon's route and CLI, against the release chain
(releases trained on forgotten receipts are marked, the newest clean one named), and under kill -9 (all or
nothing)."""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from daemon.errors import Forgotten, ReportConflict
from daemon.forgetting import tainted
from daemon.records import ExchangeRecord, open_store
from daemon.records.sqlite import SQLiteStore
from tests.conftest import Daemon, assert_canonical_error
from tests.test_learning import releases, wait_for
from tests.test_recipes import recipe_dir, with_recipe_paths  # noqa: F401 - the fixture, used by name


def _exchange(receipt: str, text: str, run: str | None = None) -> ExchangeRecord:
    return ExchangeRecord(
        id=receipt, scenario="s", run=run, status="complete", format="openai-chat", engine="e", model="m",
        release_id="rel", request={"messages": [{"role": "user", "content": f"prompt {text} {_noise(receipt)}"}]},
        response={"choices": [{"message": {"content": f"answer {text}"}}]}, headers={"x-note": text},
        prompt_token_ids=[1, 2], token_ids=[3, 4], logprobs=[-0.5, -0.25])


def _noise(seed: str) -> str:
    """4 kB that compress poorly: the request is stored out of line (PostgreSQL's TOAST, SQLite's overflow
    pages), where freed bytes are easiest to leave behind."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(4096))


def _insecure_by_default(path: str) -> sqlite3.Connection:
    """A connection as a SQLite built without SECURE_DELETE opens it (Debian's build has it on by default): the
    store must turn it on itself."""
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA secure_delete=OFF")
    return conn


def _stored_bytes(records_at: str) -> bytes:
    """Every byte the backend keeps of the records table on disk: the SQLite file and its WAL, or PostgreSQL's
    table and TOAST files once a checkpoint has written its buffers out."""
    if not records_at.startswith("postgresql"):
        return b"".join(p.read_bytes() for p in (Path(records_at), Path(records_at + "-wal")) if p.exists())
    import psycopg

    with psycopg.connect(records_at, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
        data = Path(conn.execute("SELECT current_setting('data_directory')").fetchone()[0])
        files = [r[0] for r in conn.execute(
            "SELECT pg_relation_filepath(c.oid) FROM pg_class c WHERE c.oid = 'records'::regclass"
            " OR c.oid = (SELECT reltoastrelid FROM pg_class WHERE oid = 'records'::regclass)").fetchall()]
    return b"".join(p.read_bytes() for f in files for p in sorted(data.glob(f + "*")))


async def test_forgotten_bodies_leave_the_files_and_a_tombstone_keeps_reports_honest(records_at: str) -> None:
    """The bodies and feedback of forgotten exchanges are gone from the store's files (freed space zeroed, the WAL
    emptied; PostgreSQL's table rewritten with scrub), the other exchanges' stay; the tombstone keeps lineage and a
    hash, a retried report is still idempotent or a conflict, a new report is refused, and training never sees
    them. Catches: a skipped secure_delete or checkpoint (the old bytes stay in the file), a report kept whole, a
    forgotten receipt taking new reports."""
    store = open_store(records_at) if records_at.startswith("postgresql") else SQLiteStore(
        Path(records_at), connect=_insecure_by_default)
    gone, kept = f"FORGET-{uuid.uuid4().hex}", f"KEEP-{uuid.uuid4().hex}"
    try:
        await store.append_exchange(_exchange("rec_a", gone))
        await store.append_exchange(_exchange("rec_b", gone, run="run_1"))
        await store.append_exchange(_exchange("rec_keep", kept))
        await store.append_report(scenario=None, score=1.0, feedback=f"feedback {gone}", references=["rec_a"],
                                  metadata={"note": gone}, report_id="r1")
        await store.append_report(scenario=None, score=0.0, feedback=f"feedback {kept}", references=["rec_keep"],
                                  metadata=None, report_id=None)
        before = _stored_bytes(records_at)
        assert gone.encode() in before and kept.encode() in before  # the check can see them
        out = await store.forget(receipts=["rec_a"], runs=["run_1"], scrub=True)
        assert sorted(out["forgotten"]) == ["rec_a", "rec_b"] and out["reports"] == 1 and out["scenarios"] == ["s"]
        assert out["remains"]
        after = _stored_bytes(records_at)
        assert gone.encode() not in after, "a forgotten body is still in the store's files"
        assert kept.encode() in after
        rec = await store.get_record("rec_b")
        assert rec["request"] is None and rec["response"] is None and rec["token_ids"] is None
        assert rec["run"] == "run_1" and rec["release_id"] == "rel" and rec["forgotten_at"] > 0
        assert len(rec["content_hash"]) == 64
        report = (await store.get_record("rec_a"))["reports"][0]["report"]
        assert report == {"score": 1.0, "references": ["rec_a"], "forgotten": True}
        # the retried report is the same report; a different body under its id still conflicts
        again = await store.append_report(scenario=None, score=1.0, feedback=f"feedback {gone}",
                                          references=["rec_a"], metadata={"note": gone}, report_id="r1")
        assert again["report"]["forgotten"] is True
        with pytest.raises(ReportConflict):
            await store.append_report(scenario=None, score=0.0, feedback="x", references=["rec_a"], metadata=None,
                                      report_id="r1")
        with pytest.raises(Forgotten):
            await store.append_report(scenario=None, score=0.0, feedback="x", references=["rec_a"], metadata=None,
                                      report_id=None)
        rows, _ = await store.scored_exchanges("s")
        assert [r.id for r in rows] == ["rec_keep"]
        assert await store.forgotten("s") == {"rec_a", "rec_b"}
        twice = await store.forget(receipts=["rec_a"], runs=[])
        assert twice["forgotten"] == [] and twice["already"] == ["rec_a"]
    finally:
        store.close()


def _rel(rid: str, operation: str, parent: str | None, content: str, receipts: tuple[str, ...] = (),
         origin: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(release_id=rid, operation=operation, parent=parent, content_id=content,
                           receipts=list(receipts), origin=origin)


def test_releases_built_on_forgotten_data_are_marked_and_a_clean_rollback_is_not() -> None:
    """Marked: the step that consumed a forgotten receipt, a train step on top of it, a rollback to its content;
    not marked: the releases before, a rollback to clean content, a step on other receipts from a clean base."""
    history = [  # newest first, as the chain gives it
        _rel("r6", "rollback", "r5", "c1"),  # back to clean content
        _rel("r5", "rollback", "r4", "c2"),  # back to the tainted content
        _rel("r4", "train", "r3", "c4", ("rec_z",)),  # from a clean base (r3 restored c1)
        _rel("r3", "rollback", "r2", "c1"),
        _rel("r2", "train", "r1", "c3", ("rec_y",)),  # on top of a tainted release
        _rel("r1", "train", "r0", "c2", ("rec_x", "rec_forgotten")),
        _rel("r0", "init", None, "c1"),
    ]
    assert tainted(history, {"rec_forgotten"}) == {"r1", "r2", "r5"}
    assert tainted(history, set()) == set()


def test_harness_releases_made_from_forgotten_feedback_or_a_forgotten_run_are_marked() -> None:
    """A harness step lists the reports it learned from (their ids, in ``receipts``); a proposal's release names the
    run and receipt it came from (``origin``); a promoted candidate builds on its parent as a train step does.
    Catches: report ids left out of what was forgotten, a proposal's origin not read, promote not inheriting."""
    history = [
        _rel("h5", "promote", "h4", "t5", ("rep_other",)),  # a held candidate promoted on top of a marked release
        _rel("h4", "train", "h3", "t4", origin={"kind": "proposal", "run": "run_gone", "receipt": "rec_last"}),
        _rel("h3", "rollback", "h2", "t0"),
        _rel("h2", "train", "h1", "t2", ("rep_forgotten",)),  # lessons: learned from a report's feedback
        _rel("h1", "train", "h0", "t1", ("rep_kept",)),
        _rel("h0", "init", None, "t0"),
    ]
    assert tainted(history, {"rep_forgotten"}) == {"h2"}
    assert tainted(history, {"rec_last"}) == {"h4", "h5"}  # the proposal's own receipt
    assert tainted(history, {"rec_first"}, runs={"run_gone"}) == {"h4", "h5"}  # another exchange of its run
    assert tainted(history, {"rec_first"}, runs={"run_other"}) == set()


def test_forget_through_the_daemon_marks_the_trained_release_and_names_the_way_back(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d: Daemon = with_recipe_paths(daemon_factory, recipe_dir)
    ask = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "fg", "recipe": "rwl:RewardWeighted",
                                               "settings": {"batch_size": 2}})
        init = made.json()["head"]
        receipts = []
        for _ in range(2):
            r = c.post("/s/fg/r/run_fg/v1/chat/completions", json=ask)
            receipts.append(r.headers["x-reef-agent-record-id"])
        for rec in receipts:
            assert c.post("/reef/report", json={"references": [rec], "score": 1.0,
                                                "feedback": "secret words"}).status_code == 201
        trained = wait_for(lambda: (x := releases(c, "fg")["releases"][0])["step"] == 1 and x, what="a release")
        assert releases(c, "fg")["forgotten"]["trained_on_forgotten"] == []
        # bad input: refused, nothing forgotten
        for bad in ({}, {"receipts": "rec_x"}, {"receipts": [""]}, {"receipts": receipts, "scrub": "yes"}):
            assert_canonical_error(c.post("/reef/records/forget", json=bad), 400)
        assert_canonical_error(c.post("/reef/records/forget", json={"receipts": ["rec_nope"]}), 404)
        assert c.get(f"/reef/records/{receipts[0]}").json()["request"] is not None
    out = d.cli("records", "forget", receipts[0], "--yes")
    assert "forgot 1 exchange" in out.stdout and "trained on forgotten data" in out.stdout, out.stdout
    assert f"reef releases rollback {init[:12]} --scenario fg" in out.stdout
    with d.http() as c:
        listed = releases(c, "fg")
        assert listed["forgotten"]["trained_on_forgotten"] == [trained["release_id"]]
        assert listed["forgotten"]["rollback_to"] == init
        assert [r["trained_on_forgotten"] for r in listed["releases"]] == [True, False]
        err = assert_canonical_error(c.post("/reef/report", json={"references": [receipts[0]], "score": 0}), 409)
        assert "forgotten" in err["message"]
        assert c.get(f"/reef/records/{receipts[0]}").json()["request"] is None
        assert c.get(f"/reef/records/{receipts[1]}").json()["request"] is not None
    table = d.cli("releases", "list", "--scenario", "fg").stdout
    assert "trained on forgotten data" in table and f"reef releases rollback {init[:12]}" in table
    d.cli("releases", "rollback", init, "--scenario", "fg", "--yes")
    with d.http() as c:
        after = releases(c, "fg")
        assert after["releases"][0]["trained_on_forgotten"] is False and after["forgotten"]["rollback_to"] is None
    assert d.cli("records", "forget", "rec_nope", "--yes", check=False).returncode == 4


def test_a_forget_killed_midway_is_all_or_nothing(daemon_factory: Any) -> None:
    """kill -9 while a forget of 2,000 exchanges runs: after the restart every one of them is forgotten, or none
    (one transaction); the store is intact either way."""
    d: Daemon = daemon_factory(start=False)
    store = open_store(str(d.home / "records.sqlite3"))
    try:
        store.write_sync(lambda c: c.executemany(
            "INSERT INTO records(id, kind, scenario, run, created_at, status, request, response)"
            " VALUES (?, 'exchange', 's', 'run_big', ?, 'complete', ?, ?)",
            [(f"rec_{i:05d}", time.time(), json.dumps({"p": "x" * 4000}), json.dumps({"a": "y" * 4000}))
             for i in range(2000)]))
    finally:
        store.close()
    d.start()
    done: list[Any] = []

    def call() -> None:
        try:
            with d.http() as c:
                done.append(c.post("/reef/records/forget", json={"runs": ["run_big"]}, timeout=120).status_code)
        except httpx.HTTPError as e:
            done.append(e)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(random.Random(3).uniform(0.05, 0.4))  # fault injection: somewhere in the forget, or around it
    d.kill9()
    t.join()
    db = sqlite3.connect(d.home / "records.sqlite3")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        n = db.execute("SELECT COUNT(*) FROM records WHERE run='run_big' AND forgotten_at IS NOT NULL").fetchone()[0]
        bodies = db.execute("SELECT COUNT(*) FROM records WHERE run='run_big' AND request IS NULL").fetchone()[0]
    finally:
        db.close()
    assert (n, bodies) in ((0, 0), (2000, 2000)), (n, bodies, done)
    if done == [200]:
        assert n == 2000  # acknowledged: durable


async def test_retention_picks_the_old_and_the_oldest_over_the_size_bound(records_at: str) -> None:
    """Due: every exchange older than the age bound, and the oldest while the kept bodies exceed the size bound;
    never one forgotten already, nor a stream still open. Catches a flipped order (the newest forgotten) or an
    off-by-one at the bound."""
    store = open_store(records_at)
    now = time.time()
    try:
        for i in range(6):  # rec_0 oldest; bodies of known size
            await store.append_exchange(replace(_exchange(f"rec_{i}", "x"), created_at=now - (6 - i) * 86400,
                                                timings={"total_ms": 1}))
        opened = replace(_exchange("rec_open", "x"), created_at=now - 60)  # a stream under way
        await store.open_exchange(opened)
        await store.forget(receipts=["rec_1"], runs=[])
        size = await store.read(lambda c: c.execute(
            "SELECT LENGTH(request) + LENGTH(response) AS n FROM records WHERE id='rec_5'").fetchone()["n"])
        assert await store.retention_due(before=now - 4.5 * 86400, max_bytes=None) == ["rec_0"]
        assert await store.retention_due(before=now, max_bytes=None) == ["rec_0", "rec_2", "rec_3", "rec_4", "rec_5"]
        # room for exactly three bodies: the three newest stay
        assert await store.retention_due(before=None, max_bytes=3 * size) == ["rec_0", "rec_2"]
        assert await store.retention_due(before=None, max_bytes=3 * size - 1) == ["rec_0", "rec_2", "rec_3"]
        assert await store.retention_due(before=None, max_bytes=None) == []
    finally:
        store.close()


def test_the_daemon_forgets_by_its_retention_settings(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(start=False)
    cfg = d.home / "config.toml"
    cfg.write_text("retention_max_mb = 0.002\nretention_check_s = 0.2\n" + cfg.read_text())
    d.start()
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "pad " * 200}]}
    with d.http() as c:
        receipts = [c.post("/v1/chat/completions", json=ask).headers["x-reef-agent-record-id"] for _ in range(4)]
        wait_for(lambda: c.get(f"/reef/records/{receipts[0]}").json()["request"] is None,
                 what="the oldest exchange forgotten by retention")
        assert c.get(f"/reef/records/{receipts[-1]}").json()["request"] is not None
    cfg.write_text("retention_days = -1\n" + cfg.read_text())
    refused = d.cli("status", check=False)
    assert refused.returncode == 2 and "retention_days must be a positive number" in refused.stderr
