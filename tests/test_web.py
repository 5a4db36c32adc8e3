"""The daemon's own HTTP/1.1 server (daemon/web.py), spoken to over raw sockets: what a client on the wire sees.

Keep-alive and pipelining, HTTP/1.0 clients (a stream ends with the connection, not in chunks), Expect:
100-continue, HEAD, oversized heads, malformed requests, a client that leaves mid-body, and the drain on stop.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

from tests.conftest import Daemon

CHAT = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def connect(d: Daemon) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", d.port), timeout=30)
    return s


def post(path: str, body: bytes, token: str, *, version: str = "1.1", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def read_response(s: socket.socket, buf: bytearray) -> tuple[str, dict[str, str], bytes]:
    """One response with a Content-Length body from ``s`` (``buf`` keeps what came after it)."""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a full head: {bytes(buf)!r}"
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    buf[:] = rest[n:]
    return lines[0], headers, rest[:n]


def read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_keep_alive_and_pipelined_requests_are_answered_in_order(daemon: Daemon) -> None:
    with connect(daemon) as s:
        token = daemon.token
        # three requests in one write: the answers come back in the order asked, on the same connection
        s.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
            + post("/v1/chat/completions", json.dumps(CHAT).encode(), token)
            + f"GET /reef/scenarios HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        )
        buf = bytearray()
        first = read_response(s, buf)
        second = read_response(s, buf)
        third = read_response(s, buf)
        assert first[0] == "HTTP/1.1 200 OK" and json.loads(first[2])["ok"] is True
        assert second[0] == "HTTP/1.1 200 OK" and json.loads(second[2])["object"] == "chat.completion"
        assert third[0] == "HTTP/1.1 200 OK" and "scenarios" in json.loads(third[2])
        # and the connection is still open for a fourth
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert read_response(s, buf)[0] == "HTTP/1.1 200 OK"


def test_http10_client_gets_a_stream_ended_by_the_connection(daemon: Daemon) -> None:
    body = json.dumps({**CHAT, "stream": True}).encode()
    with connect(daemon) as s:
        s.sendall(post("/v1/chat/completions", body, daemon.token, version="1.0"))
        data = read_all(s)  # the server closes: that is the end of the stream
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in head.lower()
    assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
    assert b'"reef"' in rest  # the receipt rides on the final event


def test_http10_request_is_not_kept_alive_unless_asked(daemon: Daemon) -> None:
    with connect(daemon) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"}")
    with connect(daemon) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n")
        buf = bytearray()
        assert read_response(s, buf)[0] == "HTTP/1.1 200 OK"
        s.sendall(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n")
        assert read_response(s, buf)[0] == "HTTP/1.1 200 OK"


def test_expect_100_continue(daemon: Daemon) -> None:
    body = json.dumps(CHAT).encode()
    with connect(daemon) as s:
        head, _, payload = post("/v1/chat/completions", body, daemon.token,
                                extra="Expect: 100-continue\r\n").partition(b"\r\n\r\n")
        s.sendall(head + b"\r\n\r\n")
        interim = s.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim
        s.sendall(payload)
        buf = bytearray(interim[len(b"HTTP/1.1 100 Continue\r\n\r\n"):])
        status, headers, answer = read_response(s, buf)
    assert status == "HTTP/1.1 200 OK"
    assert headers["x-reef-agent-record-id"] == json.loads(answer)["reef"]["record_id"]


def test_head_has_the_length_but_no_body(daemon: Daemon) -> None:
    with connect(daemon) as s:
        s.sendall(f"HEAD / HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {daemon.token}\r\n\r\n".encode()
                  + b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        buf = bytearray()
        while buf.count(b"\r\n\r\n") < 2:
            buf += s.recv(65536)
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert int(re.search(rb"(?i)content-length: (\d+)", head).group(1)) > 0  # type: ignore[union-attr]
        assert rest.startswith(b"HTTP/1.1 200")  # the next response follows at once: no body in between


def test_oversized_head_is_431_and_closed(daemon: Daemon) -> None:
    for size in (70_000, 1_000_000):  # one header over the limit; a head that never ends
        with connect(daemon) as s:
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):  # refused before all of it was sent
                pass
            data = read_all(s)
        assert data.startswith(b"HTTP/1.1 431"), data[:100]
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_connection_close_is_honoured(daemon: Daemon) -> None:
    with connect(daemon) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = read_all(s)  # returns because the server closed
    assert data.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close\r\n" in data


def test_malformed_request_is_400_and_closed(daemon: Daemon) -> None:
    for garbage in (b"HELLO\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
        with connect(daemon) as s:
            s.sendall(garbage)
            data = read_all(s)
        assert data.startswith(b"HTTP/1.1 400"), (garbage, data[:100])
        assert "error" in json.loads(data.partition(b"\r\n\r\n")[2])
    with daemon.http() as c:
        assert c.get("/healthz").status_code == 200


def test_client_leaving_mid_body_does_not_hurt_the_daemon(daemon: Daemon) -> None:
    for _ in range(20):
        with connect(daemon) as s:
            s.sendall(post("/v1/chat/completions", b"x" * 10, daemon.token)[:-5])  # 5 bytes of body missing
    with daemon.http() as c:
        resp = c.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200
        assert c.get("/reef/status").status_code == 200


def test_stop_lets_a_request_in_flight_finish(daemon_factory: object) -> None:
    """SIGTERM while a stream is being answered: the answer completes, new connections are refused."""
    d = daemon_factory()  # type: ignore[operator]
    body = json.dumps({**CHAT, "max_tokens": 64, "stream": True}).encode()
    got: dict[str, bytes] = {}

    def client() -> None:
        with connect(d) as s:
            s.sendall(post("/v1/chat/completions", body, d.token, extra="Connection: close\r\n"))
            got["data"] = read_all(s)

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.05)
    d.stop()
    t.join(60)
    assert got["data"].startswith(b"HTTP/1.1 200"), got["data"][:200]
    assert b"data: [DONE]" in got["data"] and got["data"].endswith(b"0\r\n\r\n")
    try:
        socket.create_connection(("127.0.0.1", d.port), timeout=2).close()
    except OSError:
        pass
    else:
        raise AssertionError("the stopped daemon still accepts connections")


def rss_mb(d: Daemon) -> float:
    assert d.proc is not None
    status = Path(f"/proc/{d.proc.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def test_large_bodies_on_a_kept_alive_connection(daemon: Daemon) -> None:
    """Large bodies one after another on one connection: each is read as a body, never taken for a head."""
    with daemon.http() as c:
        receipt = c.post("/v1/chat/completions", json=CHAT).headers["x-reef-agent-record-id"]
    with connect(daemon) as s:
        buf = bytearray()
        for i in range(4):
            body = json.dumps({"references": [receipt], "score": 1, "feedback": f"{i} " + "long " * 50_000}).encode()
            s.sendall(post("/reef/report", body, daemon.token))  # ~250 kB each
            status, _, answer = read_response(s, buf)
            assert status.startswith("HTTP/1.1 201"), (status, answer[:200])
            assert json.loads(answer)["feedback"].startswith(f"{i} long")


def test_a_client_that_never_reads_cannot_grow_the_daemon(daemon: Daemon) -> None:
    """Pipelined requests from a client that reads nothing: the daemon stops reading once the answers fill the
    socket's buffers, instead of queueing answers in memory."""
    before = rss_mb(daemon)
    req = f"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {daemon.token}\r\n\r\n".encode()
    s = connect(daemon)
    s.setblocking(False)
    sent = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sent < 64 * 1024 * 1024:
        try:
            sent += s.send(req * 64)
        except BlockingIOError:
            time.sleep(0.01)
    grown = rss_mb(daemon) - before
    s.close()
    assert sent < 32 * 1024 * 1024, f"the daemon kept reading: {sent} bytes taken"
    assert grown < 64, f"daemon memory grew by {grown:.0f} MB"
    with daemon.http() as c:
        assert c.get("/healthz").status_code == 200


def test_head_of_a_stream_route_answers_and_keeps_the_connection(daemon: Daemon) -> None:
    with connect(daemon) as s:
        s.sendall(f"HEAD /reef/events HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {daemon.token}\r\n\r\n"
                  .encode())
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n"), head
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        buf = bytearray()
        assert read_response(s, buf)[0] == "HTTP/1.1 200 OK"


def test_broken_chunked_body_is_400_at_once(daemon: Daemon) -> None:
    with connect(daemon) as s:
        # nothing more is sent: the answer (and the close) must come from the bad chunk itself, not from a timeout,
        # which would name another reason
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {daemon.token}\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nZZZ\r\n".encode())
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 400"), data[:200]
    assert b"malformed request body" in data


def test_upgrade_and_connect_are_refused_without_serving(daemon: Daemon) -> None:
    def records() -> int:
        with daemon.http() as c:
            return int(c.get("/reef/status").json()["records"])

    before = records()
    body = json.dumps(CHAT).encode()
    for raw in (post("/v1/chat/completions", body, daemon.token, extra="Connection: Upgrade\r\nUpgrade: h2c\r\n"),
                b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"):
        with connect(daemon) as s:
            s.sendall(raw)
            data = read_all(s)
        assert data.startswith(b"HTTP/1.1 400") and data.count(b"HTTP/1.1") == 1, data[:300]
    assert records() == before  # the chat request was never served


def test_expect_100_is_not_sent_to_a_request_refused_by_its_head(daemon: Daemon) -> None:
    with connect(daemon) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n"
                  b"Expect: 100-continue\r\n\r\n")  # no token: refused before the body is wanted
        buf = bytearray()
        status, headers, _ = read_response(s, buf)
    assert status.startswith("HTTP/1.1 401") and headers.get("connection") == "close"


def test_trailers_do_not_change_the_request(daemon: Daemon) -> None:
    body = json.dumps(CHAT).encode()
    with connect(daemon) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {daemon.token}\r\n"
                  f"Transfer-Encoding: chunked\r\nx-reef-scenario: web-trailers\r\n\r\n"
                  f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\nx-reef-scenario: elsewhere\r\n\r\n")
        status, headers, _ = read_response(s, bytearray())
    assert status == "HTTP/1.1 200 OK"
    with daemon.http() as c:
        rec = c.get(f"/reef/records/{headers['x-reef-agent-record-id']}").json()
    assert rec["scenario"] == "web-trailers"


def test_refused_large_upload_still_gets_its_answer(daemon_factory: object) -> None:
    """A body over the limit, sent whole by a client that does not wait (urllib, http.client): it reads the 413,
    not a connection reset."""
    import http.client

    d = daemon_factory(start=False)  # type: ignore[operator]
    (d.home / "config.toml").write_text("max_body_bytes = 1000\n" + (d.home / "config.toml").read_text())
    d.start()
    for _ in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", body=b"x" * (8 * 1024 * 1024),
                         headers={"Authorization": f"Bearer {d.token}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 413 and resp.getheader("connection") == "close"
            assert "limit" in json.loads(resp.read())["error"]["message"]
        finally:
            conn.close()
