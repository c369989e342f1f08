"""The ``warm-scripts`` case: ``python SCRIPT`` against ``overmind-lab run SCRIPT``.

Each measurement is a fresh process started as a shell starts it (``subprocess.run``), timed
from the start to its exit (what the shell waits for): plain ``python SCRIPT`` and the console
script ``overmind-lab run SCRIPT`` (forked from the zygote of this environment, with the default
preload set), alternated run by run (the first of each pair alternates too), medians. The
scripts, generated in a private folder:

- ``diffusers``: ``import overmind_lab; overmind_lab.patch_all()``, torch and diffusers, the
  suite's fp16 UNet through ``UNet2DConditionModel.from_pretrained`` (a hit of the warm cache),
  the sum of one weight;
- ``transformers``: the suite's Llama folder through ``AutoModelForCausalLM.from_pretrained``
  (cached), one forward of 4 tokens;
- ``pytest``: ``-m pytest -q`` on 4 tests importing torch and diffusers, one a forward of a
  tiny UNet built from its config;
- ``hello``: ``print("hi")``: what a trivial script costs.

Every script says whether it was forked from the zygote (``overmind_lab._forked.become`` is
imported before its first line only there) and which outcome its cached loads had: a warm run
that was not forked, or a load that was not a warm hit, is an error, not a timing.

Before the timed runs the cache is filled by a plain ``python SCRIPT --prime`` of the two loading
scripts (the store awaited before the exit), and the zygote is made to exist and know the scripts'
imports: one ``overmind-lab run`` of each (the first finds no zygote: plain, and one starts in the
background), the zygote's "ready" line in its log (an event), one forked run of
each (the zygote records what they imported), then the zygote is asked to replace itself (``replace``:
the new one preloads those modules and the cached entries' classes, as one would after a pause:
Note [A renewal waits for a pause]) and its "ready" line awaited, then one more forked run of each.

The fallback: ``overmind-lab run hello.py`` where no zygote can serve (``OVERMIND_LAB_SOCKET`` in a
fresh folder of mode 0777: the launcher's grandchild refuses to start a zygote in a folder anyone
may write) against ``python hello.py`` and ``overmind-lab run --plain hello.py``; it is checked that
no zygote appeared there. The trivial runs (``hello`` and the fallback) take tens of milliseconds:
they run at least :data:`TRIVIAL_MIN_RUNS` times each.

The zygote gets an identity of its own (``OVERMIND_LAB_BENCH_SCRIPTS``, part of the identity as
every ``OVERMIND_LAB_*`` variable), so that with ``--socket`` no zygote of the user's is used or
stopped. At the end, also on an error or Ctrl-C, every zygote of that identity and every script
forked from one (they keep the zygote's command line) and every process naming the private folders
is killed. This process never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._numbers import fmt, stats
from overmind_lab._common.zygote_paths import ZygotePaths, zygote_processes

__all__ = ["LIMITS", "SCRIPTS", "TRIVIAL_MIN_RUNS", "markdown", "run_warm_scripts"]

Progress = Callable[[str], None]

#: The targets: the diffusers script under ``overmind-lab run`` in seconds and as a fraction of
#: plain; the fallback's cost over plain Python in milliseconds.
LIMITS = {"diffusers_seconds": 0.5, "diffusers_ratio": 0.1, "fallback_extra_ms": 25.0}
#: The scripts, in run order, with their titles.
SCRIPTS = {
    "diffusers": "diffusers: torch, diffusers, the UNet through the cache, one weight summed",
    "transformers": "transformers: the Llama through the cache, one forward",
    "pytest": "`-m pytest -q`: 4 tests importing torch and diffusers, one tiny UNet forward",
    "hello": '`print("hi")`',
}
#: Runs of each kind at least, for the scripts that take tens of milliseconds.
TRIVIAL_MIN_RUNS = 20
#: How long a zygote may take to import (a loaded 2-core machine: generous).
BOOT_TIMEOUT = 600.0
READY = " ready in "
#: The line each script ends with: ``MARK`` and a JSON object (``forked``, ``outcomes``).
MARK = "BENCH-WS "
_FORKED = '"overmind_lab._forked.become" in sys.modules'

_HEAD = f"""\
import sys
FORKED = {_FORKED}  # forked from the zygote (overmind-lab run); checked before anything runs
import json
import overmind_lab
overmind_lab.patch_all()
import torch
"""
_TAIL = """\
if "--prime" in sys.argv[1:]:  # the setup's first run: the entry stored before the exit
    overmind_lab.wait_for_stores()
print("BENCH-WS " + json.dumps({"forked": FORKED, "outcomes": [e.outcome for e in events],
                                "reasons": [e.reason for e in events if e.reason],
                                "value": value}))
"""
DIFFUSERS_SCRIPT = _HEAD + """\
from diffusers import UNet2DConditionModel
with overmind_lab.record_loads() as events:
    unet = UNet2DConditionModel.from_pretrained({path!r}, dtype=torch.float16)
value = float(unet.conv_in.weight.float().sum())
""" + _TAIL
TRANSFORMERS_SCRIPT = _HEAD + """\
from transformers import AutoModelForCausalLM
with overmind_lab.record_loads() as events:
    model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16)
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
value = float(logits[0, -1].float().sum())
""" + _TAIL
HELLO_SCRIPT = f'import sys\nprint("hi", {_FORKED})\n'
CONFTEST = f"""\
import sys
FORKED = {_FORKED}


def pytest_terminal_summary(terminalreporter):
    import json
    terminalreporter.write_line("BENCH-WS " + json.dumps({{"forked": FORKED}}))
"""
TESTS = """\
import diffusers
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel


def test_tensor_arithmetic():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(x @ x.T, torch.tensor([[5.0, 14.0], [14.0, 50.0]]))


def test_scheduler_step():
    scheduler = DDPMScheduler(num_train_timesteps=10)
    scheduler.set_timesteps(5)
    sample = torch.ones(1, 4, 8, 8)
    out = scheduler.step(torch.zeros_like(sample), scheduler.timesteps[0], sample).prev_sample
    assert out.shape == sample.shape


def test_unet_forward():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8)
    with torch.no_grad():
        out = unet(torch.randn(1, 4, 8, 8), 1, encoder_hidden_states=torch.randn(1, 3, 32)).sample
    assert out.shape == (1, 4, 8, 8)
    assert torch.isfinite(out).all()


def test_versions():
    assert diffusers.__version__ and torch.__version__
"""
#: Tests the pytest folder holds (``-q`` says ``4 passed``).
TEST_COUNT = 4


class _Lab:
    """The private folders, the environments, the zygote's paths and the runs' log."""

    def __init__(self, env: dict[str, str], unet: Path, llama: Path, log_dir: Path,
                 timeout: float) -> None:
        self.timeout = timeout
        self.python = sys.executable
        self.launcher = str(Path(sys.executable).with_name("overmind-lab"))
        self.work = Path(tempfile.mkdtemp(prefix="overmind-bench-ws-"))
        # a folder anyone may write: no zygote can start there (the fallback)
        self.open_dir = Path(tempfile.mkdtemp(prefix="overmind-bench-ws-open-"))
        os.chmod(self.open_dir, 0o777)  # noqa: S103 - the point: a folder no zygote trusts
        self.env = {k: v for k, v in env.items()
                    if k not in ("PYTHONUNBUFFERED", "OVERMIND_LAB_PRELOAD")}  # a user's shell
        # the zygote stays while the case runs (the end kills it); an identity of its own
        self.env.update(OVERMIND_LAB_ZYGOTE_IDLE="3600",
                        OVERMIND_LAB_BENCH_SCRIPTS=self.work.name)
        self.open_env = dict(self.env, OVERMIND_LAB_SOCKET=str(self.open_dir / "daemon.sock"))
        self.paths = ZygotePaths.for_launch(self.python, self.env)
        self.log_path = log_dir / "warm-scripts.log"
        self.zygote_log_copy = log_dir / "warm-scripts-zygote.log"
        self.tests = self.work / "tests"
        self.unet, self.llama = unet, llama

    def write_scripts(self) -> None:
        self.tests.mkdir()
        unet, llama = self.unet, self.llama
        (self.work / "diffusers_script.py").write_text(
            DIFFUSERS_SCRIPT.replace("{path!r}", repr(str(unet))), encoding="utf-8")
        (self.work / "transformers_script.py").write_text(
            TRANSFORMERS_SCRIPT.replace("{path!r}", repr(str(llama))), encoding="utf-8")
        (self.work / "hello.py").write_text(HELLO_SCRIPT, encoding="utf-8")
        (self.tests / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
        (self.tests / "conftest.py").write_text(CONFTEST, encoding="utf-8")
        (self.tests / "test_small.py").write_text(TESTS, encoding="utf-8")

    # -- what each script runs ---------------------------------------------------------------
    def target(self, name: str) -> tuple[list[str], Path]:
        """What follows ``python`` (or ``overmind-lab run``) for script ``name``, and its folder."""
        if name == "pytest":
            return ["-m", "pytest", "-q"], self.tests
        file = {"diffusers": "diffusers_script.py", "transformers": "transformers_script.py",
                "hello": "hello.py"}[name]
        return [file], self.work

    def argv(self, kind: str, name: str, *extra: str) -> tuple[list[str], Path]:
        tail, cwd = self.target(name)
        head = {"plain": [self.python], "warm": [self.launcher, "run"],
                "run-plain": [self.launcher, "run", "--plain"]}[kind]
        return [*head, *tail, *extra], cwd

    def run(self, kind: str, name: str, *extra: str, env: dict[str, str] | None = None,
            ) -> dict[str, Any]:
        """One run, timed from its start to its exit; what it said (``forked``, outcomes)."""
        argv, cwd = self.argv(kind, name, *extra)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env=self.env if env is None else env, cwd=cwd,
                              stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=self.timeout, check=False)
        seconds = time.perf_counter() - t0
        stdout = proc.stdout.decode(errors="replace")
        stderr = proc.stderr.decode(errors="replace")
        out: dict[str, Any] = {"seconds": seconds, "rc": proc.returncode, "forked": None}
        lines = stdout.strip().splitlines()
        for line in reversed(lines):
            if line.startswith(MARK):
                with contextlib.suppress(ValueError):
                    out.update(json.loads(line[len(MARK):]))
                break
            if line.startswith("hi "):
                out["forked"] = line.split()[-1] == "True"
                break
        if name == "pytest" and not any(f"{TEST_COUNT} passed" in line for line in lines):
            out["problem"] = f"pytest did not say '{TEST_COUNT} passed'"
        if proc.returncode != 0:
            out["problem"] = f"exit status {proc.returncode}: {stderr.strip()[-300:]}"
        elif out["forked"] is None:
            out["problem"] = "it did not say whether it was forked"
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"--- {' '.join(argv)} (cwd {cwd}): {seconds * 1000:.1f} ms, exit "
                      f"{proc.returncode}, forked {out['forked']}\n{stdout[-2000:]}"
                      f"{stderr[-3000:]}\n")
        return out

    # -- the zygote ----------------------------------------------------------------------------
    def zygote_log(self) -> str:
        try:
            return self.paths.log.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def readies(self) -> int:
        return self.zygote_log().count(READY)

    def wait_ready(self, count: int) -> float:
        """Seconds until the zygote log holds ``count`` "ready" lines and the socket serves."""
        t0 = time.monotonic()
        deadline = t0 + BOOT_TIMEOUT
        while self.readies() < count or not self.paths.socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no zygote said it is ready within {BOOT_TIMEOUT:.0f} s; its "
                                   f"log: {self.zygote_log()[-1500:]!r}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def status(self) -> dict[str, Any]:
        from overmind_lab._common.zygote_client import ask

        return dict(ask(self.paths.socket, {"op": "status"}))

    def replace(self) -> dict[str, Any]:
        """Ask the zygote for a replacement (it preloads what the runs taught it) and wait for
        it to serve; its status."""
        from overmind_lab._common.zygote_client import ask

        old = self.status()["pid"]
        before = self.readies()
        t0 = time.monotonic()
        ask(self.paths.socket, {"op": "replace"})
        self.wait_ready(before + 1)
        deadline = time.monotonic() + BOOT_TIMEOUT
        while True:
            with contextlib.suppress(OSError):
                status = self.status()
                if status["pid"] != old and not status.get("retiring"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the zygote's replacement did not take over")
            time.sleep(0.1)
        status["replace_seconds"] = time.monotonic() - t0
        status["old_pid"] = old
        return status

    def zygote_pids(self) -> list[int]:
        return [pid for pid in zygote_processes(self.paths.directory)
                if str(self.paths.socket).encode() in _cmdline(pid)]

    def close(self) -> None:
        """Kill every zygote of this identity, every script forked from one and every process
        naming the private folders; copy the zygote's log; remove the folders and files."""
        markers = [str(self.paths.socket).encode(), str(self.work).encode(),
                   str(self.open_dir).encode()]
        for _ in range(3):  # a zygote starting a zygote meanwhile: once more
            pids = _marked(markers)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if not pids:
                break
            time.sleep(0.2)
        with contextlib.suppress(OSError):
            shutil.copyfile(self.paths.log, self.zygote_log_copy)
        for path in self.paths.directory.glob(f"zygote-{self.paths.ident}.*"):
            with contextlib.suppress(OSError):
                path.unlink()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.open_dir, ignore_errors=True)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _marked(markers: list[bytes]) -> list[int]:
    """This uid's processes (not this one) whose command line holds one of ``markers``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                    continue
                cmd = _cmdline(int(entry))
                if any(m in cmd for m in markers):
                    out.append(int(entry))
    return out


def _setup(lab: _Lab, progress: Progress, errors: list[str]) -> dict[str, Any]:
    """The zygote made to exist and to know the scripts' imports; the cache warm."""
    setup: dict[str, Any] = {"socket": str(lab.paths.socket)}
    # Plain runs fill the cache: an entry a forked run stored was seen cold by a plain one
    # (the transformers script, in a quick run), one a plain run stored serves both warm.
    progress("warm-scripts: the cache filled by plain runs (python SCRIPT --prime: the load "
             "stored before the exit)")
    setup["prime_runs"] = {}
    for name in ("diffusers", "transformers"):
        run = setup["prime_runs"][name] = lab.run("plain", name, "--prime")
        if run.get("problem"):
            errors.append(f"{name}: priming run: {run['problem']}")
    progress("warm-scripts: first overmind-lab run of each script (no zygote yet: plain, and "
             "one starts for the next run)")
    first = {}
    for name in SCRIPTS:
        run = first[name] = lab.run("warm", name)
        if run.get("problem"):
            errors.append(f"{name}: first run: {run['problem']}")
    setup["first_runs"] = first
    setup["ready_wait_seconds"] = lab.wait_ready(1)
    progress(f"warm-scripts: the zygote is ready (waited {setup['ready_wait_seconds']:.1f} s "
             f"after the first runs): {_ready_line(lab.zygote_log())}")

    def forked_round(label: str) -> dict[str, Any]:
        runs = {}
        for name in SCRIPTS:
            runs[name] = run = lab.run("warm", name)
            if run.get("problem"):
                errors.append(f"{name}: {label} run: {run['problem']}")
            elif not run["forked"]:
                errors.append(f"{name}: the {label} run under overmind-lab run was not forked")
            elif any(o != "warm" for o in run.get("outcomes", [])):
                errors.append(f"{name}: the {label} run's load through the cache was "
                              f"{'/'.join(run['outcomes'])}, not warm "
                              f"{'; '.join(run.get('reasons', []))}")
        return runs

    progress("warm-scripts: one forked run of each (the zygote records what they import)")
    setup["learn_runs"] = forked_round("learning")
    progress("warm-scripts: a new zygote that preloads those imports (replace)")
    status = lab.replace()
    setup["replaced"] = {k: status.get(k) for k in ("pid", "old_pid", "preloaded", "failed",
                                                     "replace_seconds")}
    progress(f"warm-scripts: zygote {status['pid']} serves with {status.get('preloaded')} modules "
             f"(replaced in {status['replace_seconds']:.1f} s); one more forked run of each")
    setup["confirm_runs"] = forked_round("confirming")
    setup["readies"] = lab.readies()
    return setup


def _ready_line(log: str) -> str:
    """The last "ready" line of a zygote log, from "zygote PID ready in" on."""
    lines = [line for line in log.splitlines() if READY in line]
    if not lines:
        return "-"
    before, _, after = lines[-1].partition(READY)
    return f"zygote {before.split()[-1]}{READY}{after}"


def _paired(lab: _Lab, name: str, kinds: tuple[str, ...], n: int,
            env: dict[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``n`` runs of each kind, alternated run by run (the order rotating each round)."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for i in range(n):
        shift = i % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            runs[kind].append(lab.run(kind, name, env=env))
    return runs


def _summary(runs: list[dict[str, Any]], want_forked: bool | None) -> dict[str, Any]:
    good = [r for r in runs if not r.get("problem")
            and (want_forked is None or r["forked"] == want_forked)]
    return {"runs": runs, "seconds": [r["seconds"] for r in runs],
            "forked": [bool(r["forked"]) for r in runs], "stats": stats([r["seconds"] for r in good]),
            "median": statistics.median([r["seconds"] for r in good]) if good else None,
            "failed": sum(1 for r in runs if r.get("problem"))}


def run_warm_scripts(unet: Path, llama: Path, repeat: int, env: dict[str, str],
                     progress: Progress, log_dir: Path, timeout: float) -> dict[str, Any]:
    """Run the case on the suite's UNet and Llama folders; JSON-ready results, with ``errors``
    (everything it started is stopped before it returns or raises)."""
    errors: list[str] = []
    result: dict[str, Any] = {"repeat": repeat, "trivial_runs": max(repeat, TRIVIAL_MIN_RUNS),
                              "unet_path": str(unet), "llama_path": str(llama), "limits": LIMITS,
                              "python": sys.executable, "errors": errors}
    lab = _Lab(env, unet, llama, log_dir, timeout)
    try:
        lab.write_scripts()
        result["work"] = str(lab.work)
        result["zygote_dir"] = str(lab.paths.directory)
        result["setup"] = _setup(lab, progress, errors)
        scripts: dict[str, Any] = {}
        result["scripts"] = scripts
        for name, title in SCRIPTS.items():
            n = result["trivial_runs"] if name == "hello" else repeat
            progress(f"warm-scripts: {name}: {n} runs each of python and overmind-lab run, "
                     "alternated")
            runs = _paired(lab, name, ("plain", "warm"), n)
            plain, warm = _summary(runs["plain"], False), _summary(runs["warm"], True)
            unforked = sum(1 for r in runs["warm"] if not r.get("problem") and not r["forked"])
            cold = sorted({o for r in runs["plain"] + runs["warm"] for o in r.get("outcomes", [])
                           if o != "warm"} | {f"({why})" for r in runs["plain"] + runs["warm"]
                                               for why in r.get("reasons", [])})
            for kind, summary in (("python", plain), ("overmind-lab run", warm)):
                if summary["failed"]:
                    first = next(r["problem"] for r in summary["runs"] if r.get("problem"))
                    errors.append(f"{name}: {summary['failed']} {kind} run(s) failed: {first}")
            if unforked:
                errors.append(f"{name}: {unforked} of {n} overmind-lab run runs were not forked "
                              "from the zygote (not timed)")
            if any(r["forked"] for r in runs["plain"]):
                errors.append(f"{name}: a plain python run says it was forked")
            if cold:
                errors.append(f"{name}: a load through the cache was not a warm hit: "
                              f"{', '.join(cold)}")
            all_forked = not unforked and not warm["failed"]
            scripts[name] = {
                "title": title, "runs": n, "plain": plain, "warm": warm,
                "all_forked": all_forked,
                "ratio_warm_over_plain": (warm["median"] / plain["median"]
                                          if warm["median"] and plain["median"] else None),
            }
            progress(f"warm-scripts: {name}: python {fmt(plain['median'])}, overmind-lab run "
                     f"{fmt(warm['median'])} ({_ratio_text(scripts[name]['ratio_warm_over_plain'])}"
                     f"); forked {sum(warm['forked'])}/{n}")
        result["fallback"] = _fallback(lab, result["trivial_runs"], progress, errors)
        result["renewals"] = lab.zygote_log().count("starting a zygote that also preloads")
        result["zygote_pids"] = lab.zygote_pids()
        result["zygote_log_tail"] = lab.zygote_log()[-3000:]
    finally:
        lab.close()
    return result


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _fallback(lab: _Lab, n: int, progress: Progress, errors: list[str]) -> dict[str, Any]:
    progress(f"warm-scripts: fallback: {n} runs each of python hello.py, overmind-lab run "
             f"hello.py where no zygote can serve ({lab.open_dir}, mode 0777) and overmind-lab run "
             "--plain hello.py, alternated")
    runs = _paired(lab, "hello", ("plain", "warm", "run-plain"), n, env=lab.open_env)
    out: dict[str, Any] = {"folder": str(lab.open_dir), "runs": n,
                           **{kind: _summary(runs[kind], False) for kind in runs}}
    for kind in runs:
        if out[kind]["failed"]:
            first = next(r["problem"] for r in out[kind]["runs"] if r.get("problem"))
            errors.append(f"fallback: {out[kind]['failed']} {kind} run(s) failed: {first}")
        if any(r["forked"] for r in runs[kind]):
            errors.append(f"fallback: a {kind} run was forked where no zygote can serve")
    left = sorted(p.name for p in lab.open_dir.iterdir())
    procs = zygote_processes(lab.open_dir)
    out["zygote_started"] = bool(procs or any(name.startswith("zygote-") for name in left))
    out["folder_files"] = left
    if out["zygote_started"]:
        errors.append(f"fallback: a zygote started in the open folder {lab.open_dir}: "
                      f"{left}, pids {procs}")
    plain = out["plain"]["median"]
    for kind in ("warm", "run-plain"):
        med = out[kind]["median"]
        out[kind]["extra_ms"] = None if med is None or plain is None else (med - plain) * 1000
    progress(f"warm-scripts: fallback: python hello.py {fmt(plain)}, overmind-lab run "
             f"{fmt(out['warm']['median'])} (+{_ms(out['warm']['extra_ms'])}), --plain "
             f"{fmt(out['run-plain']['median'])} (+{_ms(out['run-plain']['extra_ms'])}); zygote "
             f"started: {'YES' if out['zygote_started'] else 'no'}")
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


# -- results.md ------------------------------------------------------------------------------
def _cell(summary: dict[str, Any]) -> str:
    st = summary.get("stats")
    if not st:
        return "-"
    return f"{fmt(st['median'])} ({fmt(st['min'])}–{fmt(st['max'])})"


def markdown(ws: dict[str, Any] | None) -> list[str]:
    """The warm-scripts section of ``results.md``."""
    if not ws:
        return []
    lines = ["", "## Warm scripts: `python SCRIPT` vs `overmind-lab run SCRIPT`", ""]
    if ws.get("error"):
        return lines + [f"Not measured: {ws['error']}"]
    lines += [f"Fresh processes started as a shell starts them, timed from the start to the exit; "
              f"plain and `overmind-lab run` alternated run by run, medians (min–max) of "
              f"{ws.get('repeat')} runs each ({ws.get('trivial_runs')} for `print(\"hi\")` and "
              f"the fallback); the daemon's cache warm (the plain runs load through it too); the "
              f"zygote with the default preload set and the scripts' imports learned (one run of "
              f"each, then a replacement zygote). *forked*: warm runs that ran forked from the "
              f"zygote (an unforked one is an error, not timed).", "",
              "| script | python | overmind-lab run | run/python | forked |",
              "| --- | ---: | ---: | ---: | :---: |"]
    for name, s in (ws.get("scripts") or {}).items():
        forked = s["warm"]["forked"]
        lines.append(f"| {s.get('title', name)} | {_cell(s['plain'])} | {_cell(s['warm'])} | "
                     f"{_ratio_text(s.get('ratio_warm_over_plain'))} | "
                     f"{sum(forked)}/{len(forked)}{'' if s.get('all_forked') else ' ⚠'} |")
    fb = ws.get("fallback") or {}
    if fb:
        lines += ["", f"Fallback, where no zygote can serve (`OVERMIND_LAB_SOCKET` in a fresh "
                      f"folder of mode 0777, where none may start), {fb.get('runs')} runs each, "
                      f"alternated: a zygote started there: "
                      f"{'**YES**' if fb.get('zygote_started') else 'no'}.", "",
                  "| command | median (min–max) | minus `python hello.py` |",
                  "| --- | ---: | ---: |",
                  f"| `python hello.py` | {_cell(fb['plain'])} | |",
                  f"| `overmind-lab run hello.py` (no zygote) | {_cell(fb['warm'])} | "
                  f"{_ms(fb['warm'].get('extra_ms'))} |",
                  f"| `overmind-lab run --plain hello.py` | {_cell(fb['run-plain'])} | "
                  f"{_ms(fb['run-plain'].get('extra_ms'))} |"]
    setup = ws.get("setup") or {}
    replaced = setup.get("replaced") or {}
    if setup:
        first = setup.get("first_runs") or {}
        lines += ["", "Setup: the cache filled by plain runs; first `overmind-lab run` runs (plain "
                      "until the zygote, started by the first, serves) "
                      + ", ".join(f"{name} {fmt(r.get('seconds'))} "
                                  f"({'forked' if r.get('forked') else 'plain'})"
                                  for name, r in first.items())
                      + f"; the zygote ready {setup.get('ready_wait_seconds', 0):.1f} s after them; "
                      f"its replacement with the learned imports ({replaced.get('preloaded')} "
                      f"modules) served {fmt(replaced.get('replace_seconds'))} after the request. "
                      f"Renewals of the zygote during the case: {ws.get('renewals', 0)}."]
    return lines
