"""The ``warm-kernel`` case: kernel restarts through a real Jupyter server, plain vs warm.

A ``jupyter server`` (:mod:`benchmarks._server`) is started with private runtime,
config and data directories and two kernelspecs on its ``JUPYTER_PATH``, ``bench-plain``
and ``bench-warm`` (same interpreter and argv; the warm one selects the
``overmind-lab-warm`` provisioner), a private daemon and, beside its socket, a private
zygote directory. Kernels are driven as JupyterLab drives them: ``POST api/kernels``,
``POST api/kernels/<id>/restart`` and the server's websocket. For each kernelspec:

- ``restart_seconds``: from the restart request to the first ``kernel_info_reply`` on a
  new websocket (what JupyterLab waits for before the kernel shows "idle");
- ``cell_seconds``: the model's load cell right after the restart, imports included,
  with ``%overmind_load`` and a warm cache: the SD 1.5 pipeline (fp16) and a Llama-style
  1.1B causal LM (bf16, random weights: the ``llama`` model of ``_more_models.py``);
- ``timeline``: per restart, every step's offset from the restart request (Note [Restart
  timeline]): the client's (``client.*``), jupyter_client's in the server (``server.*``, hooks
  in the private ``jupyter_server_config.py``), ipykernel's in the old and the new kernel
  (``kernel.*``, hooks in the private ``ipython_kernel_config.py``, plain and warm alike) and
  overmind-lab's own (``provisioner.*``, ``zygote.*``, ``child.*``, ``$OVERMIND_LAB_TIMELINE``);
  medians in ``timeline_ms``, the table in ``timeline_table``;
- ``first_restart``: a fresh server's first kernel of the warm kernelspec (plain: no zygote
  runs yet; it starts one) loads the SD 1.5 pipeline (the cache's first load), then, once the
  zygote serves and 2 s after the cell, one restart and the cell again: from the restart
  request to the cell done (Note [A standby for a plain kernel's restart]); once per run;
- ``pss``: summed PSS of 4 idle kernels that imported torch, diffusers and transformers
  (warm kernels also with the zygote's own PSS and their standbys kept ready added).

Medians of ``repeat`` restarts. This process never imports torch (the models are built by
the benchmark's build step, in a child). The server, the
kernels, the zygote and the daemon are stopped at the end, also on an error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks._memory import read_smaps_rollup
from benchmarks._numbers import median_or_none
from benchmarks._server import JupyterServer, WsKernel
from benchmarks._service import PrivateDaemon
from overmind_lab._common.zygote_client import TIMELINE_ENV, timeline

__all__ = ["LIMITS", "run_warm_kernel"]

#: The targets: SD cell after a restart (warm kernel, warm cache) in seconds and as a
#: fraction of the plain kernel's; the Llama cell in seconds; 4 warm kernels' PSS in
#: plain kernels.
LIMITS = {"sd_cell_seconds": 1.0, "sd_cell_ratio": 0.15, "llama_cell_seconds": 0.5,
          "pss_plain_kernels": 2.0}
KERNELS = 4
QUICK_KERNELS = 2
#: Seconds between a restart's cell and the next restart (both kinds of kernel).
RESTART_PAUSE_S = 2.0

SD_CELL = """\
%load_ext overmind_lab
%overmind_load
import torch
from diffusers import StableDiffusionPipeline
pipe = StableDiffusionPipeline.from_pretrained({path!r}, dtype=torch.float16)
"""

LLAMA_CELL = """\
%load_ext overmind_lab
%overmind_load
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16)
"""

IDLE_CELL = "import torch, diffusers, transformers\n"
#: Run after the timed cell: the kernel's pid and its parent's (the zygote's when forked).
PIDS_CELL = "import os; print(os.getpid(), os.getppid())\n"

Progress = Callable[[str], None]

#: Appends one step to ``$OVERMIND_LAB_TIMELINE`` (the hooks below; no overmind-lab import).
_STAMP = """\
import json as _json, os as _os, time as _time


def _stamp(event):
    path = _os.environ.get("OVERMIND_LAB_TIMELINE")
    if path:
        with open(path, "a") as f:
            f.write(_json.dumps({"event": event, "t": _time.time(), "pid": _os.getpid()}) + "\\n")


def _hook(cls, name, label, is_async):
    import functools
    orig = getattr(cls, name)
    if is_async:
        @functools.wraps(orig)
        async def wrapper(self, *a, **k):
            _stamp(label + ".start")
            try:
                return await orig(self, *a, **k)
            finally:
                _stamp(label + ".end")
    else:
        @functools.wraps(orig)
        def wrapper(self, *a, **k):
            _stamp(label + ".start")
            try:
                return orig(self, *a, **k)
            finally:
                _stamp(label + ".end")
    setattr(cls, name, wrapper)
"""

#: The server's jupyter_client steps (both kernelspecs).
SERVER_HOOKS = _STAMP + """
from jupyter_client.manager import KernelManager as _KM
for _name, _label in (("_async_interrupt_kernel", "server.interrupt"),
                      ("_async_request_shutdown", "server.request_shutdown"),
                      ("_async_finish_shutdown", "server.finish_shutdown"),
                      ("_async_cleanup_resources", "server.cleanup"),
                      ("_async_launch_kernel", "server.launch_kernel"),
                      ("_async_post_start_kernel", "server.post_start")):
    _hook(_KM, _name, _label, True)
"""

#: ipykernel's steps in every kernel, plain or warm.
KERNEL_HOOKS = _STAMP + """
import atexit as _atexit
_stamp("kernel.config_loaded")
_atexit.register(_stamp, "kernel.atexit")
from ipykernel.kernelapp import IPKernelApp as _App
from ipykernel.kernelbase import Kernel as _K
for _name in ("init_sockets", "init_kernel", "init_shell", "start"):
    _hook(_App, _name, "kernel." + _name, False)
for _name in ("shutdown_request", "kernel_info_request"):
    _hook(_K, _name, "kernel." + _name, True)
"""

#: The steps of the timeline table, in order; ``.start`` of a hook is its first call in the
#: window (a restart's), ``.end`` its first return.
TIMELINE_STEPS = (
    ("client.restart_request", "restart request (POST .../restart)"),
    ("server.interrupt.start", "server: interrupt the old kernel (jupyter_client)"),
    ("server.request_shutdown.start", "server: shutdown_request sent"),
    ("provisioner.shutdown_requested", "provisioner: shutdown requested"),
    ("provisioner.standby", "provisioner: standby requested (Note [A standby for the restart])"),
    ("zygote.fork_request", "zygote: fork request read"),
    ("zygote.checked", "zygote: checks done (stale files, identity, threads)"),
    ("zygote.forked", "zygote: fork() returned"),
    ("zygote.fork_reply", "zygote: reply sent (child took on attributes)"),
    ("child.become", "child: become done"),
    ("child.run_module", "child: runpy ipykernel_launcher"),
    ("kernel.config_loaded", "new kernel: config loaded (imports done)"),
    ("child.standby", "standby: at init_sockets, waits for go"),
    ("kernel.shutdown_request.start", "old kernel: shutdown_request received"),
    ("kernel.shutdown_request.end", "old kernel: shutdown_reply sent, _at_shutdown done"),
    ("kernel.atexit", "old kernel: ipykernel's atexit handlers ran"),
    ("child.learned", "old kernel (forked): learned modules recorded"),
    ("child.exit", "old kernel (forked): exits"),
    ("provisioner.exit_seen", "provisioner: exit seen"),
    ("server.finish_shutdown.end", "server: old kernel gone (finish_shutdown)"),
    ("server.cleanup.end", "server: cleanup done"),
    ("server.launch_kernel.start", "server: launch_kernel"),
    ("provisioner.launch.start", "provisioner: launch_kernel start"),
    ("provisioner.standby_go", "provisioner: standby told to go"),
    ("child.go", "new kernel: go received, ports bound"),
    ("provisioner.launch.end", "provisioner: launch_kernel end"),
    ("server.launch_kernel.end", "server: launch_kernel end"),
    ("kernel.init_sockets.end", "new kernel: sockets bound"),
    ("kernel.init_kernel.end", "new kernel: Kernel object made"),
    ("kernel.init_shell.end", "new kernel: shell made"),
    ("kernel.start.start", "new kernel: ready (IPKernelApp.start)"),
    ("server.post_start.end", "server: post_start_kernel done"),
    ("kernel.kernel_info_request.start", "new kernel: first kernel_info_request"),
    ("client.restart_reply", "client: restart reply (server saw kernel_info_reply)"),
    ("client.ws_connected", "client: websocket connected"),
    ("client.kernel_info_reply", "client: first kernel_info_reply"),
    ("client.execute_request", "client: execute_request sent"),
    ("client.execute_reply", "client: execute_reply"),
)


def _pids(kernel: WsKernel) -> tuple[int, int]:
    _, out = kernel.execute(PIDS_CELL)
    pid, ppid = out.split()[-2:]
    return int(pid), int(ppid)


class _Lab:
    """The private world of one run: a directory, a daemon, a zygote directory (the
    daemon socket's), kernelspecs and a Jupyter server. :meth:`close` stops them all."""

    def __init__(self, env: dict[str, str], log_dir: Path, timeout: float) -> None:
        self.timeout = timeout
        self.log_dir = log_dir
        self.daemon = PrivateDaemon(None, log_dir / "warm-kernel-daemon.log")
        self.dir = Path(self.daemon.socket).parent  # 0700; the zygotes' sockets go here
        self.kernels: list[WsKernel] = []
        self.env = {k: v for k, v in env.items() if not k.startswith("JPY_")}
        self.env.update(
            OVERMIND_LAB_SOCKET=self.daemon.socket, JUPYTER_PATH=str(self.dir / "share"),
            JUPYTER_CONFIG_DIR=str(self.dir / "config"), JUPYTER_DATA_DIR=str(self.dir / "data"),
            JUPYTER_RUNTIME_DIR=str(self.dir / "runtime"), IPYTHONDIR=str(self.dir / "ipython"),
            PYDEVD_DISABLE_FILE_VALIDATION="1", JUPYTER_PLATFORM_DIRS="1")
        self.timeline = self.dir / "timeline.jsonl"
        self.env[TIMELINE_ENV] = str(self.timeline)
        self.server = JupyterServer(self.env, log_dir / "warm-kernel-server.log",
                                    extra_args=(f"--ServerApp.root_dir={self.dir}",))

    def start(self, progress: Progress) -> None:
        from overmind_lab._jupyter_server.kernelspec import kernel_json

        self.daemon.start()
        for name, warm in (("bench-plain", False), ("bench-warm", True)):
            spec = kernel_json(f"overmind-lab bench ({name})")
            if not warm:  # ipykernel's own argv: the warm spec's launcher would fork too
                spec["metadata"].pop("kernel_provisioner")
                spec["argv"] = [sys.executable, "-m", "ipykernel_launcher", "-f",
                                "{connection_file}"]
            (self.dir / "share" / "kernels" / name).mkdir(parents=True)
            (self.dir / "share" / "kernels" / name / "kernel.json").write_text(json.dumps(spec))
        (self.dir / "config").mkdir(parents=True, exist_ok=True)
        (self.dir / "config" / "jupyter_server_config.py").write_text(SERVER_HOOKS)
        (self.dir / "ipython" / "profile_default").mkdir(parents=True, exist_ok=True)
        (self.dir / "ipython" / "profile_default" / "ipython_kernel_config.py").write_text(
            KERNEL_HOOKS)
        seconds = self.server.start()
        progress(f"warm-kernel: jupyter server up on port {self.server.port} in {seconds:.1f} s "
                 f"(private daemon and zygote directory {self.dir})")

    def kernel(self, name: str) -> WsKernel:
        k = WsKernel(self.server, name, self.timeout, mark=self.mark)
        self.kernels.append(k)
        return k

    def mark(self, event: str) -> None:
        timeline(event, self.env)

    def steps_since(self, t0: float, t1: float) -> dict[str, float]:
        """Each step's first time in ``[t0, t1]``, in seconds after ``t0`` (the become's
        sub-steps as ``child.become:<step>`` in ms)."""
        out: dict[str, float] = {}
        with contextlib.suppress(FileNotFoundError):
            for line in self.timeline.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    t = float(ev["t"])
                    if t0 <= t <= t1 and ev["event"] not in out:
                        out[ev["event"]] = t - t0
                        for step, ms in (ev.get("steps") or {}).items():
                            out[f"child.become:{step}"] = ms / 1000
        return out

    def drop(self, kernel: WsKernel) -> None:
        kernel.close()
        self.kernels.remove(kernel)

    def zygote(self, not_pid: int | None = None) -> dict[str, Any]:
        return serving_zygote(self.dir, self.timeout, self.log_dir / "warm-kernel-server.log",
                              not_pid)

    def zygote_pids(self) -> set[int]:
        return zygote_pids(self.dir)

    def close(self) -> None:
        for k in list(self.kernels):
            self.drop(k)
        self.server.stop()
        with contextlib.suppress(OSError):  # every step of the run, beside the logs
            (self.log_dir / "warm-kernel-timeline.jsonl").write_bytes(self.timeline.read_bytes())
        # zygotes and forked kernels name the directory in their command line, plain
        # kernels their connection file in its runtime/
        for pid in marked(str(self.dir)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.daemon.stop()


def serving_zygote(folder: Path, timeout: float, log: Path,
                   not_pid: int | None = None) -> dict[str, Any]:
    """The status of the zygote serving in ``folder`` once one does (and is not ``not_pid``)."""
    from overmind_lab._jupyter_server.kernelspec import zygotes

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for z in zygotes(folder):
            if z["pid"] != not_pid and not z["retiring"]:
                return z
        time.sleep(0.2)
    raise RuntimeError(f"no zygote became ready in {folder}; see {log}")


def zygote_pids(folder: Path) -> set[int]:
    from overmind_lab._jupyter_server.kernelspec import zygotes

    return {int(z["pid"]) for z in zygotes(folder)}


def marked(marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                if marker in cmd:
                    out.append(int(entry))
    return out


@contextlib.contextmanager
def _lab(env: dict[str, str], log_dir: Path, timeout: float, progress: Progress) -> Iterator[_Lab]:
    lab = _Lab(env, log_dir, timeout)
    try:
        lab.start(progress)
        yield lab
    finally:
        lab.close()


def _restarts(lab: _Lab, name: str, cell: str, repeat: int, progress: Progress) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("plain", "warm"):
        k = lab.kernel(f"bench-{kind}")
        try:
            progress(f"warm-kernel: {name} {kind}: first cell "
                     f"({'fills the cache' if kind == 'plain' else 'the zygote learns its imports'})")
            k.execute(cell)
            if kind == "warm":
                from overmind_lab._jupyter_server.kernelspec import restart_zygotes

                k.restart()  # the kernel's exit records the modules it imported
                old = lab.zygote()["pid"]
                progress(f"warm-kernel: {name}: a new zygote with the cached classes")
                restart_zygotes(lab.dir)
                lab.zygote(not_pid=old)
            restarts: list[float] = []
            cells: list[float] = []
            forked: list[bool] = []
            steps: list[dict[str, float]] = []
            for i in range(repeat):
                one = _timed_restart(lab, k, cell)
                restarts.append(one.restart)
                cells.append(one.cell)
                steps.append(one.steps)
                forked.append(one.forked)
                progress(f"warm-kernel: {name} {kind} {i + 1}/{repeat}: restart "
                         f"{restarts[-1]:.2f} s, cell {cells[-1]:.2f} s"
                         f"{' (forked)' if forked[-1] else ''}")
            out[kind] = {"restart_seconds": median_or_none(restarts), "cell_seconds": median_or_none(cells),
                         "restart_all": restarts, "cell_all": cells, "forked": forked,
                         "timeline_ms": _timeline_medians(steps), "timeline_all": steps}
        finally:
            lab.drop(k)
    out["timeline_table"] = timeline_table(out["plain"]["timeline_ms"],
                                           out["warm"]["timeline_ms"], repeat)
    out["ratios"] = {
        "restart_warm_over_plain": out["warm"]["restart_seconds"] / out["plain"]["restart_seconds"],
        "cell_warm_over_plain": out["warm"]["cell_seconds"] / out["plain"]["cell_seconds"],
    }
    return out


class _Restart(NamedTuple):
    restart: float  # seconds from the request to the first kernel_info_reply
    cell: float  # seconds of the cell after it
    total: float  # seconds from the request to the cell done
    steps: dict[str, float]  # Lab.steps_since the request
    forked: bool  # the new kernel's parent is a zygote


def _timed_restart(lab: _Lab, k: WsKernel, cell: str) -> _Restart:
    """One restart of ``k`` and ``cell`` right after it, timed. A user restarts after reading
    the last cell's output, not within a second of the launch: a standby kept ready (Note [A
    standby kept ready]) is forked a second after each launch. Every kernel gets the same
    pause before."""
    time.sleep(RESTART_PAUSE_S)
    t0 = time.time()
    restart = k.restart()
    cell_seconds = k.execute(cell)[0]
    total = time.time() - t0
    steps = lab.steps_since(t0, time.time())
    return _Restart(restart, cell_seconds, total, steps, _pids(k)[1] in lab.zygote_pids())


def _first_restart(lab: _Lab, cell: str, progress: Progress) -> dict[str, Any]:
    """A fresh server's first kernel (plain, the zygote starting), its first cell, then its
    first restart once the zygote serves: seconds from the request to the cell done."""
    k = lab.kernel("bench-warm")
    try:
        first = k.execute(cell)[0]
        lab.zygote()
        one = _timed_restart(lab, k, cell)
    finally:
        lab.drop(k)
    progress(f"warm-kernel: a fresh server's first restart: {one.total:.2f} s to the SD cell "
             f"done (restart {one.restart:.2f} s, cell {one.cell:.2f} s"
             f"{', forked' if one.forked else ''}; its first cell, the cache's first load: "
             f"{first:.2f} s)")
    return {"first_cell_seconds": first, "restart_seconds": one.restart,
            "cell_seconds": one.cell, "total_seconds": one.total, "forked": one.forked,
            "timeline_ms": {name: 1000 * t for name, t in one.steps.items()}}


def _timeline_medians(steps: list[dict[str, float]]) -> dict[str, float]:
    names = {name for s in steps for name in s}
    return {name: 1000 * statistics.median([s[name] for s in steps if name in s])
            for name in sorted(names)}


def timeline_table(plain: dict[str, float], warm: dict[str, float], repeat: int) -> list[str]:
    """The restart timeline as Markdown lines: each step's median offset from the restart
    request (ms), plain and warm side by side."""
    def cell(d: dict[str, float], key: str) -> str:
        return f"{d[key]:.0f}" if key in d else "-"

    lines = [f"Restart timeline: median ms after the restart request ({repeat} restarts)", "",
             "| step | event | plain | warm |", "| --- | --- | ---: | ---: |"]
    for key, title in TIMELINE_STEPS:
        lines.append(f"| {title} | `{key}` | {cell(plain, key)} | {cell(warm, key)} |")
    sub = sorted(k for k in warm if k.startswith("child.become:"))
    if sub:
        lines += ["", "Forked child's `become` steps (median ms): " + ", ".join(
            f"{k.partition(':')[2]} {warm[k]:.2f}" for k in sub)]
    return lines


def _memory(lab: _Lab, n: int, progress: Progress) -> dict[str, Any]:
    out: dict[str, Any] = {"kernels": n}
    for kind in ("plain", "warm"):
        kernels = [lab.kernel(f"bench-{kind}") for _ in range(n)]
        try:
            pids = []
            for k in kernels:
                k.execute(IDLE_CELL)
                pids.append(_pids(k))
            time.sleep(1.0)
            zygotes = lab.zygote_pids()
            out[f"{kind}_pss"] = [read_smaps_rollup(pid).get("Pss", 0) for pid, _ in pids]
            out[f"{kind}_sum_bytes"] = sum(out[f"{kind}_pss"])
            out[f"{kind}_forked"] = [ppid in zygotes for _, ppid in pids]
            if kind == "warm":
                out["zygote_pss_bytes"] = read_smaps_rollup(lab.zygote()["pid"]).get("Pss", 0)
                # Note [A standby kept ready]: each kernel's next one waits beside it
                standbys = _children(zygotes) - {pid for pid, _ in pids}
                out["standby_pss"] = [read_smaps_rollup(pid).get("Pss", 0) for pid in standbys]
            progress(f"warm-kernel: {n} idle {kind} kernels: "
                     f"{out[f'{kind}_sum_bytes'] / 2**20:.0f} MiB PSS")
        finally:
            for k in kernels:
                lab.drop(k)
    one_plain = out["plain_sum_bytes"] / n
    out["warm_in_plain_kernels"] = out["warm_sum_bytes"] / one_plain
    out["warm_with_zygote_in_plain_kernels"] = (
        (out["warm_sum_bytes"] + out["zygote_pss_bytes"] + sum(out["standby_pss"])) / one_plain)
    return out


def _children(parents: set[int]) -> set[int]:
    """The processes whose parent is one of ``parents``."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid in parents:
            found.add(int(entry))
    return found


def run_warm_kernel(sd_path: Path, llama: Path, quick: bool, repeat: int,
                    env: dict[str, str], progress: Progress, log_dir: Path,
                    timeout: float) -> dict[str, Any]:
    """Run the case on the built SD 1.5 pipeline and Llama directories; JSON-ready results
    (raises on failure; everything it started is stopped first)."""
    result: dict[str, Any] = {"repeat": repeat, "sd_path": str(sd_path), "llama_path": str(llama),
                              "limits": LIMITS}
    with _lab(env, log_dir, timeout, progress) as lab:
        result["server_pid"] = lab.server.pid
        progress("warm-kernel: first warm launch (plain; it starts the zygote)")
        result["first_restart"] = _first_restart(lab, SD_CELL.format(path=str(sd_path)),
                                                 progress)
        result["zygote_pid"] = lab.zygote()["pid"]
        result["sd15"] = _restarts(lab, "sd15", SD_CELL.format(path=str(sd_path)), repeat,
                                   progress)
        for line in result["sd15"]["timeline_table"]:
            progress(f"warm-kernel: {line}")
        result["llama"] = _restarts(lab, "llama", LLAMA_CELL.format(path=str(llama)), repeat,
                                    progress)
        result["pss"] = _memory(lab, QUICK_KERNELS if quick else KERNELS, progress)
        result["zygote_pids"] = sorted(lab.zygote_pids())
        result["dir"] = str(lab.dir)
    return result
