"""``trainer_workers``: online-rl's step as data-parallel Ray Train workers on a real Ray cluster of two nodes on this
machine (a head from ``ray start --head`` and a second node joined to it, each with one CPU and its own temp dir, on
127.0.0.1 only; ``tests/ray_cluster.py``). The model is the tiny one with LoRA adapters (``lora = true``): SmolLM2
would take minutes a step on this 2-core machine (``bench/ray_scaling.py`` measures it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.trainer.worker import TrainerClient
from recipes.base import FeedbackReport, ScoredExchange, TrainJob
from recipes.online_rl import OnlineRLSettings
from tests.ray_cluster import RAY_ENV, Cluster

# the 2-worker adapter's distance from the 1-worker one, relative to how far the step moved it: measured 0.0 to
# 2e-7 (the same sums in another order), against 0.9 for the same step on another batch
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.head()
        c.join(resources='{"second": 1}')
        c.wait_cpus(2)
        yield c
    finally:
        pids = {p for n in c.nodes for p in n.pids()}
        c.close()
        deadline = time.monotonic() + 60
        while alive(pids) and time.monotonic() < deadline:  # a worker of a killed raylet leaves on its own
            time.sleep(0.2)
        assert not alive(pids), f"Ray processes left running: {alive(pids)}"


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(p)
        except OSError:
            pass
    return out


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer worker (the Ray driver) reads these from the environment it starts with."""
    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)


def scored_batch(model_dir: Path, seed: int, prompts: int = 2, group: int = 4) -> list[ScoredExchange]:
    """Answers the tiny model samples to ``prompts`` prompts, ``group`` each, scored so that every group carries
    signal; ``seed`` picks the prompts' words and the samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.online_rl import eos_ids, generate, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    words = ["file", "window", "river", "stone", "cloud", "paper"]
    ids = [render_prompt(tokenizer, f"Say {words[(seed * prompts + i) % len(words)]}.") for i in range(prompts)]
    rows = [i for i in range(prompts) for _ in range(group)]
    outs = generate(model, [ids[i] for i in rows], eos=eos_ids(model, tokenizer), max_new_tokens=6,
                    generator=torch.Generator().manual_seed(seed))
    return [ScoredExchange(id=f"rec_{seed}_{n}", release_id=None, prompt_token_ids=ids[i], token_ids=tokens,
                           logprobs=logprobs, report=FeedbackReport(id=f"rep_{seed}_{n}", seq=n + 1, score=n % 2))
            for n, (i, (tokens, logprobs)) in enumerate(zip(rows, outs, strict=True))]


def job(model_dir: Path, batch: list[ScoredExchange], name: str) -> TrainJob:
    settings = OnlineRLSettings(lora=True, lr=1e-2)
    return TrainJob(id=name, recipe="online-rl", settings=settings.to_dict(), batch=batch, base_key="base",
                    base_path=str(model_dir), head_key="base", head_path=str(model_dir), candidate_key=name,
                    model_key="c" * 40, model_release="d" * 40, model_path=str(model_dir), data_parallel=True)


def adapter(path: str | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from daemon import lora

    assert path is not None
    return load_file(str(Path(path) / lora.WEIGHTS))


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """How far adapter ``a`` is from ``b``, relative to how far ``b``'s step moved it: a first step trains the LoRA
    B matrices (A's gradient is 0 while B is 0, their start) and leaves A as initialised, the same everywhere."""
    assert a.keys() == b.keys()
    for k in a:
        if "lora_A" in k:
            assert torch.equal(a[k], b[k]), k  # the same initial adapter (seeded by the base it starts from)
    moved = sum(float(b[k].norm() ** 2) for k in b if "lora_B" in k) ** 0.5
    return sum(float((a[k] - b[k]).norm() ** 2) for k in a if "lora_B" in k) ** 0.5 / moved


def test_two_workers_make_the_adapter_one_worker_makes(cluster: Cluster, tiny_model: Path, tmp_path: Path,
                                                       ray_env: Any) -> None:
    same, other = scored_batch(tiny_model, seed=0), scored_batch(tiny_model, seed=1)
    two = TrainerClient(ray=(cluster.address, 2))
    try:
        parallel = two._run(job(tiny_model, same, "two"), tmp_path / "two")
    finally:
        two.close()
    one = TrainerClient()  # the local worker: one process, the whole batch
    try:
        alone = one._run(job(tiny_model, same, "one"), tmp_path / "one")
        elsewhere = one._run(job(tiny_model, other, "other"), tmp_path / "other")
    finally:
        one.close()
    # two workers, each on half of the 8 answers
    assert parallel.metrics["trainer_workers"] == 2 and parallel.metrics["shard_samples"] == 4
    assert "trainer_workers" not in alone.metrics and "shard_samples" not in alone.metrics
    near, far = distance(adapter(parallel.path), adapter(alone.path)), distance(adapter(elsewhere.path),
                                                                             adapter(alone.path))
    print(f"2 workers vs 1: {near:.2e}; another batch: {far:.2e}")
    assert near < TOLERANCE < far
