"""The TUI's ``reef eval``: a scenario's releases, oldest first, with a bar per release for the held-out reward
(the learning curve) and the probe accuracy (forgetting against the base), and transfer where asked
(``daemon/evaluation.py``). It opens on what is known (recorded at the gate, cached, reported: quick); ``m``
measures what is missing through the engine, its progress on the screen, as ``reef eval`` does."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Footer, Static

from daemon.evaluation import FIGURES, cell
from reef_cli.tui.format import short
from reef_cli.tui.screens import ReefScreen
from reef_cli.tui.widgets import ConnectionBar

BAR = 10  # cells of a full bar


def bar(fig: dict[str, Any] | None, lo: float, hi: float) -> Text:
    """A figure as a bar from ``lo`` to ``hi`` and its value; ``n/a`` or ``failed: reason`` as they are."""
    if not fig or fig.get("status") != "ok":
        return Text(cell(fig), style="red" if fig and fig.get("status") == "failed" else "dim")
    v = float(fig["value"])
    full = round(BAR * (v - lo) / (hi - lo)) if hi > lo else 0
    full = max(0, min(BAR, full))
    return Text.assemble(("█" * full, "green"), ("░" * (BAR - full), "dim"), f" {v:.2f}")


def span(rows: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """The bars' range for a column: [0, 1] unless a value lies outside (a user's scores in their own units)."""
    values = [float(r[key]["value"]) for r in rows if r[key].get("status") == "ok"]
    return min([0.0, *values]), max([1.0, *values])


class EvalScreen(ReefScreen):
    """``reef eval`` of one scenario: the learning curve, forgetting and transfer, a row per release."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("m", "measure", "Measure"),
        Binding("r", "refresh_data", "Refresh"),
        Binding("escape", "app.back", "Back"),
    ]
    RELOAD_ON = ("release",)

    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.scenario = scenario
        self.data: dict[str, Any] | None = None
        self.measured = 0  # measurements finished (tests wait on it)

    def compose(self) -> ComposeResult:
        yield Static(f"Evaluation of {self.scenario}: learning curve, forgetting, transfer", classes="title")
        table: DataTable[Any] = DataTable(cursor_type="row", zebra_stripes=True, id="eval")
        table.add_columns("", "step", "operation", "release", "held-out reward", "probes", "forgetting", "transfer")
        yield table
        yield Static("", id="how", classes="note")
        yield Static("", id="note", classes="note")
        yield ConnectionBar()
        yield Footer()

    async def load(self) -> None:
        self.fill(await self.reef.source.evaluation(self.scenario))

    def fill(self, data: dict[str, Any]) -> None:
        self.data = data
        rows = data["rows"]
        table = self.query_one(DataTable)
        table.clear()
        spans = {k: span(rows, k) for k in ("reward", "probes", "transfer")}
        for r in rows:
            mark = "*" if r.get("head") else ("b" if r["release_id"] == data["base"]["release_id"] else "")
            table.add_row(mark, str(r["step"]), r["operation"], short(r["release_id"]),
                          bar(r["reward"], *spans["reward"]), bar(r["probes"], *spans["probes"]),
                          Text(cell(r["forgetting"], signed=True),
                               style="red" if r["forgetting"].get("value", 0) < 0 else ""),
                          bar(r["transfer"], *spans["transfer"]) if data.get("transfer") else "-",
                          key=r["release_id"])
        missing = sum(r[k].get("reason") == "not measured yet (reef eval measures it)" for r in rows for k in FIGURES)
        lines = [f"held-out reward: {data['reward_how']}", f"probes: {data['probes_how']}; forgetting: probe "
                 f"accuracy minus the base's (step {data['base']['step']}); * the head, b the base"]
        if missing:
            lines.append(f"{missing} figure(s) not measured yet: m measures them")
        self.query_one("#how", Static).update("\n".join(lines))

    def action_measure(self) -> None:
        self.run_worker(self._measure, group="measure", exclusive=True, exit_on_error=False)  # type: ignore[arg-type]  # textual's WorkType: mypy infers Never

    async def _measure(self) -> None:
        from daemon.errors import ReefError

        note = self.query_one("#note", Static)

        async def progress(p: dict[str, Any]) -> None:
            note.update(f"measuring release {p['done'] + 1}/{p['total']} (step {p['step']}, "
                        f"{short(p['release_id'])}): {', '.join(p['measuring'])}")

        note.update("measuring...")
        try:
            data = await self.reef.source.evaluation(self.scenario, measure=True, progress=progress)
        except ReefError as e:
            self.show_error(e.message)
            return
        finally:
            self.measured += 1
        self.fill(data)
        note.update(f"{data['measured']} figure(s) measured, {data['cached']} from the cache, in "
                    f"{data['seconds']:.1f} s")
