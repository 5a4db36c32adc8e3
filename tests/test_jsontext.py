"""Big JSON in short pieces (``daemon/jsontext.py``, used by ``daemon/bodies.py`` and the record store): the same
value or the same refusal as one strict decode, whatever the body holds, while no C call sees all of it."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from daemon import jsontext
from daemon.bodies import PARSE_OFF_LOOP_BYTES, parse_json_text
from daemon.errors import BadRequest

L = jsontext.LONG_RUN * 5  # runs long enough to be cut; every body below is over PARSE_OFF_LOOP_BYTES

BODIES = {
    "long strings": json.dumps({"a": "x" * L, "b": ["y" * L, "short", "z" * (jsontext.LONG_RUN - 1)]}),
    "a long key": json.dumps({"k" * L: 1, "other": "v" * L}),
    "escapes between runs": json.dumps({"a": "q" * L + '\n"' + "w" * L + "\\" + "e" * L + "é€😀" + "r" * L},
                                       ensure_ascii=False),
    "an escaped non-ASCII character between runs": json.dumps({"a": "q" * L + "é" + "w" * L}),
    "a valid surrogate pair between runs": '{"a": "' + "x" * L + "\\ud83d\\ude00" + "y" * L + '"}',
    "whitespace outside strings": '{"a": 1,' + " " * L + '"b": "' + "c" * L + '"}',
    "a long array of numbers": '{"a": [' + ",".join(["1"] * L) + "]}",
    "a string like a placeholder": json.dumps({"a": "\ue000" + "0" * 32 + ":0\ue001" + "x" * L}),
    "nesting": json.dumps([[["m" * L]], {"x": {"y": "n" * L}}, "p" * L]),
}

REFUSED = {  # the strict decode refuses each, and so does the cut one
    "duplicate long keys": ('{"' + "k" * L + '": 1, "' + "k" * L + '": 2}', "duplicate key"),
    "a control character in a long run": ('{"a": "' + "x" * L + "\x01" + "y" * L + '"}', "Invalid control"),
    "a raw newline in a long run": ('{"a": "' + "x" * L + "\n" + "y" * L + '"}', "Invalid control"),
    "a lone surrogate between runs": ('{"a": "' + "x" * L + "\\ud800" + "y" * L + '"}', "lone UTF-16 surrogate"),
    "NaN after a long run": ('{"a": "' + "x" * L + '", "b": NaN}', "NaN is not valid JSON"),
    "cut short": (json.dumps({"a": "x" * L})[:-1], "not valid JSON"),
    "invalid UTF-8 far in": (None, "not valid UTF-8 (byte 400007)"),
}


@pytest.mark.parametrize("name", list(BODIES))
def test_a_big_body_decodes_to_what_one_strict_decode_gives(name: str) -> None:
    text = BODIES[name]
    assert len(text.encode()) > PARSE_OFF_LOOP_BYTES
    value, kept = parse_json_text(text.encode())
    assert value == json.loads(text) and kept == text


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_big_body_is_refused_as_one_strict_decode_refuses_it(name: str) -> None:
    text, said = REFUSED[name]
    raw = text.encode() if text is not None else b'{"a": "' + b"x" * 400_000 + b'\xff"}'
    assert len(raw) > PARSE_OFF_LOOP_BYTES
    with pytest.raises(BadRequest) as err:
        parse_json_text(raw)
    assert said in err.value.message, err.value.message
    if text is not None:  # and the same body small: refused the same way (the whole text in one decode)
        with pytest.raises(BadRequest) as small:
            parse_json_text(text.replace("x" * L, "x").replace("y" * L, "y").replace("k" * L, "k").encode())
        assert said.split(" (")[0] in small.value.message


class Watching(json.JSONDecoder):
    """A decoder that notes the longest text its scanner was given."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**{"object_pairs_hook": dict, **kw})
        self.longest = 0

    def decode(self, s: str, *args: Any) -> Any:  # type: ignore[override]
        self.longest = max(self.longest, len(s))
        return super().decode(s, *args)


def test_the_scanner_never_sees_a_long_run() -> None:
    """A 40 MB string (5.6 ms of scanner per MB, one C call holding the GIL) reaches the scanner as a placeholder;
    the value is whole again afterwards."""
    text = json.dumps({"messages": [{"role": "user", "content": "hello world " * ((40 << 20) // 12)}]})
    watching = Watching()
    value = jsontext.decode_cut(text, watching, dict)
    assert value == json.loads(text)
    assert watching.longest < 200, watching.longest
    # nothing long to cut: the caller decodes it whole (None), as it does when a run was outside a string
    assert jsontext.decode_cut(json.dumps(["short"] * 100_000), Watching(), dict) is None
    assert jsontext.decode_cut('{"a": [' + ",".join(["1"] * L) + "]}", Watching(), dict) is None


def test_long_runs_are_found_across_slices_and_end_at_what_ends_them() -> None:
    runs = jsontext.long_runs('"' + "a" * (3 * jsontext.SLICE + 5) + '\\n' + "b" * 10 + '"')
    assert runs == [(1, 3 * jsontext.SLICE + 6)]
    text = '"' + "a" * L + "\x02" + "b" * (L // 2) + '"'
    assert jsontext.long_runs(text) == [(1, L + 1), (L + 2, L + 2 + L // 2)]
    assert jsontext.long_runs('"' + "a" * (jsontext.LONG_RUN - 1) + '"') == []


def test_utf8_in_slices_names_the_byte_in_the_whole_body() -> None:
    ok = ("é" * jsontext.SLICE).encode()  # two bytes each: slices end inside characters
    assert jsontext.decode_utf8(ok) == "é" * jsontext.SLICE
    bad = b"a" * (jsontext.SLICE + 3) + b"\xff"
    with pytest.raises(UnicodeDecodeError) as err:
        jsontext.decode_utf8(bad)
    assert err.value.start == jsontext.SLICE + 3
    split = b"a" * (jsontext.SLICE - 1) + "é".encode()[:1] + b"x"  # a character begun at a slice's end, broken
    with pytest.raises(UnicodeDecodeError) as err:
        jsontext.decode_utf8(split)
    assert err.value.start == jsontext.SLICE - 1


@pytest.mark.parametrize(("text", "lone"), [
    (r'"\ud83d\ude00"', False), (r'"\ud83d\uDE00"', False), (r'"\ud800"', True), (r'"\udc00"', True),
    (r'"x\ude00"', True), (r'"\ud83d\ud83d\ude00"', True), (r'"\ude00\ud83d"', True), ('"plain"', False)])
def test_only_a_lone_surrogate_escape_counts(text: str, lone: bool) -> None:
    assert jsontext.lone_surrogate(text) is lone
    padded = "x" * (jsontext.SLICE - 3) + text  # across a slice's end
    assert jsontext.lone_surrogate(padded) is lone


def test_dumpb_in_pieces_is_the_same_json() -> None:
    value = {"prompt": [{"role": "user", "content": f"m{i}"} for i in range(4001)], "n": 1, "big": 2**70}
    assert json.loads(jsontext.dumpb(value)) == value  # orjson refuses 2**70: the stdlib writes it
    del value["big"]
    assert jsontext.dumpb(value) == orjson.dumps(value)
    assert jsontext.dumpb(value["prompt"]) == orjson.dumps(value["prompt"])
    assert jsontext.loads(jsontext.dumpb(value)) == value


def test_a_big_request_body_reaches_the_scanner_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request path cuts too: a body with a 10 MB string gives the strict decoder a short text, and the same
    value."""
    from daemon import bodies

    watching = Watching(object_pairs_hook=bodies._no_duplicate_keys, parse_constant=bodies._no_constants)
    monkeypatch.setattr(bodies, "_DECODER", watching)
    text = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w" * (10 << 20)}]})
    value, _ = parse_json_text(text.encode())
    assert value == json.loads(text) and watching.longest < 200, watching.longest
