"""The one check of scenario and run names and of receipts brought in from outside, used by every way one comes in.

A scenario name becomes a git ref (``refs/reef/scenarios/<name>``), a path segment, a row in the record store and
a word in a shell script (the harness installer), so it is checked once, here, in full, before anything is
stored: the whole string must match (``re.fullmatch``: ``$`` in ``re.match`` also matches before a trailing
newline, which let ``"name\\n"`` through), and what git refuses in a ref (``..``, a trailing ``.`` or ``.lock``)
is refused too, so a name the release chain would refuse never leaves a scenario row behind. Run names go into
records and path segments (``/s/<scenario>/r/<run>/v1/...``) and may also hold ``:``. A receipt the daemon makes
is ``rec_`` and 26 base32 characters; one brought in by an import (``daemon/export.py``) is a path segment too
(``/reef/records/<receipt>``), so it is ``rec_`` and letters, digits, ``_`` and ``-``, nothing that reads as a path.
"""

from __future__ import annotations

import re

from daemon.errors import InvalidName

SCENARIO_MAX = 64
RUN_MAX = 128
_SCENARIO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # SCENARIO_MAX characters at most
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # RUN_MAX characters at most
RECEIPT_MAX = 100
_RECEIPT = re.compile(r"rec_[A-Za-z0-9_-]{1,96}")  # RECEIPT_MAX characters at most


def _shown(value: object) -> str:
    """``value`` as an error message quotes it: at most 120 characters of its repr (a 100,000-character name is
    not sent back whole)."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def check_scenario(name: object) -> str:
    """``name`` if it is a valid scenario name, else ``InvalidName`` (400) saying what is allowed."""
    if (
        not isinstance(name, str)
        or _SCENARIO.fullmatch(name) is None
        or ".." in name
        or name.endswith((".", ".lock"))
    ):
        raise InvalidName(
            f"invalid scenario name {_shown(name)}: use 1-{SCENARIO_MAX} of A-Z a-z 0-9 . _ - (starting with a letter or"
            " digit, no '..', not ending in '.' or '.lock')",
            param="scenario",
        )
    return name


def check_run(name: object) -> str:
    """``name`` if it is a valid run name, else ``InvalidName`` (400) saying what is allowed."""
    if not isinstance(name, str) or _RUN.fullmatch(name) is None:
        raise InvalidName(
            f"invalid run name {_shown(name)}: use 1-{RUN_MAX} of A-Z a-z 0-9 . _ : - (starting with a letter or digit)",
            param="run",
        )
    return name


def check_receipt(value: object) -> str:
    """``value`` if it is a receipt Reef can store and name again (``rec_`` and 1-96 of A-Z a-z 0-9 _ -), else
    ``InvalidName`` (400, ``param="id"``)."""
    if not isinstance(value, str) or _RECEIPT.fullmatch(value) is None:
        raise InvalidName(
            f"invalid receipt {_shown(value)}: use rec_ and 1-{RECEIPT_MAX - 4} of A-Z a-z 0-9 _ -", param="id",
        )
    return value
