"""Whether an answer loops (``daemon/loops.py``), the rule the held-out check and the canary's guard share, by its
own: the two rules at their bounds, only the tail read, and both rules against their definitions written out plainly
on many random answers. (The held-out check's use of it is in ``tests/test_heldout.py``.)"""

from __future__ import annotations

import random

from daemon.loops import LOOP, REPEAT, TAIL, loops, said_twice


def _said_twice_by_definition(units: list[int], least: int) -> bool:
    """Some run of at least ``least`` units followed at once by the same run."""
    n = len(units)
    return any(units[i:i + p] == units[i + p:i + 2 * p] for p in range(least, n // 2 + 1) for i in range(n - 2 * p + 1))


def _loops_by_definition(units: list[int]) -> bool:
    """The module's doc: over the last 160 units, 8 units or more with at most half of the unit pairs distinct, or a
    run of 6 or more said twice in a row."""
    tail = units[-160:]
    pairs = [(tail[i], tail[i + 1]) for i in range(len(tail) - 1)]
    return (len(tail) >= 8 and 2 * len(set(pairs)) <= len(pairs)) or _said_twice_by_definition(tail, 6)


def test_the_bounds_are_the_documented_ones() -> None:
    assert (LOOP, REPEAT, TAIL) == (8, 6, 160)


def test_said_twice_agrees_with_its_definition_on_random_answers() -> None:
    """Bugs caught: a run counted from one unit too many or too few, a match counted twice, the count not reset
    by a unit that differs, periods cut short or begun late, the last position of the second saying not read."""
    rng = random.Random(42)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        n = rng.randrange(0, 40)
        alphabet = rng.choice((2, 3, 5, 12))
        units = [rng.randrange(alphabet) for _ in range(n)]
        if rng.random() < 0.4 and n > 4:  # plant a run said twice, maybe cut short by one, somewhere
            p = rng.randrange(1, n // 2 + 1)
            at = rng.randrange(0, n - 2 * p + 1)
            run = [rng.randrange(100, 200) for _ in range(p)]
            units[at:at + 2 * p] = run + run[:p - rng.choice((0, 0, 1))]
        least = rng.randrange(1, 9)
        want = _said_twice_by_definition(units, least)
        seen[want] += 1
        assert said_twice(units, least) is want, (units, least)
    assert min(seen.values()) > 500, seen  # both answers were asked about often


def test_loops_agrees_with_its_definition_on_random_answers() -> None:
    """Bugs caught: the pairs rule's bound on length or on the share of distinct pairs moved (``<`` for ``<=``, a
    third for a half, ``or`` for ``and``), pairs made of a unit and itself or of units two apart, the
    said-twice rule's least run changed, the tail read from the wrong end."""
    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        n = rng.choice((rng.randrange(0, 20), rng.randrange(150, 175)))
        alphabet = rng.choice((2, 3, 4, 6, 9, 1000))
        units = [rng.randrange(alphabet) for _ in range(n)]
        want = _loops_by_definition(units)
        seen[want] += 1
        assert loops(units) is want, units
    assert min(seen.values()) > 500, seen


def test_eight_units_whose_pairs_repeat_are_a_loop_and_seven_are_not() -> None:
    """Bugs caught: ``LOOP`` 7 or 9, ``>`` for ``>=`` on the number of pairs."""
    assert loops([1, 2] * 4) and not loops([1, 2, 1, 2, 1, 2, 1])


def test_exactly_half_the_pairs_distinct_is_a_loop_and_one_more_is_not() -> None:
    """Nine units, eight pairs: four distinct loop, five do not. Bugs caught: ``<`` for ``<=``, a third for a
    half, pairs of a unit with itself (``1 2 3 4 1 2 3 4`` would loop)."""
    assert loops([1, 2, 3, 4, 1, 2, 3, 4, 1])
    assert not loops([1, 2, 3, 4, 5, 1, 2, 3, 4]) and not loops([1, 2, 3, 4, 1, 2, 3, 4])


def test_a_run_said_again_after_a_gap_from_the_first_unit_is_no_loop() -> None:
    """Six units, one other, the six again: the run is said twice but not in a row. Bug caught: the run's count
    started at one (the match at the first position counted twice)."""
    six = [1, 2, 3, 4, 5, 6]
    assert not said_twice([*six, 9, *six, 8], REPEAT) and not loops([*six, 9, *six, 8])
    assert said_twice([*six, *six, 8], REPEAT)


def test_half_a_run_said_again_at_the_runs_length_is_no_loop() -> None:
    """Three of six units said again six units on: three matches at period six. Bug caught: a match counted as
    two."""
    assert not said_twice([1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9], REPEAT)


def test_only_the_last_tail_units_are_read() -> None:
    """A run of 80 said twice that fills the last 160 units exactly is a loop; the same with one unit after it (its
    first unit then falls outside the tail) is not, and neither is the tail's own count plus one. Bugs caught:
    ``TAIL`` 159 or 161, the tail's slice from the start."""
    opener = list(range(1000, 1100))
    run = list(range(80))
    assert loops(opener + run + run)
    assert not loops(opener + run + run + [5000])
    assert not loops(run + run + list(range(2000, 2000 + TAIL)))  # said twice long before the tail


def test_a_run_of_six_said_twice_after_an_opener_is_a_loop_and_of_five_is_not() -> None:
    """Few pairs repeat here, so only the said-twice rule decides. Bugs caught: ``REPEAT`` 5 or 7."""
    opener = list(range(100, 120))
    six, five = list(range(6)), list(range(5))
    assert loops(opener + six + six) and not loops(opener + five + five)
