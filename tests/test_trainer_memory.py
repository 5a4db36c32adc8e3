"""The trainer's memory (issue 23): a step runs its batch in micro-batches sized from the recipe's
``memory_budget_mb``, so its peak resident memory follows the budget, not the batch; the update is the one the
whole batch gives; a budget that holds no sample is refused when the scenario is created, or (a sample longer
than the budget on the model at hand) the step fails naming both numbers.

Real components: the real trainer worker process (its own peak RSS, read by the worker), the real online-rl and
sao steps, a real daemon. The model is the tiny one with agent-like lengths (400-token prompts, 60-token answers),
where SmolLM2 would be too slow for a test; ``bench/trainer_memory.py`` measures SmolLM2 at the defaults."""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

import pytest
import torch

from daemon.errors import StepFailed
from daemon.trainer.worker import TrainerClient
from recipes.base import FeedbackReport, ScoredExchange, TrainJob
from recipes.online_rl import OnlineRLSettings, Sample, make_optimizer, train_step
from tests.conftest import Daemon, assert_canonical_error

PROMPT, ANSWER = 400, 60  # tokens: an agent's prompt, an everyday answer


def records(n: int, prompt: int, answer: int, seed: int = 0) -> list[ScoredExchange]:
    """``n`` scored exchanges in groups of 8 (8 samples per prompt, rewards 0/1 alternating: every group carries
    signal), with made-up token ids and behaviour log-probs."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(prompt)] for _ in range(max(1, n // 8))]
    return [ScoredExchange(id=f"r{i}", release_id=None, prompt_token_ids=prompts[(i // 8) % len(prompts)],
                           token_ids=[rng.randrange(10, 4000) for _ in range(answer)], logprobs=[-8.0] * answer,
                           report=FeedbackReport(id=f"rep_{i}", seq=i + 1, score=float(i % 2)))
            for i in range(n)]


def job(tiny_model: Path, batch: list[ScoredExchange], budget_mb: int, n: int, base: str = "base") -> TrainJob:
    settings = dataclasses.asdict(OnlineRLSettings(memory_budget_mb=budget_mb, steps_per_batch=1))
    return TrainJob(id=f"job{n}", recipe="online-rl", settings=settings, batch=batch, base_key=base,
                    base_path=str(tiny_model), head_key="base", head_path=str(tiny_model), candidate_key=f"c{n}")


def step_peak_growth(tiny_model: Path, tmp_path: Path, budget_mb: int) -> tuple[float, float]:
    """In a fresh trainer worker: a warm-up step on a short batch (imports, model, optimizer), then online-rl's
    default batch (64 samples) of agent-like lengths. The rise of the worker's peak RSS during the second step
    (MB), and its micro-batch count."""
    trainer = TrainerClient(threads=1)
    try:
        warm = trainer._run(job(tiny_model, records(8, 8, 4), budget_mb, 1), tmp_path / f"{budget_mb}-1")
        big = trainer._run(job(tiny_model, records(64, PROMPT, ANSWER), budget_mb, 2, base="c1"),
                           tmp_path / f"{budget_mb}-2")
    finally:
        trainer.close()
    return big.metrics["trainer_peak_rss_mb"] - warm.metrics["trainer_peak_rss_mb"], big.metrics["micro_batches"]


def test_a_steps_peak_memory_follows_the_budget_not_the_batch(tiny_model: Path, tmp_path: Path) -> None:
    """The same default-sized batch under a budget that holds one sample and one that holds them all: the
    small budget's step raises the worker's peak by at most about its budget, the large one's by far more (the
    whole batch's activations at once, as every step did before: 23 GB on SmolLM2)."""
    small, small_parts = step_peak_growth(tiny_model, tmp_path, 16)
    large, large_parts = step_peak_growth(tiny_model, tmp_path, 4096)
    assert small_parts >= 32 and large_parts == 1, (small_parts, large_parts)
    assert small <= 16 * 2 + 24, (small, large)  # the budget, the estimate's slack and the allocator's
    assert large >= 10 * max(small, 16), (small, large)


@pytest.mark.parametrize(("prompt", "budget"), [(40, 2), (400, 8)], ids=["micro-batches", "checkpointed"])
def test_micro_batches_make_the_same_update_as_the_whole_batch(tiny_model: Path, prompt: int, budget: int) -> None:
    """Gradient accumulation is exact: the weights after two steps in micro-batches equal those after the same
    steps on the batch at once (a mis-scaled share of the loss, e.g. divided by the micro-batch's own token
    count, or gradients not cleared between steps, moves them differently); so do rows too long for the budget,
    run one at a time with gradient checkpointing (400-token prompts, 12-token answers: 9.3 MB each by the estimate, 5.4 MB
    checkpointed, the budget 8 MB). Plain SGD, so that the weights
    move by the gradient itself (Adam's normalisation would blow float noise in near-zero gradients up)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rows = records(16, prompt, 12, seed=1)
    rng = random.Random(2)
    batch = [Sample(r.prompt_token_ids, r.token_ids[: rng.randrange(3, 13)], [], r.score, str(i // 4))
             for i, r in enumerate(rows)]
    for s in batch:
        s.logprobs = [-8.0] * len(s.token_ids)
    after = {}
    for budget_mb in (budget, 4096):
        model = copy.deepcopy(base)
        settings = OnlineRLSettings(memory_budget_mb=budget_mb, steps_per_batch=2, entropy_coef=0.01, grad_clip=1e9)
        make_optimizer(model, settings)  # freezes the embeddings, as in training
        sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        metrics = train_step(model, batch, settings, sgd)
        after[budget_mb] = (metrics, {k: v.detach().clone() for k, v in model.named_parameters()})
    assert after[budget][0]["micro_batches"] > 1 and after[4096][0]["micro_batches"] == 1
    assert after[budget][0]["checkpointed"] == (16 if prompt == 400 else 0) and after[4096][0]["checkpointed"] == 0
    for key in ("pg_loss", "entropy", "ratio_mean", "kl", "grad_norm"):
        assert after[budget][0][key] == pytest.approx(after[4096][0][key], rel=1e-4, abs=1e-6), key
    moved = 0
    for name, small in after[budget][1].items():
        large = after[4096][1][name]
        assert torch.allclose(small, large, rtol=1e-4, atol=1e-6), (name, (small - large).abs().max())
        moved += int(not torch.equal(large, base.get_parameter(name)))
    assert moved > 0


SMOLLM2 = dict(layers=30, hidden=576, intermediate=1536, heads=9, vocab=49152, eager=False)  # SmolLM2-135M's shape


def fitted(rows: list[tuple[int, int]], budget_mb: int) -> list[tuple[bool, list[int]]]:
    """``micro_batches`` of ``rows`` on SmolLM2's shape, each checked against the estimate it is built on: every row
    in exactly one micro-batch; a micro-batch runs with gradient checkpointing exactly when its rows need it (a row
    whose plain cost is over the budget), so a row that needs it never shares a plain one; its padded cost (its
    row count times one row of its widest width and longest answer) within the budget. (checkpoint, rows) each."""
    from recipes.memory import MB, Shape, micro_batches, row_bytes

    shape = Shape(**SMOLLM2)  # type: ignore[arg-type]
    budget = budget_mb * MB
    parts = micro_batches(rows, shape, budget_mb)
    assert sorted(i for part in parts for i in part.rows) == list(range(len(rows)))
    for part in parts:
        needs = {row_bytes(shape, rows[i][0] + rows[i][1], rows[i][1]) > budget for i in part.rows}
        assert needs == {part.checkpoint}, (part, [rows[i] for i in part.rows])
        width = max(rows[i][0] + rows[i][1] for i in part.rows)
        answer = max(rows[i][1] for i in part.rows)
        cost = len(part.rows) * row_bytes(shape, width, answer, part.checkpoint)
        assert cost <= budget, (part, [rows[i] for i in part.rows], cost / MB, budget_mb)
    return [(part.checkpoint, part.rows) for part in parts]


@pytest.mark.parametrize("budget_mb", [1024, 4096])
def test_each_micro_batch_fits_the_budget_by_the_estimate(budget_mb: int) -> None:
    """Rows of every mix (prompts of 1 to 2,000 tokens, answers of 1 to 300: a longer row may have the shorter
    answer, and the answer is what costs most per token) pack into micro-batches that each fit the budget, and
    they do pack: several rows share a micro-batch, plain and checkpointed alike."""
    rng = random.Random(budget_mb)
    rows = [(rng.choice((rng.randrange(1, 60), rng.randrange(60, 600), rng.randrange(600, 2000))),
             rng.randrange(1, 300)) for _ in range(300)]
    parts = fitted(rows, budget_mb)
    assert max(len(r) for c, r in parts if not c) >= 2
    assert max(len(r) for c, r in parts if c) >= 2


def test_a_row_that_needs_checkpointing_never_shares_a_plain_micro_batch() -> None:
    """Two rows of 400 tokens on a 950 MB budget: 390 + 10 fits plain (905 MB), 300 + 100 does not (981 MB: an
    answer token costs a vocabulary's logits). Sorted by length they are neighbours, and the second's checkpointed
    cost (154 MB) would fit beside the first: it must still run checkpointed, in a micro-batch of its own kind."""
    assert fitted([(390, 10), (300, 100)], 950) == [(False, [0]), (True, [1])]
    assert fitted([(300, 100), (390, 10)], 950) == [(True, [0]), (False, [1])]


def test_a_sample_longer_than_the_budget_fails_the_step_naming_both_numbers(tiny_model: Path, tmp_path: Path) -> None:
    trainer = TrainerClient(threads=1)
    try:
        with pytest.raises(StepFailed) as e:
            trainer._run(job(tiny_model, records(8, 3000, ANSWER), 16, 1), tmp_path / "long")
    finally:
        trainer.close()
    msg = e.value.message
    assert "memory_budget_mb 16 is too small for one sample" in msg and "3000 prompt and 60 answer tokens" in msg, msg


@pytest.mark.parametrize("recipe", ["online-rl", "openclaw-rl", "sao", "ttt-discover"])
def test_a_budget_too_small_for_one_sample_is_refused_when_the_scenario_is_created(daemon: Daemon,
                                                                                  recipe: str) -> None:
    with daemon.http() as c:
        r = c.post("/reef/scenarios", json={"name": f"tight-{recipe}", "recipe": recipe,
                                            "settings": {"memory_budget_mb": 1}})
        err = assert_canonical_error(r, 400)
        assert "memory_budget_mb 1 is too small for even one sample" in err["message"], err
        assert c.get(f"/reef/scenarios/tight-{recipe}").status_code == 404  # nothing was made
        ok = c.post("/reef/scenarios", json={"name": f"roomy-{recipe}", "recipe": recipe,
                                             "settings": {"memory_budget_mb": 2}})
        assert ok.status_code == 201, ok.text


def test_sao_in_micro_batches_makes_the_same_update_as_the_whole_batch(tiny_model: Path) -> None:
    """sao with several rollouts per step: a forward without grad first (the critic, the proximal log-probs),
    then each step's in micro-batches, gives the update of the batch at once (one forward serving both)."""
    from transformers import AutoModelForCausalLM

    from recipes.sao import SAOSettings, make_learner, sao_step

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    batch = [Sample(r.prompt_token_ids, r.token_ids, [-8.0] * 12, r.score, r.id)
             for r in records(8, 40, 12, seed=3)]
    after = {}
    for budget in (2, 4096):
        model = copy.deepcopy(base)
        settings = SAOSettings(batch_size=8, steps_per_batch=2, memory_budget_mb=budget, entropy_coef=0.01,
                               grad_clip=1e9)
        learner = make_learner(model, settings)
        learner.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        learner.value.seeded = True  # a zero critic: every token carries the reward as its advantage
        metrics = sao_step(model, batch, settings, learner)
        after[budget] = (metrics, {k: v.detach().clone() for k, v in model.named_parameters()})
    assert after[2][0]["micro_batches"] > 1 and after[4096][0]["micro_batches"] == 1
    assert after[2][0]["masked_tokens"] == 0 and after[2][0]["pg_loss"] != 0
    for key in ("pg_loss", "entropy", "value_loss", "iw_mean", "kl_behaviour", "grad_norm"):
        assert after[2][0][key] == pytest.approx(after[4096][0][key], rel=1e-4, abs=1e-6), key
    for name, small in after[2][1].items():
        assert torch.allclose(small, after[4096][1][name], rtol=1e-4, atol=1e-6), name
    assert any(not torch.equal(v, base.get_parameter(k)) for k, v in after[2][1].items())


def test_the_workers_peak_is_its_own_not_its_parents(tiny_model: Path, tmp_path: Path) -> None:
    """trainer_peak_rss_mb is the worker's own high-water mark: a daemon (here, this process) holding 1.5 GB more
    when it spawns the worker must not show in it (ru_maxrss carries the parent's size at the fork across exec,
    which made every step of a worker spawned by a large daemon read the daemon's size)."""
    held = bytearray(b"\x01") * (1536 << 20)  # resident: every page written
    try:
        trainer = TrainerClient(threads=1)
        try:
            step = trainer._run(job(tiny_model, records(8, 8, 4), 16, 1), tmp_path / "own")
        finally:
            trainer.close()
    finally:
        del held
    assert 0 < step.metrics["trainer_peak_rss_mb"] < 1400, step.metrics["trainer_peak_rss_mb"]
