"""Forgetting: a user takes back the exchanges they gave. Checked where the bytes live (the SQLite file and its
WAL; PostgreSQL's table files after its checkpoint), through the daemon's route and CLI, against the release chain
(releases trained on forgotten receipts are marked, the newest clean one named), and under kill -9 (all or
nothing)."""

from __future__ import annotations

import json
import os
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
from daemon.forgetting import forgotten_sources, tainted
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
        await store.exchanges.append(_exchange("rec_a", gone))
        await store.exchanges.append(_exchange("rec_b", gone, run="run_1"))
        await store.exchanges.append(_exchange("rec_keep", kept))
        on_gone = await store.reports.append(scenario=None, score=1.0, feedback=f"feedback {gone}",
                                            references=["rec_a"], metadata={"note": gone}, report_id="r1")
        await store.reports.append(scenario=None, score=0.0, feedback=f"feedback {kept}", references=["rec_keep"],
                                  metadata=None, report_id=None)
        before = _stored_bytes(records_at)
        assert gone.encode() in before and kept.encode() in before  # the check can see them
        out = await store.user_data.forget(receipts=["rec_a"], runs=["run_1"], scrub=True)
        assert sorted(out["forgotten"]) == ["rec_a", "rec_b"] and out["reports"] == 1 and out["scenarios"] == ["s"]
        assert out["remains"]
        after = _stored_bytes(records_at)
        assert gone.encode() not in after, "a forgotten body is still in the store's files"
        assert kept.encode() in after
        rec = await store.exchanges.get("rec_b")
        assert rec["request"] is None and rec["response"] is None and rec["token_ids"] is None
        assert rec["run"] == "run_1" and rec["release_id"] == "rel" and rec["forgotten_at"] > 0
        assert len(rec["content_hash"]) == 64
        report = (await store.exchanges.get("rec_a"))["reports"][0]["report"]
        assert report == {"score": 1.0, "references": ["rec_a"], "forgotten": True}
        # the retried report is the same report; a different body under its id still conflicts
        again = await store.reports.append(scenario=None, score=1.0, feedback=f"feedback {gone}",
                                          references=["rec_a"], metadata={"note": gone}, report_id="r1")
        assert again["report"]["forgotten"] is True
        with pytest.raises(ReportConflict):
            await store.reports.append(scenario=None, score=0.0, feedback="x", references=["rec_a"], metadata=None,
                                      report_id="r1")
        with pytest.raises(Forgotten):
            await store.reports.append(scenario=None, score=0.0, feedback="x", references=["rec_a"], metadata=None,
                                      report_id=None)
        rows, _ = await store.reports.scored_exchanges("s")
        assert [r.id for r in rows] == ["rec_keep"]
        assert await store.user_data.forgotten("s") == {"rec_a", "rec_b"}
        # what releases may have been made from: the exchanges, the report on one, the run of the other
        assert await forgotten_sources(store, "s") == ({"rec_a", "rec_b", on_gone["id"]}, {"run_1"})
        assert out["runs"] == ["run_1"]
        twice = await store.user_data.forget(receipts=["rec_a"], runs=[])
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
        made = c.post("/reef/scenarios", json={"name": "fg", "recipe": "rwl:RewardWeighted",  # no canary: this
                                               "settings": {"batch_size": 2, "canary_share": 0}})  # is about forgetting
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
            await store.exchanges.append(replace(_exchange(f"rec_{i}", "x"), created_at=now - (6 - i) * 86400,
                                                timings={"total_ms": 1}))
        opened = replace(_exchange("rec_open", "x"), created_at=now - 60)  # a stream under way
        await store.exchanges.open(opened)
        await store.user_data.forget(receipts=["rec_1"], runs=[])
        size = await store.read(lambda c: c.execute(
            "SELECT LENGTH(request) + LENGTH(response) AS n FROM records WHERE id='rec_5'").fetchone()["n"])
        assert await store.user_data.retention_due(before=now - 4.5 * 86400, max_bytes=None) == ["rec_0"]
        assert await store.user_data.retention_due(before=now, max_bytes=None) == [
            "rec_0", "rec_2", "rec_3", "rec_4", "rec_5"]
        # room for exactly three bodies: the three newest stay
        assert await store.user_data.retention_due(before=None, max_bytes=3 * size) == ["rec_0", "rec_2"]
        assert await store.user_data.retention_due(before=None, max_bytes=3 * size - 1) == ["rec_0", "rec_2", "rec_3"]
        assert await store.user_data.retention_due(before=None, max_bytes=None) == []
    finally:
        store.close()


def test_the_daemon_forgets_by_its_retention_settings(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(start=False)
    cfg = d.home / "config.toml"
    cfg.write_text("retention_max_mb = 0.002\nretention_check_s = 0.2\n" + cfg.read_text())
    d.start()
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "pad " * 200}]}
    # each exchange a run of its own with its run file and its agent's transcript, as a wrapper leaves them: the
    # size bound forgets the oldest exchange, and with it its run's copies (the run started seconds ago: no age
    # bound would reach it)
    runs = [f"run_size{i}" for i in range(4)]
    for run in runs:
        _write(d.home / "homes" / "pi" / "pi" / ".pi" / "agent" / "sessions" / f"{run}.jsonl", f"prompt of {run}")
        _write(d.home / "runs" / f"{run}.json", json.dumps({
            "run": run, "adapter": "pi", "scenario": "pi", "started_at": time.time(),
            "agent_files": [f".pi/agent/sessions/{run}.jsonl"]}))
    with d.http() as c:
        receipts = [c.post("/v1/chat/completions", json=ask, headers={"x-reef-run": run}
                           ).headers["x-reef-agent-record-id"] for run in runs]
        wait_for(lambda: c.get(f"/reef/records/{receipts[0]}").json()["request"] is None,
                 what="the oldest exchange forgotten by retention")
        assert c.get(f"/reef/records/{receipts[-1]}").json()["request"] is not None
    wait_for(lambda: not (d.home / "runs" / f"{runs[0]}.json").exists(), what="the forgotten run's file removed")
    assert not (d.home / "homes" / "pi" / "pi" / ".pi" / "agent" / "sessions" / f"{runs[0]}.jsonl").exists()
    assert (d.home / "runs" / f"{runs[-1]}.json").exists()
    assert (d.home / "homes" / "pi" / "pi" / ".pi" / "agent" / "sessions" / f"{runs[-1]}.jsonl").exists()
    cfg.write_text("retention_days = -1\n" + cfg.read_text())
    refused = d.cli("status", check=False)
    assert refused.returncode == 2 and "retention_days must be a positive number" in refused.stderr


# --- what a forget reaches besides the record store --------------------------------------------------------------


def test_a_lessons_release_learned_from_forgotten_feedback_is_marked(daemon_factory: Any) -> None:
    """A harness step learns from reports (its manifest lists their ids), not from receipts: forgetting the exchange
    a report was on takes the report's feedback with it, and the release that quotes it in AGENTS.md is marked, with
    the way back named. Catches: only exchange receipts compared with what releases consumed."""
    d: Daemon = daemon_factory()
    secret = f"always say {uuid.uuid4().hex}"
    with d.http() as c:
        init = c.post("/reef/scenarios", json={"name": "ls", "recipe": "lessons"}).json()["head"]
        ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        rec = c.post("/s/ls/v1/chat/completions", json=ask).headers["x-reef-agent-record-id"]
        other = c.post("/s/ls/v1/chat/completions", json=ask).headers["x-reef-agent-record-id"]
        learned = c.post("/reef/report", json={"references": [rec], "feedback": secret}).json()["learning"]
        assert learned["verdict"] == "accepted", learned
        assert secret in c.get("/reef/scenarios/ls/harness", params={"adapter": "pi"}).text
        assert releases(c, "ls")["releases"][0]["trained_on_forgotten"] is False
        c.post("/reef/records/forget", json={"receipts": [other]}).raise_for_status()  # not what it learned from
        assert releases(c, "ls")["forgotten"]["trained_on_forgotten"] == []
    page = Path(d.cli("releases", "open", learned["release_id"], "--no-browser").stdout.strip())
    assert secret.encode() in page.read_bytes()  # the page quotes the feedback and the diff
    with d.http() as c:
        out = c.post("/reef/records/forget", json={"receipts": [rec]}).json()
        listed = releases(c, "ls")
    assert not page.exists() and out["copies"]["pages"] == 1
    assert out["releases"]["ls"]["rollback_to"] == init
    assert [r["trained_on_forgotten"] for r in listed["releases"]] == [True, False]
    assert listed["forgotten"]["trained_on_forgotten"] == [learned["release_id"]]
    assert listed["forgotten"]["command"] == f"reef releases rollback {init[:12]} --scenario ls"


PAIRS = '''
from recipes.base import Candidate, Recipe


class Pairs(Recipe):
    """A harness recipe that steps inline, two feedback reports at a time: one report waits in the learner's pool."""

    name = "pairs"
    kind = "harness"
    source = "feedback"
    inline = True

    def batch(self, records):
        return records[:2] if len(records) >= 2 else None

    async def edit(self, tree, batch, ctx):
        text = tree.get("AGENTS.md", b"# Rules\\n").decode() + "".join(f"- {r.feedback}\\n" for r in batch)
        return Candidate(tree={**tree, "AGENTS.md": text.encode()})

    def forget(self, ids, ctx):  # what the daemon tells a recipe that keeps memory of its own
        with open(ctx.config.home / "forgotten-ids", "a") as f:
            f.write(" ".join(sorted(ids)) + "\\n")
'''


def test_an_exchange_forgotten_before_its_step_is_not_learned_from(daemon_factory: Any, tmp_path: Path) -> None:
    """A report waits in the learner's memory for its batch (the step after it reads it into the pool, in the
    report's own request here); its exchange is forgotten meanwhile; the batch that comes is made of the others
    only. Catches: the pool kept across a forget (the forgotten feedback published in the next release), the
    learner not told."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "pairs.py").write_text(PAIRS)
    d: Daemon = with_recipe_paths(daemon_factory, recipes)
    secret = f"secret {uuid.uuid4().hex}"
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "pr", "recipe": "pairs:Pairs"}).status_code == 201
        recs = [c.post("/s/pr/v1/chat/completions", json=ask).headers["x-reef-agent-record-id"] for _ in range(3)]
        waited = c.post("/reef/report", json={"references": [recs[0]], "feedback": secret}).json()
        assert waited.get("learning") is None or waited["learning"].get("release_id") is None, waited
        c.post("/reef/records/forget", json={"receipts": [recs[0]]}).raise_for_status()
        b = c.post("/reef/report", json={"references": [recs[1]], "feedback": "keep b"}).json()
        assert b.get("learning") is None or b["learning"].get("release_id") is None, b  # one report: no batch
        c_ = c.post("/reef/report", json={"references": [recs[2]], "feedback": "keep c"}).json()
        head = releases(c, "pr")
        rules = c.get("/reef/scenarios/pr/harness", params={"adapter": "pi"}).text
    assert c_["learning"]["verdict"] == "accepted", c_
    assert sorted(head["releases"][0]["receipts"]) == sorted([b["report_id"], c_["report_id"]])
    assert "keep b" in rules and "keep c" in rules and secret not in rules
    assert head["forgotten"]["trained_on_forgotten"] == []
    # the recipe was told which exchange and which report were forgotten (its own memory is its to clear)
    assert (d.home / "forgotten-ids").read_text().split() == sorted([recs[0], waited["report_id"]])


def test_harness_search_drops_a_forgotten_reports_bad_run_from_its_memory(tmp_path: Path) -> None:
    """Harness-search keeps bad runs (the feedback and the run's exchange) for its proposer, in memory and in
    ``scenarios/<s>/harness-search.json``: a forgotten report's goes from both, the others stay; a memory file
    written before a restart is read first. Catches the file left as it was."""
    from recipes.harness_search import HarnessSearch

    settings = HarnessSearch.parse_settings({"tasks": [{"id": "x", "prompt": "p", "check": "true"}]})
    ctx: Any = SimpleNamespace(config=SimpleNamespace(home=tmp_path), scenario="s")
    secret = uuid.uuid4().hex
    before = HarnessSearch(settings)
    before.bad_runs.extend([{"report": "rep_gone", "score": 0, "feedback": f"no {secret}", "exchanges": [secret]},
                            {"report": "rep_kept", "score": 0, "feedback": "kept", "exchanges": ["kept run"]}])
    before._save(ctx)
    path = tmp_path / "scenarios" / "s" / "harness-search.json"
    assert secret in path.read_text()
    after = HarnessSearch(settings)  # a restart: the memory is in the file only
    after.forget({"rep_gone", "rec_gone"}, ctx)
    assert secret not in path.read_text() and "kept run" in path.read_text()
    assert [r["report"] for r in after.bad_runs] == ["rep_kept"]
    after.forget({"rep_other"}, ctx)
    assert [r["report"] for r in after.bad_runs] == ["rep_kept"]


def _config(home: Path) -> Any:
    from daemon.config import load_config

    return load_config(env={"REEF_HOME": str(home)})


def _write(path: Path, data: str = "x", mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_a_run_file_leads_to_the_agent_files_inside_its_home_only(tmp_path: Path) -> None:
    """What a run file lists goes, and the directories it leaves empty; a path that is absolute, climbs out, or
    passes a symlinked directory removes nothing outside the agent's home; a run file naming an unknown agent goes
    without touching any agent's files; a run name that is not one is no path. Catches a path joined unchecked."""
    from daemon import copies

    cfg = _config(tmp_path / "reef")
    agent = cfg.homes_dir / "pi" / "s"
    session = _write(agent / ".pi" / "agent" / "sessions" / "--proj--" / "a.jsonl", "the prompt")
    other = _write(agent / ".pi" / "agent" / "sessions" / "--proj--" / "b.jsonl", "another run's")
    _write(agent / ".pi" / "agent" / "models.json", "{}")
    outside = _write(tmp_path / "outside" / "secret.txt", "mine")
    (agent / "link").symlink_to(tmp_path / "outside")
    records = _write(cfg.home / "records.sqlite3", "the store")
    listed = [".pi/agent/sessions/--proj--/a.jsonl", "../../../records.sqlite3", str(outside), "link/secret.txt",
              "x/../../../../outside/secret.txt"]
    _write(cfg.runs_dir / "run_a.json", json.dumps({"run": "run_a", "adapter": "pi", "scenario": "s",
                                                    "agent_files": listed}))
    _write(cfg.runs_dir / "run_b.json", json.dumps({"run": "run_b", "adapter": "../pi", "scenario": "s",
                                                    "agent_files": [".pi/agent/sessions/--proj--/b.jsonl"]}))
    _write(cfg.runs_dir / "run_c.json", json.dumps({"run": "run_c", "adapter": "pi", "scenario": "../pi/s",
                                                    "agent_files": [".pi/agent/sessions/--proj--/b.jsonl"]}))
    gone = copies.remove_runs(cfg, ["run_a", "run_b", "run_c", "../runs/run_a", "run_none"])
    assert gone == {"runs": 3, "agent_files": 1}
    assert not session.exists() and other.exists() and outside.read_text() == "mine" and records.exists()
    assert sorted(p.name for p in cfg.runs_dir.iterdir()) == []
    os.unlink(other)
    _write(cfg.runs_dir / "run_d.json", json.dumps({"run": "run_d", "adapter": "pi", "scenario": "s",
                                                    "agent_files": [".pi/agent/sessions/--proj--/gone.jsonl"]}))
    _write(agent / ".pi" / "agent" / "sessions" / "--proj--" / "gone.jsonl")
    assert copies.remove_runs(cfg, ["run_d"]) == {"runs": 1, "agent_files": 1}
    assert not (agent / ".pi" / "agent" / "sessions").exists(), "the emptied directories stay"
    assert (agent / ".pi" / "agent").is_dir()


def test_an_agents_database_goes_whole_with_its_sidecars(tmp_path: Path) -> None:
    """A run's list naming a SQLite database takes its WAL, shared memory and journal too, and one naming only a WAL
    takes its database and the rest (Codex's ``state_5.sqlite-wal``, written after the list was made, kept a
    forgotten prompt); a file that is no database keeps its look-alike neighbours. Bugs caught: sidecars left, a
    sidecar's database left, a plain file's ``-wal`` neighbour taken."""
    from daemon import copies

    cfg = _config(tmp_path / "reef")
    agent = cfg.homes_dir / "codex" / "s"
    db = [_write(agent / ".codex" / f"state_5.sqlite{s}", "the prompt") for s in ("", "-wal", "-shm", "-journal")]
    logs = [_write(agent / ".codex" / f"logs_1.sqlite{s}", "the prompt") for s in ("", "-wal")]
    notes = [_write(agent / ".codex" / f"notes.txt{s}", "mine") for s in ("", "-wal")]
    _write(cfg.runs_dir / "run_a.json", json.dumps({"run": "run_a", "adapter": "codex", "scenario": "s",
                                                    "agent_files": [".codex/state_5.sqlite", ".codex/logs_1.sqlite-wal",
                                                                    ".codex/notes.txt"]}))
    assert copies.remove_runs(cfg, ["run_a"]) == {"runs": 1, "agent_files": 7}
    assert not any(p.exists() for p in db + logs), [p.name for p in db + logs if p.exists()]
    assert not notes[0].exists() and notes[1].exists()


def test_a_run_whose_wrapper_was_killed_loses_what_changed_until_the_next_run(tmp_path: Path) -> None:
    """No ``agent_files`` (the wrapper never got there): the files of the home changed from the run's start until
    the next run of that home started go; older ones, later ones and the installed harness stay."""
    from daemon import copies

    cfg = _config(tmp_path / "reef")
    agent = cfg.homes_dir / "claude" / "s"
    t = time.time() - 1000
    during = _write(agent / ".claude" / "projects" / "p" / "one.jsonl", "the prompt", t + 5)
    before = _write(agent / ".claude" / "old.jsonl", "earlier", t - 10)
    after = _write(agent / ".claude" / "projects" / "p" / "two.jsonl", "the next run's", t + 200)
    rules = _write(agent / ".claude" / "CLAUDE.md", "rules", t + 5)
    _write(agent / ".reef-harness.json", json.dumps({"release_id": "r", "files": [".claude/CLAUDE.md"]}), t + 5)
    _write(cfg.runs_dir / "run_a.json", json.dumps({"run": "run_a", "adapter": "claude", "scenario": "s",
                                                    "spawned_at": t, "ended_at": None}))
    _write(cfg.runs_dir / "run_b.json", json.dumps({"run": "run_b", "adapter": "claude", "scenario": "s",
                                                    "spawned_at": t + 100}))
    _write(cfg.runs_dir / "run_c.json", json.dumps({"run": "run_c", "adapter": "pi", "scenario": "s",
                                                    "spawned_at": t + 50}))  # another agent's home: no bound
    assert copies.remove_runs(cfg, ["run_a"]) == {"runs": 1, "agent_files": 1}
    assert not during.exists() and before.exists() and after.exists() and rules.exists()
    assert (agent / ".reef-harness.json").exists()


def test_pages_go_and_nothing_else_there(tmp_path: Path) -> None:
    from daemon import copies

    cfg = _config(tmp_path / "reef")
    pages = cfg.home / "pages"
    page = _write(pages / "abc.html", "feedback")
    note = _write(pages / "notes.txt", "the user's")
    (pages / "dir.html").mkdir()
    assert copies.remove_pages(cfg) == 1
    assert not page.exists() and note.exists() and (pages / "dir.html").is_dir()
    assert copies.remove_pages(_config(tmp_path / "empty")) == 0


def test_a_run_whose_agent_made_no_request_can_be_forgotten(daemon_factory: Any) -> None:
    """A run file with no exchange behind it (the agent failed before asking the model) holds the prompt all the
    same: forgetting the run removes it. A run known neither to the store nor here is still a 404."""
    d: Daemon = daemon_factory()
    marker = uuid.uuid4().hex
    run = _write(d.home / "runs" / "run_quiet.json", json.dumps({"run": "run_quiet", "adapter": "pi",
                                                                 "scenario": "pi", "prompt": marker}))
    with d.http() as c:
        assert_canonical_error(c.post("/reef/records/forget", json={"runs": ["run_quiet", "run_nowhere"]}), 404)
        assert run.exists()
        out = c.post("/reef/records/forget", json={"runs": ["run_quiet"]})
    assert out.status_code == 200 and out.json()["copies"]["runs"] == 1 and not run.exists()


def test_forgetting_a_receipt_takes_its_runs_file_and_agent_files_and_leaves_other_runs(daemon_factory: Any) -> None:
    """A run with exchanges, forgotten by one of its receipts: its run file (the prompt) and the files its agent
    wrote go; another run's file and transcript stay. Catches the copies removed only for runs that have no
    exchange (the real agents' check, tests/test_forget_agents.py, needs them installed)."""
    d: Daemon = daemon_factory()
    marker, other = uuid.uuid4().hex, uuid.uuid4().hex
    sessions = d.home / "homes" / "pi" / "pi" / ".pi" / "agent" / "sessions" / "--p--"
    gone = _write(sessions / "a.jsonl", marker)
    kept = _write(sessions / "b.jsonl", other)
    with d.http() as c:
        receipts = {}
        for run in ("run_fa", "run_fb"):
            r = c.post("/v1/chat/completions", headers={"x-reef-run": run}, json={
                "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": f"hi {run}"}]})
            assert r.status_code == 200, r.text
            receipts[run] = r.headers["x-reef-agent-record-id"]
        a = _write(d.home / "runs" / "run_fa.json", json.dumps({
            "run": "run_fa", "adapter": "pi", "scenario": "pi", "prompt": marker,
            "agent_files": [".pi/agent/sessions/--p--/a.jsonl"]}))
        b = _write(d.home / "runs" / "run_fb.json", json.dumps({
            "run": "run_fb", "adapter": "pi", "scenario": "pi", "prompt": other,
            "agent_files": [".pi/agent/sessions/--p--/b.jsonl"]}))
        out = c.post("/reef/records/forget", json={"receipts": [receipts["run_fa"]]})
        assert out.status_code == 200, out.text
        assert out.json()["runs"] == ["run_fa"] and out.json()["copies"]["runs"] == 1, out.json()
        assert c.get(f"/reef/records/{receipts['run_fb']}").json()["request"] is not None
    assert not a.exists() and not gone.exists()
    assert b.exists() and kept.read_text() == other


# --- retention ---------------------------------------------------------------------------------------------------


def test_retention_days_are_days(daemon_factory: Any) -> None:
    """``retention_days = 1``: an exchange two days old is forgotten at the round at start, one a few hours old is
    kept (both decided in the same round). Catches days read as hours, or as seconds."""
    d: Daemon = daemon_factory(start=False)
    cfg = d.home / "config.toml"
    cfg.write_text("retention_days = 1\n" + cfg.read_text())
    d.start()
    now = time.time()
    line = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    with d.http() as c:
        r = c.post("/reef/records/import", json={"items": [
            {**line, "id": "rec_twodays", "created_at": now - 2 * 86400},
            {**line, "id": "rec_hours", "created_at": now - 3 * 3600}]})
        assert r.status_code == 201, r.text
    d.stop()
    # runs whose agents made no request (no exchange names them): judged by when they started
    old_run = _write(d.home / "runs" / "run_twodays.json", json.dumps({
        "run": "run_twodays", "adapter": "pi", "scenario": "pi", "started_at": now - 2 * 86400}))
    new_run = _write(d.home / "runs" / "run_hours.json", json.dumps({
        "run": "run_hours", "adapter": "pi", "scenario": "pi", "started_at": now - 3 * 3600}))
    d.start()  # the round at start
    with d.http() as c:
        wait_for(lambda: c.get("/reef/records/rec_twodays").json()["forgotten_at"], what="the old exchange forgotten")
        kept = c.get("/reef/records/rec_hours").json()
    assert kept["forgotten_at"] is None and kept["request"] is not None
    wait_for(lambda: not old_run.exists(), what="the old run's file removed")
    assert new_run.exists()


async def test_a_backlog_larger_than_a_round_goes_within_one_check(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """More exchanges are due than one round forgets: the rounds follow each other before the loop waits for its
    next check. Catches one round per check interval (a backlog that would take days to clear)."""
    import asyncio

    from daemon import forgetting

    monkeypatch.setattr(forgetting, "RETENTION_ROUND", 4)
    home = tmp_path / "reef"
    home.mkdir()
    (home / "config.toml").write_text("retention_days = 1\nretention_check_s = 3600\n")
    store = SQLiteStore(home / "records.sqlite3")
    old = time.time() - 3 * 86400
    try:
        for i in range(11):
            await store.exchanges.append(replace(_exchange(f"rec_{i:02d}", "x"), created_at=old,
                                                timings={"total_ms": 1}))
        await store.exchanges.append(replace(_exchange("rec_new", "x"), timings={"total_ms": 1}))
        forgot: list[str] = []

        async def learner_forget(scenario: str, ids: set[str]) -> None:
            forgot.append(scenario)

        reef = SimpleNamespace(config=_config(home), store=store, learner=SimpleNamespace(forget=learner_forget),
                               events=SimpleNamespace(publish=lambda *a, **k: None))
        waiting = asyncio.Event()

        async def sleep(seconds: float) -> None:
            assert seconds == 3600
            waiting.set()
            await asyncio.Event().wait()  # the next check never comes in this test

        loop = asyncio.ensure_future(forgetting.retention_loop(reef, sleep=sleep))
        try:
            await asyncio.wait_for(waiting.wait(), 60)
        finally:
            loop.cancel()
        assert await store.user_data.forgotten("s") == {f"rec_{i:02d}" for i in range(11)}
        assert forgot == ["s", "s", "s"]  # three rounds: 4 + 4 + 3
    finally:
        store.close()


def test_an_import_dated_in_the_future_is_refused(daemon_factory: Any) -> None:
    """A time in milliseconds (or from a clock far ahead) is refused by line, and nothing of the batch is stored;
    a date a little ahead (another machine's clock) is taken."""
    d: Daemon = daemon_factory()
    now = time.time()
    line = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    with d.http() as c:
        ms = c.post("/reef/records/import", json={"items": [{**line, "id": "rec_ok", "created_at": now - 10},
                                                            {**line, "id": "rec_ms", "created_at": now * 1000}]})
        err = assert_canonical_error(ms, 400)
        assert "line 2" in err["message"] and "milliseconds" in err["message"]
        ahead = c.post("/reef/records/import", json={"items": [{**line, "id": "rec_ahead",
                                                                "created_at": now + 2 * 3600}]})
        assert "in the future" in assert_canonical_error(ahead, 400)["message"]
        for bad in ("-1", "1e400", "NaN", "1" + "0" * 400):  # as the JSON text has them: -1, inf, NaN, too large
            body = json.dumps({"items": [{**line, "created_at": "BAD"}]}).replace('"BAD"', bad)
            assert_canonical_error(c.post("/reef/records/import", content=body,
                                          headers={"content-type": "application/json"}), 400)
        assert c.get("/reef/records/rec_ok").status_code == 404
        skew = c.post("/reef/records/import", json={"items": [{**line, "id": "rec_skew", "created_at": now + 60}]})
        assert skew.status_code == 201, skew.text
        assert c.get("/reef/records/rec_skew").json()["created_at"] == pytest.approx(now + 60)


async def test_retention_forgets_records_dated_in_the_future_and_no_stream_lives_forever(records_at: str) -> None:
    """Stored before imports refused them: a record dated in milliseconds, or hours ahead, is due under the age
    bound (kept by its date, it would never be); a record dated a minute ahead is not; a stream opened a minute
    ago is left to finish, one opened two hours ago is not; an imported record (complete, no timings) of a minute
    ago is no open stream. Catches the future-dated left out, an imported record taken for an open stream."""
    store = open_store(records_at)
    now = time.time()
    try:
        for rid, created in (("rec_ms", now * 1000), ("rec_ahead", now + 2 * 3600), ("rec_minute", now + 60),
                             ("rec_old", now - 40 * 86400)):
            await store.exchanges.append(replace(_exchange(rid, "x"), created_at=created, timings={"total_ms": 1}))
        await store.exchanges.open(replace(_exchange("rec_streaming", "x"), created_at=now - 60))
        await store.exchanges.open(replace(_exchange("rec_stale", "x"), created_at=now - 2 * 3600))
        await store.exchanges.append(replace(_exchange("rec_imported", "x"), created_at=now - 60))  # no timings
        assert await store.user_data.retention_due(before=now - 30 * 86400, max_bytes=None) == [
            "rec_ms", "rec_ahead", "rec_old"]
        assert await store.user_data.retention_due(before=now, max_bytes=None) == [
            "rec_ms", "rec_ahead", "rec_old", "rec_stale", "rec_imported"]
        assert await store.user_data.retention_due(before=None, max_bytes=None) == []
    finally:
        store.close()
