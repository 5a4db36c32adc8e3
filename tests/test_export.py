"""Records out and in through a real daemon and the CLI: the export is the documented shape (TRL's prompt and
completion messages, score and label, token ids) in JSON Lines and Parquet, streamed page by page; an import is
idempotent by id, atomic per batch, and refuses malformed lines by number with nothing stored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import Daemon, assert_canonical_error


def chat(c: Any, scenario: str, text: str) -> str:
    r = c.post(f"/s/{scenario}/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r.headers["x-reef-agent-record-id"]


def anthropic(c: Any, scenario: str, text: str) -> str:
    r = c.post(f"/s/{scenario}/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r.headers["x-reef-agent-record-id"]


def test_export_in_the_documented_shape_and_import_back_idempotently(daemon_factory: Any, tmp_path: Path) -> None:
    d: Daemon = daemon_factory()
    with d.http() as c:
        a = chat(c, "ex", "question one")
        b = anthropic(c, "ex", "question two")
        other = chat(c, "elsewhere", "not this scenario")
        assert c.post("/reef/report", json={"references": [a], "score": 0.2, "feedback": "meh"}).status_code == 201
        assert c.post("/reef/report", json={"references": [a], "score": 0.9}).status_code == 201
        for i in range(3):  # more than one page would hold with a small page: the stream has them all
            chat(c, "ex", f"filler {i}")
    out = tmp_path / "ex.jsonl"
    d.cli("records", "export", "--scenario", "ex", "-o", str(out))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {x["id"]: x for x in lines}
    assert len(lines) == 5 and other not in by_id and list(by_id)[:2] == [a, b]  # oldest first
    first = by_id[a]
    assert first["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "question one"}]
    assert first["completion"][0]["role"] == "assistant" and isinstance(first["completion"][0]["content"], str)
    assert first["score"] == 0.9 and first["label"] is True  # the latest report
    assert [r["score"] for r in first["reports"]] == [0.2, 0.9] and first["reports"][0]["feedback"] == "meh"
    assert first["token_ids"] and len(first["logprobs"]) == len(first["token_ids"])
    assert by_id[b]["format"] == "anthropic" and by_id[b]["prompt"] == [{"role": "user", "content": "question two"}]
    assert by_id[b]["score"] is None and by_id[b]["label"] is None
    # Parquet: the same rows
    pq_path = tmp_path / "ex.parquet"
    d.cli("records", "export", "--scenario", "ex", "--format", "parquet", "-o", str(pq_path))
    import pyarrow.parquet as pq

    table = pq.read_table(pq_path).to_pylist()
    assert [r["id"] for r in table] == [x["id"] for x in lines]
    assert [{k: v for k, v in m.items() if v is not None} for m in table[0]["prompt"]] == first["prompt"]
    assert table[0]["score"] == 0.9 and table[0]["reports"][0] == {"score": 0.2, "feedback": "meh", "source": None}
    assert list(table[0]["token_ids"]) == first["token_ids"]
    # import into another daemon's home: the same exchanges, once however often it runs
    d2: Daemon = daemon_factory()
    got = d2.cli("records", "import", str(out), "--scenario", "moved", "--json")
    # both of a's reports
    assert json.loads(got.stdout) == {"imported": 5, "skipped": 0, "reports": 2, "tokens_dropped": 0}
    again = d2.cli("records", "import", str(out), "--json")
    assert json.loads(again.stdout) == {"imported": 0, "skipped": 5, "reports": 0, "tokens_dropped": 0}
    round_trip = tmp_path / "back.jsonl"
    d2.cli("records", "export", "-o", str(round_trip))
    assert round_trip.read_bytes() == out.read_bytes()  # out and back through the CLI and two daemons: same bytes
    back = {x["id"]: x for x in map(json.loads, round_trip.read_text().splitlines())}
    assert set(back) == set(by_id) and all(x["scenario"] == "ex" for x in back.values())  # the line's own
    assert back[a]["prompt"] == first["prompt"] and back[a]["score"] == 0.9
    assert back[a]["completion"][0]["content"] == first["completion"][0]["content"]


def test_malformed_lines_are_refused_by_number_and_nothing_is_imported(daemon_factory: Any, tmp_path: Path) -> None:
    d: Daemon = daemon_factory()
    good = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([json.dumps(good), "{not json", json.dumps({**good, "prompt": []}),
                               json.dumps({**good, "score": "high"}), json.dumps({**good, "id": "x1"})]) + "\n")
    bad = d.cli("records", "import", str(path), check=False)
    assert bad.returncode == 2, bad.stderr
    for number in (2, 3, 4, 5):
        assert f"line {number}:" in bad.stderr, bad.stderr
    assert "line 1:" not in bad.stderr and "nothing imported" in bad.stderr
    with d.http() as c:
        assert c.get("/reef/records", params={"scenario": "imported"}).json()["records"] == []
        # the route refuses a malformed batch whole, naming the item
        r = c.post("/reef/records/import", json={"items": [good, {"prompt": "x"}], "first_line": 10})
        assert r.status_code == 400 and "line 11" in r.json()["error"]["message"]
        assert c.get("/reef/records", params={"scenario": "imported"}).json()["records"] == []
    assert d.cli("records", "export", "--format", "csv", check=False).returncode == 2


async def test_the_export_reads_page_by_page_to_the_end(records_at: str) -> None:
    """A page at a time, each after the last one's seq, until a short page: every record once, in order (a
    dropped cursor would repeat the first page forever; a page taken as the end too early would lose the rest)."""
    from daemon.records import ExchangeRecord, open_store

    store = open_store(records_at)
    try:
        for i in range(5):
            await store.exchanges.append(ExchangeRecord(id=f"rec_{i}", scenario="s", request={}, response={}))
        seen, after, pages = [], 0, 0
        while after is not None:
            page, after = await store.user_data.export_page(scenario="s", since=None, after=after, limit=2)
            seen += [r["id"] for r in page]
            pages += 1
        assert seen == [f"rec_{i}" for i in range(5)] and pages == 3
    finally:
        store.close()


TURN = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}


def test_an_import_refuses_what_the_api_refuses_elsewhere_naming_the_item_and_field(
        daemon: Daemon, tmp_path: Path) -> None:
    """One validation for every way data comes in: run names as the serve path checks them, receipts that can be
    named again, scores and feedback as ``/reef/report`` checks them, the prompt as a served request is parsed. Each
    bad item is a 400 whose ``param`` names its index and field, the whole batch refused (nothing stored)."""
    import time

    bad_items = [
        ({"run": "a\nb/../.."}, "items[1].run"),
        ({"run": "r" * 100_000}, "items[1].run"),
        ({"id": "rec_../../x"}, "items[1].id"),
        ({"id": "rec_a/b"}, "items[1].id"),
        ({"scenario": "../x"}, "items[1].scenario"),
        ({"score": "high"}, "items[1].score"),
        ({"feedback": "x" * (256 * 1024 + 1)}, "items[1].feedback"),
        ({"feedback": 3}, "items[1].feedback"),
        ({"prompt": [{"role": "user", "content": "hi"}, {"role": "hacker", "content": "hi"}]},
         "items[1].prompt[1].role"),
        ({"completion": [{"role": "assistant\n", "content": "yo"}]}, "items[1].completion[0].role"),
        ({"model": "m" * 10_000}, "items[1].model"),
        ({"model": "a\nb"}, "items[1].model"),
        ({"created_at": time.time() * 1000}, "items[1].created_at"),  # milliseconds: "in the future"
        ({"created_at": 10**400}, "items[1].created_at"),
    ]
    with daemon.http() as c:
        for change, param in bad_items:
            r = c.post("/reef/records/import", json={"items": [TURN, {**TURN, **change}], "scenario": "imp-bad"})
            assert_canonical_error(r, 400)
            err = r.json()["error"]
            assert err["param"] == param and err["message"].startswith("line 2 (items[1]): "), (change.keys(), err)
            assert len(err["message"]) < 1000, err["message"][:200]  # a 100,000-character name is not echoed whole
        # a score JSON reads as infinity (1e400) is refused as /reef/report refuses it, never stored as null
        raw = json.dumps({"items": [TURN, {**TURN, "score": 0.5}], "scenario": "imp-bad"}).replace("0.5", "1e400")
        r = c.post("/reef/records/import", content=raw, headers={"Content-Type": "application/json"})
        assert_canonical_error(r, 400)
        assert r.json()["error"]["param"] == "items[1].score" and "finite" in r.json()["error"]["message"]
        receipt = c.post("/v1/chat/completions", headers={"x-reef-scenario": "imp-bad"}, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
                         ).headers["x-reef-agent-record-id"]
        raw = json.dumps({"references": [receipt], "score": 0.5}).replace("0.5", "1e400")
        same = c.post("/reef/report", content=raw, headers={"Content-Type": "application/json"})
        assert same.status_code == 400 and same.json()["error"]["message"] == "score must be a finite number"
        assert [x["id"] for x in c.get("/reef/records", params={"scenario": "imp-bad"}).json()["records"]] == [
            receipt]  # no imported exchange, no report
        tools = [{"role": "system", "content": "s"}, {"role": "user", "content": "ls"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                 {"role": "tool", "content": "a.py", "tool_call_id": "c1"}]  # as an export writes
        ok = c.post("/reef/records/import", json={"items": [{**TURN, "run": "run_1:a", "id": "rec_Imp-1_x",
                                                             "score": 0, "model": "Qwen/Qwen2.5-7B",
                                                             "prompt": tools}]})
        assert ok.status_code == 201, ok.text
        assert ok.json() == {"imported": 1, "skipped": 0, "reports": 1, "tokens_dropped": 0}, ok.text
    # the CLI checks each line with the same function: NaN (which Python's json reads) is refused by line
    path = tmp_path / "nan.jsonl"
    path.write_text(json.dumps(TURN) + "\n" + json.dumps({**TURN, "score": float("nan")}) + "\n")
    bad = daemon.cli("records", "import", str(path), check=False)
    assert bad.returncode == 2 and "line 2: score must be a finite number" in bad.stderr, bad.stderr


def test_a_report_key_of_an_import_is_never_a_client_report_id(daemon: Daemon) -> None:
    """An imported exchange's report is stored as ``import:<receipt>``: a client may not take such a report_id
    (the import of that receipt would then collide: it answered 500, an IntegrityError)."""
    with daemon.http() as c:
        receipt = c.post("/v1/chat/completions", headers={"x-reef-scenario": "imp-key"}, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
                         ).headers["x-reef-agent-record-id"]
        r = c.post("/reef/report", json={"references": [receipt], "score": 1, "report_id": "import:rec_x"})
        assert_canonical_error(r, 400)
        assert r.json()["error"]["param"] == "report_id"
        ok = c.post("/reef/records/import", json={"items": [{**TURN, "id": "rec_x", "score": 1}],
                                                  "scenario": "imp-key"})
        assert ok.status_code == 201 and ok.json()["reports"] == 1, ok.text
        assert c.post("/reef/report", json={"references": [receipt], "score": 1, "report_id": "mine:rec_x"}
                      ).status_code == 201


async def test_an_import_that_collides_with_a_stored_report_id_refuses_the_batch_naming_the_item(
        records_at: str) -> None:
    """A store holding a client's ``import:X`` report_id (from before such ids were refused): importing X is a
    409 naming the item and its id, with nothing of the batch stored (it was an IntegrityError, a 500)."""
    from daemon.errors import ReportConflict
    from daemon.export import from_line
    from daemon.records import ExchangeRecord, open_store

    store = open_store(records_at)
    try:
        await store.exchanges.append(ExchangeRecord(id="rec_served", scenario="s", request={}, response={}))
        await store.reports.append(scenario="s", score=1.0, feedback=None, references=["rec_served"], metadata=None,
                                  report_id="import:rec_x")
        items = [from_line({**TURN, "id": "rec_fine", "score": 1}, "line 1", "s", index=0),
                 from_line({**TURN, "id": "rec_x", "score": 0}, "line 2", "s", index=1)]
        try:
            await store.user_data.import_exchanges(items)
            raise AssertionError("the colliding import was stored")
        except ReportConflict as e:
            assert e.status == 409 and e.data["param"] == "items[1].id" and "rec_x" in e.message
        for rid in ("rec_fine", "rec_x"):
            assert not [r for r in (await store.user_data.export_page(scenario="s", since=None, after=0))[0]
                        if r["id"] == rid]
        # without the colliding key the same batch goes in whole
        counts, _ = await store.user_data.import_exchanges(items[:1])
        assert counts == {"imported": 1, "skipped": 0, "reports": 1}
    finally:
        store.close()


def test_the_same_id_less_line_imported_into_two_scenarios_gives_two_exchanges(daemon: Daemon) -> None:
    with daemon.http() as c:
        for scenario in ("imp-one", "imp-two"):
            r = c.post("/reef/records/import", json={"items": [TURN], "scenario": scenario})
            assert r.json() == {"imported": 1, "skipped": 0, "reports": 0, "tokens_dropped": 0}, (scenario, r.text)
        ids = {s: [x["id"] for x in c.get("/reef/records", params={"scenario": s}).json()["records"]]
               for s in ("imp-one", "imp-two")}
        assert len(ids["imp-one"]) == 1 and len(ids["imp-two"]) == 1 and ids["imp-one"] != ids["imp-two"], ids
        again = c.post("/reef/records/import", json={"items": [TURN], "scenario": "imp-two"})
        # in one scenario: idempotent
        assert again.json() == {"imported": 0, "skipped": 1, "reports": 0, "tokens_dropped": 0}


def test_the_label_is_true_from_a_score_of_one_half() -> None:
    from daemon.export import to_line

    def label(score: Any) -> Any:
        return to_line({"id": "rec_a", "scenario": "s", "reports": [{"report": {"score": score}}]})["label"]

    assert label(0.5) is True and label(1) is True and label(0.4999) is False and label(0.0) is False
    assert to_line({"id": "rec_a", "scenario": "s", "reports": []})["label"] is None


def test_a_parquet_export_of_more_than_a_batch_keeps_every_row(daemon: Daemon, tmp_path: Path) -> None:
    """1,001 exchanges: a full row group of 1,000 and one more (the CLI writes a row group per 1,000 lines)."""
    n = 1001
    items = [{**TURN, "id": f"rec_pq_{i:05d}", "created_at": 1_700_000_000 + i} for i in range(n)]
    with daemon.http() as c:
        for i in range(0, n, 1000):
            r = c.post("/reef/records/import", json={"items": items[i:i + 1000], "scenario": "pq-many"})
            assert r.status_code == 201, r.text
    out = tmp_path / "many.parquet"
    got = daemon.cli("records", "export", "--scenario", "pq-many", "--format", "parquet", "-o", str(out))
    assert f"wrote {n} exchange(s)" in got.stdout, got.stdout
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [it["id"] for it in items]


def test_a_stored_client_report_id_on_an_import_key_is_a_409_over_http_not_a_500(daemon_factory: Any) -> None:
    """A home whose store holds a client's ``import:rec_legacy`` report (written before /reef/report refused such
    ids): importing rec_legacy through the route is a 409 naming the item and its id (it was a 500)."""
    import asyncio

    from daemon.config import load_config
    from daemon.records import ExchangeRecord, open_store

    d: Daemon = daemon_factory(start=False)

    async def legacy() -> None:
        store = open_store(load_config(d.env).records_location)
        try:
            await store.exchanges.append(ExchangeRecord(id="rec_served", scenario="legacy", request={}, response={}))
            await store.reports.append(scenario="legacy", score=1.0, feedback=None, references=["rec_served"],
                                      metadata=None, report_id="import:rec_legacy")
        finally:
            store.close()

    asyncio.run(legacy())
    d.start()
    with d.http() as c:
        r = c.post("/reef/records/import", json={"items": [TURN, {**TURN, "id": "rec_legacy", "score": 0}],
                                                 "scenario": "legacy"})
        err = assert_canonical_error(r, 409)
        assert err["param"] == "items[1].id" and "rec_legacy" in err["message"], err
        assert c.get("/reef/records/rec_legacy").status_code == 404  # nothing of the batch stored
        ok = c.post("/reef/records/import", json={"items": [{**TURN, "id": "rec_legacy"}], "scenario": "legacy"})
        # without a report there is no key to take
        assert ok.json() == {"imported": 1, "skipped": 0, "reports": 0, "tokens_dropped": 0}
