"""The benchmark's ``orders`` case (``benchmarks/_orders.py``) end to end on tiny models: what a
user waits for in the order they type it, each row in fresh processes against a private daemon
that the case stops, kills and has loads start again.

On tiny models the ratios mean nothing: the structure is checked, that every row was measured
with the outcome it claims, and that no process the run started (the private daemon, those the
loads started on its socket, the measuring processes) is left.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks import _cases, _orders, _report
from tests.test_bench import _alive, _marked, bench_run

#: Rows measured in fresh processes (the order of results.json's ``runs``), with their outcomes.
PROCESS_ROWS = {"plain": "plain", "first": "cold", "after_first": "warm", "notebook": "warm",
                "script": "warm", "killed": "warm", "login": "cold"}


def test_orders_is_registered() -> None:
    assert "orders" in _cases.EXTRA_CASES and "orders" in _cases.ALL_NAMES
    assert _cases.select(["orders"]) == ["orders"]
    assert _cases.needed_models(["orders"]) == ["fp16"]
    ids = {t[0] for t in _report.TARGETS}
    assert {f"or_{name}" for name in _orders.LIMITS} <= ids
    # no result: no value, no verdict
    targets = {t["id"]: t for t in _report.evaluate_targets({"orders": {}})}
    assert targets["or_notebook"]["value"] is None and targets["or_notebook"]["passed"] is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_orders_case(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the run must not touch the user's daemon: the default socket points where nobody listens
    user_socket = tmp_path / "user-run" / "daemon.sock"
    env = dict(os.environ, OVERMIND_LAB_SOCKET=str(user_socket))
    start = time.monotonic()
    with bench_run(["--quick", "--only", "orders", "--out", str(out), "--models-dir",
                    str(tmp_path / "models")], env, poll=0.2) as bench:
        elapsed = time.monotonic() - start
        assert "orders: round 1/1" in bench.stderr  # progress lines

        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
        assert results["errors"] == []
        meta = results["meta"]
        assert meta["cases"] == ["orders"] and meta["private_daemon"] is True
        orders = results["orders"]
        assert orders["errors"] == [] and orders["skipped"] == []
        assert orders["repeat"] == 1 and orders["private_daemon"] is True

        # every row measured in its own process, with the outcome it claims
        runs = orders["runs"]
        assert set(runs) == set(PROCESS_ROWS)
        for name, outcome in PROCESS_ROWS.items():
            assert len(runs[name]) == 1, name
            rec = runs[name][0]
            assert "error" not in rec, (name, rec)
            assert rec["outcome"] == outcome, (name, rec)
            assert rec["load_seconds"] > 0 and rec["touch_seconds"] > 0, name
            assert rec["import_torch"] > 0 and rec["import_diffusers"] > 0, name
            assert rec["storage_bytes"] > 0 and rec["exit_code"] == 0, name
            assert rec["overmind_imported_before"] is False, name
            usage = rec["load_usage"]  # where the load call's time went, seen from outside
            assert usage["thread_cpu_seconds"] > 0 and usage["minor_faults"] >= 0, name
            if name == "plain":
                assert "import_overmind" not in rec and rec["load_event"] == {}
            else:
                assert rec["import_overmind"] > 0 and rec["patch_all"] > 0, name
        assert len({r["pid"] for rows in runs.values() for r in rows}) == len(PROCESS_ROWS)
        # script order imports overmind_lab only in its timed part; the others before "ready"
        assert runs["script"][0]["overmind_imported_at_ready"] is False
        assert runs["notebook"][0]["overmind_imported_at_ready"] is True
        script = runs["script"][0]
        assert script["repeat_outcome"] == "warm" and script["repeat_load_seconds"] > 0
        # the loads that had to start a daemon say so, the others do not: after kill -9 the
        # load serves the entry saved on disk and starts one in a thread, waiting for none (Note
        # [A hit from the disk]); at a login either patch_all started it ahead (Note [A daemon
        # started ahead]) or the load did
        killed, login = runs["killed"][0], runs["login"][0]
        assert killed["daemon_before"]["running"] is False
        assert killed["load_event"]["daemon_seconds"] is None
        if login["daemon_before"]["running"]:
            assert login["load_event"]["daemon_seconds"] is None
        else:
            assert login["load_event"]["daemon_seconds"] > 0
        for name in ("first", "after_first", "notebook", "script"):
            assert runs[name][0]["load_event"]["daemon_seconds"] is None, name
        for name in ("first", "login"):
            assert runs[name][0]["stored_seconds"] > 0 and "store_error" not in runs[name][0]
        assert runs["after_first"][0]["daemon_before"]["running"] is True

        rows = orders["rows"]
        for name, limit in _orders.LIMITS.items():
            assert rows[name]["value"] is not None and rows[name]["value"] > 0, name
            assert rows[name]["limit"] == limit and rows[name]["passed"] in (True, False)
        for name in PROCESS_ROWS:
            assert rows[name]["n"] == 1 and rows[name]["failed"] == 0, name
        assert rows["plain"]["ratio"] == pytest.approx(1.0)
        assert rows["killed"]["ratio"] > 0 and rows["killed"]["daemon_start"] is None  # from disk
        disk = orders["rounds"][0]["disk"]
        assert disk["model_bytes"] > 0 and disk["cache_bytes"] > 0 and disk["ratio"] >= 1.0
        assert disk["held_files"] >= 1 and disk["held_bytes"] > 0
        targets = {t["id"]: t for t in results["targets"]}
        for name in _orders.LIMITS:
            assert targets[f"or_{name}"]["value"] == rows[name]["value"], name
        md = (out / "results.md").read_text(encoding="utf-8")
        assert "## Orders: what a user waits for" in md
        assert "| first load of a login" in md and "⚠" not in md

        # nothing it started is left: the daemons loads started on the private socket (and
        # the kill -9'd one), the private daemon, every measuring process
        assert len(orders["started_daemons"]) == 2 and orders["started_daemons_left"] == []
        for pid in [*orders["started_daemons"], meta["daemon_pid"]]:
            assert not _alive(pid), pid
        assert _marked(meta["socket"]) == []
        assert not os.path.exists(meta["socket"])
        assert not user_socket.exists()
        left = [p for p in bench.seen if _alive(p)]
        assert not left, f"still running after the benchmark ended: {left}"
        print(f"quick orders: {elapsed:.0f} s")
