"""Sampling edge cases of the embedded engine: tiny temperatures are greedy, non-finite logits never reach the draw.

The HTTP tests go through a real daemon on the tiny model; the unit tests call the sampler on hand-made rows.
"""

from __future__ import annotations

import pytest
import torch

from daemon.engines.prompts import SamplingParams
from daemon.engines.rows import GREEDY_BELOW, _sample
from daemon.errors import EngineError
from tests.conftest import Daemon

PROMPT = [{"role": "user", "content": "Write a haiku about caches."}]


def answer(daemon: Daemon, **sampling: float) -> str:
    with daemon.http() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 12, "messages": PROMPT, **sampling})
    assert r.status_code == 200, r.text[:500]
    return str(r.json()["choices"][0]["message"]["content"])


def test_tiny_temperatures_answer_greedily_over_http(daemon: Daemon) -> None:
    greedy = answer(daemon, temperature=0)
    assert greedy, "the tiny model answers something at temperature 0"
    # 1e-300 overflowed every logit to +-inf/NaN and answered 500 before; 1e-6 is below the greedy threshold
    assert answer(daemon, temperature=1e-300) == greedy
    assert answer(daemon, temperature=1e-6) == greedy
    assert 1e-6 < GREEDY_BELOW


def test_a_normal_temperature_still_samples_over_http(daemon: Daemon) -> None:
    greedy = answer(daemon, temperature=0)
    # seeded draws at temperature 1.5 on random tiny weights: some of them differ from the greedy answer
    sampled = {answer(daemon, temperature=1.5, seed=seed) for seed in range(6)}
    assert sampled - {greedy}, "a normal temperature must sample, not collapse to greedy"
    assert answer(daemon, temperature=1.5, seed=3) == answer(daemon, temperature=1.5, seed=3)


def draw(logits: list[float], temperature: float = 1.0, **kw: float) -> int:
    g = torch.Generator()
    g.manual_seed(0)
    return _sample(torch.tensor(logits), SamplingParams(max_tokens=1, temperature=temperature, **kw), g)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-6])
def test_sampler_tiny_temperature_is_the_argmax(temperature: float) -> None:
    row = torch.randn(100, generator=torch.Generator().manual_seed(1)).tolist()
    assert draw(row, temperature) == max(range(100), key=row.__getitem__)


def test_sampler_never_draws_from_non_finite_logits() -> None:
    nan = float("nan")
    inf = float("inf")
    # a NaN from the model: greedy on the rest of the row (argmax alone would pick the NaN's index)
    assert draw([0.5, nan, 2.0, 1.0]) == 2
    assert draw([0.5, nan, 2.0, 1.0], top_k=2, top_p=0.5) == 2
    # +inf in the row: that token, without a NaN distribution reaching the draw
    assert draw([0.5, 1.0, inf, 2.0]) == 2
    # logits too large for the temperature overflow when scaled: greedy on the raw logits
    assert draw([3e38, 1e38, 2e38], temperature=0.5) == 0
    # -inf entries are masked tokens, not an error: the draw only ever picks a finite one
    assert draw([-inf, 0.0, -inf], temperature=1.0) == 1
    with pytest.raises(EngineError, match="no finite logits"):
        draw([-inf, nan, -inf])
    with pytest.raises(EngineError, match="no finite logits"):
        draw([nan, nan], temperature=0)
