"""The benchmark suite (``python -m benchmarks``, not shipped): option parsing, and a quick
end-to-end run on tiny models.

The end-to-end run is the real thing at small scale: real child processes timing real
``from_pretrained`` calls against a private daemon it starts and stops, a PSS measurement,
and the Jupyter kernel-restart loop. On tiny models the ratios mean nothing, so only the
structure and the correctness verdicts are asserted, not the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

import benchmarks
from benchmarks import _cases, _report

REPO = Path(__file__).resolve().parents[1]

#: Cases of the end-to-end run: one diffusers model, the transformers model, a whole
#: pipeline (fp32 files loaded as fp16), the PSS measurement and the kernel restart
#: (all cases at once take longer than a test should on 2 cores).
E2E_CASES = "unet-fp16,single-file,pipeline-fp32-as-fp16,pss,kernel-restart"


def test_the_suites_options() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    benchmarks.add_arguments(parser)
    args = parser.parse_args(["--quick", "--only", "unet-fp16,pss", "--only", "vae"])
    assert args.quick and args.repeat is None and args.socket is None
    assert args.models_dir == benchmarks.DEFAULT_MODELS_DIR and args.out == benchmarks.DEFAULT_OUT
    assert _cases.select(args.only) == ["unet-fp16", "vae", "pss"]
    args = parser.parse_args(["--repeat", "3", "--socket", "/tmp/x.sock"])
    assert args.repeat == 3 and args.socket == "/tmp/x.sock" and not args.quick


def test_select_cases() -> None:
    assert _cases.select(None) == _cases.ALL_NAMES
    assert _cases.select(["unet"]) == ["unet-fp16", "unet-fp32-as-fp16", "unet-fp32", "unet-bin"]
    assert _cases.needed_models(["single-file", "llama-1b"]) == ["fp16", "llama", "single-file"]
    with pytest.raises(ValueError, match="unknown case"):
        _cases.select(["nope"])


def test_cli_rejects_unknown_case(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "nope", "--out", str(tmp_path / "o"),
         "--models-dir", str(tmp_path / "m")],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert proc.returncode == 2
    assert "unknown case" in proc.stderr
    assert not (tmp_path / "m").exists()


def test_targets_are_evaluated() -> None:
    case = {"runs": {
        "plain": [{"load_seconds": 1.0, "touch_seconds": 0.1, "outcome": "plain",
                   "import_seconds": 5.0}] * 3,
        "first": [{"load_seconds": 1.4, "outcome": "cold"}] * 3,
        "warm": [{"load_seconds": 0.05, "touch_seconds": 0.6, "outcome": "warm"},
                 {"load_seconds": 0.07, "touch_seconds": 0.6, "outcome": "warm"},
                 {"error": "boom"}],
    }}
    _report.summarize(case)
    assert case["stats"]["warm"]["load"]["median"] == pytest.approx(0.06)
    assert case["stats"]["warm"]["failed"] == 1
    assert case["ratios"]["warm_over_plain"] == pytest.approx(0.06)
    assert case["ratios"]["first_over_plain"] == pytest.approx(1.4)
    targets = {t["id"]: t for t in _report.evaluate_targets({"cases": {"unet-fp16": case}})}
    assert targets["unet_fp16_warm"]["passed"] is True
    assert targets["unet_fp16_first"]["passed"] is True
    # what a user waits for: a fast load whose first touch is slow fails (0.66 / 1.1)
    assert targets["unet_fp16_total"]["value"] == pytest.approx(0.66 / 1.1)
    assert targets["unet_fp16_total"]["passed"] is False
    assert targets["pss"]["value"] is None and targets["pss"]["passed"] is None


def test_a_pipelines_first_encoding_counts_against_its_load() -> None:
    """A warm pipeline builds its tokenizer on first use (Note [A tokenizer built on first use]):
    its load alone meets the limit, its load and first encoding are what the ratio takes."""
    case = {"runs": {
        "plain": [{"load_seconds": 2.0, "encode_seconds": 0.001, "outcome": "plain"}] * 3,
        "warm": [{"load_seconds": 0.02, "encode_seconds": 0.6, "outcome": "warm"}] * 3,
    }}
    _report.summarize(case)
    targets = {t["id"]: t for t in _report.evaluate_targets({"cases": {"pipeline-fp16": case}})}
    assert targets["pipe_fp16_warm_ms"]["value"] == pytest.approx(20.0)
    assert targets["pipe_fp16_warm_ms"]["passed"] is True
    assert targets["pipe_fp16_encode"]["value"] == pytest.approx(0.62 / 2.001)
    assert targets["pipe_fp16_encode"]["passed"] is False


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_bench_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    models = tmp_path / "models"
    # the benchmark must never touch the user's daemon: point the default socket at a
    # path nobody listens on and check nothing appeared there
    user_socket = tmp_path / "user-run" / "daemon.sock"
    env = dict(os.environ, OVERMIND_LAB_SOCKET=str(user_socket))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out),
         "--models-dir", str(models), "--only", E2E_CASES],
        capture_output=True, text=True, timeout=1100, cwd=REPO, check=False, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    assert "[bench" in proc.stderr  # progress lines
    assert "models:" in proc.stderr

    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    meta = results["meta"]
    assert meta["quick"] is True and meta["repeat"] == 2 and meta["private_daemon"] is True
    assert results["errors"] == []

    # the private daemon is gone, and the user's socket was never created
    assert not os.path.exists(meta["socket"])
    pid = meta.get("daemon_pid")
    if pid:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not user_socket.exists()

    # model directories were built once, with their markers
    for info in results["models"].values():
        assert (Path(info["path"]) / ".overmind-built.json").is_file()

    for name in ("unet-fp16", "single-file", "pipeline-fp32-as-fp16"):
        case = results["cases"][name]
        for mode, outcome in (("plain", "plain"), ("first", "cold"), ("warm", "warm"),
                              ("restart", "warm"), ("plain-cold", "plain"),
                              ("reboot", "warm")):
            runs = case["runs"][mode]
            assert len(runs) == 2
            assert all("error" not in r for r in runs), runs
            assert [r["outcome"] for r in runs] == [outcome] * 2
            assert all(r["load_seconds"] > 0 and r["import_seconds"] > 0 for r in runs)
            assert case["stats"][mode]["load"]["n"] == 2
        assert len({r["pid"] for mode in case["runs"] for r in case["runs"][mode]}) == 12, \
            "every measurement runs in its own process"
        assert case["check"]["passed"] is True, case["check"]["failures"]
        assert case["ratios"]["warm_over_plain"] is not None
        assert case["ratios"]["restart_total_over_plain"] is not None
        assert case["ratios"]["reboot_total_over_plain_cold"] is not None
        assert case["entry"] is not None and case["entry"]["hits"] >= 1

    assert results["cases"]["pipeline-fp32-as-fp16"]["check"]["components"] >= 5
    pipe_runs = results["cases"]["pipeline-fp32-as-fp16"]["runs"]
    assert all(r["encode_seconds"] > 0 for r in pipe_runs["warm"] + pipe_runs["plain"])

    pss = results["pss"]
    assert "error" not in pss, pss
    assert pss["warm_outcomes"] == ["warm"] * pss["holders"]
    assert pss["checksums_equal"] is True
    assert pss["warm_sum_bytes"] > 0 and pss["plain_sum_bytes"] > 0 and pss["runtime_sum_bytes"] > 0
    assert pss["one_copy_bytes"] > 0 and pss["ratio"] > 0

    kr = results["kernel_restart"]
    if kr.get("skipped"):
        assert kr["note"]  # the reason is reported
    else:
        assert "error" not in kr, kr
        assert kr["warm_from_cache"] is True
        assert kr["warm"]["load_seconds"] > 0 and kr["plain"]["cell_seconds"] > 0

    targets = {t["id"]: t for t in results["targets"]}
    assert targets["correct"]["passed"] is True
    assert targets["unet_fp16_warm"]["value"] is not None

    md = (out / "results.md").read_text(encoding="utf-8")
    assert "| target | measured | limit |" in md
    assert "UNet fp16 -> fp16" in md and "Quick run on tiny models" in md
    assert "## Load and first touch" in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    print(f"quick bench: {elapsed:.0f} s")


def _descendants(root: int) -> set[int]:
    """Pids of every process below ``root`` (from ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.add(pid)
            todo.append(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.mark.slow
def test_a_terminated_bench_stops_its_processes_and_writes_what_it_has(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, OVERMIND_LAB_SOCKET=str(tmp_path / "user-run" / "daemon.sock"))
    log = (tmp_path / "bench.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out),
         "--models-dir", str(tmp_path / "models"), "--only", "text-encoder"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= _descendants(proc.pid)
            cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in seen if _alive(p)]
            if any(b"benchmarks._child" in c for c in cmdlines) and \
                    any(b"serve" in c for c in cmdlines):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the benchmark ended before it started a measurement"
        proc.terminate()  # SIGTERM, as `kill` or a closing session sends
        assert proc.wait(timeout=120) == 1
        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
        assert any("interrupted" in e for e in results["errors"]), results["errors"]
        left = [p for p in seen if _alive(p)]
        assert not left, f"still running after the benchmark ended: {left}"
    finally:
        for pid in [proc.pid, *seen]:
            if _alive(pid):
                os.kill(pid, 9)
        proc.wait(timeout=30)
        log.close()


class BenchRun(NamedTuple):
    stdout: str
    stderr: str
    #: every process the run started, collected while it ran
    seen: set[int]


@contextlib.contextmanager
def bench_run(args: list[str], env: dict[str, str], poll: float = 0.5) -> Iterator[BenchRun]:
    """``python -m benchmarks ARGS`` run to its end (540 s at most), its exit status 0, the
    processes it started collected while it ran; whatever of it is still alive when the block
    ends (passed or failed) is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 540
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _descendants(proc.pid)
            time.sleep(poll)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-6000:]}"
        yield BenchRun(stdout, stderr, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        for pid in seen:
            if _alive(pid):
                os.kill(pid, 9)


def _marked(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and _alive(int(entry.name)):
                out.append(int(entry.name))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_warm_kernel_case_through_a_jupyter_server(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # a small preload set: the zygote boots in seconds (the production set in a full run)
    env = dict(os.environ, OVERMIND_LAB_SOCKET=str(tmp_path / "user-run" / "daemon.sock"),
               OVERMIND_LAB_PRELOAD="torch,numpy,threadpoolctl,IPython,ipykernel,"
                                    "ipykernel.kernelapp,ipykernel.ipkernel,overmind_lab")
    with bench_run(["--quick", "--repeat", "1", "--out", str(out), "--models-dir",
                    str(tmp_path / "models"), "--only", "warm-kernel"], env) as bench:
        assert "warm-kernel: jupyter server up on port" in bench.stderr  # progress lines

        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
        assert results["errors"] == []
        wk = results["warm_kernel"]
        for name in ("sd15", "llama"):
            for kind in ("plain", "warm"):
                run = wk[name][kind]
                assert run["restart_seconds"] > 0 and run["cell_seconds"] > 0
                assert len(run["restart_all"]) == len(run["cell_all"]) == 1
            assert wk[name]["warm"]["forked"] == [True]
            assert wk[name]["plain"]["forked"] == [False]
            assert wk[name]["ratios"]["cell_warm_over_plain"] > 0
        # a fresh server's first kernel is plain; its restart, once the zygote serves, is not
        first = wk["first_restart"]
        assert first["forked"] and first["total_seconds"] >= first["restart_seconds"] > 0
        assert first["timeline_ms"]["client.execute_reply"] > 0
        pss = wk["pss"]
        assert pss["warm_forked"] == [True] * pss["kernels"]
        assert pss["plain_forked"] == [False] * pss["kernels"]
        assert pss["plain_sum_bytes"] > 0 and pss["warm_sum_bytes"] > 0
        assert pss["zygote_pss_bytes"] > 0 and pss["warm_in_plain_kernels"] > 0
        targets = {t["id"]: t for t in results["targets"]}
        for tid in ("wk_sd_cell", "wk_sd_cell_ratio", "wk_llama_cell", "wk_pss",
                    "wk_sd_restart_cell", "wk_sd_restart_cell_ratio", "wk_first_restart"):
            assert targets[tid]["value"] is not None and targets[tid]["passed"] is not None
        assert "## Warm kernels" in (out / "results.md").read_text(encoding="utf-8")

        # nothing it started is left: server, kernels, zygotes, daemon
        for pid in [wk["server_pid"], *wk["zygote_pids"], results["meta"]["daemon_pid"]]:
            assert not _alive(pid), pid
        assert _marked(wk["dir"]) == []
        left = [p for p in bench.seen if _alive(p)]
        assert not left, f"still running after the benchmark ended: {left}"


def test_the_chart_is_an_svg_of_the_results() -> None:
    from benchmarks import _chart

    case = {"title": "UNet fp16 -> fp16", "stats": {
        "plain": {"load": {"median": 2.0}}, "first": {"load": {"median": 4.0}},
        "warm": {"load": {"median": 0.05}}}}
    kind = {"restart_seconds": 1.5, "cell_seconds": 20.0}
    results = {"meta": {"cases": ["unet-fp16", "warm-kernel"], "repeat": 5, "cpus": 2},
               "cases": {"unet-fp16": case},
               "warm_kernel": {"sd15": {"plain": kind, "warm": {**kind, "cell_seconds": 0.5}},
                               "llama": {"plain": kind, "warm": {**kind, "cell_seconds": 0.1}},
                               "pss": {"kernels": 4, "plain_sum_bytes": 4 << 30,
                                       "warm_sum_bytes": 1 << 30, "zygote_pss_bytes": 1 << 28,
                                       "warm_in_plain_kernels": 1.0}}}
    svg = _chart.render(results, note="a note")
    assert svg.startswith("<svg ") and svg.rstrip().endswith("</svg>")
    assert svg.count("<rect") >= 1 + 3 + 6 + 3  # background, load bars, kernel bars, legend
    for text in ("UNet fp16 → fp16", "500 ms", "20.0 s", "100 ms", "a note", "1024 MiB"):
        assert text in svg, text


# -- `overmind-lab bench PATH` (overmind_lab/measure.py, overmind_lab/_measuring.py) ----------
#
# The user-facing command on a real model folder (a tiny UNet written by save_pretrained), run
# as a user runs it, with a real private daemon. Every process it starts inherits a marker in its
# environment; afterwards no process may carry it. No wall-clock bound is asserted: the time is
# measured by hand (a shared, noisy machine).

BENCH_ROWS = ("plain from_pretrained", "first load, cached (cold)", "warm load",
              "warm load after a daemon restart")


def _tiny_unet(path: Path) -> Path:
    from diffusers import UNet2DConditionModel

    UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        norm_num_groups=32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_unet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_unet(tmp_path_factory.mktemp("bench-model") / "unet")


def _bench_env(tmp_path: Path, marker: str) -> dict[str, str]:
    env = dict(os.environ, OVERMIND_LAB_SOCKET=str(tmp_path / "user-run" / "daemon.sock"),
               XDG_CACHE_HOME=str(tmp_path / "xdg"), OVERMIND_BENCH_TEST_MARK=marker)
    env.pop("OVERMIND_LAB_CACHE_DIR", None)
    return env


def _carrying(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (each process the bench started)."""
    needle = f"OVERMIND_BENCH_TEST_MARK={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _private_socket(stdout: str) -> Path:
    import re

    match = re.search(r"private daemon on (\S+)", stdout)
    assert match, stdout
    return Path(match.group(1))


@pytest.mark.slow  # the imports once, then four loads in forked processes
@pytest.mark.timeout(600)
def test_bench_path_measures_every_row_with_progress(tiny_unet: Path, tmp_path: Path) -> None:
    marker = f"run-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.run(
        [sys.executable, "-m", "overmind_lab", "bench", str(tiny_unet), "--repeat", "1"],
        capture_output=True, text=True, timeout=540, cwd=tmp_path,
        env=_bench_env(tmp_path, marker), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("overmind-lab bench: UNet2DConditionModel (diffusers) from ")
    for label in BENCH_ROWS:
        [line] = [ln for ln in out if ln.startswith(label + "  ")]
        assert line.split()[-1] in ("plain", "cold", "warm"), line
    assert [ln.split()[-1] for ln in out if ln.startswith(BENCH_ROWS)] == \
        ["plain", "cold", "warm", "warm"]
    assert "A fresh process (a kernel after a restart) waits imports + load + first touch" \
        in proc.stdout
    assert "timed once, in a fresh process" in " ".join(proc.stdout.split())

    # progress: the total up front, then a line for every step, each with the total refined
    progress = proc.stderr.splitlines()
    assert progress, proc.stderr
    assert all(ln.startswith("bench [") and " s of about " in ln for ln in progress), progress
    assert "importing torch, diffusers and overmind_lab once" in progress[0]
    assert "into the page cache" in progress[1]
    assert "imports: torch " in progress[2]
    steps = [ln.split("] ", 1)[1] for ln in progress]
    for label in BENCH_ROWS:
        assert any(s.startswith(f"{label} 1/1: load ") for s in steps), steps
    assert "private daemon started" in steps
    assert steps[-1].startswith("done")
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr

    # nothing it started runs on; its private socket folder and cache are gone; the user's
    # daemon and cache were never touched
    assert _carrying(marker) == []
    assert not _private_socket(proc.stdout).parent.exists()
    assert not (tmp_path / "user-run").exists()
    assert list((tmp_path / "xdg").iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_stops_everything_the_bench_started(tiny_unet: Path, tmp_path: Path) -> None:
    marker = f"int-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "overmind_lab", "bench", str(tiny_unet), "--repeat", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=_bench_env(tmp_path, marker), start_new_session=True)  # its own terminal group
    try:
        assert proc.stdout is not None and proc.stderr is not None
        header = proc.stdout.readline()
        seen = []
        for line in proc.stderr:  # the event: the daemon runs beside the measuring process
            seen.append(line)
            if "private daemon started" in line:
                break
        assert proc.poll() is None, "".join(seen)
        running = _carrying(marker)
        assert len(running) >= 3, running  # the bench, the measuring process, the daemon
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 130, rest
        assert "interrupted" in rest and "Traceback" not in rest, rest
        assert _carrying(marker) == []
        assert not _private_socket(header).parent.exists()
        assert list((tmp_path / "xdg").iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
        for pid in _carrying(marker):
            os.kill(pid, signal.SIGKILL)


def test_an_unknown_class_fails_at_once_naming_close_ones(tiny_unet: Path,
                                                          tmp_path: Path) -> None:
    marker = f"cls-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.run(
        [sys.executable, "-m", "overmind_lab", "bench", str(tiny_unet),
         "--class", "UNet9DConditionModel"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=_bench_env(tmp_path, marker), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # no header naming a library for a class that is not there
    error = proc.stderr.splitlines()[-1]
    assert error.startswith("overmind-lab bench: error: no class UNet9DConditionModel in "
                            "diffusers or transformers (did you mean "), error
    assert "UNet2DConditionModel" in error and "--class" in error
    assert "Traceback" not in proc.stderr
    assert _carrying(marker) == []
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "user-run").exists()


def test_a_bad_repeat_is_a_usage_error(tiny_unet: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "overmind_lab", "bench", str(tiny_unet),
                           "--repeat", "0"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2
    assert "argument --repeat: must be at least 1, not 0" in proc.stderr


def test_the_class_is_resolved_before_anything_starts(tiny_unet: Path) -> None:
    from overmind_lab.measure import UsageError, detect, resolve

    library, name, fallback = detect(tiny_unet)
    assert resolve(library, name, fallback, None) == ("diffusers", "UNet2DConditionModel")
    assert resolve(*detect(tiny_unet, "diffusers.UNet2DConditionModel"),
                   "diffusers.UNet2DConditionModel") == ("diffusers", "UNet2DConditionModel")
    # a class of the other library than the folder's is found there
    assert resolve(*detect(tiny_unet, "AutoTokenizer"), "AutoTokenizer") == \
        ("transformers", "AutoTokenizer")
    with pytest.raises(UsageError, match=r"no class UNet2DConditionModels in diffusers \(did "
                                         r"you mean UNet2DConditionModel"):
        resolve(*detect(tiny_unet, "diffusers.UNet2DConditionModels"),
                "diffusers.UNet2DConditionModels")


def test_the_estimate_follows_what_was_measured() -> None:
    import io

    from overmind_lab.measure import FROM_PLAIN, Progress

    out = io.StringIO()
    progress = Progress(["imports", "plain", "cold", "warm"],
                        {"imports": 10.0, "plain": 1.0, "cold": 3.0, "warm": 0.2}, out=out)
    assert sum(map(progress._cost, progress.left)) == pytest.approx(14.2)
    progress.say("starting")
    progress.done("imports", "imports done")
    progress.done("plain", "plain done")
    assert progress.left == ["cold", "warm"]
    # the rows not measured yet follow the plain load measured, not the guesses
    assert progress._cost("cold") == pytest.approx(FROM_PLAIN["cold"] * progress.taken["plain"])
    assert progress._cost("warm") == pytest.approx(FROM_PLAIN["warm"] * progress.taken["plain"])
    lines = out.getvalue().splitlines()
    assert [ln.split("] ", 1)[1] for ln in lines] == ["starting", "imports done", "plain done"]
    assert all(ln.startswith("bench [") and " s of about " in ln for ln in lines)
