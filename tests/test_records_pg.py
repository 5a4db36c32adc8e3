"""A daemon whose records live in PostgreSQL (``records = "postgresql://..."``), against a real cluster.

- It serves and records as with SQLite: receipts name records that another connection reads.
- The database goes away (the cluster stopped) while requests arrive: each gets a clear 503 in its provider's
  shape and no receipt, nothing is recorded for it, the daemon stays up; once the cluster is back, service
  resumes by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, assert_canonical_error
from tests.pg import PgCluster

CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def own_cluster() -> Iterator[PgCluster]:
    """A cluster of this test's own, since the test stops it (the session's cluster serves the others)."""
    cluster = PgCluster()
    yield cluster
    cluster.close()


def _pg_daemon(daemon_factory: Callable[..., Daemon], url: str) -> Daemon:
    d = daemon_factory(start=False)
    d.env["REEF_RECORDS"] = url
    return d.start()


def _exchanges(url: str) -> list[str]:
    import psycopg

    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM records WHERE kind='exchange' ORDER BY seq")]


def test_records_go_to_postgresql(daemon_factory: Callable[..., Daemon], pg_url: str) -> None:
    d = _pg_daemon(daemon_factory, pg_url)
    with d.http() as c:
        r = c.post("/s/pg/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        receipt = r.headers["x-reef-agent-record-id"]
        with c.stream("POST", "/s/pg/v1/messages", json={**MESSAGES, "stream": True}) as s:
            assert s.status_code == 200
            streamed = s.headers["x-reef-agent-record-id"]
            s.read()
        rep = c.post("/reef/report", json={"score": 1.0, "references": [receipt, streamed], "report_id": "once"})
        assert rep.status_code == 201, rep.text
        again = c.post("/reef/report", json={"score": 1.0, "references": [receipt, streamed], "report_id": "once"})
        assert again.json()["report_id"] == rep.json()["report_id"]  # idempotent, as with SQLite
        other = c.post("/reef/report", json={"score": 0.0, "references": [receipt, streamed], "report_id": "once"})
        assert_canonical_error(other, 409)
        assert c.get(f"/reef/records/{streamed}").json()["status"] == "complete"
    assert _exchanges(pg_url) == [receipt, streamed]  # in the database, not beside it
    assert not (d.home / "records.sqlite3").exists()


def _until(what: str, check: Callable[[], Any], guard_s: float = 60) -> Any:
    deadline = time.monotonic() + guard_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true after {guard_s} s")
        time.sleep(0.1)


def test_the_database_going_away_is_a_503_without_receipt_and_service_resumes(
        daemon_factory: Callable[..., Daemon], own_cluster: PgCluster) -> None:
    url = own_cluster.create_database()
    d = _pg_daemon(daemon_factory, url)
    stored: list[str] = []
    with d.http() as c:
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            stored.append(r.headers["x-reef-agent-record-id"])

        own_cluster.stop("fast")  # the database goes away while requests keep coming
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=CHAT)
            err = assert_canonical_error(r, 503, shape="openai")
            assert "cannot be reached" in err["message"] and "x-reef-agent-record-id" not in r.headers
            s = c.post("/v1/messages", json={**MESSAGES, "stream": True})  # a stream: refused before its headers
            err = assert_canonical_error(s, 503, shape="anthropic")
            assert "x-reef-agent-record-id" not in s.headers
            rep = c.post("/reef/report", json={"scenario": "default", "score": 1.0, "references": [stored[0]]})
            assert_canonical_error(rep, 503)
        assert c.get("/healthz").status_code == 200  # the daemon itself stays up

        own_cluster.start()
        r = _until("a request is served again", lambda: (lambda r: r if r.status_code == 200 else None)(
            c.post("/v1/chat/completions", json=CHAT)))
        stored.append(r.headers["x-reef-agent-record-id"])
        assert c.get(f"/reef/records/{stored[-1]}").status_code == 200
        with c.stream("POST", "/v1/messages", json={**MESSAGES, "stream": True}) as s:
            assert s.status_code == 200
            stored.append(s.headers["x-reef-agent-record-id"])
            s.read()
        assert c.post("/reef/report", json={"score": 1.0, "references": stored[-2:]}).status_code == 201
    # what was refused left nothing behind; what got a receipt is there, once
    assert _exchanges(url) == stored
    assert d.proc is not None and d.proc.poll() is None


def test_a_daemon_that_cannot_reach_its_database_at_start_says_so(daemon_factory: Callable[..., Daemon],
                                                                   own_cluster: PgCluster) -> None:
    import subprocess
    import sys

    url = own_cluster.create_database().replace("reef@", "reef:hunter2@")
    own_cluster.stop("fast")
    d = daemon_factory(start=False)
    proc = subprocess.run([sys.executable, "-m", "daemon"], env={**d.env, "REEF_RECORDS": url},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert "cannot be reached" in proc.stderr and "hunter2" not in proc.stderr and ":***@" in proc.stderr
    with pytest.raises(httpx.TransportError):
        httpx.get(d.url + "/healthz", timeout=2)


# --- two daemons, one store: exactly one trains ------------------------------------------------------------

NOTES = '''
import asyncio
import os
from pathlib import Path

from recipes.base import Candidate, Recipe


class Notes(Recipe):
    """Each written feedback becomes one line of AGENTS.md (a harness step: milliseconds, no trainer)."""

    name = "notes"
    kind = "harness"
    source = "feedback"

    async def edit(self, tree, batch, ctx):
        if os.environ.get("NOTES_HANG"):  # a step that never ends: the test kills its daemon in it
            Path(os.environ["NOTES_HANG"]).write_text(",".join(r.id for r in batch))
            await asyncio.sleep(3600)
        text = tree.get("AGENTS.md", b"# Rules\\n").decode()
        for r in batch:
            text += f"- {r.feedback}\\n"
        return Candidate(tree={**tree, "AGENTS.md": text.encode()})
'''


def _sharing(daemon_factory: Callable[..., Daemon], url: str, recipes: Any, **env: str) -> Daemon:
    d = daemon_factory(start=False)
    cfg = d.home / "config.toml"
    cfg.write_text(f'recipe_paths = ["{recipes}"]\nlease_ttl_s = 1.0\n' + cfg.read_text())
    d.env.update(REEF_RECORDS=url, **env)
    return d.start()


def _feedback(c: httpx.Client, text: str) -> str:
    r = c.post("/s/notes/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    rep = c.post("/reef/report", json={"references": [r.headers["x-reef-agent-record-id"]], "feedback": text})
    assert rep.status_code == 201, rep.text
    return str(rep.json()["report_id"])


def _trained(c: httpx.Client) -> list[list[str]]:
    chain = c.get("/reef/scenarios/notes/releases", params={"all": "1"}).json()
    return [r["receipts"] for r in chain["releases"] if r["operation"] == "train"]


def test_of_two_daemons_only_the_lease_holder_trains_and_the_other_takes_over(
        daemon_factory: Callable[..., Daemon], pg_url: str, tmp_path: Any) -> None:
    """Two daemons share one PostgreSQL (each with its own release chain here: chain remotes are another
    setting). Feedback reported to the one that does not hold the lease is learned by the holder; once the
    holder is killed (-9), the other takes the lease over and learns what comes next, and nothing is learned
    from twice."""
    (tmp_path / "notes_recipe.py").write_text(NOTES)
    a = _sharing(daemon_factory, pg_url, tmp_path)  # first up: it takes the lease
    with a.http() as ca:
        assert ca.post("/reef/scenarios", json={"name": "notes", "recipe": "notes_recipe:Notes"}).status_code == 201
        _until("a holds the lease", lambda: "training here" in a.log_tail(200))
    b = _sharing(daemon_factory, pg_url, tmp_path)
    with a.http() as ca, b.http() as cb:
        first = _feedback(cb, "run the tests first")  # reported to b, which does not train
        assert _until("a learns b's report", lambda: _trained(ca)) == [[first]]
        assert _trained(cb) == []
        assert "training here" not in b.log_tail(200)
        a.kill9()
        second = _feedback(cb, "keep diffs small")
        assert _until("b takes over and learns", lambda: _trained(cb)) == [[second]]  # not the first again
        assert "training here" in b.log_tail(200)



def test_a_trainer_killed_mid_step_hands_its_batch_to_the_next(daemon_factory: Callable[..., Daemon], pg_url: str,
                                                              tmp_path: Any) -> None:
    """The holder claims a batch and is killed (-9) inside the step: the daemon that takes the lease over gives
    that claim back and learns the batch itself, once."""
    (tmp_path / "notes_recipe.py").write_text(NOTES)
    marker = tmp_path / "in-step"
    a = _sharing(daemon_factory, pg_url, tmp_path, NOTES_HANG=str(marker))
    with a.http() as ca:
        assert ca.post("/reef/scenarios", json={"name": "notes", "recipe": "notes_recipe:Notes"}).status_code == 201
        _until("a holds the lease", lambda: "training here" in a.log_tail(200))
    b = _sharing(daemon_factory, pg_url, tmp_path)
    with b.http() as cb:
        first = _feedback(cb, "run the tests first")
        _until("a is inside its step", marker.exists)
        assert marker.read_text() == first
        a.kill9()
        assert _until("b takes over and learns the batch a died with", lambda: _trained(cb)) == [[first]]
        assert "come back to learn from" in b.log_tail(200)
        second = _feedback(cb, "keep diffs small")
        assert _until("b learns on", lambda: len(_trained(cb)) == 2 and _trained(cb)) == [[second], [first]]


# --- commit order across daemons ------------------------------------------------------------------------------


async def _paged_while_one_commits_late(url: str, late: Callable[[Any], None], quick: Callable[[Any], Any],
                                        page: Callable[[Any, int], Any]) -> list[str]:
    """Daemon A's writer holds a transaction open that inserted a row (``late``); daemon B then writes another
    (``quick``) and a reader pages by cursor (``page(store, cursor)`` -> (ids, new cursor)) before and after A
    commits. Returns every id the reader saw. Reef's write lock makes B wait for A, so seq is commit order and
    the reader, whatever it saw first, misses nothing; without it B commits a higher seq first, the reader's
    cursor moves past A's lower one, and A's row is never read."""
    import asyncio
    import threading

    from daemon.records import open_store

    a, b, reader = open_store(url), open_store(url), open_store(url)
    inserted, go = threading.Event(), threading.Event()

    def hold(conn: Any) -> None:
        late(conn)
        inserted.set()
        go.wait(30)

    try:
        held = asyncio.ensure_future(a.write(hold))
        assert await asyncio.to_thread(inserted.wait, 30)
        quick_done = asyncio.ensure_future(quick(b))

        async def b_done_or_waiting() -> bool:
            waiting = await reader.read(lambda c: c.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype='advisory' AND NOT granted").fetchone()[0])
            return quick_done.done() or waiting > 0

        deadline = asyncio.get_running_loop().time() + 30
        while not await b_done_or_waiting():
            assert asyncio.get_running_loop().time() < deadline, "daemon B neither wrote nor waited"
            await asyncio.sleep(0.02)
        seen, cursor = await page(reader, 0)  # B's row, if B did not wait for A
        go.set()
        await held
        await quick_done
        more, _ = await page(reader, cursor)
        return list(seen) + list(more)
    finally:
        go.set()
        for s in (a, b, reader):
            s.close()


async def test_exchanges_two_daemons_append_are_all_read_by_a_cursor(pg_url: str) -> None:
    """Records paged by ``seq`` (``GET /reef/scenarios/{s}/records?after=``, a wrapper collecting a run's
    receipts): an exchange whose transaction committed after a later one's lost no place. Fails with the write
    lock left out of either path: the general one (A's write) or the exchange fast path (B's)."""
    from daemon.records.rows import ExchangeRow

    def late(conn: Any) -> None:
        ExchangeRow.insert(conn, [ExchangeRow(_exchange("rec_late")).row])

    async def page(store: Any, cursor: int) -> tuple[list[str], int]:
        rows = await store.exchanges.listing(scenario="s", after=cursor, limit=50)
        return [r["id"] for r in rows], (rows[-1]["seq"] if rows else cursor)

    seen = await _paged_while_one_commits_late(
        pg_url, late, lambda b: b.exchanges.append(_exchange("rec_quick")), page)
    assert sorted(seen) == ["rec_late", "rec_quick"]


async def test_reports_two_daemons_append_are_all_read_by_the_learning_cursor(pg_url: str) -> None:
    """The learning loop reads reports since its cursor (``scored_exchanges``): a report whose transaction
    committed after a later one's is still learned from. Fails with the write lock left out of the general
    write path (reports take it)."""
    from daemon.records import open_store

    setup = open_store(pg_url)
    try:
        await setup.exchanges.append(_exchange("rec_1"))
        await setup.exchanges.append(_exchange("rec_2"))
    finally:
        setup.close()

    def late(conn: Any) -> None:
        conn.execute("INSERT INTO records(id, kind, scenario, created_at, status, report)"
                     " VALUES ('rep_late', 'report', 's', 0, 'complete', '{\"score\": 1.0}')")
        conn.execute("INSERT INTO report_refs(report_id, receipt) VALUES ('rep_late', 'rec_1')")

    async def quick(b: Any) -> Any:
        return await b.reports.append(scenario="s", score=0.5, feedback=None, references=["rec_2"], metadata=None,
                                     report_id=None)

    async def page(store: Any, cursor: int) -> tuple[list[str], int]:
        rows, seen = await store.reports.scored_exchanges("s", after=cursor)
        return [r.id for r in rows], seen

    assert sorted(await _paged_while_one_commits_late(pg_url, late, quick, page)) == ["rec_1", "rec_2"]


def _exchange(receipt: str) -> Any:
    from daemon.records import ExchangeRecord

    return ExchangeRecord(id=receipt, scenario="s", status="complete", format="openai-chat", engine="e", model="m",
                          release_id="rel", request={}, response={}, prompt_token_ids=[1, 2], token_ids=[3, 4],
                          logprobs=[-0.5, -0.25])
