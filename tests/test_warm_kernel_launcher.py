"""The warm kernelspec's argv run as VS Code runs it, and nbconvert run twice.

VS Code's Jupyter extension writes a connection file, runs the kernelspec's argv itself
(no jupyter_client manager, no provisioner), talks to the kernel with a bare client,
interrupts it with SIGINT to the process it started and ends it by killing that process.
Here the same, against a real zygote: the launcher (``overmind_lab._launcher``)
must give a forked kernel, forward SIGINT, die with its kernel's status, take the kernel
with it when SIGKILLed, and fall back to a plain kernel in its own place when no zygote
serves. ``jupyter nbconvert --execute`` goes through the provisioner; the zygote's idle
time (Note [Idle zygote]) makes the second run warm.

Every process started here (zygotes, kernels, launchers) is killed at the end, found by
the private directory its command line names.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overmind_lab._common.zygote_paths import ZygotePaths
from overmind_lab._jupyter_server import kernelspec as spec
from tests.conftest import run_cell, start_busy_cell

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

#: torch, as in the default set (the first cell must find it imported); colorsys, which no
#: plain kernel imports: a kernel that has it was forked.
PRELOAD = ("torch,threadpoolctl,IPython,ipykernel,ipykernel.kernelapp,ipykernel.ipkernel,"
           "colorsys")
LAUNCHER = [sys.executable, "-m", "overmind_lab._launcher"]
PROBE = "import os, sys; print(os.getpid(), 'torch' in sys.modules, 'colorsys' in sys.modules)"


def _naming(directory: Path) -> list[int]:
    """Processes whose command line names ``directory`` (zygotes, kernels forked from
    them, launchers and plain kernels with a connection file in it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(directory).encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
    return out


def _kill_all(directory: Path) -> None:
    for pid in _naming(directory):  # started by this test: they name its private directory
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_until(predicate: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def run_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="oll-", dir="/tmp") as d:
        try:
            yield Path(d)
        finally:
            _kill_all(Path(d))


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "OVERMIND_LAB_SOCKET": str(run_dir / "d.sock"),
            "OVERMIND_LAB_PRELOAD": PRELOAD, **extra}


@pytest.fixture(scope="module")
def zygote(run_dir: Path) -> Path:
    """A ready zygote for the launchers' environment, owned by this test process."""
    env = _env(run_dir)
    code = ("import os, sys\nfrom overmind_lab._common.zygote_paths import ZygotePaths\n"
            "from overmind_lab._common.zygote_client import spawn\n"
            f"spawn(ZygotePaths.for_launch(sys.executable, os.environ), owners=[{os.getpid()}],"
            " env=dict(os.environ))\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120, cwd="/")
    sock = ZygotePaths.for_launch(sys.executable, env).socket
    _wait_until(sock.exists, f"the zygote's socket {sock}")
    return sock


class Launched:
    """The kernelspec's argv run as a frontend runs it, and a bare client to its kernel."""

    def __init__(self, run_dir: Path, env: dict[str, str], name: str, *,
                 python: str = sys.executable, ready_timeout: float = 120,
                 connection_file: str | None = None) -> None:
        """``connection_file``: one to use again (a restart's); default: a new one, new ports."""
        from jupyter_client.blocking import BlockingKernelClient
        from jupyter_client.connect import write_connection_file

        if connection_file is None:
            connection_file, _ = write_connection_file(
                fname=str(run_dir / f"{name}.json"), ip="127.0.0.1", key=os.urandom(16).hex()
                .encode())
        self.connection_file = connection_file
        argv = [a.replace("{connection_file}", self.connection_file)
                for a in spec.kernel_json(python=python)["argv"]]
        assert argv[1:3] == LAUNCHER[1:] and argv[0] == python
        self.stderr = open(run_dir / f"{name}.stderr", "w+")  # noqa: SIM115 - closed below
        self.proc = subprocess.Popen(argv, env=env, cwd=run_dir, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self.stderr)
        self.kc = BlockingKernelClient(connection_file=self.connection_file)
        self.kc.load_connection_file()
        # No heartbeat channel: jupyter_client's wait_for_ready declares a kernel dead when
        # no heartbeat came within a second (a plain kernel may still be importing); the
        # launcher's own exit is the death that counts here.
        self.kc.start_channels(hb=False)
        self._wait_for_ready(ready_timeout)

    def _wait_for_ready(self, timeout: float) -> None:
        """As ``wait_for_ready``: a kernel_info reply, then iopub connected."""
        from queue import Empty

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the launcher exited: {self.errors()}"
            assert time.monotonic() < deadline, f"no kernel after {timeout} s: {self.errors()}"
            self.kc.kernel_info()
            try:
                msg = self.kc.get_shell_msg(timeout=1)
            except Empty:
                continue
            if msg["msg_type"] == "kernel_info_reply":
                try:
                    self.kc.get_iopub_msg(timeout=0.5)
                except Empty:
                    continue
                while True:  # drain what the tries left
                    try:
                        self.kc.get_shell_msg(timeout=0.2)
                    except Empty:
                        return

    def probe(self) -> tuple[int, bool, bool]:
        pid, torch, colorsys = run_cell(self.kc, PROBE, timeout=60).split()
        return int(pid), torch == "True", colorsys == "True"

    def json(self, code: str) -> Any:
        """The last line ``code`` prints, as JSON."""
        return json.loads(run_cell(self.kc, code, timeout=120).strip().splitlines()[-1])

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def shutdown(self) -> None:
        """Ask the kernel to shut down; return once its launcher exited."""
        self.kc.shutdown()
        self.proc.wait(timeout=120)

    def close(self) -> None:
        self.kc.stop_channels()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.stderr.close()


@pytest.fixture
def launched(run_dir: Path, zygote: Path, request: pytest.FixtureRequest) -> Iterator[Launched]:
    k = Launched(run_dir, _env(run_dir), request.node.name[:40])
    try:
        yield k
    finally:
        k.close()


def test_the_kernelspec_argv_gives_a_forked_kernel(launched: Launched) -> None:
    pid, torch, colorsys = launched.probe()
    assert torch and colorsys  # imported before the first cell: forked from the zygote
    assert pid != launched.proc.pid  # the launcher stays as the kernel's stand-in
    assert launched.proc.poll() is None
    assert run_cell(launched.kc, "print(6 * 7)", timeout=60).strip() == "42"


def test_sigint_to_the_launcher_interrupts_a_running_cell(launched: Launched) -> None:
    kc = launched.kc
    # Interrupted once the cell's own code runs (``start_busy_cell``; stop_on_error=False). Sent
    # at its execute_input, ipykernel sometimes never replied to the cell (beside 3 CPU burners:
    # 2 runs in 20 of a forked kernel, 1 in 14 of a plain ipykernel_launcher).
    msg_id = start_busy_cell(kc, "import time\nfor _ in range(600): time.sleep(0.1)\n"
                             "print('done')", timeout=60)
    os.kill(launched.proc.pid, signal.SIGINT)
    while True:  # (a late kernel_info_reply of the readiness check may come first)
        reply = kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert launched.proc.poll() is None  # the launcher forwarded it and lives on
    assert run_cell(kc, "print('alive')", timeout=60).strip() == "alive"


def test_a_sigkilled_launcher_takes_its_kernel_with_it(launched: Launched) -> None:
    pid, _torch, colorsys = launched.probe()
    assert colorsys
    pidfd = os.pidfd_open(pid)
    try:
        launched.proc.kill()
        launched.proc.wait(timeout=60)
        # Note [Parent death]: a pidfd wakes it at once (within a second on an idle
        # machine); the deadline is a loaded machine's, not a bound on the latency
        exited = select.select([pidfd], [], [], 120)[0]
    finally:
        os.close(pidfd)
    assert exited, f"kernel {pid} still runs 120 s after its launcher's SIGKILL"


def test_the_launcher_exits_with_the_kernels_status(launched: Launched) -> None:
    assert launched.probe()[2]
    launched.kc.shutdown()
    assert launched.proc.wait(timeout=60) == 0


def test_without_a_zygote_the_launcher_becomes_a_plain_kernel(run_dir: Path) -> None:
    alone = run_dir / "alone"
    alone.mkdir()
    env = _env(alone, OVERMIND_LAB_PRELOAD="colorsys")  # the zygote it starts boots fast
    k = Launched(alone, env, "plain")
    try:
        pid, _torch, colorsys = k.probe()
        assert pid == k.proc.pid and not colorsys  # exec'd in place: a plain kernel
        assert "overmind-lab: launching a plain kernel: no zygote was running" in k.errors()
        # ipykernel run by ``_launcher.plain`` (Note [A plain kernel's exit])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmd[1:3] == [b"-m", b"overmind_lab._launcher.plain"], cmd
        k.kc.shutdown()
        assert k.proc.wait(timeout=60) == 0
    finally:
        k.close()
        _kill_all(alone)  # the zygote it started for the next launch


NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "probe", "metadata": {},
               "outputs": [], "source": PROBE}],
    "metadata": {"kernelspec": {"name": spec.DEFAULT_NAME, "display_name": "warm",
                                "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}


@pytest.mark.slow
def test_nbconvert_execute_twice_is_warm_the_second_time(run_dir: Path) -> None:
    """Run back to back, as a loop runs them: the second run waits for the zygote the first
    one started, if it is still importing (Note [Waiting for a booting zygote]), and the
    zygote outlives the first run (Note [Idle zygote]): the second run's kernel is
    forked."""
    home = run_dir / "nbconvert"
    home.mkdir()
    spec.install(prefix=str(home / "prefix"))
    env = _env(home, OVERMIND_LAB_ZYGOTE_IDLE="120",
               JUPYTER_PATH=str(home / "prefix" / "share" / "jupyter"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    nb = home / "probe.ipynb"
    nb.write_text(json.dumps(NOTEBOOK))

    def execute(run: int) -> tuple[bool, bool, str]:
        """(torch, colorsys) imported at the first cell, and what nbconvert logged."""
        proc = subprocess.run([sys.executable, "-m", "nbconvert", "--to", "notebook",
                               "--execute", str(nb), "--output", f"out{run}.ipynb"], env=env,
                              cwd=home, check=True, timeout=300, capture_output=True,
                              text=True)
        cell = json.loads((home / f"out{run}.ipynb").read_text())["cells"][0]
        text = "".join("".join(o.get("text", "")) for o in cell["outputs"])  # str or lines
        _pid, torch, colorsys = text.split()
        return torch == "True", colorsys == "True", proc.stderr

    try:
        *first, log = execute(1)
        assert first == [False, False], log  # plain: no zygote yet; it starts one
        assert "launching a plain kernel: no zygote was running" in log
        *second, log = execute(2)
        assert second == [True, True], log  # forked: the zygote outlived the first run
    finally:
        _kill_all(home)
