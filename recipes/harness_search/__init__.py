"""``harness-search``: harness evolution that searches (a proposer mutates the tree from failing runs; paired
episodes of the real agent in a sandbox decide; a GEPA-style Pareto pool keeps the candidates).

Modules: ``mutations`` (the JSON form, parser, screens, applying), ``proposer`` (the prompt), ``episodes`` (tasks,
one episode), ``sandbox`` (bubblewrap), ``inside`` (what runs in the sandbox), ``pool`` (Pareto front),
``recipe`` (the recipe class).
"""

from recipes.harness_search.recipe import HarnessSearch, HarnessSearchSettings

__all__ = ["HarnessSearch", "HarnessSearchSettings"]
