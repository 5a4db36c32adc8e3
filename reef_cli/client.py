"""A small synchronous client of the daemon's HTTP API, for the CLI, the wrappers and the TUI.

It reaches the daemon over ``$REEF_HOME/reef.sock``, or over TCP when ``REEF_URL`` is set (with ``REEF_TOKEN``,
or else the token in ``$REEF_HOME/token``), and can start the daemon when it is not running (``ensure_daemon``).
Error bodies come back as ``daemon.errors`` instances, so the CLI maps them to one message and one exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from daemon.config import Config
from daemon.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    ReefError,
    StorageError,
    Unauthorized,
    Unavailable,
)
from reef_cli.reach import unreachable

_BY_STATUS: dict[int, type[ReefError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    503: Unavailable,
    507: StorageError,
}

START_TIMEOUT_S = 120.0


def tcp_token(config: Config) -> str | None:
    """The token for ``REEF_URL`` (``Config.tcp_token``)."""
    return config.tcp_token()


class Client:
    def __init__(self, config: Config, *, timeout: float | None = 30.0) -> None:  # None: no timeout
        self.config = config
        if config.url:
            self.base_url = config.url.rstrip("/")
            token = tcp_token(config)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        else:
            self.base_url = "http://localhost"
            # no TLS on a Unix socket: no CA bundle to load (30-70 ms of every command's CPU)
            transport = httpx.HTTPTransport(uds=str(config.socket_path), verify=False)
            self._http = httpx.Client(base_url=self.base_url, transport=transport, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing ------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, *, raw: bool = False, **kwargs: Any) -> Any:
        """JSON (or text) of a successful answer, or the ``httpx.Response`` itself with ``raw``."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError) as e:
            raise unreachable(self.config, e) from None
        except httpx.TimeoutException:
            raise Unavailable(f"the daemon at {self.where()} did not answer {method} {path} in time") from None
        if resp.status_code >= 400:
            raise _error_from(resp)
        if raw:
            return resp
        if resp.headers.get("content-type", "").startswith("application/json"):
            return resp.json()
        return resp.text

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: dict[str, Any], *, timeout: float | None | object = ...) -> Any:
        extra: dict[str, Any] = {} if timeout is ... else {"timeout": timeout}
        return self.request("POST", path, json=body, **extra)

    def where(self) -> str:
        return self.config.url or str(self.config.socket_path)

    def healthy(self) -> bool:
        try:
            return bool(self._http.get("/healthz", timeout=2.0).status_code == 200)
        except (httpx.HTTPError, OSError):
            return False

    def lines(self, path: str, *, method: str = "GET", **params: Any) -> Iterator[str]:
        """The lines of a streamed answer (JSON Lines), as they come."""
        query = {k: v for k, v in params.items() if v is not None}
        try:
            with self._http.stream(method, path, params=query, timeout=None) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error_from(resp)
                yield from (line for line in resp.iter_lines() if line)
        except (httpx.ConnectError, FileNotFoundError) as e:
            raise unreachable(self.config, e) from None

    def events(self, after: int | None = None) -> Iterator[dict[str, Any]]:
        """Follow ``/reef/events``; yields event dicts until the stream ends."""
        import json

        params = {"after": after} if after is not None else {}
        with self._http.stream("GET", "/reef/events", params=params, timeout=None) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise _error_from(resp)
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])


def _error_from(resp: httpx.Response) -> ReefError:
    try:
        body = resp.json()
        err = body.get("error", body)
        message = err.get("message") or resp.text
    except (ValueError, AttributeError):
        message = resp.text or resp.reason_phrase
        err = {}
    cls = _BY_STATUS.get(resp.status_code, ReefError)
    e = cls(str(message))
    e.data.update({k: v for k, v in err.items() if k not in ("message", "type")} if isinstance(err, dict) else {})
    return e


# --- starting the daemon -----------------------------------------------------------------------------------


def read_pid(config: Config) -> int | None:
    try:
        pid = int(config.pid_path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def start_daemon(config: Config, *, timeout: float = START_TIMEOUT_S, progress: Any = None,
                 env: dict[str, str] | None = None) -> int:
    """Start the daemon in the background and wait until it answers ``/healthz``; returns its pid. ``env``: more
    environment for it (the provider flags of ``reef daemon start``, ``daemon/providers.py``)."""
    from daemon.server import ensure_home

    ensure_home(config)
    log_path = config.logs_dir / "daemon.log"
    env = dict(os.environ, **(env or {}), REEF_HOME=str(config.home))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "--log-file"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
            cwd=str(config.home),
        )
    probe = Client(_local(config))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if probe.healthy():
                return proc.pid
            if proc.poll() is not None:
                # a full or failing disk stopped it: exit 6 here too (its own line went to the log, if it could)
                cls = StorageError if proc.returncode == StorageError.exit_code else ReefError
                raise cls(
                    f"the daemon exited with status {proc.returncode} while starting; last log lines:\n"
                    + tail(log_path, 15)
                )
            if progress is not None:
                progress()
            time.sleep(0.05)
    finally:
        probe.close()
    raise ReefError(f"the daemon did not become healthy within {timeout:.0f} s; see {log_path}")


def _local(config: Config) -> Config:
    from dataclasses import replace

    return replace(config, url=None, token=None)


def ensure_daemon(config: Config) -> Client:
    """A client of a running daemon, starting a local one when needed (not when ``REEF_URL`` points elsewhere)."""
    client = Client(config)
    if client.healthy():
        return client
    if config.url:
        raise unreachable(config, ConnectionRefusedError("not healthy"))
    start_daemon(config)
    return client


def tail(path: Path, lines: int, *, end: int | None = None) -> str:
    """The last ``lines`` lines of ``path`` (of its first ``end`` bytes when given)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END) if end is None else end
            f.seek(max(0, size - 64 * 1024))
            data = f.read(size - f.tell()).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
