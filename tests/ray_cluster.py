"""A Ray cluster of several nodes on this machine, for tests: a head started with ``ray start --head`` and nodes
joined to it, each a ``ray start --block`` in its own process group and its own temp dir, with its own resources, on
127.0.0.1 only; a node is stopped by SIGKILL to its group (the processes it started), never with ``ray stop`` (that
stops every Ray cluster on the machine).

Ray keeps a node on loopback when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``daemon/trainer/ray_trainer.py`` says
why), but its ``ray start`` then refuses to join a head ("multi-node clusters are not supported"), and with the
switch on it rewrites 127.0.0.1 in the head's address to the machine's outward address. A joining node therefore
runs ``ray start`` through ``NODE_START``: the switch stays off in the environment (the node's processes bind
loopback), and in that one process ``ray start`` is allowed to join and keeps 127.0.0.1 as given.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ROOT, free_port

# Ray 2.60 turns token auth on for every cluster started once a token exists in ~/.ray, and a driver whose token
# differs is refused: the test clusters and their daemons run without
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
# a node's death is noticed within about 2 s (Ray's default: 3 s x 5 missed checks), so that a lost node's worker is
# retried on the nodes left at once rather than after Ray Train's 60 s wait for a group of the old size
HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
          "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}
NODE_START = """
import sys
from ray._private import ray_constants, services
from ray.scripts import scripts
ray_constants.ENABLE_RAY_CLUSTER = True  # this process may join a head (the node's processes read the env: off)
services.resolve_ip_for_localhost = lambda host: host  # and the head's 127.0.0.1 stays 127.0.0.1
sys.argv[0] = "ray"
sys.exit(scripts.main())
"""
# a Ray driver answering each line on stdin with the cluster's live CPUs (0 until the head answers)
WATCHER = """
import socket
import sys
import time

import ray

host, port = sys.argv[1].split(":")
while True:  # ray.init retries for minutes on an address where nothing listens yet
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        break
    except OSError:
        time.sleep(0.2)
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="error")
for _ in sys.stdin:
    print("CPU", ray.cluster_resources().get("CPU", 0), flush=True)  # Ray prints its own news on stdout too
"""
OBJECT_STORE = 80 * 1024 * 1024  # bytes a node's object store holds (the tiny model's files are a few MB)


def ray_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "PYTHONPATH": str(ROOT), **RAY_ENV, **(extra or {})}


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    temp: Path
    log: Path
    killed: bool = False

    def kill(self) -> None:
        """SIGKILL to every process of the node: ``ray start`` and what it started (raylet, agents, and the Ray
        workers, which take process groups of their own but stay in the node's session)."""
        self.killed = True
        for pid in session(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        shutil.rmtree(self.temp, ignore_errors=True)


def session(sid: int) -> set[int]:
    """The live (not zombie) processes of session ``sid``."""
    out = set()
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.add(int(proc.name))
    return out


@dataclass
class Cluster:
    port: int = field(default_factory=free_port)
    object_store: int = OBJECT_STORE  # bytes each node's object store holds
    nodes: list[Node] = field(default_factory=list)
    _watcher: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, args: list[str], env: dict[str, str], joining: bool) -> Node:
        temp = Path(tempfile.mkdtemp(prefix="rayn-", dir="/tmp"))  # short: Ray's socket paths fit in 108 bytes
        log = temp.with_suffix(".log")
        cmd = [sys.executable, "-c", NODE_START] if joining else [str(Path(sys.executable).parent / "ray")]
        with open(log, "wb") as out:
            proc = subprocess.Popen([*cmd, "start", "--block", "--num-cpus=1", "--disable-usage-stats",
                                     f"--object-store-memory={self.object_store}", f"--temp-dir={temp}",
                                     "--node-ip-address=127.0.0.1", *args],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(proc, temp, log)
        self.nodes.append(node)
        return node

    def head(self) -> Node:
        return self._start(["--head", f"--port={self.port}", "--include-dashboard=false"], ray_env(HEALTH), False)

    def join(self, resources: str = "{}", env: dict[str, str] | None = None) -> Node:
        return self._start([f"--address={self.address}", f"--resources={resources}"], ray_env(env), True)

    def cpus(self) -> float:
        """The cluster's live CPUs, as a driver sees them: asked of one Ray driver kept for the purpose (a new one
        per question cost 3-8 s on a busy machine)."""
        if self._watcher is None or self._watcher.poll() is not None:
            self._watcher = subprocess.Popen([sys.executable, "-c", WATCHER, self.address], env=ray_env(),
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert self._watcher.stdin is not None and self._watcher.stdout is not None
        self._watcher.stdin.write("\n")
        self._watcher.stdin.flush()
        while (answer := self._watcher.stdout.readline()) and not answer.startswith("CPU "):
            pass
        return float(answer.split()[1]) if answer else 0.0

    def wait_cpus(self, n: float, timeout: float = 300) -> None:
        """Until the cluster has ``n`` live CPUs (a hang guard: a busy machine starts nodes slowly)."""
        deadline = time.monotonic() + timeout
        while (have := self.cpus()) != n:
            dead = [x.log.read_text()[-2000:] for x in self.nodes if not x.killed and x.proc.poll() is not None]
            assert not dead, dead
            assert time.monotonic() < deadline, f"the cluster has {have} CPUs, not {n}"
            time.sleep(0.2)

    def leftovers(self) -> set[int]:
        """The live processes of the cluster's nodes and of its watcher (each started in a session of its own)."""
        sids = [n.proc.pid for n in self.nodes] + ([self._watcher.pid] if self._watcher is not None else [])
        return {pid for sid in sids for pid in session(sid)}

    def close(self) -> None:
        if self._watcher is not None:
            if self._watcher.poll() is None:
                os.killpg(self._watcher.pid, signal.SIGKILL)
            self._watcher.communicate()  # and its pipes closed
        for node in reversed(self.nodes):
            node.kill()
            node.log.unlink(missing_ok=True)
