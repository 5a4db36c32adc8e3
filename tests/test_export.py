"""Records out and in through a real daemon and the CLI: the export is the documented shape (TRL's prompt and
completion messages, score and label, token ids) in JSON Lines and Parquet, streamed page by page; an import is
idempotent by id, atomic per batch, and refuses malformed lines by number with nothing stored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import Daemon


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
    assert json.loads(table[0]["prompt"]) == first["prompt"] and table[0]["score"] == 0.9
    assert list(table[0]["token_ids"]) == first["token_ids"]
    # import into another daemon's home: the same exchanges, once however often it runs
    d2: Daemon = daemon_factory()
    got = d2.cli("records", "import", str(out), "--scenario", "moved", "--json")
    assert json.loads(got.stdout) == {"imported": 5, "skipped": 0, "reports": 1}
    again = d2.cli("records", "import", str(out), "--json")
    assert json.loads(again.stdout) == {"imported": 0, "skipped": 5, "reports": 0}
    round_trip = tmp_path / "back.jsonl"
    d2.cli("records", "export", "-o", str(round_trip))
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
            await store.append_exchange(ExchangeRecord(id=f"rec_{i}", scenario="s", request={}, response={}))
        seen, after, pages = [], 0, 0
        while after is not None:
            page, after = await store.export_page(scenario="s", since=None, after=after, limit=2)
            seen += [r["id"] for r in page]
            pages += 1
        assert seen == [f"rec_{i}" for i in range(5)] and pages == 3
    finally:
        store.close()
