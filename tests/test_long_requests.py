"""Long requests on a slow engine (issue 44): bounded by the output cap (said in ``x-reef-output-cap``), shown while
they run (``GET /reef/inflight``, the wrapper's line), and stopped when their client leaves.

A client that went away is served no further: its generation stops, its exchange is recorded ``cancelled``, and
its batch slot is free at once. Real sockets on 127.0.0.1 against a real daemon: the tiny model, decoding
greedily (its greedy answers never reach an end token, so a request asking for 50,000 tokens runs for minutes unless
it is stopped), with one batch slot, so that the next request is served only once the slot is free; and an upstream
that never answers, which must see its request's connection closed.

Every wait is on an event: the daemon's event stream (a record of status ``cancelled``), ``GET /reef/inflight``
saying a request is in the engine, the upstream's own socket seeing its end. The timeouts are hang guards only.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon

LONG = 50_000  # tokens asked: minutes of greedy decoding for the tiny model, unless the request is stopped


def _post(d: Daemon, body: dict[str, Any], path: str = "/v1/chat/completions") -> socket.socket:
    """Send one request on a raw socket (left open: the test closes it to leave)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", d.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {d.token}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _leave(sock: socket.socket) -> None:
    sock.close()


class Records:
    """The daemon's event stream, read in a thread: every ``record`` event, by receipt."""

    def __init__(self, d: Daemon) -> None:
        self.seen: dict[str, dict[str, Any]] = {}
        self.cond = threading.Condition()
        self.client = httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"},
                                   timeout=httpx.Timeout(5, read=None))
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def _read(self) -> None:
        try:
            with self.client.stream("GET", "/reef/events") as resp:
                self.ready.set()
                event = None
                for line in resp.iter_lines():
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:") and event == "record":
                        rec = json.loads(line[5:])
                        with self.cond:
                            self.seen[rec["id"]] = rec
                            self.cond.notify_all()
        except httpx.HTTPError:
            pass

    def wait(self, pred: Any, guard: float = 120) -> dict[str, Any]:
        with self.cond:
            assert self.cond.wait_for(lambda: next((r for r in self.seen.values() if pred(r)), None), guard), \
                f"no such record event; seen: {list(self.seen.values())}"
            return next(r for r in self.seen.values() if pred(r))

    def close(self) -> None:
        self.client.close()


def _inflight(c: httpx.Client, guard: float, pred: Any) -> list[dict[str, Any]]:
    """``GET /reef/inflight`` until ``pred`` holds of its list (polled: the daemon sends no event for a token)."""
    deadline = time.monotonic() + guard
    while True:
        got = c.get("/reef/inflight").json()["inflight"]
        if pred(got):
            return got
        assert time.monotonic() < deadline, f"in flight: {got}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def one_slot(tiny_model: Any) -> Iterator[Daemon]:
    import shutil

    from tests.conftest import make_home

    home, port, env = make_home(tiny_model, "max_batch = 1\nmax_tokens_limit = 60000\n")
    d = Daemon(home=home, port=port, env=env).start().wait_loaded()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def _long(stream: bool, scenario: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"hello there {scenario}"}],
            "max_tokens": LONG, "temperature": 0, "stream": stream}


def test_a_client_that_leaves_is_served_no_further(one_slot: Daemon) -> None:
    """Whole and streamed, decoding and still queued: each request whose client closed its socket stops at once,
    is recorded cancelled with what the engine made of it, and the one batch slot serves the next request."""
    d = one_slot
    records = Records(d)
    try:
        with d.http() as c:
            # 1. a whole answer, decoding in the only slot
            whole = _post(d, _long(False, "whole"))
            first = _inflight(c, 60, lambda xs: any(x["output_tokens"] for x in xs))[0]
            assert not first["stream"] and first["output_cap"] == 60000
            shown = d.cli("status").stdout  # reef status lists it, with the engine's count of tokens
            assert "serving  1 request now" in shown and first["receipt"] in shown, shown
            assert "tokens of at most 60,000" in shown or "reading its prompt" in shown, shown
            # 2. a stream queued behind it (no first token yet: the slot is taken), whose client leaves too
            queued = _post(d, _long(True, "queued"))
            second = _inflight(c, 60, lambda xs: len(xs) == 2)
            receipt_queued = next(x["receipt"] for x in second if x["stream"])
            _leave(queued)
            rec = records.wait(lambda r: r["id"] == receipt_queued)
            assert rec["status"] == "cancelled", rec
            _leave(whole)
            rec = records.wait(lambda r: r["id"] == first["receipt"])
            assert rec["status"] == "cancelled", rec
            # 3. the slot is free: a short request is answered (it would wait minutes behind the cancelled one)
            short = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "hi"}]})
            assert short.status_code == 200, short.text
            assert _inflight(c, 5, lambda xs: not xs) == []
            # 4. a stream that has begun, whose client leaves after its first tokens
            streaming = _post(d, _long(True, "streaming"))
            streaming.recv(4096)  # the head and the first events
            third = _inflight(c, 60, lambda xs: any(x["output_tokens"] for x in xs))[0]
            _leave(streaming)
            rec = records.wait(lambda r: r["id"] == third["receipt"])
            assert rec["status"] == "cancelled", rec
            stored = c.get(f"/reef/records/{third['receipt']}").json()
            assert stored["status"] == "cancelled"
            short = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                         "messages": [{"role": "user", "content": "hi"}]})
            assert short.status_code == 200, short.text
            assert c.get(f"/reef/records/{first['receipt']}").json()["status"] == "cancelled"
    finally:
        records.close()


class HangingUpstream:
    """An OpenAI-compatible upstream that takes a request and never answers: it says when a request came in and when
    the connection it came on was closed by Reef."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.arrived = threading.Event()
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            self.arrived.set()
            try:
                while conn.recv(65536):  # until Reef closes it: b""
                    pass
            except ConnectionResetError:  # or a reset
                pass
            self.closed.set()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_the_upstream_request(daemon_factory: Any, stream: bool) -> None:
    up = HangingUpstream()
    try:
        d = daemon_factory(f'\n[models.up]\nengine = "upstream"\nurl = "http://127.0.0.1:{up.port}/v1"\n'
                           'format = "openai-chat"\nupstream_model = "m"\n')
        records = Records(d)
        try:
            with d.http() as c:
                assert c.post("/reef/scenarios", json={"name": "up", "model": "up"}).status_code in (200, 201)
                sock = _post(d, {"model": "up", "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
                             path="/s/up/v1/chat/completions")
                assert up.arrived.wait(60)
                receipt = _inflight(c, 60, lambda xs: len(xs) == 1)[0]["receipt"]
                _leave(sock)
                assert up.closed.wait(60), "the upstream request was not cancelled"
                rec = records.wait(lambda r: r["id"] == receipt)
                assert rec["status"] == "cancelled", rec
        finally:
            records.close()
    finally:
        up.close()


# --- the output cap ---------------------------------------------------------------------------------------------


def test_budget_caps_what_a_client_asks_and_says_when_the_cap_ended_it() -> None:
    from daemon.engines.prompts import budget

    assert budget(32_000, None, 1024, 4842) == (1024, True)  # Claude Code's max_tokens: the cap, a normal stop
    assert budget(None, None, 1024, 4842) == (1024, True)  # Codex asks no limit: the cap, a normal stop
    assert budget(None, 300, 1024, 4842) == (300, True)  # the entry's default for a client that asks none
    assert budget(10, None, 1024, 4842) == (10, False)  # the client's own limit: a length stop, as it asked
    assert budget(1024, None, 1024, 4842) == (1024, False)  # asked exactly the cap: its own limit
    assert budget(32_000, None, 1024, 500) == (500, False)  # the context ends it: a length stop
    assert budget(None, None, None, 500) == (500, False)  # no cap (upstream): the room


def test_the_default_cap_is_an_eighth_of_the_context_within_bounds() -> None:
    from daemon.engines.entry import ModelEntry
    from daemon.engines.prompts import output_cap

    local = ModelEntry(name="m")
    assert output_cap(local, 8192) == 1024  # SmolLM2
    assert output_cap(local, 65_536) == 4096 and output_cap(local, 1024) == 256
    assert output_cap(ModelEntry(name="m", max_tokens_limit=40), 8192) == 40
    assert output_cap(ModelEntry(name="u", engine="upstream"), 8192) is None


@pytest.fixture(scope="module")
def short_context(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The tiny model with a 4,096-token context: its default output cap is 512 tokens, which its greedy answers
    (no end token) always reach."""
    import shutil

    from tests.conftest import make_home

    short = tmp_path_factory.mktemp("short") / "tiny4k"
    shutil.copytree(tiny_model, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    home, port, env = make_home(short)
    d = Daemon(home=home, port=port, env=env).start().wait_loaded()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def test_a_client_asking_too_much_gets_the_cap_said_in_a_header(short_context: Daemon) -> None:
    with short_context.http() as c:
        # Claude Code's max_tokens: capped, the header says so, and the answer ends as a normal stop
        r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 32_000, "temperature": 0,
                                         "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200, r.text
        assert r.headers["x-reef-output-cap"] == "512"
        assert r.json()["usage"]["output_tokens"] == 512 and r.json()["stop_reason"] == "end_turn"
        # a client's own smaller limit: no header, and its length stop is reported as one
        r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 7, "temperature": 0,
                                         "messages": [{"role": "user", "content": "hello there"}]})
        assert "x-reef-output-cap" not in r.headers
        assert r.json()["usage"]["output_tokens"] == 7 and r.json()["stop_reason"] == "max_tokens"
        # exactly the cap: the client's own limit, no header
        r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 512, "temperature": 0,
                                         "messages": [{"role": "user", "content": "hello there"}]})
        assert "x-reef-output-cap" not in r.headers
        assert r.json()["usage"]["output_tokens"] == 512 and r.json()["stop_reason"] == "max_tokens"


def test_a_responses_client_that_asks_no_limit_gets_a_completed_answer(short_context: Daemon) -> None:
    """Codex sends no ``max_output_tokens``: it gets the cap (not 256), and an answer the cap ended is
    ``completed`` (Codex exits 1 on ``incomplete``, reason ``max_output_tokens``)."""
    with short_context.http() as c:
        r = c.post("/v1/responses", json={"model": "tiny", "input": "hello there", "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["x-reef-output-cap"] == "512"
        assert body["status"] == "completed" and body["incomplete_details"] is None, body
        assert body["usage"]["output_tokens"] == 512
        # streamed as Codex asks: the last event is response.completed
        with c.stream("POST", "/v1/responses", json={"model": "tiny", "input": "hello there", "temperature": 0,
                                                     "stream": True}) as s:
            kinds = [line.split(":", 1)[1].strip() for line in s.iter_lines() if line.startswith("event:")]
        assert kinds[-1] == "response.completed", kinds[-3:]


# --- what a long request shows while it runs ------------------------------------------------------------------


def test_long_lines_say_a_long_request_once_then_every_so_often() -> None:
    from reef_cli.progress import long_lines

    said: dict[str, float] = {}
    young = {"receipt": "rec_a", "elapsed_s": 5.0, "output_tokens": 3, "prompt_tokens": 100}
    assert long_lines([young], said, after_s=30, every_s=60) == []
    old = {**young, "elapsed_s": 31.0, "output_tokens": 12, "output_cap": 1024}
    assert long_lines([old], said, after_s=30, every_s=60) == [
        "the model is still answering: 12 tokens in 31 s (at most 1,024)"]
    assert long_lines([{**old, "elapsed_s": 60.0}], said, after_s=30, every_s=60) == []  # said 29 s ago
    assert long_lines([{**old, "elapsed_s": 95.0}], said, after_s=30, every_s=60) != []
    prefill = {"receipt": "rec_b", "elapsed_s": 40.0, "output_tokens": 0, "prompt_tokens": 3350}
    assert long_lines([prefill], said, after_s=30) == ["the model is still reading its prompt (3,350 tokens): 40 s so far"]
    upstream = {"receipt": "rec_c", "elapsed_s": 40.0, "output_tokens": None}
    assert long_lines([upstream], said, after_s=30) == ["the model is still answering: 40 s so far"]


def test_the_wrapper_line_reads_the_runs_requests_in_flight(one_slot: Daemon) -> None:
    """``progress.watch`` against the daemon: while only another run's request is in flight it says nothing (three
    polls seen); the run's own request is said with what the engine has made of it."""
    from reef_cli.progress import watch

    d = one_slot
    lines: list[str] = []
    said, polls = threading.Event(), threading.Semaphore(0)

    def say(line: str) -> None:
        lines.append(line)
        said.set()

    with d.http() as c, d.http() as watcher:
        def get(path: str) -> Any:
            answer = watcher.get(path).json()
            polls.release()
            return answer

        other = _post(d, _long(False, "other"), path="/s/prog/r/run-other/v1/chat/completions")
        _inflight(c, 60, lambda xs: any(x["output_tokens"] for x in xs))
        with watch(get, "run-mine", say, after_s=0, every_s=0, poll_s=0.05):
            for _ in range(3):
                assert polls.acquire(timeout=60)
            assert lines == []
            mine = _post(d, _long(False, "mine"), path="/s/prog/r/run-mine/v1/chat/completions")
            assert said.wait(60)
            _leave(other)  # the slot goes to the run's own request, which then decodes
            while not any("tokens in" in line for line in lines):
                assert polls.acquire(timeout=60), lines
        _leave(mine)
        _inflight(c, 60, lambda xs: not xs)
    assert lines[0].startswith("the model is still reading its prompt ("), lines
    assert any(line.startswith("the model is still answering: ") and "tokens in" in line for line in lines), lines


def test_the_wrapper_says_long_requests_only_where_no_agent_screen_is_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal with no one-shot prompt the agent draws its own screen: the wrapper writes nothing over it;
    with ``-p`` (or ``exec``, ``run``), or output going elsewhere, it says long requests."""
    import contextlib
    import io
    import sys

    from reef_cli import wrapper

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert isinstance(wrapper._long_requests(None, "r", []), contextlib.nullcontext)  # type: ignore[arg-type]
    for one_shot in (["-p", "hi"], ["exec", "hi"], ["run", "hi"]):
        assert not isinstance(wrapper._long_requests(None, "r", one_shot), contextlib.nullcontext)  # type: ignore[arg-type]
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert not isinstance(wrapper._long_requests(None, "r", []), contextlib.nullcontext)  # type: ignore[arg-type]
