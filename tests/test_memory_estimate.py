"""The training step's memory estimate and micro-batches (``recipes/memory.py``) as a unit, without torch: the
estimate number by number against the formula its docstring states, the budget's edges, the packing order and the
checkpointing switch. What a real step's peak does is in tests/test_trainer_memory.py (a trainer process and a
model); these run in milliseconds, so that every mutant of the module meets them (``bench/mutation.py
trainer_memory``)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.errors import BadRequest
from recipes.memory import (
    MB,
    MIN_BUDGET_MB,
    SLACK,
    BudgetTooSmall,
    MicroBatch,
    Shape,
    check_budget,
    checkpointing,
    micro_batches,
    row_bytes,
)

TINY = Shape(layers=2, hidden=8, intermediate=16, heads=2, vocab=100, eager=True)
# one layer's activations cost 16 floats a token (12 hidden, 4 MLP-wide); with 4 layers a plain token costs 64 and a
# checkpointed one 20 (4 layers' inputs and one layer alive): sizes that land exactly on whole MB
SDPA = Shape(layers=4, hidden=8, intermediate=16, heads=2, vocab=100, eager=False)
FLAT = Shape(layers=4, hidden=1, intermediate=1, heads=1, vocab=4, eager=False)


def test_the_documented_constants() -> None:
    assert (MB, SLACK, MIN_BUDGET_MB) == (1 << 20, 1.5, 2)


def test_a_rows_bytes_are_the_documented_count() -> None:
    """Written out from the module docstring: per token and layer 12 hidden-wide and 4 MLP-wide vectors, with eager
    attention heads x width more (times 3: weights, softmax, dropout); per answer position 3 vocabulary-wide
    vectors; float32, times SLACK. Checkpointed: each layer's input, plus one layer alive."""
    layer = 12 * 8 + 4 * 16 + 3 * 2 * 10  # 220 floats a token, one layer, a row 10 wide
    assert row_bytes(TINY, 10, 3) == int(1.5 * 4 * (10 * 2 * layer + 3 * 3 * 100)) == 31_800
    assert row_bytes(TINY, 10, 3, checkpoint=True) == int(1.5 * 4 * (10 * (2 * 8 + layer) + 3 * 3 * 100)) == 19_560
    sdpa = Shape(layers=2, hidden=8, intermediate=16, heads=2, vocab=100, eager=False)
    assert row_bytes(sdpa, 10, 3) == int(1.5 * 4 * (10 * 2 * (12 * 8 + 4 * 16) + 3 * 3 * 100)) == 24_600
    assert row_bytes(TINY, 10, 0) == 26_400 and row_bytes(TINY, 0, 3) == 5_400


def test_a_shape_is_a_value() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.layers = 3  # type: ignore[misc]
    assert {TINY: 1}[Shape(layers=2, hidden=8, intermediate=16, heads=2, vocab=100, eager=True)] == 1


def test_the_shape_is_read_from_the_models_config_with_its_defaults() -> None:
    full = SimpleNamespace(config=SimpleNamespace(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                                                  num_attention_heads=9, vocab_size=49152,
                                                  _attn_implementation="sdpa"))
    assert Shape.of(full) == Shape(layers=30, hidden=576, intermediate=1536, heads=9, vocab=49152, eager=False)
    bare = SimpleNamespace(config=SimpleNamespace(hidden_size=8, num_hidden_layers=2, intermediate_size=None,
                                                  vocab_size=100))
    assert Shape.of(bare) == Shape(layers=2, hidden=8, intermediate=32, heads=1, vocab=100, eager=True)
    eager = SimpleNamespace(config=SimpleNamespace(hidden_size=8, num_hidden_layers=2, vocab_size=100,
                                                   _attn_implementation="eager"))
    assert Shape.of(eager).eager and Shape.of(eager).intermediate == 32


def test_a_budget_below_the_minimum_is_refused_naming_the_setting() -> None:
    check_budget("online-rl", MIN_BUDGET_MB)
    check_budget("online-rl", 1024)
    with pytest.raises(BadRequest) as e:
        check_budget("online-rl", MIN_BUDGET_MB - 1)
    assert e.value.param == "settings.memory_budget_mb"
    assert "recipe online-rl setting memory_budget_mb 1 is too small" in e.value.message
    assert "at least 2 MB" in e.value.message


def fitted(rows: list[tuple[int, int]], shape: Shape, budget_mb: int) -> list[tuple[bool, list[int]]]:
    """``micro_batches`` checked: every row once, each micro-batch's padded cost (its widest row and its longest
    answer, for every row) within the budget, a checkpointed one only for rows too long to run plain."""
    parts = micro_batches(rows, shape, budget_mb)
    assert sorted(i for p in parts for i in p.rows) == list(range(len(rows)))
    for p in parts:
        plain = {row_bytes(shape, rows[i][0] + rows[i][1], rows[i][1]) > budget_mb * MB for i in p.rows}
        assert plain == {p.checkpoint}, (p, [rows[i] for i in p.rows])
        width = max(rows[i][0] + rows[i][1] for i in p.rows)
        answer = max(rows[i][1] for i in p.rows)
        assert len(p.rows) * row_bytes(shape, width, answer, p.checkpoint) <= budget_mb * MB, p
    return [(p.checkpoint, p.rows) for p in parts]


def test_rows_are_packed_longest_first_in_micro_batches_that_fit() -> None:
    """On TINY (eager attention: a row's cost grows with its width squared) rows are taken longest first, equal
    lengths by their index, each into the last micro-batch while the padded cost (the widest row and the longest
    answer, for every row) fits; rows of every mix pack, several to a micro-batch."""
    assert micro_batches([], TINY, 1) == []
    assert micro_batches([(10, 2)], TINY, 1) == [MicroBatch([0], False)]
    # 7.2 MB alone; 1.99 MB; beside the first, the second would cost 2 x 7.3 MB
    assert fitted([(5, 1), (300, 10), (5, 1), (50, 100)], TINY, 8) == [(False, [1]), (False, [3, 0, 2])]
    assert fitted([(50, 0), (10, 100)], TINY, 8) == [(False, [1, 0])]  # longest by prompt and answer together
    rng = random.Random(5)
    for budget in (2, 3, 4):  # on a shape without eager attention (linear in width): rows up to 1,200 tokens fit
        mixed = [(rng.randrange(1, 900), rng.randrange(1, 300)) for _ in range(200)]
        parts = fitted(mixed, SDPA, budget)
        assert max(len(r) for c, r in parts if not c) >= 2 and max(len(r) for c, r in parts if c) >= 2


def test_the_budget_is_reached_exactly_not_passed() -> None:
    """On FLAT a row of 32,768 tokens costs exactly 12 MB plain (6 bytes x 64 floats x 32,768 tokens) and 3.75 MB
    checkpointed. A micro-batch whose cost equals the budget is taken; a row whose plain cost equals it runs
    plain; one whose checkpointed cost equals it runs checkpointed, not refused."""
    row = (32_768, 0)
    assert row_bytes(FLAT, 32_768, 0) == 12 * MB and row_bytes(FLAT, 32_768, 0, checkpoint=True) == 3.75 * MB
    assert fitted([row, row, row], FLAT, 36) == [(False, [0, 1, 2])]
    assert fitted([row, row, row], FLAT, 35) == [(False, [0, 1]), (False, [2])]
    assert fitted([row], FLAT, 12) == [(False, [0])]
    assert fitted([row, row], FLAT, 11) == [(True, [0, 1])]  # 7.5 MB checkpointed together
    assert fitted([row, row], FLAT, 7) == [(True, [0]), (True, [1])]
    half = (16_384, 0)  # 6 MB plain: beside a checkpointed row it is still its own kind
    assert fitted([row, half], FLAT, 7) == [(True, [0]), (False, [1])]
    assert fitted([half, row], FLAT, 7) == [(True, [1]), (False, [0])]
    assert fitted([row, half], FLAT, 8) == [(True, [0]), (False, [1])]  # 7.5 MB together, were it checkpointed


def test_a_row_too_long_even_checkpointed_names_both_numbers() -> None:
    """Checkpointed, the 32,768-token row needs 3.75 MB: a budget of 3 MB is too small, and the message says 4 MB
    (rounded up), the row's prompt and answer tokens and the budget."""
    assert fitted([(32_768, 0)], FLAT, 4) == [(True, [0])]
    with pytest.raises(BudgetTooSmall) as e:
        micro_batches([(100, 1), (32_767, 1)], FLAT, 3)
    assert str(e.value) == ("memory_budget_mb 3 is too small for one sample of this batch: 32767 prompt and 1 answer "
                            "tokens need about 4 MB on this model (raise memory_budget_mb, or shorten the prompts)")
    # 34,950 + 2 tokens checkpointed: 80 bytes over 4 MB (120 a token, 72 more an answer token): refused, rounded up
    assert row_bytes(FLAT, 34_952, 2, checkpoint=True) == 4 * MB + 80
    with pytest.raises(BudgetTooSmall, match="34950 prompt and 2 answer tokens need about 5 MB"):
        micro_batches([(34_950, 2)], FLAT, 4)
    assert fitted([(34_949, 2)], FLAT, 4) == [(True, [0])]  # a token fewer: 40 bytes within it
    # exactly at the budget checkpointed (26,212 tokens, 4 of them answer: 3 MB to the byte): taken
    assert row_bytes(FLAT, 26_212, 4, checkpoint=True) == 3 * MB and fitted([(26_208, 4)], FLAT, 3) == [(True, [0])]
    # exactly 6 MB checkpointed on a budget of 5: "about 6 MB", not 7 (rounded up, from the exact bytes)
    assert row_bytes(FLAT, 52_427, 3, checkpoint=True) == 6 * MB
    with pytest.raises(BudgetTooSmall, match="need about 6 MB"):
        micro_batches([(52_424, 3)], FLAT, 5)


class Model:
    """A stand-in for a transformers model: which checkpointing calls it got."""

    def __init__(self, new_names: bool) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        if new_names:
            self.activation_checkpointing_enable = self._call("enable")
            self.activation_checkpointing_disable = self._call("disable")
        else:
            self.gradient_checkpointing_enable = self._call("enable")
            self.gradient_checkpointing_disable = self._call("disable")

    def _call(self, name: str) -> Any:
        return lambda **kw: self.calls.append((name, kw))


class Peft:
    peft_config: dict[str, Any] = {}

    def __init__(self, base: Model) -> None:
        self.base = base

    def get_base_model(self) -> Model:
        return self.base


@pytest.mark.parametrize("new_names", [True, False])
def test_checkpointing_is_on_inside_and_off_after_even_on_an_error(new_names: bool) -> None:
    kw = "activation_checkpointing_kwargs" if new_names else "gradient_checkpointing_kwargs"
    for wrap in (lambda m: m, Peft):
        base = Model(new_names)
        with checkpointing(wrap(base), True):
            assert base.calls == [("enable", {kw: {"use_reentrant": False}})]
        assert [c for c, _ in base.calls] == ["enable", "disable"]
        with pytest.raises(KeyError), checkpointing(wrap(base), True):
            raise KeyError("the step failed")
        assert [c for c, _ in base.calls] == ["enable", "disable"] * 2
    off = Model(new_names)
    with checkpointing(off, False):
        pass
    assert off.calls == []
