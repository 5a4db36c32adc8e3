"""Bad input and hardening (shared/TESTING.md items 6 and 7): every bad request gets a 4xx in the canonical
shape, none a 5xx or a hang, and the daemon keeps serving."""

from __future__ import annotations

import json
import os
import re
import socket
import stat

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Daemon, assert_canonical_error

ROUTES = [
    ("/v1/chat/completions", "openai"),
    ("/v1/responses", "openai"),
    ("/v1/messages", "anthropic"),
    ("/v1/messages/count_tokens", "anthropic"),
    ("/reef/report", "reef"),
    ("/reef/scenarios", "reef"),
]

BAD_BODIES: list[tuple[str, bytes]] = [
    ("deep nesting", b"[" * 100_000),
    ("5000-digit int", b'{"model":"tiny","max_tokens":' + b"9" * 5000 + b"}"),
    ("NaN", b'{"model":"tiny","temperature":NaN,"messages":[]}'),
    ("Infinity", b'{"score":Infinity,"references":["x"]}'),
    ("duplicate keys", b'{"model":"a","model":"b","messages":[]}'),
    ("lone surrogate", b'{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"\\ud800"}]}'),
    ("BOM", b'\xef\xbb\xbf{"model":"tiny"}'),
    ("invalid utf-8", b'{"model":"\xff\xfe"}'),
    ("empty", b""),
    ("not json", b"hello"),
    ("json array", b"[1,2,3]"),
    ("json string", b'"x"'),
    ("truncated", b'{"model":"tiny","messages":[{"role":"user"'),
    ("wrong types", b'{"model":5,"messages":"hi","max_tokens":"9"}'),
    ("bool max_tokens", b'{"model":"tiny","max_tokens":true,"messages":[{"role":"user","content":"x"}]}'),
    ("negative max_tokens", b'{"model":"tiny","max_tokens":-1,"messages":[{"role":"user","content":"x"}]}'),
    ("bad role", b'{"model":"tiny","max_tokens":4,"messages":[{"role":"wizard","content":"x"}]}'),
    ("null messages", b'{"model":"tiny","max_tokens":4,"messages":null}'),
]


@pytest.mark.parametrize("route,shape", ROUTES)
@pytest.mark.parametrize("name,body", BAD_BODIES, ids=[n for n, _ in BAD_BODIES])
def test_bad_bodies_get_canonical_4xx(daemon: Daemon, route: str, shape: str, name: str, body: bytes) -> None:
    with daemon.http() as c:
        resp = c.post(route, content=body, headers={"content-type": "application/json"})
    assert_canonical_error(resp, tuple(range(400, 500)), shape)


def test_daemon_still_serves_after_bad_input(daemon: Daemon) -> None:
    with daemon.http() as c:
        for _, body in BAD_BODIES:
            c.post("/v1/chat/completions", content=body)
        ok = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200, ok.text


def test_images_refused_for_text_only_model(daemon: Daemon) -> None:
    with daemon.http() as c:
        resp = c.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "text", "text": "what is this?"}]}]})
        err = assert_canonical_error(resp, 400, "anthropic")
        assert "image" in err["message"]
        resp = c.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]})
        assert "image" in assert_canonical_error(resp, 400, "openai")["message"]


def test_prompt_beyond_context_is_a_clear_400(daemon: Daemon) -> None:
    with daemon.http() as c:
        huge = "lorem ipsum dolor sit amet " * 60_000
        resp = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": huge}]})
    err = assert_canonical_error(resp, 400, "openai")
    assert "context" in err["message"]


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_arbitrary_json_never_5xx(daemon: Daemon, value: object) -> None:
    body = json.dumps(value).encode()
    with daemon.http() as c:
        for route, _ in ROUTES[:3]:
            resp = c.post(route, content=body)
            assert resp.status_code < 500, (route, body, resp.text)


@given(st.fixed_dictionaries({
    "model": st.text(max_size=5),
    "max_tokens": st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=3), st.none()),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system", "tool", "bogus"]),
        "content": st.one_of(st.text(max_size=10), st.lists(st.dictionaries(
            st.sampled_from(["type", "text", "tool_use_id", "id", "input"]),
            st.one_of(st.text(max_size=8), st.integers()), max_size=3), max_size=3)),
    }), max_size=3),
}))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_messages_shaped_garbage_never_5xx(daemon: Daemon, body: dict[str, object]) -> None:
    with daemon.http() as c:
        for route in ("/v1/messages", "/v1/chat/completions"):
            resp = c.post(route, json=body)
            assert resp.status_code < 500, (route, body, resp.text)


# --- hardening -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,method", [("/v1/chat/completions", "POST"), ("/v1/messages", "POST"),
                                         ("/v1/models", "GET"), ("/reef/status", "GET"), ("/reef/scenarios", "GET"),
                                         ("/reef/events", "GET"), ("/metrics", "GET"), ("/", "HEAD")])
def test_missing_or_wrong_token_is_401(daemon: Daemon, path: str, method: str) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}, {"Authorization": "Basic abc"}):
        resp = httpx.request(method, daemon.url + path, headers=headers)
        assert resp.status_code == 401
        if method != "HEAD":
            assert_canonical_error(resp, 401, "anthropic" if "messages" in path else "reef")


def test_token_as_x_api_key_and_bearer(daemon: Daemon) -> None:
    assert httpx.get(daemon.url + "/reef/status", headers={"x-api-key": daemon.token}).status_code == 200
    assert httpx.get(daemon.url + "/reef/status", headers={"Authorization": f"Bearer {daemon.token}"}).status_code == 200


def test_healthz_is_open(daemon: Daemon) -> None:
    assert httpx.get(daemon.url + "/healthz").status_code == 200


def test_wrong_host_is_400(daemon: Daemon) -> None:
    # look-alikes of loopback names: a suffix test without the dot would let "evillocalhost" through
    for host in ("evil.example", "attacker.com:8900", "192.168.1.10", "evillocalhost", "xlocalhost:8900"):
        resp = httpx.get(daemon.url + "/reef/status", headers={"Host": host, "x-api-key": daemon.token})
        assert_canonical_error(resp, 400)
    for host in ("localhost", f"127.0.0.1:{daemon.port}", "[::1]:8900", "LOCALHOST"):
        resp = httpx.get(daemon.url + "/reef/status", headers={"Host": host, "x-api-key": daemon.token})
        assert resp.status_code == 200, host


def test_host_check_refuses_look_alikes_of_localhost_and_of_the_served_names() -> None:
    from daemon.listening import answered_names, host_ok

    names = answered_names("0.0.0.0", ("reef.lan", "10.0.0.5", "fd00::5"))
    for host in ("evillocalhost", "xlocalhost:8900", "localhost.evil.example", "notlocalhost.", "127.0.0.1.evil",
                 "reef.lan.evil.example", "evilreef.lan", "10.0.0.50", "10.0.0.5.evil", "reef.lan:8900@evil.com",
                 "[fd00::50]", "0.0.0.0"):
        assert not host_ok(host, names), host
    for host in ("localhost", "a.localhost", "app.localhost:8900", "localhost.", "127.9.9.9:1", "REEF.lan:8900",
                 "reef.lan.", "10.0.0.5:8900", "[fd00:0::5]:8900"):
        assert host_ok(host, names), host
    assert not host_ok("reef.lan", answered_names("127.0.0.1", ()))  # nothing beyond loopback unless named
    assert answered_names("10.0.0.7", ()) == {"10.0.0.7"}  # one address: its clients' Host is that address


def test_socket_and_token_are_private(daemon: Daemon) -> None:
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.home / "token").st_mode) == 0o600


def test_unix_socket_needs_no_token(daemon: Daemon) -> None:
    with daemon.unix() as c:
        assert c.get("/reef/status").status_code == 200


def test_oversized_body_is_413_without_reading_it(daemon: Daemon) -> None:
    d = daemon
    # A declared length over the limit (default 64 MiB) is refused before the body is sent: we send only headers.
    s = socket.create_connection(("127.0.0.1", d.port))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + d.token.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(200 * 1024 * 1024).encode() + b"\r\n\r\n"
    )
    s.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    s.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]


def test_small_limit_applies_to_chunked_bodies(daemon_factory: object) -> None:
    d = daemon_factory()  # type: ignore[operator]
    d.stop()
    config = (d.home / "config.toml").read_text()
    (d.home / "config.toml").write_text("max_body_bytes = 1000\n" + config)
    d.start()

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(100):
            yield b" " * 100

    with d.http() as c:
        resp = c.post("/v1/chat/completions", content=chunks())
        assert_canonical_error(resp, 413, "openai")
        resp = c.post("/v1/chat/completions", content=b" " * 2000)
        assert_canonical_error(resp, 413, "openai")


def test_lying_content_length_is_4xx_and_daemon_keeps_serving(daemon: Daemon) -> None:
    s = socket.create_connection(("127.0.0.1", daemon.port))
    body = b'{"model":"tiny"}'
    s.sendall(
        b"POST /reef/report HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + daemon.token.encode()
        + b"\r\nContent-Length: 5\r\n\r\n" + body
    )
    s.settimeout(10)
    data = s.recv(65536)
    s.close()
    # the bytes beyond the declared length are a malformed next request: refused, connection closed
    assert re.match(rb"HTTP/1\.[01] 4\d\d", data), data[:200]
    with daemon.http() as c:
        assert c.get("/reef/status").status_code == 200


def test_slow_client_does_not_starve_others(daemon: Daemon) -> None:
    s = socket.create_connection(("127.0.0.1", daemon.port))
    s.sendall(b"POST /reef/report HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n")  # head unfinished
    with daemon.http() as c:
        for _ in range(5):
            assert c.get("/healthz").status_code == 200
    # the others were served while the slow request was still in progress: it is open and unanswered yet
    s.setblocking(False)
    with pytest.raises(BlockingIOError):
        s.recv(1)
    s.settimeout(30)
    s.sendall(b"\r\n" + b"x" * 100)  # now it finishes, and only now gets its answer
    assert re.match(rb"HTTP/1\.1 4\d\d", s.recv(65536))
    s.close()


def test_token_never_in_logs_or_records(daemon: Daemon) -> None:
    with daemon.http() as c:
        c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "x"}]},
               headers={"x-custom-api-key": "sekrit-123", "x-reef-run": "tok-check"})
        httpx.get(daemon.url + "/reef/status", headers={"Authorization": "Bearer wrong-token-xyz"})
    log = (daemon.home / "logs" / "daemon.log").read_text()
    assert daemon.token not in log and "wrong-token-xyz" not in log
    db = (daemon.home / "records.sqlite3").read_bytes()
    wal = daemon.home / "records.sqlite3-wal"
    blob = db + (wal.read_bytes() if wal.exists() else b"")
    assert daemon.token.encode() not in blob and b"sekrit-123" not in blob


def test_invalid_scenario_names_are_400(daemon: Daemon) -> None:
    with daemon.http() as c:
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        for bad in ("-x", "a b", "x" * 100, "../etc", "é"):
            resp = c.post("/v1/chat/completions", json=body, headers={"x-reef-scenario": bad.encode()})
            assert_canonical_error(resp, 400, "openai")
        resp = c.post("/s/bad name/v1/chat/completions", json=body)
        assert_canonical_error(resp, (400, 404), "openai")
        resp = c.post("/s/ok/r/-bad/v1/chat/completions", json=body)
        assert_canonical_error(resp, 400, "openai")


@given(st.binary(max_size=300))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_raw_bytes_never_5xx(daemon: Daemon, raw: bytes) -> None:
    with daemon.http() as c:
        for route, shape in ROUTES[:5]:
            resp = c.post(route, content=raw)
            assert_canonical_error(resp, tuple(range(400, 500)), shape)


def test_idle_connections_past_the_open_file_limit_do_not_shut_others_out(daemon_factory) -> None:
    """Under a small open-file limit (hard 400, so the daemon cannot raise it), more idle connections than it can
    hold: the daemon closes the ones idle longest to make room, and a new client is answered at once. Without
    the bound, accept() met EMFILE and new clients waited in the backlog until idle connections timed out (75 s)."""
    import subprocess
    import sys
    import time

    from tests.conftest import probe_unix

    d: Daemon = daemon_factory(start=False)
    log = open(d.home / "logs" / "daemon.log", "ab")  # noqa: SIM115 - the child owns it
    d.proc = subprocess.Popen(["prlimit", "--nofile=400:400", sys.executable, "-m", "daemon", "--log-file"],
                              env=d.env, stdout=log, stderr=log, cwd=d.home)
    log.close()
    deadline = time.monotonic() + 180
    while not probe_unix(d.socket_path):
        assert d.proc.poll() is None and time.monotonic() < deadline, d.log_tail()
        time.sleep(0.05)
    assert "client connections at most 144" in d.log_tail()  # 400 - 256 kept for the daemon's own files
    idle = []
    try:
        for _ in range(600):  # connected, never sending a byte
            idle.append(socket.create_connection(("127.0.0.1", d.port)))
        for _ in range(5):  # each new client (a new connection) makes its own room
            with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=20) as c:
                assert c.get("/reef/status").status_code == 200
        with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=20) as c:
            assert c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]}).status_code == 200
    finally:
        for s in idle:
            s.close()
