"""A warm kernel equals a fresh one: a differential test (issue 20, items 6 and 7).

Plain kernels (``python -m ipykernel_launcher``, jupyter_client's own provisioner) and
warm kernels (forked from a zygote) are started by this process, through real
``KernelManager`` s, with the same kernelspec env, cwd, umask, nice, limits, groups,
affinity, ``oom_score_adj`` and ``TZ``; then one cell in each reports everything a
program can observe about its process, and the reports are compared. Each of those
attributes is changed in this process (the "server") after its zygote started, and the
zygote is moved into another cgroup, so the warm kernel can only match by taking on the
server's values (Note [Inherited process attributes] in ``_common/inherit.py``). The differences
that are intended are exactly those ``overmind-lab kernel status`` lists (Note [What a
warm kernel does not share with a fresh one] in ``_forked/become.py``).

Every process started here has the test's private directory in its command line (the
zygote's, which forked kernels keep; a plain kernel's connection file is in
``JUPYTER_RUNTIME_DIR`` under it) and is killed at teardown, also on failure.
"""

from __future__ import annotations

import io
import json
import logging
import os
import resource
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from overmind_lab._common import inherit
from overmind_lab._common.zygote_client import WarmUnavailable, request_fork
from overmind_lab._common.zygote_paths import identity
from overmind_lab._jupyter_server import kernelspec as spec
from tests.conftest import run_cell
from tests.test_warm_kernel import PRELOAD, ListHandler, _kill_ours, ready_zygote

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

PLAIN = "olw-plain"
SPEC_ENV = {"OVERMIND_TEST_SPEC_VAR": "from-spec"}

OBSERVE = r"""
import json, locale, os, random, re, signal, sys, threading, time
def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return f"<{exc.strerror}>"
def _fd(fd):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "<closed>"
    return re.sub(r"^(socket|pipe):\[\d+\]$", r"\1", target)
def _handler(h):
    return h.name if isinstance(h, signal.Handlers) else getattr(h, "__qualname__", repr(h))
_status = {k: " ".join(v.split()) for k, _, v in
           (line.partition(":") for line in _read("/proc/self/status").splitlines())}
_mask = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
# (IPython's history thread may be committing now, in either kernel: SQLite holds the
# journal open, and the folder holding the database while it syncs the journal's deletion)
# (test_warm_scripts runs this as a script too: no IPython there)
_ip = globals().get("get_ipython")
_hist = str(_ip().history_manager.hist_file) if _ip is not None else None
_fds = sorted(t for t in (_fd(int(f)) for f in os.listdir("/proc/self/fd"))
              if _hist is None or t not in (_hist + "-journal", os.path.dirname(_hist)))
_threads = len(os.listdir("/proc/self/task"))
def _comms():
    return sorted(re.sub(r"\d+", "N", _read(f"/proc/self/task/{t}/comm").strip())
                  for t in os.listdir("/proc/self/task"))
_comm = _comms()
import __main__
obs = {
    "status": {k: _status.get(k) for k in (
        "Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
        "NoNewPrivs", "Seccomp", "Cpus_allowed", "Cpus_allowed_list", "Mems_allowed_list",
        "Umask", "SigBlk", "SigIgn", "SigCgt")},
    "limits": _read("/proc/self/limits").splitlines(),
    "cgroup": _read("/proc/self/cgroup").splitlines(),
    "oom_score_adj": _read("/proc/self/oom_score_adj").strip(),
    "priority": os.getpriority(os.PRIO_PROCESS, 0),
    "sched": [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority],
    "affinity": sorted(os.sched_getaffinity(0)),
    "umask": _status.get("Umask"),
    "cwd": os.getcwd(),
    "environ": dict(os.environ),
    "tzname": list(time.tzname),
    "timezone": [time.timezone, time.altzone, time.daylight],
    "localtime": time.strftime("%Y-%m-%d %H:%M %Z %z", time.localtime(1_700_000_000)),
    "locale": list(locale.getlocale()),
    "setlocale": {n: locale.setlocale(getattr(locale, n)) for n in (
        "LC_CTYPE", "LC_COLLATE", "LC_TIME", "LC_NUMERIC", "LC_MONETARY", "LC_MESSAGES")},
    "encodings": [sys.getfilesystemencoding(), locale.getpreferredencoding(False),
                  sys.flags.utf8_mode, sys.stdin.encoding if sys.stdin else None],
    "signals": {str(int(s)): _handler(signal.getsignal(s)) for s in signal.valid_signals()
                if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "mask": _mask,
    "fds": _fds,
    "threads": _threads,
    "comm": _comm,
    "thread_names": sorted(re.sub(r"\d+", "N", t.name) for t in threading.enumerate()),
    "argv": [re.sub(r"kernel-\d+\.json$", "{cf}", a) for a in sys.argv],
    "orig_argv": [re.sub(r"kernel-\d+\.json$", "{cf}", a) for a in sys.orig_argv],
    "flags": repr(sys.flags),
    "path": sys.path,
    "executable": sys.executable,
    "main": [getattr(__main__, "__name__", None), getattr(__main__, "__file__", None),
             repr(getattr(__main__, "__spec__", None)), type(__main__).__name__],
    "session": [os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid()],
    "ppid": os.getppid(),
    "cmdline": _read("/proc/self/cmdline").split("\0"),
    "hash": hash("overmind-lab"),
    "random": random.random(),
}
import numpy, torch
obs["numpy"] = float(numpy.random.random())
obs["torch"] = float(torch.rand(1))
obs["environ_after_imports"] = dict(os.environ)
obs["comm_after_imports"] = _comms()
print(json.dumps(obs))
"""

#: Differences that are intended (Note [What a warm kernel does not share with a fresh
#: one]); each must be what ``kernel status`` lists.
INTENDED = {"ppid", "cmdline", "hash", "random", "numpy", "torch", "fds", "thread_names"}


def _differences(plain: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """What differs, but for INTENDED: (plain, warm), or per key for a dictionary."""
    out: dict[str, Any] = {}
    for key in sorted(set(plain) | set(warm)):
        a, b = plain.get(key), warm.get(key)
        if a == b or key in INTENDED:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out[key] = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
                        if a.get(k) != b.get(k)}
        else:
            out[key] = (a, b)
    return out


class Kernel:
    """A kernel of ``name`` through jupyter_client, its log lines and its stderr file."""

    def __init__(self, name: str, cwd: str, env: dict[str, str], stderr: Path) -> None:
        from jupyter_client.manager import KernelManager

        # the connection file under the private directory: a plain kernel's command line
        # names it, so the teardown finds it
        runtime = Path(os.environ["JUPYTER_RUNTIME_DIR"])
        runtime.mkdir(exist_ok=True)

        self.handler = ListHandler()
        log = logging.getLogger(f"warm-fresh-{id(self)}")
        log.addHandler(self.handler)
        log.setLevel(logging.INFO)
        self.stderr = stderr.open("a")
        self.km = KernelManager(kernel_name=name, log=log,
                                connection_file=str(runtime / f"kernel-{id(self)}.json"))
        self.kc: Any = None
        try:
            self.km.start_kernel(cwd=cwd, env=env, stderr=self.stderr, stdout=self.stderr)
            self.kc = self.km.client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=120)
        except BaseException:
            self.close()
            raise

    @property
    def warm(self) -> bool:
        return getattr(self.km.provisioner, "warm", None) is not None

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.pid)

    def log_text(self) -> str:
        return "\n".join(self.handler.lines)

    def observe(self) -> dict[str, Any]:
        out = run_cell(self.kc, OBSERVE, 300)
        return dict(json.loads(out.strip().splitlines()[-1]))

    def close(self) -> None:
        try:
            if self.kc is not None:
                self.kc.stop_channels()
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=False)
        finally:
            self.stderr.close()


@pytest.fixture(scope="module")
def lab() -> Iterator[dict[str, Any]]:
    """A private zygote directory, the warm and a plain kernelspec (same argv and env),
    the launch environment, and a ready zygote (started by a first, plain, launch)."""
    with tempfile.TemporaryDirectory(prefix="olwf-", dir="/tmp") as d:
        mp = pytest.MonkeyPatch()
        try:
            mp.setenv("OVERMIND_LAB_SOCKET", f"{d}/d.sock")
            # debugpy, as warm kernels learn it (ipykernel imports it as it starts): its
            # import sets PYDEVD_USE_FRAME_EVAL (Note [Environment set at import])
            mp.setenv("OVERMIND_LAB_PRELOAD", PRELOAD + ",debugpy")
            mp.setenv("JUPYTER_PATH", f"{d}/prefix/share/jupyter")
            mp.setenv("JUPYTER_RUNTIME_DIR", f"{d}/runtime")
            spec.install(prefix=f"{d}/prefix", env=SPEC_ENV)
            from jupyter_client.kernelspec import KernelSpecManager

            plain = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                              "{connection_file}"], "display_name": "Python 3 (plain)",
                     "language": "python", "interrupt_mode": "signal", "env": SPEC_ENV}
            Path(d, "plain").mkdir()
            Path(d, "plain", "kernel.json").write_text(json.dumps(plain))
            KernelSpecManager().install_kernel_spec(f"{d}/plain", kernel_name=PLAIN,
                                                    prefix=f"{d}/prefix")
            env = dict(os.environ)  # fixed now: later imports here may change os.environ
            first = Kernel(spec.DEFAULT_NAME, "/", env, Path(d, "first.err"))
            first.close()
            assert not first.warm
            zygote = ready_zygote(Path(d))
            yield {"dir": Path(d), "env": env, "zygote": zygote}
        finally:
            _kill_ours(d)
            mp.undo()


@contextmanager
def _server_attributes(zygote_pid: int) -> Iterator[None]:
    """This process (the "server") takes other values than its zygote got at its start,
    and the zygote moves into a cgroup of its own; all undone at exit. What only root may
    undo (a lower nice and oom_score_adj, groups, cgroups) is changed as root only."""
    root = os.getuid() == 0
    with ExitStack() as undo:
        old_mask = os.umask(0o027)
        undo.callback(os.umask, old_mask)
        if root:
            nice = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, nice + 3)
            undo.callback(os.setpriority, os.PRIO_PROCESS, 0, nice)
        for name in ("RLIMIT_NOFILE", "RLIMIT_CORE"):
            which = getattr(resource, name)
            soft, hard = resource.getrlimit(which)
            new = 1000 if name == "RLIMIT_NOFILE" else 4096
            resource.setrlimit(which, (min(new, hard), hard))
            undo.callback(resource.setrlimit, which, (soft, hard))
        if root:
            oom = Path("/proc/self/oom_score_adj")
            old_oom = oom.read_text().strip()
            oom.write_text("123\n")
            undo.callback(oom.write_text, f"{old_oom}\n")
        cpus = os.sched_getaffinity(0)
        if len(cpus) > 1:
            os.sched_setaffinity(0, {min(cpus)})
            undo.callback(os.sched_setaffinity, 0, cpus)
        if root:
            groups = os.getgroups()
            os.setgroups([*groups, 4242])
            undo.callback(os.setgroups, groups)
            undo.enter_context(_zygote_in_own_cgroup(zygote_pid))
        yield


@contextmanager
def _zygote_in_own_cgroup(pid: int) -> Iterator[None]:
    """Move the zygote into a new child of its memory cgroup (v1; or the v2 one)."""
    lines = inherit._cgroups(Path(f"/proc/{pid}/cgroup").read_text())
    key = next((k for k in lines if k.endswith(":memory")), "0:" if "0:" in lines else None)
    if key is None:
        yield
        return
    parent = inherit._cgroup_dir(key, lines[key])
    child = parent / f"olwf-{os.getpid()}"
    child.mkdir()
    try:
        (child / "cgroup.procs").write_text(f"{pid}\n")
        yield
    finally:  # the zygote, and whatever it started meanwhile (a replacement zygote)
        for task in (child / "cgroup.procs").read_text().split():
            try:
                (parent / "cgroup.procs").write_text(f"{task}\n")
            except ProcessLookupError:
                pass
        child.rmdir()


def test_a_warm_kernel_observes_what_a_fresh_one_does(lab: dict[str, Any],
                                                      tmp_path: Path) -> None:
    env = {**lab["env"], "TZ": "Asia/Kolkata"}  # the zygote started without TZ
    zygote = ready_zygote(lab["dir"])
    obs: dict[str, list[dict[str, Any]]] = {"plain": [], "warm": []}
    with _server_attributes(zygote["pid"]):
        for kind, name in (("plain", PLAIN), ("warm", spec.DEFAULT_NAME)) * 2:
            k = Kernel(name, str(tmp_path), env, tmp_path / "kernels.err")
            try:
                assert k.warm == (kind == "warm"), k.log_text()
                obs[kind].append(k.observe())
                if kind == "warm" and len(obs["warm"]) == 2:  # a restart forks again
                    k.km.restart_kernel(now=False)
                    k.kc.wait_for_ready(timeout=120)
                    assert k.warm, k.log_text()
                    obs["warm"].append(k.observe())
            finally:
                k.close()
        zygote_cgroup = Path(f"/proc/{zygote['pid']}/cgroup").read_text()
    assert os.getuid() != 0 or f"olwf-{os.getpid()}" in zygote_cgroup, zygote_cgroup
    plain, warm = obs["plain"][0], obs["warm"][0]
    assert plain["status"]["Umask"] == "0027"  # the setup took
    if os.getuid() == 0:
        assert plain["priority"] >= 3 and plain["oom_score_adj"] == "123"
        assert "4242" in plain["status"]["Groups"].split()
    assert plain["tzname"] == ["IST", "IST"]
    unexpected = _differences(plain, warm)
    assert not unexpected, json.dumps(unexpected, indent=1)
    for other in obs["warm"][1:]:
        assert {k for k in plain if plain[k] != other[k]} <= INTENDED
    for p in obs["plain"][1:]:
        assert {k for k in plain if plain[k] != p[k]} <= INTENDED

    # the intended differences, and nothing else under their names
    status = ready_zygote(lab["dir"])
    assert warm["ppid"] == status["pid"] and plain["ppid"] == os.getpid()
    assert [f for f in warm["fds"] if f not in plain["fds"]] == ["anon_inode:[pidfd]"]
    assert sorted(set(plain["fds"]) - set(warm["fds"])) == []
    assert warm["threads"] == plain["threads"]
    assert (set(warm["thread_names"]) ^ set(plain["thread_names"])) <= {
        "overmind-lab-parent-watch", "Thread-N"}, (warm["thread_names"], plain["thread_names"])
    assert warm["environ"] == plain["environ"]
    assert warm["environ"].get("PYDEVD_USE_FRAME_EVAL") == "NO"
    assert warm["environ_after_imports"] == plain["environ_after_imports"]
    differences = "\n".join(status["differences"])
    for what in ("parent pid", "cmdline", "hash seed", "pidfd", "parent-watch",
                 "iopub_welcome", "ports listen", "while the old kernel shuts down"):
        assert what in differences
    for key in status["import_env"]:
        assert key in differences

    # random state: every kernel draws its own, as fresh ones do; the hash seed is shared
    for draw in ("random", "numpy", "torch"):
        warm_draws = [o[draw] for o in obs["warm"]]
        assert len(set(warm_draws)) == len(warm_draws), (draw, warm_draws)
        assert obs["plain"][0][draw] != obs["plain"][1][draw]
    assert len({o["hash"] for o in obs["warm"]}) == 1
    assert obs["plain"][0]["hash"] != obs["plain"][1]["hash"]


def test_the_locale_at_start_picks_another_zygote() -> None:
    """The locale variables fix the UTF-8 mode and the file system encoding at interpreter
    start, so kernels that differ in them never share a zygote (``_common/zygote_paths.py``)."""
    for key in ("LANG", "LC_ALL", "LC_CTYPE"):
        assert identity(sys.executable, {key: "C"}) != identity(sys.executable,
                                                                {key: "C.UTF-8"})


def test_kernel_status_lists_the_intended_differences(lab: dict[str, Any]) -> None:
    from overmind_lab.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["kernel", "status"]) == 0
    text = out.getvalue()
    assert "differs from a fresh kernel: parent pid" in text, text
    assert "str hash seed" in text


def test_what_no_child_can_change_gives_a_plain_kernel_and_one_log_line(
        lab: dict[str, Any], tmp_path: Path) -> None:
    """RLIMIT_STACK is fixed when a process starts: the zygote refuses before forking."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    new = 16 << 20 if soft != 16 << 20 else 12 << 20
    if hard != resource.RLIM_INFINITY and new > hard:
        new = hard // 2
    resource.setrlimit(resource.RLIMIT_STACK, (new, hard))
    try:
        k = Kernel(spec.DEFAULT_NAME, str(tmp_path), lab["env"], tmp_path / "k.err")
        try:
            assert not k.warm
            lines = [ln for ln in k.log_text().splitlines() if "plain kernel" in ln]
            assert len(lines) == 1 and "RLIMIT_STACK" in lines[0], k.log_text()
            limits = k.observe()["limits"]
            assert any(ln.startswith("Max stack size") and str(new) in ln for ln in limits)
        finally:
            k.close()
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))


def test_a_child_that_cannot_take_on_the_servers_cgroup_is_refused(
        lab: dict[str, Any], tmp_path: Path) -> None:
    """The fork happens, the child cannot join the cgroup, it says why and exits; the
    zygote reaps it, refuses, and keeps serving."""
    zygote = ready_zygote(lab["dir"])
    attributes = inherit.observe()
    lines = inherit._cgroups(attributes["cgroup"])
    key = next(iter(lines))
    lines[key] = lines[key].rstrip("/") + f"/olwf-missing-{os.getpid()}"
    attributes["cgroup"] = "".join(f"{k}:{v}\n" for k, v in lines.items())
    stdio = [os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC) for _ in range(3)]
    cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", str(tmp_path / "never.json")]
    try:
        with pytest.raises(WarmUnavailable, match="cannot move the kernel into the Jupyter "
                           r"server's cgroup .*olwf-missing.*No such file"):
            request_fork(cmd, lab["env"], str(tmp_path), stdio, watch_parent=False,
                         attributes=attributes)
    finally:
        for fd in stdio:
            os.close(fd)
    after = ready_zygote(lab["dir"])
    assert after["pid"] == zygote["pid"] and after["kernels"] == 0
    assert not [p for p in _children_of(zygote["pid"])]
    k = Kernel(spec.DEFAULT_NAME, str(tmp_path), lab["env"], tmp_path / "k.err")
    try:
        assert k.warm, k.log_text()
    finally:
        k.close()


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rpartition(")")[2].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_restarting_twice_quickly_prints_no_keyboard_interrupt(
        lab: dict[str, Any], tmp_path: Path) -> None:
    """Issue 20 item 7 (Note [Interrupted at birth]): jupyter_client interrupts a kernel
    before it shuts it down; a kernel still starting drops the interrupt."""
    err = tmp_path / "server.err"
    k = Kernel(spec.DEFAULT_NAME, str(tmp_path), lab["env"], err)
    try:
        assert k.warm, k.log_text()
        for _ in range(3):
            k.km.restart_kernel(now=False)
            k.km.restart_kernel(now=False)  # the first new kernel is still starting
            k.kc.wait_for_ready(timeout=120)
        k.km.restart_kernel(now=False)
        k.km.interrupt_kernel()  # SIGINT right after the fork, during ipykernel's start
        k.kc.wait_for_ready(timeout=120)
        assert k.warm
        assert run_cell(k.kc, "print(6 * 7)", 120).strip() == "42"
    finally:
        k.close()
    assert "KeyboardInterrupt" not in err.read_text(), err.read_text()[-3000:]




def test_with_the_zygotes_own_attributes_too(lab: dict[str, Any], tmp_path: Path) -> None:
    """The same comparison where nothing changed since the zygote started (its own CPU
    affinity: numpy's BLAS pool, sized in the child, against a fresh kernel's)."""
    obs = {}
    for kind, name in (("plain", PLAIN), ("warm", spec.DEFAULT_NAME)):
        k = Kernel(name, str(tmp_path), lab["env"], tmp_path / "kernels.err")
        try:
            assert k.warm == (kind == "warm"), k.log_text()
            obs[kind] = k.observe()
        finally:
            k.close()
    plain, warm = obs["plain"], obs["warm"]
    assert plain["ppid"] == os.getpid() and warm["ppid"] != os.getpid()
    # the pool: at start, a warm kernel's threads are a fresh one's after `import numpy`
    assert warm["comm"] == plain["comm_after_imports"] == warm["comm_after_imports"]
    unexpected = {k: v for k, v in _differences(plain, warm).items()
                  if k not in ("comm", "threads")}
    assert not unexpected, json.dumps(unexpected, indent=1)
    assert "BLAS thread pool" in "\n".join(ready_zygote(lab["dir"])["differences"])
