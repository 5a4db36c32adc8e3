"""``reef tui`` against a real daemon (Textual's Pilot): navigate from the scenarios to a release and its
detail, roll back with the keyboard and see the head change through the API, lose a rollback race against a
publish (refused, reported, refreshed), promote a pending release, show rejected candidates, follow the
records feed and training events, and reconnect when the daemon restarts."""

from __future__ import annotations

import asyncio
import io
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.config import load_config
from reef_cli.tui.api import Api
from reef_cli.tui.app import ReefApp
from reef_cli.tui.screens import ChainScreen, ConfirmScreen, RecordScreen, RecordsScreen, ReleaseScreen, TrainingScreen
from tests.conftest import Daemon

SIZE = (130, 40)


def variant(tiny: Path, dest: Path, note: str) -> Path:
    """The tiny model plus a notes file: distinct release content, and a text diff to show."""
    shutil.copytree(tiny, dest)
    (dest / "NOTES.md").write_text(note)
    return dest


def publish(d: Daemon, tiny: Path, scenario: str, note: str, **kw: Any) -> str:
    """Publish a release from outside the daemon (another process would do the same)."""
    from daemon.releases import ReleaseStore, files_from_dir

    store = ReleaseStore(d.home / "artifacts.git")
    with tempfile.TemporaryDirectory() as tmp:
        files = files_from_dir(variant(tiny, Path(tmp) / "m", note))
        if kw.pop("pending", False):
            return store.hold(scenario, files, kind="weights", recipe="record", **kw).release_id
        return store.publish(scenario, files, expected_head=store.head(scenario), operation="train",
                             kind="weights", recipe="record", **kw).release_id


def releases(d: Daemon, scenario: str) -> dict[str, Any]:
    with d.unix() as c:
        return dict(c.get(f"/reef/scenarios/{scenario}/releases").json())


@pytest.fixture(scope="module")
def seeded(daemon: Daemon, tiny_model: Path) -> Iterator[dict[str, Any]]:
    """Scenarios ``tui-a`` (init + two trained releases, one exchange with a report) and ``tui-b``."""
    with daemon.unix() as c:
        for name in ("tui-a", "tui-b"):
            assert c.post("/reef/scenarios", json={"name": name}).status_code == 201
    r1 = publish(daemon, tiny_model, "tui-a", "release one\nshared line\n", metrics={"batch_reward": 0.25})
    r2 = publish(daemon, tiny_model, "tui-a", "release two\nshared line\n", metrics={"batch_reward": 0.5})
    with daemon.unix() as c:
        resp = c.post("/s/tui-a/r/run-tui/v1/chat/completions",
                      json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hello tui"}]})
        receipt = resp.headers["x-reef-agent-record-id"]
        assert c.post("/reef/report", json={"references": [receipt], "score": 0.75, "feedback": "ok"}).status_code == 201
    yield {"r1": r1, "r2": r2, "receipt": receipt}


def plain(widget: Any) -> str:
    """What a Static shows, as plain text."""
    from rich.console import Console

    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(widget.content)
    return console.export_text()


def make_app(d: Daemon, **kw: Any) -> ReefApp:
    return ReefApp(Api(load_config(env={"REEF_HOME": str(d.home)})), **kw)


async def until(pilot: Any, cond: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        got = cond()
        if got:
            return got
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}; screen {pilot.app.screen}, "
                         f"messages {pilot.app.messages}")


async def loaded(pilot: Any, kind: type, n: int = 1) -> Any:
    return await until(pilot, lambda: isinstance(pilot.app.screen, kind) and pilot.app.screen.loaded >= n
                       and pilot.app.screen, what=f"{kind.__name__} loaded")


async def test_navigate_roll_back_by_keyboard_and_the_head_changes(daemon: Daemon, seeded: dict[str, Any]) -> None:
    app = make_app(daemon)
    async with app.run_test(size=SIZE) as pilot:
        scen = await until(pilot, lambda: app.screen.loaded and app.screen, what="scenarios")
        names = [str(k.value) for k in scen.query_one("DataTable").rows]
        await pilot.press(*["down"] * names.index("tui-a"), "enter")
        chain = await loaded(pilot, ChainScreen)
        assert chain.scenario == "tui-a" and chain.head == seeded["r2"]
        assert list(chain.rows)[:2] == [seeded["r2"], seeded["r1"]]  # newest first
        await pilot.press("down", "enter")  # the release before the head: its detail
        detail = await loaded(pilot, ReleaseScreen)
        assert detail.release_id == seeded["r1"]
        shown = plain(detail.query_one("#diff"))
        assert "NOTES.md" in shown and "release one" in shown  # the text diff to its parent
        await pilot.press("escape")
        await loaded(pilot, ChainScreen)
        await pilot.press("b")
        modal = await until(pilot, lambda: isinstance(app.screen, ConfirmScreen) and app.screen)
        question = "\n".join(modal.lines)
        assert f"from  head {seeded['r2'][:10]}" in question and f"to    {seeded['r1'][:10]}" in question
        await pilot.press("y")
        await until(pilot, lambda: any("published" in m for m in app.messages), what="rollback published")
        chain = await until(pilot, lambda: isinstance(app.screen, ChainScreen) and app.screen.head != seeded["r2"]
                            and app.screen)
    after = releases(daemon, "tui-a")
    head = after["releases"][0]
    assert after["head"] == head["release_id"] == chain.head
    assert (head["operation"], head["source"], head["step"]) == ("rollback", seeded["r1"], 3)
    assert head["content_id"] == after["releases"][2]["content_id"]  # the content of r1, restored


async def test_a_rollback_racing_a_publish_is_refused_and_reported(daemon: Daemon, tiny_model: Path,
                                                                   seeded: dict[str, Any]) -> None:
    app = make_app(daemon, scenario="tui-b")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        shown_head = chain.head
        await until(pilot, lambda: app.connection.startswith("connected"))
        publish(daemon, tiny_model, "tui-b", "one\n")  # the head moves while nobody looks
        chain.refresh_data()
        await loaded(pilot, ChainScreen, chain.loaded + 1)
        await pilot.press("down", "b")  # roll back to init, against the head the screen shows now
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        shown_head = chain.head
        racer = publish(daemon, tiny_model, "tui-b", "two\n")  # a publish wins the race
        await pilot.press("y")
        await until(pilot, lambda: any("moved meanwhile" in m for m in app.messages), what="refusal")
        assert any(racer[:10] in m and "nothing changed" in m for m in app.messages), app.messages
        await until(pilot, lambda: chain.head == racer, what="the chain refreshed to the new head")
        assert list(chain.rows)[0] == racer
    after = releases(daemon, "tui-b")
    assert after["head"] == racer != shown_head
    assert [r["operation"] for r in after["releases"]] == ["train", "train", "init"]  # no rollback published



async def test_the_chain_follows_a_rollback_made_elsewhere(daemon: Daemon, seeded: dict[str, Any]) -> None:
    """Another client rolls back through the API: the open chain screen shows the new head by itself."""
    app = make_app(daemon, scenario="tui-a")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        await until(pilot, lambda: app.connection.startswith("connected"))
        before = chain.head
        with daemon.unix() as c:
            resp = c.post("/reef/scenarios/tui-a/rollback", json={"release_id": seeded["r2"], "expected_head": before})
            assert resp.status_code == 201, resp.text
        new = resp.json()["release_id"]
        await until(pilot, lambda: chain.head == new, what="the chain refreshed from the release event")
        assert chain.rows[new]["source"] == seeded["r2"]

async def test_rejected_candidates_on_demand_and_promote(daemon: Daemon, tiny_model: Path,
                                                         seeded: dict[str, Any]) -> None:
    from daemon.releases import ReleaseStore

    with daemon.unix() as c:
        assert c.post("/reef/scenarios", json={"name": "tui-c"}).status_code == 201
    store = ReleaseStore(daemon.home / "artifacts.git")
    store.record_rejection("tui-c", verdict="rejected", reason="not better than the head", metrics={"eval_reward": 0.1})
    pending = publish(daemon, tiny_model, "tui-c", "pending\n", pending=True, metrics={"eval_reward": 0.9})
    app = make_app(daemon, scenario="tui-c")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        assert [r["operation"] for r in chain.rows.values()] == ["init"]
        await pilot.press("a")
        await until(pilot, lambda: len(chain.rows) == 3, what="candidates shown")
        ops = [r["operation"] for r in chain.rows.values()]
        assert sorted(ops) == ["init", "pending", "rejected"], ops
        chain.select(pending)
        await pilot.press("p")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await until(pilot, lambda: any("promote" in m and "published" in m for m in app.messages), what="promoted")
    after = releases(daemon, "tui-c")
    assert (after["releases"][0]["operation"], after["releases"][0]["source"]) == ("promote", pending)


async def test_o_opens_a_releases_page_in_the_browser_or_says_where_it_is(daemon: Daemon, seeded: dict[str, Any],
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`o` on the chain's selected release (and on a release's detail) writes its page where `reef releases open`
    does, for the user alone, and hands its URL to the browser: a real browser command as Python's webbrowser runs
    one (registered, as $BROWSER would be). With none that starts, the console says where the page is. Bugs caught:
    no key, the head's page opened instead of the selected one's, a page written for others to read, a failed
    browser reported as opened or without the page's URL."""
    import webbrowser

    from reef_cli.tui.format import short

    seen = tmp_path / "browser-saw"
    browser = tmp_path / "browser"
    browser.write_text(f"#!/bin/sh\nprintf '%s' \"$1\" > {seen}\n")
    browser.chmod(0o755)
    webbrowser.register("reef-test-browser", None, webbrowser.GenericBrowser([str(browser), "%s"]))
    webbrowser.register("reef-test-none", None, webbrowser.GenericBrowser(["false"]))  # exits 1: none started
    monkeypatch.setattr(webbrowser, "_tryorder", ["reef-test-browser"])  # only this one (none of the machine's)
    r1 = seeded["r1"]
    page = daemon.home / "pages" / f"{r1}.html"
    page.unlink(missing_ok=True)
    app = make_app(daemon, scenario="tui-a")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        assert "o Page" in " ".join(str(b.key) + " " + b.description for b in chain.active_bindings.values()
                                    for b in [b.binding]), "the footer does not show o"
        chain.select(r1)
        await pilot.press("o")
        await until(pilot, lambda: any("opened the page" in m for m in app.messages), what="the page opened")
        assert seen.read_text() == page.as_uri()
        assert page.stat().st_mode & 0o077 == 0
        assert f"Release {r1[:12]} of tui-a (step 1)" in page.read_text()

        monkeypatch.setattr(webbrowser, "_tryorder", ["reef-test-none"])
        await pilot.press("enter")
        detail = await loaded(pilot, ReleaseScreen)
        assert detail.release_id == r1
        await pilot.press("o")
        said = await until(pilot, lambda: next((m for m in app.messages if "no browser" in m), None),
                           what="no browser said")
        assert said == f"no browser could be started; the page of {short(r1)} is at {page.as_uri()}", said
        assert not any("opened" in m for m in app.messages[app.messages.index(said):])

    # a rejected candidate is no release: it has no page, and o says so (nothing fetched, nothing opened)
    from daemon.releases import ReleaseStore

    with daemon.unix() as c:
        assert c.post("/reef/scenarios", json={"name": "tui-page"}).status_code == 201
    ReleaseStore(daemon.home / "artifacts.git").record_rejection("tui-page", verdict="rejected", reason="worse",
                                                                 metrics={"eval_reward": 0.1})
    app = make_app(daemon, scenario="tui-page")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        await pilot.press("a")
        await until(pilot, lambda: len(chain.rows) == 2, what="the rejected candidate shown")
        chain.select("rejected:")
        await pilot.press("o")
        await until(pilot, lambda: any("has no release page" in m for m in app.messages), what="no page said")
        assert not any("page of" in m for m in app.messages)


async def test_records_feed_opens_an_exchange_and_training_follows_events(daemon: Daemon,
                                                                          seeded: dict[str, Any]) -> None:
    app = make_app(daemon, scenario="tui-a")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, ChainScreen)
        await pilot.press("f")
        feed = await loaded(pilot, RecordsScreen)
        keys = [str(k.value) for k in feed.query_one("DataTable").rows]
        assert seeded["receipt"] in keys
        await pilot.press(*["down"] * keys.index(seeded["receipt"]), "enter")
        exchange = await loaded(pilot, RecordScreen)
        text = plain(exchange.query_one("#exchange"))
        assert "hello tui" in text and "run-tui" in text and "score 0.75" in text
        await pilot.press("escape", "escape")
        await loaded(pilot, ChainScreen)
        await pilot.press("t")
        training = await loaded(pilot, TrainingScreen)
        await until(pilot, lambda: any(s == 0.75 for _, s, scen in app.training.scores if scen == "tui-a"),
                    what="the seeded report, replayed from the event history")
        before = len(app.training.scores)
        with daemon.unix() as c:
            assert c.post("/reef/report", json={"references": [seeded["receipt"]], "score": 0.25}).status_code == 201
        await until(pilot, lambda: len(app.training.scores) == before + 1, what="a live report event")
        state = plain(training.query_one("#state"))
        assert "last score 0.25" in state


async def test_reconnects_when_the_daemon_restarts(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory()
    app = make_app(d, retry_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.connection.startswith("connected"), what="connected")
        first_pid = app.daemon_pid
        await asyncio.to_thread(d.stop)
        await until(pilot, lambda: app.connection.startswith("daemon unreachable"), what="unreachable shown")
        assert any("lost the daemon" in m for m in app.messages)
        await asyncio.to_thread(d.start)
        await until(pilot, lambda: app.connection.startswith("connected"), timeout=60, what="reconnected")
        assert app.daemon_pid != first_pid
        assert any("restarted" in m for m in app.messages), app.messages


async def test_over_tcp_with_the_token(daemon: Daemon, seeded: dict[str, Any]) -> None:
    cfg = load_config(env={"REEF_HOME": str(daemon.home), "REEF_URL": daemon.url, "REEF_TOKEN": daemon.token})
    app = ReefApp(Api(cfg), scenario="tui-a")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        assert chain.head and daemon.url in app.source.where()
        await until(pilot, lambda: app.connection.startswith("connected"))
    bad = load_config(env={"REEF_HOME": str(daemon.home), "REEF_URL": daemon.url, "REEF_TOKEN": "wrong"})
    app = ReefApp(Api(bad), scenario="tui-a")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        note = plain(chain.query_one("#note"))
        assert "token" in note.lower(), note



def test_the_reef_tui_command_paints_the_chain_in_a_terminal(daemon: Daemon, seeded: dict[str, Any]) -> None:
    """The real command in a pseudo-terminal: it reaches the daemon, paints the chain screen and exits cleanly
    (``--exit-after-paint``, which bench/tui_start.py times)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "reef_cli.main", "tui", "-s", "tui-a", "--exit-after-paint"],
                            stdin=slave, stdout=slave, stderr=slave, env={**daemon.env, "TERM": "xterm-256color"})
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, out[-2000:]
    painted = float(out.rsplit(b"painted ", 1)[1].split()[0])
    assert t0 < painted < time.time()
    assert b"Release chain of tui-a" in out


async def test_a_canary_started_followed_and_promoted_from_the_keyboard(daemon: Daemon, tiny_model: Path,
                                                                        seeded: dict[str, Any]) -> None:
    """c on a pending candidate starts a canary (confirmed); reports on both arms move its line live (the report
    events reload the chain); e asks before ending and n keeps it running; p on the canary promotes it through
    the canary's end, so its figures go on the chain (the plain promote route refuses a running canary)."""
    with daemon.unix() as c:
        assert c.post("/reef/scenarios", json={"name": "tui-k"}).status_code == 201
    pending = publish(daemon, tiny_model, "tui-k", "canary\n", pending=True)
    app = make_app(daemon, scenario="tui-k")
    seen: list[str] = []
    dispatch = app.dispatch
    app.dispatch = lambda ev: (seen.append(ev.get("kind")), dispatch(ev))[1]  # type: ignore[method-assign]

    def report_on_both_arms() -> None:
        with daemon.unix() as c:
            assert c.get("/reef/scenarios/tui-k/canary").json()["release_id"] == pending
            refused = c.post("/reef/scenarios/tui-k/promote", json={"release_id": pending})
            assert refused.status_code == 409 and "canary-end" in refused.text
            for i in range(6):
                r = c.post("/s/tui-k/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": f"q{i}"}]})
                rep = c.post("/reef/report", json={"references": [r.headers["x-reef-agent-record-id"]], "score": 1})
                assert rep.status_code == 201

    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        await pilot.press("a")
        await until(pilot, lambda: len(chain.rows) == 2, what="the pending candidate shown")
        chain.select(pending)
        await pilot.press("c")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await until(pilot, lambda: chain.canary is not None, what="the canary shown")
        # the reload the canary.start event asks for is done: from here only report events move the figures
        await until(pilot, lambda: "canary.start" in seen and not chain._reload_pending
                    and not [w for w in chain.workers if w.group in ("load", "steer") and not w.is_finished],
                    what="the canary.start reload")
        await asyncio.to_thread(report_on_both_arms)  # the app's loop keeps following events meanwhile

        def reports_shown() -> bool:
            f = (chain.canary or {}).get("figures") or {}
            return f.get("canary_reports", 0) + f.get("head_reports", 0) == 6

        await until(pilot, reports_shown, what="the reports in the canary's figures")
        line = plain(chain.query_one("#canary"))
        assert f"canary {pending[:8]}" in line and "serves 20% of new runs" in line and "p promotes it" in line, line
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("n")
        await until(pilot, lambda: any("the canary runs on" in m for m in app.messages), what="kept running")
        chain.select(pending)
        await pilot.press("p")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await until(pilot, lambda: any("canary promoted" in m for m in app.messages), what="promoted")
        await until(pilot, lambda: chain.canary is None and not plain(chain.query_one("#canary")).strip(),
                    what="the canary line gone")
    top = releases(daemon, "tui-k")["releases"][0]
    assert (top["operation"], top["source"], top["metrics"]["canary_verdict"]) == ("promote", pending, "promoted")
    assert top["metrics"]["canary_reports"] + top["metrics"]["head_reports"] == 6


async def test_a_chain_opened_with_s_is_drawn_as_when_returned_to(daemon: Daemon, seeded: dict[str, Any]) -> None:
    """``reef tui -s NAME`` (issue 44): the chain opened at start had squeezed columns and no head marker until the
    user left and came back. The columns and the marker at start are those after a return."""
    app = make_app(daemon, scenario="tui-a")
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        await pilot.pause(0.2)
        table = chain.query_one("DataTable")
        first = [c.get_render_width(table) for c in table.columns.values()]
        first_cell = str(table.get_cell_at((0, 0)))
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ChainScreen), what="scenarios")
        scen = app.screen
        names = [str(k.value) for k in scen.query_one("DataTable").rows]
        await pilot.press(*["down"] * names.index("tui-a"), "enter")
        chain = await loaded(pilot, ChainScreen)
        await pilot.pause(0.2)
        table = chain.query_one("DataTable")
        again = [c.get_render_width(table) for c in table.columns.values()]
        assert (first, first_cell) == (again, str(table.get_cell_at((0, 0)))), (first, again)
        assert first_cell == "▶" and first[0] >= 1


async def test_a_chain_is_drawn_whole_before_the_table_measures_its_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    """What issue 44 saw of ``reef tui -s pi`` (columns squeezed, no head marker, until the user left and came back)
    is a chain drawn before Textual's DataTable measured its new cells, which it does when it is next idle: every
    column at its label's width (ids cut to 7 characters) and the marker's column, which has no label, at none.
    What delayed that pass on the user's terminal did not reproduce here (Pilot and tmux, several sizes); the chain
    screen sets its columns' widths as it fills them, so its first paint is whole whenever the pass runs. Here the
    pass never runs. Bug caught: widths left to the table's own measuring (the picture above)."""
    from textual.widgets import DataTable

    from tests.tui_fixture import NOW, R2, R3, R4, FixedSource

    monkeypatch.setattr(DataTable, "_update_dimensions", lambda self, new_rows: None)  # the idle-time pass
    app = ReefApp(FixedSource(), clock=lambda: NOW, scenario="alpha", follow_events=False)
    async with app.run_test(size=SIZE) as pilot:
        chain = await loaded(pilot, ChainScreen)
        await pilot.pause(0.1)
        table = chain.query_one(DataTable)
        lines = [table.render_line(y).text.split() for y in range(3)]
    assert lines[0] == ["step", "operation", "release", "content", "age", "gate", "metrics", "note"], lines[0]
    assert lines[1][:4] == ["▶", "4", "rollback", R4[:8]] and lines[1][-4:] == ["restores", R2[:8], "(step", "2)"]
    assert lines[2][:3] == ["3", "train", R3[:8]] and "eval_reward" in lines[2] and "accepted" in lines[2], lines[2]
