"""Small widgets shared by the TUI's screens."""

from __future__ import annotations

from textual.widgets import Static


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
