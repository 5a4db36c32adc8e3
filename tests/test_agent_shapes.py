"""What real agents send (shared/CLIENTS.md), served by a real daemon: Claude Code's 80 kB streaming request,
pi's and opencode's OpenAI-format requests with tools; and several configured models, one per scenario."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import Daemon, sse_events


def tool(i: int) -> dict[str, Any]:
    return {
        "name": f"Tool{i}",
        "description": ("Performs an operation on the workspace. " * 40) + f"Variant {i}.",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Absolute path to the file " * 8},
                "pattern": {"type": "string", "description": "A regular expression " * 8},
                "limit": {"type": "integer", "minimum": 1},
                "flags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
        **({"cache_control": {"type": "ephemeral"}} if i == 23 else {}),
    }


def claude_code_body() -> dict[str, Any]:
    system_text = "You are an interactive CLI tool that helps users with software engineering tasks. " * 150
    return {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 16,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "gitStatus: clean", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "tools": [tool(i) for i in range(24)],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                {"type": "text", "text": "fix the bug in parser.py", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "look at the file", "signature": "sig"},
                {"type": "text", "text": "Reading the file."},
                {"type": "tool_use", "id": "toolu_01", "name": "Tool0", "input": {"path": "/src/parser.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "def parse(): ..."}]},
                {"type": "text", "text": "continue"}]},
            {"role": "system", "content": "The user switched to plan mode."},
            {"role": "user", "content": "now fix it"},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": json.dumps({"device_id": "abc", "session_id": "s-1"})},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "temperature": 1,
    }


def test_claude_code_request_streams_with_receipt(daemon: Daemon) -> None:
    body = claude_code_body()
    size = len(json.dumps(body))
    assert 60_000 < size < 120_000, size
    with daemon.http() as c:
        assert c.head("/").status_code == 200
        resp = c.post("/s/claude/r/cc-run/v1/messages?beta=true", json=body,
                      headers={"anthropic-version": "2023-06-01", "X-Claude-Code-Session-Id": "sess-1",
                               "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert resp.status_code == 200, resp.text[:500]
    events = sse_events(resp.text)
    kinds = [e for e, _ in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    receipt = events[-1][1]["reef"]["record_id"]
    assert resp.headers["x-reef-agent-record-id"] == receipt
    with daemon.http() as c:
        rec = c.get(f"/reef/records/{receipt}").json()
    assert rec["scenario"] == "claude" and rec["run"] == "cc-run"
    assert rec["request"]["metadata"]["user_id"] == body["metadata"]["user_id"]
    assert rec["headers"]["x-claude-code-session-id"] == "sess-1"
    assert len(rec["prompt_token_ids"]) > 5000 and rec["usage"]["input_tokens"] == len(rec["prompt_token_ids"])


def test_pi_and_opencode_style_openai_requests(daemon: Daemon) -> None:
    tools = [{"type": "function", "function": {"name": n, "description": f"{n} a file",
                                               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
             for n in ("read", "write", "edit", "bash")]
    body = {
        "model": "tiny", "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 8,
        "tools": tools, "tool_choice": "auto", "parallel_tool_calls": True, "store": False,
        "messages": [
            {"role": "system", "content": "You are pi. " * 100},
            {"role": "user", "content": [{"type": "text", "text": "say hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "file contents"},
        ],
    }
    with daemon.http() as c:
        resp = c.post("/s/pi/v1/chat/completions", json=body, headers={"session_id": "abc"})
    assert resp.status_code == 200, resp.text
    events = [d for _, d in sse_events(resp.text)]
    assert events[-1] == "[DONE]"
    assert any(isinstance(d, dict) and d.get("usage") for d in events[:-1])
    assert "reef" in events[-2]


def codex_body() -> dict[str, Any]:
    """The shape of Codex CLI 0.171.0's second request of a tool round trip (docs/agents.md), its texts shortened."""
    tool = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                           "additionalProperties": False}}
    return {
        "model": "tiny",
        "stream": True,
        "input": [
            {"type": "message", "id": "msg_1", "role": "developer",
             "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI. " * 40}]},
            {"type": "message", "id": "msg_2", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions instructions>read-only</permissions"
                                                        " instructions>"}]},
            {"type": "message", "id": "msg_3", "role": "user",
             "content": [{"type": "input_text", "text": "# AGENTS.md instructions\n\n<INSTRUCTIONS>\nrules"
                                                        "\n</INSTRUCTIONS>"}]},
            {"type": "message", "id": "msg_4", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "run it"}],
             "content": None, "encrypted_content": "gAAAAB-opaque"},
            {"type": "function_call", "status": "completed", "id": "fc_1", "name": "exec_command",
             "arguments": '{"cmd": "echo hi"}', "call_id": "call_1"},
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_1",
             "output": "Process exited with code 0\nOutput:\nhi\n"},
        ],
        "tools": [tool, {"type": "namespace", "name": "multi_agent_v1", "description": "subagents",
                         "tools": [dict(tool, name="spawn_agent")]},
                  {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a23fad-d88a-7550-949d-0aba9bfa62a5",
        "client_metadata": {"thread_id": "01a23fad-d88a-7550-949d-0aba9bfa62a5", "x-codex-window-id": "w:0"},
    }


def test_codex_style_responses_request_streams_and_keeps_its_session(daemon: Daemon) -> None:
    from daemon.sessions import session_key

    headers = {"session-id": "01a23fad-d88a", "thread-id": "01a23fad-d88a", "originator": "codex_exec",
               "x-codex-turn-metadata": json.dumps({"turn_id": "t1"}), "accept": "text/event-stream"}
    with daemon.http() as c:
        resp = c.post("/s/codex/r/cx-run/v1/responses", json=codex_body(), headers=headers)
    assert resp.status_code == 200, resp.text[:500]
    events = sse_events(resp.text)
    kinds = [e for e, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    seqs = [d["sequence_number"] for _, d in events]
    assert seqs == list(range(len(seqs)))
    receipt = events[-1][1]["reef"]["record_id"]
    with daemon.http() as c:
        rec = c.get(f"/reef/records/{receipt}").json()
    assert rec["scenario"] == "codex" and rec["run"] == "cx-run" and rec["format"] == "openai-responses"
    # the daemon's session for Codex is its session-id header (not the run): continuation is judged within it
    assert session_key(rec["headers"], rec["run"]) == "session-id=01a23fad-d88a"


def test_models_are_bound_per_scenario(daemon_factory: Any, tiny_model: Path) -> None:
    d: Daemon = daemon_factory(f'\n[models.tiny2]\nengine = "transformers"\npath = "{tiny_model}"\n')
    with d.http() as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["smollm2", "tiny", "tiny-demo", "tiny2"]  # the built-in entries, made on first use
        assert c.post("/reef/scenarios", json={"name": "second", "model": "tiny2"}).json()["model"] == "tiny2"
        bad = c.post("/reef/scenarios", json={"name": "third", "model": "nope"})
        assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]
        body = {"model": "whatever-the-client-says", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        r2 = c.post("/s/second/v1/chat/completions", json=body)
        r1 = c.post("/s/first/v1/chat/completions", json=body)
        rec2 = c.get(f"/reef/records/{r2.headers['x-reef-agent-record-id']}").json()
        rec1 = c.get(f"/reef/records/{r1.headers['x-reef-agent-record-id']}").json()
    assert rec2["model"] == "tiny2" and rec1["model"] == "tiny"
    # the scenario's model answered, and the answer says so (it echoed the client's name)
    assert r2.json()["model"] == "tiny2" and r2.headers["x-reef-model"] == "tiny2"


def test_config_errors_are_clear(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory("\n[models.bad]\nengine = \"transformers\"\nfrobnicate = 1\n", start=False)
    out = d.cli("status", check=False)
    assert out.returncode == 2 and "frobnicate" in out.stderr and "Traceback" not in out.stderr
    (d.home / "config.toml").write_text("port = [\n")
    out = d.cli("daemon", "start", check=False)
    assert out.returncode == 2 and "config.toml" in out.stderr
