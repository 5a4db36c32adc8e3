"""The trainer: a worker process that runs weights recipes' training steps, so serving never stalls on
training.

Design choices:
- One long-lived worker process (``spawn``: no inherited threads or torch state), with its own torch thread
  count (``threads``, default 1: on a 2-core machine one core stays for serving). A ``TrainJob`` goes in and a
  ``Candidate`` comes back over a pipe (``recipes/base.py``); the worker loads the job's recipe by name and calls
  its ``train(job, state)``, with a ``state`` dict per recipe that lives as long as the worker (a recipe keeps its
  model and optimizer there between steps).
- The worker gives the recipe an empty directory beside the candidate's final name; after ``train`` returns,
  every file is fsynced and the directory renamed: a half-written candidate never exists under its final name,
  so it can never become a release, whatever the recipe does (``daemon/trainer/step.py``, the Ray actor's too).
- With ``ray`` (``trainer = "ray"``) the worker is a Ray driver instead (``daemon/trainer/ray_trainer.py``): each job
  runs on a Ray actor, or on ``trainer_workers`` data-parallel Ray Train workers (``daemon/trainer/ray_parallel.py``),
  and its candidate comes back as files; the pipe, the job and the candidate are the same.
- ``TrainerClient.run`` restarts a dead worker and retries the job once (``retries``): a worker killed from outside
  (``kill -9``, a lost node) deserves another go. A worker that dies twice on the same job is a ``StepFailed``
  naming how it died (the kernel's OOM killer sends SIGKILL): the daemon writes the step down as failed and moves
  on, so a batch that cannot fit is never retried in a loop. A job that fails inside the worker with an exception
  is not retried at all (the same batch would fail again): it comes back as a ``StepFailed`` carrying the
  exception's message.
- ``run``'s ``limit`` stops a job that runs past a number of seconds (a scenario's trainer-time cap:
  ``daemon/spend.py``): the worker is killed, since a recipe's ``train`` cannot be interrupted from outside, and the
  job is a ``StepFailed`` with the limit's message, never retried; the next job starts a fresh worker. The seconds
  each job held the worker (from its turn on the worker, not from when it queued behind another scenario's) are
  kept in ``seconds`` by job id for the daemon to take.
- The worker adds its peak resident memory so far (``trainer_peak_rss_mb``) to every step's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from daemon.errors import EngineError, ReefError, StepFailed
from daemon.trainer.step import run_job
from recipes.base import Candidate, TrainJob

log = logging.getLogger("reef.trainer")


# --- the worker process -----------------------------------------------------------------------------------


def _exit_with_parent(parent: int, driver: Any = None) -> None:
    """A worker must not outlive its daemon (``kill -9`` of the daemon leaves no orphan training on, nor a local
    Ray cluster the worker started)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            if driver is not None:
                with contextlib.suppress(Exception):
                    driver.close()
            os._exit(0)


def worker_main(conn: Connection, threads: int, parent: int, paths: list[str],
                ray: tuple[str | None, int | None] | None = None) -> None:
    """The worker's loop: a job in, its candidate (or the exception's message) out. ``ray``: ``(address,
    workers)`` to run the jobs on a Ray cluster (address None: a local cluster; workers: ``trainer_workers``) instead
    of here."""
    for p in reversed(paths):  # the daemon's recipe directories, found first as in the daemon
        if p not in sys.path:
            sys.path.insert(0, p)
    driver = None
    if ray is not None:
        from daemon.trainer.ray_trainer import RayDriver

        driver = RayDriver(ray[0], threads=threads, recipe_paths=paths, workers=ray[1])
    else:
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: unannotated
    threading.Thread(target=_exit_with_parent, args=(parent, driver), daemon=True).start()
    states: dict[str, dict[str, Any]] = {}
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is None:
                break
            job, out_dir = msg
            t0 = time.perf_counter()
            try:
                result: Any = driver.run(job, Path(out_dir)) if driver else run_job(states, job, Path(out_dir))
            except ReefError as e:
                result = e.message
            except Exception as e:  # the daemon decides; the worker stays up
                result = f"{type(e).__name__}: {e}"
                log.debug("job %s failed after %.1f s", job.id, time.perf_counter() - t0, exc_info=True)
            conn.send(result)
    finally:
        if driver is not None:
            driver.close()
    if driver is None:
        # the daemon's close waits for this exit: skip the interpreter's teardown of torch and the models trained
        # here (seconds on a busy machine); nothing is left to write
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(0)


# --- the daemon side ---------------------------------------------------------------------------------------


def _death(proc: Any) -> str:
    """How a dead worker died, in words."""
    proc.join(5)
    code = proc.exitcode
    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL:
            return f"killed by {name}: the kernel's out-of-memory killer, or kill -9; lower the recipe's " \
                   "memory_budget_mb or its batch size"
        return f"killed by {name}"
    return f"exit status {code}"


class TrainerClient:
    """Runs jobs in the worker process, restarting it when it dies."""

    def __init__(self, threads: int = 1, retries: int = 1, recipe_paths: list[str] | None = None,
                 ray: tuple[str | None, int | None] | None = None) -> None:
        self.ray = ray  # (address, workers): the worker is a Ray driver (trainer = "ray")
        self.threads = threads
        self.retries = retries
        self.recipe_paths = list(recipe_paths or [])
        self._proc: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0
        self.seconds: dict[str, float] = {}  # job id -> seconds the job held the worker (the daemon pops its own)

    def _ensure(self) -> Connection:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        if self._proc is not None:
            self.restarts += 1
            log.warning("trainer worker died (exit %s); restarting it", self._proc.exitcode)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=worker_main, args=(child, self.threads, os.getpid(), self.recipe_paths, self.ray),
                                 name="reef-trainer", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        return parent

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def _run(self, job: TrainJob, out_dir: Path, limit: tuple[float, str] | None = None) -> Candidate:
        with self._lock:
            started = time.monotonic()
            try:
                return self._attempts(job, out_dir, started, limit)
            finally:
                self.seconds[job.id] = time.monotonic() - started

    def _attempts(self, job: TrainJob, out_dir: Path, started: float, limit: tuple[float, str] | None) -> Candidate:
        stopped = False
        for attempt in range(self.retries + 1):
            if self._closed:
                raise EngineError("the trainer is shutting down")
            conn = self._ensure()
            try:
                conn.send((job, str(out_dir)))
                while not conn.poll(0.2):
                    if limit is not None and time.monotonic() - started >= limit[0] and not stopped:
                        stopped = True  # past the limit: stopped, never retried
                        self._proc.kill()
                    if not self._proc.is_alive():
                        raise EOFError
                result: Candidate | str = conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                self._conn = None
                shutil.rmtree(out_dir, ignore_errors=True)
                if stopped:
                    self._proc.join(5)
                    assert limit is not None
                    raise StepFailed(limit[1], job=job.id) from None
                how = _death(self._proc)
                if attempt == self.retries:
                    raise StepFailed(f"the trainer worker died {attempt + 1} times on this batch ({how}); "
                                     "not retried again", job=job.id) from None
                log.warning("trainer worker died during job %s (%s); retrying the job once", job.id, how)
                continue
            if isinstance(result, str):
                raise StepFailed(result, job=job.id)
            return result
        raise AssertionError("unreachable")

    async def run(self, job: TrainJob, out_dir: Path, limit: tuple[float, str] | None = None) -> Candidate:
        """Run one step in the worker: the candidate (complete at ``out_dir``), or ``StepFailed``; ``limit``:
        (seconds, message): a job still running that long after its turn came is stopped, ``StepFailed(message)``."""
        return await asyncio.to_thread(self._run, job, out_dir, limit)

    def close(self) -> None:
        """Stop the worker; a job still running is abandoned (its candidate was never published)."""
        self._closed = True
        idle = self._lock.acquire(timeout=2)
        try:
            if idle and self._conn is not None:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
            if self._proc is not None:
                self._proc.join(5 if idle else 0)
                if self._proc.is_alive():
                    self._proc.kill()
                    self._proc.join()
        finally:
            if idle:
                self._lock.release()
