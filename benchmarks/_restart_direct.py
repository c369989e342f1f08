"""The ``restart-direct`` case: kernel restarts driven by jupyter_client directly, no server.

nbclient, papermill, scripts and VS Code drive a kernel without a Jupyter server: a
``jupyter_client.manager.KernelManager`` (or their own launch of the kernelspec's argv) and a
client talking ZMQ to the kernel. Here the same, in this process: one
``KernelManager(kernel_name=...)`` with its default settings and a blocking client
(``km.client()``) per kernelspec, timed from ``km.restart_kernel()`` to the UNet load cell done
(its ``execute_reply`` on the shell channel and its ``idle`` status on IOPub, as
``execute_interactive`` waits for them). Three kernelspecs, on a private ``JUPYTER_PATH``
(``JUPYTER_*`` and ``IPYTHONDIR`` private too, set in this process's environment for the case
and restored after), a private daemon and, beside its socket, a private zygote directory:

- ``plain``: ipykernel's own argv, no provisioner;
- ``warm``: :func:`overmind_lab._jupyter_server.kernelspec.kernel_json` as is (its metadata
  selects the ``overmind-lab-warm`` provisioner: the kernel is forked from the zygote);
- ``warm-launcher``: the same without ``metadata.kernel_provisioner``: jupyter_client's
  ``LocalProvisioner`` runs the spec's argv, overmind-lab's launcher, whose kernel is forked
  from the zygote (what VS Code does: it runs the argv itself).

The cell: ``%load_ext overmind_lab``, ``%overmind_load``, ``import torch``,
``UNet2DConditionModel.from_pretrained(<pipeline>/unet, dtype=torch.float16)`` (the plain kernel
without the two magic lines). Before the timed restarts, per kernelspec: start,
``wait_for_ready``, the cell (the first warm one stores the entry); for the warm kinds a restart
once a zygote serves and the cell in a forked kernel, then (once per run) the restart whose exit
records the modules it imported, a new zygote that preloads them (``restart_zygotes``, as the
``warm-kernel`` case does), one more restart and the cell; then the daemon's background work
awaited (``wait_quiet``). Then ``repeat`` rounds of three modes, in turn:

- ``pause``: 2 s after the last cell, ``restart_kernel()``, the cell sent at once;
- ``no-pause``: ``restart_kernel()`` right after the previous cell, the cell sent at once;
- ``ready``: 2 s after the last cell, ``restart_kernel()``, ``kc.wait_for_ready()``, the cell.

``wait_for_ready`` costs any kernel that restarts as a new process a floor of about 0.3 s
before the first cell (Note [A floor in wait_for_ready] below). With ``--quick`` the plain
kernel, whose every cell imports torch and diffusers for seconds, runs one round (the warm
kinds ``repeat``). Each restart records
``restart_kernel()`` seconds, ``wait_for_ready`` seconds (mode ``ready``), cell seconds, their
total, the reply's status, whether the kernel's parent is a zygote (``forked``: asked on the
shell channel after the timing) and overmind-lab's own steps (``$OVERMIND_LAB_TIMELINE``).
Medians per kind and mode; warm / plain ratios of the medians of the totals per mode.

Note [A floor in wait_for_ready]: jupyter_client's ``wait_for_ready`` sends ``kernel_info`` until
a ``kernel_info_reply`` is followed within 0.2 s by an IOPub message, then reads IOPub until
0.2 s pass without one. After a restart the client's sockets (the same ports) lost their TCP
connections with the old kernel: libzmq tries again ``reconnect_ivl`` (100 ms) plus a random
jitter of up to ``reconnect_ivl`` later, 100-199 ms, and so on until the new kernel has bound
its ports; only then do requests and IOPub messages flow (each socket on its own: an IOPub that
connects after the shell loses the ``kernel_info``'s status messages, and a round of 0.2 s
starts again). So a kernel that binds at once is reached ~0.1-0.2 s after the old one's sockets
closed, and ``wait_for_ready`` returns 0.2 s of silence after that: ~0.3 s before any cell,
whatever the kernel (plain or forked) and however fast it starts. A cell sent at once waits for
the same reconnection in the client's DEALER socket, but not for the silence.

This process never imports torch. Everything the case starts (kernels, launchers, standbys,
zygotes, the daemon) is stopped at the end, also on an error or Ctrl-C: the kernels through
their managers, then every process whose command line names the private directory (zygotes and
kernels forked from them keep the zygote's command line; plain kernels and launchers name their
connection file in its ``runtime/``), then the daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks._numbers import fmt, median_or_none, ratio
from benchmarks._service import PrivateDaemon
from benchmarks._warm_kernel import marked, serving_zygote, zygote_pids
from overmind_lab._common.zygote_client import TIMELINE_ENV

__all__ = ["KINDS", "LIMITS", "MODES", "markdown", "run_restart_direct"]

Progress = Callable[[str], None]

#: The targets: a warm kind's restart -> cell done (modes ``pause`` and ``no-pause``) in
#: seconds and as a fraction of the plain kernel's.
LIMITS = {"warm_seconds": 0.3, "warm_ratio": 0.05}
#: The kernelspecs, in run order, with their titles.
KINDS = {
    "plain": "plain (ipykernel's argv, no provisioner)",
    "warm": "warm (overmind-lab-warm provisioner)",
    "warm-launcher": "warm launcher (spec's argv run by LocalProvisioner, as VS Code)",
}
WARM_KINDS = ("warm", "warm-launcher")
#: The modes of a timed restart, in run order within a round, with their titles.
MODES = {
    "pause": "2 s pause, restart, execute at once",
    "no-pause": "restart right after the last cell, execute at once",
    "ready": "2 s pause, restart, wait_for_ready, execute",
}
#: Seconds between the last cell and a restart (modes ``pause`` and ``ready``): a user
#: restarts after reading the output (a warm kernel's next one is forked a second after its
#: launch: Note [A standby kept ready]).
RESTART_PAUSE_S = 2.0
#: Note [A floor in wait_for_ready]: 0.2 s of IOPub silence plus libzmq's reconnection
#: (100-199 ms), roughly.
READY_FLOOR_S = 0.3
#: How long a cell's ``idle`` on IOPub is awaited after its ``execute_reply``.
IDLE_GRACE_S = 2.0

CELL = """\
%load_ext overmind_lab
%overmind_load
import torch
from diffusers import UNet2DConditionModel
m = UNet2DConditionModel.from_pretrained({path!r}, dtype=torch.float16)
"""
PLAIN_CELL = """\
import torch
from diffusers import UNet2DConditionModel
m = UNet2DConditionModel.from_pretrained({path!r}, dtype=torch.float16)
"""
#: Asked after the timing, on the shell channel alone: the kernel's pid and its parent's.
PIDS_EXPRESSION = "__import__('os').getpid(), __import__('os').getppid()"


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (jupyter_client reads its paths there), as it was after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _Kernel:
    """One kernelspec's manager and blocking client."""

    def __init__(self, name: str, log: Any, timeout: float) -> None:
        from jupyter_client.manager import KernelManager

        self.timeout = timeout
        self.km = KernelManager(kernel_name=name)
        self.km.start_kernel(stdout=log, stderr=log)
        self.kc = self.km.client()
        self.kc.start_channels()

    def wait_ready(self) -> None:
        self.kc.wait_for_ready(timeout=self.timeout)

    def run(self, code: str) -> tuple[str, float, bool]:
        """Execute ``code``: the reply's status, the seconds to the cell done (its reply and its
        ``idle``), whether the ``idle`` came (else the seconds to the reply)."""
        import zmq

        kc = self.kc
        t0 = time.perf_counter()
        msg_id = kc.execute(code, stop_on_error=True)
        poller = zmq.Poller()
        poller.register(kc.iopub_channel.socket, zmq.POLLIN)
        poller.register(kc.shell_channel.socket, zmq.POLLIN)
        reply: dict[str, Any] | None = None
        replied = idle = None
        deadline = time.monotonic() + self.timeout
        while reply is None or idle is None:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"no reply to the cell in {self.timeout:g} s")
            if replied is not None and time.perf_counter() - replied > IDLE_GRACE_S:
                break  # IOPub lost the cell's status: the reply ends the cell
            events = dict(poller.poll(100))
            if kc.iopub_channel.socket in events:
                msg = kc.iopub_channel.get_msg(timeout=0)
                if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                        and msg["content"].get("execution_state") == "idle"):
                    idle = time.perf_counter()
            if kc.shell_channel.socket in events:
                msg = kc.shell_channel.get_msg(timeout=0)
                if msg["parent_header"].get("msg_id") == msg_id:
                    reply, replied = msg, time.perf_counter()
        assert reply is not None and replied is not None
        done = replied if idle is None else max(idle, replied)
        return str(reply["content"].get("status")), done - t0, idle is not None

    def pids(self) -> tuple[int, int]:
        reply = self.kc.execute("", silent=True, user_expressions={"pids": PIDS_EXPRESSION},
                                reply=True, timeout=self.timeout)
        value = reply["content"]["user_expressions"]["pids"]
        if value.get("status") != "ok":
            raise RuntimeError(f"the kernel's pids: {value}")
        pid, ppid = value["data"]["text/plain"].strip("() ").split(",")
        return int(pid), int(ppid)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=True)


class _Lab:
    """The private world of one run: a directory, a daemon, a zygote directory (the daemon
    socket's), kernelspecs. :meth:`close` stops everything started."""

    def __init__(self, env: dict[str, str], log_dir: Path, timeout: float) -> None:
        self.timeout = timeout
        self.log_dir = log_dir
        self.daemon = PrivateDaemon(None, log_dir / "restart-direct-daemon.log")
        self.dir = Path(self.daemon.socket).parent  # 0700; the zygotes' sockets go here
        self.kernels: list[_Kernel] = []
        self.env = {k: v for k, v in env.items() if not k.startswith("JPY_")}
        self.env.update(
            OVERMIND_LAB_SOCKET=self.daemon.socket, JUPYTER_PATH=str(self.dir / "share"),
            JUPYTER_CONFIG_DIR=str(self.dir / "config"), JUPYTER_DATA_DIR=str(self.dir / "data"),
            JUPYTER_RUNTIME_DIR=str(self.dir / "runtime"), IPYTHONDIR=str(self.dir / "ipython"),
            PYDEVD_DISABLE_FILE_VALIDATION="1", JUPYTER_PLATFORM_DIRS="1")
        self.timeline = self.dir / "timeline.jsonl"
        self.env[TIMELINE_ENV] = str(self.timeline)
        self.kernel_log: Any = None

    def start(self) -> None:
        from overmind_lab._jupyter_server.kernelspec import kernel_json

        self.daemon.start()
        self.kernel_log = open(self.log_dir / "restart-direct-kernels.log", "ab")  # noqa: SIM115
        for kind in KINDS:
            spec = kernel_json(f"overmind-lab bench ({kind})")
            if kind != "warm":  # the spec's argv is run by jupyter_client's LocalProvisioner
                spec["metadata"].pop("kernel_provisioner")
            if kind == "plain":  # ipykernel's own argv: the warm spec's launcher would fork too
                spec["argv"] = [sys.executable, "-m", "ipykernel_launcher", "-f",
                                "{connection_file}"]
            folder = self.dir / "share" / "kernels" / f"bench-{kind}"
            folder.mkdir(parents=True)
            (folder / "kernel.json").write_text(json.dumps(spec))

    def kernel(self, kind: str) -> _Kernel:
        k = _Kernel(f"bench-{kind}", self.kernel_log, self.timeout)
        self.kernels.append(k)
        return k

    def drop(self, kernel: _Kernel) -> None:
        kernel.close()
        self.kernels.remove(kernel)

    def zygote(self, not_pid: int | None = None) -> dict[str, Any]:
        return serving_zygote(self.dir, self.timeout,
                              self.log_dir / "restart-direct-kernels.log", not_pid)

    def zygote_pids(self) -> set[int]:
        return zygote_pids(self.dir)

    def steps_since(self, t0: float, t1: float) -> dict[str, float]:
        """overmind-lab's steps (``$OVERMIND_LAB_TIMELINE``) first seen in ``[t0, t1]``, in ms
        after ``t0``."""
        out: dict[str, float] = {}
        with contextlib.suppress(FileNotFoundError):
            for line in self.timeline.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    ev = json.loads(line)
                    t = float(ev["t"])
                    if t0 <= t <= t1 and ev["event"] not in out:
                        out[ev["event"]] = round(1000 * (t - t0), 1)
        return out

    def close(self) -> None:
        for k in list(self.kernels):
            self.drop(k)
        with contextlib.suppress(OSError):  # every step of the run, beside the logs
            (self.log_dir / "restart-direct-timeline.jsonl").write_bytes(
                self.timeline.read_bytes())
        # zygotes, standbys and forked kernels name the directory in their command line,
        # plain kernels and launchers their connection file in its runtime/
        for pid in marked(str(self.dir)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.daemon.stop()
        if self.kernel_log is not None:
            self.kernel_log.close()


def _timed(lab: _Lab, k: _Kernel, mode: str, cell: str) -> dict[str, Any]:
    """One restart of ``k`` in ``mode`` and the cell after it, timed."""
    if mode != "no-pause":
        time.sleep(RESTART_PAUSE_S)
    wall0 = time.time()
    t0 = time.perf_counter()
    k.km.restart_kernel()
    t1 = time.perf_counter()
    if mode == "ready":
        k.wait_ready()
    t2 = time.perf_counter()
    status, cell_seconds, idle_seen = k.run(cell)
    total = time.perf_counter() - t0
    steps = lab.steps_since(wall0, time.time())
    _, ppid = k.pids()
    return {"restart_seconds": t1 - t0, "ready_seconds": t2 - t1 if mode == "ready" else None,
            "cell_seconds": cell_seconds, "total_seconds": total, "status": status,
            "idle_seen": idle_seen, "forked": ppid in lab.zygote_pids(), "steps_ms": steps}


def _prepare(lab: _Lab, k: _Kernel, kind: str, cell: str, learned: bool,
             progress: Progress) -> dict[str, Any]:
    """The untimed start of a kernelspec: its first cell and, for the warm kinds, restarts until
    one is forked from a zygote that preloads the cell's imports."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    k.wait_ready()
    out["start_seconds"] = time.perf_counter() - t0
    status, out["first_cell_seconds"], _ = k.run(cell)
    if status != "ok":
        raise RuntimeError(f"{kind}: the first cell's status is {status!r}")
    progress(f"restart-direct: {kind}: started in {out['start_seconds']:.2f} s, first cell "
             f"{out['first_cell_seconds']:.2f} s")
    if kind in WARM_KINDS:
        from overmind_lab._jupyter_server.kernelspec import restart_zygotes

        lab.zygote()  # the first launch may have been plain (it starts the zygote)
        rounds = 1 if learned else 2
        for i in range(rounds):
            k.km.restart_kernel()  # the exit records the modules the kernel imported
            if i == 1:
                old = lab.zygote()["pid"]
                progress(f"restart-direct: {kind}: a new zygote with the cell's imports")
                restart_zygotes(lab.dir)
                lab.zygote(not_pid=old)
                k.km.restart_kernel()  # forked from the new zygote
            k.wait_ready()
            status, seconds, _ = k.run(cell)
            if status != "ok":
                raise RuntimeError(f"{kind}: the cell after a restart: status {status!r}")
            progress(f"restart-direct: {kind}: cell after a warm-up restart {seconds:.2f} s")
    lab.daemon.wait_quiet()
    return out


def _kind(lab: _Lab, kind: str, cell: str, repeat: int, learned: bool, progress: Progress,
          errors: list[str]) -> dict[str, Any]:
    k = lab.kernel(f"{kind}")
    try:
        out = _prepare(lab, k, kind, cell, learned, progress)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for i in range(repeat):
            for mode in MODES:
                one = _timed(lab, k, mode, cell)
                runs[mode].append(one)
                ready = ("" if one["ready_seconds"] is None
                         else f", wait_for_ready {one['ready_seconds']:.3f} s")
                progress(f"restart-direct: {kind} {mode} {i + 1}/{repeat}: total "
                         f"{one['total_seconds']:.3f} s (restart_kernel() "
                         f"{one['restart_seconds']:.3f} s{ready}, cell {one['cell_seconds']:.3f} s"
                         f"{', forked' if one['forked'] else ''})")
                problems = []
                if one["status"] != "ok":
                    problems.append(f"the cell's status is {one['status']!r}")
                if one["forked"] != (kind in WARM_KINDS):
                    problems.append("the kernel was not forked from the zygote" if one["forked"]
                                    is False else "a plain kernel's parent is a zygote")
                if not one["idle_seen"]:
                    problems.append("IOPub lost the cell's idle status (the reply ended it)")
                for p in problems:
                    message = f"{kind} {mode} {i + 1}/{repeat}: {p}"
                    progress(f"restart-direct: WARNING {message}")
                    if "idle" not in p:
                        errors.append(message)
    finally:
        lab.drop(k)
    out["modes"] = {}
    for mode, rs in runs.items():
        out["modes"][mode] = {
            "restart_seconds": median_or_none([r["restart_seconds"] for r in rs]),
            "ready_seconds": median_or_none([r["ready_seconds"] for r in rs
                                      if r["ready_seconds"] is not None]),
            "cell_seconds": median_or_none([r["cell_seconds"] for r in rs]),
            "total_seconds": median_or_none([r["total_seconds"] for r in rs]),
            "all_ok": all(r["status"] == "ok" for r in rs),
            "forked": [r["forked"] for r in rs],
            "runs": rs,
        }
    out["all_ok"] = all(m["all_ok"] for m in out["modes"].values())
    out["forked"] = all(all(m["forked"]) for m in out["modes"].values())
    return out


def run_restart_direct(unet: Path, quick: bool, repeat: int, env: dict[str, str],
                       progress: Progress, log_dir: Path, timeout: float) -> dict[str, Any]:
    """Run the case on the built UNet folder; JSON-ready results with ``errors`` (raises on a
    failure that stops the case; everything it started is stopped first)."""
    result: dict[str, Any] = {"repeat": repeat, "quick": quick, "unet_path": str(unet),
                              "limits": LIMITS,
                              "pause_seconds": RESTART_PAUSE_S, "modes": MODES,
                              "kinds": {}, "errors": []}
    lab = _Lab(env, log_dir, timeout)
    result["dir"] = str(lab.dir)
    with _environ(lab.env):
        try:
            lab.start()
            result["daemon_pid"] = lab.daemon.pid()
            progress(f"restart-direct: private daemon and zygote directory {lab.dir}")
            zygotes: set[int] = set()
            for kind in KINDS:
                cell = (PLAIN_CELL if kind == "plain" else CELL).format(path=str(unet))
                learned = any(k in result["kinds"] for k in WARM_KINDS)
                rounds = 1 if quick and kind == "plain" else repeat
                result["kinds"][kind] = _kind(lab, kind, cell, rounds, learned, progress,
                                              result["errors"])
                zygotes |= lab.zygote_pids()
            result["zygote_pids"] = sorted(zygotes)
        finally:
            lab.close()
    plain = result["kinds"]["plain"]["modes"]
    result["ratios"] = {
        kind: {mode: ratio(result["kinds"][kind]["modes"][mode]["total_seconds"],
                            plain[mode]["total_seconds"]) for mode in MODES}
        for kind in WARM_KINDS}
    for kind in WARM_KINDS:
        modes = result["kinds"][kind]["modes"]
        progress(f"restart-direct: {kind}: restart -> cell done "
                 + ", ".join(f"{mode} {fmt(modes[mode]['total_seconds'], ms_digits=0)} "
                             f"({_x(result['ratios'][kind][mode])} of plain)" for mode in MODES))
    return result


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(rd: dict[str, Any] | None) -> list[str]:
    """The results.md section."""
    if not rd:
        return []
    lines = ["", "## Kernel restarts through jupyter_client directly (no server: nbclient, "
                 "papermill, scripts, VS Code)", ""]
    if rd.get("error"):
        return lines + [f"Not measured: {rd['error']}"]
    lines += [f"A `jupyter_client.manager.KernelManager(kernel_name=...)` with its default "
              f"settings and a blocking client in the benchmark's process; timed from "
              f"`km.restart_kernel()` to the UNet load cell done (its `execute_reply` and its "
              f"`idle` on IOPub; `%overmind_load`, imports included, warm cache; the plain "
              f"kernel without overmind-lab). Medians of {rd.get('repeat')} restarts per kind "
              f"and mode. Kinds: *plain*: ipykernel's argv; *warm*: the `overmind-lab-warm` "
              f"provisioner; *warm-launcher*: the warm spec's argv run by jupyter_client's "
              f"`LocalProvisioner` (what VS Code does). Modes: "
              + "; ".join(f"*{m}*: {t}" for m, t in MODES.items()) + ".", "",
              "| kind | mode | restart_kernel() | wait_for_ready | cell | total | total / plain "
              "| forked |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for kind, kind_title in KINDS.items():
        k = (rd.get("kinds") or {}).get(kind) or {}
        for mode in MODES:
            m = (k.get("modes") or {}).get(mode) or {}
            forked = m.get("forked") or []
            over_plain = (rd.get("ratios") or {}).get(kind, {}).get(mode)
            ok = "" if m.get("all_ok", True) else " ⚠ a cell failed"
            restart, ready, cell, total = (fmt(m.get(f"{step}_seconds"), ms_digits=0)
                                           for step in ("restart", "ready", "cell", "total"))
            lines.append(f"| {kind_title} | {mode} | {restart} | {ready} | {cell} | {total}{ok} | "
                         f"{'-' if kind == 'plain' else _x(over_plain)} | "
                         f"{sum(forked)}/{len(forked)} |")
    lines += ["", f"*ready*: jupyter_client's `wait_for_ready` sends `kernel_info` until a reply "
                  f"is followed within 0.2 s by an IOPub message, then reads IOPub until 0.2 s "
                  f"pass without one. After a restart the client's sockets reach the new kernel "
                  f"(same ports) only when libzmq tries again, `reconnect_ivl` (100 ms) plus a "
                  f"random jitter of up to 100 ms after the old kernel's connections dropped, "
                  f"each socket on its own (an IOPub connected after the shell loses the "
                  f"`kernel_info`'s status: one more 0.2 s round). That is a floor of about "
                  f"{READY_FLOOR_S:g} s before any cell for any kernel that restarts as a new "
                  f"process, plain or forked (informative rows among the targets, no limit). A "
                  f"cell sent at once waits in the client's DEALER socket for the same "
                  f"reconnection, but not for the silence."]
    if rd.get("errors"):
        lines += ["", "Problems: " + "; ".join(rd["errors"])]
    return lines
