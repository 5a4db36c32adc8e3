"""Big JSON texts decoded and encoded in a worker thread without holding the GIL for long.

A thread shares the GIL with the event loop, and one C call holds it until it returns: ``json.loads`` of 64 MB of
short messages held it 1.3 s, one decode of 64 MB of UTF-8 110 ms, the JSON scanner 5.6 ms per MB of one string
(0.36 s for a 64 MB one), ``orjson.dumps`` of 500,000 objects about 0.1 s. So the big cases are cut into pieces
of a few milliseconds each, between which the loop can take the GIL back:

- UTF-8 is decoded in ``SLICE`` pieces;
- the scanner runs with an ``object_pairs_hook`` (Python, called once per object: a point where the GIL can
  change hands), and runs of ``LONG_RUN`` characters or more without a quote, backslash or control character
  (base64 images, long plain text) are cut out before it and put back into the parsed strings afterwards. The
  placeholders are unguessable; one outside a string makes the text invalid, and it is then decoded whole;
- the lone-surrogate scan runs over slices;
- ``dumpb`` encodes long lists a piece at a time;
- ``QUIET`` keeps the cyclic garbage collector off while what big JSON became lives: a full collection walks every
  tracked object in one call (500,000 parsed messages are 1.3 million of them, 0.9 s);
- ``take_apart`` frees it a slice at a time (freed at once, 500,000 parsed messages held the GIL 0.1 s).

Not cut: one string that is long and full of escapes (a 64 MB source file with a newline every line) is still
one scanner call.
"""

from __future__ import annotations

import codecs
import contextlib
import gc
import json
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson

SLICE = 1 << 20  # characters (or bytes) one C call gets at most
LONG_RUN = 1 << 16  # a run of plain string characters at least this long is cut out before the scanner
_PIECE = 2000  # list items one ``orjson.dumps`` call gets at most

_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # a surrogate escape: a lone one, or half a pair
_CONTROL = re.compile(r"[\x00-\x1f]")

PairsHook = Callable[[list[tuple[str, Any]]], dict[str, Any]]


def decode_utf8(raw: bytes) -> str:
    """``raw.decode("utf-8")``, a slice at a time; a ``UnicodeDecodeError`` names the offset in all of ``raw``."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    parts = []
    for i in range(0, len(raw), SLICE):
        held = len(decoder.getstate()[0])  # bytes of a character begun in the slice before
        try:
            parts.append(decoder.decode(view[i:i + SLICE], final=i + SLICE >= len(raw)))
        except UnicodeDecodeError as e:
            raise UnicodeDecodeError("utf-8", raw, i - held + e.start, i - held + e.end, e.reason) from None
    return "".join(parts)


def lone_surrogate(text: str) -> bool:
    """Whether JSON ``text`` may have a surrogate escape that is not half of a pair (a false alarm, like an escaped
    backslash before "ud800", costs the caller's exact check). A slice at a time; a pair (an emoji) costs a look."""
    for i in range(0, len(text), SLICE):
        for m in _SURROGATE.finditer(text, i, i + SLICE + 5):  # one that crosses the end: seen whole
            at, high = m.start(), m.group()[3] in "89abAB"
            if high:
                if not _SURROGATE.match(text, at + 6) or text[at + 9] not in "cdefCDEF":
                    return True
            elif at < 6 or not _SURROGATE.match(text, at - 6) or text[at - 3] not in "89abAB":
                return True
    return False


def _control_at(text: str, start: int, end: int) -> int | None:
    """The first control character in ``text[start:end]``, a slice at a time (``isprintable`` is the fast no)."""
    for i in range(start, end, SLICE):
        j = min(i + SLICE, end)
        if not text[i:j].isprintable() and (m := _CONTROL.search(text, i, j)):
            return m.start()
    return None


def long_runs(text: str) -> list[tuple[int, int]]:
    """Spans of ``LONG_RUN`` or more characters with no quote, backslash or control character. Jumps a window at a
    time: the last quote or backslash in the window is where a run could start, so text of short strings costs two
    ``rfind`` calls per ``LONG_RUN`` characters."""
    spans: list[tuple[int, int]] = []
    p, n = 0, len(text)
    while p + LONG_RUN <= n:
        stop = p + LONG_RUN
        last = max(text.rfind('"', p, stop), text.rfind("\\", p, stop))
        if last >= 0:
            p = last + 1 if text[last] == '"' else last + 6  # past any escape the backslash begins
            continue
        end = stop
        while end < n:  # a slice at a time: find scans its whole range in one call
            found = [x for x in (text.find('"', end, end + SLICE), text.find("\\", end, end + SLICE)) if x >= 0]
            if found:
                end = min(found)
                break
            end = min(end + SLICE, n)
        bad = _control_at(text, p, end)
        if bad is not None:  # a control character is not a plain string character: the run ends before it
            if bad - p >= LONG_RUN:
                spans.append((p, bad))
            p = bad + 1
            continue
        spans.append((p, end))
        p = end
    return spans


def decode_cut(text: str, decoder: json.JSONDecoder, pairs: PairsHook) -> Any | None:
    """The JSON value of ``text`` (by ``decoder``) with its long plain runs cut out before the scanner and put back
    after (dicts whose keys had one rebuilt by ``pairs``); None when there are none, or when the cut text is not
    valid JSON (a run outside a string): then decode it whole, for the value or the error."""
    spans = long_runs(text)
    if not spans:
        return None
    nonce = secrets.token_hex(16)
    marks: dict[str, str] = {}
    parts, at = [], 0
    for i, (a, b) in enumerate(spans):
        mark = f"\ue000{nonce}:{i}\ue001"
        marks[mark] = text[a:b]
        parts += [text[at:a], mark]
        at = b
    parts.append(text[at:])
    try:
        value = decoder.decode("".join(parts))
    except (ValueError, RecursionError):
        return None
    return _put_back(value, f"\ue000{nonce}:", marks, pairs)


def _put_back(value: Any, prefix: str, marks: dict[str, str], pairs: PairsHook) -> Any:
    """``value`` with every placeholder in its strings (keys too) replaced by its run. Iterative: text nested deeply
    enough to pass the decoder still passes here."""
    mark = re.compile(re.escape(prefix) + r"\d+\ue001")

    def fix(s: str) -> str:
        return mark.sub(lambda m: marks[m.group()], s) if prefix in s else s

    root = [value]
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    node[i] = fix(v)
                elif isinstance(v, (list, dict)):
                    stack.append(v)
            continue
        if any(prefix in k for k in node):
            items = [(fix(k), v) for k, v in node.items()]
            node.clear()
            node.update(pairs(items))
        for k, v in node.items():
            if isinstance(v, str):
                node[k] = fix(v)
            elif isinstance(v, (list, dict)):
                stack.append(v)
    return root[0]


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)  # Python, not the builtin: a call the scanner makes per object where the GIL can change hands


_PLAIN = json.JSONDecoder(object_pairs_hook=_pairs)


def loads(text: str | bytes) -> Any:
    """``json.loads`` of stored JSON (valid when written), without holding the GIL long when it is big."""
    if len(text) <= LONG_RUN:
        return json.loads(text)
    if isinstance(text, bytes):
        text = decode_utf8(text)
    value = decode_cut(text, _PLAIN, _pairs)
    return _PLAIN.decode(text) if value is None else value


def dumpb(value: Any) -> bytes:
    """Compact JSON as UTF-8 bytes (orjson), a list of more than ``_PIECE`` items (at the top or in a top-level
    value) a piece at a time. The stdlib for what orjson refuses (integers beyond 64 bits)."""
    try:
        if isinstance(value, dict) and any(_long_list(v) for v in value.values()):
            return b"{" + b",".join(orjson.dumps(k) + b":" + (_list(v) if _long_list(v) else orjson.dumps(v))
                                    for k, v in value.items()) + b"}"
        return _list(value) if _long_list(value) else orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _long_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > _PIECE


def _list(v: list[Any]) -> bytes:
    return b"[" + b",".join(orjson.dumps(v[i:i + _PIECE])[1:-1] for i in range(0, len(v), _PIECE)) + b"]"


def take_apart(stack: list[Any]) -> None:
    """Free what ``stack`` holds (lists, dicts, objects with a ``__dict__``, and what they hold) a slice at a time:
    freed at once, 500,000 parsed messages held the GIL 0.1 s. Only what nothing else holds is taken apart (the
    caller drops its own names first); the rest is left whole, to be freed where it is let go. Empties ``stack``."""
    while stack:
        node = stack.pop()
        if sys.getrefcount(node) > 2:  # more than ``node`` and getrefcount's argument: someone else's
            continue
        if isinstance(node, list):
            while node:
                piece = node[-_PIECE:]
                del node[-_PIECE:]
                stack.extend(v for v in piece if _holds_much(v))
                del piece  # frees the items not kept, each with what it holds
            continue
        d = node if isinstance(node, dict) else vars(node)
        values = [v for v in d.values() if isinstance(v, (list, dict)) or _is_object(v)]
        d.clear()
        stack.extend(values)
        del values


def _is_object(v: Any) -> bool:
    return hasattr(v, "__dict__") and not isinstance(v, type)


def _holds_much(v: Any) -> bool:
    """Whether freeing ``v`` at once would free much: a big container, or one holding one (a message and its
    content blocks)."""
    if isinstance(v, (list, dict)):
        if len(v) > _PIECE:
            return True
        inner = v.values() if isinstance(v, dict) else ()
    elif _is_object(v):
        inner = vars(v).values()
    else:
        return False
    return any(isinstance(x, (list, dict)) and len(x) > _PIECE for x in inner)


class Quiet:
    """Keeps the cyclic garbage collector off while something big built from JSON lives: a full collection walks
    every tracked object in one call, GIL held, and 500,000 parsed messages are 1.3 million of them (0.9 s).
    ``hold`` when building one begins, ``release`` when it is gone: the collector is off while any is held, for at
    most ``WINDOW_S`` (then on again, until none is held), so that cyclic garbage made meanwhile waits, never
    piles up. Nothing is frozen: what the window made is collected as usual afterwards."""

    WINDOW_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = 0
        self._opened = 0.0
        self._disabled = False

    def hold(self) -> None:
        with self._lock:
            if not self._held:
                self._opened = time.monotonic()
                if gc.isenabled():
                    gc.disable()
                    self._disabled = True
            self._held += 1
            self._expire()

    def release(self) -> None:
        with self._lock:
            self._held -= 1
            if not self._held and self._disabled:
                self._disabled = False
                gc.enable()
            self._expire()

    def _expire(self) -> None:
        if self._disabled and time.monotonic() - self._opened > self.WINDOW_S:
            self._disabled = False
            gc.enable()

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Around building (and dropping) something big and short-lived."""
        self.hold()
        try:
            yield
        finally:
            self.release()


QUIET = Quiet()
