"""Data-parallel training steps on a Ray cluster (``trainer = "ray"``, ``trainer_workers = N``): the step of a recipe
that supports it (``Recipe.data_parallel``: online-rl) runs as N workers of Ray Train's ``TorchTrainer`` (gloo on
CPU, NCCL on GPU), each on its share of the batch with the gradients summed across them (``recipes/parallel.py``);
rank 0's candidate comes back as files, and the daemon gates and publishes it as any other.

Design choices:
- One long-lived TorchTrainer run (a session) serves every step, not a run per step: starting a worker group (a
  controller actor, N processes importing torch, the process group) took 16-34 s on this 2-core machine under load.
  A session pays it once, and each worker keeps the recipe's ``state`` (its model and optimizer) between steps as the
  local worker does. The session's train function (``_serve``) is a loop: rank 0 takes the next job from a mailbox
  actor the driver owns (``_Mailbox``, pinned to the driver's node), tells the others with a broadcast, every
  worker runs it, and rank 0 posts the candidate back. Rank 0 asks every few seconds, so an idle group also checks
  that its peers are alive.
- A step starts only on N workers: the cluster's live CPUs (GPUs for a cuda model) are read first and a shortfall is
  refused with both numbers, and a session that came up smaller is stopped and the step refused. Only a retry runs
  on fewer: the session's size is elastic (1 to N), so when a worker is lost (its node gone, its process killed)
  Ray Train tears the group down and starts one on the nodes left, and the job still in the mailbox is handed to it.
  The sum of the gradients does not depend on how many workers share it. The mailbox counts hand-outs: a job handed
  out three times (the first try and two retries) is a failed step naming why. A lost attempt consumed and published
  nothing (the daemon publishes only what comes back), so a retry cannot publish twice.
- A recipe's exception is not retried (the same batch would fail again): the worker posts its message and leaves the
  train function, so that Ray Train tears the group down (its peers may be waiting in an all-reduce); the step is a
  ``StepFailed`` and the next one starts a new session. A communication error (gloo's "Connection closed by peer":
  a peer was lost) is a lost worker, retried.
- Each worker checks at the start of a session that its node has the daemon's torch and Reef installed (their
  versions, as ``importlib.metadata`` reads them there): a node that differs refuses the session, naming the node and
  both versions, and the step fails. Reef's own code travels with the job (``py_modules``) either way.
- Every worker hashes its candidate and the step fails if they differ (a recipe whose workers drifted apart).
- A session that ends (stopped, or out of retries) is replaced at the next step; a session whose workers send no
  heartbeat for ``LOST_S`` makes the step fail, never wait for ever.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from daemon.errors import EngineError, StepFailed
from recipes.base import Candidate, TrainJob

log = logging.getLogger("reef.trainer.ray")

TRIES = 3  # hand-outs of one job: the first try and two retries after lost workers
POLL_S = 5.0  # how long rank 0 waits for a job before telling its peers there is none (a liveness check too)
LOST_S = 300.0  # no heartbeat from a session's workers this long (none restarted): the step fails
START_S = 300.0  # a session's workers must be up within this (placement, processes, the process group)
SETTLE_S = 60.0  # how long a new session waits for the CPUs (GPUs) a stopped one held to come free
RESTART_S = 2.0  # the pause before a group that came up short is started again
# how long Ray Train waits for the cluster to place a worker group before trying again with what is there: its 60 s
# default is what a retry after a lost node cost, since Ray Train's own health check sees the worker gone before the
# cluster marks its node dead and asks for a group of the old size first (measured: 78 s from the kill to the retry)
PLACEMENT_S = "10"
STOP = -1  # rank 0's word to its peers: the session is over
VERSIONED = ("torch", "reef")  # what a node must have installed at the daemon's versions


def versions() -> dict[str, str | None]:
    """The installed versions of ``VERSIONED`` here (None: not installed as a distribution)."""
    out: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def mismatch(expected: dict[str, str | None], found: dict[str, str | None]) -> str | None:
    """What differs between the daemon's versions and a node's, in words (None: nothing known differs)."""
    said = [f"{name} {found[name]} where the daemon has {name} {expected[name]}" for name in VERSIONED
            if expected.get(name) and found.get(name) and expected[name] != found[name]]
    return "; ".join(said) or None


# --- the mailbox (a Ray actor on the driver's node) ------------------------------------------------------------


class _Mailbox:
    """Between the driver and the sessions' workers: the job in hand, its hand-outs, and what came back."""

    def __init__(self, tries: int) -> None:
        self.tries = tries
        self.cv = threading.Condition()
        self.session = 0  # the current session (an older one's rank 0 is told to stop)
        self.seq = 0  # the job in hand (0: none)
        self.payload: Any = None
        self.handed = 0
        # seq -> ("done", (candidate, files)) | ("failed", message) | ("taken", None): the driver has it
        self.results: dict[int, tuple[str, Any]] = {}
        self.ready: dict[int, dict[str, Any]] = {}  # session -> {"workers", "nodes"} | {"refused": message}
        self.beat = time.monotonic()

    def open(self, session: int) -> None:
        with self.cv:
            self.session = session
            self.beat = time.monotonic()
            self.cv.notify_all()

    def end(self, session: int) -> None:
        """``session``'s rank 0 is told to stop (at its next ask: at once if it is waiting for work)."""
        with self.cv:
            if self.session == session:
                self.session = 0
            self.cv.notify_all()

    def submit(self, seq: int, payload: Any) -> None:
        with self.cv:
            self.results = {k: v for k, v in self.results.items() if k >= seq}  # only the job in hand matters
            self.seq, self.payload, self.handed = seq, payload, 0
            self.cv.notify_all()

    def take(self, session: int, timeout: float) -> int | None:
        """Rank 0 of ``session`` asks for work: a job's seq, ``STOP``, or None (nothing yet)."""
        with self.cv:
            self.beat = time.monotonic()
            self.cv.wait_for(lambda: session != self.session or self._pending(), timeout)
            if session != self.session:
                return STOP
            if not self._pending():
                return None
            if self.handed >= self.tries:
                self.results[self.seq] = ("failed", f"its workers were lost {self.handed} times (a node gone, or a "
                                                    "worker killed); not retried again")
                self.cv.notify_all()
                return None
            self.handed += 1
            return self.seq

    def _pending(self) -> bool:
        return self.seq > 0 and self.seq not in self.results

    def job(self, seq: int) -> Any:
        with self.cv:
            return self.payload if seq == self.seq else None

    def post(self, seq: int, kind: str, value: Any) -> None:
        with self.cv:
            self.results.setdefault(seq, (kind, value))  # the first word on a job stands
            self.cv.notify_all()

    def started(self, session: int, info: dict[str, Any]) -> None:
        with self.cv:
            self.ready[session] = info
            self.beat = time.monotonic()
            self.cv.notify_all()

    def alive(self) -> None:
        with self.cv:
            self.beat = time.monotonic()

    def status(self, seq: int, timeout: float) -> dict[str, Any]:
        """What the driver waits on (up to ``timeout`` for the outcome): the job's outcome, its hand-outs, and how
        long since a worker was last heard from."""
        with self.cv:
            self.cv.wait_for(lambda: seq in self.results, timeout)
            result = self.results.get(seq)
            if result is not None:  # handed over once; the job stays answered (never handed out again)
                self.results[seq] = ("taken", None)
            return {"result": result, "handed": self.handed, "quiet_s": time.monotonic() - self.beat}

    def wait_ready(self, session: int, timeout: float) -> dict[str, Any] | None:
        with self.cv:
            self.cv.wait_for(lambda: session in self.ready, timeout)
            return self.ready.get(session)


# --- the workers (Ray Train's train function) -----------------------------------------------------------------


def _comm_error(e: BaseException) -> bool:
    """An error of the process group (a peer lost), not of the recipe."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in ("gloo", "nccl", "connection closed by peer",
                                                                   "connection reset by peer"))


def _serve(config: dict[str, Any]) -> str:
    """One worker of a session: check the node, then run jobs until told to stop."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from daemon.trainer.ray_files import _node_dir, _read_dir, _safe, _write_dir
    from daemon.trainer.step import run_job

    box, session = config["box"], config["session"]
    ctx = ray.train.get_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config["threads"])
    for p in reversed(config["paths"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    node = ray.get_runtime_context().get_node_id()
    found: list[Any] = [None] * size
    ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # Ray: unannotated
    dist.all_gather_object(found, {"node": node, "ip": ip, "versions": versions()})
    if rank == 0:
        refused = [f"node {f['ip']} ({f['node'][:12]}) has {why}" for f in found
                   if (why := mismatch(config["expected"], f["versions"]))]
        ray.get(box.started.remote(session, {"refused": "; ".join(refused)} if refused else
                                   {"workers": size, "nodes": len({f["node"] for f in found})}))
    if any(mismatch(config["expected"], f["versions"]) for f in found):
        return "refused"
    stop = threading.Event()
    if rank == 0:
        def beat() -> None:
            while not stop.wait(POLL_S):
                with contextlib.suppress(Exception):
                    box.alive.remote()

        threading.Thread(target=beat, daemon=True).start()
    cache = _node_dir()
    states: dict[str, dict[str, Any]] = {}
    try:
        while True:
            word = [ray.get(box.take.remote(session, POLL_S)) if rank == 0 else None]
            dist.broadcast_object_list(word, src=0)
            seq = word[0]
            if seq is None:
                continue
            if seq == STOP:
                return "stopped"
            job, inputs, refs = ray.get(box.job.remote(seq))
            try:
                for key in set(inputs.values()):
                    dest = cache / _safe(key)
                    if not dest.is_dir():
                        _write_dir(ray.get(refs[key])[1], dest)
                local = {p: str(cache / _safe(k)) for p, k in inputs.items()}
                job = replace(job, base_path=local.get(job.base_path, job.base_path),
                              head_path=local.get(job.head_path, job.head_path),
                              model_path=local.get(job.model_path, job.model_path) if job.model_path else "")
                out = cache / "out" / job.id
                t0 = time.perf_counter()
                candidate = run_job(states, job, out)
                candidate.metrics["worker_step_s"] = round(time.perf_counter() - t0, 3)  # the recipe's, in rank 0
                files = _read_dir(str(out)) if candidate.path is not None else {}
                shutil.rmtree(out, ignore_errors=True)
            except Exception as e:
                if _comm_error(e):  # a peer was lost: Ray Train starts a group on the nodes left, the job goes again
                    raise
                ray.get(box.post.remote(seq, "failed", f"{type(e).__name__}: {e}"))
                raise  # the peers may wait in an all-reduce for this worker: the group is torn down
            digests: list[Any] = [None] * size
            digest = hashlib.sha256()
            for name, data in sorted(files.items()):
                digest.update(f"{name}\0{len(data)}\0".encode())
                digest.update(data)
            dist.all_gather_object(digests, digest.hexdigest())
            if len(set(digests)) > 1:  # every worker starts the next step afresh
                states.clear()
            if rank == 0:
                if len(set(digests)) > 1:
                    ray.get(box.post.remote(seq, "failed", f"the {size} workers made different candidates (a recipe "
                                                           "whose data-parallel workers drifted apart)"))
                else:
                    candidate.metrics["trainer_workers"] = size
                    ray.get(box.post.remote(seq, "done", (replace(candidate, path=None), files)))
    finally:
        stop.set()
        shutil.rmtree(cache, ignore_errors=True)


# --- the driver side -------------------------------------------------------------------------------------------


@dataclass
class _Session:
    id: int
    gpu: bool
    thread: threading.Thread
    storage: str
    outcome: dict[str, Any] = field(default_factory=dict)  # "error": why the run ended, when it raised
    workers: int = 0  # as started (the retries of a step may run on fewer)

    def ended(self) -> bool:
        return not self.thread.is_alive()

    def why(self) -> str:
        error = self.outcome.get("error")
        return (str(error).strip().splitlines() or [""])[-1] if error is not None else "the session ended"


class ParallelSteps:
    """Runs data-parallel jobs on the Ray cluster ``ray`` is connected to, from the trainer worker process (the
    Ray driver, ``daemon/trainer/ray_trainer.py``)."""

    def __init__(self, ray: Any, workers: int, threads: int, recipe_paths: list[str], address: str) -> None:
        self.ray = ray
        self.workers = workers
        self.threads = threads
        self.recipe_paths = recipe_paths
        self.address = address  # for messages
        self.expected = versions()
        self._box: Any = None
        self._session: _Session | None = None
        self._count = 0
        self._seq = 0
        self.closed = False

    def _mailbox(self) -> Any:
        if self._box is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=False)
            cls = self.ray.remote(num_cpus=0, max_concurrency=16, max_restarts=0, scheduling_strategy=here)(_Mailbox)
            self._box = cls.remote(TRIES)
        return self._box

    def capacity(self, gpu: bool) -> tuple[int, str]:
        """How many workers the cluster's live nodes hold, and the cluster in words (for a refusal)."""
        res = self.ray.cluster_resources()
        nodes = sum(1 for n in self.ray.nodes() if n.get("Alive"))
        cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
        said = f"{cpus} CPU{'s' * (cpus != 1)}" + (f" and {gpus} GPU{'s' * (gpus != 1)}" if gpu else "")
        return (min(cpus, gpus) if gpu else cpus), f"the Ray cluster at {self.address} has {said} on {nodes} " \
                                                   f"node{'s' * (nodes != 1)}"

    def _settle(self, gpu: bool) -> None:
        """Wait (up to ``SETTLE_S``) until the cluster has room for N workers free, not only in all."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and not self.closed:
            free = self.ray.available_resources()
            room = min(free.get("CPU", 0), free.get("GPU", 0)) if gpu else free.get("CPU", 0)
            if room >= self.workers:
                return
            time.sleep(0.5)

    def _start(self, gpu: bool, most: int) -> _Session:
        """A session of 1 to ``most`` workers, up and checked (or refused: ``StepFailed``)."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", PLACEMENT_S)  # the controller reads it
        box = self._mailbox()
        self._count += 1
        sid = self._count
        self.ray.get(box.open.remote(sid))
        storage = tempfile.mkdtemp(prefix="reef-train-")
        # ray.train picks Ray Train v1 or v2 at import time (Reef runs v2: an elastic num_workers range, any return
        # value from the loop); mypy reads v1's annotations, hence the two ignores
        trainer = TorchTrainer(
            _serve,  # type: ignore[arg-type]
            train_loop_config={"box": box, "session": sid, "threads": self.threads, "paths": self.recipe_paths,
                               "expected": self.expected},
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
            scaling_config=ScalingConfig(num_workers=(1, most), use_gpu=gpu,  # type: ignore[call-arg, arg-type]
                                         resources_per_worker={"CPU": 1, "GPU": 1} if gpu else {"CPU": 1},
                                         elastic_resize_monitor_interval_s=24 * 3600.0),  # grown only at a step
            run_config=RunConfig(name=f"reef-session-{sid}", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=-1)))  # the mailbox bounds the retries
        outcome: dict[str, Any] = {}

        def fit() -> None:
            try:
                outcome["result"] = trainer.fit()
            except Exception as e:  # the run ended in error: the step waiting on it says why
                outcome["error"] = e

        thread = threading.Thread(target=fit, name=f"reef-train-session-{sid}", daemon=True)
        session = _Session(sid, gpu, thread, storage, outcome)
        thread.start()
        deadline = time.monotonic() + START_S
        while True:
            info = self.ray.get(box.wait_ready.remote(sid, 1.0))
            if info is not None or session.ended() or time.monotonic() > deadline or self.closed:
                break
        if info is None or "refused" in info:
            self._stop(session)
            if info is not None:
                raise StepFailed(f"a node differs from the daemon: {info['refused']}")
            why = session.why() if session.ended() else f"no worker started within {START_S:.0f} s"
            raise StepFailed(f"the data-parallel workers did not start: {why}")
        session.workers = int(info["workers"])
        log.info("trainer: %d data-parallel worker(s) on %d node(s) of %s", session.workers, info["nodes"],
                 self.address)
        return session

    def _stop(self, session: _Session) -> None:
        if self._box is not None:
            with contextlib.suppress(Exception):
                self.ray.get(self._box.end.remote(session.id), timeout=10)
        session.thread.join(30)
        shutil.rmtree(session.storage, ignore_errors=True)
        if self._session is session:
            self._session = None

    def run(self, job: TrainJob, inputs: dict[str, str], refs: dict[str, Any]) -> tuple[Candidate, dict[str, bytes]]:
        """One step on N workers (a retry on the workers left): the candidate without a path, and its files."""
        gpu = job.device == "cuda" or (job.device == "auto" and self.ray.cluster_resources().get("GPU", 0) > 0)
        have, cluster = self.capacity(gpu)
        session = self._session
        if session is not None and not session.ended():  # Ray Train may have restarted it smaller since
            info = self.ray.get(self._mailbox().wait_ready.remote(session.id, 0))
            session.workers = int((info or {}).get("workers", 0))
        if session is not None and (session.ended() or session.gpu != gpu or session.workers < self.workers
                                    or have < self.workers):
            self._stop(session)  # over, another device, or shrunk by a retry: a step starts on N workers
            session = None
        if have < self.workers:
            raise StepFailed(f"trainer_workers = {self.workers} needs {self.workers} {'GPUs' if gpu else 'CPUs'} "
                             f"(one a worker); {cluster}", job=job.id)
        if session is None:
            # Ray Train sizes an elastic group by what its autoscaling coordinator last saw (a node that just
            # joined comes into that view seconds later on a busy machine: CI started 1 of 2 twice in a row), and
            # resources a stopped session held come free a little later: a group that came up short is stopped and
            # started again, for up to SETTLE_S
            deadline = time.monotonic() + SETTLE_S
            for attempt in itertools.count():
                self._settle(gpu)
                session = self._start(gpu, self.workers)
                if session.workers >= self.workers:
                    break
                self._stop(session)
                last = attempt >= 1 and time.monotonic() > deadline
                log.warning("trainer: %d of %d data-parallel workers started%s", session.workers, self.workers,
                            "" if last else "; starting them again")
                if last or self.closed:
                    raise StepFailed(f"trainer_workers = {self.workers}: only {session.workers} worker(s) could "
                                     f"start; {cluster}, some of them busy", job=job.id)
                time.sleep(RESTART_S)
            self._session = session
        assert session is not None  # kept, or started above (the loop ends by break or raise)
        box = self._mailbox()
        self._seq += 1
        seq = self._seq
        self.ray.get(box.submit.remote(seq, (job, inputs, refs)))
        while True:
            if self.closed:
                raise EngineError("the trainer is shutting down")
            st = self.ray.get(box.status.remote(seq, 0.5))
            if st["result"] is not None:
                kind, value = st["result"]
                if kind == "failed":
                    raise StepFailed(value, job=job.id)
                candidate, files = value
                return candidate, files
            if session.ended():  # out of its own retries, or stopped: the job goes to a new session if it may
                why = session.why()
                self._stop(session)
                if st["handed"] >= TRIES:
                    raise StepFailed(f"its workers were lost {st['handed']} times; not retried again ({why})",
                                     job=job.id)
                have, cluster = self.capacity(gpu)
                if have < 1:
                    raise StepFailed(f"no worker left to run it: {cluster} ({why})", job=job.id)
                log.warning("trainer: the session running job %s ended (%s); retrying on %d worker(s)", job.id,
                            why, min(have, self.workers))
                session = self._start(gpu, min(have, self.workers))
                self._session = session
                continue
            if st["quiet_s"] > LOST_S:
                self._stop(session)
                raise StepFailed(f"its workers were lost and none started again within {LOST_S:.0f} s", job=job.id)

    def close(self) -> None:
        """Stop the session (its workers leave their loop, the run ends)."""
        self.closed = True
        if self._session is not None:
            self._stop(self._session)
