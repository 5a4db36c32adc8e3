"""Data out and back: ``export -> import -> export`` gives the same bytes for exchanges of every wire format (OpenAI
chat, Anthropic, Responses) and every status (complete, incomplete, error, cancelled), with tools, tool calls and
tool results, several reports and token ids; an imported multi-message completion is kept whole; a Responses
exchange exports its answer; the export's shapes are the ones TRL documents, read by ``datasets.load_dataset`` from
JSON Lines and Parquet, and accepted by TRL's data utilities as they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon

CHAT_BODY = {"model": "tiny", "max_tokens": 8, "messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
    {"role": "user", "content": "and now?"}],
    "tools": [{"type": "function", "function": {"name": "ls", "description": "list files", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]}


def bodies(fmt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A request and its answer in ``fmt``, made by that format's own renderers from one conversation."""
    from daemon.exchange import Completion, ToolCall
    from daemon.protocols import openai_chat
    from daemon.protocols.formats import FORMATS

    wire = FORMATS[fmt]
    ex = openai_chat.parse_request(CHAT_BODY)
    request = wire.render_request(ex, model="tiny", stream=False)
    ex = wire.parse_request(request)
    answer = Completion(text="b.py is new", tool_calls=[ToolCall(id="call_2", name="ls", arguments="{}")],
                        stop_reason="tool_calls", model="tiny")
    return request, wire.render_response(ex, answer, response_id="x_1", created=1_700_000_000, receipt=None)


def stored(fmt: str, status: str, i: int) -> Any:
    from daemon.records import ExchangeRecord

    request, response = bodies(fmt)
    outcome: dict[str, Any] = {"response": response, "token_ids": [5, 6, 7], "logprobs": [-0.5, -1.25, -2.0],
                               "prompt_token_ids": [1, 2, 3, 4]}
    if status == "error":
        outcome = {"response": {"error": {"type": "upstream_error", "message": "boom"}, "partial": None}}
    elif status == "incomplete":  # a stream whose client left before the answer was stored
        outcome = {"response": None}
    return ExchangeRecord(id=f"rec_{fmt}_{status}_{i}", scenario="rt", run="run_a", format=fmt, engine="transformers",
                          model="tiny", release_id="ab" * 20, status=status, request=request,
                          created_at=1_700_000_000.0 + i + 0.25, **outcome)


IMPORTED = {"id": "rec_multi", "scenario": "rt", "prompt": [{"role": "user", "content": "fix the test"}],
            "completion": [
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"pytest\"}"}}]},
                {"role": "tool", "content": "1 failed", "tool_call_id": "c1"},
                {"role": "assistant", "content": "fixed: the off-by-one in range()"}],
            "score": 1, "created_at": 1_700_000_100.5}


async def export_all(store: Any) -> bytes:
    from daemon.export import render_lines

    out, after = b"", 0
    while after is not None:
        page, after = await store.export_page(scenario=None, since=None, after=after, limit=3)
        out += render_lines(page)
    return out


async def import_lines(store: Any, data: bytes) -> dict[str, int]:
    from daemon.export import from_line

    items = [from_line(json.loads(x), f"line {i}", "imported", index=i)
             for i, x in enumerate(data.splitlines())]
    counts, _ = await store.import_exchanges(items)
    return counts


async def test_export_import_export_is_byte_stable_on_every_format_and_status(tmp_path: Path) -> None:
    from daemon.records import open_store

    first = open_store(str(tmp_path / "a.sqlite3"))
    second = open_store(str(tmp_path / "b.sqlite3"))
    third = open_store(str(tmp_path / "c.sqlite3"))
    try:
        i = 0
        for fmt in ("openai-chat", "anthropic", "openai-responses"):
            for status in ("complete", "incomplete", "error", "cancelled"):
                await first.append_exchange(stored(fmt, status, i))
                i += 1
        await first.append_report(scenario="rt", score=0.2, feedback="meh", references=["rec_anthropic_complete_4"],
                                  metadata=None, report_id=None)
        await first.append_report(scenario="rt", score=0.9, feedback=None, references=["rec_anthropic_complete_4"],
                                  metadata={"source": "judge", "judge": "j"}, report_id=None)
        await first.append_report(scenario="rt", score=None, feedback={"why": "slow"},
                                  references=["rec_openai-chat_cancelled_3"], metadata=None, report_id=None)
        assert await import_lines(first, (json.dumps(IMPORTED) + "\n").encode()) == {
            "imported": 1, "skipped": 0, "reports": 1}
        out1 = await export_all(first)
        lines = {x["id"]: x for x in map(json.loads, out1.splitlines())}
        assert len(lines) == 13
        # what each line says
        for fmt in ("openai-chat", "anthropic", "openai-responses"):
            done = next(x for x in lines.values() if x["format"] == fmt and x["status"] == "complete")
            assert done["completion"] == [{"role": "assistant", "content": "b.py is new", "tool_calls": [
                {"id": "call_2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}], fmt
            assert done["prompt"][3] == {"role": "tool", "content": "a.py\nb.py", "tool_call_id": "call_1"}, fmt
            assert done["prompt"][2]["tool_calls"][0]["function"]["name"] == "ls", fmt
            assert json.loads(done["tools"])[0]["function"]["name"] == "ls", fmt
            assert done["token_ids"] == [5, 6, 7] and done["logprobs"] == [-0.5, -1.25, -2.0]
            assert next(x for x in lines.values() if x["format"] == fmt and x["status"] == "error")["completion"] \
                is None
        assert lines["rec_multi"]["completion"] == IMPORTED["completion"]  # the whole completion, not its last
        assert lines["rec_anthropic_complete_4"]["score"] == 0.9
        assert [r["source"] for r in lines["rec_anthropic_complete_4"]["reports"]] == [None, "judge"]
        # out and back, twice: the same bytes
        assert await import_lines(second, out1) == {"imported": 13, "skipped": 0, "reports": 4}
        out2 = await export_all(second)
        assert out2 == out1
        await import_lines(third, out2)
        assert await export_all(third) == out1
    finally:
        for s in (first, second, third):
            s.close()


def test_a_responses_exchange_exports_its_answer_through_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    """Served for real: a Responses answer body has ``"error": null``, which the export took for a failure."""
    with daemon.http() as c:
        r = c.post("/s/rt-resp/v1/responses", json={"model": "tiny", "max_output_tokens": 3, "input": "hi"})
        assert r.status_code == 200, r.text
        text = "".join(p["text"] for item in r.json()["output"] if item["type"] == "message"
                       for p in item["content"])
    out = tmp_path / "resp.jsonl"
    daemon.cli("records", "export", "-s", "rt-resp", "-o", str(out))
    line = json.loads(out.read_text())
    assert line["completion"] == [{"role": "assistant", "content": text}], line


@pytest.mark.parametrize(("change", "param"), [
    ({"prompt": [{"role": "user", "content": "ls"}, {"role": "tool", "content": "a.py"}]}, "items[0].prompt[1]."
     "tool_call_id"),
    ({"status": "paused"}, "items[0].status"),
    ({"status": "complete", "completion": None}, "items[0].completion"),
    ({"format": "gemini"}, "items[0].format"),
    ({"token_ids": [1, -2]}, "items[0].token_ids"),
    ({"token_ids": [1, 2], "logprobs": [-1.0]}, "items[0].logprobs"),
    ({"reports": [{"score": "x"}]}, "items[0].reports[0].score"),
    ({"reports": [{"score": 0.2}], "score": 0.9}, "items[0].score"),
    ({"tools": "{not json"}, "items[0].tools"),
])
def test_an_import_line_is_checked_field_by_field(change: dict[str, Any], param: str) -> None:
    from daemon.errors import BadRequest
    from daemon.export import from_line

    line = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    with pytest.raises(BadRequest) as e:
        from_line({**line, **change}, "line 1", "s", index=0)
    assert e.value.param == param, e.value.message


def test_a_failed_exchange_without_an_answer_imports() -> None:
    from daemon.export import from_line

    got = from_line({"status": "error", "prompt": None, "completion": None}, "line 1", "s")
    assert got["record"].status == "error" and got["reports"] == []
