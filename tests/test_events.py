"""Events are typed (``daemon/events.py``: one ``TypedDict`` per kind, ``KINDS``), and both ends are held to it:
- every ``events.publish(...)`` in the product names a declared kind, as a literal, with only that kind's fields
  and every field the kind requires (read from the source with ``ast``, so modules mypy does not check are held
  too; a ``**spread`` is checked where it is made, by the test of that event, not here);
- what the readers read of an event (the TUI, the demo, OpenTelemetry) is a field some kind declares;
- what a real daemon publishes on ``/reef/events`` for a served request and a report carries only declared fields.
"""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from typing import Any

from daemon.events import KINDS, Event, EventBus
from tests.conftest import Daemon
from tests.test_imports import ROOT
from tests.test_reports import serve_one
from tests.test_structure import product_files

READERS = ("reef_cli/tui/app.py", "reef_cli/tui/screens.py", "reef_cli/demo.py", "daemon/telemetry.py")
EVENT_NAMES = ("ev", "event", "e")  # what readers call an event they hold


def fields(kind: type[Event]) -> tuple[frozenset[str], frozenset[str]]:
    """A kind's fields, and those it requires (the common ``seq``, ``time`` and ``kind`` are the bus's)."""
    common = Event.__required_keys__
    return (frozenset(kind.__required_keys__ | kind.__optional_keys__) - common,
            frozenset(kind.__required_keys__) - common)


def publish_findings(source: str, where: str) -> list[str]:
    """What breaks the declarations in one module's ``events.publish`` calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "publish"):
            continue
        receiver = node.func.value
        if (receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)) != "events":
            continue
        at = f"{where}:{node.lineno}"
        if not (node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(f"{at}: the kind is not a literal")
            continue
        kind = node.args[0].value
        if kind not in KINDS:
            found.append(f"{at}: kind {kind!r} is not declared in daemon/events.py KINDS")
            continue
        allowed, required = fields(KINDS[kind])
        named = {k.arg for k in node.keywords if k.arg is not None}
        spread = any(k.arg is None for k in node.keywords)
        found += [f"{at}: {kind} has no field {name!r}" for name in sorted(named - allowed)]
        if not spread:
            found += [f"{at}: {kind} needs field {name!r}" for name in sorted(required - named)]
    return found


def read_keys(source: str) -> set[str]:
    """The keys read off an event: ``ev["x"]`` and ``ev.get("x")`` on the names ``EVENT_NAMES``."""
    keys = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in EVENT_NAMES
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            keys.add(node.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Name) and node.func.value.id in EVENT_NAMES and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            keys.add(node.args[0].value)
    return keys


def declared() -> set[str]:
    return set(Event.__required_keys__) | {name for kind in KINDS.values() for name in fields(kind)[0]}


def test_every_publish_names_a_declared_kind_and_its_fields() -> None:
    found, calls = [], 0
    for path in product_files():
        source = (ROOT / path).read_text()
        if "publish(" in source:
            calls += source.count("events.publish(")
            found += publish_findings(source, path)
    assert calls > 25  # the scan sees the product's publishers
    assert not found, "\n".join(found)


def test_the_check_refuses_an_unknown_kind_a_misspelt_field_and_a_missing_one() -> None:
    source = ("def f(events, k, out):\n"
              "    events.publish('gate', scenario='s', verdict='passed')\n"
              "    events.publish('gaet', scenario='s')\n"
              "    self.events.publish('gate', scenario='s', verdikt='passed')\n"
              "    events.publish('train.error', scenario='s')\n"
              "    events.publish('train.error', scenario='s', **out)\n"
              "    events.publish(k, scenario='s')\n"
              "    store.publish('gaet')\n")
    assert publish_findings(source, "m.py") == [
        "m.py:3: kind 'gaet' is not declared in daemon/events.py KINDS",
        "m.py:4: gate has no field 'verdikt'",
        "m.py:5: train.error needs field 'error'",
        "m.py:7: the kind is not a literal",
    ]


def test_readers_read_only_declared_fields() -> None:
    unknown = {path: sorted(read_keys((ROOT / path).read_text()) - declared()) for path in READERS}
    assert all(read_keys((ROOT / path).read_text()) for path in READERS)  # each reader is seen reading
    assert not any(unknown.values()), f"fields read that no event kind declares: {unknown}"
    assert read_keys("ev.get('verdikt'); ev['kind']; other['x']") - declared() == {"verdikt"}


def undeclared(event: dict[str, Any]) -> list[str]:
    kind = KINDS.get(str(event.get("kind")))
    if kind is None:
        return [f"kind {event.get('kind')!r}"]
    allowed, required = fields(kind)
    common = set(Event.__required_keys__)
    return ([f"{event['kind']}.{k}" for k in sorted(set(event) - allowed - common)]
            + [f"{event['kind']} lacks {k}" for k in sorted(required - set(event))])


def test_a_served_request_and_its_report_publish_only_declared_fields(daemon: Daemon) -> None:
    with daemon.http() as c:
        receipt = serve_one(c, "typed-events")
        assert c.post("/reef/report", json={"score": 1, "references": [receipt], "feedback": "fine"}).is_success
        seen: list[dict[str, Any]] = []
        with c.stream("GET", "/reef/events", params={"after": 0}, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if any(e["kind"] == "report" and e.get("scenario") == "typed-events" for e in seen):
                        break
    ours = [e for e in seen if (e["scenario"].get("name") if isinstance(e.get("scenario"), dict)
                                else e.get("scenario")) == "typed-events"]  # a scenario event carries the scenario
    assert {"scenario", "record", "report"} <= {e["kind"] for e in ours}, [e["kind"] for e in ours]
    assert [problem for e in seen for problem in undeclared(e)] == []
    assert undeclared({"kind": "record", "seq": 1, "time": 0.0, "id": "rec_x", "recipt": "x"}) == ["record.recipt"]
    assert undeclared({"kind": "train.error", "seq": 1, "time": 0.0, "scenario": "s"}) == ["train.error lacks error"]


def test_kinds_are_the_ones_the_docstring_names_first() -> None:
    doc = Path(ROOT / "daemon" / "events.py").read_text().split('"""', 2)[1]
    for kind in ("record", "report", "scenario", "release", "engine.load", "train.step", "gate", "heldout", "eval"):
        assert f"``{kind}``" in doc and kind in KINDS


def test_the_daemons_own_readers_are_not_counted_among_the_clients() -> None:
    """The status page tells of clients: a reader of the daemon's own (residency, telemetry) is neither a subscriber
    there nor, when it falls behind, a client dropped; a client still is both."""
    async def run() -> None:
        bus = EventBus(queue_size=2)
        own = bus.subscribe(internal=True)
        client = bus.subscribe()
        assert bus.subscribers == 1
        for _ in range(3):  # both fall behind
            bus.publish("warning", message="x", scenario=None)
        assert bus.dropped == 1 and bus.subscribers == 0
        assert own.get_nowait()["kind"] == "dropped" and client.get_nowait()["kind"] == "dropped"
        again = bus.subscribe(internal=True)
        bus.unsubscribe(again)
        assert bus.subscribers == 0
        bus.subscribe()
        assert bus.subscribers == 1
    asyncio.run(run())
