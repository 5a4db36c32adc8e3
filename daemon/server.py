"""The daemon process: state dir, token, sockets, signals, pid file, graceful drain.

It listens on TCP (the token required), on ``reef.sock`` (no token: its 0600 mode is the auth) and on
``scoped.sock`` (0600 too, for sandboxes: every request needs a scoped token, ``daemon/scopes.py``; the full token
is refused there), so a sandbox that gets only ``scoped.sock`` can do no more than its token allows.

``run(config)`` serves until SIGTERM/SIGINT, then stops accepting, lets in-flight requests finish (up to
``DRAIN_TIMEOUT_S``), closes the engines and the record store, and removes its pid file and socket.

A start-up that a full, failing or read-only disk stops (the token, the record store, the release store, the
pid file) raises ``StorageError`` naming what could not be written: ``python -m daemon`` prints it as one line
and exits 6, never with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import signal
import socket
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

from daemon import durable, web
from daemon.app import make_app, refusal_body
from daemon.config import Config
from daemon.errors import ReefError, storage_error
from daemon.listening import tls_context
from daemon.serving import Reef

log = logging.getLogger("reef")

DRAIN_TIMEOUT_S = 60.0


def ensure_home(config: Config) -> None:
    config.home.mkdir(parents=True, exist_ok=True)
    os.chmod(config.home, 0o700)
    for sub in (config.logs_dir, config.models_dir, config.runs_dir):
        sub.mkdir(exist_ok=True)


def ensure_token(path: Path) -> str:
    """Read the token, creating it (0600, atomically) on first start."""
    try:
        token = path.read_text().strip()
        if token:
            os.chmod(path, 0o600)
            return token
    except FileNotFoundError:
        pass
    token = "reef-" + secrets.token_urlsafe(32)
    durable.write_atomic(path, (token + "\n").encode(), mode=0o600)
    return token


def _unix_socket(path: Path) -> socket.socket:
    """Bind the Unix socket with mode 0600 from the start (umask), replacing a stale one."""
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
        else:
            probe.close()
            raise ReefError(f"another daemon is already listening on {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ReefError(f"port {port} on {host} is already in use (set port in config.toml or --port)") from None
        raise
    sock.listen(1024)
    sock.setblocking(False)
    return sock


@contextlib.contextmanager
def storing(what: str) -> Iterator[None]:
    """Raise the ``StorageError`` of a full, failing or read-only disk met while doing ``what``."""
    try:
        yield
    except (OSError, sqlite3.Error) as e:
        err = storage_error(e, what)
        if err is None:
            raise
        raise err from e


def _write_pid(path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, path)


FD_RESERVE = 256  # file descriptors kept for what is not a client: the record store, git, models, the trainer


def raise_open_files_limit() -> int:
    """Raise the soft limit of open files to the hard one (at most 65536) and return it: the common soft limit of
    1,024 let about 1,000 idle client connections shut every other client out."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    except (ValueError, OSError):
        return soft


def max_connections(open_files: int) -> int:
    """Client connections the daemon holds at once, leaving ``FD_RESERVE`` descriptors for its own files."""
    return max(32, open_files - FD_RESERVE)


async def serve(config: Config, *, ready: asyncio.Event | None = None) -> None:
    open_files = raise_open_files_limit()
    with storing(f"preparing the state dir {config.home}"):
        ensure_home(config)
        token = ensure_token(config.token_path)
    ssl_ctx = tls_context(config.tls_cert, config.tls_key)  # a certificate that cannot load: refused before binding
    tcp = _tcp_socket(config.host, config.port)
    unix = _unix_socket(config.socket_path)
    scoped = _unix_socket(config.scoped_socket_path)
    reef: Reef | None = None
    server: web.Server | None = None
    scoped_server: web.Server | None = None
    serving = False
    try:
        with storing(f"opening the record store {config.records_shown}"):
            reef = Reef(config, token)
        with storing("starting the daemon"):
            await reef.start()
        # said only where the limit binds: a user behind a small hard limit (ulimit -Hn) learns why clients wait
        log.log(logging.INFO if max_connections(open_files) < 1024 else logging.DEBUG,
                "open files: %d; client connections at most %d", open_files, max_connections(open_files))
        server = web.Server(make_app(reef), ctx=reef, max_body=config.max_body_bytes, refusal=refusal_body,
                            max_connections=max_connections(open_files),
                            log_exception=_log_exception)
        await server.listen(tcp, ssl_ctx)
        await server.listen(unix)
        scoped_server = web.Server(make_app(reef, scoped_only=True), ctx=reef, max_body=config.max_body_bytes,
                                   refusal=refusal_body, log_exception=_log_exception)
        await scoped_server.listen(scoped)
        with storing(f"writing the pid file {config.pid_path}"):
            _write_pid(config.pid_path)
        port = tcp.getsockname()[1]
        scheme = "https" if config.tls_cert else "http"
        log.info("reef serving on %s://%s:%s and %s (pid %s)", scheme, config.host, port, config.socket_path,
                 os.getpid())
        if config.insecure_http:
            log.warning("serving %s beyond loopback over plain HTTP (insecure_http = true): the token crosses the "
                        "network in clear text", config.host)
        if config.provider is not None:  # where answers come from: the variable's name, never its value
            from daemon.providers import describe

            log.info("default model %s: %s", config.provider.name, describe(config.provider))
        serving = True
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("stopping: draining in-flight requests")
    finally:
        if server is not None and reef is not None:
            reef.events.close()  # ends event streams (TUI, progress bars): they are not work to drain
            await server.shutdown(DRAIN_TIMEOUT_S)  # stops accepting, waits for in-flight requests
        if scoped_server is not None:
            await scoped_server.shutdown(DRAIN_TIMEOUT_S)
        if reef is not None:
            await reef.close()
        for path in (config.pid_path, config.socket_path, config.scoped_socket_path):
            with contextlib.suppress(FileNotFoundError):
                if path == config.pid_path and path.read_text().strip() != str(os.getpid()):
                    continue
                path.unlink()
        tcp.close()
        unix.close()
        scoped.close()
        if serving:  # a start that failed says why in one line (``python -m daemon``), not twice
            log.info("stopped")


def _log_exception(request: web.Request) -> None:
    log.exception("unexpected error answering %s %s", request.method, request.path)


def setup_logging(config: Config, *, to_file: bool) -> None:
    # A log line that cannot be written (a full disk) is dropped: logging's default prints a traceback for each one
    logging.raiseExceptions = False
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if to_file:
        config.logs_dir.mkdir(parents=True, exist_ok=True)
        handlers = [logging.FileHandler(config.logs_dir / "daemon.log")]
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def run(config: Config) -> None:
    """Serve in the foreground until a signal (``reef serve``)."""
    import uvloop

    from daemon.providers import require_provider_key

    require_provider_key(config.provider, config.secrets)  # before anything starts: one line naming the variable

    uvloop.run(serve(config))
