"""The learning core on its own: the demo task family's verifier and splits, the online-RL training step
(importance ratio, advantages, that it moves the policy towards reward), evaluation, and the warm-up."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

from daemon.models import build_tiny, save_model
from recipes.base import FeedbackReport, ScoredExchange
from recipes.online_rl import (
    OnlineRLSettings,
    Sample,
    advantages,
    eos_ids,
    evaluate,
    generate,
    make_optimizer,
    render_prompt,
    token_logprobs,
    train_step,
)
from recipes.tasks import FAMILIES, SayWord, Task, get_family
from recipes.warmup import warm_up


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return build_tiny(seed=0)


def fresh(tiny):
    tokenizer, model = tiny
    return tokenizer, copy.deepcopy(model)


# --- the task family ---------------------------------------------------------------------------------------------


def test_say_verifier_scores():
    fam = get_family("say")
    task = Task(prompt="Say file.", answer="file")
    assert fam.score(task, "file") == 1.0
    assert fam.score(task, " file\n") == 1.0  # surrounding whitespace is not judged
    assert fam.score(task, "file.") == 0.4  # right word, did not stop
    assert fam.score(task, "file file") == 0.4
    assert fam.score(task, "the file") == 0.2  # the word, elsewhere
    assert fam.score(task, "files") == 0.0
    assert fam.score(task, "") == 0.0
    assert fam.score(task, "profile") == 0.0
    assert [fam.exact(task, t) for t in ("file", "file.", "x")] == [1.0, 0.0, 0.0]
    assert fam.target(task) == " file"  # supervised target: the word's own (space-prefixed) token
    assert FAMILIES["say"] is SayWord


def test_held_out_and_validation_are_disjoint_from_training():
    fam = get_family("say")
    train = fam.train_tasks(seed=3)
    held, val = fam.held_out(300, seed=3), fam.validation(300, seed=3)
    train_words = {t.answer for t in train}
    assert train_words.isdisjoint({t.answer for t in held})
    assert train_words.isdisjoint({t.answer for t in val})
    assert {t.answer for t in held}.isdisjoint({t.answer for t in val})
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in held} | {t.prompt for t in val})
    assert len({t.answer for t in fam.held_out(200, seed=0)}) == 200  # distinct words while they last
    assert fam.held_out(50, seed=1) == fam.held_out(50, seed=1)  # deterministic
    rng = random.Random(0)
    assert all(fam.sample(rng).answer in train_words for _ in range(200))
    with pytest.raises(ValueError, match="unknown task family"):
        get_family("nope")


def test_a_weights_recipe_refuses_an_unknown_eval_family_as_a_bad_request_naming_it():
    from daemon.errors import BadRequest
    from recipes.online_rl import OnlineRL
    from recipes.openclaw_rl import OpenClawRL
    from recipes.sao import SAO

    for recipe in (OnlineRL, OpenClawRL, SAO):  # online-rl's was a bare ValueError: not a 400
        with pytest.raises(BadRequest, match="unknown task family 'nope'") as e:
            recipe.parse_settings({"eval_family": "nope"})
        assert e.value.param == "settings.eval_family"
        assert recipe.parse_settings({"eval_family": "say"}).eval_family == "say"


# --- the training step -------------------------------------------------------------------------------------------


def sample_batch(tokenizer, model, prompts: list[str], group_size: int, seed: int = 0) -> list[Sample]:
    fam = get_family("say")
    ids = [render_prompt(tokenizer, p) for p in prompts]
    rows = [i for i in range(len(prompts)) for _ in range(group_size)]
    outs = generate(
        model,
        [ids[i] for i in rows],
        eos=eos_ids(model, tokenizer),
        max_new_tokens=6,
        generator=torch.Generator().manual_seed(seed),
    )
    batch = []
    for i, (tokens, logprobs) in zip(rows, outs, strict=True):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        task = Task(prompt=prompts[i], answer=prompts[i].split()[1].rstrip("."))
        batch.append(Sample(ids[i], tokens, logprobs, fam.score(task, text), group=str(i)))
    return batch


def test_recorded_logprobs_match_the_model_so_the_ratio_starts_at_one(tiny):
    tokenizer, model = fresh(tiny)
    batch = sample_batch(tokenizer, model, ["Say file.", "Echo window back.", "Repeat a."], group_size=3)
    with torch.no_grad():
        logp, _, mask = token_logprobs(model, batch)
    for row, s in enumerate(batch):
        assert mask[row].sum() == len(s.token_ids)
        assert torch.allclose(logp[row, : len(s.token_ids)], torch.tensor(s.logprobs), atol=1e-4)
    for s in batch:  # make every group carry signal, so the step uses every sample
        s.reward = float(hash(tuple(s.token_ids)) % 2)
    batch[0].reward, batch[1].reward = 1.0, 0.0
    metrics = train_step(model, batch, OnlineRLSettings())
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["clip_frac"] == 0.0


def test_advantages_are_group_normalised_and_degenerate_groups_carry_none():
    settings = OnlineRLSettings(min_std=0.1)

    def s(reward: float, group: str) -> Sample:
        return Sample([1], [2], [-1.0], reward, group)

    adv, degenerate = advantages([s(1, "a"), s(0, "a"), s(0, "b"), s(0, "b"), s(1, "c"), s(1, "c")], settings)
    assert adv[:2] == [1.0, -1.0]  # (r - mean) / std, std 0.5
    assert adv[2:] == [0.0] * 4 and degenerate == 2
    adv, _ = advantages([s(0.2, "a"), s(0.0, "a")], settings)  # a crumb of difference is not blown up
    assert adv == pytest.approx([1.0, -1.0])  # std 0.1 meets the floor
    adv, _ = advantages([s(0.25, "a"), s(0.2, "a")], settings)
    assert adv == pytest.approx([0.25, -0.25])
    adv, _ = advantages([s(1, "a"), s(0, "b"), s(0, "c"), s(1, "d")], settings)  # singletons: batch baseline
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])


def test_train_step_moves_the_policy_towards_reward(tiny):
    tokenizer, model = fresh(tiny)
    prompt = render_prompt(tokenizer, "Say file.")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    good = tokenizer.backend_tokenizer.encode(" file", add_special_tokens=False).ids + [eos]
    bad = tokenizer.backend_tokenizer.encode(" window", add_special_tokens=False).ids + [eos]

    def batch_now() -> list[Sample]:
        with torch.no_grad():
            probe = [Sample(prompt, ids, [0.0] * len(ids), 0.0, "g") for ids in (good, bad)]
            logp, _, mask = token_logprobs(model, probe)
        lp = [logp[i, : int(mask[i].sum())].tolist() for i in range(2)]
        return [Sample(prompt, good, lp[0], 1.0, "g"), Sample(prompt, bad, lp[1], 0.0, "g")] * 4

    def margin() -> float:
        b = batch_now()
        return sum(b[0].logprobs) - sum(b[1].logprobs)

    settings = OnlineRLSettings(lr=3e-3)
    optimizer = make_optimizer(model, settings)
    before = margin()
    losses = [train_step(model, batch_now(), settings, optimizer)["pg_loss"] for _ in range(5)]
    assert margin() > before + 1.0
    # on-policy start (ratio 1): the loss is -mean(A) over tokens, 0 here (A = +-1 on equally long answers)
    assert losses[0] == pytest.approx(0.0, abs=1e-6)
    assert not model.get_input_embeddings().weight.requires_grad  # embeddings stay frozen by default


def test_an_off_policy_sample_beyond_the_clip_carries_no_gradient(tiny):
    """PPO's clip: a token whose ratio is already past 1 + clip_high with a positive advantage is clipped (the
    surrogate is the constant clipped ratio times A) and moves nothing; with a negative advantage the same ratio
    is not clipped (the pessimistic minimum keeps ratio * A) and trains. Every other test trains on-policy
    (ratio 1), where the minimum and a maximum agree."""
    tokenizer, model = fresh(tiny)
    prompt = render_prompt(tokenizer, "Say file.")
    tokens = tokenizer.backend_tokenizer.encode(" window", add_special_tokens=False).ids
    with torch.no_grad():
        logp, _, mask = token_logprobs(model, [Sample(prompt, tokens, [0.0] * len(tokens), 0.0, "g")])
    now = logp[0, : int(mask[0].sum())].tolist()
    behaviour = [lp - 2.0 for lp in now]  # the sample was far less likely when drawn: ratio e^2 ~ 7.4 per token
    settings = OnlineRLSettings(steps_per_batch=1)
    sample = Sample(prompt, tokens, behaviour, 1.0, "g")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = train_step(model, [sample], settings, adv=([1.0], 0))
    assert metrics["ratio_mean"] == pytest.approx(torch.e ** 2, rel=1e-3)
    assert metrics["clip_frac"] == 1.0
    assert metrics["pg_loss"] == pytest.approx(-(1 + settings.clip_high), rel=1e-5)  # the clipped value
    assert metrics["grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    metrics = train_step(model, [sample], settings, adv=([-1.0], 0))  # past the clip the other way: trains
    assert metrics["clip_frac"] == 0.0 and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_train_step_skips_batches_without_signal_and_rejects_bad_samples(tiny):
    tokenizer, model = fresh(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flat = [Sample([1, 2], [3, 4], [-1.0, -1.0], 1.0, "g")] * 4
    metrics = train_step(model, flat, OnlineRLSettings())
    assert metrics["skipped"] == 1.0 and metrics["degenerate_groups"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="one logprob per sampled token"):
        train_step(model, [Sample([1], [3, 4], [-1.0], 1.0, "g")], OnlineRLSettings())
    with pytest.raises(ValueError, match="at least one sample"):
        train_step(model, [], OnlineRLSettings())


# --- prompts, evaluation, warm-up --------------------------------------------------------------------------------


def test_render_prompt_matches_the_engine(tiny, tmp_path):
    from daemon.engines.rows import Load
    from daemon.exchange import Exchange, Message, Part

    tokenizer, model = tiny
    save_model(tokenizer, model, tmp_path / "m")
    load = Load.open(tmp_path / "m", "t:1", torch.device("cpu"))
    exchange = Exchange(format="openai-chat", model="tiny", messages=[Message("user", [Part("text", text="Say file.")])])
    assert load.encode(exchange) == render_prompt(tokenizer, "Say file.")
    assert eos_ids(model, tokenizer) == set(load.eos_ids)


def test_warm_up_is_deterministic_and_teaches_something(tiny):
    tokenizer, model = tiny
    fam = get_family("say")
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    info_a = warm_up(tokenizer, a, fam, steps=12, seed=1, target=None)
    info_b = warm_up(tokenizer, b, "say", steps=12, seed=1, target=None)
    assert info_a["steps"] == info_b["steps"] == 12 and info_a["loss"] == info_b["loss"]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(a.state_dict().values(), model.state_dict().values(), strict=True))
    assert float(a.get_input_embeddings().weight.detach().std()) == pytest.approx(0.5, rel=1e-3)
    score = evaluate(a, tokenizer, fam.held_out(16), fam, max_new_tokens=4)
    assert 0.0 <= score <= 1.0


def lora_job(tmp_path, records, base_path, *, key: str, candidate: str, settings=None):
    from recipes.base import TrainJob

    settings = settings or OnlineRLSettings(lora=True, lr=1e-2)
    return TrainJob(id=candidate, recipe="online-rl", settings=settings.to_dict(), batch=records, base_key=key,
                    base_path=str(base_path), head_key="base", head_path=str(tmp_path / "base"),
                    candidate_key=candidate, model_key="c" * 40, model_release="d" * 40,
                    model_path=str(tmp_path / "base"))


def test_lora_candidates_hold_only_the_adapter_and_a_lineage_goes_on_training_it(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from daemon import lora
    from daemon.trainer.step import run_job

    tokenizer, model = fresh(tiny)
    save_model(tokenizer, model, tmp_path / "base")
    batch = sample_batch(tokenizer, model, ["Say file.", "Echo window back."], group_size=4)
    for i, s in enumerate(batch):  # every group carries signal
        s.reward = float(i % 2)
    records = [ScoredExchange(id=f"rec_{i}", release_id=None, prompt_token_ids=s.prompt_token_ids,
                              token_ids=s.token_ids, logprobs=s.logprobs,
                              report=FeedbackReport(id=f"rep_{i}", seq=i + 1, score=s.reward))
               for i, s in enumerate(batch)]
    states: dict = {}
    result = run_job(states, lora_job(tmp_path, records, tmp_path / "base", key="base", candidate="c1"),
                     tmp_path / "c1")
    assert result.path == str(tmp_path / "c1") and result.metrics["skipped"] == 0.0
    trained = [n for n, p in states["online-rl"]["model"].named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)  # the base weights stay frozen
    # the candidate is the adapter alone, naming the whole model it applies to: no copy of any base file
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == sorted(lora.FILES)
    assert lora.read_dir(tmp_path / "c1") == lora.AdapterManifest("c" * 40, "d" * 40)
    ids = torch.tensor([batch[0].prompt_token_ids])

    def served(adapter_dir):  # the base with the adapter, as any peft user would load it
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return PeftModel.from_pretrained(base, str(adapter_dir)).eval()(ids).logits

    with torch.no_grad():
        c1 = served(tmp_path / "c1")
        assert torch.allclose(c1, states["online-rl"]["model"](ids).logits, atol=1e-5)
        assert not torch.allclose(c1, model(ids).logits, atol=1e-4)
    # the lineage goes on from the adapter: in memory, and in a worker that starts afresh (read from c1)
    for label, st in (("kept", states), ("restarted", {})):
        job = lora_job(tmp_path, records, tmp_path / "c1", key="c1", candidate=f"c2-{label}")
        if label == "restarted":
            from recipes.online_rl import load_policy

            continued = load_policy(tmp_path / "c1", tmp_path / "base", OnlineRLSettings(lora=True), trainable=True)
            with torch.no_grad():
                assert torch.allclose(continued(ids).logits, c1, atol=1e-5)  # starts where c1 ended, not fresh
            assert all("lora_" in n for n, p in continued.named_parameters() if p.requires_grad)
        run_job(st, job, tmp_path / f"c2-{label}")
        c2 = served(tmp_path / f"c2-{label}")
        assert not torch.allclose(c2, c1, atol=1e-4)


def test_lora_unset_trains_adapters_on_real_sized_models_only(tiny, tmp_path):
    from recipes import online_rl

    tokenizer, model = fresh(tiny)
    save_model(tokenizer, model, tmp_path / "base")
    unset = OnlineRLSettings()
    assert unset.lora is None
    small = online_rl.load_policy(tmp_path / "base", None, unset, trainable=True)
    assert not online_rl.is_adapter(small)  # the tiny model (0.4M parameters) trains all its weights
    old = online_rl.LORA_AUTO_PARAMS
    online_rl.LORA_AUTO_PARAMS = sum(p.numel() for p in model.parameters())  # as big as a real model
    try:
        assert online_rl.is_adapter(online_rl.load_policy(tmp_path / "base", None, unset, trainable=True))
        assert not online_rl.is_adapter(online_rl.load_policy(tmp_path / "base", None,
                                                              OnlineRLSettings(lora=False), trainable=True))
    finally:
        online_rl.LORA_AUTO_PARAMS = old


# --- gates -------------------------------------------------------------------------------------------------------


def test_gates_decide_as_documented():
    from daemon.errors import BadRequest
    from daemon.gate import judge

    cand, base = [1, 1, 0, 1], [0, 1, 1, 0]  # wins 2, losses 1
    assert judge("always", candidate=None, base=None, best=None).publish
    assert judge("floor", candidate=cand, base=base, best=None, floor=0.75).publish
    assert not judge("floor", candidate=cand, base=base, best=None, floor=0.8).publish
    v = judge("compare", candidate=cand, base=base, best=None)  # 3 untied pairs: a sweep needs 5 at 0.05
    assert v.verdict == "pending" and (v.metrics["wins"], v.metrics["losses"]) == (2, 1)
    better, worse = [1.0] * 6 + [0.0] * 10, [0.0] * 16  # the error-rate forms: tests/test_gate_noise.py
    assert judge("compare", candidate=better, base=worse, best=None).publish
    v = judge("compare", candidate=worse, base=better, best=None)
    assert not v.publish and v.verdict == "rejected" and "wins 0 - losses 6: p = 1 > alpha 0.05" in v.reason
    same = [1.0, 0.0] * 20  # regression: against the serving head (paired), not the best so far
    v = judge("regression", candidate=same, base=same, best=0.9)
    assert v.publish and v.metrics["best"] == 0.9 and v.metrics["margin"] == 0.1
    assert not judge("regression", candidate=worse + [0.0] * 24, base=better + [0.0] * 24, best=None).publish
    pending = judge("review", candidate=None, base=None, best=None)
    assert not pending.publish and pending.verdict == "pending"
    with pytest.raises(BadRequest, match="eval_family"):
        judge("compare", candidate=None, base=None, best=None)
    with pytest.raises(BadRequest, match="unknown gate"):
        judge("nope", candidate=cand, base=base, best=None)


SEED = 0


def test_the_drift_from_the_base_is_zero_at_first_and_grows_with_training(tiny):
    """kl_from_base (the watchdog's drift measure): a fresh adapter (B = 0) is the base exactly; training moves
    the policy away (three steps further than one: Adam at this rate was seen stepping back once on other seeds),
    and the measure sees it (computing both sides with the adapter on, or off, reads 0)."""
    from recipes.online_rl import kl_from_base, wrap_lora

    tokenizer, model = fresh(tiny)
    settings = OnlineRLSettings(lora=True, lr=3e-2, steps_per_batch=1)
    torch.manual_seed(SEED)  # the adapter's initial A (else drawn from whatever state the earlier tests left)
    model = wrap_lora(model, settings)
    batch = sample_batch(tokenizer, model, ["Say file.", "Say door."], group_size=4)
    for i, s in enumerate(batch):  # a signal in every group
        s.reward = float(i % 2)
    assert kl_from_base(model, batch) == pytest.approx(0.0, abs=1e-9)
    optimizer = make_optimizer(model, settings)
    drift = []
    for _ in range(3):
        train_step(model, batch, settings, optimizer)
        drift.append(kl_from_base(model, batch))
    assert 0 < drift[0] < drift[2], drift
    with torch.no_grad():  # what it measures: the policy against the same weights with the adapter off
        lp, _, mask = token_logprobs(model, batch[:1], entropy_grad=False)
        with model.disable_adapter():
            base, _, _ = token_logprobs(model, batch[:1], entropy_grad=False)
    assert not torch.allclose(lp[mask], base[mask])
