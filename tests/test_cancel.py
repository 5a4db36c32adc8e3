"""A client that went away is served no further: its generation stops, its exchange is recorded ``cancelled``, and
its batch slot is free at once (issue 44). Real sockets on 127.0.0.1 against a real daemon: the tiny model, decoding
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
