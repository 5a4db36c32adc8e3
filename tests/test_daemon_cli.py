"""``reef daemon start|stop|status|logs``, ``reef serve``, on-demand start and draining, as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from tests.conftest import Daemon


def test_daemon_lifecycle_and_exit_codes(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(start=False)
    status = d.cli("daemon", "status", check=False)
    assert status.returncode == 3 and "not running" in status.stdout
    started = d.cli("daemon", "start")
    assert "started" in started.stdout
    pid = int((d.home / "reef.pid").read_text())
    assert d.cli("daemon", "status").returncode == 0
    again = d.cli("daemon", "start")
    assert "already running" in again.stdout and int((d.home / "reef.pid").read_text()) == pid
    assert "reef serving" in d.cli("daemon", "logs").stdout
    stopped = d.cli("daemon", "stop")
    assert "stopped" in stopped.stdout
    assert not (d.home / "reef.pid").exists() and not d.socket_path.exists()
    assert d.cli("daemon", "status", check=False).returncode == 3
    assert "not running" in d.cli("daemon", "stop").stdout


def test_commands_start_the_daemon_when_needed(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(start=False)
    out = d.cli("scenarios", "list", "--json")
    assert out.stdout.strip().startswith("[")
    assert d.cli("daemon", "status").returncode == 0
    d.cli("daemon", "stop")


def test_stop_drains_in_flight_requests(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory()
    results: list[httpx.Response] = []

    def slow_request() -> None:
        with d.http() as c:
            results.append(c.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 400, "temperature": 1.0, "stop": [],
                "messages": [{"role": "user", "content": "tell me a long story"}]}))

    t = threading.Thread(target=slow_request)
    t.start()
    time.sleep(0.3)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert d.proc.wait(60) == 0
    assert results and results[0].status_code == 200, results
    receipt = results[0].headers["x-reef-agent-record-id"]
    d.start()
    with d.http() as c:
        assert c.get(f"/reef/records/{receipt}").status_code == 200


def test_serve_in_foreground_with_port_flag(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(start=False)
    from tests.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "reef_cli.main", "serve", "--port", str(port)], env=d.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("reef serve did not come up")
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, out
    assert f"127.0.0.1:{port}" in out


def test_remote_daemon_via_reef_url(daemon: Daemon) -> None:
    env = dict(daemon.env, REEF_URL=daemon.url, REEF_TOKEN=daemon.token, REEF_HOME="/nonexistent-home")
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "status", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    bad = subprocess.run([sys.executable, "-m", "reef_cli.main", "status"], capture_output=True, text=True,
                         env=dict(env, REEF_TOKEN="wrong"), timeout=60)
    assert bad.returncode == 3 and "token" in bad.stderr


def test_second_daemon_on_same_home_refuses(daemon: Daemon) -> None:
    env = dict(daemon.env)
    out = subprocess.run([sys.executable, "-m", "daemon"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "already" in out.stderr
    assert os.path.exists(daemon.socket_path)


def test_model_init_and_first_start_build_the_tiny_model(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(start=False)
    (d.home / "config.toml").write_text(f'port = {d.port}\ndefault_model = "tiny"\n')  # the built-in tiny entry
    out = d.cli("model", "init", "tiny")
    model = d.home / "models" / "tiny"
    assert "tiny model ready" in out.stdout and (model / "config.json").exists()
    assert (model / "tokenizer_config.json").exists() and list(model.glob("*.safetensors"))
    assert "ready" in d.cli("model", "init", "tiny").stdout  # idempotent
    bad = d.cli("model", "init", "huge", check=False)
    assert bad.returncode == 2 and "huge" in bad.stderr
    import shutil

    shutil.rmtree(model)
    d.start(timeout=120)  # the daemon builds it on first start, in the background: a request waits for it
    with d.http() as c:
        resp = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "x"}]})
        assert c.get("/healthz").json()["models"]["loaded"] == ["tiny"]
    assert resp.status_code == 200
    assert (model / "config.json").exists()
