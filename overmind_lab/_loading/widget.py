"""``overmind_lab.widget()``: the cache as an ipywidgets panel.

For frontends without the JupyterLab sidebar (VS Code, Notebook 7, Colab-like hosts)::

    import overmind_lab
    overmind_lab.widget()

One row per entry (name, size, hits, cold vs warm, holders) with *Evict* and *Refresh*, memory
against the budget and the system, and *Evict all*; polls every ``interval`` s until closed.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

try:
    import ipywidgets as w
except ImportError:  # pragma: no cover - depends on the environment
    from overmind_lab._extras import require

    require("jupyter", "overmind_lab.widget()", ["ipywidgets"])  # names [jupyter]
    raise

from overmind_lab._common.display import (
    entry_speedup,
    format_ago,
    format_bytes,
    format_seconds,
    status_line,
)
from overmind_lab._common.messages import EntryJson, Status
from overmind_lab._errors import OvermindError, UnknownEntry

if TYPE_CHECKING:
    from overmind_lab._loading.client import Client

__all__ = ["OvermindPanel", "widget"]

_COLUMNS = ("name", "size", "hits", "cold", "warm", "holders", "state", "")
_GRID = "minmax(16em, 3fr) repeat(6, minmax(5em, 1fr)) 11em"


def widget(*, interval: float | None = 2.0, client: Client | None = None) -> OvermindPanel:
    """An ipywidgets panel that shows and manages the cache.

    ``interval``: seconds between polls of the daemon (``None``: only on demand, with the panel's
    *Reload* button or :meth:`OvermindPanel.poll`). ``client``: an :class:`overmind_lab.Client`
    (default: the user's daemon).

    >>> import overmind_lab
    >>> panel = overmind_lab.widget()        # doctest: +SKIP
    >>> panel                                # shows it as a notebook cell's output
    """
    return OvermindPanel(client=client, interval=interval)


class _Row:
    """The widgets of one entry; updated in place when the entry's numbers change."""

    def __init__(self, key: str, on_evict: Callable[[str], None],
                 on_refresh: Callable[[str], None]) -> None:
        self.key = key
        self.name = w.HTML()
        self.cells = [w.Label() for _ in range(6)]
        self.evict = w.Button(description="Evict", button_style="warning",
                              tooltip="drop this entry from the cache", icon="trash",
                              layout=w.Layout(width="5.2em"))
        self.reload = w.Button(description="Refresh", tooltip="load it from the source "
                               "again and replace the entry", icon="refresh",
                               layout=w.Layout(width="5.6em"))
        self.evict.on_click(lambda _b: on_evict(self.key))
        self.reload.on_click(lambda _b: on_refresh(self.key))
        self.buttons = w.HBox([self.evict, self.reload])
        self.entry: EntryJson | None = None

    @property
    def children(self) -> list[w.Widget]:
        return [self.name, *self.cells, self.buttons]

    def update(self, entry: EntryJson, now: float) -> None:
        self.entry = entry
        name = str(entry.get("name") or entry.get("key"))
        self.name.value = (
            f'<span title="{html.escape(str(entry.get("key")))}">{html.escape(name)}</span>'
        )
        speedup = entry_speedup(entry)
        holders = entry.get("holders") or []
        size = format_bytes(entry.get("bytes"))
        if entry.get("shared_bytes"):
            size += f" (+{format_bytes(entry['shared_bytes'])} shared)"
        if entry.get("held_bytes"):  # Note [What an entry costs]: the user's own files
            size += f" (+{format_bytes(entry['held_bytes'])} held)"
        refresh = entry.get("refresh") or {}
        state = {"running": "refreshing...", "failed": "refresh failed",
                 "done": "refreshed"}.get(str(refresh.get("state")), "")
        values = [
            size,
            str(entry.get("hits", 0)),
            format_seconds(entry.get("cold_seconds")),
            format_seconds(entry.get("warm_median_seconds"))
            + (f" ({speedup})" if speedup else ""),
            ", ".join(str(p) for p in holders) if holders else "-",
            state or f"used {format_ago(entry.get('last_used'), now)}",
        ]
        for cell, value in zip(self.cells, values, strict=True):
            if cell.value != value:
                cell.value = value
        self.cells[5].tooltip = str(refresh.get("message") or "")
        self.reload.disabled = refresh.get("state") == "running" or not entry.get(
            "replayable", True)

    def close(self) -> None:
        for child in (*self.children, self.evict, self.reload):
            child.close()


class OvermindPanel(w.VBox):  # type: ignore[misc]
    """The panel :func:`widget` returns: an ``ipywidgets.VBox`` that polls the daemon."""

    def __init__(self, *, client: Client | None = None, interval: float | None = 2.0) -> None:
        if client is None:
            from overmind_lab._loading.client import Client

            client = Client()
        self.client = client
        self.interval = interval
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._rows: dict[str, _Row] = {}
        self._order: list[str] = []
        self.header = w.HTML()
        self.usage = w.FloatProgress(min=0.0, max=1.0, value=0.0, bar_style="info",
                                     layout=w.Layout(width="100%"))
        self.grid = w.GridBox(layout=w.Layout(grid_template_columns=_GRID,
                                              grid_gap="2px 8px", align_items="center"))
        self.evict_all_button = w.Button(description="Evict all", button_style="danger",
                                         icon="trash", tooltip="empty the cache")
        self.reload_button = w.Button(description="Reload", icon="refresh",
                                      tooltip="ask the daemon again now")
        self.message = w.HTML()
        self.evict_all_button.on_click(lambda _b: self._act(self._evict_all))
        self.reload_button.on_click(lambda _b: self.poll())
        self._heads = [w.HTML(f"<b>{c}</b>") for c in _COLUMNS]
        super().__init__([
            self.header, self.usage, self.grid,
            w.HBox([self.evict_all_button, self.reload_button, self.message]),
        ])
        self._thread: threading.Thread | None = None
        self.poll()
        if interval:
            self._thread = threading.Thread(target=self._poll, name="overmind-lab-widget",
                                            daemon=True)
            self._thread.start()

    # -- data -----------------------------------------------------------------------------
    def poll(self) -> None:
        """Ask the daemon for its status and entries now and update the panel."""
        with self._lock:
            status: Status = self.client.status()
            entries: list[EntryJson] = []
            if status.get("running"):
                try:
                    entries = self.client.entries()
                except OvermindError as exc:
                    status = {**status, "running": False, "error": str(exc)}
            self._show_status(status)
            self._show_entries(entries)

    @property
    def entries(self) -> list[EntryJson]:
        """The entries as last shown (daemon JSON), in display order."""
        return [e for e in (self._rows[k].entry for k in self._order) if e is not None]

    def row(self, key: str) -> _Row:
        """The row of one entry (tests and scripts can press its buttons)."""
        return self._rows[key]

    def _show_status(self, status: Status) -> None:
        used = float(status.get("cached_bytes") or 0)
        budget = float(status.get("budget_bytes") or 0)
        line = html.escape(status_line(status))
        if self.header.value != line:
            self.header.value = line
        self.usage.value = min(1.0, used / budget) if budget else 0.0
        self.usage.bar_style = "warning" if budget and used / budget > 0.9 else "info"
        self.evict_all_button.disabled = not status.get("running")

    def _show_entries(self, entries: list[EntryJson]) -> None:
        now = time.time()
        order = [str(e["key"]) for e in entries]
        for key in set(self._rows) - set(order):
            self._rows.pop(key).close()
        for entry in entries:
            key = str(entry["key"])
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _Row(key, self._on_evict, self._on_refresh)
            row.update(entry, now)
        if order != self._order or not self.grid.children:
            self._order = order
            cells: list[w.Widget] = list(self._heads) if order else [
                w.HTML("<i>the cache is empty</i>")]
            for key in order:
                cells.extend(self._rows[key].children)
            self.grid.children = tuple(cells)

    # -- actions --------------------------------------------------------------------------
    def _on_evict(self, key: str) -> None:
        row = self._rows.get(key)
        name = row.entry["name"] if row is not None and row.entry is not None else key

        def run() -> None:
            self.client.evict(key)
            self._say(f"evicted {name}")

        self._act(run)

    def _on_refresh(self, key: str) -> None:
        def run() -> None:
            entry = self.client.refresh(key)
            self._say(f"refreshing {entry.get('name', key)} in the background")

        self._act(run)

    def _evict_all(self) -> None:
        self._say(f"evicted {len(self.client.evict_all())} entries")

    def _act(self, action: Callable[[], None]) -> None:
        """Run a button's action: errors become the panel's message, not a lost traceback in the
        browser console."""
        try:
            action()
        except UnknownEntry as exc:
            self._say(f"already gone: {exc}")
        except OvermindError as exc:
            self._say(f"failed: {exc}", error=True)
        self.poll()

    def _say(self, text: str, *, error: bool = False) -> None:
        color = "var(--jp-error-color1, #d32f2f)" if error else "inherit"
        self.message.value = f'<span style="color:{color}">{html.escape(text)}</span>'

    # -- lifetime -------------------------------------------------------------------------
    def _poll(self) -> None:
        assert self.interval
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - keep polling; show what went wrong
                self._say(f"could not reach the daemon: {exc}", error=True)

    @property
    def polling(self) -> bool:
        """Whether the background refresh is running."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop polling and close every widget of the panel."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        with self._lock:
            for row in self._rows.values():
                row.close()
            self._rows.clear()
            for child in (*self._heads, self.header, self.usage, self.grid,
                          self.evict_all_button, self.reload_button, self.message):
                child.close()
        super().close()
