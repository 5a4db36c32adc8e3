"""Whether an answer loops: the rule the held-out check (``daemon/gating/heldout.py``, on greedy answers) and the
canary's guard (``daemon/canary.py``, on the answers its arm served) share.

An answer loops when, over its last ``TAIL`` units (tokens, or words where there are none):
- it has ``LOOP`` units or more and half of its unit pairs repeat ("large large large", or "orersorersorers" in
  tokens: one word and the same loop); or
- a run of ``REPEAT`` units or more is said twice in a row: "The most beautiful thing in the world is a volcano. The
  most beautiful thing in the world is a volcano." after an opener, which the pairs rule misses when the opener and
  the sentence are long. A greedy model that said a sentence twice goes on saying it; an honest answer says a
  phrase again apart, not back to back (SmolLM2's own greedy answers to 108 everyday questions and probes: 0, 1, 2
  and 4 trip it at 16, 32, 48 and 64 tokens, each a real loop).
Only the tail is read, so a long answer costs what ``TAIL`` units cost: a loop runs to the answer's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LOOP = 8  # an answer of this many units or more, half of whose unit pairs repeat, is a loop
REPEAT = 6  # ...and so is one that says a run of this many units or more twice in a row
TAIL = 160  # the units read, from the end


def loops(units: Sequence[Any]) -> bool:
    """Whether an answer's units (token ids, or words) loop, by either rule, over its last ``TAIL``."""
    tail = list(units[-TAIL:])
    pairs = list(zip(tail, tail[1:], strict=False))
    if len(pairs) >= LOOP - 1 and len(set(pairs)) <= len(pairs) / 2:
        return True
    return said_twice(tail, REPEAT)


def said_twice(units: Sequence[Any], least: int) -> bool:
    """Whether a run of at least ``least`` units is followed at once by the same run. For each period p, the
    positions whose unit equals the one p further on: p of them in a row are a run said twice."""
    n = len(units)
    for p in range(least, n // 2 + 1):
        same = 0
        for i in range(n - p):
            same = same + 1 if units[i] == units[i + p] else 0
            if same >= p:
                return True
    return False
