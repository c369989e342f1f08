"""The ``orders`` case: what a user waits for, in the order they type it.

The suite's fp16 UNet (stored fp16, loaded with ``dtype=torch.float16``), the weight file as a
save leaves it (``as_saved``, before each round's plain load and before each first load), every
row a fresh ``python -m benchmarks._orders JOB`` process and a ratio to a plain load measured in
the same round. "touch": the first read of every weight page (one byte of each 4 KiB page of
every storage), as the suite's load + first touch table. Rows:

1. ``plain``: torch and diffusers imported (not timed), ``from_pretrained`` + touch;
2. ``notebook``: ``import overmind_lab; overmind_lab.patch_all()`` first (what ``%load_ext
   overmind_lab`` and ``%overmind_load`` do), then torch and diffusers (not timed), then the
   patched ``from_pretrained`` + touch; timed: the import of overmind_lab, ``patch_all``, the load
   and the touch; the cache warm;
3. ``script``: torch and diffusers first (not timed), then, timed, ``import overmind_lab;
   overmind_lab.patch_all()``, the load and the touch; the cache warm;
4. ``first_call``: in the script-order process, the same load + touch again (the first object
   alive): first / repeated;
5. ``first``: the entry evicted, the daemon running: the call's return + touch, and when its
   background store ended (the entry stored). Rows 5 to 8 run in notebook-order processes and
   count the call and the touch (their import of overmind_lab and ``patch_all`` reported apart);
6. ``login``: no daemon running as the process starts (the private one stopped, the entry
   evicted): its ``patch_all`` starts one ahead while torch and diffusers import (Note [A daemon
   started ahead]; off with ``OVERMIND_LAB_START_AHEAD=0``), or the load does, on the same socket
   (``OVERMIND_LAB_SOCKET``, its cache directory through ``OVERMIND_LAB_CACHE_DIR``); whether one
   served at the load is recorded, and the load event's ``daemon_seconds`` is a start's part;
7. ``killed``: ``kill -9`` of the daemon holding the saved entry; the load serves the entry saved
   on disk and starts a new daemon meanwhile (Note [A hit from the disk]): over a warm hit (row 2's
   call + touch) and over plain;
8. ``after_first``: a warm load + touch in a process started (and imported) beforehand, sent
   right after the first load's process (row 5) reported its entry stored and exited, while the
   daemon still copies or refolds the held file (its status just before is recorded);
9. ``disk``: the cache directory's blocks (after the daemon is quiet, inodes of the model's own
   files not counted twice) plus the model's files, over the model's files; ``held_bytes`` and
   ``held_files`` from the daemon's status.

A round starts its 7 processes at once: those that time nothing before their load (plain, script)
import together, then each notebook-order process alone up to its "ready" (its timed import of
overmind_lab and ``patch_all`` never runs beside another import). Then, one at a time: plain;
first and, right after, after_first; the disk measured; notebook and script (alternating which
goes first); ``kill -9``, killed; the entry evicted, the daemon stopped, login; then the daemon a
load started is stopped and the suite's private daemon started again. Each process also reports
where its load call's time went, seen from outside (``load_usage``: its thread's and process's
CPU, page faults, context switches, the daemon's and the rest of the machine's CPU meanwhile);
with ``OVERMIND_BENCH_ORDERS_PROFILE=DIR`` its timed part runs under cProfile (``DIR/ROW-N.prof``).
Every daemon a load started is stopped, also on an error or Ctrl-C (found by the socket path in
its command line). With ``--socket`` (the user's daemon) rows 6, 7 and 9 are not measured.

The measuring process imports nothing of overmind_lab before its timed part may (this module
imports the standard library only at its top; what the parent needs is imported in functions).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks._numbers import fmt, ratio, stats

if TYPE_CHECKING:
    from benchmarks._runner import Child, Timeouts
    from benchmarks._service import PrivateDaemon

__all__ = ["LIMITS", "ROWS", "TARGETS", "markdown", "run_orders", "target_values"]

Progress = Callable[[str], None]

#: The rows, in the order of the table: (id, title).
ROWS: list[tuple[str, str]] = [
    ("plain", "plain: torch, diffusers imported; `from_pretrained` + touch"),
    ("notebook", "notebook order: `import overmind_lab; patch_all()`, then torch and diffusers, "
                 "then the patched load + touch (warm)"),
    ("script", "script order: torch and diffusers, then `import overmind_lab; patch_all()`, the "
               "patched load + touch (warm)"),
    ("first_call", "script-order process: its first load + touch / the same again"),
    ("first", "first load, the daemon running, the entry evicted"),
    ("login", "first load of a login: no daemon running as the process starts (its `patch_all` "
              "starts one ahead, or the load does)"),
    ("killed", "first load after `kill -9` of the daemon holding the entry (the load serves the "
               "entry saved on disk and starts a new daemon)"),
    ("after_first", "warm load right after the first load returned (the daemon still copying or "
                    "refolding)"),
    ("disk", "disk: the cache's bytes + the model's files / the model's files"),
]
#: Row -> (what the limit applies to, the limit).
LIMITS: dict[str, float] = {"notebook": 0.15, "script": 0.25, "first_call": 1.3, "first": 1.2,
                            "login": 1.2, "killed": 2.0, "after_first": 0.5, "disk": 1.05}
#: The suite's targets from this case (id, description, limit).
TARGETS: list[tuple[str, str, float]] = [
    ("or_notebook", "orders: notebook order (import overmind_lab, patch_all, then torch and "
                    "diffusers), import + patch_all + load + touch / plain load + touch, UNet "
                    "fp16, warm", LIMITS["notebook"]),
    ("or_script", "orders: script order (torch and diffusers, then import overmind_lab and "
                  "patch_all), import + patch_all + load + touch / plain, warm",
     LIMITS["script"]),
    ("or_first_call", "orders: script-order process, first load + touch / the same repeated",
     LIMITS["first_call"]),
    ("or_first", "orders: first load (daemon running, entry evicted) + touch / plain",
     LIMITS["first"]),
    ("or_login", "orders: first load of a login (no daemon as the process starts) + touch / plain",
     LIMITS["login"]),
    ("or_killed", "orders: load after kill -9 of the daemon (served from the disk, a new one "
                  "started) + touch / a warm hit", LIMITS["killed"]),
    ("or_after_first", "orders: warm load + touch right after the first load (daemon copying or "
                       "refolding) / plain", LIMITS["after_first"]),
    ("or_disk", "orders: disk used by the cache + the model's files / the model's files",
     LIMITS["disk"]),
]
#: Each process's row, its import order and the outcome its load must have.
_PROCS: dict[str, tuple[str, str | None]] = {
    "plain": ("plain", None), "first": ("notebook", "cold"), "after_first": ("notebook", "warm"),
    "notebook": ("notebook", "warm"), "script": ("script", "warm"),
    "killed": ("notebook", "warm"), "login": ("notebook", "cold"),
}
#: Set to a folder: each process's timed part runs under cProfile, its stats written there.
PROFILE_ENV = "OVERMIND_BENCH_ORDERS_PROFILE"
_LOADER = "diffusers:UNet2DConditionModel"


# -- the measuring process ---------------------------------------------------------------------
def _child(job: dict[str, Any]) -> None:
    from benchmarks import _child as io  # the standard library only

    io._setup_streams()
    io._quiet_libraries()
    # the parent says when: a timed import of overmind_lab runs while no other process imports
    io._wait_for("begin")
    order = job["order"]
    before = "overmind_lab" in sys.modules  # nothing may have imported it: checked by the parent
    times: dict[str, float] = {}
    om: Any = None
    if order == "notebook":
        t0 = time.perf_counter()
        import overmind_lab

        t1 = time.perf_counter()
        overmind_lab.patch_all()
        om = overmind_lab
        t2 = time.perf_counter()
        times.update(import_overmind=t1 - t0, patch_all=t2 - t1)
    t2 = time.perf_counter()
    import torch

    t3 = time.perf_counter()
    from diffusers import UNet2DConditionModel

    t4 = time.perf_counter()
    times.update(import_torch=t3 - t2, import_diffusers=t4 - t3)
    io._send("ready", pid=os.getpid(), overmind_imported_before=before,
             overmind_imported_at_ready="overmind_lab" in sys.modules, **times)
    io._wait_for("go")

    profile = None
    if job.get("profile"):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    if order == "script":
        t0 = time.perf_counter()
        import overmind_lab

        t1 = time.perf_counter()
        overmind_lab.patch_all()
        t2 = time.perf_counter()
        om = overmind_lab
        times.update(import_overmind=t1 - t0, patch_all=t2 - t1)
    started = time.monotonic()
    first = _load_and_touch(om, UNet2DConditionModel, job["path"], torch)
    load, touch, event, obj = first["load"], first["touch"], first["event"], first["obj"]
    if profile is not None:
        profile.disable()
        profile.dump_stats(job["profile"])
    result: dict[str, Any] = {"pid": os.getpid(), "load_seconds": load, "touch_seconds": touch,
                              "load_event": event, "outcome": event.get("outcome", "plain"),
                              "load_usage": first["usage"], **times}
    if job.get("repeat"):
        # the same call again, the first object alive: what the first paid on top is the process's
        # start-up (imports of the load machinery, the connection, scans)
        again = _load_and_touch(om, UNet2DConditionModel, job["path"], torch)
        result.update(repeat_load_seconds=again["load"], repeat_touch_seconds=again["touch"],
                      repeat_outcome=again["event"].get("outcome"), repeat_usage=again["usage"])
        del again
    storages = _storages(obj)
    result.update(storage_bytes=sum(int(s.nbytes()) for s in storages), storages=len(storages))
    if om is not None and job.get("wait_stores"):
        # the stores the load left running (seen as it returned: one may end before the touch
        # does, and wait_for_stores names only those still running)
        stored = None
        for store in first["stores"]:
            if not store.done.wait(job.get("store_timeout", 900)):
                raise TimeoutError(f"the store of {store.name} has not ended")
            stored = (store.finished or started) - started
            if store.error is not None:
                result["store_error"] = store.error
        # a small result is stored before the call returns (no background store)
        result["stored_seconds"] = load if stored is None else stored
        result["background_store"] = stored is not None
    io._send("result", **result)


def _storages(obj: Any) -> list[Any]:
    from benchmarks._child import _tensors, _unique_storages

    return list(_unique_storages(_tensors(obj)))


def _jiffies(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def _machine() -> tuple[int, dict[int, int]]:
    """The machine's busy CPU time and that of each daemon on this process's socket, in ticks."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # not idle, not iowait
    socket = os.environ.get("OVERMIND_LAB_SOCKET", "").encode()
    daemons: dict[int, int] = {}
    if socket:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        args = f.read().split(b"\0")
                    if socket in args and b"serve" in args:
                        daemons[int(entry)] = _jiffies(entry)
    return busy, daemons


def _usage() -> tuple[float, float, Any, tuple[int, dict[int, int]]]:
    import resource

    machine = _machine()  # first: its reading of /proc not counted as the call's
    return (time.thread_time(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF),
            machine)


def _usage_since(before: tuple[float, float, Any, tuple[int, dict[int, int]]]
                 ) -> dict[str, float]:
    """Where a call's wall time went, from outside: this thread's and the process's CPU time, page
    faults, context switches (voluntary: it waited; involuntary: another task took the CPU), the
    CPU time the daemon used meanwhile (one the call started included) and the rest of the
    machine's (others: a forked store, other processes), the last two in 10 ms ticks."""
    import resource

    thread, process, ru, (busy, daemons) = before
    now = (time.thread_time(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF),
           _machine())  # the machine's last: its reading of /proc not counted as the call's
    tick = os.sysconf("SC_CLK_TCK")
    daemon = sum(t - daemons.get(pid, 0) for pid, t in now[3][1].items()) / tick
    machine = (now[3][0] - busy) / tick
    return {"thread_cpu_seconds": now[0] - thread, "process_cpu_seconds": now[1] - process,
            "minor_faults": now[2].ru_minflt - ru.ru_minflt,
            "major_faults": now[2].ru_majflt - ru.ru_majflt,
            "voluntary_switches": now[2].ru_nvcsw - ru.ru_nvcsw,
            "involuntary_switches": now[2].ru_nivcsw - ru.ru_nivcsw,
            "daemon_cpu_seconds": daemon,
            "others_cpu_seconds": max(0.0, machine - daemon - (now[1] - process))}


def _load_and_touch(om: Any, cls: Any, path: str, torch: Any) -> dict[str, Any]:
    """The load (through the patched ``from_pretrained`` when ``om``) and the first read of every
    weight page, timed apart as the suite's load + touch table (``load``, ``touch``); the load's
    ``event``, the object, the ``stores`` it left running in the background (``StoreOutcome``s,
    seen as the call returned) and where the load's time went (``usage``)."""
    from benchmarks._child import _touch_pages

    event: dict[str, Any] = {}
    stores: list[Any] = []
    before = _usage()
    if om is None:
        start = time.perf_counter()
        obj = cls.from_pretrained(path, dtype=torch.float16)
        load = time.perf_counter() - start
    else:
        start = time.perf_counter()
        with om.record_loads() as events:
            obj = cls.from_pretrained(path, dtype=torch.float16)
        load = time.perf_counter() - start
    usage = _usage_since(before)
    if om is not None:
        # a cold load imported it (a hit does not): the stores still running as the call returned
        background = sys.modules.get("overmind_lab._loading.background")
        stores = list(background.pending_stores()) if background is not None else []
        if events:
            ev = events[-1]
            event = {"outcome": ev.outcome, "seconds": ev.seconds, "cold_seconds": ev.cold_seconds,
                     "daemon_seconds": ev.daemon_seconds, "reason": ev.reason, "key": ev.key}
        else:
            event = {"outcome": "unknown"}
    storages = _storages(obj)
    start = time.perf_counter()
    _touch_pages(storages)
    touch = time.perf_counter() - start
    return {"load": load, "touch": touch, "event": event, "obj": obj, "stores": stores,
            "usage": usage}


def _child_main(argv: list[str]) -> None:
    import traceback

    from benchmarks import _child as io

    try:
        _child(json.loads(argv[0]))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 1
        if io._proto is not None:
            io._send("error", error=f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc())
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    io._proto.flush()
    os._exit(0)  # no teardown (unmapping the weights one by one): the parent waits for the exit


# -- the parent ----------------------------------------------------------------------------------
def _start(job: dict[str, Any], env: dict[str, str], log_path: Path, timeouts: Timeouts) -> Child:
    """A measuring process of this case (``Child``'s protocol, this module's ``__main__``)."""
    from benchmarks._runner import Child

    child = Child(job, env, log_path, timeouts)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._orders", json.dumps(job)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, close_fds=True,
            start_new_session=True)
    return child


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _daemons_on(socket: str) -> list[int]:
    """This user's ``overmind_lab serve`` processes whose command line names ``socket``."""
    needle = socket.encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            args = _cmdline(int(entry)).split(b"\0")
            if b"serve" in args and needle in args and _alive(int(entry)):
                out.append(int(entry))
    return out


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


def _disk_usage(paths: list[Path], skip: set[tuple[int, int]] | None = None
                ) -> tuple[int, int, int, set[tuple[int, int]]]:
    """Blocks (``du``), apparent bytes and the count of the distinct files under ``paths``, each
    inode once and those in ``skip`` not at all; and the inodes counted."""
    seen: set[tuple[int, int]] = set()
    blocks = apparent = files = 0
    for root in paths:
        walk = [root] if root.is_file() else list(root.rglob("*"))
        for p in walk:
            with contextlib.suppress(OSError):
                st = p.lstat()
                if not p.is_file() or p.is_symlink():
                    continue
                ident = (st.st_dev, st.st_ino)
                if ident in seen or (skip and ident in skip):
                    continue
                seen.add(ident)
                blocks += st.st_blocks * 512
                apparent += st.st_size
                files += 1
    return blocks, apparent, files, seen


#: The rows whose time counts overmind_lab's import and ``patch_all`` (rows 2 and 3); the others
#: are the load call and the touch (the import and ``patch_all`` reported apart).
WITH_IMPORT = ("notebook", "script")


def _total(rec: dict[str, Any], with_import: bool) -> float:
    """What the user waits for: the load and the touch, after overmind_lab's import and
    ``patch_all`` when ``with_import``."""
    extra = rec.get("import_overmind", 0.0) + rec.get("patch_all", 0.0) if with_import else 0.0
    return float(extra + rec["load_seconds"] + rec["touch_seconds"])


class _Orders:
    def __init__(self, daemon: PrivateDaemon, path: Path, repeat: int, env: dict[str, str],
                 progress: Progress, log_dir: Path, timeouts: Timeouts) -> None:
        self.daemon, self.path, self.repeat = daemon, path, repeat
        self.progress, self.log_dir, self.timeouts = progress, log_dir, timeouts
        self.private = daemon.private
        self.env = dict(env)
        if daemon.cache_dir:  # a daemon a load starts keeps the private cache
            self.env["OVERMIND_LAB_CACHE_DIR"] = daemon.cache_dir
        if daemon.budget:
            self.env["OVERMIND_LAB_BUDGET"] = daemon.budget
        self.profile_dir = os.environ.get(PROFILE_ENV)
        if self.profile_dir:
            Path(self.profile_dir).mkdir(parents=True, exist_ok=True)
        self.errors: list[str] = []
        self.runs: dict[str, list[dict[str, Any]]] = {name: [] for name in _PROCS}
        self.rounds: list[dict[str, Any]] = []
        self.started_daemons: list[int] = []  # pids of the daemons loads started

    # -- daemons -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return dict(self.daemon.client().status())

    def stop_daemon(self) -> None:
        """Stop whatever daemon serves the socket (the private one, or one a load started)."""
        pid = self.status().get("pid")
        with contextlib.suppress(Exception):
            self.daemon.client().stop(timeout=30.0, force=True)
        if pid and not _wait_gone(int(pid), 10):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
            _wait_gone(int(pid), 10)
        proc = self.daemon.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def kill_daemon(self) -> int | None:
        """``kill -9`` of the daemon (its saved index complete first)."""
        self.daemon.wait_quiet()
        pid = self.status().get("pid")
        if not pid:
            return None
        os.kill(int(pid), signal.SIGKILL)
        proc = self.daemon.proc
        if proc is not None and proc.pid == int(pid):
            proc.wait(timeout=10)
        _wait_gone(int(pid), 10)
        return int(pid)

    def note_started(self) -> None:
        pid = self.status().get("pid")
        proc = self.daemon.proc
        if pid and (proc is None or proc.pid != int(pid)):
            self.started_daemons.append(int(pid))

    def restore(self) -> None:
        """The suite's private daemon serving again, every daemon a load started stopped."""
        if not self.private:
            return
        proc = self.daemon.proc
        running = self.status()
        if running.get("running") and proc is not None and proc.poll() is None \
                and running.get("pid") == proc.pid:
            return
        if running.get("running") or running.get("not_answering"):
            self.stop_daemon()
        self._kill_strays()
        self._keep_detached_log()
        self.daemon.start()

    def _kill_strays(self) -> None:
        """Daemons on the socket other than the suite's own (a load started them), by pid."""
        own = self.daemon.proc.pid if self.daemon.proc is not None else None
        for pid in _daemons_on(self.daemon.socket):
            if pid != own:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, 10)

    def _keep_detached_log(self) -> None:
        """Append the log of the daemons loads started (beside the socket) to the case's logs."""
        log = Path(self.daemon.socket + ".log")
        with contextlib.suppress(OSError):
            text = log.read_bytes()
            if text:
                with open(self.log_dir / "orders-started-daemons.log", "ab") as out:
                    out.write(text)
                log.write_bytes(b"")

    # -- one process ---------------------------------------------------------------------------
    def begin(self, name: str, child: Child) -> None:
        from benchmarks._runner import ChildError

        with contextlib.suppress(ChildError):  # reported by ready()
            child.send("begin")

    def ready(self, name: str, child: Child, i: int) -> dict[str, Any] | None:
        from benchmarks._runner import ChildError

        try:
            return child.expect("ready", self.timeouts.ready)
        except ChildError as exc:
            self.errors.append(f"orders: {name} {i + 1}: import: {exc}")
            return None

    def go(self, name: str, child: Child, ready: dict[str, Any] | None) -> dict[str, Any] | None:
        """Run one prepared process's timed part; its record (``None`` if it failed), with the
        daemon's state just before (``daemon_before``: running, copying or refolding...)."""
        from benchmarks._runner import ChildError

        head = f"orders: {name} {len(self.runs[name]) + 1}/{self.repeat}"
        before = {k: v for k, v in self.status().items()
                  if k in ("running", "pid", "copying", "refolding", "refold_passes", "unsaved",
                           "held_files", "entries")}
        if ready is None:
            rec: dict[str, Any] = {"error": "the process did not start"}
        else:
            try:
                child.send("go")
                rec = {**ready, **child.expect("result", self.timeouts.load)}
            except ChildError as exc:
                rec = {**ready, "error": str(exc)}
                child.kill()
        rec["exit_code"] = child.finish()
        rec["daemon_before"] = before
        self.runs[name].append(rec)
        expected = _PROCS[name][1]
        if "error" in rec:
            self.errors.append(f"{head}: {rec['error'].splitlines()[0] if rec['error'] else '?'}")
            self.progress(f"{head}: ERROR, see {child.log_path}")
            return None
        if rec.get("overmind_imported_before") or (_PROCS[name][0] != "notebook"
                                                   and rec.get("overmind_imported_at_ready")):
            rec["error"] = "overmind_lab was imported before its timed import"
            self.errors.append(f"{head}: {rec['error']}")
        if expected is not None and rec.get("outcome") != expected:
            rec["error"] = (f"outcome {rec.get('outcome')}, expected {expected} "
                            f"({rec.get('load_event', {}).get('reason')})")
            self.errors.append(f"{head}: {rec['error']}")
        if rec.get("store_error"):
            self.errors.append(f"{head}: store failed: {rec['store_error']}")
        extra = ""
        ev = rec.get("load_event") or {}
        if ev.get("daemon_seconds") is not None:
            extra += f", daemon start {fmt(ev['daemon_seconds'])}"
        if name in ("login", "killed"):
            extra += f", a daemon serving at go: {'yes' if before.get('running') else 'no'}"
        if rec.get("stored_seconds") is not None:
            extra += f", stored after {fmt(rec['stored_seconds'])}"
        if rec.get("repeat_load_seconds") is not None:
            extra += (f"; repeated load {fmt(rec['repeat_load_seconds'])} + touch "
                      f"{fmt(rec['repeat_touch_seconds'])}")
        self.progress(f"{head}: {fmt(_total(rec, name in WITH_IMPORT))} (import+patch "
                      f"{fmt(rec.get('import_overmind', 0) + rec.get('patch_all', 0))}, load "
                      f"{fmt(rec['load_seconds'])}, touch {fmt(rec['touch_seconds'])}"
                      f"{', outcome ' + str(rec.get('outcome')) if expected else ''}{extra})")
        return rec

    def disk(self) -> dict[str, Any]:
        cache = Path(self.daemon.cache_dir) if self.daemon.cache_dir else None
        model_blocks, model_apparent, model_files, model_inodes = _disk_usage([self.path])
        out: dict[str, Any] = {"model_bytes": model_blocks, "model_apparent_bytes": model_apparent,
                               "model_files": model_files}
        if cache is not None:
            blocks, apparent, files, _ = _disk_usage([cache], skip=model_inodes)
            out.update(cache_dir=str(cache), cache_bytes=blocks, cache_apparent_bytes=apparent,
                       cache_files=files,
                       ratio=ratio(model_blocks + blocks, model_blocks))
        status = self.status()
        out.update({k: status.get(k) for k in ("held_bytes", "held_files", "cached_bytes",
                                               "disk_bytes", "memfd_bytes", "tier", "entries",
                                               "copying", "refolding")})
        return out

    # -- one round -----------------------------------------------------------------------------
    def round(self, i: int) -> None:
        from benchmarks._memory import as_saved

        names = [n for n in _PROCS if self.private or n not in ("killed", "login")]
        children: dict[str, Child] = {}
        readies: dict[str, dict[str, Any] | None] = {}
        record: dict[str, Any] = {"round": i + 1}
        self.rounds.append(record)
        try:
            for name in names:
                job: dict[str, Any] = {"order": _PROCS[name][0], "path": str(self.path),
                                       "repeat": name == "script",
                                       "wait_stores": name in ("first", "login")}
                if self.profile_dir:
                    job["profile"] = str(Path(self.profile_dir) / f"{name}-{i + 1}.prof")
                children[name] = _start(job, self.env, self.log_dir / f"orders-{name}-{i + 1}.log",
                                        self.timeouts)
            # Those that time nothing before "go" import together; then each that times its
            # import of overmind_lab and patch_all (notebook order) alone, up to its "ready"; the
            # login's process only once no daemon runs (below).
            together = [n for n in names if _PROCS[n][0] != "notebook"]
            alone = [[n] for n in names if n not in together and n != "login"]
            for group in (together, *alone):
                for name in group:
                    self.begin(name, children[name])
                for name in group:
                    readies[name] = self.ready(name, children[name], i)
            # 1. plain, the file as a save leaves it
            self.daemon.evict_all()
            as_saved([self.path])
            self.go("plain", children["plain"], readies["plain"])
            # 5. the first load (the file still as saved), 8. a warm load right after it
            self.go("first", children["first"], readies["first"])
            self.go("after_first", children["after_first"], readies["after_first"])
            self.daemon.wait_quiet()
            # 9. the disk, the daemon quiet
            record["disk"] = self.disk()
            # 2., 3. and 4.: warm hits, in both orders
            for name in (("notebook", "script") if i % 2 == 0 else ("script", "notebook")):
                self.go(name, children[name], readies[name])
            if self.private:
                # 7. kill -9 of the daemon holding the saved entry
                record["killed_pid"] = self.kill_daemon()
                self.go("killed", children["killed"], readies["killed"])
                # the load served the entry saved on disk and started a daemon in a thread (Note
                # [A hit from the disk]): wait for that one (start() waits on the same start lock;
                # where the process ended before its thread began, it starts one)
                with contextlib.suppress(Exception):
                    self.daemon.client().start()
                self.note_started()
                self.daemon.wait_quiet()
                # 6. a login: no daemon, no entry when the process starts (its patch_all may start
                # one ahead, while torch and diffusers import: Note [A daemon started ahead]; else
                # the load starts it); the file as a save leaves it
                self.daemon.evict_all()
                self.stop_daemon()
                self.begin("login", children["login"])
                readies["login"] = self.ready("login", children["login"], i)
                as_saved([self.path])
                self.go("login", children["login"], readies["login"])
                self.note_started()
                self.daemon.wait_quiet()
        finally:
            for child in children.values():
                child.kill()
                child.finish()
            self.restore()

    # -- the summary -----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        def good(name: str) -> list[dict[str, Any]]:
            return [r for r in self.runs[name] if "error" not in r]

        totals = {name: stats([_total(r, name in WITH_IMPORT) for r in good(name)])
                  for name in self.runs}
        loads = {name: stats([r["load_seconds"] for r in good(name)]) for name in self.runs}

        def med(stats: dict[str, Any] | None) -> float | None:
            return None if stats is None else float(stats["median"])

        plain, plain_load = med(totals["plain"]), med(loads["plain"])
        warm = med(stats([_total(r, False) for r in good("notebook")]))
        rows: dict[str, dict[str, Any]] = {}
        for name in ("plain", "notebook", "script", "first", "login", "killed", "after_first"):
            runs = good(name)
            row: dict[str, Any] = {
                "total": totals[name], "load": loads[name],
                "touch": stats([r["touch_seconds"] for r in runs]),
                "import_patch": stats([r.get("import_overmind", 0.0) + r.get("patch_all", 0.0)
                                        for r in runs]) if name != "plain" else None,
                "ratio": ratio(med(totals[name]), plain),
                "load_ratio": ratio(med(loads[name]), plain_load),
                "failed": len(self.runs[name]) - len(runs), "n": len(runs),
            }
            daemon = [r["load_event"]["daemon_seconds"] for r in runs
                      if (r.get("load_event") or {}).get("daemon_seconds") is not None]
            row["daemon_start"] = stats(daemon)
            if daemon and len(daemon) == len(runs):
                row["ratio_without_daemon_start"] = ratio(
                    statistics.median([_total(r, False) - r["load_event"]["daemon_seconds"]
                                       for r in runs]),
                    plain)
            cold = [r["load_event"]["cold_seconds"] for r in runs
                    if (r.get("load_event") or {}).get("cold_seconds") is not None]
            if name in ("first", "login") and cold:
                row["loader"] = stats(cold)  # the loader's own time, as the event records it
                row["stored"] = stats([r["stored_seconds"] for r in runs
                                        if r.get("stored_seconds") is not None])
                row["stored_ratio"] = ratio(med(row["stored"]), plain_load)
            if name in ("login", "killed"):  # a daemon already serving as the load started
                row["daemon_running_at_go"] = sum(1 for r in runs
                                                  if (r.get("daemon_before") or {}).get("running"))
            if name == "killed":  # over a warm hit's load + touch (the notebook row's)
                row["over_warm"] = ratio(med(totals[name]), warm)
            usages = [r["load_usage"] for r in runs if r.get("load_usage")]
            row["load_usage"] = {k: statistics.median(u[k] for u in usages)
                                 for k in (usages[0] if usages else {})}
            rows[name] = row
        script = good("script")
        first = [r["load_seconds"] + r["touch_seconds"] for r in script]
        repeated = [r["repeat_load_seconds"] + r["repeat_touch_seconds"] for r in script
                    if r.get("repeat_load_seconds") is not None]
        rows["first_call"] = {
            "first": stats(first), "repeated": stats(repeated),
            "ratio": ratio(med(stats(first)), med(stats(repeated))),
            "with_import_ratio": ratio(med(totals["script"]), med(stats(repeated))),
            "n": len(repeated),
        }
        disks = [r["disk"] for r in self.rounds if r.get("disk")]
        ratios = [d["ratio"] for d in disks if d.get("ratio") is not None]
        rows["disk"] = {"ratio": statistics.median(ratios) if ratios else None,
                        "last": disks[-1] if disks else None, "n": len(ratios)}
        limited = {"notebook": rows["notebook"]["ratio"], "script": rows["script"]["ratio"],
                   "first_call": rows["first_call"]["ratio"], "first": rows["first"]["ratio"],
                   "login": rows["login"]["ratio"], "killed": rows["killed"].get("over_warm"),
                   "after_first": rows["after_first"]["ratio"], "disk": rows["disk"]["ratio"]}
        for name, value in limited.items():
            rows[name]["value"] = value
            rows[name]["limit"] = LIMITS[name]
            rows[name]["passed"] = None if value is None else value <= LIMITS[name]
        return rows


def run_orders(daemon: PrivateDaemon, path: Path, repeat: int, env: dict[str, str],
               progress: Progress, log_dir: Path, timeouts: Timeouts) -> dict[str, Any]:
    """Run the case on the suite's fp16 UNet folder ``path`` with the suite's daemon (left serving
    when it returns or raises); JSON-ready results, with ``errors``."""
    lab = _Orders(daemon, path, repeat, env, progress, log_dir, timeouts)
    result: dict[str, Any] = {
        "path": str(path), "loader": _LOADER, "dtype": "float16", "repeat": repeat,
        "private_daemon": daemon.private, "limits": LIMITS, "errors": lab.errors,
        "touch": "one byte of every 4 KiB page of every storage (the suite's load + touch)",
        "skipped": [] if daemon.private else ["killed", "login", "disk"],
    }
    try:
        for i in range(repeat):
            progress(f"orders: round {i + 1}/{repeat}: {len(_PROCS)} fresh processes importing")
            lab.round(i)
    finally:
        lab.restore()
        result["started_daemons"] = lab.started_daemons
        result["started_daemons_left"] = [p for p in lab.started_daemons if _alive(p)]
        result["runs"] = lab.runs
        result["rounds"] = lab.rounds
    if result["started_daemons_left"]:
        lab.errors.append(f"daemons a load started are still running: "
                          f"{result['started_daemons_left']}")
    result["rows"] = rows = lab.summary()
    progress("orders: " + "; ".join(
        f"{name} {_x(rows[name].get('value'))} (<= {LIMITS[name]:g})" for name in LIMITS))
    return result


def _x(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def target_values(orders: dict[str, Any]) -> dict[str, float | None]:
    """The suite's ``or_*`` targets from the case's results."""
    rows = orders.get("rows") or {}
    if not rows or orders.get("error"):
        return {}
    return {f"or_{name}": (rows.get(name) or {}).get("value") for name in LIMITS}


# -- results.md ----------------------------------------------------------------------------------
def _cell(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "-"
    return f"{fmt(stats['median'])} ({fmt(stats['min'])}–{fmt(stats['max'])})"


def _mark(row: dict[str, Any]) -> str:
    passed = row.get("passed")
    return "n/a" if passed is None else ("pass" if passed else "**FAIL**")


def markdown(orders: dict[str, Any] | None) -> list[str]:
    """The orders section of ``results.md``."""
    if not orders:
        return []
    lines = ["", "## Orders: what a user waits for, in the order they type it (UNet fp16)", ""]
    if orders.get("error"):
        return lines + [f"Not measured: {orders['error']}"]
    rows = orders.get("rows") or {}
    lines += [f"Fresh processes, medians (min–max) of {orders.get('repeat')} rounds, each row in "
              f"the same round as its plain load; the weight file as a save leaves it before the "
              f"plain and the first loads. *waited*: the load call + the first read of every "
              f"weight page (*touch*); for the notebook and script orders also `import "
              f"overmind_lab` + `patch_all()` (*import + patch*; the other rows' processes are "
              f"in notebook order, their import + patch shown apart, not counted). torch and "
              f"diffusers imports are never counted. *ratio*: waited / plain waited; *load call "
              f"ratio*: the call alone over plain's.", "",
              "| row | waited | import + patch | load call | touch | ratio | load call ratio | "
              "limit | |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    titles = dict(ROWS)
    for name in ("plain", "notebook", "script", "first", "login", "killed", "after_first"):
        row = rows.get(name) or {}
        if not row.get("n") and name in orders.get("skipped", []):
            lines.append(f"| {titles[name]} | not measured (`--socket`) | | | | | | | |")
            continue
        # the killed row's limit is over a warm hit (below the table)
        limited = "limit" in row and name != "killed"
        limit = f"≤ {row['limit']:g}" if limited else ""
        failed = f" ⚠ {row['failed']} failed" if row.get("failed") else ""
        lines.append(f"| {titles[name]}{failed} | {_cell(row.get('total'))} | "
                     f"{_cell(row.get('import_patch'))} | "
                     f"{_cell(row.get('load'))} | {_cell(row.get('touch'))} | "
                     f"{_x(row.get('ratio'))} | {_x(row.get('load_ratio'))} | "
                     f"{limit} | "
                     f"{_mark(row) if limited else ''} |")
    fc, killed = rows.get("first_call") or {}, rows.get("killed") or {}
    first, login = rows.get("first") or {}, rows.get("login") or {}
    disk = rows.get("disk") or {}
    last = disk.get("last") or {}
    lines += [
        "",
        f"- {titles['first_call']}: {_cell(fc.get('first'))} / {_cell(fc.get('repeated'))} = "
        f"**{_x(fc.get('ratio'))}** (limit ≤ {LIMITS['first_call']:g}: {_mark(fc)}); with the "
        f"import of overmind_lab and `patch_all` in the first: {_x(fc.get('with_import_ratio'))}",
        f"- {titles['killed']}: over a warm hit's load + touch (the notebook row's) "
        f"**{_x(killed.get('over_warm'))}** "
        f"(limit ≤ {LIMITS['killed']:g}: {_mark(killed)}), over plain {_x(killed.get('ratio'))}; "
        f"the daemon's start in it {_cell(killed.get('daemon_start'))}",
        f"- {titles['first']}: stored (from the call to the entry stored) / plain load call "
        f"{_x(first.get('stored_ratio'))} ({_cell(first.get('stored'))}); the loader alone, as "
        f"the load event records it, {_cell(first.get('loader'))}",
        f"- {titles['login']}: a daemon already serving as the load started (started ahead by "
        f"`patch_all`, while torch and diffusers imported) in {login.get('daemon_running_at_go', 0)} "
        f"of {login.get('n', 0)}; the daemon's start in the load (its event's `daemon_seconds`) "
        f"{_cell(login.get('daemon_start'))}; ratio without it "
        f"{_x(login.get('ratio_without_daemon_start'))}; stored / plain load call "
        f"{_x(login.get('stored_ratio'))}",
        f"- {titles['disk']}: **{_x(disk.get('ratio'))}** (limit ≤ {LIMITS['disk']:g}: "
        f"{_mark(disk)}): the cache directory {_mb(last.get('cache_bytes'))} in "
        f"{last.get('cache_files', '-')} files beside the model's {_mb(last.get('model_bytes'))}; "
        f"the daemon holds {_mb(last.get('held_bytes'))} of the user's files "
        f"(`held_files` {last.get('held_files', '-')}), caches {_mb(last.get('cached_bytes'))} "
        f"(tier {last.get('tier', '-')})",
    ]
    after = [r.get("daemon_before") or {} for r in (orders.get("runs") or {}).get("after_first", [])]
    if after:
        busy = sum(1 for b in after if b.get("copying") or b.get("refolding")
                   or b.get("refold_passes"))
        lines.append(f"- {titles['after_first']}: the daemon was copying or refolding when "
                     f"{busy} of {len(after)} of them started")
    for message in orders.get("errors", []):
        lines.append(f"- error: {message}")
    lines += ["", "Where the load call's time went, medians (seen from outside the library: "
                  "`getrusage`, `/proc`; CPU times in 10 ms ticks for the daemon and the rest of "
                  "the machine): the loading thread's CPU, the process's (its threads), the "
                  "daemon's meanwhile (the daemon process alive after the call: one the load "
                  "started included), the rest of the machine's (a forked store, the `serve "
                  "--detach` launcher a load ran, which exited, other processes), page faults and context switches "
                  "(involuntary: another task had the CPU).", "",
              "| row | load call | thread CPU | process CPU | daemon CPU | others' CPU | "
              "minor / major faults | voluntary / involuntary switches |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("plain", "notebook", "script", "first", "login", "killed", "after_first"):
        row = rows.get(name) or {}
        u = row.get("load_usage") or {}
        if not u:
            continue
        lines.append(f"| {name} | {fmt((row.get('load') or {}).get('median'))} | "
                     f"{fmt(u['thread_cpu_seconds'])} | {fmt(u['process_cpu_seconds'])} | "
                     f"{fmt(u['daemon_cpu_seconds'])} | {fmt(u['others_cpu_seconds'])} | "
                     f"{u['minor_faults']:.0f} / {u['major_faults']:.0f} | "
                     f"{u['voluntary_switches']:.0f} / {u['involuntary_switches']:.0f} |")
    return lines


def _mb(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


if __name__ == "__main__":
    _child_main(sys.argv[1:])
