"""Messages a new user meets when something is not there (issue 44): after a daemon crash the CLI and the wrappers
printed raw errno texts (``[Errno 111] Connection refused``); ``reef serve --model nosuch`` named neither the setting
nor the models it knows. Now each names the daemon (or the setting), says what happened in words, and how to go on.

Real sockets: a crashed daemon's socket file (bound, nobody listening: what ``kill -9`` leaves), a server that
accepts and closes at once (a daemon that dies mid-request), a closed loopback port for ``REEF_URL``."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.config import load_config
from daemon.errors import DaemonNotRunning
from reef_cli.client import Client
from reef_cli.runs import call
from tests.conftest import ROOT, free_port


def home_env(home: Path, **extra: str) -> dict[str, str]:
    return {"REEF_HOME": str(home), "HOME": str(home), **extra}


def messages(env: dict[str, str]) -> list[str]:
    """What the wrapper's lean client and the CLI's client say for one request."""
    cfg = load_config(env)
    out = []
    with pytest.raises(DaemonNotRunning) as lean:
        call(cfg, "GET", "/reef/status", timeout=5)
    out.append(lean.value.message)
    # httpcore's sync Unix-socket connect leaves its socket to the garbage collector when the connect is refused:
    # collected here, its ResourceWarning is not this test's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        with Client(cfg, timeout=5) as c, pytest.raises(DaemonNotRunning) as full:
            c.get("/reef/status")
        gc.collect()
    out.append(full.value.message)
    return out


@pytest.fixture
def dead_socket(tmp_path: Path) -> Iterator[Path]:
    """The socket file a killed daemon leaves: bound, never listening again."""
    path = tmp_path / "reef.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    yield path
    s.close()


def test_a_crashed_daemons_socket_is_named_with_how_to_start_it(tmp_path: Path, dead_socket: Path) -> None:
    """Bugs caught: the errno text passed on, the socket path or the start command missing."""
    for text in messages(home_env(tmp_path)):
        assert "Errno" not in text and str(dead_socket) in text, text
        assert "is not answering (connection refused" in text and "reef daemon start" in text, text


def test_no_socket_at_all_says_not_running(tmp_path: Path) -> None:
    for text in messages(home_env(tmp_path)):
        assert "Errno" not in text and "is not running (no socket there)" in text and "reef daemon start" in text


def test_a_daemon_gone_mid_request_says_so(tmp_path: Path) -> None:
    """A server that reads the request and closes without answering, as a daemon killed mid-request does."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp_path / "reef.sock"))
    srv.listen(8)

    def serve() -> None:
        for _ in range(2):  # the two requests of ``messages``
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        texts = messages(home_env(tmp_path))
    finally:
        t.join(timeout=30)
        srv.close()
    for text in texts:
        assert "Errno" not in text and "gone mid-request" in text, text


def test_reef_url_that_does_not_answer_names_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for text in messages(home_env(tmp_path, REEF_URL=url, REEF_TOKEN="t")):
        assert "Errno" not in text and f"the Reef daemon at {url} is not answering" in text and "REEF_URL" in text


def test_serve_an_unknown_model_names_the_setting_and_the_models(tmp_path: Path) -> None:
    """Bugs caught: the flag's value reported as if from config.toml, the known models not listed."""
    env = {**home_env(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "serve", "--model", "nosuch"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "unknown model 'nosuch', from --model (it sets default_model)" in line, line
    assert "smollm2, tiny, tiny-demo" in line and "[models.NAME]" in line
    (tmp_path / "config.toml").write_text('default_model = "gone"\n')
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "serve"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and f"from default_model in {tmp_path / 'config.toml'}" in out.stderr, out.stderr
