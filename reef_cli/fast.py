"""The ``reef`` command's entry point: ``reef --help``, ``reef status`` and the shell completions' questions
(``reef __complete scenarios|releases``) answered with the standard library alone, everything else handed to the
typer app (``reef_cli/main.py``).

Why: typer and its click fork cost 120-350 ms of imports and rendering before a command runs, several times a
bare interpreter's start. ``reef --help`` prints ``help.txt`` (typer's own help, written by
``python -m reef_cli.fast --write-help`` and kept equal to it by ``tests/test_cli_docs.py``); ``reef status``
asks a running daemon over its Unix socket and prints what ``reef_cli.main.status`` prints. Anything else, a
daemon that is not running (``status`` starts it) or ``REEF_URL`` (TCP, a token) goes the full way.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

from reef_cli.status import status_lines

HELP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "help.txt")


def _status() -> dict[str, Any] | None:
    """``GET /reef/status`` over the daemon's socket; None when it cannot be asked this way."""
    status = _get("/reef/status", 30)
    return status if isinstance(status, dict) else None


def _get(path: str, timeout: float) -> Any:
    """``GET path`` over the daemon's Unix socket, as JSON; None when it cannot be asked this way."""
    home = os.environ.get("REEF_HOME") or os.path.join(os.path.expanduser("~"), ".reef")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.path.join(home, "reef.sock"))
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    except OSError:
        return None
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return None  # the full path says why, in its own words
    try:
        return json.loads(body)
    except ValueError:
        return None


COMPLETE_TIMEOUT_S = 0.5  # a Tab waits at most this for the daemon


def complete(args: list[str]) -> list[str]:
    """What the shell completions offer from the running daemon: ``scenarios`` (their names), ``releases
    [SCENARIO]`` (its release and pending ids, newest first). Nothing when the daemon is down or slow, or the
    question is not one of these: a completion never prints an error."""
    from urllib.parse import quote

    if args[:1] == ["scenarios"]:
        data = _get("/reef/scenarios", COMPLETE_TIMEOUT_S)
        return [s["name"] for s in (data or {}).get("scenarios", []) if isinstance(s, dict) and "name" in s]
    if args[:1] == ["releases"]:
        scenario = (args[1:2] or [""])[0] or "default"
        data = _get(f"/reef/scenarios/{quote(scenario, safe='')}/releases?all=1", COMPLETE_TIMEOUT_S) or {}
        rows = [*data.get("pending", []), *data.get("releases", [])]
        return [r["release_id"] for r in rows if isinstance(r, dict) and "release_id" in r]
    return []


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["__complete"]:
        try:
            words = complete(args[1:])
        except (ValueError, TypeError, AttributeError):  # an answer of another shape: offer nothing
            words = []
        sys.stdout.write("".join(f"{w}\n" for w in words))
        return
    if args in ([], ["--help"]):
        with open(HELP, encoding="utf-8") as f:
            sys.stdout.write(f.read())
        sys.exit(0 if args else 2)  # as typer's app: `reef` alone is a usage error that shows the help
    if args in (["status"], ["status", "--json"]) and not os.environ.get("REEF_URL"):
        info = _status()
        if info is not None:
            out = json.dumps(info, indent=2, ensure_ascii=False) if "--json" in args else "\n".join(status_lines(info))
            sys.stdout.write(out + "\n")
            return
    from reef_cli.main import main as full

    full()


def write_help() -> None:
    """Write ``help.txt`` from the typer app's own ``reef --help``."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "--help"], capture_output=True, text=True,
                         check=True).stdout
    with open(HELP, "w", encoding="utf-8") as f:
        f.write(out)


if __name__ == "__main__":
    write_help() if sys.argv[1:] == ["--write-help"] else main()
