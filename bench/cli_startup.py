"""CLI start-up: ``reef --help`` against ``python -c pass``, in one run (goal: ``reef --help`` at most 250 ms).

Both run as fresh processes, alternating, so that machine noise hits both alike; we print the median and the
minimum of each, what ``reef --help`` adds over a bare interpreter, and which heavy modules it imported (none
should be: torch, transformers, pygit2, textual, aiohttp and the daemon are imported by the commands that need
them).

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
GOAL_MS = 250.0
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
    for cmd in (bare, reef):  # warm the page cache
        timed(cmd, env)
    samples: dict[str, list[float]] = {"python -c pass": [], "reef --help": []}
    for _ in range(args.runs):
        samples["python -c pass"].append(timed(bare, env))
        samples["reef --help"].append(timed(reef, env))
    med = {k: statistics.median(v) for k, v in samples.items()}
    for name, values in samples.items():
        print(f"{name:15} median {med[name]:6.1f} ms   min {min(values):6.1f} ms   ({len(values)} runs)")
    added = med["reef --help"] - med["python -c pass"]
    print(f"reef --help adds {added:.1f} ms over a bare interpreter ({med['reef --help'] / med['python -c pass']:.1f}x)")
    probe = (
        "import sys, runpy; sys.argv = ['reef', '--help']\n"
        "try:\n    runpy.run_module('reef_cli.main', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout
    heavy = next((line[6:] for line in out.splitlines() if line.startswith("HEAVY=")), "?")
    print(f"heavy modules imported by reef --help: {heavy or 'none'}")
    verdict = "meets" if med["reef --help"] <= GOAL_MS else "misses"
    print(f"goal: reef --help <= {GOAL_MS:.0f} ms: {verdict} it ({med['reef --help']:.0f} ms)")


if __name__ == "__main__":
    main()
