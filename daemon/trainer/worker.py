"""The trainer: a worker process that turns a batch of scored records into a candidate, so serving never
stalls on training.

Design choices:
- One long-lived worker process (``spawn``: no inherited threads or torch state), with its own torch thread
  count (``threads``, default 1: on a 2-core machine one core stays for serving). Jobs and results travel over
  a pipe as plain dicts.
- Full fine-tuning, or LoRA (``lora = true``: peft adapters on the attention and MLP projections, trained
  while the lineage lasts and merged into the saved candidate, so every release is a plain model directory).
- The worker keeps the model and optimizer of its last candidate in memory: when the next job's base is that
  candidate (it was published), training continues with the optimizer state intact; otherwise it reloads the
  base release's weights and starts a fresh optimizer.
- A candidate is written to a temp dir beside its final name, every file fsynced, then renamed: a half-written
  candidate never exists under its final name, so it can never become a release.
- The worker also evaluates for the gate (greedy answers to the family's validation prompts, scored by its
  verifier) for the candidate and, once per head release, for the serving head: the daemon's engine is never
  asked.
- ``TrainerClient.run`` restarts a dead worker and retries the job (up to ``retries`` times); a job that fails
  inside the worker with an exception is not retried (the same batch would fail again).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from daemon import durable
from daemon.errors import EngineError

log = logging.getLogger("reef.trainer")


# --- the worker process -----------------------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.key: str | None = None  # the release (or candidate) the model in memory holds
        self.model: Any = None
        self.tokenizer: Any = None
        self.optimizer: Any = None
        self.base_eval: dict[str, list[float]] = {}


def _eval_scores(model: Any, tokenizer: Any, ev: dict[str, Any]) -> list[float]:
    from recipes.online_rl import eos_ids, generate, render_prompt
    from recipes.tasks import get_family

    family = get_family(ev["family"])
    # validation prompts: never trained on, and not the held-out ones a demo or benchmark reports at the end
    tasks = family.validation(ev["n"], seed=ev.get("seed", 0))
    outs = generate(model, [render_prompt(tokenizer, t.prompt) for t in tasks], eos=eos_ids(model, tokenizer),
                    max_new_tokens=ev.get("max_new_tokens", 8), temperature=0)
    return [family.exact(t, tokenizer.decode(ids, skip_special_tokens=True)) for t, (ids, _) in zip(tasks, outs,
                                                                                                      strict=True)]


def run_job(state: _State, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.online_rl import OnlineRLSettings, Sample, make_optimizer, train_step, wrap_lora

    settings = OnlineRLSettings(**job["settings"])
    t0 = time.perf_counter()
    if state.key != job["base_key"]:
        base = Path(job["base_path"])
        state.tokenizer = AutoTokenizer.from_pretrained(base)
        state.model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if settings.lora:  # fresh adapters on the base release's weights; candidates are saved merged
            state.model = wrap_lora(state.model, settings)
        state.optimizer = make_optimizer(state.model, settings)
        state.key = job["base_key"]
    model, tokenizer = state.model, state.tokenizer
    ev = job.get("eval")
    base_scores = None
    t_eval = time.perf_counter()
    if ev:  # the gate compares with the serving head, which the lineage in memory may have moved past
        # the daemon sends the head's scores when it has them (the head is the candidate it last published)
        base_scores = ev.get("head_scores") or state.base_eval.get(job["head_key"])
        if base_scores is None:
            head = model if job["head_key"] == state.key else AutoModelForCausalLM.from_pretrained(
                job["head_path"], dtype=torch.float32)
            state.base_eval = {job["head_key"]: _eval_scores(head, tokenizer, ev)}  # only the head's is needed
            base_scores = state.base_eval[job["head_key"]]
    eval_s = time.perf_counter() - t_eval
    samples = [Sample(**s) for s in job["samples"]]
    t_train = time.perf_counter()
    model.train()
    metrics = train_step(model, samples, settings, state.optimizer)  # its own steps_per_batch steps
    model.eval()
    t_save = time.perf_counter()
    train_s = t_save - t0  # loading and evaluating the base included
    out = Path(job["out_dir"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if settings.lora:  # a release is a whole model the engine loads as is: adapters merged into a copy
            import copy

            copy.deepcopy(model).merge_and_unload().save_pretrained(tmp, safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        for f in Path(job["base_path"]).iterdir():  # tokenizer and generation files travel with the weights
            if f.is_file() and not (tmp / f.name).exists() and not f.name.endswith((".safetensors", ".bin")):
                shutil.copyfile(f, tmp / f.name)
        durable.sync_tree(tmp)
        os.rename(tmp, out)
        durable.sync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    state.key = job["candidate_key"]  # if it is published, the next job continues from here
    metrics.update(step_s=round(t_save - t_train, 3), save_s=round(time.perf_counter() - t_save, 3))
    result: dict[str, Any] = {"ok": True, "candidate": str(out), "train_metrics": metrics,
                              "train_s": round(train_s, 3), "samples": len(samples)}
    if ev:
        t_eval = time.perf_counter()
        cand_scores = _eval_scores(model, tokenizer, ev)
        metrics["eval_s"] = round(eval_s + time.perf_counter() - t_eval, 3)
        result["eval"] = {"candidate": cand_scores, "base": base_scores}
    return result


def _exit_with_parent(parent: int) -> None:
    """A worker must not outlive its daemon (``kill -9`` of the daemon leaves no orphan training on)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def worker_main(conn: Connection, threads: int, parent: int) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    state = _State()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            result = run_job(state, job)
        except Exception as e:  # the daemon decides; the worker stays up
            state.key = None
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        conn.send(result)


# --- the daemon side ---------------------------------------------------------------------------------------


class TrainerClient:
    """Runs jobs in the worker process, restarting it when it dies."""

    def __init__(self, threads: int = 1, retries: int = 2) -> None:
        self.threads = threads
        self.retries = retries
        self._proc: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0

    def _ensure(self) -> Connection:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        if self._proc is not None:
            self.restarts += 1
            log.warning("trainer worker died (exit %s); restarting it", self._proc.exitcode)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=worker_main, args=(child, self.threads, os.getpid()), name="reef-trainer", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        return parent

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def _run(self, job: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            for attempt in range(self.retries + 1):
                if self._closed:
                    raise EngineError("the trainer is shutting down")
                conn = self._ensure()
                try:
                    conn.send(job)
                    while not conn.poll(0.2):
                        if not self._proc.is_alive():
                            raise EOFError
                    result: dict[str, Any] = conn.recv()
                    return result
                except (EOFError, OSError, BrokenPipeError):
                    self._conn = None
                    shutil.rmtree(job["out_dir"], ignore_errors=True)
                    if attempt == self.retries:
                        raise EngineError(f"the trainer worker died {attempt + 1} times on job {job['id']}") from None
            raise AssertionError("unreachable")

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self._run, job)

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
