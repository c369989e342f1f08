"""``overmind_lab.widget()``: real ipywidgets against a real daemon."""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from diffusers import UNet2DConditionModel

import overmind_lab
from overmind_lab import Client
from overmind_lab._common.display import entry_speedup, format_bytes, format_seconds
from overmind_lab._loading.widget import OvermindPanel
from tests import loaders


def wait_for(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the condition")
        time.sleep(0.05)


@pytest.fixture
def filled(daemon: Client, tiny_unet_dir: Path) -> Client:
    overmind_lab.load(UNet2DConditionModel.from_pretrained, tiny_unet_dir)
    overmind_lab.load(loaders.sized_load, 1 << 20, "one MiB")
    return daemon


@pytest.fixture
def panel(filled: Client) -> Iterator[OvermindPanel]:
    p = overmind_lab.widget(interval=None)
    yield p
    p.close()


def test_the_panel_shows_every_entry_and_the_memory(panel: OvermindPanel,
                                                     filled: Client) -> None:
    entries = filled.entries()
    status = filled.status()
    assert [e["key"] for e in panel.entries] == [e["key"] for e in entries]
    unet = next(e for e in entries if e["name"].startswith("UNet2DConditionModel"))
    row = panel.row(unet["key"])
    assert row.name.value == f'<span title="{unet["key"]}">{html.escape(unet["name"])}</span>'
    size = format_bytes(unet["bytes"])
    if unet.get("shared_bytes"):  # segments of other entries it references
        size += f" (+{format_bytes(unet['shared_bytes'])} shared)"
    if unet.get("held_bytes"):  # source files it holds (file tier): the user's own
        size += f" (+{format_bytes(unet['held_bytes'])} held)"
    assert row.cells[0].value == size
    assert row.cells[1].value == "0"  # hits
    assert row.cells[3].value == "-"  # no warm load yet
    # the header is the status line (display.status_line), as the magics show it
    assert panel.header.value.startswith(f"daemon pid {status['pid']} on ")
    assert (f"{format_bytes(status['cached_bytes'])} cached of "
            f"{format_bytes(status['budget_bytes'])} budget") in panel.header.value
    assert panel.usage.value == pytest.approx(status["cached_bytes"] / status["budget_bytes"])
    # header row + 8 cells per entry
    assert len(panel.grid.children) == 8 * (1 + len(entries))


def test_a_warm_load_shows_up_after_a_poll(panel: OvermindPanel, filled: Client,
                                            tiny_unet_dir: Path) -> None:
    overmind_lab.load(UNet2DConditionModel.from_pretrained, tiny_unet_dir)
    panel.poll()
    unet = next(e for e in filled.entries() if e["name"].startswith("UNet2DConditionModel"))
    row = panel.row(unet["key"])
    assert row.cells[1].value == "1"
    assert row.cells[3].value != "-" and row.cells[3].value.endswith("x)")
    # the median warm load and the speed-up over it, as the CLI and the sidebar show them
    assert row.cells[3].value == (f"{format_seconds(unet['warm_median_seconds'])} "
                                  f"({entry_speedup(unet)})")


def test_evict_and_evict_all_buttons(panel: OvermindPanel, filled: Client) -> None:
    first = panel.entries[0]
    panel.row(first["key"]).evict.click()
    assert first["key"] not in [e["key"] for e in filled.entries()]
    assert first["key"] not in [e["key"] for e in panel.entries]
    assert panel.message.value.endswith(f"evicted {html.escape(first['name'])}</span>")

    panel.evict_all_button.click()
    assert filled.entries() == []
    assert panel.entries == []
    assert "the cache is empty" in panel.grid.children[0].value
    assert "evicted 1 entries" in panel.message.value


def test_refresh_button_starts_a_background_refresh(panel: OvermindPanel,
                                                    filled: Client) -> None:
    entry = next(e for e in panel.entries if "sized_load(" in e["name"])
    panel.row(entry["key"]).reload.click()
    assert "in the background" in panel.message.value
    state = next(e for e in filled.entries() if e["key"] == entry["key"])["refresh"]["state"]
    assert state in ("running", "done")


def test_an_error_becomes_the_panel_message(panel: OvermindPanel, filled: Client) -> None:
    row = panel.row(panel.entries[0]["key"])
    filled.stop()
    row.evict.click()
    assert "failed: no overmind-lab daemon is listening" in panel.message.value
    assert panel.entries == []
    assert panel.header.value.startswith("no daemon is running")
    assert panel.evict_all_button.disabled


def test_the_panel_polls_until_closed(filled: Client) -> None:
    p = overmind_lab.widget(interval=0.1)
    try:
        assert p.polling
        count = len(p.entries)
        overmind_lab.load(loaders.sized_load, 4096, "added later")
        wait_for(lambda: len(p.entries) == count + 1)
    finally:
        p.close()
    assert not p.polling
    assert p.comm is None and p.grid.comm is None
