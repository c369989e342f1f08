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
- ``pss``: summed PSS of 4 idle kernels that imported torch, diffusers and transformers
  (warm kernels also with the zygote's own PSS added).

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
from typing import Any

from benchmarks._memory import read_smaps_rollup
from benchmarks._server import JupyterServer, WsKernel
from benchmarks._service import PrivateDaemon

__all__ = ["LIMITS", "run_warm_kernel"]

#: The targets: SD cell after a restart (warm kernel, warm cache) in seconds and as a
#: fraction of the plain kernel's; the Llama cell in seconds; 4 warm kernels' PSS in
#: plain kernels.
LIMITS = {"sd_cell_seconds": 1.0, "sd_cell_ratio": 0.15, "llama_cell_seconds": 0.5,
          "pss_plain_kernels": 2.0}
KERNELS = 4
QUICK_KERNELS = 2

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


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


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
        seconds = self.server.start()
        progress(f"warm-kernel: jupyter server up on port {self.server.port} in {seconds:.1f} s "
                 f"(private daemon and zygote directory {self.dir})")

    def kernel(self, name: str) -> WsKernel:
        k = WsKernel(self.server, name, self.timeout)
        self.kernels.append(k)
        return k

    def drop(self, kernel: WsKernel) -> None:
        kernel.close()
        self.kernels.remove(kernel)

    def zygote(self, not_pid: int | None = None) -> dict[str, Any]:
        """The zygote's status once one serves (and is not ``not_pid``)."""
        from overmind_lab._jupyter_server.kernelspec import zygotes

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for z in zygotes(self.dir):
                if z["pid"] != not_pid and not z["retiring"]:
                    return z
            time.sleep(0.5)
        raise RuntimeError(f"no zygote became ready in {self.dir}; see "
                           f"{self.log_dir / 'warm-kernel-server.log'}")

    def zygote_pids(self) -> set[int]:
        from overmind_lab._jupyter_server.kernelspec import zygotes

        return {int(z["pid"]) for z in zygotes(self.dir)}

    def close(self) -> None:
        for k in list(self.kernels):
            self.drop(k)
        self.server.stop()
        # zygotes and forked kernels name the directory in their command line, plain
        # kernels their connection file in its runtime/
        for pid in _marked(str(self.dir)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.daemon.stop()


def _marked(marker: str) -> list[int]:
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
            for i in range(repeat):
                restarts.append(k.restart())
                cells.append(k.execute(cell)[0])
                forked.append(_pids(k)[1] in lab.zygote_pids())
                progress(f"warm-kernel: {name} {kind} {i + 1}/{repeat}: restart "
                         f"{restarts[-1]:.2f} s, cell {cells[-1]:.2f} s"
                         f"{' (forked)' if forked[-1] else ''}")
            out[kind] = {"restart_seconds": _median(restarts), "cell_seconds": _median(cells),
                         "restart_all": restarts, "cell_all": cells, "forked": forked}
        finally:
            lab.drop(k)
    out["ratios"] = {
        "restart_warm_over_plain": out["warm"]["restart_seconds"] / out["plain"]["restart_seconds"],
        "cell_warm_over_plain": out["warm"]["cell_seconds"] / out["plain"]["cell_seconds"],
    }
    return out


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
            progress(f"warm-kernel: {n} idle {kind} kernels: "
                     f"{out[f'{kind}_sum_bytes'] / 2**20:.0f} MiB PSS")
        finally:
            for k in kernels:
                lab.drop(k)
    one_plain = out["plain_sum_bytes"] / n
    out["warm_in_plain_kernels"] = out["warm_sum_bytes"] / one_plain
    out["warm_with_zygote_in_plain_kernels"] = (
        (out["warm_sum_bytes"] + out["zygote_pss_bytes"]) / one_plain)
    return out


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
        lab.drop(lab.kernel("bench-warm"))
        result["zygote_pid"] = lab.zygote()["pid"]
        result["sd15"] = _restarts(lab, "sd15", SD_CELL.format(path=str(sd_path)), repeat,
                                   progress)
        result["llama"] = _restarts(lab, "llama", LLAMA_CELL.format(path=str(llama)), repeat,
                                    progress)
        result["pss"] = _memory(lab, QUICK_KERNELS if quick else KERNELS, progress)
        result["zygote_pids"] = sorted(lab.zygote_pids())
        result["dir"] = str(lab.dir)
    return result
