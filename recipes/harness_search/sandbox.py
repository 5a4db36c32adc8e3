"""The episode sandbox: bubblewrap (Debian ``bubblewrap``), no network but the daemon, one writable directory.

Measured here (bubblewrap 0.8, as root): ``--unshare-all`` gives the sandbox its own network namespace with only
its own loopback up, so nothing on the host (not even the host's 127.0.0.1) is reachable. The daemon is reached
through its Unix socket, bound into the sandbox, and a relay inside (``inside.py``) listening on the sandbox's
127.0.0.1 at the daemon's port number, so the agent's usual ``http://127.0.0.1:<port>`` base URL works unchanged.

The file system is the host's, read-only (``--ro-bind / /``), with fresh ``/dev``, ``/proc`` and an empty tmpfs on
``/tmp``, ``/var/tmp`` and every hidden path (the daemon's home: its records and token); the workspace copy is
the one path bound writable. The process tree gets its own PID namespace and dies with bubblewrap
(``--die-with-parent``), so killing bubblewrap at the time limit ends the whole episode.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from daemon.errors import ReefError

SOCKET_INSIDE = "/tmp/reef-episode/reef.sock"


def bwrap() -> str:
    found = shutil.which("bwrap")
    if found is None:
        raise ReefError("bubblewrap is not installed (Debian: apt-get install bubblewrap; or ./install.sh --dev); "
                        "harness-search runs its episodes in it")
    return found


def _empty() -> Path:
    """An empty read-only regular file to bind over hidden files."""
    import tempfile

    path = Path(tempfile.gettempdir()) / "reef-sandbox-empty"
    if not path.is_file() or path.stat().st_size:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(b"")
        tmp.chmod(0o444)
        os.replace(tmp, path)
    return path


def argv(cmd: list[str], *, workspace: Path, env: Mapping[str, str], socket: Path | None = None,
         hide: Iterable[str | Path] = (), ro_binds: Mapping[str, str] | None = None) -> list[str]:
    """The bubblewrap command line that runs ``cmd`` in ``workspace`` (writable) and nothing else writable;
    ``socket``: the daemon's Unix socket, bound at ``SOCKET_INSIDE``; ``hide``: host directories replaced by an
    empty tmpfs (files by an empty file; ``~`` expanded); ``ro_binds``: host path -> path inside (read-only), bound
    after the hiding, so a directory under a hidden one (the agents in ``$REEF_HOME/agents``) stays visible."""
    out = [bwrap(), "--die-with-parent", "--unshare-all", "--new-session", "--ro-bind", "/", "/",
           "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    for h in hide:
        path = Path(h).expanduser()
        if path.is_dir():
            out += ["--tmpfs", str(path)]
        elif path.exists():  # a file: an empty one in its place (not /dev/null: tmpfs mounts are nodev)
            out += ["--ro-bind", str(_empty()), str(path)]
    out += ["--bind", str(workspace), str(workspace)]
    if socket is not None:
        out += ["--bind", str(socket), SOCKET_INSIDE]
    for src, dst in (ro_binds or {}).items():
        out += ["--ro-bind", str(src), dst]
    out += ["--clearenv"]
    for k, v in env.items():
        out += ["--setenv", k, v]
    out += ["--chdir", str(workspace), "--", *cmd]
    return out
