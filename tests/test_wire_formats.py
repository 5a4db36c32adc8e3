"""The three provider formats are one interface (``daemon.protocols.base.WireFormat``): each module has every
member, each member does its part of a round trip, and a format missing a member is caught, by ``isinstance`` at
run time and by mypy where the formats are listed (``daemon/protocols/formats.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import BadRequest
from daemon.exchange import Completion, Receipt, TextDelta, ToolCall, ToolCallDelta, ToolCallStart, Usage
from daemon.protocols import anthropic, formats, openai_chat, openai_responses
from daemon.protocols.base import WireFormat
from daemon.protocols.sse import SSEDecoder

ROOT = Path(__file__).resolve().parent.parent
MODULES = {"openai-chat": openai_chat, "openai-responses": openai_responses, "anthropic": anthropic}
REQUESTS: dict[str, dict[str, Any]] = {  # the smallest request of each format: one user turn, "hi"
    "openai-chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "openai-responses": {"model": "m", "input": "hi"},
    "anthropic": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
}
RECEIPT = Receipt("rec_wire", "rel_wire")
MEMBERS = sorted(name for name in vars(WireFormat) if not name.startswith("_"))


def test_the_interface_names_what_serving_and_the_upstream_engine_use() -> None:
    assert MEMBERS == sorted(["FORMAT", "PATH", "ID_PREFIX", "parse_request", "render_response", "StreamRenderer",
                              "relay_finish", "error_body", "render_request", "parse_response", "StreamParser"])


@pytest.mark.parametrize("name", MODULES)
def test_each_format_module_is_a_wire_format(name: str) -> None:
    module = MODULES[name]
    assert isinstance(module, WireFormat)
    assert formats.FORMATS[name] is module and module.FORMAT == name
    for member in MEMBERS:
        assert hasattr(module, member), f"{name} lacks {member}"
    # the route a format is served on, with or without a scenario/run prefix, answers (and errs) in that format
    for prefix in ("", "/s/scen", "/s/scen/r/run1"):
        assert formats.for_path(prefix + module.PATH) is module
    assert formats.for_path("/reef/status") is None


@pytest.mark.parametrize("member", MEMBERS)
def test_a_format_missing_a_member_is_not_a_wire_format(member: str) -> None:
    partial = types.ModuleType("partial_format")
    partial.__dict__.update({k: v for k, v in vars(openai_chat).items() if k != member})
    assert not isinstance(partial, WireFormat)
    whole = types.ModuleType("whole_format")
    whole.__dict__.update(vars(openai_chat))
    assert isinstance(whole, WireFormat)


def test_mypy_refuses_a_format_missing_a_member_or_with_one_of_another_shape(tmp_path: Path) -> None:
    """What ``daemon/protocols/formats.py`` does for the three modules, done for two broken ones: one without
    ``error_body``, one whose ``parse_request`` takes another argument. mypy refuses both."""
    kept = [m for m in MEMBERS if m != "error_body"]
    (tmp_path / "missing_format.py").write_text(f"from daemon.protocols.openai_chat import {', '.join(kept)}\n")
    others = [m for m in MEMBERS if m != "parse_request"]
    (tmp_path / "misshapen_format.py").write_text(textwrap.dedent(f"""\
        from daemon.exchange import Exchange
        from daemon.protocols.openai_chat import {', '.join(others)}


        def parse_request(body: object, strict: bool) -> Exchange:
            raise NotImplementedError
        """))
    (tmp_path / "listed.py").write_text(textwrap.dedent("""\
        import missing_format
        import misshapen_format
        from daemon.protocols import openai_chat
        from daemon.protocols.base import WireFormat

        GOOD: WireFormat = openai_chat
        MISSING: WireFormat = missing_format
        MISSHAPEN: WireFormat = misshapen_format
        """))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(tmp_path / "listed.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={"PATH": "/usr/bin:/bin", "MYPYPATH": f"{ROOT}:{tmp_path}"},
    )
    assert "No module named mypy" not in out.stderr
    lines = out.stdout.splitlines()
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [line for line in lines if ": error:" in line]
    # one error each for the broken two (line 7: no error_body; line 8: parse_request of another shape), none for
    # the real module they were made from (line 6)
    assert len(errors) == 2 and "listed.py:7:" in errors[0] and "listed.py:8:" in errors[1], out.stdout
    assert all('variable has type "WireFormat"' in e for e in errors), out.stdout


def _completion(calls: bool = False) -> Completion:
    tool_calls = [ToolCall("call_1", "read", '{"path":"a.txt"}')] if calls else []
    return Completion(text="hello", tool_calls=tool_calls, stop_reason="tool_calls" if calls else "stop",
                      usage=Usage(input_tokens=3, output_tokens=2), model="m")


def _frames(payload: bytes) -> list[tuple[str | None, str]]:
    decoder = SSEDecoder()
    return decoder.feed(payload) + decoder.close()


@pytest.mark.parametrize("name", MODULES)
def test_a_round_trip_through_each_format(name: str) -> None:
    """Request in, whole answer out and read back, stream out and read back, error shaped: each by the format's
    own members, as serving and the upstream engine call them."""
    wire: WireFormat = formats.FORMATS[name]
    ex = wire.parse_request(REQUESTS[name])
    assert ex.format == name and [(m.role, m.text) for m in ex.messages] == [("user", "hi")]
    with pytest.raises(BadRequest):
        wire.parse_request({"model": "m"})

    # whole: rendered with the receipt, read back to the same completion
    body = wire.render_response(ex, _completion(calls=True), response_id=wire.ID_PREFIX + "1", created=1,
                                receipt=RECEIPT)
    assert body["reef"] == RECEIPT.to_dict() and str(body["id"]).startswith(wire.ID_PREFIX)
    back = wire.parse_response(body)
    assert back.text == "hello" and [(c.id, c.name, c.arguments) for c in back.tool_calls] == [
        ("call_1", "read", '{"path":"a.txt"}')]

    # streamed: the renderer's frames, parsed by the format's own stream parser, are the same completion
    renderer = wire.StreamRenderer(ex, response_id=wire.ID_PREFIX + "2", created=1)
    out = renderer.start()
    for ev in (TextDelta("hel"), TextDelta("lo"), ToolCallStart(0, "call_1", "read"),
               ToolCallDelta(0, '{"path":"a.txt"}')):
        out += renderer.event(ev)
    out += renderer.finish(_completion(calls=True), RECEIPT)
    parser = wire.StreamParser()
    for event, data in _frames(b"".join(out)):
        parser.feed(event, data)
    assert parser.done
    streamed = parser.finish()
    assert streamed.text == "hello" and [(c.name, c.arguments) for c in streamed.tool_calls] == [
        ("read", '{"path":"a.txt"}')]
    assert RECEIPT.record_id in b"".join(out).decode()

    # a relayed stream's held-back final event gets the receipt
    relayed = b"".join(wire.relay_finish((None, '{"type": "x"}'), RECEIPT)).decode()
    assert RECEIPT.record_id in relayed

    # an error, in the format's own shape; a stream that fails ends with it
    err = BadRequest("no such thing")
    assert "no such thing" in str(wire.error_body(err))
    assert "no such thing" in b"".join(renderer.error(err)).decode()


@pytest.mark.parametrize("source", MODULES)
@pytest.mark.parametrize("target", MODULES)
def test_a_request_goes_out_in_any_format_and_reads_back(source: str, target: str) -> None:
    """The upstream direction: a request parsed from one format, rendered as another's request, parses back to
    the same turn."""
    ex = formats.FORMATS[source].parse_request(REQUESTS[source])
    out = formats.FORMATS[target].render_request(ex, model="up", stream=False)
    again = formats.FORMATS[target].parse_request(out)
    assert again.model == "up" and [(m.role, m.text) for m in again.messages] == [("user", "hi")]
