"""A throwaway PostgreSQL cluster for tests and benchmarks: Debian's binaries, initdb in a temp dir, a free
loopback port, run as a non-root user (PostgreSQL refuses to run as root: as root, the ``postgres`` system user
that Debian's package creates, through ``runuser``)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def _bindir() -> Path | None:
    """Debian's server binaries (``/usr/lib/postgresql/<major>/bin``, the newest), else where ``initdb`` is."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name))
    if dirs:
        return Path(dirs[-1])
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """One cluster: ``start``, ``stop``, ``create_database``. ``durable=False`` (tests) turns fsync off, which
    only matters for a power cut (a stopped or killed server keeps what it committed); benchmarks keep it on."""

    def __init__(self, *, durable: bool = False) -> None:
        bindir = _bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql; install.sh --dev)")
        self.bindir = bindir
        self.durable = durable
        self.root = Path(tempfile.mkdtemp(prefix="reef-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user = "reef"
        self._as: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", self.user, "-A", "trust", "-E", "UTF8", "--locale=C",
                  "--no-sync", "--no-instructions")
        settings = [
            "listen_addresses = '127.0.0.1'", f"port = {self.port}", f"unix_socket_directories = '{self.root}'",
            "max_connections = 200", "shared_buffers = 32MB", "log_min_messages = warning",
        ]
        if not durable:
            settings += ["fsync = off", "full_page_writes = off"]
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("\n".join(settings) + "\n")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        proc = subprocess.run([*self._as, str(self.bindir / tool), *args], capture_output=True, text=True,
                              timeout=120, cwd=self.root)
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnects clients and shuts down cleanly; ``immediate``: like a crash)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def create_database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
