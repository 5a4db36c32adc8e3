"""``record``: keep every exchange and report, never train. The default recipe."""

from __future__ import annotations

from recipes.base import Recipe


class RecordOnly(Recipe):
    name = "record"
    kind = "none"  # its releases follow its model: weights for a local model, a harness for an upstream
