"""The Ray trainer (``trainer = "ray"``): training steps run as tasks of a Ray actor instead of in the local worker
process, with the same ``TrainJob`` in and ``Candidate`` out, and the candidate comes back as files the daemon
publishes.

Design choices:
- The Ray driver (``RayDriver``) lives in the trainer worker process (``daemon/trainer/worker.py``), not in the
  daemon: the daemon talks to it over the same pipe as to the local trainer, and Ray's threads, its fatal-signal
  handlers (which turn the daemon's SIGTERM into an abort at exit) and its 250 MB of imports stay out of the
  serving process. The worker does not train; it forwards each job to the cluster.
- One long-lived actor (``_StepActor``) per device class, so a recipe keeps its ``state`` (a model in memory, an
  optimizer) between steps exactly as in the worker process; its step is the worker's own ``run_job``, so a
  recipe cannot tell the two apart. The actor asks for one CPU (and one GPU where the job's device is ``cuda``,
  or ``auto`` on a cluster that has GPUs).
- Files, not paths, cross the boundary: the actor may run on another machine. The model directories a job
  names (its base, the serving head, the whole model under an adapter) are put in Ray's object store once per
  content key and materialised on the actor's node once (keys name immutable content: a content id, or a
  candidate of this daemon); the candidate's files come back as bytes and are written under their final name the
  way the worker writes them (temp directory beside it, fsync, rename), so a half-received candidate never
  exists under its final name.
- Reef's own packages (``daemon``, ``recipes``) travel with the job (Ray ``py_modules``), so every node runs the
  daemon's code; ``recipe_paths`` directories are put on the workers' ``PYTHONPATH`` and must exist at the same
  path on the nodes (they do on a local cluster). Torch and transformers must be installed on the nodes.
- A dead actor (its worker killed, its node lost) is replaced and the step retried once (``retries``): the
  step had consumed nothing and published nothing (the daemon publishes only what comes back), so a retry cannot
  publish twice. A step that raises inside the actor is not retried (the same batch would fail again): it comes
  back as ``StepFailed`` with the exception's message.
- ``ray_address`` joins an existing cluster (``ray.init(address=...)``); without it the worker starts a local
  cluster (``ray.init()``, a few seconds) on the first step and stops it when it stops (with the daemon, or when
  the daemon dies: the worker follows its parent). The address is tried with a plain TCP connect before each step:
  ``ray.init`` on a cluster that is gone retried for minutes, and a connected driver's calls waited 60 s for a head
  that was gone before the driver exited (measured, Ray 2.60); a step fails at once with the reason instead.
- With ``trainer_workers`` the step of a data-parallel recipe (``TrainJob.data_parallel``) runs on that many Ray
  Train workers instead of the actor (``daemon/trainer/ray_parallel.py``); the inputs travel the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.errors import EngineError, StepFailed
from daemon.trainer.ray_files import _node_dir, _read_dir, _safe, _write_dir
from daemon.trainer.step import run_job
from recipes.base import Candidate, TrainJob

if TYPE_CHECKING:
    from daemon.trainer.ray_parallel import ParallelSteps

log = logging.getLogger("reef.trainer.ray")

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the daemon and recipes packages
_MAX_INPUTS = 16  # model directories kept in the object store (the oldest dropped first)









def _loopback_only() -> None:
    """Keep a local cluster Reef starts on loopback. Ray binds its GCS and raylet to every interface, and names the
    node by the machine's outward address, even with ``_node_ip_address="127.0.0.1"`` (measured, Ray 2.60: ``*:port``
    in ``ss -ltn``); a cluster's gRPC ports run code for whoever reaches them. Ray's own switch for a cluster that
    spans no other machine makes it resolve the node to 127.0.0.1 and bind there. It is read when ``ray`` is imported
    (and by the processes the cluster starts, from the environment), so it is set in both places."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]  # Ray's module, typed as a ModuleType here

class _StepActor:
    """Runs training steps on a Ray worker (made a Ray actor class by ``RayDriver``)."""

    def __init__(self, threads: int, paths: list[str]) -> None:
        import torch

        for p in reversed(paths):
            if p not in sys.path:
                sys.path.insert(0, p)
        torch.set_num_threads(threads)
        self.states: dict[str, dict[str, Any]] = {}
        self.cache = _node_dir()

    def pid(self) -> int:
        return os.getpid()

    def missing(self, keys: list[str]) -> list[str]:
        """Which of these model directories this actor does not hold yet."""
        return [k for k in keys if not (self.cache / _safe(k)).is_dir()]

    def run(self, job: TrainJob, inputs: dict[str, str], *blobs: tuple[str, dict[str, bytes]]
            ) -> tuple[Candidate, dict[str, bytes]] | str:
        """One step: ``inputs`` maps each of the job's paths to its content key, ``blobs`` are the directories
        this actor lacked. Returns (candidate without a path, its files) or the exception's message."""
        try:
            for key, files in blobs:
                dest = self.cache / _safe(key)
                if not dest.is_dir():
                    _write_dir(files, dest)
            local = {p: str(self.cache / _safe(k)) for p, k in inputs.items()}
            job = replace(job, base_path=local.get(job.base_path, job.base_path),
                          head_path=local.get(job.head_path, job.head_path),
                          model_path=local.get(job.model_path, job.model_path) if job.model_path else "")
            out = self.cache / "out" / job.id
            candidate = run_job(self.states, job, out)
            files = _read_dir(str(out)) if candidate.path is not None else {}
            shutil.rmtree(out, ignore_errors=True)
            return replace(candidate, path=None), files
        except Exception as e:  # the daemon decides; the actor stays up
            return f"{type(e).__name__}: {e}"


def _reachable(address: str) -> None:
    """A ``StepFailed`` naming the address unless something listens there (``host:port``; anything else, a
    ``ray://`` client address or ``auto``, is left to Ray)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
    except OSError as e:
        raise StepFailed(f"the Ray cluster at {address} does not answer: {getattr(e, 'strerror', None) or e}") \
            from None




class RayDriver:
    """Runs jobs on a Ray cluster, from the trainer worker process: ``run`` gives the candidate (complete at
    ``out_dir``) or raises ``StepFailed``; ``close`` stops the actors (and the local cluster it started)."""

    def __init__(self, address: str | None = None, threads: int = 1, retries: int = 1,
                 recipe_paths: list[str] | None = None, workers: int | None = None) -> None:
        self.address = address
        self.workers = workers  # trainer_workers: data-parallel jobs run on that many Ray Train workers
        self._parallel: ParallelSteps | None = None
        self.threads = threads
        self.retries = retries
        self.recipe_paths = list(recipe_paths or [])
        self._lock = threading.Lock()
        self._actors: dict[str, Any] = {}
        self._inputs: dict[str, Any] = {}  # content key -> ObjectRef of its files
        self._connected = False
        self._closed = False
        self.restarts = 0

    def _connect(self) -> Any:
        if not self.address:
            _loopback_only()
        import ray

        if not self._connected:
            if self.address:
                _reachable(self.address)
            # the node's own PYTHONPATH stays (Ray expands ${PYTHONPATH} from the worker's environment)
            paths = os.pathsep.join([*self.recipe_paths, os.environ.get("PYTHONPATH", ""), "${PYTHONPATH}"])
            runtime_env: dict[str, Any] = {"py_modules": [str(_ROOT / "daemon"), str(_ROOT / "recipes")],
                                           "env_vars": {"PYTHONPATH": paths.lstrip(os.pathsep)}}
            local: dict[str, Any] = {} if self.address else {"num_cpus": max(1, os.cpu_count() or 1),
                                                             "_node_ip_address": "127.0.0.1"}  # loopback
            # Ray annotates logging_level as an int; it takes a level's name too (its own default is "info")
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                     logging_level="warning",  # type: ignore[arg-type]
                     runtime_env=runtime_env, configure_logging=False, **local)
            self._connected = True
            log.info("trainer: connected to Ray %s", self.address or "(a local cluster started by Reef)")
        return ray

    def _actor(self, ray: Any, device: str) -> Any:
        gpus = 1 if device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0) else 0
        key = "gpu" if gpus else "cpu"
        actor = self._actors.get(key)
        if actor is None:
            cls = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0, max_task_retries=0)(_StepActor)
            actor = cls.remote(self.threads, self.recipe_paths)
            self._actors[key] = actor
        return actor

    def _put(self, ray: Any, key: str, path: str) -> Any:
        ref = self._inputs.get(key)
        if ref is None:
            while len(self._inputs) >= _MAX_INPUTS:
                self._inputs.pop(next(iter(self._inputs)))
            ref = self._inputs[key] = ray.put((key, _read_dir(path)))
        return ref

    def _run_parallel(self, job: TrainJob, out_dir: Path) -> Candidate:
        """A data-parallel job on ``workers`` Ray Train workers (``daemon/trainer/ray_parallel.py``)."""
        from daemon.trainer.ray_parallel import ParallelSteps

        with self._lock:
            ray = self._connect()
            if self.address:  # a cluster gone between steps: a driver's calls would wait a minute for it
                _reachable(self.address)
            if self._parallel is None:
                assert self.workers is not None
                self._parallel = ParallelSteps(ray, self.workers, self.threads, self.recipe_paths,
                                               self.address or "(local)")
            inputs = {job.base_path: job.base_key, job.head_path: job.head_key}
            if job.model_path:
                inputs[job.model_path] = job.model_key
            refs = {k: self._put(ray, k, p) for p, k in inputs.items()}
            try:
                candidate, files = self._parallel.run(job, inputs, refs)
            except ray.exceptions.RayError as e:  # the cluster, not the step: its head gone, say
                raise StepFailed(f"the Ray cluster at {self.address or '(local)'} failed the step: "
                                 f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}", job=job.id) from None
            if candidate.skipped is not None or not files:
                return candidate
            _write_dir(files, out_dir)
            return replace(candidate, path=str(out_dir))

    def run(self, job: TrainJob, out_dir: Path) -> Candidate:
        """One step on the cluster, retried on a fresh actor when the one running it dies."""
        if self.workers and job.data_parallel:
            return self._run_parallel(job, out_dir)
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError

        dead = (RayActorError, ActorDiedError, ActorUnavailableError, WorkerCrashedError)
        with self._lock:
            ray = self._connect()
            if self.address:  # a cluster gone between steps: a driver's calls would wait a minute for it
                _reachable(self.address)
            inputs = {job.base_path: job.base_key, job.head_path: job.head_key}
            if job.model_path:
                inputs[job.model_path] = job.model_key
            for attempt in range(self.retries + 1):
                if self._closed:
                    raise EngineError("the trainer is shutting down")
                actor = self._actor(ray, job.device)
                try:
                    lacking = set(ray.get(actor.missing.remote(sorted(set(inputs.values())))))
                    blobs = [self._put(ray, k, p) for p, k in inputs.items() if k in lacking]
                    pending = actor.run.remote(job, inputs, *blobs)
                    while not ray.wait([pending], timeout=0.5)[0]:
                        if self._closed:
                            ray.cancel(pending, force=True)
                            raise EngineError("the trainer is shutting down")
                    result: tuple[Candidate, dict[str, bytes]] | str = ray.get(pending)  # _StepActor.run's
                except dead as e:
                    self.restarts += 1
                    self._actors = {k: a for k, a in self._actors.items() if a is not actor}
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
                    log.warning("trainer: the Ray actor died during job %s (%s); retrying", job.id,
                                type(e).__name__)
                    if attempt == self.retries:
                        raise EngineError(f"the Ray trainer actor died {attempt + 1} times on job {job.id}") from None
                    continue
                except ray.exceptions.RayTaskError as e:
                    raise StepFailed(str(e).splitlines()[-1], job=job.id) from None
                if isinstance(result, str):
                    raise StepFailed(result, job=job.id)
                candidate, files = result
                if candidate.skipped is not None or not files:
                    return candidate
                _write_dir(files, out_dir)
                return replace(candidate, path=str(out_dir))
            raise AssertionError("unreachable")

    def close(self) -> None:
        """Stop the actors, and the local cluster if Reef started it (a cluster it joined keeps running)."""
        self._closed = True
        if not self._connected:
            return
        import ray

        if self._parallel is not None:
            self._parallel.close()
        with self._lock:
            for actor in self._actors.values():
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            self._actors.clear()
            self._inputs.clear()
            with contextlib.suppress(Exception):
                ray.shutdown()
            self._connected = False
