"""``reef tui`` start-up: from launching ``reef tui -s SCENARIO`` to the first painted release-chain screen
(goal: at most 1.5 s), against a real daemon whose scenario has a chain of releases.

Each run launches the real command in a pseudo-terminal (120x40), as a person would, with the hidden flag
``--exit-after-paint``: the app exits right after Textual has painted the chain screen with the chain's rows,
and prints the wall-clock time of that paint. We print the median and the spread over the runs, and, for
scale, ``reef --help`` and ``python -c pass`` in the same run.

Run: ``.venv/bin/python bench/tui_start.py [--runs N] [--releases N]``
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GOAL_S = 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon(home: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = open(home / "logs" / "daemon.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--log-file"], env=env, stdout=log, stderr=log, cwd=home)
    log.close()
    deadline = time.monotonic() + 120
    with httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=str(home / "reef.sock"))) as c:
        while time.monotonic() < deadline:
            try:
                if c.get("/healthz", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited: see {home / 'logs' / 'daemon.log'}")
            time.sleep(0.1)
    raise SystemExit("the daemon did not start in 120 s")


def seed(home: Path, scenario: str, releases: int) -> None:
    from daemon.releases import ReleaseStore, files_from_dir

    with httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=str(home / "reef.sock")),
                      timeout=120) as c:
        c.post("/reef/scenarios", json={"name": scenario}).raise_for_status()
    store = ReleaseStore(home / "artifacts.git")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        shutil.copytree(home / "models" / "tiny", model)
        for i in range(releases):
            (model / "NOTES.md").write_text(f"release {i}\n")
            store.publish(scenario, files_from_dir(model), expected_head=store.head(scenario), operation="train",
                          kind="weights", recipe="record", metrics={"batch_reward": i / releases, "loss": 1 - i / 99})


def run_tui(env: dict[str, str], scenario: str) -> tuple[float, float]:
    """Seconds to the first painted chain screen, and to the process's exit."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    script = shutil.which("reef", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "reef_cli.main"]
    t0 = time.time()
    proc = subprocess.Popen([*cmd, "tui", "-s", scenario, "--exit-after-paint"], stdin=slave, stdout=slave,
                            stderr=slave, env={**env, "TERM": "xterm-256color"}, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    t_exit = time.time() - t0
    os.close(master)
    m = re.search(rb"painted (\d+\.\d+)", out)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"reef tui failed ({proc.returncode}): {out[-2000:]!r}")
    return float(m.group(1)) - t0, t_exit


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="launches of reef tui")
    ap.add_argument("--releases", type=int, default=30, help="releases on the scenario's chain")
    args = ap.parse_args()
    from daemon.models import init_tiny

    home = Path(tempfile.mkdtemp(prefix="reef-bench-", dir="/tmp"))
    (home / "logs").mkdir()
    init_tiny(home / "models" / "tiny", seed=0)
    (home / "config.toml").write_text(f"port = {free_port()}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    env.update(REEF_HOME=str(home), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    daemon = start_daemon(home, env)
    try:
        seed(home, "bench", args.releases)
        run_tui(env, "bench")  # warm the page cache
        paints, exits = [], []
        for _ in range(args.runs):
            paint, done = run_tui(env, "bench")
            paints.append(paint)
            exits.append(done)
        reef = [shutil.which("reef", path=str(Path(sys.executable).parent)) or "reef", "--help"]
        helps = [timed(reef, env) for _ in range(args.runs)]
        bare = [timed([sys.executable, "-c", "pass"], env) for _ in range(args.runs)]
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(home, ignore_errors=True)
    print(f"reef tui -s bench ({args.releases + 1} releases): first painted chain screen, median "
          f"{statistics.median(paints):.3f} s (min {min(paints):.3f}, max {max(paints):.3f}; {args.runs} runs)")
    print(f"  process exit after the paint: median {statistics.median(exits):.3f} s")
    print(f"  for scale: reef --help {statistics.median(helps) * 1e3:.0f} ms, python -c pass "
          f"{statistics.median(bare) * 1e3:.0f} ms")
    verdict = "meets" if statistics.median(paints) <= GOAL_S else "misses"
    print(f"goal: first paint <= {GOAL_S} s: {verdict} it")


if __name__ == "__main__":
    main()
