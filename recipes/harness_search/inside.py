"""What runs inside the episode sandbox: a relay from the sandbox's loopback to the daemon's socket, the agent's
config home with the episode's harness, and the real wrapper (``reef-pi``...) run headless.

Run as ``python -m recipes.harness_search.inside SPEC`` (``SPEC``: a read-only JSON file, see ``episodes.py``).
Prints one JSON line: ``{"run", "exit", "output"}`` (the wrapper's run id, its exit status, its output's tail).

The sandbox has the daemon's scoped socket only (``/tmp/reef-episode/scoped.sock``), where every request needs a
token scoped to the episodes scenario (``daemon/scopes.py``): the daemon refuses the rest whatever connects. The
wrapper and the agent reach the daemon through the relay (``REEF_URL``) with that token (``REEF_TOKEN``, from the
spec). The relay's filter stays as a second line, not the one the daemon relies on.

The relay is a filter, not only a pipe: each connection carries one request (``Connection: close`` is forced),
and only the routes a wrapped run uses pass (the episode scenario's ``/s/<scenario>/...`` provider routes,
``POST /reef/runs``, ``GET /reef/records?run=``); anything else is answered 403, so an agent in an episode cannot
reach the rest of the daemon's API (reports, rollbacks, other scenarios' records) through it.

Bodies: a provider request's body cannot leave its scenario (the path names it, and the daemon takes the path's
over any header), but ``POST /reef/runs`` names its scenario in the body: unchecked, an agent could read any
scenario's harness through it, and create scenarios. So that body is read whole (``Content-Length`` only, at most
64 kB) and passes only when it names the episode's scenario; a request pipelined behind any request is never
served (``Connection: close`` is forced, and the daemon answers one request of such a connection).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HOME = Path("/tmp/reef-episode")  # the episode's REEF_HOME (tmpfs); the daemon's scoped socket is bound at SOCKET
SOCKET = HOME / "scoped.sock"  # sandbox.SOCKET_INSIDE

AGENT_ARGS = {  # headless, one prompt (CLIENTS.md); Claude Code asks before each edit unless told not to
    "pi": lambda prompt: ["-p", "--no-session", prompt],
    "claude": lambda prompt: ["-p", "--permission-mode", "acceptEdits", prompt],
    "opencode": lambda prompt: ["run", *prompt.split()],
    "codex": lambda prompt: ["-p", prompt],
}


MAX_RUNS_BODY = 65536


def _forbidden(client: socket.socket, why: str) -> None:
    body = json.dumps({"error": {"type": "forbidden", "message": why}}).encode()
    client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nConnection: close\r\n"
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def _runs_body(client: socket.socket, headers: list[str], rest: bytes, scenario: str) -> bytes | str:
    """The whole body of a ``POST /reef/runs`` when it names ``scenario``; else why it does not pass."""
    names = [h.split(":", 1) for h in headers if ":" in h]
    if any(k.strip().lower() == "transfer-encoding" for k, _ in names):
        return "POST /reef/runs from an episode sandbox must send a Content-Length body, not a chunked one"
    lengths = [v.strip() for k, v in names if k.strip().lower() == "content-length"]
    if len(lengths) != 1 or not lengths[0].isdigit() or int(lengths[0]) > MAX_RUNS_BODY:
        return f"POST /reef/runs from an episode sandbox needs one Content-Length of at most {MAX_RUNS_BODY}"
    n = int(lengths[0])
    while len(rest) < n:
        chunk = client.recv(65536)
        if not chunk:
            return "the body ended early"
        rest += chunk
    try:
        body = json.loads(rest[:n])
    except ValueError:
        return "POST /reef/runs needs a JSON body"
    if not isinstance(body, dict) or body.get("scenario") != scenario:
        got = body.get("scenario") if isinstance(body, dict) else None
        return f"an episode sandbox starts runs of scenario {scenario!r} only, not {got!r}"
    return rest[:n]  # bytes after it would be a request pipelined behind: dropped


def allowed(method: str, target: str, scenario: str) -> bool:
    if target.startswith(f"/s/{scenario}/") and ".." not in target:
        return True
    return (method, target) == ("POST", "/reef/runs") or (method == "GET" and target.startswith("/reef/records?run="))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve(client: socket.socket, scenario: str) -> None:
    try:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = client.recv(65536)
            if not chunk:
                return
            head += chunk
        raw_head, _, rest = head.partition(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        method, target = (lines[0].split(" ") + ["", ""])[:2]
        if not allowed(method, target, scenario):
            _forbidden(client, f"{method} {target} is not reachable from an episode sandbox")
            return
        if method == "POST":
            checked = _runs_body(client, lines[1:], rest, scenario) if target == "/reef/runs" else rest
            if isinstance(checked, str):
                _forbidden(client, checked)
                return
            rest = checked
        kept = [h for h in lines[1:] if h.split(":", 1)[0].strip().lower() not in ("connection", "keep-alive")]
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(str(SOCKET))
        upstream.sendall("\r\n".join([lines[0], *kept, "Connection: close"]).encode("latin-1") + b"\r\n\r\n" + rest)
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        upstream.close()
    except OSError:
        pass
    finally:
        client.close()


def relay(port: int, scenario: str) -> socket.socket:
    """Listen on the sandbox's 127.0.0.1:``port``; each connection goes to the daemon's socket (filtered)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(64)

    def loop() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_serve, args=(c, scenario), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv


def main(spec_path: str) -> int:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    from adapters import get_adapter
    from adapters.base import install_harness

    adapter = get_adapter(spec["adapter"])
    scenario = spec["scenario"]
    (HOME / "logs").mkdir(parents=True, exist_ok=True)
    (HOME / "config.toml").write_text(
        f"port = {int(spec['port'])}\nagents_dir = {json.dumps(spec['agents_dir'])}\nharness_updates = \"notify\"\n")
    token = spec.get("token") or ""
    (HOME / "token").write_text(token + "\n")
    agent_home = adapter.home(HOME / "homes", scenario)
    # installed as the release that holds it, and harness_updates = notify: the wrapper keeps it and pins it
    install_harness(agent_home, spec.get("release_id"), {p: t.encode() for p, t in spec["files"].items()})
    relay(int(spec["port"]), scenario)
    user_home = Path("/tmp/home")
    user_home.mkdir(exist_ok=True)
    env = {**os.environ, "REEF_HOME": str(HOME), "HOME": str(user_home), "REEF_QUIET": "1",
           "REEF_URL": f"http://127.0.0.1:{int(spec['port'])}", "REEF_TOKEN": token}
    log = HOME / "agent.log"
    with open(log, "wb") as out:
        code = subprocess.call([sys.executable, "-m", "reef_cli.wrapper", adapter.name, "--reef-scenario", scenario,
                                *AGENT_ARGS[adapter.name](spec["prompt"])], env=env, stdout=out, stderr=out,
                               stdin=subprocess.DEVNULL, cwd=spec["workspace"])
    run = None
    try:
        run = (HOME / "runs" / f"last-{adapter.name}").read_text().strip()
    except OSError:
        pass
    tail = log.read_bytes()[-2000:].decode("utf-8", "replace")
    sys.stdout.write(json.dumps({"run": run, "exit": code, "output": tail}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
