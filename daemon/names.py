"""The one check of scenario and run names, used by every way a name comes in.

A scenario name becomes a git ref (``refs/reef/scenarios/<name>``), a path segment, a row in the record store and
a word in a shell script (the harness installer), so it is checked once, here, in full, before anything is
stored: the whole string must match (``re.fullmatch``: ``$`` in ``re.match`` also matches before a trailing
newline, which let ``"name\\n"`` through), and what git refuses in a ref (``..``, a trailing ``.`` or ``.lock``)
is refused too, so a name the release chain would refuse never leaves a scenario row behind. Run names go into
records and path segments (``/s/<scenario>/r/<run>/v1/...``) and may also hold ``:``.
"""

from __future__ import annotations

import re

from daemon.errors import InvalidName

SCENARIO_MAX = 64
RUN_MAX = 128
_SCENARIO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # SCENARIO_MAX characters at most
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # RUN_MAX characters at most


def check_scenario(name: object) -> str:
    """``name`` if it is a valid scenario name, else ``InvalidName`` (400) saying what is allowed."""
    if (
        not isinstance(name, str)
        or _SCENARIO.fullmatch(name) is None
        or ".." in name
        or name.endswith((".", ".lock"))
    ):
        raise InvalidName(
            f"invalid scenario name {name!r}: use 1-{SCENARIO_MAX} of A-Z a-z 0-9 . _ - (starting with a letter or"
            " digit, no '..', not ending in '.' or '.lock')",
            param="scenario",
        )
    return name


def check_run(name: object) -> str:
    """``name`` if it is a valid run name, else ``InvalidName`` (400) saying what is allowed."""
    if not isinstance(name, str) or _RUN.fullmatch(name) is None:
        raise InvalidName(
            f"invalid run name {name!r}: use 1-{RUN_MAX} of A-Z a-z 0-9 . _ : - (starting with a letter or digit)",
            param="run",
        )
    return name
