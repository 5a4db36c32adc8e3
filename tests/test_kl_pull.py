"""The pull toward the base that every weights recipe applies at its defaults (issue 41): ``kl_coef * KL(policy ||
base)`` per completion token in the loss of a LoRA policy (the base: the adapter switched off), and the default
drift bound ``max_kl`` the watchdog reads. On by default, 0 turns the pull off, bad values are refused, and the
term pulls a policy back toward its base where the same steps without it do not."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import pytest
import torch

from daemon.errors import BadRequest
from daemon.models import build_tiny
from recipes.base import TrainJob
from recipes.online_rl import (
    KL_COEF,
    MAX_KL,
    OnlineRL,
    OnlineRLSettings,
    Sample,
    kl_from_base,
    make_optimizer,
    pull_coef,
    token_logprobs,
    train_step,
    wrap_lora,
)
from recipes.openclaw_rl import OpenClawRL
from recipes.sao import SAO, SAOSettings, make_learner, sao_step
from recipes.ttt_discover import TTTDiscover

RECIPES = (OnlineRL, SAO, OpenClawRL, TTTDiscover)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    """The tiny model with its output head scaled up: random weights give it near-uniform answers that an adapter
    on its attention and MLP can barely move; scaled, its answers are peaked like a trained model's (the end token
    first at 1.5e-6) and a few steps can run off toward answering nothing."""
    torch.set_num_threads(1)
    tokenizer, model = build_tiny(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return tokenizer, model


def lora(tiny: tuple[Any, Any], *, moved: bool, seed: int = 0, scale: float = 0.3) -> Any:
    """The tiny model with a LoRA adapter; ``moved``: its B matrices drawn away from 0 (a fresh adapter is the
    base exactly)."""
    torch.manual_seed(seed)
    model = wrap_lora(copy.deepcopy(tiny[1]), OnlineRLSettings(lora=True, lora_rank=4))
    if moved:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, scale)
    return model


def batch_of(model: Any, answers: list[tuple[list[int], float]], prompt: tuple[int, ...] = (5, 6, 7)) -> list[Sample]:
    """One group of answers to ``prompt`` with their rewards, behaviour log-probs under ``model`` (on-policy)."""
    out = []
    for tokens, reward in answers:
        s = Sample(prompt_token_ids=list(prompt), token_ids=tokens, logprobs=[0.0] * len(tokens), reward=reward,
                   group="g")
        with torch.no_grad():
            s.logprobs = token_logprobs(model, [s], entropy_grad=False)[0][0].tolist()
        out.append(s)
    return out


def answers(eos: int) -> list[tuple[list[int], float]]:
    """A scorer an empty answer satisfies: the answer that is only the end token scores 1, the others 0."""
    return [([eos], 1.0), ([8, 9, 10, 11, eos], 0.0), ([12, 13, 14, eos], 0.0), ([8, 15, 9, 16, eos], 0.0)]


# --- on by default, 0 turns it off, bad values refused ----------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_every_weights_recipe_pulls_toward_its_base_and_bounds_drift_by_default(recipe: Any) -> None:
    settings = recipe.parse_settings({})
    assert settings.kl_coef == KL_COEF > 0
    assert settings.max_kl == MAX_KL > 0
    recipe.check_settings(settings)  # the defaults pass their own checks


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_bad_pull_and_bound_settings_are_refused_naming_them(recipe: Any) -> None:
    for bad, key in (({"kl_coef": -0.1}, "kl_coef"), ({"kl_coef": math.nan}, "kl_coef"),
                     ({"kl_coef": math.inf}, "kl_coef"), ({"max_kl": 0}, "max_kl"), ({"max_kl": -1}, "max_kl"),
                     # no base to measure against with whole weights: a value set there would be inert
                     ({"kl_coef": KL_COEF * 3, "lora": False}, "kl_coef"),
                     ({"max_kl": MAX_KL * 3, "lora": False}, "max_kl"),
                     # set, even to the default's value: what was set is refused, never taken and left inert
                     ({"kl_coef": KL_COEF, "lora": False}, "kl_coef"), ({"max_kl": MAX_KL, "lora": False}, "max_kl")):
        with pytest.raises(BadRequest) as e:
            recipe.check_settings(recipe.parse_settings(bad))
        assert e.value.param == f"settings.{key}" and key in str(e.value), bad
    for fine in ({"kl_coef": 0}, {"max_kl": None}, {"lora": False}, {"kl_coef": 0, "max_kl": None, "lora": False},
                 {"kl_coef": 2.5, "max_kl": 0.3}):
        recipe.check_settings(recipe.parse_settings(fine))


def test_a_default_step_has_the_term_in_its_loss_and_kl_coef_0_removes_it(tiny: Any) -> None:
    """At the defaults a LoRA step's loss is the policy loss plus KL_COEF times the KL to the base (and its
    gradient differs from the same step without it); kl_coef = 0: no term, the plain policy-gradient step."""
    eos = tiny[0].eos_token_id
    model = lora(tiny, moved=True)
    batch = batch_of(model, answers(eos))
    plain = copy.deepcopy(model)
    settings = OnlineRL.parse_settings({"lora": True})
    assert pull_coef(model, settings) == KL_COEF
    with_pull = train_step(model, batch, settings)
    without = train_step(plain, batch, OnlineRL.parse_settings({"lora": True, "kl_coef": 0}))
    assert with_pull["kl_coef"] == KL_COEF and with_pull["kl_ref"] > 0.01
    assert with_pull["loss"] == pytest.approx(with_pull["pg_loss"] + KL_COEF * with_pull["kl_ref"], rel=1e-5)
    assert without["kl_coef"] == 0 and "kl_ref" not in without
    assert without["loss"] == pytest.approx(without["pg_loss"], abs=1e-7)
    assert with_pull["pg_loss"] == pytest.approx(without["pg_loss"], rel=1e-5)  # the same batch, the same start
    assert abs(with_pull["grad_norm"] - without["grad_norm"]) > 1e-4  # the term is in the gradient


def test_the_term_is_exactly_the_measured_drift_on_a_one_sample_batch(tiny: Any) -> None:
    """``kl_ref`` (the loss's term) and ``kl_from_base`` (what max_kl bounds) are the same quantity: the exact
    per-token KL from the base, before the step on the same sample."""
    model = lora(tiny, moved=True)
    batch = batch_of(model, [([8, 9, 10, 11], 1.0), ([12, 13], 0.0)])
    before = kl_from_base(model, batch)
    metrics = train_step(model, batch, OnlineRL.parse_settings({"lora": True}))
    assert metrics["kl_ref"] == pytest.approx(before, rel=1e-4)


def test_whole_weights_have_no_base_the_default_is_inert_another_value_refused(tiny: Any) -> None:
    model = copy.deepcopy(tiny[1])  # the tiny model trains all its weights
    batch = batch_of(model, answers(tiny[0].eos_token_id))
    metrics = train_step(model, batch, OnlineRL.parse_settings({}))
    assert metrics["kl_coef"] == 0 and "kl_ref" not in metrics
    with pytest.raises(ValueError, match="kl_coef pulls toward the model a LoRA adapter applies to"):
        train_step(model, batch, OnlineRL.parse_settings({"kl_coef": KL_COEF * 3}))
    with pytest.raises(ValueError, match="kl_coef pulls toward the model a LoRA adapter applies to"):
        train_step(model, batch, OnlineRL.parse_settings({"kl_coef": KL_COEF}))  # set to the default's value
    # a trainer's job carries every value and what was set, so the trainer reads defaults as defaults
    from daemon.trainer.step import recipe_of

    assert OnlineRL.parse_settings({"lr": 1e-4}).explicit == {"lr"}
    for raw, refused in (({}, False), ({"kl_coef": KL_COEF}, True)):
        settings = OnlineRL.parse_settings(raw)
        job = TrainJob(id="j", recipe="online-rl", settings=dataclasses.asdict(settings), batch=[], base_key="b",
                       base_path="", head_key="h", head_path="", candidate_key="c",
                       explicit=sorted(settings.explicit))
        again = recipe_of(job).settings
        assert again.explicit == settings.explicit
        if refused:
            with pytest.raises(ValueError, match="kl_coef pulls toward"):
                train_step(model, batch, again)
        else:
            assert train_step(model, batch, again)["kl_coef"] == 0


# --- the pull works ----------------------------------------------------------------------------------------------


def run(model: Any, eos: int, settings: Any, steps: int) -> None:
    optimizer = make_optimizer(model, settings)
    for _ in range(steps):  # on-policy: the behaviour log-probs are the current policy's at each step
        train_step(model, batch_of(model, answers(eos)), settings, optimizer)


def p_empty(model: Any, eos: int) -> float:
    """The policy's probability of answering the end token first (an empty answer)."""
    s = Sample(prompt_token_ids=[5, 6, 7], token_ids=[eos], logprobs=[0.0], reward=0.0, group="g")
    with torch.no_grad():
        return math.exp(float(token_logprobs(model, [s], entropy_grad=False)[0][0, 0]))


def test_the_pull_keeps_a_policy_nearer_its_base_than_the_same_steps_without_it(tiny: Any) -> None:
    """A scorer that an empty answer satisfies, the same steps from the same start: without the term the policy
    runs off toward answering nothing; with it, it stays nearer the base and the empty answer gains less."""
    eos = tiny[0].eos_token_id
    start = lora(tiny, moved=False)
    base_empty = p_empty(start, eos)
    pulled, free = copy.deepcopy(start), copy.deepcopy(start)
    run(pulled, eos, OnlineRL.parse_settings({"lora": True, "lr": 5e-3, "kl_coef": 1.0, "warmup_steps": 0}), steps=8)
    run(free, eos, OnlineRL.parse_settings({"lora": True, "lr": 5e-3, "kl_coef": 0, "warmup_steps": 0}), steps=8)
    probe = batch_of(start, answers(eos))
    assert kl_from_base(pulled, probe) < 0.2 * kl_from_base(free, probe)
    assert p_empty(free, eos) > 0.5  # without the pull: mostly nothing
    assert base_empty < p_empty(pulled, eos) < p_empty(free, eos)  # it still learns, less far


def test_the_pull_brings_a_drifted_policy_back_toward_its_base(tiny: Any) -> None:
    """A policy already far from its base, trained with advantages near 0 (its answers' rewards barely differ): at
    the default coefficient the drift falls to a fraction of what it was; without the term it does not."""
    model = lora(tiny, moved=True, scale=0.1)
    answers2 = [([8, 9, 10, 11], 1.0), ([12, 13, 14], 0.0)]
    probe = batch_of(model, answers2)
    start = kl_from_base(model, probe)
    assert start > 1.0
    free = copy.deepcopy(model)
    for m, coef in ((model, KL_COEF), (free, 0.0)):
        settings = OnlineRL.parse_settings({"lora": True, "lr": 1e-2, "kl_coef": coef})
        optimizer = make_optimizer(m, settings)
        for _ in range(8):
            train_step(m, batch_of(m, answers2), settings, optimizer, adv=([1e-4, -1e-4], 0))
    assert kl_from_base(model, probe) < 0.2 * start
    assert kl_from_base(free, probe) > start


def test_sao_pulls_toward_the_base_by_default_and_not_with_kl_coef_0(tiny: Any) -> None:
    eos = tiny[0].eos_token_id
    start = lora(tiny, moved=True)
    pulled, free = copy.deepcopy(start), copy.deepcopy(start)
    drift = {}
    for m, extra in ((pulled, {}), (free, {"kl_coef": 0})):
        settings = SAO.parse_settings({"lora": True, "lr": 1e-2, **extra})
        learner = make_learner(m, settings)
        for i in range(6):
            sample = batch_of(m, [answers(eos)[i % 4]])
            metrics = sao_step(m, sample, settings, learner)
            if not metrics["skipped"]:
                assert metrics["kl_coef"] == settings.kl_coef
                assert ("kl_ref" in metrics) == (settings.kl_coef > 0)
        drift[settings.kl_coef] = kl_from_base(m, batch_of(start, answers(eos)))
    assert SAOSettings().kl_coef == KL_COEF
    assert drift[KL_COEF] < drift[0.0]


def test_a_fresh_optimizers_rate_rises_over_its_warm_up_steps_and_a_lineage_keeps_its_count() -> None:
    """``warmup_steps`` (4): the rate of a fresh optimizer's k-th step is lr * k / 4 up to lr; the count lives on
    the optimizer, so a lineage that goes on (the same optimizer) is not warmed up again and a new one is; 0: the
    rate as it is. Bugs caught: no warm-up, a count that restarts at every step (each at a quarter), the rate's
    own value lost after the first change (ttt-discover builds its optimizer at its own rate), an off-by-one."""
    from recipes.online_rl import warm_up

    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(params, lr=0.01)
    seen = []
    for _ in range(6):
        warm_up(opt, 4)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])
    fresh = torch.optim.AdamW(params, lr=0.02)
    warm_up(fresh, 4)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.005)  # a new optimizer starts again, at its own rate
    off = torch.optim.AdamW(params, lr=0.01)
    warm_up(off, 0)
    assert off.param_groups[0]["lr"] == 0.01
    assert OnlineRLSettings().warmup_steps == 4


def test_the_first_step_of_a_fresh_optimizer_moves_the_policy_a_quarter_as_far(tiny: tuple[Any, Any]) -> None:
    """Adam's first step moves every trained weight by about lr whatever its gradient's size (measured on SmolLM2:
    0.17 nats per token from the base and 6 of 24 probes lost after one step at 3e-3); at the default warm-up the
    same step moves it a quarter as far, and the steps after it grow back to the full rate. Bug caught: the
    warm-up setting read but not applied in ``train_step``."""
    eos = tiny[0].eos_token_id
    moves = {}
    for warm in (0, 4):
        model = lora(tiny, moved=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        settings = OnlineRLSettings(lora=True, lora_rank=4, kl_coef=0.0, warmup_steps=warm)
        opt = make_optimizer(model, settings)
        train_step(model, batch_of(model, answers(eos)), settings, opt)
        moves[warm] = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters()
                          if p.requires_grad)
    assert moves[4] == pytest.approx(moves[0] / 4, rel=0.05)


def test_a_negative_warm_up_is_refused_naming_it() -> None:
    for recipe in (OnlineRL, OpenClawRL):
        with pytest.raises(BadRequest) as e:
            recipe.check_settings(recipe.parse_settings({"warmup_steps": -1}))
        assert e.value.param == "settings.warmup_steps"
