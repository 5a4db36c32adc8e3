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
