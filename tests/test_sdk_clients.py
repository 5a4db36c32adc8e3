"""The official ``openai`` and ``anthropic`` SDKs against a real daemon, over TCP and over the Unix socket,
streaming and not, for all three APIs: each answer carries a receipt, and a report on it shows in the CLI."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from tests.conftest import Daemon

TRANSPORTS = ["tcp", "unix"]
_open: list[Any] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Any:
    yield
    while _open:
        _open.pop().close()


def openai_client(d: Daemon, transport: str, base: str = "/v1") -> openai.OpenAI:
    if transport == "tcp":
        client = openai.OpenAI(base_url=d.url + base, api_key=d.token, max_retries=0)
    else:
        http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(d.socket_path)))
        client = openai.OpenAI(base_url="http://localhost" + base, api_key="unused", http_client=http, max_retries=0)
    _open.append(client)
    return client


def anthropic_client(d: Daemon, transport: str, base: str = "") -> anthropic.Anthropic:
    if transport == "tcp":
        client = anthropic.Anthropic(base_url=d.url + base, api_key=d.token, max_retries=0)
    else:
        http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(d.socket_path)))
        client = anthropic.Anthropic(base_url="http://localhost" + base, api_key="unused", http_client=http,
                                     max_retries=0)
    _open.append(client)
    return client


def extra(obj: Any, name: str) -> Any:
    return (getattr(obj, "model_extra", None) or {}).get(name)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_chat_completions(daemon: Daemon, transport: str) -> None:
    client = openai_client(daemon, transport)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "say hi"}], max_tokens=8, seed=1
    )
    completion = raw.parse()
    receipt = raw.headers["x-reef-agent-record-id"]
    assert receipt.startswith("rec_")
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens >= 1
    rec = daemon.cli("records", "show", receipt, "--json")
    assert json.loads(rec.stdout)["response"]["choices"][0]["message"]["content"] == completion.choices[0].message.content

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "say hi"}], max_tokens=8, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    receipts = [extra(c, "reef") for c in chunks if extra(c, "reef")]
    assert len(receipts) == 1 and receipts[0]["record_id"].startswith("rec_")
    stored = json.loads(daemon.cli("records", "show", receipts[0]["record_id"], "--json").stdout)
    assert stored["response"]["choices"][0]["message"]["content"] == text
    assert stored["token_ids"] and len(stored["logprobs"]) == len(stored["token_ids"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_responses(daemon: Daemon, transport: str) -> None:
    client = openai_client(daemon, transport)
    raw = client.responses.with_raw_response.create(model="tiny", input="say hi", max_output_tokens=8)
    resp = raw.parse()
    assert raw.headers["x-reef-agent-record-id"].startswith("rec_")
    assert resp.status in ("completed", "incomplete")  # incomplete: the token limit was reached, as OpenAI says
    events = list(client.responses.create(model="tiny", input="say hi", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    done = events[-1]
    assert extra(done, "reef")["record_id"].startswith("rec_")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.response.output_text == deltas


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_messages(daemon: Daemon, transport: str) -> None:
    client = anthropic_client(daemon, transport)
    raw = client.messages.with_raw_response.create(
        model="tiny", max_tokens=8, system="be brief", messages=[{"role": "user", "content": "say hi"}]
    )
    msg = raw.parse()
    assert raw.headers["x-reef-agent-record-id"].startswith("rec_")
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")

    # raw events: the receipt rides on message_stop
    events = list(client.messages.create(model="tiny", max_tokens=8, stream=True,
                                         messages=[{"role": "user", "content": "say hi"}]))
    stop = [e for e in events if e.type == "message_stop"]
    assert len(stop) == 1 and extra(stop[0], "reef")["record_id"].startswith("rec_")
    # the SDK's stream helper rebuilds message_stop; its response headers carry the receipt
    with client.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "say hi"}]) as s:
        final = s.get_final_message()
        receipt = s.response.headers["x-reef-agent-record-id"]
    text = "".join(b.text for b in final.content if b.type == "text")
    stored = json.loads(daemon.cli("records", "show", receipt, "--json").stdout)
    assert "".join(b["text"] for b in stored["response"]["content"] if b["type"] == "text") == text

    # Claude Code sends ?beta=true; count_tokens and models work too
    beta = client.beta.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert beta.role == "assistant"
    assert client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    assert "tiny" in [m.id for m in client.models.list()]


def test_models_for_openai(daemon: Daemon) -> None:
    assert "tiny" in [m.id for m in openai_client(daemon, "tcp").models.list()]


def test_report_by_receipt_shows_in_records_show(daemon: Daemon) -> None:
    client = openai_client(daemon, "tcp", base="/s/reports-demo/r/run-1/v1")
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=4
    )
    receipt = raw.headers["x-reef-agent-record-id"]
    out = daemon.cli("report", receipt, "--score", "0.5", "--feedback", "missed the empty-token case")
    assert "stored" in out.stdout
    rec = json.loads(daemon.cli("records", "show", receipt, "--json").stdout)
    assert rec["scenario"] == "reports-demo" and rec["run"] == "run-1"
    assert rec["reports"][0]["report"]["score"] == 0.5
    assert rec["reports"][0]["report"]["feedback"] == "missed the empty-token case"
    listed = json.loads(daemon.cli("records", "list", "--scenario", "reports-demo", "--json").stdout)
    assert listed[0]["id"] == receipt and listed[0]["score"] == 0.5
    human = daemon.cli("records", "show", receipt).stdout
    assert "missed the empty-token case" in human


def test_scenario_and_run_from_headers(daemon: Daemon) -> None:
    client = openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0,
        default_headers={"x-reef-scenario": "hdr-scen", "x-reef-run": "r-42"},
    )
    _open.append(client)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    rec = json.loads(daemon.cli("records", "show", raw.headers["x-reef-agent-record-id"], "--json").stdout)
    assert (rec["scenario"], rec["run"]) == ("hdr-scen", "r-42")
    assert "authorization" not in rec["headers"] and daemon.token not in json.dumps(rec)
