"""``trainer = "ray"``: training steps run as tasks of a Ray actor on a real local Ray cluster (one per module,
started with ``ray start --head --block`` and stopped by its pid), the candidate comes back as files the daemon
publishes, and a Ray worker killed mid-step makes the step run again with nothing published twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, Daemon, free_port
from tests.test_learning import releases, serve_and_report, wait_for

RECIPES = '''
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from recipes.base import Candidate, GateSettings, Recipe


@dataclass
class Settings(GateSettings):
    hold: str = ""  # a directory: write started-<pid> there, then wait for a file named go
    canary_share: float | None = 0.0  # straight to the head: these tests are about where a step runs


class Marked(Recipe):
    """Copies the model and adds a note naming the job: a new content id; says where the step ran."""

    name = "marked"
    kind = "weights"
    source = "scores"
    Settings = Settings

    def batch(self, records):
        return records[:2] if len(records) >= 2 else None

    def train(self, job, state):
        import ray

        if self.settings.hold:
            hold = Path(self.settings.hold)
            (hold / f"started-{os.getpid()}").write_text(job.id)
            deadline = time.monotonic() + 120  # a hang guard only: the test creates go
            while not (hold / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        for f in Path(job.base_path).iterdir():
            shutil.copyfile(f, Path(job.work_dir) / f.name)
        (Path(job.work_dir) / "note.txt").write_text(f"trained by {job.id}")
        ctx = ray.get_runtime_context()
        return Candidate(metrics={"ray_actor": ctx.get_actor_id() is not None, "pid": os.getpid(),
                                  "same_base_path": Path(job.base_path).exists() and "reef-ray-" in job.base_path})
'''


# Ray 2.60 turns token auth on for every cluster started once a token exists in ~/.ray, and a driver whose token
# differs is refused: the test cluster and its daemons run without, so what another cluster left there cannot matter
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # node addresses on loopback


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray cluster for this module: ``ray start --head --block``, on loopback, stopped through its process
    group (the processes it started), never ``ray stop`` (that would stop every Ray cluster on the machine)."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rayt-", dir="/tmp")  # short: Ray's socket paths must fit in 108 bytes
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", **RAY_ENV}
    ray_cli = Path(sys.executable).parent / "ray"
    proc = subprocess.Popen([str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats",
                             "--node-ip-address=127.0.0.1"],  # loopback only
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        probe = [sys.executable, "-c", f"import ray; ray.init(address={address!r}, log_to_driver=False); "
                 "print(ray.cluster_resources()['CPU'])"]
        wait_for(lambda: proc.poll() is None and subprocess.run(probe, env=env, capture_output=True).returncode == 0,
                 timeout=300, what="the Ray cluster")  # a hang guard: a busy machine is slow
        yield address
    finally:
        # its own session: the head and every process it started (a SIGTERM's graceful stop took 33 s; this
        # throwaway cluster has nothing to keep, and nothing of it was seen left after the SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_daemon(daemon_factory: Any, ray_address: str, tmp_path: Path) -> Daemon:
    recipes = tmp_path / "ray-recipes"
    recipes.mkdir()
    (recipes / "rayrec.py").write_text(RECIPES)
    d: Daemon = daemon_factory(start=False)
    d.env.update(RAY_ENV)
    cfg = d.home / "config.toml"
    cfg.write_text(f'trainer = "ray"\nray_address = "{ray_address}"\nrecipe_paths = [{json.dumps(str(recipes))}]\n'
                   + cfg.read_text())
    return d.start(timeout=180)  # a hang guard: the machine may be busy


def test_a_step_runs_on_the_ray_cluster_and_its_candidate_is_published(ray_daemon: Daemon) -> None:
    with ray_daemon.http() as c:
        assert c.post("/reef/scenarios", json={"name": "rt", "recipe": "rayrec:Marked"}).status_code == 201
        receipts = serve_and_report(c, "rt", 2, score=lambda i: 1.0)
        chain = wait_for(lambda: (x := releases(c, "rt"))["releases"][0]["step"] == 1 and x, what="a release")
        head = chain["releases"][0]
        assert head["operation"] == "train" and sorted(head["receipts"]) == sorted(receipts)
        # it ran in a Ray actor, from a copy of the model the actor received (not the daemon's own path)
        assert head["metrics"]["ray_actor"] is True and head["metrics"]["same_base_path"] is True
        assert c.get("/reef/status").json()["trainer"] == "ray"
        assert ray_daemon.proc is not None  # not in the daemon, nor in a process it started: on the cluster
        assert head["metrics"]["pid"] not in descendants(ray_daemon.proc.pid) | {ray_daemon.proc.pid}
        diff = c.get(f"/reef/releases/{head['release_id']}").json()["diff"]
        assert diff["added"] == ["note.txt"]  # the candidate's files came back and were published
        nxt = c.post("/s/rt/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert nxt.headers["x-reef-release-id"] == head["release_id"]


def test_killing_the_ray_worker_mid_step_retries_it_and_publishes_once(ray_daemon: Daemon, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.mkdir()
    with ray_daemon.http() as c:
        r = c.post("/reef/scenarios", json={"name": "rk", "recipe": "rayrec:Marked", "settings": {"hold": str(hold)}})
        assert r.status_code == 201, r.text
        receipts = serve_and_report(c, "rk", 2, score=lambda i: 1.0)
        first = wait_for(lambda: list(hold.glob("started-*")), what="the step to start")[0]
        pid = int(first.name.split("-")[1])
        os.kill(pid, signal.SIGKILL)  # the Ray worker process running the step
        second = wait_for(lambda: [p for p in hold.glob("started-*") if p != first], what="the retried step")[0]
        assert second.read_text() == first.read_text()  # the same job, run again
        (hold / "go").touch()
        chain = wait_for(lambda: (x := releases(c, "rk"))["releases"][0]["step"] == 1 and x, what="a release")
        trained = [r for r in chain["releases"] if r["operation"] == "train"]
        assert len(trained) == 1 and sorted(trained[0]["receipts"]) == sorted(receipts)
        assert trained[0]["metrics"]["pid"] == int(second.name.split("-")[1]) != pid
        assert releases(c, "rk", all_=True)["rejected"] == []  # the killed attempt left no failed step behind


def descendants(pid: int) -> set[int]:
    """Every process under ``pid`` (children, theirs, ...)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, stack = set(), [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
                stack.append(c)
    return found
