"""``trainer = "ray"`` without ``ray_address``: the daemon starts a local Ray cluster of its own on the first
training step (its one cluster in this module), on loopback only, trains there, and stops it when the daemon
stops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import Daemon
from tests.test_learning import releases, serve_and_report, wait_for
from tests.test_ray_trainer import RECIPES, descendants


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_daemon_starts_a_local_ray_cluster_trains_on_it_and_stops_it(daemon_factory: Any, tmp_path: Path):
    recipes = tmp_path / "ray-recipes"
    recipes.mkdir()
    (recipes / "rayrec.py").write_text(RECIPES)
    d: Daemon = daemon_factory(start=False)
    cfg = d.home / "config.toml"
    cfg.write_text(f'trainer = "ray"\nrecipe_paths = [{json.dumps(str(recipes))}]\n' + cfg.read_text())
    d.start(timeout=180)
    assert d.proc is not None
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "rl", "recipe": "rayrec:Marked"}).status_code == 201
        receipts = serve_and_report(c, "rl", 2, score=lambda i: 1.0)
        chain = wait_for(lambda: (x := releases(c, "rl"))["releases"][0]["step"] == 1 and x, timeout=240,
                         what="a release trained on the local Ray cluster")
        head = chain["releases"][0]
        assert sorted(head["receipts"]) == sorted(receipts) and head["metrics"]["ray_actor"] is True
        cluster = descendants(d.proc.pid)
        assert head["metrics"]["pid"] in cluster  # the actor's worker belongs to the cluster this daemon started
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in alive(cluster)}
        assert {"gcs_server", "raylet"} <= names, names
        # the cluster's ports run code for whoever reaches them: loopback only (Ray's default bound them to every
        # interface, `*:port`, with the node named by the machine's outward address)
        listening = [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in cluster]
        assert listening, "the cluster's processes listen somewhere"
        assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip, _ in listening), listening
    assert d.stop() == 0
    wait_for(lambda: not alive(cluster), timeout=120, what="the daemon's Ray cluster to stop")
