"""What ``reef-pi`` adds before the agent's first request, against ``pi`` alone pointed at the same daemon.

One daemon serves the tiny model. Each round runs the same non-interactive prompt twice, in alternating order:
``pi`` started directly with the provider config and environment the adapter would give it, and ``reef-pi``
(which first asks the daemon for a run, checks the harness, writes the agent's config, then starts ``pi``).
The time to the first request is taken from the daemon's own record of it (arrival = record time minus the
request's total time), against the moment the process was spawned, on the same clock.

    .venv/bin/python bench/wrapper_overhead.py [--rounds 7] [--agents-dir DIR]

Goal (issue 5): at most 150 ms added. On a busy machine the end-to-end figure swings by hundreds of milliseconds
(pi's own start-up varies that much); the wrapper's own time before it starts pi (from its run record) is the
steadier figure, and the load average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adapters import ADAPTERS, Target  # noqa: E402
from daemon.config import load_config  # noqa: E402
from reef_cli.client import start_daemon  # noqa: E402
from reef_cli.runs import call  # noqa: E402

PROMPT = ["-p", "--no-session", "say hi"]


def first_request_at(cfg, run: str) -> float:
    got = call(cfg, "GET", f"/reef/records?run={run}&kind=exchange&limit=100")["records"]
    if not got:
        raise SystemExit(f"run {run} made no request")
    return min(r["created_at"] - r["timings"]["total_ms"] / 1e3 for r in got)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--agents-dir", default=str(ROOT / ".cache" / "agents"))
    args = p.parse_args()

    home = Path(tempfile.mkdtemp(prefix="reef-bench-wrap-"))
    port = 18900 + os.getpid() % 1000
    agents = Path(args.agents_dir)
    (home / "config.toml").write_text(
        f'port = {port}\nagents_dir = "{agents}"\n\n[models.tiny]\npath = "{home}/models/tiny"\nmax_tokens_limit = 4\n'
    )
    env = dict(os.environ, REEF_HOME=str(home), REEF_AGENTS_DIR=str(agents), REEF_QUIET="1", REEF_SCENARIO="bench")
    env.pop("REEF_URL", None)
    os.environ.update(env)
    cfg = load_config()
    pi = ADAPTERS["pi"]
    if pi.installed_version(agents) != pi.version:
        subprocess.run([sys.executable, "-m", "reef_cli.main", "agents", "install", "pi"], env=env, check=True)
    pid = start_daemon(cfg)
    token = cfg.token_path.read_text().strip()
    wrapper = Path(sys.executable).parent / "reef-pi"
    cwd = Path(tempfile.mkdtemp(prefix="reef-bench-cwd-"))
    try:
        # first use: builds the model, creates the scenario, installs the harness (not what is measured)
        subprocess.run([str(wrapper), *PROMPT], env=env, cwd=cwd, check=True, capture_output=True)
        direct_home = home / "direct-home"
        direct, wrapped, own = [], [], []
        for i in range(args.rounds):
            for kind in (("direct", "wrapped") if i % 2 == 0 else ("wrapped", "direct")):
                if kind == "direct":
                    start = call(cfg, "POST", "/reef/runs", {"adapter": "pi", "scenario": "bench",
                                                            "installed_release": "x"})
                    target = Target(url=start["url"], scenario="bench", run=start["run"], model=start["model"],
                                    release_id=start["release_id"])
                    pi.prepare(direct_home, target)
                    run_env = {**env, **pi.env(direct_home, target, token)}
                    t0 = time.time()
                    subprocess.run([str(pi.binary_path(agents)), *PROMPT], env=run_env, cwd=cwd, check=True,
                                   capture_output=True)
                    direct.append(first_request_at(cfg, target.run) - t0)
                else:
                    t0 = time.time()
                    subprocess.run([str(wrapper), *PROMPT], env=env, cwd=cwd, check=True, capture_output=True)
                    run = (home / "runs" / "last-pi").read_text().strip()
                    wrapped.append(first_request_at(cfg, run) - t0)
                    own.append(json.loads((home / "runs" / f"{run}.json").read_text())["spawned_at"] - t0)
        d, w = statistics.median(direct), statistics.median(wrapped)
        added_ms = (w - d) * 1e3
        print(f"time to the agent's first request, median of {args.rounds} runs each:")
        print(f"  pi alone        {d * 1e3:8.1f} ms   (runs: {', '.join(f'{x * 1e3:.0f}' for x in direct)})")
        print(f"  reef-pi         {w * 1e3:8.1f} ms   (runs: {', '.join(f'{x * 1e3:.0f}' for x in wrapped)})")
        print(f"  added by reef-pi {added_ms:7.1f} ms   ratio {w / d:.3f}   goal <= 150 ms: "
              f"{'met' if added_ms <= 150 else 'MISSED'}")
        print(f"  reef-pi's own work before it starts pi (interpreter, imports, one request to the daemon, harness "
              f"check, agent config): median {statistics.median(own) * 1e3:.0f} ms (runs: "
              f"{', '.join(f'{x * 1e3:.0f}' for x in own)})")
        print(json.dumps({"pi_ms": round(d * 1e3, 1), "reef_pi_ms": round(w * 1e3, 1), "added_ms": round(added_ms, 1),
                          "ratio": round(w / d, 3), "wrapper_before_spawn_ms": round(statistics.median(own) * 1e3, 1),
                          "load_avg_1m": os.getloadavg()[0]}))
    finally:
        subprocess.run([sys.executable, "-m", "reef_cli.main", "daemon", "stop"], env=env, capture_output=True)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(cwd, ignore_errors=True)


if __name__ == "__main__":
    main()
