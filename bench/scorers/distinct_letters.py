"""A user's own ttt-discover scorer, as ``scorer`` runs it: the attempt on stdin, its score on stdout.

The problem: "Say one long word.", scored by how many different letters the first word has, over 10 (capped
at 1): ``experience`` scores 0.6 (e, x, p, r, i, n, c), ``conversation`` 0.8. Nothing in Reef knows this rule.
"""

import sys

words = sys.stdin.read().split()
first = words[0].strip(".,;:!?\"'`").lower() if words else ""
print(min(1.0, len(set(c for c in first if c.isalpha())) / 10))
