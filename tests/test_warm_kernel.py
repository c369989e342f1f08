"""Warm kernels through real jupyter_client kernel managers, a real zygote and, for the
parent-death case, a real Jupyter server process.

The zygote here preloads a smaller set than the default (``OVERMIND_LAB_PRELOAD``: torch,
numpy, ipykernel, IPython, overmind_lab) so that it boots in seconds; everything else is
the production path. The module's zygote belongs to this pytest process; every process
whose command line names the test's private directory (zygotes, and the kernels forked
from them, which keep the zygote's command line) is killed at teardown, also on failure.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import overmind_lab
from overmind_lab._jupyter_server import kernelspec as spec
from overmind_lab._zygote.loop import RENEW_AFTER_IDLE_S
from tests.conftest import run_cell, start_busy_cell
from tests.nobody import NOBODY, package_for_nobody, python_for_nobody

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

PRELOAD = ("torch,numpy,threadpoolctl,IPython,ipykernel,ipykernel.kernelapp,"
           "ipykernel.ipkernel,overmind_lab")
REPO = str(Path(overmind_lab.__file__).resolve().parents[1])


# -- processes -------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it only waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def _ours(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and _alive(int(entry)):
            out.append(int(entry))
    return out


def _kill_ours(marker: str) -> None:
    for pid in _ours(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 120
    while _ours(marker) and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def ready_zygote(directory: Path, not_pid: int | None = None, timeout: float = 300,
                 identity: str | None = None) -> dict[str, Any]:
    """The status of the zygote in ``directory`` once it serves (and is not ``not_pid``;
    of ``identity`` only, when given: a directory may hold zygotes of other preload sets)."""
    def ready() -> dict[str, Any] | None:
        for z in spec.zygotes(directory):
            if (z["pid"] != not_pid and not z["retiring"]
                    and identity in (None, z["identity"])):
                return z
        return None

    return dict(_wait_for(ready, timeout, f"a zygote in {directory}"))


# -- kernels ---------------------------------------------------------------------------

LAUNCH_ENV: dict[str, str] = {}


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Kernel:
    """A kernel of the warm kernelspec through jupyter_client, with its log lines."""

    def __init__(self, cwd: str = "/", env: dict[str, str] | None = None) -> None:
        from jupyter_client.manager import KernelManager

        self.handler = ListHandler()
        log = logging.getLogger(f"warm-test-{id(self)}")
        log.addHandler(self.handler)
        log.setLevel(logging.INFO)
        self.km = KernelManager(kernel_name=spec.DEFAULT_NAME, log=log)
        self.km.start_kernel(cwd=cwd, env={**LAUNCH_ENV, **(env or {})})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    @property
    def warm(self) -> bool:
        return getattr(self.km.provisioner, "warm", None) is not None

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.pid)

    def log_text(self) -> str:
        return "\n".join(self.handler.lines)

    def run(self, code: str, timeout: float = 120) -> str:
        return run_cell(self.kc, code, timeout)

    def json(self, code: str) -> Any:
        return json.loads(self.run(code).strip().splitlines()[-1])

    def restart(self) -> None:
        self.km.restart_kernel(now=False)
        self.kc.wait_for_ready(timeout=120)

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=False)


@contextmanager
def private_zygote_dir(prefix: str, spec_env: dict[str, str] | None = None,
                       files_env: dict[str, str] | None = None) -> Iterator[Path]:
    """A private zygote directory: the daemon socket and the warm kernelspec under it, the
    test preload set, ``files_env`` (variable -> file name in the directory) set, and
    :data:`LAUNCH_ENV` fixed; every process of ours under it killed at exit."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir="/tmp") as d:
        mp = pytest.MonkeyPatch()
        try:
            mp.setenv("OVERMIND_LAB_SOCKET", f"{d}/d.sock")
            mp.setenv("OVERMIND_LAB_PRELOAD", PRELOAD)
            mp.setenv("JUPYTER_PATH", f"{d}/prefix/share/jupyter")
            for name, file in (files_env or {}).items():
                mp.setenv(name, f"{d}/{file}")
            spec.install(prefix=f"{d}/prefix", env=spec_env)
            # The environment a server would pass: fixed now, since imports in this
            # process (torch sets KMP_DUPLICATE_LIB_OK) would change the zygote identity.
            LAUNCH_ENV.clear()
            LAUNCH_ENV.update(os.environ)
            yield Path(d)
        finally:
            _kill_ours(d)
            mp.undo()


@pytest.fixture(scope="module")
def warm_dir() -> Iterator[Path]:
    """A private zygote directory, the warm kernelspec installed under it."""
    with private_zygote_dir("olw-", spec_env={"OVERMIND_TEST_SPEC_VAR": "from-spec"}) as d:
        yield d


@pytest.fixture(scope="module")
def zygote(warm_dir: Path) -> dict[str, Any]:
    """The first launch finds no zygote: it is plain, says why, and starts one."""
    k = Kernel()
    try:
        assert not k.warm
        assert "launching a plain kernel: no zygote was running" in k.log_text()
        assert k.run("print(6 * 7)").strip() == "42"
    finally:
        k.close()
    return ready_zygote(warm_dir)


@pytest.fixture
def kernel(zygote: dict[str, Any], tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(cwd=str(tmp_path))
    try:
        yield k
    finally:
        k.close()


# -- tests -----------------------------------------------------------------------------

def test_start_execute_interrupt_restart_shutdown(kernel: Kernel, zygote: dict[str, Any]
                                                  ) -> None:
    assert kernel.warm, kernel.log_text()
    info = kernel.json("import os, json; print(json.dumps([os.getpid(), os.getppid(), "
                       "os.getsid(0), os.getpgrp()]))")
    assert info == [kernel.pid, zygote["pid"], kernel.pid, kernel.pid]

    # Interrupt a busy cell: the kernel gets KeyboardInterrupt, the zygote nothing. The
    # interrupt goes once the cell's first line has run (its output arrived), not after a
    # sleep that a slow kernel could outlast. stop_on_error=False (``start_busy_cell``):
    # ipykernel would abort requests that arrive right after the error for a while (any
    # kernel, plain too).
    msg_id = start_busy_cell(kernel.kc, "while True:\n    pass", timeout=120)
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=120)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert kernel.run("print('still here')").strip() == "still here"
    assert _alive(zygote["pid"])

    old = kernel.pid
    kernel.restart()
    assert kernel.warm and kernel.pid != old
    assert kernel.run("print(1 + 1)").strip() == "2"
    _wait_for(lambda: not _alive(old), 120, "the old kernel to exit")
    last = kernel.pid
    kernel.close()
    _wait_for(lambda: not _alive(last), 120, "the kernel to exit at shutdown")
    assert _alive(zygote["pid"])


ENV_CODE = """
import json, os, random, sys
print(json.dumps({"cwd": os.getcwd(), "session": os.environ.get("JPY_SESSION_NAME"),
                  "spec": os.environ.get("OVERMIND_TEST_SPEC_VAR"),
                  "zygote_only": [k for k in os.environ if k.startswith("OVERMIND_LAB_ORIG")
                                  or k == "PYTORCH_NVML_BASED_CUDA_CHECK"],
                  "blas": os.environ.get("OPENBLAS_NUM_THREADS"),
                  "path0": sys.path[0], "random": random.random()}))
"""


def test_cwd_env_and_random_state_are_the_kernels_own(zygote: dict[str, Any],
                                                      tmp_path: Path) -> None:
    seen = []
    for name in ("first.ipynb", "second.ipynb"):
        k = Kernel(cwd=str(tmp_path), env={"JPY_SESSION_NAME": str(tmp_path / name)})
        try:
            assert k.warm, k.log_text()
            got = k.json(ENV_CODE)
        finally:
            k.close()
        assert got["cwd"] == str(tmp_path)
        assert got["session"] == str(tmp_path / name)
        assert got["spec"] == "from-spec"
        assert got["zygote_only"] == []
        assert got["blas"] == os.environ.get("OPENBLAS_NUM_THREADS")  # not the zygote's "1"
        seen.append(got["random"])
    assert seen[0] != seen[1]


THREADS_CODE = """
import hashlib, json
import numpy as np, threadpoolctl, torch
torch.manual_seed(0)
a = torch.randn(384, 384, dtype=torch.float64)
m = np.random.default_rng(0).standard_normal((384, 384))
print(json.dumps({
    "torch_threads": torch.get_num_threads(),
    "interop": torch.get_num_interop_threads(),
    "pools": {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info()},
    "torch_mm": hashlib.sha256((a @ a).numpy().tobytes()).hexdigest(),
    "numpy_mm": hashlib.sha256((m @ m).tobytes()).hexdigest(),
}))
"""


def test_thread_counts_and_matmul_results_match_a_fresh_process(kernel: Kernel) -> None:
    assert kernel.warm, kernel.log_text()
    warm = kernel.json(THREADS_CODE)
    fresh_proc = subprocess.run([sys.executable, "-c", THREADS_CODE], capture_output=True,
                                text=True, timeout=300, cwd="/", check=True)
    fresh = json.loads(fresh_proc.stdout.strip().splitlines()[-1])
    assert warm["torch_threads"] == fresh["torch_threads"]
    assert warm["interop"] == fresh["interop"]
    assert warm["torch_mm"] == fresh["torch_mm"]
    assert warm["numpy_mm"] == fresh["numpy_mm"]
    for path, n in fresh["pools"].items():
        assert warm["pools"].get(path) == n, (path, warm["pools"], fresh["pools"])


#: A zygote of its own (the preload set is part of the identity) that also holds diffusers,
#: its UNet and scheduler modules, tokenizers and tqdm, as the default set would.
LIBRARY_PRELOAD = PRELOAD + (",tqdm.auto,tokenizers,diffusers,diffusers.models.modeling_utils,"
                             "diffusers.models.unets.unet_2d_condition,"
                             "diffusers.schedulers.scheduling_ddim")

LIBRARY_CODE = """
import hashlib, json, os, sys, threading
import torch
from diffusers import DDIMScheduler, UNet2DConditionModel
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm.auto import tqdm
from tqdm.std import TqdmDefaultWriteLock

inherited = {"tqdm_lock": "mp_lock" in vars(TqdmDefaultWriteLock),
             "tqdm_monitor": any(t.name == "tqdm_monitor" for t in threading.enumerate())}
torch.manual_seed(0)
unet = UNet2DConditionModel(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
    block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
    attention_head_dim=8, norm_num_groups=8).eval()
scheduler = DDIMScheduler(num_train_timesteps=1000)
scheduler.set_timesteps(2)
latents, text = torch.randn(2, 4, 8, 8), torch.randn(2, 7, 32)
with torch.no_grad():
    for t in tqdm(scheduler.timesteps, file=sys.stdout, disable=False, mininterval=0):
        latents = scheduler.step(unet(latents, t, encoder_hidden_states=text).sample, t,
                                 latents).prev_sample
words = [f"w{i}" for i in range(50)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, "[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
ids = [e.ids for e in tok.encode_batch([" ".join(words[i:] + words[:i]) for i in range(200)])]
print(json.dumps({**inherited,
    "step": hashlib.sha256(latents.numpy().tobytes()).hexdigest(),
    "tokens": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
    "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
    "torch_threads": torch.get_num_threads()}))
"""


def test_a_diffusers_step_tokenizers_and_tqdm_match_a_fresh_process(
        zygote: dict[str, Any], warm_dir: Path) -> None:
    """Issue 10: "a small diffusers pipeline step gives the same results as in a fresh
    process"; tqdm's lock and monitor and the tokenizers pool are the kernel's own (Note
    [Library state across the fork])."""
    env = {"OVERMIND_LAB_PRELOAD": LIBRARY_PRELOAD}
    first = Kernel(env=env)
    first.close()
    assert not first.warm  # a new identity: the first launch starts its zygote
    try:
        ready = _wait_for(lambda: [z for z in spec.zygotes(warm_dir) if not z["retiring"]
                                   and "diffusers" in z["preload_roots"]], 300,
                          "a zygote that preloaded diffusers")
        assert ready[0]["refusal"] is None, ready
        k = Kernel(env=env)
        try:
            assert k.warm, k.log_text()
            warm = k.json(LIBRARY_CODE)
        finally:
            k.close()
    finally:  # the other tests expect their own zygote alone in the directory
        for z in spec.zygotes(warm_dir):
            if z["identity"] != zygote["identity"]:
                os.kill(z["pid"], signal.SIGKILL)
                _wait_for(lambda z=z: not _alive(z["pid"]), 120, "the diffusers zygote to exit")
    fresh_proc = subprocess.run([sys.executable, "-c", LIBRARY_CODE], capture_output=True,
                                text=True, timeout=300, cwd="/", check=True,
                                env={**LAUNCH_ENV, **env})
    fresh = json.loads(fresh_proc.stdout.strip().splitlines()[-1])
    assert warm == fresh
    assert not warm["tqdm_lock"] and not warm["tqdm_monitor"]


def test_a_zygote_stops_tqdms_monitor_and_its_kernels_do_not_share_tqdms_lock() -> None:
    """A bar made before the fork (its monitor thread, its inter-process lock): the zygote
    stops the thread; a kernel killed while it holds tqdm's lock (mid-write) does not
    block the bars of a kernel forked after it."""
    code = """
import os, signal, sys, time
from tqdm.auto import tqdm
from overmind_lab._forked.become import _fresh_library_state
from overmind_lab._zygote.loop import _stop_library_threads
for _ in tqdm(range(2), mininterval=0, file=sys.stderr):
    pass
assert tqdm.monitor is not None
_stop_library_threads()
deadline = time.monotonic() + 120
while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < deadline:
    time.sleep(0.01)
print("threads", len(os.listdir("/proc/self/task")), flush=True)

def fork(work):
    pid = os.fork()
    if pid == 0:
        _fresh_library_state()
        work()
        os._exit(0)
    return pid

held_r, held_w = os.pipe()

def hold():  # a kernel that is killed while it writes a bar
    tqdm.get_lock().acquire()
    os.write(held_w, b"x")  # the test strikes once the lock is held, not after a sleep
    time.sleep(600)

holder = fork(hold)
assert os.read(held_r, 1) == b"x"
os.kill(holder, signal.SIGKILL)
os.waitpid(holder, 0)
drawer = fork(lambda: [None for _ in tqdm(range(2), mininterval=0, file=sys.stderr)])
deadline = time.monotonic() + 180
while time.monotonic() < deadline:
    done, status = os.waitpid(drawer, os.WNOHANG)
    if done:
        print("drawer", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.05)
else:
    os.kill(drawer, signal.SIGKILL)
    os.waitpid(drawer, 0)
    print("drawer blocked")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert out.stdout.split("\n")[:2] == ["threads 1", "drawer 0"], out.stdout + out.stderr


def test_an_edited_user_module_in_the_notebook_folder_runs_new_code(
        kernel: Kernel, warm_dir: Path, tmp_path: Path) -> None:
    mod = tmp_path / "my_user_module_xyz.py"
    mod.write_text("VALUE = 1\n")
    assert kernel.run("import my_user_module_xyz; print(my_user_module_xyz.VALUE)"
                      ).strip() == "1"
    kernel.restart()
    assert kernel.warm
    mod.write_text("VALUE = 2\n")
    later = time.time() + 5
    os.utime(mod, (later, later))
    assert kernel.run("import my_user_module_xyz; print(my_user_module_xyz.VALUE)"
                      ).strip() == "2"
    kernel.restart()  # the exit of the kernel that imported it records learned modules
    learned = "".join(p.read_text() for p in warm_dir.glob("zygote-*.learned.json"))
    assert "my_user_module_xyz" not in learned


def test_modules_a_kernel_imported_are_preloaded_by_a_later_zygote(
        kernel: Kernel, zygote: dict[str, Any], warm_dir: Path) -> None:
    """A kernel's exit records its third-party modules; once no fork came for a while (Note [A
    renewal waits for a pause]) the zygote starts a replacement that preloads them, and the
    next restart is forked from it."""
    check = "import sys; print('colorsys' in sys.modules)"
    assert kernel.warm
    assert kernel.run(check).strip() == "False"
    kernel.run("import colorsys")
    kernel.restart()  # the old kernel's exit records colorsys
    assert kernel.warm, kernel.log_text()
    assert kernel.run(check).strip() == "False"  # forked from the zygote that lacks it
    before = _ppid(kernel.pid)
    ready = _wait_for(lambda: [z for z in spec.zygotes(warm_dir)
                               if z["identity"] == zygote["identity"] and not z["retiring"]
                               and "colorsys" in z["preload_roots"]], 300,
                      "a zygote that preloaded colorsys")
    kernel.restart()
    assert kernel.warm, kernel.log_text()
    assert kernel.run(check).strip() == "True"
    assert _ppid(kernel.pid) == ready[0]["pid"]
    # The renewal began a pause after the old zygote's last fork, not at a fork.
    lines = zygote_log_times(warm_dir, before)
    renewed = max(t for t, line in lines if "starting a zygote that also preloads" in line)
    last_fork = max(t for t, line in lines if "forked kernel" in line and t <= renewed)
    assert renewed - last_fork >= RENEW_AFTER_IDLE_S - 0.01, (last_fork, renewed)


def zygote_log_times(directory: Path, pid: int) -> list[tuple[float, str]]:
    """``(time, line)`` of zygote ``pid``'s log lines (``logging``'s asctime, ms)."""
    out = []
    for line in _logs(directory).splitlines():
        stamp, _, rest = line.partition(f" zygote {pid} ")
        if rest:
            when = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
            out.append((when.timestamp(), rest))
    return out


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run a client as another uid")
def test_another_uid_cannot_ask_the_zygote_to_fork(zygote: dict[str, Any]) -> None:
    sock = Path(zygote["socket"])
    before = {z["pid"]: z["forks"] for z in spec.zygotes(sock.parent)}
    python = python_for_nobody()
    if python is None:
        pytest.skip("uid 65534 can run no Python interpreter on this machine")
    with package_for_nobody() as copy:
        _ask_as_nobody(python, copy, sock)
    for z in spec.zygotes(sock.parent):  # nothing was forked for the other uid
        assert z["forks"] == before.get(z["pid"], 0)


def _ask_as_nobody(python: str, package: str, sock: Path) -> None:
    code = (f"import sys, json, socket; sys.path.insert(0, {package!r})\n"
            "from overmind_lab._common.protocol import Channel\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({str(sock)!r})\n"
            "except OSError as e:\n"
            "    print(json.dumps({'error': str(e)})); raise SystemExit\n"
            "c = Channel(s, 10)\n"
            "try:  # the zygote may have answered and closed already\n"
            "    c.send({'op': 'fork', 'argv': [sys.executable, '-m', "
            "'ipykernel_launcher'], 'env': {}, 'cwd': '/'}, [0, 1, 2])\n"
            "except OSError:\n"
            "    pass\n"
            "print(json.dumps(c.recv()[0]))\n")
    as_nobody = [*NOBODY, python, "-c", code]
    mode = sock.parent.stat().st_mode & 0o777
    try:
        sock.parent.chmod(0o700)
        out = subprocess.run(as_nobody, capture_output=True, text=True, timeout=60)
        assert out.stdout, out.stderr
        assert "permission denied" in json.loads(out.stdout)["error"].lower()
        sock.parent.chmod(0o755)
        sock.chmod(0o777)
        out = subprocess.run(as_nobody, capture_output=True, text=True, timeout=60)
        assert out.stdout, out.stderr
        reply = json.loads(out.stdout)
        assert reply["ok"] is False
        assert "does not serve uid 65534" in reply["error"]
    finally:
        sock.chmod(0o600)
        sock.parent.chmod(mode)


def test_a_touched_preloaded_module_retires_the_stale_zygote(
        zygote: dict[str, Any], warm_dir: Path) -> None:
    import threadpoolctl

    current = ready_zygote(warm_dir, identity=zygote["identity"])
    path = Path(threadpoolctl.__file__)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    k = Kernel()
    try:
        assert not k.warm
        assert "the zygote is stale" in k.log_text(), (_logs(warm_dir), current,
                                                       os.listdir(warm_dir))
        assert str(path) in k.log_text()
    finally:
        k.close()
    fresh = ready_zygote(warm_dir, not_pid=current["pid"], identity=current["identity"])
    _wait_for(lambda: not _alive(current["pid"]), 120, "the stale zygote to exit")
    k = Kernel()
    try:
        assert k.warm, k.log_text()
        assert _ppid(k.pid) == fresh["pid"]
    finally:
        k.close()


PLAIN_EXIT_CODE = """
import atexit, json, os, sys
log = open({log!r}, "w")  # never closed nor flushed by the cell: the exit must flush it
log.write("written before the restart")
atexit.register(lambda: open({marker!r}, "w").write("atexit ran"))
print(json.dumps([sys.argv[0].endswith("ipykernel_launcher.py"), sys.orig_argv[1:3],
                  open("/proc/self/cmdline").read().split("\\0")[1:3]]))
"""


def test_a_killed_zygote_gives_one_plain_launch_then_warm_again(
        zygote: dict[str, Any], warm_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from overmind_lab._common.zygote_client import TIMELINE_ENV

    current = ready_zygote(warm_dir, identity=zygote["identity"])
    os.kill(current["pid"], signal.SIGKILL)
    _wait_for(lambda: not _alive(current["pid"]), 120, "the zygote to die")
    timeline = tmp_path / "timeline.jsonl"  # the provisioner's steps, in the launch's env
    monkeypatch.setenv(TIMELINE_ENV, str(timeline))
    k = Kernel(env={TIMELINE_ENV: str(timeline)})
    try:
        assert not k.warm
        assert "launching a plain kernel: no zygote was running" in k.log_text()
        assert k.run("print('plain ok')").strip() == "plain ok"
        # Note [A plain kernel's exit]: ipykernel in a process of ``_launcher.plain``, which
        # looks like ``-m ipykernel_launcher`` to the kernel's code, and whose exit runs its
        # atexit handlers and closes what the user namespace held.
        log, marker = tmp_path / "unflushed.txt", tmp_path / "atexit.txt"
        assert k.json(PLAIN_EXIT_CODE.format(log=str(log), marker=str(marker))) == [
            True, ["-m", "ipykernel_launcher"], ["-m", "overmind_lab._launcher.plain"]]
        fresh = ready_zygote(warm_dir, not_pid=current["pid"], identity=current["identity"])
        old = k.pid
        # Note [A standby for a plain kernel's restart]: forked while the plain one exits.
        k.restart()
        assert k.warm, k.log_text()
        assert _ppid(k.pid) == fresh["pid"]
        _wait_for(lambda: not _alive(old), 120, "the plain kernel to exit")
        assert log.read_text() == "written before the restart"
        assert marker.read_text() == "atexit ran"
        events = [json.loads(line)["event"] for line in timeline.read_text().splitlines()]
        assert "provisioner.standby_go" in events, events
        assert k.run("print('warm ok')").strip() == "warm ok"
    finally:
        k.close()
    k = Kernel()
    try:
        assert k.warm, k.log_text()
        assert _ppid(k.pid) == fresh["pid"]
    finally:
        k.close()


# -- a real Jupyter server, killed ----------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _api(port: int, path: str, method: str = "GET", body: Any = None) -> Any:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": "token warm-test", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"null")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                if _ppid(int(entry)) == pid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def test_a_sigkilled_server_leaves_no_kernel_and_no_zygote(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="olws-", dir="/tmp") as d:
        env = {**os.environ, "OVERMIND_LAB_SOCKET": f"{d}/d.sock",
               "OVERMIND_LAB_PRELOAD": PRELOAD, "JUPYTER_PATH": f"{d}/prefix/share/jupyter",
               "JUPYTER_RUNTIME_DIR": f"{d}/runtime"}
        spec.install(prefix=f"{d}/prefix")
        port = _free_port()
        server_log = open(f"{d}/server.log", "w")  # noqa: SIM115 - closed below
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", f"--ServerApp.port={port}",
             "--ServerApp.open_browser=False", "--IdentityProvider.token=warm-test",
             f"--ServerApp.root_dir={tmp_path}", "--ServerApp.port_retries=0",
             f"--ServerApp.config_file={d}/none.py", "--allow-root"],
            env=env, cwd=d, stdout=subprocess.DEVNULL, stderr=server_log)
        try:
            _wait_for(lambda: _try(lambda: _api(port, "status")) or server.poll() is not None,
                      120, "the server")
            assert server.poll() is None, Path(f"{d}/server.log").read_text()
            first = _api(port, "kernels", "POST", {"name": spec.DEFAULT_NAME})
            zyg = ready_zygote(Path(d))
            second = _api(port, "kernels", "POST", {"name": spec.DEFAULT_NAME})
            assert first["id"] != second["id"]
            warm_kernels = _wait_for(lambda: _children(zyg["pid"]), 60, "the warm kernel")
            plain_kernels = [p for p in _children(server.pid)]
            assert len(warm_kernels) == 1 and plain_kernels
            watched = [zyg["pid"], *warm_kernels, *plain_kernels]
            assert all(_alive(p) for p in watched)

            server.kill()
            server.wait(timeout=30)
            # Note [Parent death]: each kernel wakes on a pidfd of the server and exits
            # within a second of its death when the machine is idle; the deadline is a
            # loaded machine's (an elapsed-time bound would race with the scheduler).
            _wait_for(lambda: not any(_alive(p) for p in watched), 120,
                      f"kernels and zygote {watched} to exit after the server's SIGKILL")
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=30)
            server_log.close()
            _kill_ours(d)


def _logs(directory: Path) -> str:
    return "\n".join(p.read_text() for p in directory.glob("zygote-*.log"))


def _try(fn: Any) -> Any:
    try:
        return fn()
    except OSError:
        return None
