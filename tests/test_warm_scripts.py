"""``overmind-lab run`` against ``python``: a differential test of warm scripts (issue 37).

Every script here runs twice, as ``python SCRIPT ARGS`` and as ``overmind-lab run SCRIPT ARGS``
(forked from a real zygote), with the same environment, working directory and stdin, and what
each can observe is compared: what the warm kernel's differential test observes
(``tests/test_warm_kernel_fresh.py``: attributes, environment, signals, descriptors, threads,
``sys.path``, argv, ``__main__``), plus stdio and terminal, random draws, exit statuses,
signals, ``-m`` forms, multiprocessing, and a small pytest suite. The differences allowed are
those the README's "Warm scripts" limits name (Note [A script in another session] in
``_launcher/script.py``, Note [What a warm kernel does not share with a fresh one]).

The module's first run finds no zygote: it runs plain and starts one (the fallback). The
zygote's log is a FIFO this test reads, so the test waits for its "ready" line, an event, not
a clock. Every process started here names the test's private directory in its command line
(the zygote's, which forked scripts keep) and is killed at teardown.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overmind_lab._common.learned import read_learned
from overmind_lab._common.zygote_paths import ZygotePaths
from tests.test_warm_kernel_fresh import INTENDED as FRESH_INTENDED
from tests.test_warm_kernel_fresh import OBSERVE, _differences
from tests.test_warm_kernel_launcher import _kill_all

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

#: torch and numpy (their random state must be fresh), anyio (a pytest plugin's package, as
#: transformers imports it: Note [Pytest's plugins imported fresh]), colorsys (no plain script
#: imports it before its first line: a run that has it was forked).
PRELOAD = "torch,numpy,threadpoolctl,anyio,colorsys"
RUN = [str(Path(sys.executable).with_name("overmind-lab")), "run"]
PLAIN = [sys.executable]
#: How long a zygote may take to import (a loaded machine).
BOOT_TIMEOUT = 600

#: What the warm kernel's test observes, and what a script's process shows besides.
SCRIPT_OBSERVE = OBSERVE.replace("print(json.dumps(obs))", r"""
obs["forked"] = "colorsys" in _modules_at_start
obs["stdin"] = sys.stdin.read()
obs["stdio"] = [[s.isatty(), s.line_buffering, s.write_through, s.encoding, s.errors,
                 s.mode, s.buffer.name if hasattr(s.buffer, "name") else None,
                 type(s.buffer).__name__] for s in (sys.stdin, sys.stdout, sys.stderr)]
obs["dunder_stdio"] = [sys.__stdin__ is sys.stdin, sys.__stdout__ is sys.stdout]
obs["main_vars"] = {k: type(v).__name__ for k, v in vars(__main__).items()}
obs["main_module"] = sys.modules["__main__"] is __main__
obs["mp_authkey"] = __import__("multiprocessing").current_process().authkey.hex()
print("to stderr", file=sys.stderr)
print(json.dumps(obs))
""")
SCRIPT_OBSERVE = "import sys\n_modules_at_start = set(sys.modules)\n" + SCRIPT_OBSERVE

#: Differences allowed between a warm and a plain script (the README's limits).
INTENDED = {
    "ppid",  # the zygote's
    "cmdline",  # /proc/self/cmdline: the zygote's
    "hash",  # the str hash seed: the zygote's
    "random", "numpy", "torch", "mp_authkey",  # fresh in each: compared between two runs
    "session",  # Note [A script in another session]: it leads its own
    "forked",
    # Note [BLAS threads]: a preloaded numpy's pool runs from the start
    "threads", "comm",
}


class Zygote:
    """The zygote log of an identity made a FIFO, read by a thread: each zygote that boots
    for it says "ready" there (Note [A quiet zygote log])."""

    def __init__(self, paths: ZygotePaths) -> None:
        self.paths = paths
        os.mkfifo(paths.log, 0o600)
        # read-write: opening it never blocks, and no writer leaving ends it
        self.fd = os.open(paths.log, os.O_RDWR | os.O_CLOEXEC)
        self.stop_r, self.stop_w = os.pipe2(os.O_CLOEXEC)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        data = b""
        while True:
            ready = select.select([self.fd, self.stop_r], [], [])[0]
            if self.stop_r in ready:
                return
            data += os.read(self.fd, 65536)
            *done, data = data.split(b"\n")
            with self.changed:
                self.lines += [line.decode(errors="replace") for line in done]
                self.changed.notify_all()

    def wait_ready(self, count: int = 1) -> list[str]:
        """The log once ``count`` zygotes said they are ready."""
        def readies() -> int:
            return sum(" ready in " in line for line in self.lines)

        with self.changed:
            assert self.changed.wait_for(lambda: readies() >= count, BOOT_TIMEOUT), \
                "\n".join(self.lines)
            return list(self.lines)

    def close(self) -> None:
        os.write(self.stop_w, b"x")
        self.thread.join()
        for fd in (self.fd, self.stop_r, self.stop_w):
            os.close(fd)


@pytest.fixture(scope="module")
def lab() -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="olws-", dir="/tmp") as d:
        root = Path(d)
        work = root / "work"
        work.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        # the zygote outlives each run (Note [Idle zygote]); the teardown ends it
        env.update(OVERMIND_LAB_SOCKET=str(root / "d.sock"), OVERMIND_LAB_PRELOAD=PRELOAD,
                   OVERMIND_LAB_ZYGOTE_IDLE="3600", OVERMIND_TEST_SCRIPT_VAR="from-test")
        zygote = Zygote(ZygotePaths.for_launch(sys.executable, env))
        try:
            yield {"root": root, "work": work, "env": env, "zygote": zygote,
                   "fallback": _fallback(work, env, zygote)}
        finally:
            _kill_all(root)
            zygote.close()


def _fallback(work: Path, env: dict[str, str], zygote: Zygote) -> dict[str, Any]:
    """The first run: no zygote yet; plain, and one starts for the next."""
    write(work, "first.py", "import sys\nprint('colorsys' in sys.modules, sys.argv)\n")
    plain = run(PLAIN, "first.py", env, work)
    warm = run([*RUN, "-v"], "first.py", env, work)
    log = zygote.wait_ready()
    return {"plain": plain, "warm": warm, "log": log}


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def run(how: list[str], script: Path | str, env: dict[str, str], cwd: Path, *args: str,
        stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    target = [str(script)] if isinstance(script, Path) else script.split()
    return subprocess.run([*how, *target, *args], env=env, cwd=cwd, input=stdin, text=True,
                          capture_output=True, timeout=timeout)


def both(lab: dict[str, Any], script: Path | str, *args: str, stdin: str = "",
         ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The script run plain and warm (relative to the working directory, as typed)."""
    target = script.name if isinstance(script, Path) else script
    plain = run(PLAIN, target, lab["env"], lab["work"], *args, stdin=stdin)
    warm = run(RUN, target, lab["env"], lab["work"], *args, stdin=stdin)
    return plain, warm


def observe(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


#: glibc's own handler of signal 33 (SIGSETXID), which torch's import installs: a warm script,
#: whose torch was imported in the zygote, has it from its start.
SIGSETXID_BIT = 1 << 32


def _comparable(obs: dict[str, Any]) -> dict[str, Any]:
    """``obs`` without what differs between any two processes (object addresses in reprs), and
    without the handler of :data:`SIGSETXID_BIT`."""
    out = json.loads(re.sub(r" at 0x[0-9a-f]+", " at 0x...", json.dumps(obs)))
    status = out.get("status", {})
    if status.get("SigCgt"):
        status["SigCgt"] = f"{int(status['SigCgt'], 16) & ~SIGSETXID_BIT:016x}"
    return dict(out)


def differences(plain: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """What differs, but for :data:`INTENDED` (the kernel test's comparison; stricter: also the
    descriptors and threads, which a warm kernel has one more of)."""
    plain, warm = ({k: v for k, v in _comparable(obs).items() if k not in INTENDED}
                   for obs in (plain, warm))
    out = _differences(plain, warm)
    out.update({k: (plain.get(k), warm.get(k)) for k in FRESH_INTENDED - INTENDED
                if plain.get(k) != warm.get(k)})
    return out


def test_the_first_run_is_plain_and_starts_a_zygote(lab: dict[str, Any]) -> None:
    first = lab["fallback"]
    assert first["warm"].returncode == first["plain"].returncode == 0
    assert first["warm"].stdout == first["plain"].stdout == "False ['first.py']\n"
    assert first["warm"].stderr.startswith("overmind-lab run: plain Python: no zygote was running")
    assert any(" ready in " in line for line in first["log"])  # the next run's zygote


def test_a_warm_script_observes_what_a_plain_one_does(lab: dict[str, Any]) -> None:
    script = write(lab["work"], "observe.py", SCRIPT_OBSERVE)
    plain, warm = both(lab, script, "an arg", "--flag", stdin="line one\nline two\n")
    again = run(RUN, "observe.py", lab["env"], lab["work"], "an arg", "--flag", stdin="x")
    p, w, w2 = observe(plain), observe(warm), observe(again)
    assert w["forked"] and w2["forked"] and not p["forked"]
    assert differences(p, w) == {}
    assert warm.stderr == plain.stderr == "to stderr\n"
    assert w["argv"] == ["observe.py", "an arg", "--flag"]
    assert w["orig_argv"] == [sys.executable, "observe.py", "an arg", "--flag"]
    assert w["main"][:2] == ["__main__", str(lab["work"] / "observe.py")]
    assert w["path"][0] == str(lab["work"])
    assert w["stdin"] == "line one\nline two\n"
    assert w["environ"]["OVERMIND_TEST_SCRIPT_VAR"] == "from-test"
    # Note [A script in another session]: it leads its own session and process group
    assert w["session"] == [True, True] and p["session"] == [False, False]
    # fresh random state in each run, as in each plain process
    for key in ("random", "numpy", "torch", "mp_authkey", "hash"):
        assert w[key] != w2[key] or key == "hash", key


def test_a_module_run_with_dash_m(lab: dict[str, Any]) -> None:
    write(lab["work"], "observe_mod.py", SCRIPT_OBSERVE)
    plain, warm = both(lab, "-m observe_mod", "x", stdin="in")
    p, w = observe(plain), observe(warm)
    assert w["forked"]
    assert differences(p, w) == {}
    assert w["argv"] == [str(lab["work"] / "observe_mod.py"), "x"]
    assert w["path"][0] == str(lab["work"])
    package = lab["work"] / "pkg"
    package.mkdir()
    write(package, "__init__.py", "")
    write(package, "__main__.py", "import sys\nprint(__name__, __spec__.name, sys.argv)\n"
          "raise SystemExit('bye')\n")
    plain, warm = both(lab, "-m pkg", "y")
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        plain.returncode, plain.stdout, plain.stderr) == (1, plain.stdout, "bye\n")
    assert "pkg.__main__" in warm.stdout
    # ``python -m overmind_lab run`` is the same command
    via_m = run([sys.executable, "-m", "overmind_lab", "run"], "-m pkg", lab["env"],
                lab["work"], "y")
    assert (via_m.returncode, via_m.stdout, via_m.stderr) == (1, plain.stdout, "bye\n")


@pytest.mark.parametrize(("body", "status"), [
    ("print('fine')", 0),
    ("import sys\nprint('three')\nsys.exit(3)", 3),
    ("import sys\nsys.exit('a message')", 1),
    ("def f():\n    raise ValueError('boom')\nf()", 1),
    ("import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)", -9),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", -15),
    ("raise KeyboardInterrupt", -2),
    ("def broken(:\n    pass", 1),
], ids=["ok", "exit3", "exit-message", "exception", "sigkill", "sigterm", "keyboard", "syntax"])
def test_exit_status_and_output_are_plain_pythons(lab: dict[str, Any], body: str,
                                                  status: int) -> None:
    script = write(lab["work"], "status.py", "import sys\n" + body + "\n")
    plain, warm = both(lab, script)
    assert plain.returncode == status, plain.stderr
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        plain.returncode, plain.stdout, plain.stderr)


def _interrupted(how: list[str], lab: dict[str, Any], signum: int) -> tuple[int, str]:
    """A script that waits, given ``signum`` once it said it waits: its status and the last line
    of its stderr (the signal may come before its ``print`` returned)."""
    script = write(lab["work"], "wait.py", "import sys, time\nprint('waiting', flush=True)\n"
                   "time.sleep(600)\n")
    proc = subprocess.Popen([*how, script.name], env=lab["env"], cwd=lab["work"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "waiting\n"
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, (err.splitlines() or [""])[-1]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_run_reaches_the_script(lab: dict[str, Any], signum: int) -> None:
    plain = _interrupted(PLAIN, lab, signum)
    warm = _interrupted(RUN, lab, signum)
    assert warm == plain
    assert plain[0] == -signum
    assert plain[1] == ("KeyboardInterrupt" if signum == signal.SIGINT else "")


def test_a_killed_run_takes_its_script_with_it(lab: dict[str, Any]) -> None:
    script = write(lab["work"], "pid.py", "import os, time\nprint(os.getpid(), flush=True)\n"
                   "time.sleep(600)\n")
    proc = subprocess.Popen([*RUN, script.name], env=lab["env"], cwd=lab["work"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    assert pid != proc.pid
    pidfd = os.pidfd_open(pid)
    try:
        proc.kill()
        proc.wait()
        # Note [A script dies with its run]: the zygote sees the run's connection close
        assert select.select([pidfd], [], [], 120)[0], f"script {pid} outlived its run"
    finally:
        os.close(pidfd)
        proc.stdout.close()


#: A shell with job control in a pseudo-terminal: the job (the command in the arguments) in its
#: own foreground process group; it reports each stop on the terminal ("STOPPED N") and
#: continues the job ("fg"), then its exit ("EXIT N"). The harness types into the terminal:
#: a line, Ctrl-Z once the script read it, a line once it stopped (read once it continued),
#: Ctrl-C; it prints the transcript.
TERMINAL = r"""
import json, os, pty, select, signal, sys
cmd = json.loads(sys.argv[1])
pid, master = pty.fork()
if pid == 0:
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    job = os.fork()
    if job == 0:
        os.setpgid(0, 0)
        os.tcsetpgrp(0, os.getpgrp())
        signal.signal(signal.SIGTTOU, signal.SIG_DFL)
        os.execv(cmd[0], cmd)
    try:
        os.setpgid(job, job)
    except OSError:
        pass
    os.tcsetpgrp(0, job)
    while True:
        _, status = os.waitpid(job, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            break
        os.write(1, f"STOPPED {os.WSTOPSIG(status)}\n".encode())
        os.tcsetpgrp(0, job)
        os.killpg(job, signal.SIGCONT)
    os.write(1, f"EXIT {os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)
seen = b""
def until(token):
    global seen
    while token not in seen:
        assert select.select([master], [], [], 60)[0], seen
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
until(b"ready")
os.write(master, b"typed line\n")
until(b"got typed line")
os.write(master, b"\x1a")
until(b"STOPPED")
os.write(master, b"second line\n")
until(b"continued with second line")
os.write(master, b"\x03")
until(b"EXIT")
os.waitpid(pid, 0)
print(json.dumps(seen.decode(errors="replace")))
"""

TERMINAL_SCRIPT = r"""
import os, signal, sys, time
print("tty", [s.isatty() for s in (sys.stdin, sys.stdout, sys.stderr)],
      sys.stdout.line_buffering, sys.stdin.encoding)
print("ready")
print("got", sys.stdin.readline().strip())
# (no SIGCONT handler: a preloaded numpy's BLAS thread may take the signal while the main thread
# sleeps, and the handler would run when the sleep ends)
print("continued with", sys.stdin.readline().strip())
while True:
    time.sleep(600)
"""


def test_a_terminal_job_stops_continues_and_is_interrupted(lab: dict[str, Any]) -> None:
    script = write(lab["work"], "term.py", TERMINAL_SCRIPT)
    transcripts = []
    for how in (PLAIN, RUN):
        cmd = [*how, script.name] if how is PLAIN else [RUN[0], "run", script.name]
        done = subprocess.run([sys.executable, "-c", TERMINAL, json.dumps(cmd)],
                              env=lab["env"], cwd=lab["work"], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (how, done.stderr)
        transcripts.append(json.loads(done.stdout))
    # (where the traceback starts depends on when Ctrl-C came: before ``print`` returned)
    plain, warm = (re.sub(r"Traceback.*?KeyboardInterrupt", "<traceback>KeyboardInterrupt", t,
                          flags=re.S) for t in transcripts)
    assert "tty [True, True, True] True" in plain
    # echoed input aside, the terminal shows the same: Ctrl-Z stopped the job (SIGTSTP), it
    # continued, Ctrl-C ended it with KeyboardInterrupt by SIGINT
    assert warm == plain
    assert "STOPPED 20" in plain and "KeyboardInterrupt" in plain and "EXIT -2" in plain


MULTIPROCESSING = """
import multiprocessing, sys, threading
from concurrent.futures import ThreadPoolExecutor

def square(x):
    return x * x

if __name__ == "__main__":
    for method in ("spawn", "fork", "forkserver"):
        with multiprocessing.get_context(method).Pool(2) as pool:
            print(method, pool.map(square, range(5)))
    with ThreadPoolExecutor(3) as ex:
        print("threads", list(ex.map(square, range(5))))
    q = multiprocessing.get_context("spawn").Queue()
    p = multiprocessing.get_context("spawn").Process(target=q.put, args=(sys.argv[1],))
    p.start()
    print("queue", q.get())
    p.join()
    print("exitcode", p.exitcode, threading.active_count())
"""


def test_multiprocessing_and_threads_work_in_a_script(lab: dict[str, Any]) -> None:
    script = write(lab["work"], "mp.py", MULTIPROCESSING)
    plain, warm = both(lab, script, "hello")
    assert plain.returncode == 0, plain.stderr
    assert (warm.returncode, warm.stdout, warm.stderr) == (0, plain.stdout, plain.stderr)
    assert "spawn [0, 1, 4, 9, 16]" in warm.stdout and "queue hello" in warm.stdout


SUITE = {
    "test_ok.py": "def test_one():\n    assert 1 + 1 == 2\n\ndef test_two():\n    pass\n",
    "test_bad.py": "import pytest\n\ndef test_fails():\n    assert [1, 2] == [1, 3]\n\n"
                   "@pytest.fixture\ndef broken():\n    raise RuntimeError('fixture')\n\n"
                   "def test_errors(broken):\n    pass\n\n"
                   "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n",
}


def _summary(proc: subprocess.CompletedProcess[str]) -> tuple[int, list[str]]:
    """The status and the outcome lines (``PASSED``/``FAILED``/``ERROR``), the summary without
    its time."""
    lines = [re.sub(r" in [\d.]+s", "", line) for line in proc.stdout.splitlines()
             if re.match(r"(tests?/|FAILED|ERROR|=+ .*(passed|failed|error))", line)]
    return proc.returncode, lines


def test_pytest_runs_warm_with_plain_outcomes(lab: dict[str, Any]) -> None:
    folder = lab["work"] / "suite"
    folder.mkdir()
    for name, text in SUITE.items():
        write(folder, name, text)
    args = ("-p", "no:cacheprovider", "-rA")
    for target in ("suite/test_ok.py", "suite"):
        plain, warm = both(lab, "-m pytest", target, *args)
        assert _summary(warm) == _summary(plain), (plain.stdout, warm.stdout)
        assert "warning" not in _summary(plain)[1][-1]
        assert plain.returncode == (0 if target.endswith(".py") else 1)
    summary = _summary(warm)[1][-1]
    assert "1 failed, 2 passed, 1 skipped, 1 error" in summary


#: The project's own fast tests that need no daemon of their own: run both ways, their outcomes
#: must be the same, test by test.
OWN_FAST_TESTS = ("tests/test_display.py", "tests/test_protocol.py", "tests/test_layout.py",
                  "tests/test_run_start.py")


def test_the_projects_own_fast_tests_run_warm_with_plain_outcomes(lab: dict[str, Any]) -> None:
    root = Path(__file__).resolve().parents[1]
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q",
            *OWN_FAST_TESTS]
    plain = run(PLAIN, " ".join(args), lab["env"], root)
    warm = run([*RUN, "-v"], " ".join(args), lab["env"], root)
    assert "plain Python" not in warm.stderr, warm.stderr  # -v: says why a run was plain
    assert _summary(warm) == _summary(plain), (plain.stdout[-3000:], warm.stdout[-3000:])
    assert plain.returncode == 0 and re.search(r"\b\d{2,} passed", plain.stdout), plain.stdout


def test_the_zygote_learns_what_scripts_import(lab: dict[str, Any]) -> None:
    """A module a warm run imported (``wave``, which nothing here preloads) is learned at its
    exit; the zygote that replaces this one once forks pause (Note [A renewal waits for a
    pause]) preloads it, and the next run finds it imported."""
    zygote: Zygote = lab["zygote"]
    script = write(lab["work"], "learn.py", "import sys\nprint('wave' in sys.modules)\n"
                   "import wave\n")
    assert run(RUN, script, lab["env"], lab["work"]).stdout == "False\n"
    assert "wave" in read_learned(zygote.paths.learned)
    for _ in range(3):  # (a renewal that began before the run learned it lacks it: the next)
        readies = sum(" ready in " in line for line in zygote.lines)
        zygote.wait_ready(readies + 1)  # the renewal
        found = run(RUN, script, lab["env"], lab["work"]).stdout
        if found == "True\n":
            break
    assert found == "True\n"
