"""What a wrapper's runs keep and how a wrapper asks the daemon, shared by the wrapped run (``reef_cli/wrapper.py``)
and the wrapper's subcommands (``reef_cli/wrapper_cmd.py``): a light client of the daemon (standard library only,
so the path to the agent's first request stays short) and the run files under ``$REEF_HOME/runs``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from adapters import Adapter
from adapters.base import write_file
from daemon.config import Config
from daemon.errors import NotFound, ReefError
from reef_cli.reach import unreachable

# --- a light client of the daemon (stdlib only) ------------------------------------------------------------


def call(config: Config, method: str, path: str, body: Any = None, *, timeout: float = 60.0) -> Any:
    """One request to the daemon; JSON answer, or a ``ReefError`` carrying the daemon's message.

    A plain HTTP/1.0 exchange on a socket (the daemon closes the connection after answering): ``http.client``
    would cost the wrapper more start-up time than the whole request."""
    if config.url:
        from urllib.parse import urlsplit

        u = urlsplit(config.url)
        try:
            sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=timeout)
        except ConnectionError as e:
            raise unreachable(config, e) from None
        auth = f"Authorization: Bearer {config.tcp_token() or ''}\r\n"
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        auth = ""
    data = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.0\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    try:
        if not config.url:
            sock.connect(str(config.socket_path))
        sock.sendall(head + data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionError, FileNotFoundError) as e:  # refused, reset, no socket: said in words (``unreachable``)
        raise unreachable(config, e) from None
    finally:
        sock.close()
    raw = b"".join(chunks)
    if not raw:  # it took the request and closed without a word: the daemon went away mid-request
        raise unreachable(config, ConnectionResetError("closed without answering"))
    header, _, payload = raw.partition(b"\r\n\r\n")
    try:
        status = int(header.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise ReefError(f"the daemon sent no valid HTTP answer to {method} {path}") from None
    if status >= 400:
        from reef_cli.client import _BY_STATUS

        try:
            message = json.loads(payload)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = payload.decode("utf-8", "replace") or f"HTTP {status}"
        raise _BY_STATUS.get(status, ReefError)(message)
    return json.loads(payload) if payload else None


def call_starting(config: Config, method: str, path: str, body: Any = None) -> Any:
    """``call``, starting the local daemon first when it is not running."""
    from daemon.errors import DaemonNotRunning

    try:
        return call(config, method, path, body)
    except DaemonNotRunning:
        if config.url:
            raise
    from reef_cli.client import start_daemon

    say("starting the daemon")
    start_daemon(config)
    return call(config, method, path, body)


def say(message: str) -> None:
    if not os.environ.get("REEF_QUIET"):
        sys.stderr.write(f"reef: {message}\n")
        sys.stderr.flush()


def token(config: Config) -> str:
    if config.url:
        return config.tcp_token() or ""
    try:
        return config.token_path.read_text().strip()
    except FileNotFoundError:
        raise ReefError(f"no token at {config.token_path}; is the daemon's home right?") from None


# --- runs ----------------------------------------------------------------------------------------------------


def runs_dir(config: Config) -> Path:
    d = config.runs_dir
    d.mkdir(parents=True, exist_ok=True)
    return d


def save_run(config: Config, run: dict[str, Any]) -> None:
    d = runs_dir(config)
    write_file(d / f"{run['run']}.json", (json.dumps(run, indent=2) + "\n").encode())  # no-follow, durable
    write_file(d / f"last-{run['adapter']}", (run["run"] + "\n").encode())


def _reportable(run: dict[str, Any]) -> bool:
    """Not a run the daemon said made no model requests (one whose receipts could not be read when it ended is
    reportable: they are asked for again)."""
    return bool(run.get("receipts")) or not run.get("no_requests")


def load_run(config: Config, adapter: Adapter, run_id: str | None) -> dict[str, Any]:
    """The run ``run_id``, or (None) the newest run of ``adapter`` that made model requests: a run that made none (a
    typo passed to the agent, its help printed) is never the one a report scores."""
    d = runs_dir(config)
    if run_id is None:
        try:
            run_id = (d / f"last-{adapter.name}").read_text().strip()
        except FileNotFoundError:
            raise NotFound(f"no {adapter.command} run yet; run {adapter.command} first (or pass --run ID)") from None
        with contextlib.suppress(OSError, ValueError):
            last = json.loads((d / f"{run_id}.json").read_text()) if "/" not in run_id else None
            if isinstance(last, dict) and not _reportable(last):
                earlier = next((r for r in list_runs(config, adapter) if _reportable(r)), None)
                if earlier is None:
                    raise NotFound(f"the last {adapter.command} run ({run_id}) made no model requests, and no earlier "
                                   "one did: there is nothing to report on")
                return earlier
    path = d / f"{run_id}.json"
    if not path.is_file() or "/" in run_id:
        raise NotFound(f"no run {run_id!r} in {d}")
    run = json.loads(path.read_text())
    if not isinstance(run, dict):
        raise NotFound(f"{path} is not a run's file (a JSON object)")
    return run


def list_runs(config: Config, adapter: Adapter | None = None) -> list[dict[str, Any]]:
    out = []
    for p in runs_dir(config).glob("run_*.json"):
        try:
            run = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if adapter is None or run.get("adapter") == adapter.name:
            out.append(run)
    out.sort(key=lambda r: r.get("started_at", 0), reverse=True)
    return out


RECEIPTS_PAGE = 50  # receipts asked for at a time when collecting a run's (the daemon's default page)


def run_receipts(get: Any, run: str, failed: list[str] | None = None) -> list[str]:
    """Every exchange receipt of ``run``, oldest first, read page by page (``get(path)`` answers a GET): a run of
    an agent can make many more model requests than one page holds. ``failed`` gets the receipts of those that
    failed (status ``error``), in the same order."""
    out: list[str] = []
    after = ""
    while True:
        got = get(f"/reef/records?run={run}&kind=exchange&limit={RECEIPTS_PAGE}{after}")
        out += [r["id"] for r in got["records"]]
        if failed is not None:
            failed += [r["id"] for r in got["records"] if r.get("status") == "error"]
        if len(got["records"]) < RECEIPTS_PAGE or got.get("next_after") is None:
            return out
        after = f"&after={got['next_after']}"


def failed_requests(get: Any, failed: list[str], n: int) -> str:
    """One line for a run whose model requests failed: how many, and the last one's reason as its record holds it
    (the upstream's own words). An agent may print its own words instead (Claude Code answers a 404 with "There's
    an issue with the selected model"), or retry out of sight, so the wrapper says it once after the run."""
    try:
        rec = get(f"/reef/records/{failed[-1]}")
        reason = ((rec.get("response") or {}).get("error") or {}).get("message") or "no reason recorded"
    except (OSError, ReefError) as e:
        reason = f"its record could not be read ({e})"
    return (f"{len(failed)} of the run's {n} model request{'s' if n != 1 else ''} failed; the last: {reason} "
            f"(reef records show {failed[-1]})")
