"""In a forked child of the zygote: become a kernel exactly as a fresh process would.

``run_and_exit`` runs in the child at the fork site: it takes on the server's process attributes
first, then session, stdio, cwd, env, signals, ``sys.path``, TZ, random state, library state and
BLAS threads as a fresh ``python -m MODULE ARGS`` has them, runs the module (``runpy``) and exits.

Note [What a warm kernel does not share with a fresh one]: the differences a fork cannot avoid
are :data:`INTENDED_DIFFERENCES` (and Note [Environment set at import]), listed by ``kernel
status``; ``tests/test_warm_kernel_fresh.py`` compares the rest. More in docs/notes.md.

Note [Interrupted at birth]: a quick second restart interrupts a kernel still starting; the zygote
blocks SIGINT across the fork and an ipykernel child drops it until ipykernel's own ``SIG_IGN``.
More in docs/notes.md.

Note [Parent death]: ipykernel's poller would watch the zygote; a thread waits on the server's
pidfd instead and exits (``os._exit(1)``) within a second of its death. More in docs/notes.md.
"""

from __future__ import annotations

import atexit
import importlib
import linecache
import logging
import os
import random
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from overmind_lab._common import inherit, learned
from overmind_lab._common.exiting import exit_now, run_main
from overmind_lab._common.zygote_client import is_ipykernel, read_pipe, timeline
from overmind_lab._forked import claim, ports

__all__ = ["ForkTask", "run_and_exit", "run", "become", "exit_now", "tqdm_classes",
           "prepare_in_zygote", "path0", "is_main_importer", "INTENDED_DIFFERENCES"]

#: Note [What a warm kernel does not share with a fresh one].
@dataclass
class ForkTask:
    """What a forked child needs to become a kernel, built by the zygote from the request."""
    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdio: list[int]
    parent_pidfd: int | None
    thread_targets: dict[str, int]
    learned_path: Path
    preloaded: frozenset[str]
    #: The server's attributes to take on (Note [Inherited process attributes]).
    inherit: dict[str, Any] = field(default_factory=dict)
    #: Where the child says "ok" or why it cannot take them on; the zygote waits for it.
    ready_fd: int | None = None
    #: Set at start if the kernel's env lacks them (Note [Environment set at import]).
    start_env: dict[str, str] = field(default_factory=dict)
    #: A standby's: ``go`` arrives here (Note [A standby for the restart]); ``None``: go at once.
    go_fd: int | None = None
    #: How long a standby waits for ``go`` (Note [A standby kept ready]).
    go_wait: float = 120.0
    #: ``overmind-lab run``'s child: ``argv`` is ``python SCRIPT ARGS`` or ``python -m MODULE
    #: ARGS``, run by ``_forked/script.py`` as plain Python runs it.
    script: bool = False
    #: A launcher's kernel: the zygote's socket, asked for a standby on a restart (Note [A
    #: standby for the launcher's restart] in ``_forked/claim.py``).
    zygote_socket: str | None = None
    #: That standby's: the claim arrives here, with the launcher's stdio and pidfd.
    claim_fd: int | None = None



INTENDED_DIFFERENCES = (
    "parent pid: the zygote's, not the Jupyter server's (Note [Parent death])",
    "/proc/self/cmdline: the zygote's command line (sys.argv and sys.orig_argv are the "
    "kernel's)",
    "str hash seed: the zygote's, shared by its kernels (fixed when an interpreter starts)",
    "one extra descriptor, a pidfd of the Jupyter server, and a thread "
    "'overmind-lab-parent-watch' in place of ipykernel's parent poller",
    "modules imported by the zygote are already in sys.modules",
    "iopub welcomes every subscriber (XPUB_VERBOSE: an iopub_welcome each time a client "
    "subscribes, not only the first; Note [Every subscriber welcomed])",
    "the kernel's TCP ports listen from the fork on, before ipykernel binds them (Note [Ports "
    "bound at the fork])",
    "its first cell waits until IOPub has a subscriber, for 0.3 s at most (Note [The first cell "
    "waits for a listener])",
    "on a restart it starts while the old kernel shuts down: its config files and command line "
    "are read tens of ms after the restart request, its ports bound once the old kernel "
    "exited (Note [A standby for the restart]); or it was forked a second after the old "
    "kernel's launch and waited, its config files checked unchanged at the restart (Note [A "
    "standby kept ready])",
    "restarted through the launcher (VS Code), it was forked when the old kernel was asked to "
    "shut down and read its command line and config files then; its launcher's stdio, "
    "JPY_PARENT_PID and parent watch were handed to it when that launcher started (Note [A "
    "standby for the launcher's restart])",
    "a preloaded numpy's BLAS thread pool (sized for the kernel: Note [BLAS threads]) runs "
    "from the start; a fresh kernel starts it when it imports numpy",
)

#: Note [A standby for the restart]: how long a standby waits for its ``go`` at most, unless
#: its request says (Note [A standby kept ready]), and the longest a request may say.
STANDBY_SECONDS = 120.0
MAX_STANDBY_SECONDS = 24 * 3600.0


def _starting_sigint(signum: int, frame: object) -> None:
    """SIGINT while the kernel starts: dropped (Note [Interrupted at birth])."""


def _reset_signals(ipykernel: bool = False, ignored: Iterable[int] = ()) -> None:
    """Signal dispositions as a fresh process has them: default, but what the server ignores
    (``inherit._ignored_signals``) ignored, and Python's own SIGINT, SIGPIPE and SIGXFSZ."""
    ignored = set(ignored)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if int(sig) in ignored else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT,
                      _starting_sigint if ipykernel else signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _replace_environ(env: dict[str, str], start_env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    for key, value in start_env.items():  # Note [Environment set at import] (``_zygote/loop.py``)
        os.environ.setdefault(key, value)


def _reseed() -> None:
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.seed()  # not torch.seed(): that also queues a seed for CUDA


def tqdm_classes() -> list[type]:
    """``tqdm.std.tqdm`` and its subclasses (each may hold its own monitor and lock)."""
    tqdm_std = sys.modules.get("tqdm.std")
    if tqdm_std is None:
        return []
    found: list[type] = []
    todo: list[type] = [tqdm_std.tqdm]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found


def _fresh_library_state() -> None:
    """Drop tqdm's inter-process write lock (Note [Library state across the fork])."""
    for cls in tqdm_classes():
        if "_lock" in vars(cls):
            delattr(cls, "_lock")
    lock_cls = getattr(sys.modules.get("tqdm.std"), "TqdmDefaultWriteLock", None)
    if lock_cls is not None and "mp_lock" in vars(lock_cls):
        del lock_cls.mp_lock


#: ``threadpoolctl``'s controllers, found once in the zygote (:func:`prepare_in_zygote`).
_THREADPOOL_LIBS: list[Any] | None = None
#: What the zygote's import caches held; kept alive so the child frees nothing of it
#: (Note [Import caches after the fork]).
_ZYGOTE_CACHES: list[object] = []


def prepare_in_zygote() -> None:
    """In the zygote, once its imports are done: what every child would otherwise find again
    after the fork (Note [BLAS threads]: the thread pools' libraries; ``threadpoolctl`` scans every
    loaded library, 5-10 ms a child)."""
    global _THREADPOOL_LIBS
    if "threadpoolctl" in sys.modules:
        from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]

        _THREADPOOL_LIBS = list(ThreadpoolController().lib_controllers)


def _set_threads(targets: dict[str, int]) -> None:
    if not targets or "threadpoolctl" not in sys.modules:
        return
    libs = _THREADPOOL_LIBS
    if libs is None:
        from threadpoolctl import ThreadpoolController

        libs = ThreadpoolController().lib_controllers
    for lib in libs:
        want = targets.get(lib.filepath)
        if want is not None and lib.num_threads != want:
            lib.set_num_threads(want)


def _fresh_import_caches() -> None:
    """Note [Import caches after the fork]: the finders a fresh process has not made yet.

    A fresh interpreter starts with an empty ``sys.path_importer_cache``. Clearing the zygote's
    would free its finders and their directory listings in the child, a write to thousands of
    pages shared with the zygote (copy-on-write: 20 ms of a restart measured); the child binds a
    new empty dict instead (the import system and ``importlib`` read ``sys.path_importer_cache``
    at each use) and keeps the old one alive. More in docs/notes.md."""
    _ZYGOTE_CACHES.append(sys.path_importer_cache)
    sys.path_importer_cache = {}
    importlib.invalidate_caches()
    # the same for linecache (34,000 source lines in the zygote: clearcache() took 4 ms here);
    # linecache, traceback and IPython read ``linecache.cache`` at each use
    _ZYGOTE_CACHES.append(linecache.cache)
    linecache.cache = {}


def _fresh_multiprocessing() -> None:
    """What ``multiprocessing.process`` made at its import in the zygote and a fresh process makes
    at its own: the main process's authentication key (random: no two processes share one) and
    the directory it started in."""
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process()._config["authkey"] = process.AuthenticationString(
            os.urandom(32))
        process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # type: ignore[attr-defined]


def path0(task: ForkTask) -> str | None:
    """What a fresh ``python ARGV`` puts first on ``sys.path``: the working directory for ``-m``,
    a script's folder (symbolic links resolved), a folder or zip file run as ``__main__`` itself;
    nothing (``None``) in safe-path mode but for the latter."""
    target = task.argv[1] if task.script and task.argv[1] != "-m" else None
    if target is not None and is_main_importer(target):
        return os.path.abspath(target)
    if task.env.get("PYTHONSAFEPATH"):
        return None
    return os.getcwd() if target is None else os.path.dirname(os.path.realpath(target))


def is_main_importer(path: str) -> bool:
    """Whether ``python PATH`` runs ``PATH``'s ``__main__`` module (a folder or a zip file)."""
    import zipfile

    return os.path.isdir(path) or zipfile.is_zipfile(path)


def _watch_parent(pidfd: int) -> None:
    def wait() -> None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll():
            pass
        logging.getLogger("traitlets").warning("Parent appears to have exited, shutting down.")
        os._exit(1)

    threading.Thread(target=wait, name="overmind-lab-parent-watch", daemon=True).start()


def _parent_handle_from_env() -> None:
    """``IPKernelApp.parent_handle`` read ``JPY_PARENT_PID`` when the zygote imported it. With a
    parent, use 1: ipykernel starts no poller (it would watch the zygote: Note [Parent death]) and
    prints no "Ctrl-C will not work" banner, as for a fresh kernel with a parent."""
    app = sys.modules.get("ipykernel.kernelapp")
    if app is not None:
        value = 1 if os.environ.get("JPY_PARENT_PID") else 0
        cls = app.IPKernelApp
        cls.class_traits()["parent_handle"].default_value = value
        static = getattr(cls, "_static_immutable_initial_values", None)
        if isinstance(static, dict) and "parent_handle" in static:  # traitlets >= 5.9 cache
            static["parent_handle"] = value


def _leave_zygote_finalizers() -> None:
    """Note [The zygote's finalizers]: the ``weakref.finalize`` objects alive now were made in the
    zygote, for the zygote's objects; the child does not run them at exit. More in
    docs/notes.md."""
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False


def _welcome_every_subscriber() -> None:
    """Note [Every subscriber welcomed]: the kernel's IOPub socket reports every subscription,
    not only the first to a topic, so every client that connects gets an ``iopub_welcome``
    (JEP 65). More in docs/notes.md."""
    iostream = sys.modules.get("ipykernel.iostream")
    thread_cls = getattr(iostream, "IOPubThread", None)
    original = getattr(thread_cls, "_setup_xpub_listener", None)
    if thread_cls is None or original is None:
        return
    import zmq

    def _setup_xpub_listener(self: Any) -> None:
        # In IOPubThread.__init__, before its thread starts: the socket is not used by another
        # thread yet (a socket option set later would race the IOPub thread).
        socket = self.socket
        if hasattr(socket, "getsockopt") and socket.getsockopt(zmq.TYPE) == zmq.XPUB:
            socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        original(self)

    thread_cls._setup_xpub_listener = _setup_xpub_listener


#: Note [The first cell waits for a listener]: the longest a forked kernel's first
#: ``execute_request`` waits for an IOPub subscriber.
LISTENER_WAIT_S = 0.3


def _first_cell_waits_for_a_listener() -> None:
    """Note [The first cell waits for a listener]: a warm kernel is up tens of ms after a restart,
    and a client that executes right after ``restart_kernel()`` (no ``wait_for_ready``) has its
    shell and IOPub sockets reconnect on libzmq's timers, each with its own jitter: its first
    cell could run before its IOPub socket subscribed, and the cell's output and its ``idle``
    status went to nobody (``execute_interactive`` then waits for that ``idle`` until its timeout;
    the benchmark saw it under load). The first ``execute_request`` waits, on the kernel's loop,
    until IOPub has a subscriber (its XPUB socket reports each one: Note [Every subscriber
    welcomed]), ``LISTENER_WAIT_S`` at most; later ones do not wait, nor does any other request.
    A reconnected SUB socket sends its subscription only when its own thread next uses it
    (libzmq attaches the new pipe then), so a client that waits for a reply before it reads
    IOPub (``wait_for_ready``'s ``kernel_info``) would wait for the kernel while the kernel
    waited for it: only a cell waits, and clients read IOPub for a cell's output. A plain kernel
    takes seconds to start, by which time every client has subscribed. More in docs/notes.md."""
    iostream = sys.modules.get("ipykernel.iostream")
    kernelbase = sys.modules.get("ipykernel.kernelbase")
    thread_cls: Any = getattr(iostream, "IOPubThread", None)
    kernel_cls: Any = getattr(kernelbase, "Kernel", None)
    handle = getattr(thread_cls, "_handle_subscription", None)
    execute = getattr(kernel_cls, "execute_request", None)
    import inspect

    if handle is None or execute is None or not inspect.iscoroutinefunction(execute):
        return
    import asyncio

    subscribed = threading.Event()

    def _handle_subscription(self: Any, frames: list[Any]) -> None:
        if any(bytes(frame)[:1] == b"\x01" for frame in frames):  # a subscription, not a leave
            subscribed.set()
        handle(self, frames)

    async def execute_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kernel_cls.execute_request is execute_request:
            kernel_cls.execute_request = execute  # ipykernel's own from the next cell on
            # A subscription that reached the socket before the IOPub thread watched it would
            # leave the descriptor's edge spent (ZMQ's are edge-triggered) until the thread's
            # next send, and none comes while this waits: the thread is asked to look, in its
            # own loop (a ZMQ socket belongs to one thread), every 10 ms.
            iopub: Any = getattr(self, "iopub_thread", None)
            stream = getattr(iopub, "_xpub_stream", None)
            deadline = time.monotonic() + LISTENER_WAIT_S
            polls = 0
            while not subscribed.is_set() and time.monotonic() < deadline:
                if stream is not None and polls % 5 == 0:
                    iopub.io_loop.add_callback(stream._handle_events, stream.socket, 0)
                polls += 1
                await asyncio.sleep(0.002)
        return await execute(self, *args, **kwargs)

    thread_cls._handle_subscription = _handle_subscription
    kernel_cls.execute_request = execute_request


def _standby_until_go(task: ForkTask) -> None:
    """Note [A standby for the restart]: ipykernel starts as far as binding its sockets and
    waits there for ``go`` (the old kernel holds the ports until it exits). A short-lived thread
    waits for ``go`` meanwhile and binds the ports the moment it comes (Note [Ports bound at the
    fork]), so that the server's sockets, which connect right after the launch, are not refused
    and left to libzmq's 100-200 ms reconnect timer. Without ``go`` the child exits at once and
    quietly: nothing of the user's has run. More in docs/notes.md."""
    go_fd = task.go_fd
    assert go_fd is not None

    def wait(_app_at_sockets: Callable[[float], Any]) -> bool:
        if read_pipe(go_fd, task.go_wait, until=b"go") != b"go":
            return False
        timeline("child.go", task.env, ports=ports.bind_kernel_ports(task.argv[3:]))
        return True

    claim.hold_at_sockets(wait, task.env)


def _learn_at_exit(task: ForkTask) -> None:
    def learn() -> None:
        # Note [Learning at exit]: only the modules the zygote did not preload are looked at (a
        # look at every module, realpath of each file, took 60-130 ms of each restart). More in
        # docs/notes.md.
        t0 = time.perf_counter()
        try:
            new = learned.third_party_modules(
                [m for m in list(sys.modules) if m not in task.preloaded])
            if new:
                learned.record_learned(task.learned_path, new)
        except OSError:
            pass
        timeline("child.learned", ms=(time.perf_counter() - t0) * 1000)

    atexit.register(learn)


def _take_on_server_attributes(task: ForkTask) -> None:
    """Note [Inherited process attributes]: tell the zygote on ``ready_fd`` whether this child took
    on the server's attributes; exit at once if it could not."""
    try:
        inherit.apply(task.inherit)
    except Exception as exc:  # noqa: BLE001 - any failure: say why, the launch goes plain
        why = str(exc) if isinstance(exc, inherit.NotApplicable) else (
            f"the forked kernel failed to take on the server's attributes: {exc!r}")
        if task.ready_fd is not None:
            os.write(task.ready_fd, why.encode()[:4000])
        os._exit(70)
    if task.ready_fd is not None:
        os.write(task.ready_fd, b"ok")
        os.close(task.ready_fd)


def become(task: ForkTask) -> None:
    """Everything but running the module (separate so a test can check the state)."""
    steps: dict[str, float] = {}
    last = [time.perf_counter()]

    def step(name: str) -> None:  # the ms of each step, for Note [Restart timeline]
        now = time.perf_counter()
        steps[name] = round((now - last[0]) * 1000, 3)
        last[0] = now

    _take_on_server_attributes(task)
    step("inherit")
    os.setsid()
    for target, fd in enumerate(task.stdio):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    # Modules whose start-up ignores SIGINT once ready (Note [Interrupted at birth]).
    kernel = (is_ipykernel(task.argv) and "ipykernel.kernelapp" in sys.modules
              and not task.script)
    _reset_signals(ipykernel=kernel, ignored=task.inherit.get("ignored_signals", ()))
    os.chdir(task.cwd)
    if kernel and task.claim_fd is not None:  # Note [A standby for the launcher's restart]
        claim.standby_until_claimed(task.claim_fd, task.argv[3:], task.env, task.go_wait,
                                    _watch_parent)
    elif kernel and task.go_fd is not None:  # Note [A standby for the restart]
        _standby_until_go(task)
    elif kernel:  # as early as the cwd allows: Note [Ports bound at the fork]
        ports.bind_kernel_ports(task.argv[3:])
        step("ports")
    _replace_environ(task.env, task.start_env)
    time.tzset()
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    step("process")
    first = path0(task)
    if first is not None:
        sys.path.insert(0, first)
    _fresh_import_caches()
    step("import_caches")
    _reseed()
    step("reseed")
    _fresh_library_state()
    _fresh_multiprocessing()
    _set_threads(task.thread_targets)
    step("threads")
    if task.parent_pidfd is not None and task.env.get("JPY_PARENT_PID"):
        _watch_parent(task.parent_pidfd)
    _parent_handle_from_env()
    _learn_at_exit(task)
    step("watch")
    _leave_zygote_finalizers()
    if kernel:
        _welcome_every_subscriber()
        _first_cell_waits_for_a_listener()
        if task.zygote_socket:  # Note [A standby for the launcher's restart]
            claim.ask_on_restart(task.zygote_socket, task.env)
    step("kernel")
    timeline("child.become", task.env, steps=steps)


def run(task: ForkTask) -> int:
    """Become the kernel and run it; returns the exit status for ``sys.exit``."""
    become(task)
    module, args = task.argv[2], task.argv[3:]
    sys.argv = [task.argv[0], *args]
    sys.orig_argv = list(task.argv)
    timeline("child.run_module", task.env)
    return run_main(module)


def run_and_exit(task: ForkTask) -> NoReturn:
    """In the child, right after the fork: become the kernel, run it, exit.

    Note [Leaving the zygote's loop]: the child never returns into the zygote's loop (as
    ``multiprocessing.forkserver``); what :func:`run` lets out is printed, status 1."""
    code = 1
    try:
        code = run(task)
    except BaseException:  # noqa: BLE001 - the top of this process: report, then exit
        traceback.print_exc()
    exit_now(code)
