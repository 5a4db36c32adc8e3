"""OpenTelemetry export (``[telemetry]``, ``daemon/telemetry.py``), against a real OTLP/HTTP receiver started here
(``tests/otlp_receiver.py``: the protobuf of the protocol, decoded) and real daemons serving the tiny model.

What each test catches:
- the spans' content: the GenAI attributes (model, tokens equal to the record's, sampling, finish reason, an error
  status on a failed exchange) and Reef's (scenario, run, release, receipt), for a stream and a whole answer, in two
  wire formats; a report's span linked to its exchanges' spans by ids derived from the receipts; no prompt, answer
  or feedback text anywhere in what was sent unless the user opted in;
- with ``content = true``: the prompt, the answer and the feedback, in the conventions' shape; and the flush at a
  stop (these spans wait an hour in the batch: only the stop's flush sends them);
- the client's W3C trace context: an exchange span in the trace of a valid ``traceparent`` (its parent, its
  ``tracestate``, its sampled flag obeyed: not sampled, not exported), whole or streamed, in two wire formats; a
  report's span linked to it there; a malformed ``traceparent`` (every way the spec refuses) ignored, the request
  answered and its span in a trace of its own; the store's read of those headers, on both backends;
- a collector that refuses, hangs or is down: every request answered while it does, its failure logged once and its
  recovery once, the exporter's own log lines kept out, the stop not held by it;
- the config: bad values refused with a clear message (in-process and by a real daemon), the environment's OTLP
  variables and their precedence, a configured exporter without OpenTelemetry installed refused at start, and a
  daemon without ``[telemetry]`` importing none of it (it starts with OpenTelemetry made unimportable).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from daemon.config import load_config
from daemon.errors import BadRequest
from daemon.telemetry import span_ids
from tests.conftest import ROOT, Daemon, assert_canonical_error, make_home, sse_events
from tests.otlp_receiver import Receiver, Span
from tests.upstream_stub import chat_stream

PROMPT = "the secret prompt zebra-quartz"  # never in a span unless content = true
FEEDBACK = "the secret feedback mango-lattice"
ERROR = 2  # the OTLP status code of an error


@pytest.fixture
def receiver() -> Any:
    r = Receiver().start()
    yield r
    r.close()


def telemetry(receiver: Receiver | None, *lines: str, **extra: Any) -> str:
    """A ``[telemetry]`` table sending to ``receiver`` (None: no endpoint in the table), with ``lines`` and ``extra``
    settings."""
    endpoint = [] if receiver is None else [f'otlp_endpoint = "{receiver.url}"']
    return "\n[telemetry]\n" + "\n".join([*endpoint, *lines, *(f"{k} = {json.dumps(v)}" for k, v in extra.items())]) \
        + "\n"


def chat(c: httpx.Client, scenario: str, *, run: str | None = None, stream: bool = False,
         text: str = PROMPT, temperature: float = 0.7) -> tuple[str, httpx.Response, Any]:
    """An OpenAI chat completion through ``/s/<scenario>[/r/<run>]``: its receipt, response and parsed body."""
    prefix = f"/s/{scenario}" + (f"/r/{run}" if run else "")
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 6,
            "temperature": temperature, "stream": stream}
    r = c.post(f"{prefix}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-reef-agent-record-id"], r, sse_events(r.text) if stream else r.json()


def messages(c: httpx.Client, scenario: str, run: str, *, stream: bool) -> str:
    """An Anthropic message (the scenario and run as headers): its receipt."""
    r = c.post("/v1/messages", headers={"x-reef-scenario": scenario, "x-reef-run": run},
               json={"model": "tiny", "max_tokens": 5, "stream": stream,
                     "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code == 200, r.text
    return r.headers["x-reef-agent-record-id"]


def check_exchange(span: Span, record: dict[str, Any], *, run: str | None) -> None:
    """The span of an exchange says what its record says."""
    a = span.attributes
    assert span.name == "chat tiny"
    assert span.kind == 2  # SPAN_KIND_SERVER
    assert (span.trace_id, span.span_id) == tuple(f"{i:0{n}x}" for i, n in zip(span_ids("exchange", record["id"]),
                                                                                (32, 16), strict=True))
    assert span.parent_span_id == ""
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == a["gen_ai.system"] == "reef"
    assert a["gen_ai.request.model"] == "tiny" and a["gen_ai.response.model"] == record["model"] == "tiny"
    assert a["gen_ai.usage.input_tokens"] == record["usage"]["input_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == record["usage"]["output_tokens"] > 0
    assert a["reef.receipt"] == record["id"]
    assert a["reef.scenario"] == record["scenario"]
    assert a.get("reef.run") == run == record["run"]
    assert a["reef.release_id"] == record["release_id"] and record["release_id"]
    assert a["reef.status"] == "complete" and span.status_code != ERROR
    assert a["gen_ai.response.finish_reasons"] in (["stop"], ["length"])
    # the span lasts from the request's arrival to its durable record: at least the record's own total time
    assert span.end_ns - span.start_ns >= record["timings"]["total_ms"] * 1e6 * 0.999
    assert span.resource["service.name"] == "reef"


def no_content(receiver: Receiver) -> None:
    for s in receiver.attempted:
        assert not {"gen_ai.input.messages", "gen_ai.output.messages", "reef.report.feedback"} & set(s.attributes)
    for body in receiver.bodies:  # nowhere in what was sent: not in any attribute, event or name
        assert PROMPT.encode() not in body and FEEDBACK.encode() not in body


def test_spans_of_exchanges_and_reports_without_content(receiver: Receiver, daemon_factory: Any) -> None:
    d = daemon_factory(telemetry(receiver, 'headers = { "x-collector-key" = "k1" }', batch_delay_s=0.05))
    with d.http() as c:
        whole, resp, _ = chat(c, "alpha", run="run-1")
        streamed, _, _ = chat(c, "alpha", run="run-1", stream=True)
        anthropic_whole = messages(c, "beta", "run-2", stream=False)
        anthropic_streamed = messages(c, "beta", "run-2", stream=True)
        failed = c.post("/s/alpha/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": PROMPT},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}]})
        assert_canonical_error(failed, 400, "openai")
        failed_receipt = failed.headers["x-reef-agent-record-id"]
        report = c.post("/reef/report", json={"score": 0.25, "feedback": FEEDBACK, "references": [whole, streamed]})
        assert report.status_code == 201, report.text
        report_id = report.json()["report_id"]
        receipts = [whole, streamed, anthropic_whole, anthropic_streamed, failed_receipt]
        receiver.wait(lambda r: all(r.span(x) for x in receipts)
                      and any(s.attributes.get("reef.report.id") == report_id for s in r.spans))
        records = {x: c.get(f"/reef/records/{x}").json() for x in receipts}

    for receipt, run in ((whole, "run-1"), (streamed, "run-1"), (anthropic_whole, "run-2"),
                         (anthropic_streamed, "run-2")):
        span = receiver.span(receipt)
        assert span is not None
        check_exchange(span, records[receipt], run=run)
    a = receiver.span(whole).attributes  # type: ignore[union-attr]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.7
    assert a["reef.format"] == "openai-chat" and receiver.span(anthropic_whole).attributes["reef.format"] == "anthropic"  # type: ignore[union-attr]
    assert resp.headers["x-reef-release-id"] == a["reef.release_id"]

    bad = receiver.span(failed_receipt)
    assert bad is not None and records[failed_receipt]["status"] == "error"
    assert bad.status_code == ERROR and "text-only" in bad.status_message
    assert bad.attributes["reef.status"] == "error" and bad.attributes["error.type"] == "invalid_request_error"
    assert "gen_ai.usage.output_tokens" not in bad.attributes

    (rep,) = [s for s in receiver.spans if s.attributes.get("reef.report.id") == report_id]
    assert rep.name == "reef report"
    assert rep.attributes["reef.report.score"] == 0.25 and rep.attributes["reef.scenario"] == "alpha"
    assert rep.attributes["reef.receipts"] == [whole, streamed]
    # linked to the very spans of the exchanges it judges, by ids any tool can derive from a receipt
    linked = {(t, s): attrs["reef.receipt"] for t, s, attrs in rep.links}
    assert linked == {(receiver.span(x).trace_id, receiver.span(x).span_id): x  # type: ignore[union-attr]
                      for x in (whole, streamed)}
    assert rep.trace_id not in {receiver.span(x).trace_id for x in receipts}  # type: ignore[union-attr]
    no_content(receiver)
    assert {h.get("x-collector-key") for h in receiver.headers} == {"k1"}
    assert {h["content-type"] for h in receiver.headers} == {"application/x-protobuf"}


class HeldUpstream:
    """An OpenAI-compatible upstream whose streamed answer (a tool call) stops after its first chunk until the test
    lets it go: an exchange still in flight when the daemon is told to stop."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.begun = threading.Event()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                frames = chat_stream("held-model", "", tool=True, usage=True)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the body ends when the connection closes
                self.wfile.write(frames[0])
                self.wfile.flush()
                upstream.begun.set()
                upstream.go.wait(120)
                self.wfile.write(b"".join(frames[1:]))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def entry(self) -> str:
        return (f'\n[models.held]\nengine = "upstream"\nurl = "http://127.0.0.1:{self.server.server_address[1]}"\n'
                'format = "openai-chat"\n')

    def close(self) -> None:
        self.go.set()
        self.server.shutdown()
        self.server.server_close()


def test_content_only_when_opted_in_and_spans_flushed_at_stop(receiver: Receiver, daemon_factory: Any) -> None:
    # an hour's batch delay: nothing is sent before the stop, whose flush sends it all
    upstream = HeldUpstream()
    d = daemon_factory(telemetry(receiver, content=True, batch_delay_s=3600, service_name="reef-here")
                       + upstream.entry())
    try:
        with d.http() as c:
            whole, _, body = chat(c, "gamma")
            # greedy: the tiny model's random weights sampled at 0.7 could answer nothing at all (seen once), and
            # the check below needs text to compare
            streamed, _, events = chat(c, "gamma", stream=True, temperature=0)
            report = c.post("/reef/report", json={"score": 1, "feedback": FEEDBACK, "references": [whole]})
            assert report.status_code == 201
            answer = c.get(f"/reef/records/{streamed}").json()
            assert c.post("/reef/scenarios", json={"name": "held", "model": "held"}).status_code in (200, 201)
            # an exchange in flight at the stop: recorded while the daemon drains, after its event streams ended
            with c.stream("POST", "/s/held/v1/chat/completions", json={
                    "model": "held", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}) as r:
                drained = r.headers["x-reef-agent-record-id"]
                upstream.begun.wait(120)
                assert d.proc is not None
                d.proc.send_signal(signal.SIGTERM)
                wait_logged(d, "stopping: draining in-flight requests")
                upstream.go.set()
                assert "call_stub1" in r.read().decode()
        assert receiver.attempted == []
        assert d.stop() == 0
    finally:
        upstream.close()
    spans = {s.attributes.get("reef.receipt") or s.attributes["reef.report.id"]: s for s in receiver.spans}
    assert set(spans) == {whole, streamed, report.json()["report_id"], drained}
    assert {s.resource["service.name"] for s in spans.values()} == {"reef-here"}
    held = spans[drained].attributes
    assert held["reef.status"] == "complete" and held["gen_ai.usage.output_tokens"] == 5
    assert json.loads(held["gen_ai.output.messages"]) == [{"role": "assistant", "finish_reason": "tool_calls", "parts": [
        {"type": "tool_call", "id": "call_stub1", "name": "get_weather", "arguments": {"city": "Paris"}}]}]

    a = spans[whole].attributes
    assert json.loads(a["gen_ai.input.messages"]) == [{"role": "user", "parts": [{"type": "text", "content": PROMPT}]}]
    out = json.loads(a["gen_ai.output.messages"])
    assert out == [{"role": "assistant", "parts": [{"type": "text", "content": body["choices"][0]["message"]["content"]}],
                    "finish_reason": body["choices"][0]["finish_reason"]}]
    streamed_text = "".join(e["choices"][0]["delta"].get("content") or "" for _, e in events
                            if isinstance(e, dict) and e.get("choices"))
    out = json.loads(spans[streamed].attributes["gen_ai.output.messages"])
    assert out[0]["parts"] == [{"type": "text", "content": streamed_text}] and streamed_text
    assert answer["status"] == "complete"
    assert spans[report.json()["report_id"]].attributes["reef.report.feedback"] == FEEDBACK


def log_lines(d: Daemon, pattern: str) -> list[str]:
    return [line for line in (d.home / "logs" / "daemon.log").read_text().splitlines() if re.search(pattern, line)]


def wait_logged(d: Daemon, pattern: str, guard_s: float = 120) -> None:
    """Block until the daemon's log has a line matching ``pattern`` (``guard_s``: a hang guard only)."""
    deadline = time.monotonic() + guard_s
    while not log_lines(d, pattern):
        assert time.monotonic() < deadline, f"never logged: {pattern}\n{d.log_tail()}"
        time.sleep(0.02)


def test_a_collector_that_refuses_hangs_or_is_down_never_touches_serving(receiver: Receiver,
                                                                         daemon_factory: Any) -> None:
    receiver.set_mode("reject")
    # the endpoint and headers from the standard variables, the table giving the rest
    d = daemon_factory(telemetry(None, batch_delay_s=0.05, timeout_s=60), start=False)
    d.env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_EXPORTER_OTLP_HEADERS="x-collector-key=k%202")
    d.start()
    with d.http() as c:
        # refused: two exports fail (each request answered), one warning says so
        first, _, _ = chat(c, "delta")
        receiver.wait(lambda r: r.span(first, attempted=True))
        second, _, _ = chat(c, "delta", stream=True)
        receiver.wait(lambda r: r.span(second, attempted=True))
        receiver.set_mode("ok")
        third, _, _ = chat(c, "delta")
        receiver.wait(lambda r: r.span(third))
        wait_logged(d, "exporting spans to .* again")
        warned = log_lines(d, "could not export spans")
        assert len(warned) == 1, warned
        assert receiver.url in warned[0] and "400" in warned[0]
        assert log_lines(d, r" opentelemetry[.\w]*: ") == []  # the exporter's own lines are held back

        assert {h.get("x-collector-key") for h in receiver.headers} == {"k 2"}

        # hanging: an export is held unanswered; requests are answered meanwhile, the export still waiting on it
        receiver.set_mode("hold")
        held, _, _ = chat(c, "delta")
        receiver.wait(lambda r: r.holding)
        during = [chat(c, "delta")[0], chat(c, "delta", stream=True)[0]]
        assert receiver.holding and not receiver.peer_left  # nothing above waited for the collector
        receiver.set_mode("ok")
        receiver.release()
        receiver.wait(lambda r: all(r.span(x) for x in [held, *during]))

        # down: nothing listens; a request is answered, and the stop is not held by the span it cannot send: its
        # retries are cut short (FLUSH_ON_STOP_S), and the log says so
        receiver.close()
        chat(c, "delta", stream=True)
    assert d.stop() == 0
    assert log_lines(d, "did not take the last spans within 5 s of the stop")


def load(tmp_path: Path, table: str, env: dict[str, str] | None = None) -> Any:
    (tmp_path / "config.toml").write_text(table)
    return load_config({"REEF_HOME": str(tmp_path), **(env or {})}).telemetry


@pytest.mark.parametrize(("table", "env", "says"), [
    ('[telemetry]\notlp_endpoint = "127.0.0.1:4318"\n', {}, "http:// or https:// URL"),
    ('[telemetry]\notlp_endpoint = "ftp://collector"\n', {}, "http:// or https:// URL"),
    ('[telemetry]\notlp_endpoint = "http://collector:port"\n', {}, "port that is not a number"),
    ('[telemetry]\notlp_endpoint = 4318\n', {}, "http:// or https:// URL"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\ncontent = "yes"\n', {}, "content must be true or false"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\ntimeout_s = 0\n', {}, "timeout_s must be a number"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\nbatch_delay_s = true\n', {}, "batch_delay_s must be a number"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\nheaders = "k=v"\n', {}, "must be a table of header names"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\nheaders = { "a b" = "1" }\n', {}, "is not a header name"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\nheaders = { "k" = 1 }\n', {}, "telemetry.headers.k must be"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\nservice_name = ""\n', {}, "service_name must be"),
    ('[telemetry]\notlp_endpoint = "http://c:4318"\nendpoint = "x"\n', {}, "unknown keys endpoint"),
    ("[telemetry]\n", {}, "needs otlp_endpoint"),
    ("telemetry = 1\n", {}, "must be a table"),
    ("[telemetry]\n", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTLP over HTTP"),
    ("[telemetry]\n", {"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4318"}, "environment: OTEL_EXPORTER_OTLP_ENDPOINT must be"),
    ("[telemetry]\n", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_HEADERS": "key-s3cret"},
     "OTEL_EXPORTER_OTLP_HEADERS: each header must be name=value"),
])
def test_bad_telemetry_settings_are_refused_saying_which(tmp_path: Path, table: str, env: dict[str, str],
                                                         says: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(says)) as info:
        load(tmp_path, table, env)
    assert "s3cret" not in info.value.message  # a header's value is often a key: never repeated


def test_the_otlp_variables_fill_in_what_the_table_leaves_out(tmp_path: Path) -> None:
    generic = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://gen:4318/", "OTEL_EXPORTER_OTLP_HEADERS": "api-key=a%20b,x=1"}
    traces = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tr:4318/custom/path"}
    # no table: the variables alone turn nothing on (an agent's own OTLP settings reach a daemon its wrapper starts)
    assert load(tmp_path, "", generic) is None
    got = load(tmp_path, "[telemetry]\n", generic)
    assert (got.endpoint, got.source, dict(got.headers)) == ("http://gen:4318/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT",
                                                            {"api-key": "a b", "x": "1"})
    assert "a b" not in repr(got)  # headers (keys, often) stay out of the config's repr
    got = load(tmp_path, "[telemetry]\n", {**generic, **traces})  # the traces variable is taken as it is
    assert got.endpoint == "http://tr:4318/custom/path"
    table = '[telemetry]\notlp_endpoint = "https://mine:4318/base"\nheaders = { k = "v" }\n'
    got = load(tmp_path, table, {**generic, **traces, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})  # config.toml wins
    assert (got.endpoint, dict(got.headers), got.content) == ("https://mine:4318/base/v1/traces", {"k": "v"}, False)
    assert load(tmp_path, '[telemetry]\notlp_endpoint = "http://c:4318/v1/traces"\n').endpoint == \
        "http://c:4318/v1/traces"
    assert load(tmp_path, table, {"OTEL_SDK_DISABLED": "true"}) is None


def refusal(d: Daemon) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon", "--log-file"], env=d.env, cwd=d.home, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def no_opentelemetry(tmp_path: Path) -> str:
    """A PYTHONPATH on which ``opentelemetry`` cannot be imported (as where the otel extra is not installed)."""
    (tmp_path / "opentelemetry").mkdir()
    (tmp_path / "opentelemetry" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'opentelemetry\' (the test made it so)", name="opentelemetry")\n')
    return f"{tmp_path}:{ROOT}"


def test_a_daemon_refuses_bad_telemetry_and_a_missing_extra_and_imports_none_without_it(
        daemon_factory: Any, no_opentelemetry: str) -> None:
    bad = daemon_factory('\n[telemetry]\notlp_endpoint = "localhost:4318"\n', start=False)
    out = refusal(bad)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "telemetry.otlp_endpoint must be an http:// or https:// URL" in out.stderr

    missing = daemon_factory('\n[telemetry]\notlp_endpoint = "http://127.0.0.1:9"\n', start=False)
    missing.env["PYTHONPATH"] = no_opentelemetry
    out = refusal(missing)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("reef: config: [telemetry] needs OpenTelemetry") and 'pip install "reef[otel]"' in \
        out.stderr and "install.sh --otel" in out.stderr

    plain = daemon_factory(start=False)  # no [telemetry]: nothing of OpenTelemetry is imported, so none is needed
    plain.env["PYTHONPATH"] = no_opentelemetry
    plain.start()
    with plain.http() as c:
        assert c.get("/healthz").status_code == 200
    assert plain.stop() == 0


# --- the client's W3C trace context (traceparent, tracestate) ----------------------------------------------------

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # the spec's example ids (hex letters in both: upper case is wrong)
PARENT_ID = "00f067aa0ba902b7"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"


@pytest.fixture(scope="module")
def traced(tiny_model: Path) -> Any:
    """One receiver and one daemon exporting to it, shared by the trace-context tests (each request its own
    receipt, so its own span)."""
    r = Receiver().start()
    home, port, env = make_home(tiny_model, telemetry(r, batch_delay_s=0.05))
    d = Daemon(home=home, port=port, env=env).start()
    yield r, d
    d.stop()
    r.close()
    shutil.rmtree(home, ignore_errors=True)


def own_ids(receipt: str) -> tuple[str, str]:
    """The trace id and span id, as OTLP's hex, of an exchange's span in a trace of its own."""
    trace_id, span_id = span_ids("exchange", receipt)
    return f"{trace_id:032x}", f"{span_id:016x}"


def traced_chat(c: httpx.Client, headers: dict[str, str], *, stream: bool = False, anthropic: bool = False) -> str:
    """A request (OpenAI chat or Anthropic messages, whole or streamed) carrying ``headers``: answered 200; its
    receipt."""
    path, body = ("/v1/messages", {"max_tokens": 4}) if anthropic else ("/v1/chat/completions", {"max_tokens": 4})
    r = c.post(f"/s/trace{path}", headers=headers, json={
        "model": "tiny", "stream": stream, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 200, r.text
    assert ("data:" in r.text) == stream
    return r.headers["x-reef-agent-record-id"]


def fresh_ids(n: int) -> tuple[str, str]:
    """A trace id and a parent span id of the client's, distinct per request."""
    return f"{n:x}".rjust(32, "a"), f"{n:x}".rjust(16, "b")


def test_a_client_traceparent_puts_the_exchange_span_in_its_trace(traced: Any) -> None:
    """Catches: the traceparent ignored (the span in a trace of its own), its trace id taken but its parent dropped
    (or the reverse), the tracestate lost, a stream or another wire format not followed, the span id no longer the
    receipt's, and a report's link still pointing at the trace the exchange span is no longer in."""
    receiver, d = traced
    forms = {"whole": {}, "stream": {"stream": True}, "anthropic stream": {"stream": True, "anthropic": True}}
    sent: dict[str, tuple[str, str]] = {}
    with d.http() as c:
        for n, kw in enumerate(forms.values(), start=1):
            trace_id, parent = fresh_ids(n)
            receipt = traced_chat(c, {"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": STATE}, **kw)
            sent[receipt] = trace_id, parent
        # the spec's own example, with its tracestate: what an OpenTelemetry-instrumented client sends
        example = traced_chat(c, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": STATE})
        sent[example] = TRACE_ID, PARENT_ID
        plain = traced_chat(c, {})  # none sent: a trace of its own, as before
        assert c.get(f"/reef/records/{example}").json()["headers"]["traceparent"] == f"00-{TRACE_ID}-{PARENT_ID}-01"
        report = c.post("/reef/report", json={"score": 1, "references": [example, plain]})
        assert report.status_code == 201, report.text
        report_id = report.json()["report_id"]
        receiver.wait(lambda r: all(r.span(x) for x in [*sent, plain])
                      and any(s.attributes.get("reef.report.id") == report_id for s in r.spans))

    for receipt, (trace_id, parent) in sent.items():
        span = receiver.span(receipt)
        assert span is not None
        assert (span.trace_id, span.parent_span_id) == (trace_id, parent), receipt
        assert span.span_id == own_ids(receipt)[1]  # still the receipt's: any tool finds it
        assert span.trace_state == STATE
        assert span.flags & 0x300 == 0x300  # OTLP's "the parent is remote": the client's, in another process
    own = receiver.span(plain)
    assert own is not None and (own.trace_id, own.span_id) == own_ids(plain)
    assert own.parent_span_id == "" and own.trace_state == ""

    (rep,) = [s for s in receiver.spans if s.attributes.get("reef.report.id") == report_id]
    links = {attrs["reef.receipt"]: (t, s) for t, s, attrs in rep.links}
    assert links == {example: (TRACE_ID, own_ids(example)[1]), plain: own_ids(plain)}  # to the very spans
    assert rep.trace_id not in {TRACE_ID, own.trace_id} and rep.parent_span_id == ""


def test_a_client_trace_not_sampled_is_not_exported(traced: Any) -> None:
    """The SDK's default sampler (ParentBased): a client's trace whose flag says not sampled gets no exchange span.
    Catches a sampler that ignores the flag (ALWAYS_ON kept) and a report span that cannot link to such an
    exchange (its link still names the client's trace)."""
    receiver, d = traced
    trace_id, parent = fresh_ids(0x5EED)
    with d.http() as c:
        unsampled = traced_chat(c, {"traceparent": f"00-{trace_id}-{parent}-00"})
        streamed = traced_chat(c, {"traceparent": f"00-{trace_id}-{parent}-00"}, stream=True)
        report = c.post("/reef/report", json={"score": 0, "references": [unsampled]})
        assert report.status_code == 201, report.text
        after = traced_chat(c, {})
        # spans are made in the order of the events and exported in that order: the later one's arrival means
        # the unsampled ones would have come before it
        receiver.wait(lambda r: r.span(after) and any(s.attributes.get("reef.report.id") == report.json()["report_id"]
                                                      for s in r.spans))
    assert receiver.span(unsampled, attempted=True) is None and receiver.span(streamed, attempted=True) is None
    (rep,) = [s for s in receiver.spans if s.attributes.get("reef.report.id") == report.json()["report_id"]]
    assert [(t, s) for t, s, _ in rep.links] == [(trace_id, own_ids(unsampled)[1])]


def _bad(form: str) -> str:
    t, s = TRACE_ID, PARENT_ID
    return {
        "trace id short": f"00-{t[:-1]}-{s}-01",
        "trace id long": f"00-{t}a-{s}-01",
        "span id short": f"00-{t}-{s[:-1]}-01",
        "flags short": f"00-{t}-{s}-1",
        "not hex": f"00-{t[:-1]}g-{s}-01",
        "all-zero trace id": f"00-{'0' * 32}-{s}-01",
        "all-zero span id": f"00-{t}-{'0' * 16}-01",
        "version ff": f"ff-{t}-{s}-01",
        "upper-case hex": f"00-{t.upper()}-{s.upper()}-01",
        "version 00 with more fields": f"00-{t}-{s}-01-more",
        "other separators": f"00_{t}_{s}_01",
        "empty": "",
        "not a traceparent": "hello",
        "too long (over 512)": f"01-{t}-{s}-01-{'a' * 600}",
    }[form]


BAD_FORMS = ("trace id short", "trace id long", "span id short", "flags short", "not hex", "all-zero trace id",
             "all-zero span id", "version ff", "upper-case hex", "version 00 with more fields", "other separators",
             "empty", "not a traceparent", "too long (over 512)")


@pytest.mark.parametrize("form", BAD_FORMS)
def test_a_malformed_traceparent_is_ignored(traced: Any, form: str) -> None:
    """Catches a malformed traceparent taken (its trace joined, its parent set, its tracestate carried), a 400 or
    a crash over one, and the propagator's warnings let into the daemon's log (a line per request, the client's
    to cause)."""
    receiver, d = traced
    header = _bad(form)
    with d.http() as c:
        receipts = [traced_chat(c, {"traceparent": header, "tracestate": STATE}, stream=stream)
                    for stream in (False, True)]
        receiver.wait(lambda r: all(r.span(x) for x in receipts))
        assert c.get(f"/reef/records/{receipts[0]}").json()["headers"]["traceparent"] == header  # kept as sent
    for receipt in receipts:
        span = receiver.span(receipt)
        assert span is not None
        assert (span.trace_id, span.span_id) == own_ids(receipt)  # a fresh trace of its own, as without one
        assert span.parent_span_id == "" and span.trace_state == ""
    assert log_lines(d, "traceparent|tracestate|Traceback") == []


async def test_the_store_gives_back_the_trace_headers_of_exchanges(records_at: str) -> None:
    """What a report's span reads to link to exchange spans in their clients' traces, on both backends. Catches a
    read of the wrong key, a receipt mixed up with another's, and a report or an exchange without them listed."""
    from daemon.records import ExchangeRecord, open_store

    store = open_store(records_at)
    try:
        parent = f"00-{TRACE_ID}-{PARENT_ID}-01"
        for receipt, headers in (("both", {"traceparent": parent, "tracestate": STATE, "user-agent": "x"}),
                                 ("parent", {"traceparent": parent}), ("none", {"user-agent": "x"}),
                                 ("no-headers", None)):
            await store.exchanges.append(ExchangeRecord(id=receipt, scenario="s", request={}, response={},
                                                       headers=headers))
        report = await store.reports.append(scenario="s", score=1.0, feedback=None, references=["both"],
                                           metadata=None, report_id=None)
        got = await store.exchanges.trace_headers(["both", "parent", "none", "no-headers", "unknown", report["id"]])
        assert got == {"both": {"traceparent": parent, "tracestate": STATE}, "parent": {"traceparent": parent}}
        assert await store.exchanges.trace_headers([]) == {}
    finally:
        store.close()
