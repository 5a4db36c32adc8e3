"""The client's headers as Reef reads them: which are recorded (never credentials), and ``x-reef-capture``."""

from __future__ import annotations

import re
from collections.abc import Mapping

from daemon.errors import BadRequest

# headers never stored: credentials, and anything that looks like one
_SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|password|credential", re.I)


_RECORDED_NAME: dict[str, str | None] = {}  # header name as sent -> its recorded name, None for a secret one


def safe_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers as recorded: without credentials."""
    out = {}
    for k, v in headers.items():
        name = _RECORDED_NAME.get(k, "")
        if name == "":
            name = None if _SECRET_HEADER.search(k) else k.lower()
            if len(_RECORDED_NAME) < 4096:  # names are the client's: bounded memo
                _RECORDED_NAME[k] = name
        if name is not None:
            out[name] = v
    return out


CAPTURE_VALUES = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
                  "off": False}


def capture_header(value: str | None) -> bool:
    """``x-reef-capture``: absent or true records the exchange for training; false serves it with a receipt and
    never trains on it. Anything else is refused, never taken for either."""
    if value is None:
        return True
    got = CAPTURE_VALUES.get(value.strip().lower())
    if got is None:
        raise BadRequest(f"x-reef-capture must be true or false, not {value[:40]!r}", param="x-reef-capture")
    return got
