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
        page, after = await store.user_data.export_page(scenario=None, since=None, after=after, limit=3)
        out += render_lines(page)
    return out


async def import_lines(store: Any, data: bytes) -> dict[str, int]:
    from daemon.export import from_line

    items = [from_line(json.loads(x), f"line {i}", "imported", index=i)
             for i, x in enumerate(data.splitlines())]
    counts, _ = await store.user_data.import_exchanges(items)
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
                await first.exchanges.append(stored(fmt, status, i))
                i += 1
        await first.reports.append(scenario="rt", score=0.2, feedback="meh", references=["rec_anthropic_complete_4"],
                                  metadata=None, report_id=None)
        await first.reports.append(scenario="rt", score=0.9, feedback=None, references=["rec_anthropic_complete_4"],
                                  metadata={"source": "judge", "judge": "j"}, report_id=None)
        await first.reports.append(scenario="rt", score=None, feedback={"why": "slow"},
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


def serve_three(c: Any, scenario: str) -> list[str]:
    """An exchange of each wire format, the chat one with tools and a tool result in its history."""
    got = []
    r = c.post(f"/s/{scenario}/v1/chat/completions", json={**CHAT_BODY, "max_tokens": 3})
    got.append(r)
    got.append(c.post(f"/s/{scenario}/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "user", "content": "question two"}]}))
    got.append(c.post(f"/s/{scenario}/v1/responses", json={"model": "tiny", "max_output_tokens": 3, "input": "three"}))
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    return [r.headers["x-reef-agent-record-id"] for r in got]


def test_both_files_load_with_datasets_in_trl_shapes_and_trl_takes_a_row(daemon: Daemon, tmp_path: Path) -> None:
    """The export files as a TRL user meets them: ``datasets.load_dataset`` reads the JSON Lines and the Parquet
    file of each shape into the same typed columns (messages as lists of dicts, a float score, a bool label only
    where scored, the tools as JSON text), and TRL's data utilities take a row as it is."""
    import datasets
    from transformers import AutoTokenizer
    from trl.data_utils import apply_chat_template, is_conversational

    with daemon.http() as c:
        chat_id, anthropic_id, responses_id = serve_three(c, "rt-trl")
        assert c.post("/reef/report", json={"references": [chat_id], "score": 1}).status_code == 201
        assert c.post("/reef/report", json={"references": [anthropic_id], "score": 0.25}).status_code == 201
    datasets.disable_progress_bars()
    for shape in ("prompt-completion", "messages"):
        loaded = {}
        for fmt, ext in (("jsonl", "json"), ("parquet", "parquet")):
            path = tmp_path / f"{shape}.{fmt}"
            daemon.cli("records", "export", "-s", "rt-trl", "--format", fmt, "--shape", shape, "-o", str(path))
            ds = datasets.load_dataset(ext, data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
            assert ds.num_rows == 3, (shape, fmt)
            assert ds.features["score"].dtype in ("float64", "double")
            assert ds.features["label"].dtype == "bool" if shape == "prompt-completion" else "label" not in ds.features
            loaded[fmt] = ds
            rows = {r["id"]: r for r in ds}
            assert [rows[i]["score"] for i in (chat_id, anthropic_id, responses_id)] == [1.0, 0.25, None]
            if shape == "prompt-completion":
                assert [rows[i]["label"] for i in (chat_id, anthropic_id, responses_id)] == [True, False, None]
            assert json.loads(rows[chat_id]["tools"])[0]["function"]["name"] == "ls"
            assert rows[anthropic_id]["tools"] is None
            row = rows[chat_id]
            talk = row["messages"] if shape == "messages" else row["prompt"] + row["completion"]
            assert [m["role"] for m in talk] == ["system", "user", "assistant", "tool", "user", "assistant"]
            assert talk[3]["tool_call_id"] == "call_1" and talk[2]["tool_calls"][0]["function"]["name"] == "ls"
            assert rows[responses_id][("messages" if shape == "messages" else "completion")][-1]["content"]
            assert is_conversational(row), (shape, fmt)
            tok = AutoTokenizer.from_pretrained(str(daemon.models.get("tiny") or _tiny_path(daemon)))
            text = apply_chat_template(row, tok, tools=json.loads(row["tools"]))
            assert any("list the files" in v for v in text.values() if isinstance(v, str)), text
        # the two files of one shape hold the same rows
        assert sorted(loaded["jsonl"]["id"]) == sorted(loaded["parquet"]["id"])


def _tiny_path(daemon: Daemon) -> str:
    import tomllib

    return str(tomllib.loads((daemon.home / "config.toml").read_text())["models"]["tiny"]["path"])


def test_a_messages_export_imports_back_with_its_completion(daemon: Daemon, tmp_path: Path) -> None:
    with daemon.http() as c:
        chat_id = serve_three(c, "rt-msg")[0]
    path = tmp_path / "m.jsonl"
    daemon.cli("records", "export", "-s", "rt-msg", "--shape", "messages", "-o", str(path))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert all("prompt" not in x and "completion" not in x for x in lines)
    import dataclasses

    from daemon.export import from_line, to_line

    item = from_line(next(x for x in lines if x["id"] == chat_id), "line 1", "s")
    back = to_line({**dataclasses.asdict(item["record"]), "reports": []})
    full = next(x for x in lines if x["id"] == chat_id)["messages"]
    assert back["prompt"] + back["completion"] == full and len(back["completion"]) == 1


def test_parquet_without_pyarrow_names_the_command_for_reefs_python(daemon: Daemon, tmp_path: Path) -> None:
    """An install that lacks pyarrow (one from before it was a dependency): the refusal names the exact command,
    with the Python that runs Reef, and exit 2; nothing is written."""
    import subprocess
    import sys

    fake = tmp_path / "fake"
    (fake / "pyarrow").mkdir(parents=True)
    (fake / "pyarrow" / "__init__.py").write_text("raise ImportError('no pyarrow here')\n")
    env = {**daemon.env, "PYTHONPATH": f"{fake}:{daemon.env['PYTHONPATH']}"}
    out = tmp_path / "x.parquet"
    got = subprocess.run([sys.executable, "-m", "reef_cli.main", "records", "export", "--format", "parquet", "-o",
                          str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stderr
    assert f"{sys.executable} -m pip install 'pyarrow>=17'" in got.stderr and not out.exists(), got.stderr


def test_token_ids_of_another_model_are_not_imported_for_learning(daemon: Daemon, tmp_path: Path) -> None:
    """Token ids are a tokenizer's: an exchange exported from another model (``model`` not the scenario's) keeps its
    text but not its ids and log-probs, so a weights recipe never trains on ids that mean other words here; the
    scenario's own model's ids are kept, and the CLI says what it dropped."""
    base = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
            "prompt_token_ids": [1, 2], "token_ids": [3, 4], "logprobs": [-0.5, -0.25], "score": 1}
    own = {**base, "id": "rec_own", "model": "tiny"}
    foreign = {**base, "id": "rec_foreign", "model": "llama-3.1-8b"}
    with daemon.http() as c:
        assert c.post("/reef/scenarios", json={"name": "tok", "model": "tiny"}).status_code in (200, 201)
        r = c.post("/reef/records/import", json={"items": [own, foreign], "scenario": "tok"})
        assert r.status_code == 201, r.text
        assert r.json()["tokens_dropped"] == 1
        kept, dropped = (c.get(f"/reef/records/{i}").json() for i in ("rec_own", "rec_foreign"))
    assert kept["token_ids"] == [3, 4] and kept["prompt_token_ids"] == [1, 2] and kept["logprobs"] == [-0.5, -0.25]
    assert dropped["token_ids"] is None and dropped["prompt_token_ids"] is None and dropped["logprobs"] is None
    assert dropped["model"] == "llama-3.1-8b" and dropped["response"]["choices"][0]["message"]["content"] == "yo"
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({**foreign, "id": "rec_foreign2"}) + "\n")
    out = daemon.cli("records", "import", str(path), "-s", "tok")
    assert "1 exchange(s) came from another model" in out.stdout, out.stdout
