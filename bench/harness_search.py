"""Episodes per minute of ``harness-search`` on this machine, with the stand-ins, and where the time goes.

The search is episode-bound: a step costs 2 x tasks x repeats episodes of the real agent, each in a fresh
sandbox. This starts the stand-ins of ``tests/harness_standins.py`` (agent model and proposer over real HTTP) and a
daemon serving them, then:

1. the sandbox's own cost: ``bwrap ... true``, ``bwrap ... python -c pass`` and ``bwrap ... pi --version``
   (pi's own start-up; median of 5);
2. ``--episodes`` episodes of one task run back to back (``run_episode``, the recipe's own path: workspace copy,
   sandbox, relay, real ``reef-pi`` and pi, a real check), split into: setup (copy), start (spawn to the agent's
   first request, from the daemon's record of it: bubblewrap, the wrapper, pi's start-up), model (the daemon's
   total time of the run's requests), the rest of the agent's part (tool runs, pi's exit, teardown), the check;
3. one whole recipe step (an ``evolve`` instruction, a scripted proposal, the paired gate on 2 tasks).

    .venv/bin/python bench/harness_search.py [--episodes 6] [--agents-dir DIR]

The load average is printed with the results: on a shared 2-core machine the figures swing with it.
"""

from __future__ import annotations

import argparse
import asyncio
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

import httpx  # noqa: E402

from recipes.harness_search import sandbox  # noqa: E402
from recipes.harness_search.episodes import EpisodeEnv, Task, _env, run_episode  # noqa: E402
from recipes.harness_search.recipe import episodes_scenario  # noqa: E402
from tests.conftest import Daemon, free_port, make_home  # noqa: E402


def median_run(cmd: list[str], n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wait(fn, timeout: float = 600):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := fn()):
            return got
        time.sleep(0.3)
    raise SystemExit("timed out")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=6)
    p.add_argument("--agents-dir", default=str(ROOT / ".cache" / "agents"))
    args = p.parse_args()
    from daemon.models import init_tiny

    work = Path(tempfile.mkdtemp(prefix="reef-bench-hs-"))
    tiny = init_tiny(work / "tiny", seed=0)
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, str(ROOT / "tests" / "harness_standins.py"), str(stub_port)])
    standin = f"http://127.0.0.1:{stub_port}"
    models = "".join(f'\n[models.{n}]\nengine = "upstream"\nurl = "{standin}"\nformat = "openai-chat"\n'
                     f'upstream_model = "{n}"\n' for n in ("agent", "proposer"))
    home, port, env = make_home(tiny, models)
    (home / "config.toml").write_text(f'agents_dir = "{args.agents_dir}"\n' + (home / "config.toml").read_text())
    d = Daemon(home=home, port=port, env=env).start()
    template = work / "template"
    template.mkdir()
    (template / "README.md").write_text("Write the greeting into answer.txt.\n")
    try:
        ws = work / "ws"
        ws.mkdir()
        bare = median_run(sandbox.argv(["/bin/true"], workspace=ws, env=_env()))
        py = median_run(sandbox.argv([sys.executable, "-c", "pass"], workspace=ws, env=_env()))
        from adapters import get_adapter

        agents = {str(Path(args.agents_dir)): str(Path(args.agents_dir))}  # bound in as an episode binds them
        pi = median_run(sandbox.argv([str(get_adapter("pi").binary_path(Path(args.agents_dir))), "--version"],
                                     workspace=ws, env=_env(), ro_binds=agents))
        print(f"sandbox: bwrap true {bare * 1e3:.0f} ms, bwrap python -c pass {py * 1e3:.0f} ms, "
              f"bwrap pi --version {pi * 1e3:.0f} ms (median of 5)")

        scenario = episodes_scenario("bench")
        with d.http() as c:
            c.post("/reef/scenarios", json={"name": scenario, "recipe": "record", "model": "agent"})
            token = c.post("/reef/tokens", json={"scenario": scenario, "ttl_s": 3600}).json()["token"]
        ep_env = EpisodeEnv(socket=d.home / "scoped.sock", port=d.port, scenario=scenario,
                            agents_dir=Path(args.agents_dir), home=d.home, token=token)
        task = Task("greet", "Write the greeting into answer.txt.", 'test "$(cat answer.txt)" = hello',
                    workspace=str(template))
        rows = []
        t0 = time.perf_counter()
        for i in range(args.episodes):
            ep = asyncio.run(run_episode(task, {}, ep_env, side="serving", repeat=i))
            with d.http() as c:
                recs = c.get("/reef/records", params={"run": ep.run, "kind": "exchange"}).json()["records"]
            first = min(r["created_at"] - r["timings"]["total_ms"] / 1e3 for r in recs)
            model = sum(r["timings"]["total_ms"] for r in recs) / 1e3
            start = first - ep.timings["spawned_at"]
            rows.append({"status": ep.status, "setup": ep.timings["setup_s"], "start": start, "model": model,
                         "rest": ep.seconds - start - model, "check": ep.check_seconds,
                         "total": ep.timings["setup_s"] + ep.seconds + ep.check_seconds})
        wall = time.perf_counter() - t0
        print(f"episodes: {args.episodes} in {wall:.1f} s = {60 * args.episodes / wall:.1f} per minute "
              f"({sum(r['status'] == 'passed' for r in rows)} passed)")
        for key in ("setup", "start", "model", "rest", "check", "total"):
            xs = [r[key] for r in rows]
            print(f"  {key:6s} median {statistics.median(xs) * 1e3:7.0f} ms  max {max(xs) * 1e3:7.0f} ms")

        tasks = [{"id": "lower", "prompt": "Write the greeting into answer.txt.", "workspace": str(template),
                  "check": 'test "$(cat answer.txt)" = hello'},
                 {"id": "upper", "prompt": "Write the greeting into answer.txt.", "workspace": str(template),
                  "check": 'test "$(cat answer.txt)" = HELLO'}]
        proposal = {"mutations": [{"op": "create", "kind": "rule", "id": "shout",
                                   "text": "Write greetings in upper case.", "reason": "bench"}]}
        httpx.post(f"{standin}/_script", json={"proposer": [json.dumps(proposal)]})
        with d.http() as c:
            c.post("/reef/scenarios", json={"name": "bench-step", "recipe": "harness-search", "model": "agent",
                                            "settings": {"proposer": "proposer", "tasks": tasks}})
            t0 = time.perf_counter()
            c.post("/reef/scenarios/bench-step/evolve", json={"instruction": "make the tasks pass"})
            out = wait(lambda: (c.get("/reef/scenarios/bench-step/releases", params={"all": "1"}).json()
                                .get("rejected") or [None])[0])
            step_s = time.perf_counter() - t0
        m = out["metrics"]
        print(f"one step (2 tasks x 1 repeat x 2 sides): {step_s:.1f} s wall; {m['episodes']} episodes "
              f"{m['episode_s']:.1f} s, {m['proposer_calls']} proposer call(s) {m['proposer_s']:.2f} s; "
              f"verdict {out['verdict']}: {out['reason']}")
        print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        d.stop()
        stub.kill()
        stub.wait()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
