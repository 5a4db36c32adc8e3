"""What the TUI shows, as snapshots (``pytest-textual-snapshot``): the scenarios screen, a release chain (head
marked, a rollback naming what it restored, rejected and pending candidates on demand), a release's detail
(text diff and tensor summary), the training screen (a plotext chart fed by events) and the rollback
confirmation. Fixed data and a fixed clock (``tests/tui_fixture.py``) keep them identical from run to run;
``pytest --snapshot-update`` rewrites them after a deliberate change."""

from __future__ import annotations

from typing import Any

from reef_cli.tui.app import ReefApp
from tests.tui_fixture import NOW, FixedSource

SIZE = (120, 34)


def app(**kw: Any) -> ReefApp:
    return ReefApp(FixedSource(), clock=lambda: NOW, **kw)


async def settled(pilot: Any) -> None:
    """Wait until the screen on top has loaded, then for the screen to be painted."""
    for _ in range(200):
        if getattr(pilot.app.screen, "loaded", 1):
            break
        await pilot.pause(0.02)
    await pilot.pause(0.1)
    await pilot.wait_for_scheduled_animations()


def test_scenarios_screen(snap_compare: Any) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled)


def test_chain_screen(snap_compare: Any) -> None:
    assert snap_compare(app(scenario="alpha"), terminal_size=SIZE, run_before=settled)


def test_chain_screen_with_rejected_and_pending_candidates(snap_compare: Any) -> None:
    async def run_before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("a")
        await pilot.pause(0.2)
        await settled(pilot)

    assert snap_compare(app(scenario="alpha"), terminal_size=SIZE, run_before=run_before)


def test_release_detail(snap_compare: Any) -> None:
    async def run_before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("down", "down", "enter")
        await pilot.pause(0.1)
        await settled(pilot)

    assert snap_compare(app(scenario="alpha"), terminal_size=SIZE, run_before=run_before)


def test_rollback_confirmation(snap_compare: Any) -> None:
    async def run_before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("down", "down", "b")
        await pilot.pause(0.2)

    assert snap_compare(app(scenario="alpha"), terminal_size=SIZE, run_before=run_before)


def test_training_screen(snap_compare: Any) -> None:
    async def run_before(pilot: Any) -> None:
        await settled(pilot)
        for _ in range(200):  # every fixed event delivered
            if len(pilot.app.training.steps) == 3:
                break
            await pilot.pause(0.02)
        await pilot.press("t")
        await pilot.pause(0.1)
        await settled(pilot)

    assert snap_compare(app(scenario="alpha"), terminal_size=SIZE, run_before=run_before)


def test_exchange_view(snap_compare: Any) -> None:
    async def run_before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("f")
        await pilot.pause(0.1)
        await settled(pilot)
        await pilot.press("enter")
        await pilot.pause(0.1)
        await settled(pilot)

    assert snap_compare(app(scenario="alpha"), terminal_size=SIZE, run_before=run_before)


def test_eval_screen(snap_compare: Any) -> None:
    """``v`` on a chain: ``reef eval`` as bars per release, after ``m`` measured the base's probes."""
    async def run_before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("v")
        await settled(pilot)
        await pilot.press("m")
        for _ in range(200):
            if getattr(pilot.app.screen, "measured", 0):
                break
            await pilot.pause(0.02)
        await settled(pilot)

    assert snap_compare(app(scenario="alpha"), terminal_size=SIZE, run_before=run_before)
