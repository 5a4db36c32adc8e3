"""One training step, wherever it runs: a job's recipe called into a candidate directory that ends up complete under
its final name or not at all (temp directory beside it, fsync, rename), with the process's peak memory in its
metrics. The local worker (``daemon/trainer/worker.py``) and the Ray actor (``daemon/trainer/ray_trainer.py``) both
run their steps through ``run_job``, so a recipe cannot tell the two apart.
"""

from __future__ import annotations

import resource
from dataclasses import replace
from pathlib import Path
from typing import Any

from daemon import durable
from recipes.base import Candidate, TrainJob, set_explicit


def peak_rss_mb() -> float:
    """The worker's own peak resident memory so far (MB). Linux: ``VmHWM``, the high-water mark of this process's
    address space. Not ``ru_maxrss``: a spawned worker's starts at its parent's resident size at the fork (the
    kernel keeps the larger of the two across exec), so next to a daemon holding 2 GB every step read 2 GB."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)  # kB
    except (OSError, ValueError, IndexError):
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB where there is no /proc


def recipe_of(job: TrainJob) -> Any:
    """The job's recipe with its settings: every value the job carries, and the ones the user set marked as set
    (``TrainJob.explicit``), so a setting inert at its default is not taken for one the user set."""
    from recipes import load_recipe

    cls = load_recipe(job.recipe, job.recipe_paths)
    return cls(set_explicit(cls.parse_settings(job.settings), job.explicit))


def run_job(states: dict[str, dict[str, Any]], job: TrainJob, out_dir: Path) -> Candidate:
    """Run ``job``'s recipe step; a candidate directory ends up complete at ``out_dir`` or not at all."""
    recipe = recipe_of(job)
    state = states.setdefault(job.recipe, {})
    with durable.staged_dir(out_dir) as tmp:
        try:
            candidate = recipe.train(replace(job, work_dir=str(tmp)), state)
        except BaseException:
            state.clear()  # whatever it held may be half-updated
            raise
        if not isinstance(candidate, Candidate):
            raise TypeError(f"recipe {job.recipe}: train() returned {type(candidate).__name__}, not a Candidate")
        candidate.metrics["trainer_peak_rss_mb"] = peak_rss_mb()  # this step's, or an earlier one's if higher
        if candidate.skipped is not None:
            return replace(candidate, path=None)
        if not any(tmp.iterdir()):
            raise ValueError(f"recipe {job.recipe}: train() wrote no files into the candidate directory")
        durable.publish_dir(tmp, out_dir)
    return replace(candidate, path=str(out_dir))
