"""``record``: keep every exchange and report, never train. The default recipe."""

from __future__ import annotations


class RecordOnly:
    name = "record"
    trains = False
