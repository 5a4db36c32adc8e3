"""CLI start-up: ``reef --help`` and ``reef status`` against ``python -c pass``, in one run (goal: each within
100 ms of the bare interpreter).

All run as fresh processes, alternating, so that machine noise hits them alike; we print the median and the
minimum of each, what each adds over a bare interpreter, and which heavy modules ``reef --help`` imported (none
should be: torch, transformers, pygit2, textual, aiohttp and the daemon are imported by the commands that need
them). ``reef status`` asks a daemon started for the bench on a temporary home (the tiny model; its start is not
timed).

Run: ``.venv/bin/python bench/cli_startup.py [--runs N]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_ADDED_MS = 100.0
HEAVY = ("torch", "transformers", "pygit2", "textual", "aiohttp", "daemon.app")


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="runs of each command")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = shutil.which("reef", path=str(Path(sys.executable).parent))
    reef = [script, "--help"] if script else [sys.executable, "-m", "reef_cli.main", "--help"]
    bare = [sys.executable, "-c", "pass"]
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="reef-bench-cli-"))
    denv = dict(env, REEF_HOME=str(home), REEF_MODEL="tiny", REEF_PORT="0")
    status = [*reef[:-1], "status"]
    subprocess.run([*reef[:-1], "daemon", "start"], env=denv, check=True, stdout=subprocess.DEVNULL)
    try:
        for cmd, e in ((bare, env), (reef, env), (status, denv)):  # warm the page cache
            timed(cmd, e)
        samples: dict[str, list[float]] = {"python -c pass": [], "reef --help": [], "reef status": []}
        for _ in range(args.runs):
            samples["python -c pass"].append(timed(bare, env))
            samples["reef --help"].append(timed(reef, env))
            samples["reef status"].append(timed(status, denv))
    finally:
        subprocess.run([*reef[:-1], "daemon", "stop"], env=denv, stdout=subprocess.DEVNULL)
        shutil.rmtree(home, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    for name, values in samples.items():
        print(f"{name:15} median {med[name]:6.1f} ms   min {min(values):6.1f} ms   ({len(values)} runs)")
    for name in ("reef --help", "reef status"):
        added = med[name] - med["python -c pass"]
        verdict = "meets" if added <= GOAL_ADDED_MS else "misses"
        print(f"{name} adds {added:.1f} ms over a bare interpreter ({med[name] / med['python -c pass']:.1f}x): "
              f"{verdict} the goal (<= {GOAL_ADDED_MS:.0f} ms)")
    probe = (
        "import sys, runpy; sys.argv = ['reef', '--help']\n"
        "try:\n    runpy.run_module('reef_cli.main', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout
    heavy = next((line[6:] for line in out.splitlines() if line.startswith("HEAVY=")), "?")
    print(f"heavy modules imported by reef --help: {heavy or 'none'}")


if __name__ == "__main__":
    main()
