"""The zygote: a process that imported the heavy libraries once and forks kernels.

It serves only its uid (``SO_PEERCRED``) and answers ``fork``, ``status`` and ``replace`` in one
single-threaded ``poll`` loop; never tensor work, thread pools, CUDA or zmq (:func:`fork_refusal`).

Note [Owners]: a zygote lives while an *owner* (a server or launcher that asked it for kernels,
watched by pidfd) or one of its kernels lives, then for the idle time (Note [Idle zygote]).
More in docs/notes.md.

Note [Replacing a zygote]: a new zygote imports under a temporary name, then renames its socket
over the public one, so the old one serves until then and exits once its children are reaped; a
boot lock allows one import per identity.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from overmind_lab._common import inherit
from overmind_lab._common.messages import (
    ZYGOTE_OPS,
    ForkReply,
    ForkRequest,
    OkReply,
    ReplaceReply,
    ZygoteRefusal,
    ZygoteRequest,
    ZygoteStatus,
)
from overmind_lab._common.protocol import Channel, bind_private, peer_credentials
from overmind_lab._common.zygote_client import (
    is_ipykernel,
    read_pipe,
    spawn,
    timeline,
    user_env,
)
from overmind_lab._common.zygote_paths import (
    ZygotePaths,
    environment,
    identity,
    zygote_idle_seconds,
    zygote_package_check_seconds,
)
from overmind_lab._forked import become
from overmind_lab._forked import script as script_child
from overmind_lab._forked.become import INTENDED_DIFFERENCES, ForkTask
from overmind_lab._forked.claim import claim_seconds
from overmind_lab._zygote import preload, restart

__all__ = ["serve", "fork_refusal", "main"]

log = logging.getLogger("overmind_lab.zygote")

_REPLY_TIMEOUT = 10.0
#: How long a forked child may take to report that it took on the server's attributes.
_READY_TIMEOUT = 10.0
#: How long a fork may wait for the BLAS probe of a CPU affinity not seen before.
_AFFINITY_PROBE_TIMEOUT = 8.0
_TICK_MS = 500
#: A replacement that did not take over (it failed, or lost the boot lock) is asked again.
_RENEW_AGAIN_S = 30.0
#: Note [A renewal waits for a pause]: seconds without a fork before a renewal is considered.
RENEW_AFTER_IDLE_S = 10.0
_PROBE = (
    "import json, threadpoolctl\n"
    "for m in ('numpy', 'scipy.linalg'):\n"
    "    try: __import__(m)\n"
    "    except Exception: pass\n"
    "print(json.dumps({i['filepath']: i['num_threads'] "
    "for i in threadpoolctl.threadpool_info()}))\n"
)


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket
    #: ``overmind-lab run``'s: killed when its requester's connection closes (Note [A script
    #: dies with its run])
    script: bool = False
    #: a launcher's kernel's launch, for its restart's standby (Note [A standby for the
    #: launcher's restart] in ``_forked/claim.py``)
    launch: ForkRequest | None = None


@dataclass
class _State:
    paths: ZygotePaths
    listener: socket.socket
    inode: int
    snap: preload.Snapshot
    preloaded: list[str]
    failed: list[str]
    refusal: str | None
    thread_targets: dict[str, int]
    import_env: dict[str, str]
    cpus: tuple[int, ...] = ()  # the affinity thread_targets were probed with
    start_env: dict[str, str] = field(default_factory=dict)  # Note [Environment set ...]
    targets_by_cpus: dict[tuple[int, ...], dict[str, int]] = field(default_factory=dict)
    owners: dict[int, int] = field(default_factory=dict)      # pid -> pidfd
    children: dict[int, _Child] = field(default_factory=dict)  # pidfd -> child
    #: Note [A script dies with its run]: requester connection fd -> script child
    requesters: dict[int, _Child] = field(default_factory=dict)
    conns: dict[int, socket.socket] = field(default_factory=dict)
    forks: int = 0
    last_fork_ms: float | None = None
    retiring: str | None = None
    #: ``time.monotonic()`` when the last staleness check that found nothing began
    checked_at: float | None = None
    renew_requested: float = 0.0
    #: ``time.monotonic()`` of the last fork whose pause was not yet checked for a renewal
    forked_at: float | None = None
    started: float = field(default_factory=time.time)
    #: Note [A zygote whose package is gone]: the files checked, and when they last were
    own_files: list[str] = field(default_factory=list)
    own_checked: float = field(default_factory=time.monotonic)
    #: Note [Stopping a zygote]: SIGTERM came
    stopping: bool = False
    #: Note [A standby for the launcher's restart]: pidfd -> a standby waiting for its claim
    standbys: dict[int, restart.RestartStandby] = field(default_factory=dict)
    standbys_claimed: int = 0


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _stop_library_threads() -> None:
    """Stop threads that a preloaded module started and would restart on its own.

    Note [Library state across the fork]: besides BLAS pools (Note [BLAS threads]): tqdm's
    monitor thread (stopped here, or no fork is allowed) and its write lock (dropped in the
    child); tokenizers' pool (the zygote never encodes). More in docs/notes.md."""
    from overmind_lab._forked.become import tqdm_classes

    for cls in tqdm_classes():
        monitor = vars(cls).get("monitor")
        if monitor is not None:
            monitor.exit()
            cls.monitor = None  # type: ignore[attr-defined]


def fork_refusal() -> str | None:
    """Why forking now would give a kernel unlike a fresh one, or ``None``."""
    n = _threads()
    if n != 1:
        names = sorted(t for t in os.listdir("/proc/self/task"))
        return f"the zygote has {n} threads (tasks {', '.join(names)}), forking needs 1"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized in the zygote"
    zmq = sys.modules.get("zmq")
    if zmq is not None and getattr(zmq.Context, "_instance", None) is not None:
        return "a zmq context exists in the zygote"
    return None


def _probe_threads(env: dict[str, str], cpus: tuple[int, ...] = ()) -> subprocess.Popen[str]:
    """A fresh interpreter reports the BLAS thread counts a fresh kernel would have (on ``cpus`` if
    given: the pools size to the CPUs a process may run on)."""
    # the zygote has one thread, so a function between fork and exec is safe here
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen([sys.executable, "-P", "-c", _PROBE], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/",
                            preexec_fn=pin)


def _targets_for(state: _State, wanted: dict[str, Any]) -> dict[str, int]:
    """Note [BLAS threads]: the counts a fresh kernel with the server's CPU affinity gets (probed
    once per affinity; the boot's probe ran on the zygote's own)."""
    import json

    cpus = tuple(wanted.get("affinity") or ())
    if not cpus or cpus == state.cpus:
        return state.thread_targets
    if cpus not in state.targets_by_cpus:
        probe = _probe_threads(user_env(dict(os.environ)), cpus)
        try:  # well within the provisioner's wait for the fork (_FORK_TIMEOUT, 20 s)
            out, _ = probe.communicate(timeout=_AFFINITY_PROBE_TIMEOUT)
            found = {str(k): int(v) for k, v in json.loads(out or "{}").items()}
        except (subprocess.TimeoutExpired, ValueError):
            probe.kill()
            probe.wait()
            found = {}
        state.targets_by_cpus[cpus] = found
    return state.targets_by_cpus[cpus]


def _entry_classes() -> list[str]:
    """The classes of the entries now in the cache (the daemon is not started)."""
    from overmind_lab import Client
    from overmind_lab._errors import OvermindError

    try:
        entries = Client().entries()
    except (OvermindError, OSError):
        return []
    return [str(e.get("class") or "") for e in entries if e.get("class")]


def _entry_modules() -> list[str]:
    """Import the modules of the cached entries' classes (third-party ones only)."""
    out: list[str] = []
    for cls in _entry_classes():
        for cand in preload.class_module_candidates(cls):
            if cand in out:
                break
            if preload.import_third_party(cand) is None:
                out.append(cand)
                break
    return out


def wanted_modules(paths: ZygotePaths) -> list[str]:
    base = os.environ.get(preload.PRELOAD_ENV)
    first = base.split(",") if base else preload.DEFAULT_PRELOAD
    return [*first, *preload.read_learned(paths.learned)]


#: The packages ``python -m ipykernel_launcher`` imports while it starts
#: (Note [Environment set at import]).
KERNEL_START_PACKAGES = frozenset({
    "ipykernel", "ipykernel_launcher", "IPython", "debugpy", "jupyter_client", "jupyter_core",
    "zmq", "tornado", "traitlets", "comm"})


def _do_preload(paths: ZygotePaths, start_env: dict[str, str] | None = None
                ) -> tuple[list[str], list[str]]:
    """Import the preload set; variables the kernel's own packages set on import go into
    ``start_env``."""
    failed: list[str] = []
    for name in wanted_modules(paths):
        if name == "overmind_lab":
            preload.preload_overmind()
            continue
        before = dict(os.environ)
        why = preload.import_third_party(name)
        if start_env is not None and name.partition(".")[0] in KERNEL_START_PACKAGES:
            start_env.update({k: v for k, v in os.environ.items() if k not in before})
        if why:
            failed.append(why)
        elif name not in sys.modules:  # replaced itself, or a lazy alias
            failed.append(f"{name}: not in sys.modules after its import")
    _entry_modules()
    return preload.third_party_modules(), failed


def _bind(paths: ZygotePaths) -> tuple[socket.socket, Path]:
    tmp = paths.socket.with_name(f"{paths.socket.name}.{os.getpid()}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    bind_private(sock, str(tmp), 64)
    return sock, tmp


def boot(paths: ZygotePaths, owners: list[int],
         installed: preload.Snapshot | None = None) -> _State | None:
    """Import the preload set and take over the socket; ``None`` if another is booting.
    ``installed``: the installation's state before the imports (Note [Installs the zygote sees]
    in ``preload.py``; taken now if not given)."""
    if installed is None:
        installed = preload.install_snapshot()
    lock = os.open(paths.boot_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        log.info("another zygote is booting for %s; exiting", paths.socket)
        return None
    try:
        t0 = time.monotonic()
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        probe = _probe_threads(user_env(dict(os.environ)))
        listener, tmp = _bind(paths)
        before = dict(os.environ)
        start_env: dict[str, str] = {}
        with preload.quiet_imports():  # Note [A quiet zygote log]
            preloaded, failed = _do_preload(paths, start_env)
        # Note [Environment set at import]: variables a module set when imported; the child sets
        # those of KERNEL_START_PACKAGES again, ``status`` lists the rest. More in docs/notes.md.
        import_env = {k: v for k, v in os.environ.items() if k not in before and k not in start_env}
        _stop_library_threads()
        out, _ = probe.communicate(timeout=120)
        import json

        targets = {str(k): int(v) for k, v in json.loads(out or "{}").items()}
        become.prepare_in_zygote()
        snap = preload.snapshot(installed)
        # Note [Frozen heap]: a kernel's collection would write the GC header of every object the
        # zygote imported, copying its page; frozen, those pages stay shared.
        gc.collect()
        gc.freeze()
        refusal = fork_refusal()
        os.rename(tmp, paths.socket)  # Note [Replacing a zygote]
        state = _State(paths, listener, os.stat(paths.socket).st_ino, snap, preloaded,
                       failed, refusal, targets, import_env, cpus, start_env,
                       own_files=preload.own_files(snap))
        for pid in owners:
            _add_owner(state, pid)
        log.info("zygote %d ready in %.1f s: %d modules, %d files watched%s", os.getpid(),
                 time.monotonic() - t0, len(preloaded), len(snap),
                 f"; refuses to fork: {refusal}" if refusal else "")
        for why in failed:
            log.info("not preloaded: %s", why)
        return state
    finally:
        os.close(lock)


def _add_owner(state: _State, pid: int) -> None:
    if pid in state.owners or pid <= 1:
        return
    try:
        state.owners[pid] = os.pidfd_open(pid)
    except OSError:
        pass


def _status(state: _State) -> ZygoteStatus:
    return {
        "ok": True, "pid": os.getpid(), "identity": state.paths.ident,
        "socket": str(state.paths.socket), "python": sys.executable,
        "preloaded": len(state.preloaded), "preload_roots": sorted(
            {m.partition(".")[0] for m in state.preloaded}),
        "failed": state.failed, "refusal": state.refusal, "forks": state.forks,
        "last_fork_ms": state.last_fork_ms, "kernels": len(state.children),
        "standbys": len(state.standbys), "standbys_claimed": state.standbys_claimed,
        "owners": sorted(state.owners), "uptime_seconds": time.time() - state.started,
        "retiring": state.retiring, "import_env": sorted(state.import_env),
        "differences": [*INTENDED_DIFFERENCES, *(
            [f"environment variables a preloaded module set at its import, which a "
             f"fresh kernel gets when it imports that module, are not set: "
             f"{', '.join(sorted(state.import_env))}"] if state.import_env else [])],
    }


def _check_stale(state: _State) -> str | None:
    """Why the zygote is stale (and now retiring), or ``None`` (``checked_at`` set).

    Note [Checked while the old kernel exits]: a ``stat`` of every preloaded file (3,900 with
    torch, diffusers and transformers: 6-12 ms) ran between a restart's fork request and its
    fork. On a restart the provisioner asks for this check (``check``) as soon as the old
    kernel is asked to shut down, and the fork request carries when that was
    (``checked_since``): a check that began then or later stands for the fork's. A warm
    kernel still sees every edit made before the restart was requested; an edit during the
    old kernel's shutdown (~40 ms) is seen by the next launch. More in docs/notes.md."""
    began = time.monotonic()
    stale = preload.stale_reason(state.snap, lambda: _reap_exited(state))
    if stale:
        state.retiring = f"stale: {stale}"  # a later fork request is told which file
        log.info("stale: %s", stale)
        return f"the zygote is stale: {stale}"
    state.checked_at = began
    return None


def _reap_exited(state: _State) -> None:
    """Reap the kernels that exited, now. Note [A standby for the restart]: a restart's check
    (10-40 ms) runs as the old kernel exits; the launch waits for its exit report."""
    if not state.children:
        return
    poller = select.poll()
    for fd in state.children:
        poller.register(fd, select.POLLIN)
    for fd, _ in poller.poll(0):
        _reap(state, fd)


def _retiring(state: _State) -> str | None:
    return f"the zygote is retiring ({state.retiring})" if state.retiring else None


def _refuse(state: _State, request: ForkRequest, env: dict[str, str],
            check_files: bool = True) -> str | None:
    retiring = _retiring(state)
    if retiring:
        return retiring
    if state.refusal:
        return state.refusal
    argv = [str(a) for a in request.get("argv", [])]
    script = bool(request.get("script")) and len(argv) >= 2 and not argv[1].startswith("-")
    if (len(argv) < 3 or argv[1] != "-m") and not script:
        return f"the kernel command is not `python -m MODULE ...`: {argv}"
    if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return f"the kernel's interpreter {argv[0]} is not the zygote's {sys.executable}"
    # Note [Environments share an interpreter]: a zygote started by a process of another venv
    # of the same interpreter has that venv's packages
    if environment(argv[0]) != environment(sys.executable):
        return (f"the kernel's Python environment {environment(argv[0])} is not the zygote's "
                f"{environment(sys.executable)}")
    if identity(argv[0], env) != state.paths.ident:
        return "the kernel's import-relevant environment differs from the zygote's"
    since = request.get("checked_since")
    if check_files and not (isinstance(since, (int, float)) and state.checked_at is not None
            and state.checked_at >= since):  # Note [Checked while the old kernel exits]
        stale = _check_stale(state)
        if stale:
            return stale
    wanted = request.get("inherit")
    if isinstance(wanted, dict) and wanted:
        try:
            why = inherit.refusal(wanted)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            why = f"the request's process attributes are malformed ({exc!r})"
        if why:
            return why
    return fork_refusal()


def _await_ready(state: _State, fd: int) -> str | None:
    """What the child wrote on its ready pipe: ``None`` for "ok", else why it exited. Kernels
    that exit meanwhile are reaped at once: a restart's old kernel exits while its standby
    starts, and its launcher exits only once the exit report came (jupyter_client polls for
    that every 100 ms; a report after 1 s is lost)."""
    deadline = time.monotonic() + _READY_TIMEOUT
    while (left := deadline - time.monotonic()) > 0:
        poller = select.poll()
        for waited in (fd, *state.children):
            poller.register(waited, select.POLLIN)
        if fd in [f for f, _ in poller.poll(left * 1000)]:
            break
        _reap_exited(state)
    data = read_pipe(fd, max(deadline - time.monotonic(), 1.0))
    if data is None:
        return f"the forked kernel did not start within {_READY_TIMEOUT:.0f} s"
    if data == b"ok":
        return None
    return data.decode(errors="replace") or "the forked kernel exited before it started"


def _standby_wait(request: ForkRequest) -> float:
    """A standby's longest wait for ``go``: the request's (Note [A standby kept ready]),
    within bounds, or ``become.STANDBY_SECONDS``."""
    wait = request.get("standby_wait")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait == wait:
        return min(max(float(wait), 1.0), become.MAX_STANDBY_SECONDS)
    return become.STANDBY_SECONDS


def _refused(chan: Channel, reason: str) -> None:
    refusal: ZygoteRefusal = {"ok": False, "reason": reason}
    chan.send(refusal)


def _handle_fork(state: _State, conn: socket.socket, chan: Channel,
                 request: ForkRequest, fds: list[int], peer: int) -> None:
    """Fork a kernel for ``request``: in the parent, returns once the child started (or could not);
    the child never returns (Note [Leaving the zygote's loop] in ``_forked/become.py``)."""
    env = {str(k): str(v) for k, v in dict(request.get("env", {})).items()}
    standby = bool(request.get("standby"))
    script = bool(request.get("script"))
    timeline("zygote.fork_request", env, standby=standby)
    # Note [A standby for the launcher's restart] in ``_forked/claim.py``
    launcher = (bool(request.get("launcher")) and not standby and not script
                and is_ipykernel([str(a) for a in request.get("argv", [])]))
    if launcher and len(fds) == 3:
        taken = _claim_standby(state, request, env, fds, peer)
        if taken is not None:
            _adopt(state, conn, chan, taken.pid, peer, env, request, pidfd=taken.pidfd)
            log.info("kernel %d for %d: a restart standby, claimed", taken.pid, peer)
            return
    # Note [A standby for the restart]: a standby's files are checked right after its fork
    why = _refuse(state, request, env, check_files=not standby)
    if not standby:
        timeline("zygote.checked", env, files=len(state.snap),
                 checked_since=request.get("checked_since"), checked_at=state.checked_at)
    if not why and standby and (script or not is_ipykernel(request["argv"])):
        why = "a standby kernel needs ipykernel's command (python -m ipykernel_launcher ...)"
    if why or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        _refused(chan, why or "fork needs stdin, stdout and stderr")
        return
    parent_pidfd = None
    if request.get("watch_parent"):
        try:
            parent_pidfd = os.pidfd_open(peer)
        except OSError:
            parent_pidfd = None
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    # Note [A standby for the restart]: the child waits on go_r; the requester gets go_w.
    go_r, go_w = os.pipe2(os.O_CLOEXEC) if standby else (None, None)
    task = _task(state, request, env, fds, ready_w, parent_pidfd=parent_pidfd, go_fd=go_r,
                 go_wait=_standby_wait(request), launcher=launcher)
    # go_w: or the child would never see its requester go away
    pid = _fork(state, task, close=[ready_r, *([go_w] if go_w is not None else [])],
                keep=[*fds, *([parent_pidfd] if parent_pidfd else [])])
    os.close(ready_w)
    for fd in fds:
        os.close(fd)
    if parent_pidfd is not None:
        os.close(parent_pidfd)
    if go_r is not None:
        os.close(go_r)
        not_ready = _standby_ready(state, pid, ready_r, env)
    else:
        not_ready = _await_ready(state, ready_r)
    if not_ready and go_w is not None:
        os.close(go_w)
    if not_ready:
        _reap_unready(pid)
        log.info("forked child %d for %d could not start: %s", pid, peer, not_ready)
        _refused(chan, not_ready)
        return
    state.forks += 1
    _adopt(state, conn, chan, pid, peer, env, request, go_w=go_w,
           fork_ms=state.last_fork_ms or 0.0)
    log.info("forked kernel %d for %d in %.1f ms", pid, peer, state.last_fork_ms)


def _adopt(state: _State, conn: socket.socket, chan: Channel, pid: int, peer: int,
           env: dict[str, str], request: ForkRequest, pidfd: int | None = None,
           go_w: int | None = None, fork_ms: float = 0.0) -> None:
    """The child ``pid`` is now the kernel (or script) of the requester ``peer``: the reply carries
    its pidfd (and a standby's ``go_w``), its exit is reported on ``conn``."""
    script = bool(request.get("script"))
    if pidfd is None:
        pidfd = os.pidfd_open(pid)
    _add_owner(state, peer)
    child = _Child(pid, pidfd, conn, script, request if request.get("launcher") else None)
    state.children[pidfd] = child
    if script:
        state.requesters[conn.fileno()] = child
    state.conns.pop(conn.fileno(), None)
    reply: ForkReply = {"ok": True, "pid": pid, "fork_ms": fork_ms}
    try:
        chan.send(reply, [pidfd] if go_w is None else [pidfd, go_w])
    except OSError:
        pass  # the provisioner went away; the kernel's own parent watch decides (a standby's
        # go descriptor closes below: it exits)
    finally:
        if go_w is not None:
            os.close(go_w)
    timeline("zygote.fork_reply", env, kernel=pid)
    state.forked_at = time.monotonic()  # Note [A renewal waits for a pause]


def _claim_standby(state: _State, request: ForkRequest, env: dict[str, str], fds: list[int],
                   peer: int) -> restart.RestartStandby | None:
    """Note [A standby for the launcher's restart]: the standby forked for a launch equal to
    ``request``, now holding copies of its stdio ``fds`` (then closed here) and its launcher's
    parent watch; ``None`` (``fds`` left open, any other standby of that launch let go) when
    there is none or it could not take the launch over."""
    argv = [str(a) for a in request.get("argv", [])]
    standby = next((s for s in state.standbys.values() if s.launch.get("argv") == argv), None)
    if standby is None:
        return None
    del state.standbys[standby.pidfd]
    # its files were checked at its fork, as the provisioner's standby's (Note [A standby for
    # the restart])
    why = restart.differs(standby.launch, request) or _refuse(state, request, env,
                                                              check_files=False)
    if why is None:
        parent_pidfd = None
        if request.get("watch_parent"):
            with contextlib.suppress(OSError):
                parent_pidfd = os.pidfd_open(peer)
        try:
            why = restart.claim(standby, request, fds, parent_pidfd)
        finally:
            if parent_pidfd is not None:
                os.close(parent_pidfd)
    timeline("zygote.claim", env, kernel=standby.pid, refused=why)
    if why is not None:
        log.info("restart standby %d not taken: %s", standby.pid, why)
        restart.drop(standby)
        return None
    standby.sock.close()
    for fd in fds:
        os.close(fd)
    state.standbys_claimed += 1
    return standby


def _fork_restart_standby(state: _State, chan: Channel, peer: int) -> None:
    """Note [A standby for the launcher's restart]: the launcher's kernel ``peer`` was told to
    restart; acknowledge at once, then fork a standby for its launch."""
    launch = next((c.launch for c in state.children.values() if c.pid == peer and c.launch),
                  None)
    why = _retiring(state) or state.refusal
    if why or launch is None:
        _refused(chan, why or "the requester is no launcher's kernel of this zygote")
        return
    ok: OkReply = {"ok": True}
    chan.send(ok)
    for old in [s for s in state.standbys.values() if s.launch.get("argv") == launch["argv"]]:
        del state.standbys[old.pidfd]
        restart.drop(old)
    why = fork_refusal()
    env = {str(k): str(v) for k, v in dict(launch.get("env", {})).items()}
    timeline("zygote.restart_standby", env, kernel=peer, refused=why)
    if why:
        log.info("no restart standby for kernel %d: %s", peer, why)
        return
    # placeholders until the claim: what it prints meanwhile is kept for the launcher's stdio
    stdio = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC),
             os.memfd_create("overmind-lab-standby-stdout", os.MFD_CLOEXEC),
             os.memfd_create("overmind-lab-standby-stderr", os.MFD_CLOEXEC)]
    ours, theirs_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs = theirs_sock.detach()  # the child's socket object owns it
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    wait = claim_seconds()
    task = _task(state, launch, env, stdio, ready_w, parent_pidfd=None, go_wait=wait,
                 launcher=True, claim_fd=theirs)
    pid = _fork(state, task, close=[ready_r, ours.fileno()], keep=[*stdio, theirs])
    for fd in (ready_w, *stdio, theirs):
        os.close(fd)
    not_ready = _standby_ready(state, pid, ready_r, env)
    if not_ready:
        _reap_unready(pid)
        ours.close()
        log.info("restart standby %d for kernel %d could not start: %s", pid, peer, not_ready)
        return
    pidfd = os.pidfd_open(pid)
    # it exits by itself after its wait; let go of it a little later in any case
    state.standbys[pidfd] = restart.RestartStandby(pid, pidfd, launch, ours,
                                                   time.monotonic() + wait + 5.0)
    log.info("restart standby %d forked for kernel %d", pid, peer)


def _standby_ready(state: _State, pid: int, ready_r: int, env: dict[str, str]) -> str | None:
    """A standby just forked: why it cannot start (then reap it), or ``None``. Note [A standby
    for the restart]: the zygote's files are checked while the child starts; a stale zygote's
    standby is killed before anything of the user's ran in it (it waits for its go first)."""
    stale = _check_stale(state)
    timeline("zygote.checked", env, files=len(state.snap), checked_since=None,
             checked_at=state.checked_at)
    if stale:
        os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
        os.close(ready_r)
        return stale
    return _await_ready(state, ready_r)


def _task(state: _State, request: ForkRequest, env: dict[str, str], stdio: list[int],
          ready_fd: int, parent_pidfd: int | None, go_wait: float, launcher: bool,
          go_fd: int | None = None, claim_fd: int | None = None) -> ForkTask:
    """What the child of ``request`` needs (``_forked/become.py``); ``launcher``: it asks this
    zygote for a standby on a restart (Note [A standby for the launcher's restart])."""
    wanted = request.get("inherit")
    task_inherit = dict(wanted) if isinstance(wanted, dict) else {}
    script = bool(request.get("script"))
    return ForkTask(
        argv=[str(a) for a in request["argv"]], env=env,
        cwd=str(request.get("cwd") or os.getcwd()), stdio=stdio, parent_pidfd=parent_pidfd,
        thread_targets=_targets_for(state, task_inherit), learned_path=state.paths.learned,
        preloaded=frozenset(state.preloaded), inherit=task_inherit, ready_fd=ready_fd,
        go_fd=go_fd, go_wait=go_wait,
        # Note [Environment set at import]: a script that imports no kernel package gets none
        start_env={} if script else state.start_env, script=script,
        zygote_socket=str(state.paths.socket) if launcher else None, claim_fd=claim_fd)


def _fork(state: _State, task: ForkTask, close: list[int], keep: list[int]) -> int:
    """Fork the child for ``task``; its pid. The child closes ``close`` and every descriptor of
    the zygote's but ``keep``, and never returns (Note [Leaving the zygote's loop])."""
    # Note [Interrupted at birth] in ``_forked/become.py``: the child unblocks SIGINT; and
    # SIGTERM, once its disposition is the default again (Note [Stopping a zygote]).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        for fd in close:
            os.close(fd)
        _close_for_child(state, keep=keep)
        # the routes out of the zygote: they never return
        (script_child.run_and_exit if task.script else become.run_and_exit)(task)
    state.last_fork_ms = (time.perf_counter() - t0) * 1000
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    timeline("zygote.forked", task.env, kernel=pid, fork_ms=state.last_fork_ms)
    return pid


def _reap_unready(pid: int) -> None:
    """A child that reported it cannot start exits at once; one that hangs is killed."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if not done:
            pidfd = os.pidfd_open(pid)
            try:
                if not select.select([pidfd], [], [], _READY_TIMEOUT)[0]:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
            os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _missing(state: _State) -> list[str]:
    """Wanted modules this zygote lacks: learned ones, and cached entries' classes."""
    failed = {f.partition(":")[0] for f in state.failed}
    missing = [m for m in preload.read_learned(state.paths.learned)
               if m not in sys.modules and m not in failed]
    for cls in _entry_classes():
        cands = preload.class_module_candidates(cls)
        if cands and not any(c in sys.modules for c in cands) and cands[-1] not in failed:
            missing.append(cands[0])
    return missing


def _booting(paths: ZygotePaths) -> bool:
    """Whether a zygote holds the boot lock (is importing) for these paths now."""
    fd = os.open(paths.boot_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# Note [A renewal waits for a pause]: a grown preload set (modules a kernel's exit recorded,
# cached entries' classes) is imported by a new zygote in the background: ~5 s of CPU, which
# on 2 cores slowed whatever ran beside it. Started at the fork after a kernel's exit recorded
# new modules, it ran in a restart loop's next restarts and cells: in a fresh environment
# (quiet, restarts 2 s apart), restart to the SD 1.5 cell done took 0.44-0.64 s during it, the
# cell alone 0.18-0.28 s. So it is considered once no fork came for ``RENEW_AFTER_IDLE_S``:
# while the user reads and edits, not while they restart and rerun. Until then kernels import
# what the zygote lacks, as before: the same restarts took 0.23-0.33 s (cells 0.11-0.14 s).
# Checked on the loop's tick, once per pause.
def _maybe_renew(state: _State) -> None:
    """Note [Replacing a zygote]: a grown preload set is imported by a new zygote in the background
    (Note [A renewal waits for a pause])."""
    if state.retiring or time.monotonic() - state.renew_requested < _RENEW_AGAIN_S:
        return
    missing = _missing(state)
    if missing and not _booting(state.paths):
        state.renew_requested = time.monotonic()
        log.info("starting a zygote that also preloads %d more modules (%s...)",
                 len(missing), ", ".join(missing[:5]))
        spawn(state.paths, owners=list(state.owners), env=user_env(dict(os.environ)))


def _close_for_child(state: _State, keep: list[int]) -> None:
    """In the child: close every descriptor the zygote owns (not the libraries' own)."""
    state.listener.close()
    for sock in state.conns.values():
        sock.close()
    for child in state.children.values():
        os.close(child.pidfd)
        child.conn.close()
    for standby in state.standbys.values():
        os.close(standby.pidfd)
        standby.sock.close()
    for fd in state.owners.values():
        if fd not in keep:
            os.close(fd)


# Note [A script dies with its run]: ``overmind-lab run`` stands in for its script as the
# launcher does for a kernel, and a script must not outlive it (``kill -9`` of the run, a closed
# terminal that killed it): the script has no thread to watch it (a fresh one has none), so the
# zygote does. The run never writes on its connection after the fork's reply: the connection
# becomes readable when the run is gone (end of file), and the zygote SIGKILLs the script, by
# pidfd (only the script: a plain script killed leaves its own children too).
def _requester_gone(state: _State, fd: int) -> None:
    child = state.requesters.pop(fd)
    try:
        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it exited meanwhile; its pidfd reports it
    log.info("the run of script %d went away; killed it", child.pid)


def _reap(state: _State, pidfd: int) -> None:
    child = state.children.pop(pidfd)
    if child.script:
        state.requesters.pop(child.conn.fileno(), None)
    try:
        _, status = os.waitpid(child.pid, 0)
        code = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        code = -1
    os.close(pidfd)
    try:
        Channel(child.conn, 1.0).send({"exit": code})
    except OSError:
        pass
    child.conn.close()
    log.info("kernel %d exited with %d", child.pid, code)


def _accept(state: _State) -> None:
    conn, _ = state.listener.accept()
    _pid, uid, _gid = peer_credentials(conn)
    if uid != os.getuid():
        Channel(conn, 1.0).send({"ok": False, "error": f"the overmind-lab zygote of uid "
                                 f"{os.getuid()} does not serve uid {uid}"})
        conn.close()
        log.warning("refused a connection from uid %d", uid)
        return
    conn.setblocking(True)
    state.conns[conn.fileno()] = conn


def _serve_conn(state: _State, conn: socket.socket) -> None:
    """One request (Note [The zygote's wire] in ``_common/messages.py``)."""
    chan = Channel(conn, _REPLY_TIMEOUT)
    try:
        frame, fds = chan.recv()
    except Exception:  # noqa: BLE001 - a broken client only loses its connection
        state.conns.pop(conn.fileno(), None)
        conn.close()
        return
    peer, _uid, _gid = peer_credentials(conn)
    request = cast(ZygoteRequest, frame)
    op = request.get("op")
    if op == "fork":
        _handle_fork(state, conn, chan, cast(ForkRequest, request), fds, peer)
        return
    for fd in fds:
        os.close(fd)
    if op == "status":
        chan.send(_status(state))
    elif op == "replace":
        spawn(state.paths, owners=[*state.owners, peer], env=user_env(dict(os.environ)))
        state.retiring = "replaced on request"
        replaced: ReplaceReply = {"ok": True, "pid": os.getpid()}
        chan.send(replaced)
    elif op == "owner":
        _add_owner(state, peer)
        ok: OkReply = {"ok": True}
        chan.send(ok)
    elif op == "restart_standby":
        _fork_restart_standby(state, chan, peer)
    elif op == "check":
        why = _retiring(state) or _check_stale(state)
        if why:
            _refused(chan, why)
        else:  # which zygote checked (Note [A standby kept ready])
            chan.send({"ok": True, "pid": os.getpid()})
    else:
        _refused(chan, f"unknown op {op!r} (the zygote's are {', '.join(ZYGOTE_OPS)})")


def _replaced(state: _State) -> bool:
    try:
        return os.stat(state.paths.socket).st_ino != state.inode
    except FileNotFoundError:
        return True


# Note [A zygote whose package is gone]: after ``pip uninstall overmind-lab`` a zygote must not
# serve on: every ``OVERMIND_LAB_ZYGOTE_PACKAGE_CHECK`` seconds (default 10; a few ``stat``s) it
# checks that the files of the overmind-lab it runs still exist (its package's ``__init__.py``
# and ``_zygote`` files; an editable install's source stays, so also its distribution's
# records: ``METADATA``, ``.pth``, editable finder). When one is gone it retires as a stale
# zygote does: it stops serving (its socket goes), and exits once its kernels have exited (at
# once with none); it starts no replacement. An upgrade retires it too (the old ``METADATA``
# goes): the next launch is plain and starts a zygote of the new version. Without owner nor
# kernel the idle time (Note [Idle zygote]) ends it anyway.
def _check_own_package(state: _State) -> None:
    now = time.monotonic()
    if state.retiring or now - state.own_checked < zygote_package_check_seconds():
        return
    state.own_checked = now
    for path in state.own_files:
        if not os.path.exists(path):
            state.retiring = f"its overmind-lab was uninstalled or replaced: {path} was removed"
            log.info("%s; exiting once its %d kernel(s) have exited", state.retiring,
                     len(state.children))
            return


def _loop(state: _State) -> None:
    idle_since: float | None = None
    while True:
        if state.stopping:
            log.info("stopped by SIGTERM; %d kernel(s) of this zygote run on",
                     len(state.children))
            return
        if state.retiring is None and _replaced(state):
            state.retiring = "replaced by a newer zygote"
        _check_own_package(state)
        if state.retiring and not state.children:
            return
        # Note [Idle zygote]: with no owner nor kernel, it stays for the idle time so the next run
        # is forked; a new owner or kernel resets the clock.
        if state.owners or state.children:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        if idle_since is not None and time.monotonic() - idle_since >= zygote_idle_seconds():
            log.info("no owner and no kernel for %.0f s; exiting", time.monotonic() - idle_since)
            return
        poller = select.poll()
        if not state.retiring:
            poller.register(state.listener, select.POLLIN)
        for fd in (*state.conns, *state.children, *state.owners.values(), *state.requesters,
                   *state.standbys):
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(_TICK_MS):
            if fd == state.listener.fileno():
                _accept(state)
            elif fd in state.children:
                _reap(state, fd)
            elif fd in state.standbys:  # it exited unclaimed
                restart.drop(state.standbys.pop(fd))
            elif fd in state.requesters:
                _requester_gone(state, fd)
            elif fd in state.conns:
                _serve_conn(state, state.conns[fd])
            else:
                for pid, pfd in list(state.owners.items()):
                    if pfd == fd:
                        del state.owners[pid]
                        os.close(pfd)
        for standby in [s for s in state.standbys.values() if time.monotonic() > s.until]:
            restart.drop(state.standbys.pop(standby.pidfd))
        if state.retiring and not _replaced(state):
            _unlink_own_socket(state)
        if (state.forked_at is not None
                and time.monotonic() - state.forked_at >= RENEW_AFTER_IDLE_S):
            state.forked_at = None
            _maybe_renew(state)


def _unlink_own_socket(state: _State) -> None:
    try:
        if os.stat(state.paths.socket).st_ino == state.inode:
            state.paths.socket.unlink()
    except FileNotFoundError:
        pass


# Note [Stopping a zygote]: ``overmind-lab stop`` (``kernelspec.stop_zygotes``) sends SIGTERM.
# While it imports, a zygote dies of it (the default). Once it serves, a handler only sets
# ``stopping``; the loop sees it within a tick (PEP 475 resumes the ``poll``), leaves, removes
# its socket if it is still its own (Note [Replacing a zygote]) and exits, its kernels left to
# run on (their exit statuses are lost to their requesters). A fork blocks SIGTERM with SIGINT
# (Note [Interrupted at birth]): the child inherits the handler, which must never run there,
# and unblocks both only after ``become`` reset every disposition to the default; a SIGTERM
# sent to the new kernel meanwhile is delivered then and ends it.
def serve(paths: ZygotePaths, owners: list[int],
          installed: preload.Snapshot | None = None) -> None:
    """Boot and serve until the zygote is done (a forked child never returns here)."""
    state = boot(paths, owners, installed)
    if state is None:
        return

    def stop(_signum: int, _frame: object) -> None:
        state.stopping = True

    signal.signal(signal.SIGTERM, stop)
    _loop(state)
    _unlink_own_socket(state)
    state.listener.close()


def main(argv: list[str] | None = None, installed: preload.Snapshot | None = None) -> int:
    """The zygote; ``installed``: Note [Installs the zygote sees] (``__main__.py`` takes it)."""
    parser = argparse.ArgumentParser(prog="python -m overmind_lab._zygote")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--identity", required=True)
    parser.add_argument("--owner", type=int, action="append", default=[])
    args = parser.parse_args(argv)
    # Note [Third-party only] in ``_zygote/preload.py``: nothing from the directory ``-m`` puts
    # first on sys.path (the child adds its cwd, as ``-m`` does); not ``-P`` (safe_path).
    # safe_path (-P) is 3.11+: on 3.10 sys.path[0] is always the folder -m put there.
    if sys.path and not getattr(sys.flags, "safe_path", False) and sys.path[0] == os.getcwd():
        del sys.path[0]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s zygote %(process)d %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    socket_path = Path(args.socket)
    paths = ZygotePaths(socket_path.parent, args.identity)
    serve(paths, args.owner, installed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
