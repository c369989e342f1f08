"""The ``restart-direct`` bench case (``benchmarks/_restart_direct.py``) at small scale: kernel
restarts driven by jupyter_client's ``KernelManager`` in the benchmark's own process (no Jupyter
server), plain, warm (the provisioner) and the warm spec's launcher argv, on the tiny pipeline's
UNet. On tiny models the times mean nothing: the structure, every cell's status, the forks and
that nothing the run started is left are asserted, not the targets; the targets and the report
section are checked on a made-up result."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _report
from benchmarks._restart_direct import KINDS, MODES, WARM_KINDS, markdown
from tests.test_bench import _alive, _marked, bench_run


def _result(totals: dict[str, float], forked: bool = True) -> dict[str, Any]:
    """A restart-direct result with one run per kind and mode, totals per kind."""
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        warm = kind in WARM_KINDS
        modes = {mode: {"restart_seconds": 0.05, "cell_seconds": totals[kind] - 0.05,
                        "ready_seconds": 0.3 if mode == "ready" else None,
                        "total_seconds": totals[kind] + (0.3 if mode == "ready" else 0),
                        "all_ok": True, "forked": [warm and forked], "runs": []}
                 for mode in MODES}
        kinds[kind] = {"all_ok": True, "forked": warm and forked, "modes": modes}
    ratios = {kind: {mode: kinds[kind]["modes"][mode]["total_seconds"]
                     / kinds["plain"]["modes"][mode]["total_seconds"] for mode in MODES}
              for kind in WARM_KINDS}
    return {"repeat": 1, "kinds": kinds, "ratios": ratios, "errors": []}


def test_restart_direct_targets_and_report() -> None:
    rd = _result({"plain": 10.0, "warm": 0.2, "warm-launcher": 0.6})
    targets = {t["id"]: t for t in _report.evaluate_targets({"restart_direct": rd})}
    assert targets["rd_warm"]["value"] == pytest.approx(0.2) and targets["rd_warm"]["passed"]
    assert targets["rd_warm_ratio"]["value"] == pytest.approx(0.02)
    assert targets["rd_warm_nopause_ratio"]["passed"] is True
    assert targets["rd_launcher"]["passed"] is False  # 0.6 s > 0.3 s
    assert targets["rd_launcher_nopause_ratio"]["value"] == pytest.approx(0.06)
    for tid in ("rd_warm_ready", "rd_launcher_ready"):  # informative: no limit, no verdict
        t = targets[tid]
        assert t["value"] > 0 and t["passed"] is None and t["limit"] is None and t["info"]
    lines = "\n".join(markdown(rd))
    assert "| warm (overmind-lab-warm provisioner) | ready | 50 ms | 300 ms |" in lines
    assert "wait_for_ready" in lines and "reconnect_ivl" in lines
    # not forked: no value (the measurement is not what it claims)
    rd = _result({"plain": 10.0, "warm": 0.2, "warm-launcher": 0.6}, forked=False)
    targets = {t["id"]: t for t in _report.evaluate_targets({"restart_direct": rd})}
    assert all(targets[t]["value"] is None for t in targets if t.startswith("rd_"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_quick_restart_direct_case_through_jupyter_client(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # a small preload set: the zygote boots in seconds (the production set in a full run)
    env = dict(os.environ, OVERMIND_LAB_SOCKET=str(tmp_path / "user-run" / "daemon.sock"),
               OVERMIND_LAB_PRELOAD="torch,numpy,threadpoolctl,IPython,ipykernel,"
                                    "ipykernel.kernelapp,ipykernel.ipkernel,overmind_lab")
    with bench_run(["--quick", "--out", str(out), "--models-dir", str(tmp_path / "models"),
                    "--only", "restart-direct"], env) as bench:
        assert "restart-direct: warm pause 1/2: total" in bench.stderr  # progress lines
        assert "restart-direct: WARNING" not in bench.stderr, bench.stderr[-6000:]

        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
        assert results["errors"] == []
        rd = results["restart_direct"]
        assert rd["errors"] == [] and rd["repeat"] == 2 and rd["quick"] is True
        assert set(rd["kinds"]) == set(KINDS)
        for kind, k in rd["kinds"].items():
            assert k["all_ok"] and k["first_cell_seconds"] > 0
            assert k["forked"] is (kind in WARM_KINDS)
            assert set(k["modes"]) == set(MODES)
            for mode, m in k["modes"].items():
                runs = m["runs"]
                assert len(runs) == (1 if kind == "plain" else 2)  # --quick: one plain round
                for r in runs:
                    assert r["status"] == "ok", (kind, mode, r)
                    assert r["forked"] is (kind in WARM_KINDS), (kind, mode, r)
                    assert r["restart_seconds"] > 0 and r["cell_seconds"] > 0
                    assert (r["ready_seconds"] is None) is (mode != "ready")
                    parts = r["restart_seconds"] + (r["ready_seconds"] or 0) + r["cell_seconds"]
                    assert r["total_seconds"] == pytest.approx(parts, abs=0.01)
                assert m["total_seconds"] > 0 and m["forked"] == [kind in WARM_KINDS] * len(runs)
            if kind in WARM_KINDS:  # a forked kernel's steps: overmind-lab's timeline
                steps = k["modes"]["pause"]["runs"][-1]["steps_ms"]
                assert "zygote.forked" in steps or "provisioner.standby_go" in steps, steps
        for kind in WARM_KINDS:
            assert all(rd["ratios"][kind][mode] > 0 for mode in MODES)

        targets = {t["id"]: t for t in results["targets"]}
        for prefix in ("rd_warm", "rd_launcher"):
            for suffix in ("", "_ratio", "_nopause", "_nopause_ratio"):
                t = targets[prefix + suffix]
                assert t["value"] is not None and t["passed"] is not None, t
            info = targets[prefix + "_ready"]  # informative: no limit
            assert info["value"] > 0 and info["passed"] is None and info["limit"] is None
            assert info["info"] is True
        md = (out / "results.md").read_text(encoding="utf-8")
        assert "## Kernel restarts through jupyter_client directly" in md
        assert "none (informative)" in md

        # nothing it started is left: kernels, launchers, standbys, zygotes, daemons
        for pid in [*rd["zygote_pids"], rd["daemon_pid"], results["meta"]["daemon_pid"]]:
            assert not _alive(pid), pid
        assert _marked(rd["dir"]) == []
        left = [p for p in bench.seen if _alive(p)]
        assert not left, f"still running after the benchmark ended: {left}"
