"""How entries and the status read for people (``_common.display``): plain functions over
the daemon's JSON, the same for the CLI, the magics and the widget."""

from __future__ import annotations

from overmind_lab._common.display import (
    ENTRY_HEADERS,
    describe_load,
    entry_row,
    entry_speedup,
    format_speedup,
    status_line,
)
from overmind_lab._common.messages import EntryJson, Status


def listed(**fields: object) -> EntryJson:
    entry: EntryJson = {
        "key": "a1b2c3", "name": "UNet2DConditionModel.from_pretrained('/m/unet')",
        "class": "diffusers.UNet2DConditionModel", "callable": "diffusers.U.from_pretrained",
        "source": "/m/unet", "bytes": 3 * 1024 ** 2, "shared_bytes": 0, "tensors": 10,
        "created": 1.0, "last_used": 100.0, "hits": 3, "verified": 0, "cold_seconds": 4.0,
        "store_seconds": 1.0, "warm_seconds": [0.05, 0.04, 2.0],
        "warm_median_seconds": 0.05, "holders": [], "replayable": True,
        "refresh": {"state": "idle", "message": "", "started": None},
        "resident_bytes": 0, "tier": ["file"],
    }
    entry.update(fields)  # type: ignore[typeddict-item]
    return entry


def test_the_speed_up_is_cold_over_the_median_warm_load_not_the_last() -> None:
    entry = listed()
    assert entry_speedup(entry) == "80x"  # 4.0 / 0.05; the last warm load (2.0) would be 2.0x
    row = dict(zip(ENTRY_HEADERS, entry_row(entry, now=160.0), strict=True))
    assert row["warm"] == "0.05 s" and row["speedup"] == "80x" and row["cold"] == "4.00 s"
    assert row["last used"] == "1 min ago"


def test_no_speed_up_before_the_first_warm_load() -> None:
    entry = listed(warm_seconds=[], warm_median_seconds=None)
    assert entry_speedup(entry) == ""
    row = dict(zip(ENTRY_HEADERS, entry_row(entry), strict=True))
    assert row["warm"] == "-" and row["speedup"] == "-"


def test_speed_ups_are_rounded_for_reading() -> None:
    assert format_speedup(4.0, 0.05) == "80x"
    assert format_speedup(3.0, 1.0) == "3.0x"
    assert format_speedup(None, 1.0) == format_speedup(1.0, 0.0) == ""


def test_a_warm_load_slower_than_the_cold_one_is_not_shown_as_zero() -> None:
    assert format_speedup(1.0, 4.0) == "0.25x"
    assert format_speedup(0.1, 3.0) == "0.033x"
    assert format_speedup(0.9, 1.0) == "0.9x"
    entry = listed(cold_seconds=0.01, warm_median_seconds=0.3)
    row = dict(zip(ENTRY_HEADERS, entry_row(entry), strict=True))
    assert row["speedup"] == "0.033x"
    assert not any(format_speedup(c / 100, 1.0).startswith("0x") or
                   format_speedup(c / 100, 1.0) == "0.0x" for c in range(1, 100))


def test_the_status_line_of_a_running_daemon_and_of_none() -> None:
    running: Status = {
        "running": True, "socket": "/run/o.sock", "pid": 42, "entries": 2,
        "cached_bytes": 1024 ** 2, "budget_bytes": 1024 ** 3,
        "memory_available_bytes": 2 * 1024 ** 3, "memory_total_bytes": 4 * 1024 ** 3,
    }
    assert status_line(running) == (
        "daemon pid 42 on /run/o.sock: 2 entries, 1 MiB cached of 1 GiB budget, "
        "2 GiB of 4 GiB system memory available")
    down: Status = {"running": False, "socket": "/run/o.sock", "error": "refused"}
    assert status_line(down) == ("no daemon is running on /run/o.sock: the first cached "
                                 "load starts one (refused)")


def test_a_first_load_says_whether_it_is_cached_now_or_in_the_background() -> None:
    from overmind_lab._loading.load import LoadEvent

    name = "UNet2DConditionModel.from_pretrained('/m/unet')"
    stored = LoadEvent("k", name, "cold", 0.31, cold_seconds=0.3)
    forked = LoadEvent("k", name, "cold", 0.31, cold_seconds=0.3,
                       reason="being cached in the background")
    assert describe_load(stored) == (f"cold 0.31 s (load 0.30 s + cache it 0.01 s), "
                                     f"now cached  {name}")
    assert describe_load(forked) == (f"cold 0.31 s (load 0.30 s + cache it 0.01 s), "
                                     f"being cached in the background  {name}")
