"""Small widgets shared by the TUI's screens, and what they do to Textual's own (``fit_columns``)."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable, Static


class ConnectionBar(Static):
    """One line saying where the daemon is and whether the TUI is connected; follows ``ReefApp.connection``."""

    DEFAULT_CSS = """
    ConnectionBar { height: 1; padding: 0 1; background: $panel; color: $text-muted; }
    ConnectionBar.-down { background: $error; color: $text; }
    """

    def on_mount(self) -> None:
        self.watch(self.app, "connection", self._show, init=True)

    def _show(self, text: str) -> None:
        self.update(text)
        self.set_class(text.startswith("daemon unreachable"), "-down")


def fit_columns(table: DataTable[Any], grid: list[list[str]]) -> None:
    """Make each column of ``table`` as wide as its label and its widest cell in ``grid`` (the rows about to be
    added), here rather than leaving it to the table: DataTable measures new cells when it is next idle, and a table
    drawn before that pass shows every column at its label's width, an unlabelled one at none (a chain opened with
    ``reef tui -s NAME`` was seen so, issue 44: ids cut to 7 characters and no head marker)."""
    from rich.cells import cell_len

    for i, column in enumerate(table.ordered_columns):
        column.width = max([cell_len(column.label.plain), *(cell_len(row[i]) for row in grid)])
        column.auto_width = False
