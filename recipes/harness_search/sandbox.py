"""The episode sandbox: bubblewrap (Debian ``bubblewrap``), no network but the daemon's scoped socket, an
allow-list of read-only paths, one writable directory.

Measured here (bubblewrap 0.8, as root): ``--unshare-all`` gives the sandbox its own network namespace with only
its own loopback up, so nothing on the host (not even the host's 127.0.0.1) is reachable. The daemon is reached
through its scoped socket (``Config.scoped_socket_path``: every request there needs a scoped token, which allows
one scenario's sampling and runs only, ``daemon/scopes.py``), bound into the sandbox, and a relay inside
(``inside.py``) listening on the sandbox's 127.0.0.1 at the daemon's port number, so the agent's usual
``http://127.0.0.1:<port>`` base URL works unchanged. The daemon's main socket (no token needed) is never bound in.

The file system is an allow-list (``allowed()``), not the host's with holes: read-only, the system's programs and
libraries (``/usr``, ``/bin``, ``/lib*``...), the parts of ``/etc`` that programs read to start (the loader's
cache, users and groups, time zone, hosts, TLS roots; not ``/etc/shadow``), the Python that runs Reef (its prefix
and base prefix and the directories on its ``sys.path``, wherever they are, even under ``/tmp``), Reef's source
tree, Node.js where it lives outside ``/usr``, and what the caller adds (the agents directory, the episode's
spec); fresh ``/dev``, ``/proc``, and an empty tmpfs on ``/tmp`` (the episode's ``REEF_HOME`` and a fake
``HOME``, ``/tmp/home``) and ``/var/tmp``; the workspace copy is the one host path bound writable. So the agent
cannot read the user's home (``~/.claude``, ``~/.config``, shell history), other projects, or the daemon's home
(its records and token). ``hide`` hides paths under an allowed one as well (an empty tmpfs, or an empty file).
The process tree gets its own PID namespace and dies with bubblewrap (``--die-with-parent``), so killing
bubblewrap at the time limit ends the whole episode.
"""

from __future__ import annotations

import os
import shutil
import site
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from daemon.errors import ReefError

SOCKET_INSIDE = "/tmp/reef-episode/scoped.sock"
ROOT = Path(__file__).resolve().parents[2]  # Reef's source tree: daemon/, recipes/, adapters/, reef_cli/

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "nsswitch.conf",
       "passwd", "group", "hosts", "host.conf", "resolv.conf", "gai.conf", "protocols", "services", "ssl",
       "ca-certificates", "ca-certificates.conf", "mime.types", "os-release", "debian_version", "terminfo",
       "locale.alias", "inputrc", "shells")


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


def _python_paths() -> list[str]:
    """Where the running Python and its packages are: both prefixes, the interpreter's real directory, and every
    directory on ``sys.path`` (site-packages, a user site, editable installs) but the working directory."""
    out = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
           str(Path(sys.executable).resolve().parent), str(Path(sys.executable).parent)]
    cwd = os.getcwd()  # on sys.path only as an artefact of ``python -m`` (the daemon's is its home): left out
    out += [p for p in sys.path if p and os.path.isabs(p) and os.path.normpath(p) != cwd]
    try:
        out.append(site.getusersitepackages())
    except AttributeError:  # a Python without the site module's user parts
        pass
    return out


def _node_paths() -> list[str]:
    node = shutil.which("node")
    return [str(Path(node).resolve().parents[1])] if node else []


def allowed() -> list[str]:
    """The host paths an episode may read (each bound read-only at its own place), parents before children and
    nothing under a path already listed."""
    wanted = [*SYSTEM, *(f"/etc/{name}" for name in ETC), *_python_paths(), *_node_paths(), str(ROOT)]
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in wanted if os.path.lexists(p)}, key=lambda p: (p.count("/"), p)):
        if p != "/" and not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def argv(cmd: list[str], *, workspace: Path, env: Mapping[str, str], socket: Path | None = None,
         hide: Iterable[str | Path] = (), ro_binds: Mapping[str, str] | None = None) -> list[str]:
    """The bubblewrap command line that runs ``cmd`` in ``workspace`` (writable), with the ``allowed()`` paths
    read-only and nothing else of the host; ``socket``: the daemon's scoped socket, bound at ``SOCKET_INSIDE``;
    ``hide``: host paths under an allowed one replaced by an empty tmpfs (files by an empty file; ``~`` expanded);
    ``ro_binds``: host path -> path inside (read-only), bound after the hiding (the agents directory)."""
    out = [bwrap(), "--die-with-parent", "--unshare-all", "--new-session",
           "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp", "--dir", "/tmp/home"]
    bound = allowed()
    for path in bound:
        if os.path.islink(path) and path.count("/") == 1:  # /bin -> usr/bin on a merged-/usr system: the same link
            out += ["--symlink", os.readlink(path), path]
        else:
            out += ["--ro-bind", path, path]
    for h in hide:
        hidden = Path(h).expanduser()
        if not _under(str(hidden), bound):
            continue  # not bound in: nothing to hide
        if hidden.is_dir():
            out += ["--tmpfs", str(hidden)]
        elif hidden.exists():  # a file: an empty one in its place (not /dev/null: tmpfs mounts are nodev)
            out += ["--ro-bind", str(_empty()), str(hidden)]
    out += ["--bind", str(workspace), str(workspace)]
    if socket is not None:
        out += ["--bind", str(socket), SOCKET_INSIDE]
    for src, dst in (ro_binds or {}).items():
        out += ["--ro-bind", str(src), dst]
    out += ["--remount-ro", "/", "--clearenv"]
    for k, v in env.items():
        out += ["--setenv", k, v]
    out += ["--chdir", str(workspace), "--", *cmd]
    return out
