"""The TUI's screens: scenarios, release chain, release detail, training, records feed, one exchange, and the
confirmation of a rollback or promotion.

Each screen loads what it shows in a worker (``refresh_data``), reacts to daemon events that concern it
(``daemon_event``, throttled), and reloads when it comes back to the top. Errors from the daemon become a
notification and a line on the screen, never a crash."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Footer, Static

from daemon.errors import Conflict, ReefError
from reef_cli.tui.format import (
    age,
    canary_line,
    conversation,
    duration,
    key_metrics,
    number,
    one_line,
    recipe_summary,
    score,
    short,
    spent,
    verdict,
)
from reef_cli.tui.widgets import ConnectionBar, fit_columns


class ReefScreen(Screen[None]):
    """A screen that loads its data in a worker and reloads when events concern it."""

    scenario: str | None = None
    RELOAD_ON: ClassVar[tuple[str, ...]] = ()
    THROTTLE_S: ClassVar[float] = 0.5

    def __init__(self) -> None:
        super().__init__()
        self._reload_pending = False
        self.loaded = 0  # how many loads finished (tests wait on it)

    @property
    def reef(self) -> Any:
        return self.app

    def on_mount(self) -> None:
        self.refresh_data()

    def on_screen_resume(self) -> None:
        if self.loaded:
            self.refresh_data()

    def refresh_data(self) -> None:
        # a callable, not a coroutine: a load cancelled by the next one before it started is never created
        self.run_worker(self._guarded_load, group="load", exclusive=True, exit_on_error=False)  # type: ignore[arg-type]  # textual's WorkType: mypy infers Never

    async def _guarded_load(self) -> None:
        try:
            await self.load()
        except ReefError as e:
            self.show_error(e.message)
        finally:
            self.loaded += 1

    async def load(self) -> None:
        raise NotImplementedError

    def show_error(self, message: str) -> None:
        for note in self.query("#note").results(Static):
            note.update(Text(message, style="red"))

    def daemon_event(self, ev: dict[str, Any]) -> None:
        if ev.get("kind") in self.RELOAD_ON and (self.scenario is None or ev.get("scenario") in (None, self.scenario)):
            self.reload_soon()

    def open_page(self, release_id: str) -> None:
        """Write the release's page and hand it to the browser, as ``reef releases open`` does; where no browser can
        be started, say where the page is (its file URL)."""
        self.run_worker(functools.partial(self._open_page, release_id), group="page", exit_on_error=False)  # type: ignore[arg-type]  # textual's WorkType: mypy infers Never

    async def _open_page(self, release_id: str) -> None:
        from reef_cli.releases import save_page

        src = self.reef.source
        try:
            full, html = await src.page(release_id)
            path = await asyncio.to_thread(save_page, src.pages_dir() / f"{full}.html", html)
        except ReefError as e:
            self.reef.say(f"no page for {short(release_id)}: {e.message}", severity="error")
            return
        except OSError as e:
            self.reef.say(f"cannot write the page of {short(release_id)}: {e.strerror or e}", severity="error")
            return
        if await self.reef.show_page(path):
            self.reef.say(f"opened the page of {short(full)} in the browser ({path})")
        else:
            self.reef.say(f"no browser could be started; the page of {short(full)} is at {path.as_uri()}",
                          severity="warning")

    def reload_soon(self) -> None:
        if not self._reload_pending:
            self._reload_pending = True

            def go() -> None:
                self._reload_pending = False
                self.refresh_data()

            self.set_timer(self.THROTTLE_S, go)


# --- scenarios -------------------------------------------------------------------------------------------


class ScenariosScreen(ReefScreen):
    """Every scenario: recipe, head step, records, reports, mean recent score, training state, learning spend."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Chain", priority=True),
        Binding("r", "refresh_data", "Refresh"),
    ]
    RELOAD_ON = ("scenario", "release", "report", "record", "train.start", "train.step", "gate", "warning")
    THROTTLE_S = 1.0

    def compose(self) -> ComposeResult:
        yield Static("Scenarios", classes="title")
        table: DataTable[Any] = DataTable(cursor_type="row", zebra_stripes=True, id="scenarios")
        table.add_columns("scenario", "recipe", "model", "head step", "records", "reports", "mean score", "training", "spend")
        yield table
        yield Static("", id="note", classes="note")
        yield ConnectionBar()
        yield Footer()

    async def load(self) -> None:
        src = self.reef.source
        scenarios, status = await asyncio.gather(src.scenarios(), src.status())
        heads = await asyncio.gather(*(src.releases(s["name"], limit=1) for s in scenarios), return_exceptions=True)
        learning, spend = status.get("learning") or {}, status.get("spend") or {}
        table = self.query_one(DataTable)
        keep = table.cursor_row
        table.clear()
        for s, chain in zip(scenarios, heads, strict=True):
            step = "-"
            if isinstance(chain, dict) and chain.get("releases"):
                step = str(chain["releases"][0]["step"])
            state = self.reef.training.state.get(s["name"]) or learning.get(s["name"]) or "idle"
            if s.get("warning"):  # the early warning stands: learning waits for the user (the note says why)
                state = "WARNING"
            table.add_row(s["name"], s.get("recipe", "-"), s.get("model", "-"), step, str(s.get("records", 0)),
                          str(s.get("reports", 0)), score(s.get("mean_score")), state, spent(spend.get(s["name"])),
                          key=s["name"])
        if scenarios:
            table.move_cursor(row=min(keep, len(scenarios) - 1))
        note = f"{len(scenarios)} scenarios; enter opens a release chain" if scenarios else "no scenarios yet"
        warned = [f"warning on {s['name']}: {s['warning'].get('reason')}" for s in scenarios if s.get("warning")]
        self.query_one("#note", Static).update("\n".join([*warned, note]))

    def action_open(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            self.app.push_screen(ChainScreen(str(key)))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.push_screen(ChainScreen(str(event.row_key.value)))


# --- a release chain -------------------------------------------------------------------------------------


class ChainScreen(ReefScreen):
    """One scenario's release chain, newest first, head marked; rejected candidates on demand."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Detail", priority=True),
        Binding("b", "rollback", "Roll back"),
        Binding("p", "promote", "Promote"),
        Binding("c", "canary", "Canary"),
        Binding("e", "end_canary", "End canary"),
        Binding("a", "toggle_all", "Candidates"),
        Binding("o", "page", "Page"),
        Binding("r", "refresh_data", "Refresh"),
        Binding("escape", "app.back", "Back"),
        Binding("v", "app.evaluate", "Eval", show=False),  # reef eval (reef_cli/tui/evaluation.py); docs/tui.md
    ]
    RELOAD_ON = ("release", "release.pending", "gate", "canary.start", "canary.end")
    CANARY_SHARE = 0.2  # what c serves a candidate to (reef releases canary --share for another)

    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.scenario = scenario
        self.show_all = False
        self.head: str | None = None
        self.rows: dict[str, dict[str, Any]] = {}
        self.canary: dict[str, Any] | None = None  # the running canary (daemon/canary.py), with its figures
        self.canary_history: list[tuple[float | None, float | None]] = []  # both arms' means, load by load

    def compose(self) -> ComposeResult:
        yield Static(f"Release chain of {self.scenario}", classes="title", id="title")
        table: DataTable[Any] = DataTable(cursor_type="row", zebra_stripes=True, id="chain")
        table.add_columns("", "step", "operation", "release", "content", "age", "gate", "metrics", "note")
        yield table
        yield Static("", id="canary", classes="note")
        yield Static("", id="note", classes="note")
        yield ConnectionBar()
        yield Footer()

    def daemon_event(self, ev: dict[str, Any]) -> None:
        super().daemon_event(ev)
        if ev.get("kind") == "report" and self.canary is not None and ev.get("scenario") == self.scenario:
            self.reload_soon()  # a report moves the running canary's figures

    async def load(self) -> None:
        data = await self.reef.source.releases(self.scenario, all_=self.show_all)
        self.fill(data)

    def fill(self, data: dict[str, Any]) -> None:
        now = self.reef.clock()
        self.head = data.get("head")
        table = self.query_one(DataTable)
        selected = self.selected_key()
        table.clear()
        self.rows = {}
        rows: list[tuple[str, dict[str, Any], str]] = []
        for r in data.get("pending", []):
            rows.append((r["release_id"], {**r, "operation": "pending"}, "?"))
        for r in data.get("releases", []):
            rows.append((r["release_id"], r, "▶" if r["release_id"] == self.head else ""))
        for r in data.get("rejected", []):
            rows.append((f"rejected:{r['rejection_id']}", {**r, "operation": "rejected"}, "✗"))
        rows.sort(key=lambda x: (-(x[1].get("step") or 0), x[1]["operation"] == "rejected"))
        grid: list[tuple[str, list[str], str]] = []
        for key, r, mark in rows:
            self.rows[key] = r
            note = ""
            if r.get("source"):
                restored = next((x for x in data.get("releases", []) if x["release_id"] == r["source"]), None)
                note = f"restores {short(r['source'], 8)}" + (f" (step {restored['step']})" if restored else "")
            elif r["operation"] == "rejected":
                note = one_line(r.get("reason"), 48)
            elif self.canary is not None and r["release_id"] == self.canary["release_id"]:
                note = "canary: p promotes, e ends"
            elif r["operation"] == "pending" and (r.get("metrics") or {}).get("watchdog"):
                note = one_line(r["metrics"]["watchdog"], 48)  # held by the reward-hacking watchdog: why
            elif r["operation"] == "pending":
                note = "p promotes, c serves as a canary"
            style = "bold" if mark == "▶" else "dim" if r["operation"] == "rejected" else ""
            cells = [mark, str(r.get("step", "-")), r["operation"], short(r.get("release_id"), 8),
                     short(r.get("content_id"), 8), age(r.get("created_at"), now), verdict(r),
                     key_metrics(r.get("metrics"), 2), note]
            grid.append((key, cells, style))
        fit_columns(table, [cells for _, cells, _ in grid])
        for key, cells, style in grid:
            table.add_row(*(Text(c, style=style) for c in cells), key=key)
        keys = list(self.rows)
        if keys:
            table.move_cursor(row=keys.index(selected) if selected in keys else 0)
        canary = data.get("canary")
        if canary is None or (self.canary or {}).get("release_id") != canary.get("release_id"):
            self.canary_history = []
        self.canary = canary
        if canary is not None:
            f = canary.get("figures") or {}
            point = (f.get("canary_mean"), f.get("head_mean"))
            if not self.canary_history or self.canary_history[-1] != point:
                self.canary_history.append(point)
        self.query_one("#canary", Static).update(canary_line(canary, self.canary_history) if canary else "")
        hidden = "" if self.show_all else "; a shows rejected and pending candidates"
        self.query_one("#note", Static).update(
            f"head {short(self.head)}: {len(data.get('releases', []))} releases{hidden}"
        )
        if self.loaded == 0:
            self.call_after_refresh(self.reef.chain_painted)

    def selected_key(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    def selected(self) -> dict[str, Any] | None:
        key = self.selected_key()
        return self.rows.get(key) if key else None

    def select(self, release_id: str) -> None:
        """Put the cursor on a release (by id or id prefix)."""
        for i, key in enumerate(self.rows):
            if key.startswith(release_id):
                self.query_one(DataTable).move_cursor(row=i)
                return
        raise KeyError(release_id)

    def action_open(self) -> None:
        row = self.selected()
        if row is None:
            return
        if row["operation"] == "rejected":
            self.app.push_screen(RejectionScreen(row))
        else:
            self.app.push_screen(ReleaseScreen(row["release_id"]))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_page(self) -> None:
        row = self.selected()
        if row is None:
            return
        if row["operation"] == "rejected":
            self.reef.say("a rejected candidate has no release page (enter shows why it was rejected)",
                          severity="warning")
            return
        self.open_page(row["release_id"])

    def action_toggle_all(self) -> None:
        self.show_all = not self.show_all
        self.refresh_data()

    def action_rollback(self) -> None:
        self._steer("rollback")

    def action_promote(self) -> None:
        self._steer("promote")

    def action_canary(self) -> None:
        row = self.selected()
        if row is None:
            return
        if self.canary is not None:
            self.reef.say(f"a canary of {short(self.canary['release_id'])} runs already: e ends it", severity="warning")
            return
        if row["operation"] != "pending":
            self.reef.say("only a pending candidate can serve as a canary (a shows pending candidates)",
                          severity="warning")
            return
        lines = [f"Serve {short(row['release_id'])} as a canary of scenario {self.scenario}",
                 f"to {self.CANARY_SHARE:.0%} of new runs beside the head {short(self.head)};",
                 "live scores promote it or end it at the stated error rate"]

        def done(ok: bool | None) -> None:
            if ok:
                start = functools.partial(self._do_canary, row["release_id"])
                self.run_worker(start, group="steer", exit_on_error=False)  # type: ignore[arg-type]  # textual's WorkType: mypy infers Never
            else:
                self.reef.say("canary cancelled; nothing changed")

        self.app.push_screen(ConfirmScreen(lines, "Start"), done)

    async def _do_canary(self, release_id: str) -> None:
        try:
            row = await self.reef.source.canary(self.scenario, release_id, self.CANARY_SHARE)
        except ReefError as e:
            self.reef.say(f"canary failed: {e.message}", severity="error")
        else:
            self.reef.say(f"canary {short(row['release_id'])} serves {row['share']:.0%} of new runs")
        self.refresh_data()

    def action_end_canary(self) -> None:
        self._end_canary(promote=False)

    def _end_canary(self, *, promote: bool) -> None:
        if self.canary is None:
            self.reef.say("no canary runs in this scenario (c starts one from a pending candidate)",
                          severity="warning")
            return
        f = self.canary.get("figures") or {}
        lines = [f"{'Promote' if promote else 'End'} the canary {short(self.canary['release_id'])} of {self.scenario}",
                 canary_line(self.canary, []),
                 "published as the new head, its figures on the chain" if promote
                 else f"discarded: the head {short(self.head)} stays; its figures go on the chain",
                 f"({f.get('canary_reports', 0)} and {f.get('head_reports', 0)} reports so far)"]

        def done(ok: bool | None) -> None:
            if ok:
                end = functools.partial(self._do_end_canary, promote)
                self.run_worker(end, group="steer", exit_on_error=False)  # type: ignore[arg-type]  # textual's WorkType: mypy infers Never
            else:
                self.reef.say("nothing changed; the canary runs on")

        self.app.push_screen(ConfirmScreen(lines, "Promote" if promote else "End"), done)

    async def _do_end_canary(self, promote: bool) -> None:
        try:
            out = await self.reef.source.canary_end(self.scenario, promote=promote)
        except ReefError as e:
            self.reef.say(f"ending the canary failed: {e.message}", severity="error")
        else:
            self.reef.say(f"canary {out['verdict']}" + (f": published {short(out['release_id'])}"
                                                         if out.get("release_id") else "; the head stays"))
        self.refresh_data()

    def _steer(self, op: str) -> None:
        row = self.selected()
        if row is None:
            return
        if op == "promote" and self.canary is not None and row.get("release_id") == self.canary["release_id"]:
            self._end_canary(promote=True)  # a canary is promoted with its figures on the chain
            return
        if row["operation"] == "rejected":
            self.reef.say("a rejected candidate was never published; there is nothing to restore", severity="warning")
            return
        if op == "promote" and row["operation"] != "pending":
            self.reef.say("only a pending release can be promoted (a shows pending candidates)", severity="warning")
            return
        if op == "rollback" and row["operation"] == "pending":
            self.reef.say("this release is pending: promote it with p", severity="warning")
            return
        if op == "rollback" and row["release_id"] == self.head:
            self.reef.say("that release is the head already", severity="warning")
            return
        expected = self.head  # compare-and-swap against the head this screen showed
        current = self.rows.get(expected or "")
        lines = [
            f"{'Roll back' if op == 'rollback' else 'Promote'} scenario {self.scenario}",
            f"from  head {short(expected)}  step {current['step'] if current else '-'}  "
            f"content {short(current['content_id'] if current else None)}",
            f"to    {short(row['release_id'])}  step {row['step']}  content {short(row['content_id'])}",
            "published as a new release; history is kept",
        ]
        if current and current.get("content_id") == row.get("content_id"):
            lines.append("(the content is the same as the head's)")

        def done(ok: bool | None) -> None:
            if ok:
                steer = functools.partial(self._do_steer, op, row["release_id"], expected)
                self.run_worker(steer, group="steer", exit_on_error=False)  # type: ignore[arg-type]  # textual's WorkType: mypy infers Never
            else:
                self.reef.say(f"{op} of {self.scenario} to {short(row['release_id'])} cancelled; nothing changed")

        self.app.push_screen(ConfirmScreen(lines, "Roll back" if op == "rollback" else "Promote"), done)

    async def _do_steer(self, op: str, release_id: str, expected: str | None) -> None:
        try:
            rel = await self.reef.source.steer(op, self.scenario, release_id, expected)
        except Conflict as e:
            if "actual_head" in e.data:
                self.reef.say(f"the head of {self.scenario} moved meanwhile (now {short(e.data['actual_head'])}); "
                              "nothing changed; the chain is refreshed", severity="error")
            else:
                self.reef.say(e.message, severity="error")
        except ReefError as e:
            self.reef.say(f"{op} failed: {e.message}", severity="error")
        else:
            self.reef.say(f"published {short(rel['release_id'])} (step {rel['step']}, {rel['operation']}); "
                          "it serves new requests now")
        self.refresh_data()


class ConfirmScreen(ModalScreen[bool]):
    """Asks before a rollback or promotion, showing from and to."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 72; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    ConfirmScreen Horizontal { height: auto; margin-top: 1; }
    ConfirmScreen Button { margin-right: 2; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, lines: list[str], verb: str) -> None:
        super().__init__()
        self.lines = lines
        self.verb = verb

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text("\n".join(self.lines)), id="question")
            with Horizontal():
                yield Button(f"{self.verb} (y)", variant="warning", id="yes")
                yield Button("Cancel (n)", id="no")

    def action_answer(self, ok: bool) -> None:
        self.dismiss(ok)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


# --- a release -------------------------------------------------------------------------------------------


class ReleaseScreen(ReefScreen):
    """One release: manifest, metrics, the receipts that fed it, and its diff to the parent."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("o", "page", "Page"),
        Binding("r", "refresh_data", "Refresh"),
        Binding("escape", "app.back", "Back"),
    ]

    def __init__(self, release_id: str) -> None:
        super().__init__()
        self.release_id = release_id

    def action_page(self) -> None:
        self.open_page(self.release_id)

    def compose(self) -> ComposeResult:
        yield Static(f"Release {short(self.release_id)}", classes="title", id="title")
        with VerticalScroll(id="body"):
            yield Static("loading…", id="summary")
            yield Static("", id="diff")
        yield Static("", id="note", classes="note")
        yield ConnectionBar()
        yield Footer()

    async def load(self) -> None:
        rel = await self.reef.source.release(self.release_id)
        self.scenario = rel.get("scenario")
        now = self.reef.clock()
        head = " (head)" if rel.get("head") == rel["release_id"] else ""
        self.query_one("#title", Static).update(
            f"Release {short(rel['release_id'])} of {rel['scenario']}: step {rel['step']} {rel['operation']}{head}"
        )
        info = Table.grid(padding=(0, 2))
        info.add_column(style="bold")
        info.add_column()
        info.add_row("release", rel["release_id"])
        info.add_row("content", str(rel.get("content_id")))
        info.add_row("parent", str(rel.get("parent") or "- (first release)"))
        if rel.get("source"):
            info.add_row("restores", rel["source"])
        info.add_row("kind", f"{rel.get('kind')}  recipe {rel.get('recipe')}  age {age(rel.get('created_at'), now)}")
        for k, v in sorted((rel.get("metrics") or {}).items()):
            info.add_row(f"  {k}", number(v))
        if rel.get("settings"):
            info.add_row("settings", one_line(rel["settings"], 200))
        fed = rel.get("receipts") or []  # a harness release lists the reports it learned from, a weights one exchanges
        reports, receipts = [i for i in fed if i.startswith("rep_")], [i for i in fed if not i.startswith("rep_")]
        for label, ids in (("reports", reports), ("receipts", receipts)):
            if ids or label == "receipts" and not reports:
                info.add_row(label, f"{len(ids)}" + ("" if not ids else ": " + ", ".join(ids[:12])
                                                     + (" …" if len(ids) > 12 else "")))
        if rel.get("message"):
            info.add_row("message", rel["message"].strip().splitlines()[0])
        self.query_one("#summary", Static).update(info)
        self.query_one("#diff", Static).update(render_diff(rel.get("diff") or {}))


def render_diff(diff: dict[str, Any]) -> Any:
    """The diff to the parent: a unified diff for text files, per-tensor changes for weights."""
    from rich.console import Group
    from rich.syntax import Syntax

    base = diff.get("base")
    parts: list[Any] = [Text(f"\ndiff to {short(base)}" if base else "\ndiff (first release: everything is new)",
                             style="bold underline")]
    files = diff.get("files", [])
    if not files:
        parts.append(Text("no file changed (same content)"))
    for f in files:
        sign = {"added": ("+", "green"), "removed": ("-", "red")}.get(f["status"], ("~", "yellow"))
        parts.append(Text(f"{sign[0]} {f['path']} ({f['kind']}, {f['status']})", style=sign[1]))
        if f["kind"] == "safetensors":
            t = Table(box=None, padding=(0, 2), show_edge=False)
            for col in ("tensor", "status", "shape", "|Δ|", "|w|"):
                t.add_column(col)
            for ten in f.get("tensors", []):
                if ten.get("status") == "unchanged":
                    continue
                t.add_row(ten["name"], ten.get("status", "changed"), "×".join(map(str, ten.get("shape") or [])),
                          number(ten.get("diff_norm") or 0), number(ten.get("old_norm") or 0))
            parts.append(t)
            if f.get("unchanged_tensors"):
                parts.append(Text(f"  {f['unchanged_tensors']} tensors unchanged", style="dim"))
        elif f.get("diff"):
            parts.append(Syntax(f["diff"], "diff", theme="ansi_dark", background_color="default"))
        elif f.get("old_size") is not None or f.get("new_size") is not None:
            parts.append(Text(f"  {f.get('old_size', '-')} → {f.get('new_size', '-')} bytes", style="dim"))
    return Group(*parts)


class RejectionScreen(Screen[None]):
    """A rejected candidate: the gate's reason and metrics (it was never published)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.back", "Back")]

    def __init__(self, rejection: dict[str, Any]) -> None:
        super().__init__()
        self.rejection = rejection

    def compose(self) -> ComposeResult:
        r = self.rejection
        yield Static(f"Rejected candidate at step {r.get('step')} of {r.get('scenario')}", classes="title")
        with VerticalScroll():
            t = Table.grid(padding=(0, 2))
            t.add_column(style="bold")
            t.add_column()
            t.add_row("verdict", str(r.get("verdict")))
            t.add_row("reason", str(r.get("reason")))
            t.add_row("base", str(r.get("base")))
            for k, v in sorted((r.get("metrics") or {}).items()):
                t.add_row(f"  {k}", number(v))
            t.add_row("receipts", str(len(r.get("receipts") or [])))
            yield Static(t)
        yield ConnectionBar()
        yield Footer()


# --- training --------------------------------------------------------------------------------------------


class TrainingScreen(ReefScreen):
    """Training as it happens: reported scores and training reward over time, steps, gate verdicts, state."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.back", "Back")]
    WINDOW = 16  # reports in the moving mean

    def __init__(self, scenario: str | None = None) -> None:
        super().__init__()
        self.scenario = scenario

    def compose(self) -> ComposeResult:
        from textual_plotext import PlotextPlot

        what = f"of {self.scenario}" if self.scenario else "(all scenarios)"
        yield Static(f"Training {what}", classes="title")
        yield Static("", id="state", classes="note")
        yield PlotextPlot(id="plot")
        log: DataTable[Any] = DataTable(id="log", cursor_type="row")
        log.add_columns("t", "scenario", "event", "step", "detail")
        yield log
        yield Static("", id="note", classes="note")
        yield ConnectionBar()
        yield Footer()

    DEFAULT_CSS = """
    TrainingScreen #plot { height: 2fr; min-height: 10; }
    TrainingScreen #log { height: 1fr; }
    """

    async def load(self) -> None:
        status = await self.reef.source.status()
        learning = status.get("learning") or {}
        self.draw(learning)

    def daemon_event(self, ev: dict[str, Any]) -> None:
        if self.scenario is None or ev.get("scenario") == self.scenario:
            self.draw(None)

    def draw(self, learning: dict[str, Any] | None) -> None:
        from textual_plotext import PlotextPlot

        tr = self.reef.training
        mine = (lambda s: True) if self.scenario is None else (lambda s: s == self.scenario)
        t0 = tr.first_time or 0.0
        scores = [(t - t0, s) for t, s, scen in tr.scores if mine(scen)]
        steps = [e for e in tr.steps if mine(e.get("scenario"))]
        plot = self.query_one(PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title("reward over time")
        plt.xlabel("seconds")
        if scores:
            xs = [x for x, _ in scores]
            ys = [y for _, y in scores]
            mean = [sum(ys[max(0, i - self.WINDOW + 1): i + 1]) / len(ys[max(0, i - self.WINDOW + 1): i + 1])
                    for i in range(len(ys))]
            plt.scatter(xs, ys, label="reported score", marker="dot")
            plt.plot(xs, mean, label=f"mean of last {self.WINDOW}")
        batch = [(float(e["time"]) - t0, (e.get("metrics") or {}).get("batch_reward")) for e in steps]
        batch = [(x, y) for x, y in batch if isinstance(y, (int, float))]
        if batch:
            plt.plot([x for x, _ in batch], [y for _, y in batch], label="training batch reward", marker="hd")
        plot.refresh()
        table = self.query_one("#log", DataTable)
        table.clear()
        for ev in reversed([e for e in tr.log if mine(e.get("scenario"))]):
            kind = ev["kind"]
            detail = ""
            if kind == "train.start":
                detail = f"{ev.get('samples')} samples from {short(ev.get('base'))}"
            elif kind == "train.step":
                detail = f"{key_metrics(ev.get('metrics'), 3)}  {duration(ev.get('seconds'))}"
            elif kind == "gate":
                detail = f"{str(ev.get('verdict')).upper()}: {one_line(ev.get('reason'), 50)}"
            elif kind in ("release", "release.pending"):
                detail = f"{ev.get('operation', 'pending')} {short(ev.get('release_id'))}"
            table.add_row(f"+{float(ev['time']) - t0:.0f}s", str(ev.get("scenario")), kind,
                          str(ev.get("step", "")), detail)
        states = dict(learning or {})
        states.update(tr.state)
        shown = {k: v for k, v in sorted(states.items()) if mine(k)}
        trainer = ", ".join(f"{k}: {v}" for k, v in shown.items()) or "no trainer activity yet"
        summary = recipe_summary(steps)
        self.query_one("#state", Static).update(
            f"trainer {trainer}   steps {len(steps)}   reports {len(scores)}"
            + (f"   last score {number(scores[-1][1])}" if scores else "")
            + (f"   {summary}" if summary else "")
        )


# --- records ---------------------------------------------------------------------------------------------


class RecordsScreen(ReefScreen):
    """The newest receipts, live: run, scenario, release, latency, score and feedback."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Exchange", priority=True),
        Binding("r", "refresh_data", "Refresh"),
        Binding("escape", "app.back", "Back"),
    ]
    RELOAD_ON = ("record", "report")

    def __init__(self, scenario: str | None = None) -> None:
        super().__init__()
        self.scenario = scenario

    def compose(self) -> ComposeResult:
        yield Static("Records" + (f" of {self.scenario}" if self.scenario else ""), classes="title")
        table: DataTable[Any] = DataTable(cursor_type="row", zebra_stripes=True, id="records")
        table.add_columns("receipt", "age", "scenario", "run", "release", "ms", "score", "feedback")
        yield table
        yield Static("", id="note", classes="note")
        yield ConnectionBar()
        yield Footer()

    async def load(self) -> None:
        recs = await self.reef.source.records(limit=100, scenario=self.scenario)
        now = self.reef.clock()
        table = self.query_one(DataTable)
        keep = table.cursor_row
        table.clear()
        for r in recs:
            timings = r.get("timings") or {}
            table.add_row(r["id"], age(r.get("created_at"), now), r.get("scenario", "-"), r.get("run") or "-",
                          short(r.get("release_id")), number(round(timings.get("total_ms") or 0)),
                          score(r.get("score")), one_line(r.get("feedback"), 40), key=r["id"])
        if recs:
            table.move_cursor(row=min(keep, len(recs) - 1))
        self.query_one("#note", Static).update(f"{len(recs)} newest records; enter shows the exchange")

    def action_open(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            self.app.push_screen(RecordScreen(str(key)))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.push_screen(RecordScreen(str(event.row_key.value)))


class RecordScreen(ReefScreen):
    """One exchange: who said what, the release that served it, timings and its reports."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.back", "Back")]

    def __init__(self, receipt: str) -> None:
        super().__init__()
        self.receipt = receipt

    def compose(self) -> ComposeResult:
        yield Static(f"Exchange {self.receipt}", classes="title")
        with VerticalScroll():
            yield Static("loading…", id="exchange")
        yield Static("", id="note", classes="note")
        yield ConnectionBar()
        yield Footer()

    async def load(self) -> None:
        from rich.console import Group

        rec = await self.reef.source.record(self.receipt)
        now = self.reef.clock()
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        head.add_row("scenario", f"{rec.get('scenario')}  run {rec.get('run') or '-'}  {age(rec.get('created_at'), now)}")
        head.add_row("release", f"{rec.get('release_id') or '-'}  load {rec.get('runtime_load_id') or '-'}")
        head.add_row("model", f"{rec.get('model')} ({rec.get('engine')}, {rec.get('format')})  status {rec.get('status')}")
        if rec.get("timings"):
            head.add_row("timings", "  ".join(f"{k.removesuffix('_ms')} {duration(v / 1e3)}"
                                              for k, v in rec["timings"].items() if isinstance(v, (int, float))))
        if rec.get("usage"):
            head.add_row("usage", json.dumps(rec["usage"]))
        parts: list[Any] = [head, Text("")]
        for role, text in conversation(rec.get("request"), rec.get("response")):
            parts.append(Text(role, style="bold cyan" if role != "assistant" else "bold green"))
            parts.append(Text(text[:20000] + ("…" if len(text) > 20000 else "")))
        reports = rec.get("reports") or []
        parts.append(Text(f"\nreports ({len(reports)})", style="bold"))
        for rep in reports:
            r = rep.get("report") or {}
            parts.append(Text(f"{rep['id']}  score {score(r.get('score'))}  {one_line(r.get('feedback'), 80)}"))
        self.query_one("#exchange", Static).update(Group(*parts))
