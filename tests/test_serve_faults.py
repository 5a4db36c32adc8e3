"""Faults at the serve path's edges (issue 12), against real daemons over real sockets.

- A stream's receipt (its ``x-reef-agent-record-id`` header) names a record that exists even when the daemon is
  killed (``kill -9``) mid-stream, after the client saw it; a stream that ends fills that record in.
- Scenario and run names are checked in full (``"name\\n"`` is refused) at every entry point, before anything is
  stored: a refused name leaves no scenario behind.
- A ``/reef/events`` subscriber that falls behind gets a ``dropped`` event and the end of its stream, and can
  resume from it; the TUI reconnects and reloads on it.
- The ``Host`` check parses ``host[:port]`` strictly; empty credentials are a 401.
- The final ``reef`` object of a stream names the receipt both ways (``agent_record_id`` and ``record_id``).
- ``REEF_URL`` without ``REEF_TOKEN`` uses ``$REEF_HOME/token``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.conftest import Daemon, assert_canonical_error, free_port, sse_events

STUB = Path(__file__).with_name("upstream_stub.py")
FORMATS = {  # format: (path, body); the stub reads its directives from the last message
    "openai-chat": ("/v1/chat/completions",
                    lambda text: {"model": "m", "stream": True, "messages": [{"role": "user", "content": text}]}),
    "openai-responses": ("/v1/responses", lambda text: {"model": "m", "stream": True, "input": text}),
    "anthropic": ("/v1/messages", lambda text: {"model": "m", "stream": True, "max_tokens": 16,
                                                "messages": [{"role": "user", "content": text}]}),
}


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``tests/upstream_stub.py`` as its own process: a provider whose streams can stall (``[stub:stall=S]``)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("stub") / "stub.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, str(STUB), str(port)], stdout=log, stderr=log)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    with httpx.Client(timeout=2) as http:
        while True:
            try:
                if http.get(url + "/_stub/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "stub did not start"
            time.sleep(0.05)
    yield url
    proc.kill()  # not terminate: aiohttp would wait for the stalled streams to end
    proc.wait(10)


def raw_request(d: Daemon, head: str, body: bytes = b"") -> httpx.Response:
    """One request written byte for byte (headers no HTTP client would send), its answer as an httpx Response."""
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
        s.sendall(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    headers_raw, _, content = rest.partition(b"\r\n\r\n")
    headers = [tuple(h.decode("latin-1").split(": ", 1)) for h in headers_raw.split(b"\r\n") if b": " in h]
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=content)


# --- a stream's receipt ----------------------------------------------------------------------------------------


def test_a_streams_receipt_survives_kill_9_mid_stream(daemon_factory: Callable[..., Daemon], stub: str) -> None:
    extra = "".join(f'\n[models.stub-{fmt}]\nengine = "upstream"\nurl = "{stub}/v1"\nformat = "{fmt}"\n'
                    f'upstream_model = "stub-model"\n' for fmt in FORMATS)
    d = daemon_factory(extra)
    with d.http() as http:
        for fmt in FORMATS:
            assert http.post("/reef/scenarios", json={"name": f"stall-{fmt}", "model": f"stub-{fmt}"}).status_code == 201
    receipts: dict[str, str] = {}
    readers: list[Any] = []
    with contextlib.ExitStack() as stack:
        for fmt, (path, body) in FORMATS.items():
            client = stack.enter_context(d.http())
            resp = stack.enter_context(client.stream(
                "POST", f"/s/stall-{fmt}{path}", json=body(f"count slowly [stub:stall=300] ({fmt})")))
            assert resp.status_code == 200
            receipts[fmt] = resp.headers["x-reef-agent-record-id"]
            # the stream is under way: its first bytes are in, its end is not (the iterator is kept: dropped, it
            # would close the response, and the daemon would record a client that left as cancelled)
            readers.append(resp.iter_bytes())
            assert next(readers[-1])
        with d.http() as http:  # while the streams stall: their records are there already, in progress
            for fmt, receipt in receipts.items():
                r = http.get(f"/reef/records/{receipt}")
                assert r.status_code == 200, (fmt, r.text)
                assert r.json()["status"] == "in_progress" and r.json()["timings"] is None, (fmt, r.json())
        d.kill9()
    d.start()
    with d.http() as http:
        for fmt, receipt in receipts.items():
            r = http.get(f"/reef/records/{receipt}")
            assert r.status_code == 200, (fmt, r.text)
            rec = r.json()
            assert rec["status"] == "incomplete" and rec["scenario"] == f"stall-{fmt}" and rec["format"] == fmt
            assert f"({fmt})" in json.dumps(rec["request"]) and rec["response"] is None
            # the receipt is as good as any other: feedback on it is taken
            assert http.post("/reef/report", json={"references": [receipt], "score": 0.0}).status_code == 201


def test_a_finished_streams_record_is_completed_once_under_the_same_receipt(daemon: Daemon) -> None:
    """Each format's final ``reef`` object names the receipt both ways, and it is the header's receipt; the
    record it names holds the finished answer (the opening record was filled in, not a second one written)."""
    cases = {
        "openai-chat": ("/v1/chat/completions", {"model": "tiny", "stream": True, "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "hi"}]}),
        "anthropic": ("/v1/messages", {"model": "tiny", "stream": True, "max_tokens": 3,
                                       "messages": [{"role": "user", "content": "hi"}]}),
        "openai-responses": ("/v1/responses", {"model": "tiny", "stream": True, "max_output_tokens": 3,
                                               "input": "hi"}),
    }
    with daemon.http() as http:
        before = http.get("/reef/status").json()["records"]
        for fmt, (path, body) in cases.items():
            r = http.post(path, json=body, headers={"x-reef-scenario": "finish-once"})
            assert r.status_code == 200, r.text
            receipt = r.headers["x-reef-agent-record-id"]
            events = sse_events(r.text)
            finals = [data for _, data in events if isinstance(data, dict) and "reef" in data]
            assert len(finals) == 1, (fmt, events)
            final = finals[0]
            kind = {"openai-chat": "chat.completion.chunk", "anthropic": "message_stop",
                    "openai-responses": ("response.completed", "response.incomplete")}[fmt]
            assert final.get("object", final.get("type")) in ((kind,) if isinstance(kind, str) else kind), final
            assert final["reef"]["agent_record_id"] == final["reef"]["record_id"] == receipt, final
            rec = http.get(f"/reef/records/{receipt}").json()
            assert rec["status"] == "complete" and rec["timings"]["total_ms"] > 0 and rec["token_ids"], rec
            assert rec["response"]["reef"]["agent_record_id"] == receipt
        # one record per stream: completing the opened record added none
        assert http.get("/reef/status").json()["records"] == before + len(cases)


def test_a_non_streamed_answer_names_its_receipt_both_ways(daemon: Daemon) -> None:
    with daemon.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["reef"]["agent_record_id"] == r.json()["reef"]["record_id"] == r.headers[
            "x-reef-agent-record-id"]


def test_an_open_record_is_completed_at_most_once(tmp_path: Path) -> None:
    from daemon.errors import ReefError
    from daemon.records import ExchangeRecord, SQLiteStore

    store = SQLiteStore(tmp_path / "records.sqlite3")

    async def go() -> None:
        await store.exchanges.open(ExchangeRecord(id="rec_x", scenario="s", request={"q": 1}))
        assert (await store.exchanges.get("rec_x"))["status"] == "incomplete"
        done = ExchangeRecord(id="rec_x", scenario="s", status="complete", response={"a": 2},
                              timings={"total_ms": 1.0})
        await store.exchanges.complete(done)
        rec = await store.exchanges.get("rec_x")
        assert rec["status"] == "complete" and rec["response"] == {"a": 2} and rec["request"] == {"q": 1}
        with pytest.raises(ReefError, match="not open"):
            await store.exchanges.complete(replace(done, status="error", response={"b": 3}))
        with pytest.raises(ReefError, match="not open"):
            await store.exchanges.complete(replace(done, id="rec_never_opened"))
        assert (await store.exchanges.get("rec_x"))["response"] == {"a": 2}

    try:
        asyncio.run(go())
    finally:
        store.close()


# --- names -----------------------------------------------------------------------------------------------------

BAD_SCENARIOS = ["name\n", "a..b", "x.lock", "x.", "-x", "", "x" * 65, "a/b", "na me"]


def test_the_name_checks_match_whole_names() -> None:
    from daemon.errors import InvalidName
    from daemon.names import check_run, check_scenario

    for good in ("name", "a.b-c_d", "x" * 64):
        assert check_scenario(good) == good
    for bad in BAD_SCENARIOS + [None, 3]:
        with pytest.raises(InvalidName):
            check_scenario(bad)
    assert check_run("run_01:a.b") == "run_01:a.b"
    for bad in ("run\n", "", ":x", "r" * 129, "a/b"):
        with pytest.raises(InvalidName):
            check_run(bad)


def test_names_with_a_trailing_newline_are_refused_at_every_entry_point(daemon: Daemon) -> None:
    chat = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    body = json.dumps(chat).encode()
    token = daemon.token
    with daemon.http() as http:
        # the path prefixes: scenario, and run (percent-encoded newline)
        err = assert_canonical_error(http.post("/s/name%0A/v1/chat/completions", json=chat), 400)
        assert "scenario" in err["message"]
        err = assert_canonical_error(http.post("/s/runs-ok/r/run%0A/v1/chat/completions", json=chat), 400)
        assert "run" in err["message"]
        # creating a scenario, starting a wrapper's run, the harness installer
        assert_canonical_error(http.post("/reef/scenarios", json={"name": "name\n"}), 400)
        assert_canonical_error(http.post("/reef/runs", json={"adapter": "pi", "scenario": "name\n"}), 400)
        assert_canonical_error(http.get("/reef/harness/install", params={"adapter": "pi", "scenario": "name\n"}),
                               400)
        # listing records of a run
        assert_canonical_error(http.get("/reef/records", params={"run": "run\n"}), 400)
    # the headers, as bytes: a value ending in a newline never gets past the HTTP parser (no client library sends
    # one); a name the old check let through and git refused (leaving its row behind) is refused as a name
    def via_header(header: str) -> httpx.Response:
        return raw_request(daemon, f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                                   f"Authorization: Bearer {token}\r\n{header}\r\nContent-Type: application/json\r\n"
                                   f"Content-Length: {len(body)}\r\nConnection: close\r\n", body)

    for header in ("x-reef-scenario: name\n", "x-reef-run: run\n"):
        assert "malformed HTTP request" in assert_canonical_error(via_header(header), 400)["message"]
    for header, what in (("x-reef-scenario: hdr..name", "scenario"), ("x-reef-scenario: hdr.lock", "scenario"),
                         ("x-reef-run: :run", "run")):
        assert f"invalid {what} name" in assert_canonical_error(via_header(header), 400)["message"]
    with daemon.http() as http:
        records = http.get("/reef/records", params={"limit": 1000}).json()["records"]
        assert not any(rec["scenario"].endswith("\n") or (rec["run"] or "").endswith("\n") for rec in records)
        listed = [s["name"] for s in http.get("/reef/scenarios").json()["scenarios"]]
        assert not [n for n in listed if n.endswith("\n") or n.startswith("hdr")], listed


def test_refused_scenario_names_leave_nothing_behind(daemon: Daemon) -> None:
    chat = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with daemon.http() as http:
        for name in BAD_SCENARIOS:
            if name:
                r = http.post("/reef/scenarios", json={"name": name})
                assert_canonical_error(r, 400)
                if "/" not in name:
                    path = f"/s/{quote(name, safe='')}/v1/chat/completions"
                    assert_canonical_error(http.post(path, json=chat), (400, 404))
                    assert_canonical_error(http.post("/reef/runs", json={"adapter": "pi", "scenario": name}), 400)
        listed = [s["name"] for s in http.get("/reef/scenarios").json()["scenarios"]]
        assert not set(listed) & set(BAD_SCENARIOS), listed
        # and a good name still works end to end
        assert http.post("/s/fine.name_1/v1/chat/completions", json=chat).status_code == 200
        assert "fine.name_1" in [s["name"] for s in http.get("/reef/scenarios").json()["scenarios"]]


def test_the_installer_for_a_valid_scenario_is_valid_shell(daemon: Daemon) -> None:
    with daemon.http() as http:
        script = http.get("/reef/harness/install", params={"adapter": "pi", "scenario": "my.scen-1"}).text
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0


# --- /reef/events ----------------------------------------------------------------------------------------------


def _subscribe(d: Daemon, after: int | None = None, rcvbuf: int | None = None) -> socket.socket:
    """A raw /reef/events subscriber; its response head is read, nothing more."""
    s = socket.socket()
    if rcvbuf is not None:  # before connecting: a small window, so the daemon's writes block soon
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(60)  # a hang guard: every read below waits on what the daemon sends
    s.connect(("127.0.0.1", d.port))
    extra = f"Last-Event-ID: {after}\r\n" if after is not None else ""
    s.sendall(f"GET /reef/events HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {d.token}\r\n{extra}\r\n"
              .encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


def _read_events(s: socket.socket, until: Callable[[list[dict[str, str]], bytes], bool]) -> list[dict[str, str]]:
    """Read a chunked SSE stream until ``until(events, raw)``; events as {id, event, data} dicts."""
    raw = b""
    while True:
        chunk = s.recv(65536)
        raw += chunk
        body = _dechunk(raw)
        events = []
        for block in body.split(b"\n\n"):
            fields = dict(line.decode().split(": ", 1) for line in block.split(b"\n") if line and not
                          line.startswith(b":") and b": " in line)
            if "data" in fields:
                events.append(fields)
        if until(events, raw) or not chunk:
            return events


def _dechunk(raw: bytes) -> bytes:
    out, i = b"", 0
    while True:
        j = raw.find(b"\r\n", i)
        if j < 0:
            return out
        size = int(raw[i:j], 16)
        if size == 0 or len(raw) < j + 2 + size:
            return out
        out += raw[j + 2 : j + 2 + size]
        i = j + 4 + size


def test_a_subscriber_that_falls_behind_gets_dropped_and_its_stream_ends(daemon_factory: Callable[..., Daemon]
                                                                         ) -> None:
    d = daemon_factory(start=False)
    config = d.home / "config.toml"
    config.write_text("events_queue = 8\n" + config.read_text())  # top-level key: before the first table
    d.start()
    slow = _subscribe(d, rcvbuf=4096)  # from here on it reads nothing until the daemon has dropped it
    with d.http() as http:
        receipt = http.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).headers[
            "x-reef-agent-record-id"]
        assert http.get("/reef/status").json()["events"] == {"subscribers": 1, "dropped": 0}
        feedback = "a long note to make each event big " * 13
        for n in range(20_000):  # a hang guard: the daemon drops the subscriber long before
            assert http.post("/reef/report", json={"references": [receipt], "feedback": feedback}).status_code == 201
            if n % 10 == 9 and http.get("/reef/status").json()["events"]["dropped"] == 1:
                break
        else:
            pytest.fail("the subscriber that reads nothing was never dropped")
        assert http.get("/reef/status").json()["events"]["subscribers"] == 0
        # now it reads: what was under way, then a "dropped" event, then the end of the stream (a stream left
        # hanging would send a keep-alive comment next, 15 s later: reading stops there too)
        raw: list[bytes] = []
        events = _read_events(slow, lambda _, r: raw.append(r) or r.endswith(b"0\r\n\r\n") or b": keep-alive" in r)
        slow.close()
        assert raw[-1].endswith(b"0\r\n\r\n"), raw[-1][-200:]
        assert events and events[-1]["event"] == "dropped", events[-3:]
        dropped = json.loads(events[-1]["data"])
        assert dropped["kind"] == "dropped" and int(events[-1]["id"]) == dropped["resume_after"]
        seen = [int(e["id"]) for e in events[:-1]]
        assert seen and max(seen) <= dropped["resume_after"], "the backlog past the drop is not sent"
        # resuming from the dropped event's id replays the history from the first event it missed
        again = _subscribe(d, after=dropped["resume_after"])
        replay = _read_events(again, lambda evs, _: len(evs) >= 1)
        again.close()
        assert int(replay[0]["id"]) == dropped["resume_after"] + 1 and replay[0]["event"] == "report"


def _tcp_state(s: socket.socket) -> int:
    """The kernel's TCP state of ``s`` (TCP_INFO's first byte; 1 = ESTABLISHED), read without reading data."""
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def test_a_dropped_subscriber_that_never_reads_has_its_connection_closed(daemon_factory: Callable[..., Daemon]
                                                                        ) -> None:
    """A subscriber that stops reading is dropped from the bus, and then, when it has not taken its last events
    within the grace, the daemon closes its connection (it stayed open for good, the handler blocked in a write
    that could never finish)."""
    d = daemon_factory(start=False)
    config = d.home / "config.toml"
    config.write_text("events_queue = 8\n" + config.read_text())
    d.start()
    slow = _subscribe(d, rcvbuf=4096)  # it never reads again
    with d.http() as http:
        receipt = http.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).headers[
            "x-reef-agent-record-id"]
        feedback = "a long note to make each event big " * 13
        for n in range(20_000):
            assert http.post("/reef/report", json={"references": [receipt], "feedback": feedback}).status_code == 201
            if n % 10 == 9 and http.get("/reef/status").json()["events"]["dropped"] == 1:
                break
        else:
            pytest.fail("the subscriber that reads nothing was never dropped")
    assert _tcp_state(slow) == 1  # dropped from the bus, still connected: the grace to take its end
    deadline = time.monotonic() + 60  # a hang guard: the daemon closes it after its 10 s grace
    while _tcp_state(slow) == 1:
        assert time.monotonic() < deadline, "the dropped subscriber's connection was never closed"
        time.sleep(0.2)
    with pytest.raises(ConnectionResetError):  # closed at once, unsent events and all
        while slow.recv(65536):
            pass
    slow.close()


async def test_the_tui_reloads_and_resumes_after_being_dropped() -> None:
    from reef_cli.tui.app import ReefApp
    from reef_cli.tui.screens import ScenariosScreen
    from tests.tui_fixture import FixedSource

    class Dropping(FixedSource):
        """Its first stream ends with the daemon's ``dropped`` event; later ones stay open."""

        def __init__(self) -> None:
            super().__init__()
            self.afters: list[int | None] = []
            self.reloads = 0

        async def scenarios(self) -> list[dict[str, Any]]:
            self.reloads += 1
            return await super().scenarios()

        async def events(self, after: int | None) -> Any:
            self.afters.append(after)
            if len(self.afters) == 1:
                yield {"seq": 7, "time": 1.0, "kind": "record", "id": "rec_a", "scenario": "alpha"}
                yield {"seq": None, "time": 2.0, "kind": "dropped", "resume_after": 41, "message": "fell behind"}
                return
            await asyncio.Event().wait()

    source = Dropping()
    app = ReefApp(source, retry_s=0.01)
    async with app.run_test(size=(120, 34)) as pilot:
        for _ in range(400):  # a hang guard; each pause lets the app's workers run
            if len(source.afters) >= 2 and isinstance(app.screen, ScenariosScreen) and source.reloads >= 2:
                break
            await pilot.pause(0.02)
        assert source.afters[:2] == [0, 41], source.afters
        assert source.reloads >= 2, "the screen reloads what it shows after a drop"
        assert any("fell behind" in m for m in app.messages), app.messages


# --- the Host check and credentials ------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["localhost:80@evil.com", "127.0.0.1.evil.example", "localhost.evil.com",
                                  "evil.localhost.com", "", "localhost:", "127.0.0.1:99999", "[::2]:8900", "::1",
                                  "127.0.0.256", "localhost:8900/x"])
def test_a_host_that_is_not_loopback_is_refused(daemon: Daemon, host: str) -> None:
    r = raw_request(daemon, f"GET /reef/status HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {daemon.token}\r\n"
                            "Connection: close\r\n")
    err = assert_canonical_error(r, 400)
    assert "Host" in err["message"]


def test_a_request_without_host_is_refused(daemon: Daemon) -> None:
    r = raw_request(daemon, f"GET /reef/status HTTP/1.0\r\nAuthorization: Bearer {daemon.token}\r\n")
    assert "Host" in assert_canonical_error(r, 400)["message"]


@pytest.mark.parametrize("host", ["localhost", "localhost:8900", "127.0.0.1:8900", "[::1]:8900", "[::1]",
                                  "LocalHost.", "app.localhost:8900", "127.3.2.1"])
def test_a_loopback_host_is_accepted(daemon: Daemon, host: str) -> None:
    r = raw_request(daemon, f"GET /reef/status HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {daemon.token}\r\n"
                            "Connection: close\r\n")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("credential", ["Authorization: Bearer ", "Authorization: Bearer", "Authorization: ",
                                        "x-api-key: ", "Authorization: Basic {token}", "x-api-key: {token}x"])
def test_empty_or_wrong_credentials_are_401(daemon: Daemon, credential: str) -> None:
    line = credential.format(token=daemon.token)
    r = raw_request(daemon, f"GET /reef/status HTTP/1.1\r\nHost: localhost\r\n{line}\r\nConnection: close\r\n")
    assert_canonical_error(r, 401)
    ok = raw_request(daemon, f"GET /reef/status HTTP/1.1\r\nHost: localhost\r\nx-api-key: {daemon.token}\r\n"
                             "Connection: close\r\n")
    assert ok.status_code == 200


# --- REEF_URL without REEF_TOKEN ---------------------------------------------------------------------------------


def test_reef_url_without_reef_token_uses_the_homes_token_file(daemon: Daemon, tmp_path: Path) -> None:
    env = {**daemon.env, "REEF_URL": daemon.url}
    env.pop("REEF_TOKEN", None)
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "status", "--json"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["home"] == str(daemon.home)
    # a home without a token file: still no token, and the daemon says so
    empty = tmp_path / "home"
    empty.mkdir()
    shutil.copy(daemon.home / "config.toml", empty / "config.toml")
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "status", "--json"],
                         env={**env, "REEF_HOME": str(empty)}, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "missing token" in out.stderr + out.stdout
    # an explicit REEF_TOKEN still wins over the file
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "status", "--json"],
                         env={**env, "REEF_TOKEN": "wrong"}, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "invalid token" in out.stderr + out.stdout


def test_a_wrapper_over_reef_url_without_reef_token(daemon: Daemon) -> None:
    env = {**daemon.env, "REEF_URL": daemon.url}
    env.pop("REEF_TOKEN", None)
    out = subprocess.run([sys.executable, "-m", "reef_cli.wrapper", "pi", "evolve", "write type hints"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "released step" in out.stdout, out.stdout + out.stderr


async def test_the_tui_over_reef_url_without_reef_token(daemon: Daemon) -> None:
    from daemon.config import load_config
    from reef_cli.tui.api import Api

    api = Api(load_config(env={"REEF_HOME": str(daemon.home), "REEF_URL": daemon.url}))
    try:
        assert (await api.status())["home"] == str(daemon.home)
    finally:
        await api.aclose()
