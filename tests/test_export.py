"""Records out and in through a real daemon and the CLI: the export is the documented shape (TRL's prompt and
completion messages, score and label, token ids) in JSON Lines and Parquet, streamed page by page; an import is
idempotent by id, atomic per batch, and refuses malformed lines by number with nothing stored."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

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


# --- from_line and to_line, without a daemon ------------------------------------------------------------------------

_LINE = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
         "completion": [{"role": "assistant", "content": "yo"}]}


def _refused(item: Any, **kw: Any) -> Any:
    from daemon.errors import BadRequest
    from daemon.export import from_line

    with pytest.raises(BadRequest) as e:
        from_line(item, "line 3", "s", **kw)
    return e.value


@pytest.mark.parametrize(("over", "param", "words"), [
    ({"status": "done"}, "status", "status must be one of complete, incomplete, error, cancelled"),
    ({"prompt": None}, "prompt", "prompt must be a non-empty list of messages"),
    ({"completion": []}, "completion", "completion must be a non-empty list of messages"),
    ({"prompt": [{"role": "wizard", "content": "x"}]}, "prompt[0].role", "prompt[0]"),
    ({"tools": "not json"}, "tools", "tools must be a JSON list of function schemas"),
    ({"tools": {"a": 1}}, "tools", "tools must be a list of function schemas"),
    ({"scenario": "a b"}, "scenario", "scenario"),
    ({"run": "../x"}, "run", "invalid run name"),
    ({"model": ""}, "model", "model must be a name of 1 to 200 printable characters"),
    ({"model": "m" * 201}, "model", "model must be a name of 1 to 200"),
    ({"model": "a\nb"}, "model", "model must be a name"),
    ({"model": 5}, "model", "model must be a name"),
    ({"release_id": ""}, "release_id", "release_id must be an id of 1 to 200 printable characters"),
    ({"release_id": "r" * 201}, "release_id", "release_id must be an id"),
    ({"release_id": "a\tb"}, "release_id", "release_id must be an id"),
    ({"release_id": 7}, "release_id", "release_id must be an id"),
    ({"format": "smoke-signals"}, "format", "format must be one of openai-chat"),
    ({"created_at": "yesterday"}, "created_at", "created_at must be seconds since the epoch (a number), not str"),
    ({"created_at": True}, "created_at", "(a number), not bool"),
    ({"created_at": -1}, "created_at", "created_at must be seconds since the epoch, got -1"),
    ({"created_at": float("nan")}, "created_at", "got nan"),
    ({"created_at": 10**400}, "created_at", "created_at must be seconds since the epoch, got 1000"),
    ({"created_at": 1.9e12}, "created_at", "is in the future (milliseconds? Reef takes seconds since the epoch)"),
    ({"token_ids": [1, -1]}, "token_ids", "token_ids must be a list of token ids (integers from 0 to 2^31-1)"),
    ({"token_ids": [2**31]}, "token_ids", "token_ids must be a list of token ids"),
    ({"token_ids": [True]}, "token_ids", "token_ids must be a list"),
    ({"prompt_token_ids": (1, 2)}, "prompt_token_ids", "prompt_token_ids must be a list"),
    ({"token_ids": [1, 2], "logprobs": [0.0]}, "logprobs", "logprobs must have one number per token id"),
    ({"logprobs": [0.0]}, "logprobs", "logprobs must have one number per token id"),
    ({"token_ids": [1], "logprobs": [float("inf")]}, "logprobs", "logprobs must be a list of finite numbers"),
    ({"token_ids": [1], "logprobs": [False]}, "logprobs", "logprobs must be a list of finite numbers"),
    ({"token_ids": [1], "logprobs": "x"}, "logprobs", "logprobs must be a list of finite numbers"),
    ({"score": "high"}, "score", "score must be a number"),
    ({"feedback": 3}, "feedback", "feedback must be text"),
    ({"reports": {"score": 1}}, "reports", "reports must be a list of {score, feedback, source}"),
    ({"reports": [1]}, "reports[0]", "each report must be an object"),
    ({"reports": [{"score": 1}, {"score": "x"}]}, "reports[1].score", "score must be a number"),
    ({"reports": [{"feedback": 1}]}, "reports[0].feedback", "feedback must be text"),
    ({"reports": [{"source": ""}]}, "reports[0].source", "a report's source must be a name of 1 to 40"),
    ({"reports": [{"source": "s" * 41}]}, "reports[0].source", "a report's source must be"),
    ({"reports": [{"source": "a\nb"}]}, "reports[0].source", "a report's source must be"),
    ({"reports": [{"source": 1}]}, "reports[0].source", "a report's source must be"),
    ({"score": 1, "reports": [{"score": 0.5}]}, "score", "score 1 is not the last scored report's (0.5)"),
    ({"score": 1, "reports": [{"feedback": "ok"}]}, "score", "score 1 is not the last scored report's (none)"),
    ({"id": "no spaces allowed"}, "id", "receipt"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "expected object"),
    ({"token_ids": [2**31 + 1]}, "token_ids", "token_ids must be a list of token ids"),
    ({"token_ids": [1], "logprobs": [0.0, 0.0]}, "logprobs", "logprobs must have one number per token id"),
    ({"score": 0.5, "reports": [{"score": 1}]}, "score", "score 0.5 is not the last scored report's (1)"),
    ({"score": 1, "reports": [{"score": 0.2}, {"score": 0.5}]}, "score", "(0.5): change both, or drop reports"),
    ({"created_at": -10**50}, "created_at", f"got {str(-10**50)[:40]}"),
])
def test_an_imported_line_is_refused_naming_the_field(over: dict[str, Any], param: str, words: str) -> None:
    """Each check ``from_line`` makes, with the field its refusal names. Bugs caught: any check dropped, inverted
    or moved off its bound (200 characters of a model or release id, 40 of a source, ids up to 2^31-1), a bool
    taken for a number, milliseconds not named, a score beside reports not compared with the last scored one."""
    e = _refused({**_LINE, **over})
    assert words in e.message and e.message.startswith("line 3: "), e.message
    if param == "created_at" and "got -1000" in words:  # the value shown is cut at 40 characters
        assert e.message.endswith(words), e.message
    assert str(e.param).startswith(param) if param in ("scenario", "id") else e.param == param, (e.param, param)


def test_a_refusal_names_the_item_of_the_batch_and_its_field() -> None:
    """Bugs caught: the item's index left out (or put where no index is given), a field-less refusal given a dot."""
    e = _refused({**_LINE, "model": ""}, index=4)
    assert e.param == "items[4].model" and e.message.startswith("line 3: model must"), (e.param, e.message)
    assert _refused([1], index=2).param == "items[2]" and _refused([1]).param is None
    assert _refused("x").message == "line 3: not a JSON object"


def test_the_bounds_an_import_takes_at_their_edge() -> None:
    """Exactly 200 characters of a model or release id, 40 of a source, token id 2^31-1 and 0, a time up to the
    clock's skew, and a failed exchange without prompt or answer are taken. Bugs caught: ``<`` for ``<=`` on each
    bound, a failed exchange required to have messages."""
    import time

    from daemon.export import from_line
    from daemon.records.user_data import CLOCK_SKEW_S

    got = from_line({**_LINE, "model": "m" * 200, "release_id": "r" * 200, "prompt_token_ids": [0],
                     "token_ids": [2**31 - 1], "logprobs": [-0.5], "created_at": 0,
                     "reports": [{"score": 1, "source": "s" * 40}]}, "line 1", "s")
    rec = got["record"]
    assert (rec.model, rec.release_id, rec.prompt_token_ids, rec.token_ids, rec.logprobs, rec.created_at) == (
        "m" * 200, "r" * 200, [0], [2**31 - 1], [-0.5], 0.0)
    assert got["reports"][0]["source"] == "s" * 40
    soon = time.time() + CLOCK_SKEW_S - 60
    assert from_line({**_LINE, "created_at": soon}, "l", "s")["record"].created_at == soon
    e = _refused({**_LINE, "created_at": time.time() + CLOCK_SKEW_S + 60})
    assert "is in the future" in e.message and "milliseconds" not in e.message
    for status in ("incomplete", "error", "cancelled"):
        bare = from_line({"status": status}, "l", "s")["record"]
        assert (bare.status, bare.request) == (status, None) and bare.response == {"reef_import": {
            "format": "openai-chat", "completion": None}}


def test_an_imported_line_becomes_a_chat_exchange_with_its_reports_keyed_by_its_receipt() -> None:
    """Bugs caught: the defaults (status complete, model ``imported``, format openai-chat, the line's scenario
    else the batch's) lost, the answer not the completion's last assistant message, the tools dropped from the
    request, an id-less line's id not from its content (or from another part of it), a report per ``score`` not
    made, the report keys not ``import:<id>`` then ``:1``, ``:2``..., the time not kept."""
    from daemon.export import from_line

    got = from_line({**_LINE, "completion": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "content": "a.py", "tool_call_id": "c1"}, {"role": "assistant", "content": "done"}],
        "tools": '[{"type":"function","function":{"name":"ls","parameters":{}}}]', "score": 0.25,
        "feedback": "slow", "created_at": 12.5}, "line 1", "dflt")
    rec = got["record"]
    assert (rec.scenario, rec.status, rec.model, rec.format, rec.engine, rec.created_at) == (
        "dflt", "complete", "imported", "openai-chat", "import", 12.5)
    assert rec.request == {"model": "imported", "messages": _LINE["prompt"],
                           "tools": [{"type": "function", "function": {"name": "ls", "parameters": {}}}]}
    assert rec.response["choices"][0]["message"] == {"role": "assistant", "content": "done"}
    assert rec.response["reef_import"]["format"] == "openai-chat" and rec.id.startswith("rec_imp_")
    assert got["reports"] == [{"score": 0.25, "feedback": "slow", "source": "import", "report_id": f"import:{rec.id}"}]
    same = from_line({**_LINE, "scenario": "dflt"}, "l", "other")["record"].id
    assert same == from_line(dict(_LINE), "l", "dflt")["record"].id  # the same content in the same scenario
    assert same != from_line(dict(_LINE), "l", "other")["record"].id
    assert same != from_line({**_LINE, "completion": [{"role": "assistant", "content": "no"}]}, "l", "dflt")[
        "record"].id
    assert same != from_line({**_LINE, "prompt": [{"role": "user", "content": "hey"}]}, "l", "dflt")["record"].id
    three = from_line({**_LINE, "id": "rec_x", "reports": [{"score": 1}, {"feedback": "f"}, {"score": 0,
                                                                                             "source": "me"}]},
                      "l", "s")
    assert [r["report_id"] for r in three["reports"]] == ["import:rec_x", "import:rec_x:1", "import:rec_x:2"]
    assert three["reports"][2] == {"score": 0.0, "feedback": None, "source": "me", "report_id": "import:rec_x:2"}
    assert from_line(dict(_LINE), "l", "s")["reports"] == []
    only_tools = from_line({**_LINE, "completion": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}],
        "format": "anthropic"}, "l", "s")["record"]
    assert only_tools.response["reef_import"]["format"] == "anthropic"


def test_a_messages_line_is_split_after_its_last_user_message() -> None:
    """Bugs caught: the ``messages`` shape not read, or read when ``prompt`` is there too, an empty list taken."""
    from daemon.export import from_line

    msgs = [*_LINE["prompt"], *_LINE["completion"]]
    rec = from_line({"messages": msgs}, "l", "s")["record"]
    assert rec.request["messages"] == _LINE["prompt"]
    assert rec.response["reef_import"]["completion"] == _LINE["completion"]
    assert _refused({"messages": []}).param == "messages"
    assert _refused({"messages": "hi"}).param == "messages"
    assert _refused({"messages": [{"role": "x"}]}).param.startswith("messages[0]")
    both = from_line({**_LINE, "messages": [{"role": "user", "content": "other"}]}, "l", "s")["record"]
    assert both.request["messages"] == _LINE["prompt"]
    failed = from_line({"status": "error", "prompt": _LINE["prompt"], "messages": [{"role": "user", "content": "o"}]},
                       "l", "s")["record"]
    assert failed.request["messages"] == _LINE["prompt"]  # a prompt alone is the prompt-completion shape too


def test_an_export_line_imported_and_exported_again_is_the_same() -> None:
    """``to_line`` of what ``from_line`` made: the line's fields, its format, its whole completion, its tools as
    JSON text, the last scored report's score and its label, each report's source. Bugs caught: any field lost or
    renamed on the way, the score of the first report, unscored reports counted, the label's 0.5 moved."""
    from daemon.export import from_line, to_line

    line = {"id": "rec_rt", "scenario": "s", "run": "run-1", "created_at": 100.0, "model": "smollm2",
            "release_id": "rel_1", "format": "openai-responses", "status": "complete", **_LINE,
            "tools": '[{"type":"function","function":{"name":"ls","description":"list","parameters":{}}}]',
            "score": 0.5, "label": True, "reports": [{"score": 0.0, "feedback": None, "source": None},
                                                     {"score": 0.5, "feedback": "better", "source": "me"},
                                                     {"score": None, "feedback": "note", "source": None}],
            "prompt_token_ids": [1, 2], "token_ids": [3], "logprobs": [-0.1]}
    got = from_line(line, "l", "dflt")
    rec = dataclasses.asdict(got["record"])
    rec["reports"] = [{"report": {k: v for k, v in r.items() if k != "report_id"} | {
        "metadata": {"source": r["source"]}}} for r in got["reports"]]
    assert to_line(rec) == line
    assert to_line({**rec, "reports": [{"report": {"score": 1}}, {"report": "junk"}, {"x": 1}]})["score"] == 1.0


def test_more_bounds_and_forms_an_import_takes() -> None:
    """A one-character model, release id or source; a report of a score alone or of feedback alone; a score given
    as another float object equal to its report's; 300 tokens with 300 log-probs; the time 1e11 refused without the
    milliseconds hint and one second more with it; an id-less line's id the same whatever its keys' order, 32 hex
    digits of its hash; the answer the last assistant message even behind a tool result; the stored exchange at
    index 0 and kept for training. Bugs caught: ``1 <`` for ``0 <`` on each name, ``or`` for ``and`` on a report
    without both, ``is not`` for ``!=`` on the scores and the log-probs' count, the 1e11 bound moved or made ``>=``,
    the id's hash taken of unsorted keys or cut at 31 or 33, the answer taken from any role, ``capture`` off."""
    from daemon.export import from_line

    one = from_line({**_LINE, "model": "m", "release_id": "r", "reports": [{"score": 1, "source": "a"}]}, "l", "s")
    assert (one["record"].model, one["record"].release_id, one["reports"][0]["source"]) == ("m", "r", "a")
    assert [r["score"] for r in from_line({**_LINE, "score": 1}, "l", "s")["reports"]] == [1.0]
    assert [r["feedback"] for r in from_line({**_LINE, "feedback": "meh"}, "l", "s")["reports"]] == ["meh"]
    assert from_line({**_LINE, "score": float("0.5"), "reports": [{"score": 0.5}]}, "l", "s")["reports"][0][
        "score"] == 0.5
    many = from_line({**_LINE, "token_ids": list(range(300)), "logprobs": [-1.0] * 300}, "l", "s")["record"]
    assert len(many.logprobs) == 300
    assert "milliseconds" not in _refused({**_LINE, "created_at": 1e11}).message
    assert "milliseconds" in _refused({**_LINE, "created_at": 1e11 + 1}).message
    a = from_line({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant",
                                                                                   "content": "yo"}]}, "l", "s")
    b = from_line({"prompt": [{"content": "hi", "role": "user"}], "completion": [{"content": "yo",
                                                                                   "role": "assistant"}]}, "l", "s")
    assert a["record"].id == b["record"].id and len(a["record"].id) == len("rec_imp_") + 32
    calls = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    rec = from_line({**_LINE, "completion": [{"role": "assistant", "content": "", "tool_calls": calls},
                                             {"role": "tool", "content": "a.py", "tool_call_id": "c1"}]},
                    "l", "s")["record"]
    assert rec.response["choices"] == [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "", "tool_calls": calls}}]
    assert rec.capture is True


_SERVED_REQUEST = {"model": "m", "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "this"}]},
    {"role": "assistant", "content": "I will list.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": ""}}]},
    {"role": "tool", "content": "a.py", "tool_call_id": "c1"}],
    "tools": [{"type": "function", "function": {"name": "ls", "description": "liste les fichiers é",
                                                "parameters": {"type": "object"}}}]}


def _served(**over: Any) -> dict[str, Any]:
    return {"id": "rec_s", "scenario": "s", "format": "openai-chat", "engine": "vllm", "request": _SERVED_REQUEST,
            "response": {"id": "x", "object": "chat.completion", "model": "m", "choices": [{
                "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": ""}}]}}],
                "reef": {"receipt": "rec_s"}}, **over}


def test_a_served_exchange_is_exported_as_chat_messages_with_its_tools_and_answer() -> None:
    """Text parts joined and images left out, an assistant's calls as ``tool_calls`` (empty arguments as ``{}``), a
    tool result as a ``tool`` message, the tools as JSON text that keeps its non-ASCII, the answer's calls. Bugs
    caught: parts picked by order instead of their type, a tool result or a call lost or doubled, a message with
    only results written twice, ``null`` content, the text escaped, the ``reef`` key not dropped before parsing."""
    from daemon.export import to_line

    line = to_line(_served())
    assert line["prompt"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "look: this"},
        {"role": "assistant", "content": "I will list.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "content": "a.py", "tool_call_id": "c1"}]
    assert line["tools"] == ('[{"type":"function","function":{"name":"ls","description":"liste les fichiers é",'
                             '"parameters":{"type":"object"}}}]')
    assert line["completion"] == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": "{}"}}]}]
    plain = to_line(_served(response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}))
    assert plain["completion"] == [{"role": "assistant", "content": "ok"}]


def test_a_failed_or_unreadable_exchange_is_exported_without_what_it_lacks() -> None:
    """A failure stored as ``{error, partial}`` gives its partial answer; an error beside other keys (a Responses
    body) is read as the body; no partial, a response that is no object or does not parse, a request that does not
    parse, an unknown format: None there, never an exception. Bugs caught: each of those checks inverted or
    dropped (``or`` for ``and``, ``==`` or ``>=`` for ``<=`` on the failure's keys), an exception let out."""
    from daemon.export import to_line

    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "half"}}]}
    got = to_line(_served(status="error", response={"error": {"message": "cut"}, "partial": answer}))
    assert got["completion"] == [{"role": "assistant", "content": "half"}]
    only = to_line(_served(status="error", response={"error": {"message": "cut"}}))
    assert only["completion"] is None and only["prompt"] is not None
    assert to_line(_served(response={"error": "x", "partial": "not an object"}))["completion"] is None
    # an error beside other keys is a body, not serving's failure (a chat body with an error does not parse)
    assert to_line(_served(response={**answer, "error": {"m": 1}, "partial": answer}))["completion"] is None
    assert to_line(_served(response={"partial": answer}))["completion"] is None  # no error: no failure
    clean = to_line(_served(response={**answer, "error": None}))
    assert clean["completion"] == [{"role": "assistant", "content": "half"}]
    for response in ("text", None, {"choices": "nope"}):
        assert to_line(_served(response=response))["completion"] is None, response
    bad = to_line(_served(request={"model": "m", "messages": [{"role": "wizard"}]}))
    assert bad["prompt"] is None and bad["tools"] is None and bad["completion"] is not None
    assert to_line(_served(request="not an object"))["prompt"] is None
    unknown = to_line(_served(format="smoke"))
    assert (unknown["prompt"], unknown["completion"], unknown["format"]) == (None, None, "smoke")
    for completion in (None, [], "x", [{"role": "wizard"}]):
        imported = {"id": "rec_i", "scenario": "s", "format": "openai-chat", "engine": "import",
                    "response": {"reef_import": {"format": "openai-chat", "completion": completion}}}
        assert to_line(imported)["completion"] is None, completion
    not_import = to_line(_served(response={**answer, "reef_import": {"format": "anthropic"}}))
    assert not_import["format"] == "openai-chat" and not_import["completion"] == [
        {"role": "assistant", "content": "half"}]


def test_the_export_renders_each_record_as_one_line_in_order() -> None:
    """Bugs caught: the records taken from the wrong end or the wrong one of a pair, a line without its newline,
    the loop not run."""
    import json as _json

    from daemon.export import render_lines, to_line

    recs = [_served(id="rec_1"), _served(id="rec_2"), _served(id="rec_3")]
    want = [to_line(r) for r in recs]
    out = render_lines(list(recs))
    assert out.endswith(b"\n") and [_json.loads(x) for x in out.decode().splitlines()] == want
    assert render_lines([]) == b""


def test_an_answers_tool_call_keeps_its_arguments() -> None:
    """Bug caught: ``and`` for ``or`` (every call's arguments written as ``{}``)."""
    from daemon.export import to_line

    call = {"id": "c", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}
    resp = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}
    got = to_line({"id": "r", "scenario": "s", "format": "openai-chat", "request": None, "response": resp})
    assert got["completion"] == [{"role": "assistant", "content": "", "tool_calls": [call]}]
