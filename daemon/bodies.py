"""Request bodies: read, decoded strictly, parsed; a big one entirely off the event loop, in short pieces.

A body is JSON decoded strictly: a BOM, invalid UTF-8, duplicate keys, ``NaN``/``Infinity``, integers past the
digit limit, nesting too deep and lone UTF-16 surrogate escapes are each a ``BadRequest`` that says what is
wrong. The text is kept as received: it is what the record stores.

A body over ``PARSE_OFF_LOOP_BYTES`` is decoded and parsed (into the protocol's exchange, for a provider route) in
a worker thread, two at a time. A thread shares the GIL with the loop, and one C call holds it until it returns,
so everything that grows with the body is cut into pieces of a few milliseconds:

- the received chunks are joined in the thread (``daemon/web.py``: ``bytes.join`` lets go of the GIL past 1 MB;
  on the loop 64 MB took 90 ms);
- UTF-8, the JSON scan and the lone-surrogate scan go a piece at a time (``daemon/jsontext.py``); the
  lone-surrogate scan no longer takes a valid pair (an escaped emoji) for a lone one, which sent the whole value
  through ``json.dumps`` (0.3 s at 64 MB);
- the protocol's parse (``WireFormat.parse_request``) is Python, so it lets go of the GIL on its own (and the
  engines look for images in their worker threads: 0.2 s on the loop for 870,000 messages);
- the cyclic garbage collector is off while a body over ``QUIET_BYTES`` lives (``jsontext.QUIET``): a full
  collection walks every tracked object in one call, and 500,000 parsed messages are 1.3 million of them;
- when the request is done, ``discard`` frees the parsed body a slice at a time in a thread (freed at once,
  500,000 messages held the GIL 0.1 s).

Measured with ``bench/big_body.py``: see docs/durability.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from daemon import jsontext, web
from daemon.errors import BadRequest, PayloadTooLarge

T = TypeVar("T")

BODY_TIMEOUT_S = 60.0
PARSE_OFF_LOOP_BYTES = 256 * 1024  # bodies larger than this are decoded in a worker thread, two at a time
QUIET_BYTES = 4 << 20  # a body larger than this keeps the garbage collector off until it is discarded
_BIG_PARSES = asyncio.Semaphore(2)

def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in an object")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON: " + ("not a number" if name == "NaN" else "not a finite number")
                     + " (send a finite number)")


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)


def parse_json(raw: bytes) -> Any:
    """Decode a request body strictly; every failure is a ``BadRequest`` that says what is wrong."""
    return parse_json_text(raw)[0]


def parse_json_text(raw: bytes) -> tuple[Any, str]:
    """``parse_json``, and the body's text: valid JSON as received, what the record stores (no re-encoding). A big
    body is decoded in short pieces (``daemon/jsontext.py``)."""
    if not raw:
        raise BadRequest("request body is empty; send a JSON object")
    if raw.startswith(b"\xef\xbb\xbf"):
        raise BadRequest("request body starts with a byte order mark; send plain UTF-8 JSON")
    big = len(raw) > PARSE_OFF_LOOP_BYTES
    try:
        text = jsontext.decode_utf8(raw) if big else raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = jsontext.decode_cut(text, _DECODER, _no_duplicate_keys) if big else None
        if value is None:
            value = _DECODER.decode(text)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # duplicate keys, NaN/Infinity, integers beyond the digit limit
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if jsontext.lone_surrogate(text):
        try:  # a match may be a false alarm (an escaped backslash before "ud800"): the encoder has the last word
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("request body contains a lone UTF-16 surrogate escape (like \\ud800)") from None
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
    return value, text


async def read_raw(request: web.Request, limit: int) -> bytes:
    """The request's whole body (refused as ``PayloadTooLarge``, ``BadRequest`` or a 408 where it cannot be had).
    A declared length over the limit never gets here (the dispatcher refuses it); a chunked body is cut off at the
    limit by the server."""
    try:
        if request.body_complete:  # all of it already came with the head: nothing to wait for, no timer
            return await request.read()
        async with asyncio.timeout(BODY_TIMEOUT_S):
            return await request.read()
    except web.BodyTooLarge:
        raise PayloadTooLarge(f"request body is over the {limit}-byte limit") from None
    except web.MalformedBody as e:
        raise BadRequest(f"malformed request body: {e}") from None
    except TimeoutError:
        raise BadRequest(f"request body not received within {BODY_TIMEOUT_S:.0f} s", status=408) from None


async def read_json(request: web.Request, limit: int) -> Any:
    return (await read_json_text(request, limit))[0]


async def read_json_text(request: web.Request, limit: int) -> tuple[Any, str]:
    """The request's JSON body and its text (``parse_json_text``)."""
    return await read_parsed(request, limit, _same)


def _same(value: Any) -> Any:
    return value


async def read_parsed(request: web.Request, limit: int, parse: Callable[[Any], T], *,
                      quiet: bool = False) -> tuple[T, str]:
    """``parse`` of the request's JSON body, and the body's text: a big body's decode and ``parse`` both run in a
    worker thread (``parse`` must not touch the loop). ``quiet``: a body over ``QUIET_BYTES`` keeps the garbage
    collector off until ``discard`` gets it (``jsontext.QUIET``); the caller must hand every big one to it."""
    raw = await read_raw(request, limit)
    if len(raw) <= PARSE_OFF_LOOP_BYTES:
        return _parse_raw(raw, parse)
    async with _BIG_PARSES:
        return await asyncio.to_thread(_parse_quietly if quiet else _parse_raw, raw, parse)


def _parse_raw(raw: bytes, parse: Callable[[Any], T]) -> tuple[T, str]:
    value, text = parse_json_text(raw)
    return parse(value), text


def _parse_quietly(raw: bytes, parse: Callable[[Any], T]) -> tuple[T, str]:
    if len(raw) <= QUIET_BYTES:
        return _parse_raw(raw, parse)
    jsontext.QUIET.hold()  # until ``discard``
    try:
        out = _parse_raw(raw, parse)
    except BaseException:
        jsontext.QUIET.release()
        raise
    _HOLDING.add(id(out[1]))  # the text lives until ``discard``: its id names it until then
    return out


_HOLDING: set[int] = set()  # the ids of the texts of bodies that hold the collector off


def is_big(text: str) -> bool:
    """Whether a body of this text was a big one (read in a thread; ``discard`` it)."""
    return len(text) > PARSE_OFF_LOOP_BYTES


async def discard(trash: list[Any], text: str) -> None:
    """Free a big body's parse (``trash``: what ``read_parsed(..., quiet=True)`` gave, the caller's own names
    dropped; ``text``: its body's text) in a thread, a slice at a time (``jsontext.take_apart``), and end its hold
    on the garbage collector."""
    try:
        await asyncio.to_thread(jsontext.take_apart, trash)
    finally:
        if id(text) in _HOLDING:
            _HOLDING.discard(id(text))
            jsontext.QUIET.release()
