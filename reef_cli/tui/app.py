"""``ReefApp``: the Textual console over one daemon.

The app owns the connection: one worker follows ``/reef/events`` (server-sent events), feeds the training
log and tells the screen on top what happened; when the daemon goes away it says so in the connection bar,
retries with a short back-off, and on its return says whether it restarted (a new pid) and refreshes the
screen. Every network call runs in a worker, so the UI never waits on the daemon.

Screens (``reef_cli/tui/screens.py``): scenarios, a scenario's release chain, a release's detail, training,
records feed and one exchange. Keys are listed in each screen's footer (``o`` on a release: its page in the
browser, as ``reef releases open``); the mouse works too.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from textual.app import App
from textual.binding import Binding
from textual.notifications import SeverityLevel
from textual.reactive import reactive

from daemon.errors import ReefError
from reef_cli.tui.api import Source


@dataclass
class Training:
    """What the events said about learning, per scenario: scores reported, training steps, gate verdicts."""

    scores: list[tuple[float, float, str]] = field(default_factory=list)  # (time, score, scenario)
    steps: list[dict[str, Any]] = field(default_factory=list)  # train.step events
    log: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=500))  # start/step/gate/release
    state: dict[str, str] = field(default_factory=dict)  # scenario -> idle|training|judging|waiting
    first_time: float | None = None

    def add(self, ev: dict[str, Any]) -> bool:
        """Take one event; returns whether it changed what the training screen shows."""
        kind, scen, t = ev.get("kind"), ev.get("scenario"), float(ev.get("time") or 0.0)
        if kind not in ("report", "train.start", "train.step", "gate", "release", "release.pending", "train.error"):
            return False
        if self.first_time is None:
            self.first_time = t
        if kind == "report":
            if isinstance(ev.get("score"), (int, float)):
                self.scores.append((t, float(ev["score"]), str(scen)))
            return True
        if kind == "release" and ev.get("operation") == "init":
            return False
        self.log.append(ev)
        if kind == "train.start":
            self.state[str(scen)] = "training"
        elif kind == "train.step":
            self.steps.append(ev)
            self.state[str(scen)] = "judging"
        elif kind == "gate":
            self.state[str(scen)] = "waiting"
        elif kind == "train.error":
            self.state[str(scen)] = "error"
        return True


class ReefApp(App[None]):
    """The Reef console. ``source`` is the daemon's API (``reef_cli.tui.api.Api``) or a stand-in with fixed
    data; ``clock`` gives "now" for ages (fixed in snapshot tests)."""

    TITLE = "reef"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    .title { height: 1; padding: 0 1; background: $primary-background; text-style: bold; }
    .note { height: auto; padding: 0 1; color: $text-muted; }
    DataTable { height: 1fr; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("s", "scenarios", "Scenarios"),
        Binding("t", "training", "Training"),
        Binding("f", "records", "Feed"),
        Binding("escape", "back", "Back", show=False),
    ]

    connection: reactive[str] = reactive("connecting…")
    """One line about the connection to the daemon, shown by every screen's connection bar."""

    def __init__(
        self,
        source: Source,
        *,
        scenario: str | None = None,
        clock: Callable[[], float] = time.time,
        follow_events: bool = True,
        exit_after_paint: bool = False,
        retry_s: float = 0.5,
    ) -> None:
        super().__init__()
        self.source = source
        self.clock = clock
        self.start_scenario = scenario
        self.follow_events = follow_events
        self.exit_after_paint = exit_after_paint
        self.painted_at: float | None = None
        self.retry_s = retry_s
        self.training = Training()
        self.daemon_pid: int | None = None
        self.messages: list[str] = []  # every notification, newest last (tests and the curious read it)

    # --- screens ---------------------------------------------------------------------------------------

    def on_mount(self) -> None:
        from reef_cli.tui.screens import ChainScreen, ScenariosScreen

        self.push_screen(ScenariosScreen())
        if self.start_scenario:
            self.push_screen(ChainScreen(self.start_scenario))
        if self.follow_events:
            self.run_worker(self._follow, name="events", group="events", exclusive=True)  # type: ignore[arg-type]  # textual's WorkType: mypy infers Never

    def action_scenarios(self) -> None:
        while len(self.screen_stack) > 2:
            self.pop_screen()

    def action_training(self) -> None:
        from reef_cli.tui.screens import TrainingScreen

        if not isinstance(self.screen, TrainingScreen):
            self.push_screen(TrainingScreen(getattr(self.screen, "scenario", None)))

    def action_records(self) -> None:
        from reef_cli.tui.screens import RecordsScreen

        if not isinstance(self.screen, RecordsScreen):
            self.push_screen(RecordsScreen(getattr(self.screen, "scenario", None)))

    def action_evaluate(self) -> None:
        """``reef eval`` of the scenario on screen (``v`` on a chain)."""
        from reef_cli.tui.evaluation import EvalScreen

        scenario = getattr(self.screen, "scenario", None)
        if scenario is not None and not isinstance(self.screen, EvalScreen):
            self.push_screen(EvalScreen(scenario))

    async def action_back(self) -> None:  # textual's own is a coroutine; this one only pops
        if len(self.screen_stack) > 2:
            self.pop_screen()

    async def show_page(self, page: Any) -> bool:
        """Hand a written release page to the browser (``reef_cli/releases.py``'s ``to_browser``); whether one
        started. The terminal is lent while it starts, so a terminal browser (lynx, w3m) can use it; where there is
        no terminal to lend (a headless run), the browser starts from a thread."""
        from textual.app import SuspendNotSupported

        from reef_cli.releases import to_browser

        try:
            with self.suspend():
                return to_browser(page)
        except SuspendNotSupported:
            return await asyncio.to_thread(to_browser, page)

    def say(self, message: str, *, severity: SeverityLevel = "information") -> None:
        """Tell the person something (a toast), and keep it in ``messages``."""
        self.messages.append(message)
        self.notify(message, severity=severity, timeout=8)

    def chain_painted(self) -> None:
        """The first chain screen is on the terminal (``reef tui --exit-after-paint`` measures this)."""
        if self.painted_at is None:
            self.painted_at = time.time()
            if self.exit_after_paint:
                self.exit()

    # --- the connection --------------------------------------------------------------------------------

    async def _follow(self) -> None:
        """Follow the daemon's events forever: reconnect when it goes away or ends the stream (a subscriber that
        fell behind is dropped after a ``dropped`` event: the screen reloads), and say so."""
        after: int | None = 0
        down_since: float | None = None
        while True:
            try:
                health = await self.source.healthz()
                pid = health.get("pid")
                if self.daemon_pid is not None and pid != self.daemon_pid:
                    after = 0  # a new daemon numbers its events afresh
                    self.say(f"the daemon restarted (pid {self.daemon_pid} → {pid}); reconnected")
                elif down_since is not None:
                    self.say("reconnected to the daemon")
                if down_since is not None or (self.daemon_pid is not None and pid != self.daemon_pid):
                    self.refresh_screen()
                self.daemon_pid, down_since = pid, None
                self.connection = f"connected to {self.source.where()} (daemon pid {pid})"
                async for ev in self.source.events(after):
                    if ev.get("kind") == "dropped":  # fell behind: its stream ends; resume after the drop, reload
                        after = int(ev.get("resume_after") or 0)
                        self.say("fell behind the daemon's events; reloading", severity="warning")
                        self.refresh_screen()
                        continue
                    after = int(ev.get("seq") or after or 0)
                    self.dispatch(ev)
            except asyncio.CancelledError:
                raise
            except (ReefError, OSError, ValueError) as e:
                if down_since is None:
                    down_since = time.monotonic()
                    self.say("lost the daemon; reconnecting…", severity="warning")
                self.connection = f"daemon unreachable at {self.source.where()}: reconnecting… ({_first_line(e)})"
            await asyncio.sleep(self.retry_s)

    def dispatch(self, ev: dict[str, Any]) -> None:
        """One daemon event: into the training log, then to the screen on top."""
        self.training.add(ev)
        handler = getattr(self.screen, "daemon_event", None)
        if handler is not None:
            handler(ev)

    def refresh_screen(self) -> None:
        reload = getattr(self.screen, "refresh_data", None)
        if reload is not None:
            reload()

    async def on_unmount(self) -> None:
        await self.source.aclose()


def _first_line(e: BaseException) -> str:
    text = getattr(e, "message", None) or str(e) or type(e).__name__
    return text.splitlines()[0][:160]
