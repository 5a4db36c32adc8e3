"""A pre-imported daemon for the suite to fork: test daemons start in a fraction of a second of CPU.

A daemon's start is mostly imports: torch and transformers (with the tiny model's classes) cost about 4.5 s of CPU
per ``python -m daemon``, and the suite starts a few hundred daemons on two cores. The zygote imports them once
(per xdist worker), then forks a daemon per request: the child takes the test's environment and working directory,
writes to the test's log file and runs ``daemon.__main__`` exactly as ``python -m daemon --log-file`` would. Only
the interpreter's start and its imports are shared; config, stores, sockets and the model load are the child's own.

Used by ``tests/conftest.Daemon.start`` when every variable read at a process's start (``PYTHONPATH``, ``LD_PRELOAD``,
thread-pool sizes: ``AT_START``) is the zygote's own: a test that hides or adds modules, or traces file operations
with a preloaded library, gets a fresh interpreter, as does every test of ``reef daemon start`` and the installed
commands. The
zygote forks only while it has no threads of its own (it is one loop; the imports start none), so each child begins
as a fresh process would.

Protocol (a Unix socket, one connection per daemon): the client sends one JSON line ``{"env", "cwd", "log"}``; the
zygote answers ``{"pid": N}`` and, when that child exits, ``{"exit": code}`` (negative: the signal), then closes.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PRELOAD = (
    "daemon.__main__", "daemon.app", "daemon.engines.transformers", "daemon.engines.lora", "daemon.trainer",
    "transformers", "transformers.models.llama.modeling_llama", "peft", "safetensors.torch",
)


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: F401 - resolved lazily
    from transformers.cache_utils import DynamicLayer  # noqa: F401


def child(request: dict[str, Any], inherited: list[socket.socket]) -> None:
    """In the forked child: become the test's daemon process. Never returns."""
    code = 70
    try:
        for s in inherited:  # the zygote's listener and every client connection: none is the daemon's
            s.close()
        # signal dispositions are left as the zygote has them: those of a fresh interpreter (SIGPIPE ignored)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        sys.argv = [str(Path(__file__).resolve().parent.parent / "daemon" / "__main__.py"), "--log-file"]
        import random

        import numpy

        random.seed()
        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))

        from daemon.__main__ import exit_now, main

        exit_now(main(sys.argv[1:]))
    except BaseException as e:  # noqa: BLE001 - the child reports and exits; it never returns into the zygote's loop
        try:
            os.write(2, f"zygote child failed: {e!r}\n".encode())
        finally:
            os._exit(code)


def serve(path: str) -> None:
    """The zygote's loop: accept requests, fork daemons, report their exits; exits when its parent (the pytest
    worker) is gone."""
    preload()
    import threading

    if threading.active_count() != 1:  # a fork copies only the forking thread: a lock another held stays held
        names = [t.name for t in threading.enumerate()]
        raise SystemExit(f"the zygote's imports started threads ({names}): it cannot fork safely")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    buffers: dict[socket.socket, bytes] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *buffers], [], [], 0.05)
        for s in ready:
            if s is listener:
                conn, _ = listener.accept()
                buffers[conn] = b""
                continue
            data = s.recv(1 << 20)
            if not data:
                buffers.pop(s)
                s.close()
                continue
            buffers[s] += data
            if b"\n" in buffers[s]:
                request = json.loads(buffers.pop(s))
                pid = os.fork()
                if pid == 0:
                    child(request, [listener, s, *buffers, *children.values()])
                children[pid] = s
                s.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


class Forked:
    """What a test holds of a forked daemon: the parts of ``subprocess.Popen`` the suite uses."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self.conn, self.args = conn, args
        self.returncode: int | None = None
        self._buf = b""
        self.pid = int(self._message(None)["pid"])

    def _message(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            data = self.conn.recv(4096)
            if not data:
                raise RuntimeError("the zygote closed the connection without the daemon's exit status")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(0)["exit"])
            except subprocess.TimeoutExpired:
                return None
            self.conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._message(timeout)["exit"])
            self.conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# read when a process starts (the loader, the interpreter, the libraries' thread pools): a test whose daemon needs
# other values than the zygote's gets a fresh interpreter
AT_START = ("LD_", "PYTHON", "MALLOC_", "OMP_", "MKL_", "GOMP_")


class Zygote:
    """The client side: start the zygote once, fork daemons from it."""

    def __init__(self, root: Path, workdir: Path) -> None:
        self.workdir = workdir
        self.path = str(workdir / "zygote.sock")
        env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r}); "
                                   f"from tests.zygote import serve; serve({self.path!r})"],
            env=env, stdout=subprocess.PIPE, cwd=workdir,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # what an import printed comes first
            if line.strip() == b"ready":
                break
        else:
            raise RuntimeError(f"the zygote did not start (exit {self.proc.wait()})")

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a daemon with ``env`` would start the same from the zygote as from a fresh interpreter."""
        return all(env.get(k) == self.env.get(k) for k in {*env, *self.env} if k.startswith(AT_START))

    def spawn(self, env: dict[str, str], cwd: Path, log: Path) -> Forked:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps({"env": env, "cwd": str(cwd), "log": str(log)}).encode() + b"\n")
        return Forked(conn, [sys.executable, "-m", "daemon", "--log-file"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


_STARTED: list[Zygote] = []


def worker_zygote(root: Path) -> Zygote | None:
    """This pytest process's zygote (started on first use, stopped at exit), or None where
    ``REEF_TESTS_FRESH_DAEMONS=1`` switches it off. Kept here, not in conftest: pytest imports ``tests/conftest.py``
    as ``conftest`` and test modules import it again as ``tests.conftest``, and each copy would start its own."""
    if os.environ.get("REEF_TESTS_FRESH_DAEMONS") == "1":
        return None
    if not _STARTED:
        import atexit
        import tempfile

        z = Zygote(root, Path(tempfile.mkdtemp(prefix="reef-zygote-", dir="/tmp")))
        atexit.register(z.close)
        _STARTED.append(z)
    return _STARTED[0]
