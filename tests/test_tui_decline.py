"""``reef tui``'s declined confirmations against a real daemon (Textual's Pilot): a rollback asked for with ``b``
and declined with ``n`` or escape publishes nothing, the head stays where it was (on screen and through the API),
and the screen says it was cancelled. (Accepting, ``b`` then ``y``, is tested in test_tui.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reef_cli.tui.screens import ChainScreen, ConfirmScreen
from tests.conftest import Daemon
from tests.test_tui import SIZE, loaded, make_app, publish, releases, until


@pytest.fixture(scope="module")
def chain(daemon: Daemon, tiny_model: Path) -> dict[str, Any]:
    """Scenario ``tui-decline``: init and one trained release (the head)."""
    with daemon.unix() as c:
        assert c.post("/reef/scenarios", json={"name": "tui-decline"}).status_code == 201
    head = publish(daemon, tiny_model, "tui-decline", "the head\n")
    return {"head": head, "init": releases(daemon, "tui-decline")["releases"][1]["release_id"]}


@pytest.mark.parametrize("key", ["n", "escape"])
async def test_a_declined_rollback_changes_nothing_and_says_so(daemon: Daemon, chain: dict[str, Any],
                                                               key: str) -> None:
    app = make_app(daemon, scenario="tui-decline")
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot, ChainScreen)
        assert screen.head == chain["head"]
        await pilot.press("down", "b")  # roll back to init...
        modal = await until(pilot, lambda: isinstance(app.screen, ConfirmScreen) and app.screen, what="the question")
        assert f"to    {chain['init'][:10]}" in "\n".join(modal.lines)
        await pilot.press(key)  # ...and decline
        said = await until(pilot, lambda: [m for m in app.messages if "cancelled" in m], what="cancelled said")
        assert said == [f"rollback of tui-decline to {chain['init'][:10]} cancelled; nothing changed"]
        assert app.screen is screen, "the question is gone, the chain is shown again"
        # a steer started anyway would run as a worker: let every one finish before looking at the head
        steers = [w for w in app.workers if w.group == "steer"]
        if steers:  # (an empty list would mean every worker, the event stream's too, which never ends)
            await app.workers.wait_for_complete(steers)
        assert not any("published" in m for m in app.messages), app.messages
        assert screen.head == chain["head"]
    after = releases(daemon, "tui-decline")
    assert after["head"] == chain["head"]
    assert [r["operation"] for r in after["releases"]] == ["train", "init"]  # no rollback published
