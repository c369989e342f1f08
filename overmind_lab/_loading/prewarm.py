"""A fresh process's first-call work, done in a background thread started by ``import
overmind_lab``: Note [The first call's work, earlier].

Note [The first call's work, earlier]: a fresh process's first ``load`` imported the load machinery
(3-5 ms: 13 modules) and scanned the installation for the key (1.4 ms: the ``.dist-info`` folders
along ``sys.path``, the editable roots, the attention packages), on top of the 8 ms a repeated hit
takes. Users import ``overmind_lab`` before they load, usually with torch and diffusers (seconds)
in between, so ``import overmind_lab`` starts one daemon thread that does both; the first call
finds them done or, where it comes at once, waits on the same module locks and caches (never twice
the work).

- The scans are the same once-per-process caches the first call filled; computed earlier, they
  could miss a package installed between the import and the first call. So the thread records the
  search path's state (``sys.path``, ``sys.meta_path`` and the ``mtime`` of each folder on the path,
  which an install changes by adding its ``.dist-info``) *before* scanning, and the first key
  compares it (``keys._settle``: ~20 µs): on any difference the caches are emptied and that key
  scans afresh, exactly as without the thread.
- A fork while the thread imports would leave a module lock held in the child by a thread that does
  not exist there (a later import of that module hangs) and the module half-run in
  ``sys.modules``: Note [A fork while the thread imports]. The processes of our own that fork (the
  daemon, the zygote) and the CLI start no thread at all (``wanted``).
- The thread starts at once but works only once the importing thread's own call ended: Note [The
  thread waits its turn].

Note [The thread waits its turn]: the thread's imports (100 modules where nothing imported them)
hold the GIL in turns with the importing thread, 5 ms at a time, so a thread that began at once
made the user's ``import overmind_lab; overmind_lab.patch_all()`` (``%load_ext``, the first cell
of a notebook, before torch) 4-10 ms instead of 2 where the standard library was imported (an
IPython kernel) and 20-30 ms instead of 9 in a bare interpreter, where it also had to import
``logging`` first (Note [A fork while the thread imports], 1). So it waits, blocked on a lock
(no GIL, no CPU), for two things:

1. ``go()``: the end of ``patch_all`` and of ``%load_ext`` (``load_ipython_extension``), or, where
   neither comes, ``HOLD_SECONDS`` after the import (a script that imports ``overmind_lab``, then
   torch, and patches later);
2. ``logging`` imported by another thread (torch, diffusers and IPython import it), polled every
   few milliseconds, for at most ``GIVE_UP_SECONDS`` (then the first call does the work, as
   without the thread). The thread itself never imports ``logging`` first: Note [A fork while the
   thread imports], 1.

A caller that needs the work now (``wait``: a public name of a module the thread imports, such as
``overmind_lab.load``) imports ``logging`` itself, lets the thread go and waits for it: the same
work, done at once. In the notebook order the thread's 25-70 ms then run beside the imports of
torch and diffusers (seconds), and in the script order (torch first) right after ``patch_all``,
where the first load waits for them as it did.

Note [A fork while the thread imports]: a fork right after ``import overmind_lab`` (a
multiprocessing fork pool, DataLoader workers, ``os.fork``) used to wait for the thread (0.05-0.8 s)
and printed ``Exception ignored in _releaseLock``: ``logging``, imported by the thread *during* that
wait, registered its fork hooks after the interpreter had copied the list of ``before`` hooks, so
its ``after_in_parent`` released a lock its ``before`` never took. Now a fork does not wait:

1. ``logging`` (the one module the thread would import that registers ``before`` and
   ``after_in_parent`` hooks; ``tests/test_prewarm.py`` checks that it stays the only one) is
   imported by another thread before the thread begins its work: it waits until it sees it in
   ``sys.modules`` (Note [The thread waits its turn]). The thread then registers no hook that
   pairs a parent's before and after, so no fork can see half a pair.
2. The child repairs what the vanished thread held: each module lock it owned is dropped from
   ``importlib._bootstrap._module_locks`` (the next import makes a fresh one) and each module it was
   still running is removed from ``sys.modules``, with its submodules (the next import runs them
   from the start, as in a fresh process; a finished submodule left there would not be bound to
   the package's new module object again); the scans it made are forgotten (they were not
   checked against the search path's state: ``keys.forget_prewarm``). The child starts no
   thread of its own: it does the work at its first call, as without the thread.
3. The thread holds no lock of ours while it scans (the caches are ``lru_cache``s, filled whole),
   so nothing else of ours can be left held.
4. From Python 3.12 on, ``os.fork()`` in a process with more than one thread warns ("This process
   (pid=N) is multi-threaded, use of fork() may lead to deadlocks in the child", a
   ``DeprecationWarning`` shown in ``__main__``), after the ``after_in_parent`` hooks ran. A fork
   while the thread is the only other one (ours, and 2 made the child safe from it) puts one
   ``ignore`` filter for that warning in front (the ``before`` hook), which the thread takes out
   when it ends (the child: at once). So while it lives (its wait for its turn, at most
   ``GIVE_UP_SECONDS`` and in practice until torch imports ``logging``, then a few milliseconds
   of work) that warning is not shown; with any other thread at the fork (the user's, a BLAS
   pool) it shows as always, as it does once the thread ended. The filter is added and taken
   out under ``_quiet_lock``, so one added as the thread ends is taken out too; the child, whose
   copy of the lock may be held by the vanished thread, makes a new one.

5. ``patch_all``'s thread that starts the daemon ahead (Note [A daemon started ahead] in
   ``client``) imports the client in a fresh login; a fork meanwhile left the child waiting
   forever on a module lock that thread held (found by a fork right after ``patch_all``). It is
   counted among the importing threads (``importing``) and repaired the same way (2).

Note [A package half imported by another thread]: an import of ``pkg.sub`` does not wait for
``pkg`` when ``pkg`` is already in ``sys.modules``, even while another thread is still running
its ``__init__``. For ``importlib`` that is fatal: a thread that imports ``importlib.util`` (the
user's ``import torch``) while this thread runs ``importlib/__init__.py``, before that binds
``importlib._bootstrap`` to the interpreter's own ``_frozen_importlib``, loads a second, never
set up copy of the frozen ``importlib._bootstrap`` and rebinds the package's ``_bootstrap`` to
it; every later ``importlib.import_module`` then raises ``NameError: name 'sys' is not
defined``. CI met it once (``overmind_lab.load`` in a fresh venv's ``python -c``), so
``importlib`` and ``importlib.util`` are imported by the importing thread before the thread
starts (0.3 ms where nothing imported them yet).
"""

from __future__ import annotations

import os
import sys
from _thread import allocate_lock

# ``threading`` and ``warnings`` are imported once the thread starts: a process that starts none
# (the CLI, ``overmind-lab run`` before its plain exec) pays nothing for ``import overmind_lab``.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading

_thread: threading.Thread | None = None


def wanted(argv: list[str]) -> bool:
    """Whether this process should warm up: not our own daemon, zygote, launcher or CLI (they import
    what they use themselves, and the first two fork)."""
    if os.environ.get("OVERMIND_LAB_PREWARM", "1") == "0":
        return False
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "-m":
            return i + 1 < len(argv) and argv[i + 1].split(".")[0] != "overmind_lab"
        if argv[i] in ("-c", "-"):
            return True
        i += 2 if argv[i] in ("-X", "-W") else 1
    return not (i < len(argv) and os.path.basename(argv[i]) == "overmind-lab")


#: Note [The thread waits its turn]: how long (s) the thread waits for ``go()``, then for
#: ``logging``, and how often (s) it looks for ``logging`` at most.
HOLD_SECONDS = 0.03
GIVE_UP_SECONDS = 10.0
_POLL_SECONDS = 0.02
#: held until ``go()``; the thread's sleeps are timed acquires of ``_never`` (no import of ``time``)
_go = allocate_lock()
_go.acquire()
_never = allocate_lock()
_never.acquire()


def start() -> None:
    """Start the thread once per process (called by ``import overmind_lab``)."""
    global _thread
    if _thread is not None or not wanted(list(getattr(sys, "orig_argv", sys.argv))):
        return
    import importlib.util  # noqa: F401 - Note [A package half imported by another thread]
    import threading

    _thread = threading.Thread(target=_run, name="overmind-lab-prewarm", daemon=True)
    importing(_thread)
    _thread.start()


_hooked = False


def _fork_hooks() -> None:
    global _hooked
    if not _hooked:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _hooked = True


#: The threads of ours that import: this module's thread and ``patch.start_ahead``'s (which
#: imports the client as it starts the daemon); a fork while one imports is repaired in the
#: child (Note [A fork while the thread imports], 2 and 5), by their idents.
_importers: list[threading.Thread] = []


def importing(thread: threading.Thread) -> None:
    """Count ``thread`` (not started yet) among the threads whose imports a fork's child
    repairs: Note [A fork while the thread imports], 5."""
    _fork_hooks()
    _importers.append(thread)


def go() -> None:
    """The importing thread's own call ended: the thread may begin (Note [The thread waits its
    turn]). Again is harmless."""
    if _go.locked():
        try:
            _go.release()
        except RuntimeError:  # another thread's go() came first
            pass


def wait(timeout: float | None = 5.0) -> None:
    """The work now: let the thread go and wait for it, if one runs (the lazy public names;
    tests). ``logging`` is imported here where nothing did yet (Note [The thread waits its
    turn], 2)."""
    thread = _thread
    if thread is None:
        return
    import threading

    if thread is not threading.current_thread():
        import logging  # noqa: F401 - Note [A fork while the thread imports], 1

        go()
        thread.join(timeout)


#: whether the thread ran at the last fork (Note [A fork while the thread imports]), and the
#: idents of the importing threads then alive, the thread's among them (2, 5)
_running_at_fork = False
_importing_at_fork: list[int] = []


#: Note [A fork while the thread imports], 4: the ``ignore`` filter a fork put in, the lock
#: around it, and whether the thread ended (no filter may go in after that)
_quiet_filter: tuple[object, ...] | None = None
_quiet_lock = allocate_lock()
_ended = False
_FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\)"


def _before_fork() -> None:
    global _running_at_fork, _quiet_filter, _importing_at_fork
    thread = _thread
    _running_at_fork = thread is not None and thread.is_alive()
    _importing_at_fork = [t.ident for t in _importers if t.ident is not None and t.is_alive()]
    if not _running_at_fork or sys.version_info < (3, 12) or not _only_ours():
        return
    import warnings

    with _quiet_lock:
        if not _ended and _quiet_filter is None:
            warnings.filterwarnings("ignore", _FORK_WARNING, DeprecationWarning)
            _quiet_filter = warnings.filters[0]


def _only_ours() -> bool:
    """Whether this process's threads are the main one and ours (as CPython counts them on
    Linux: the tasks of ``/proc/self``)."""
    import threading

    try:
        return threading.active_count() == 2 and len(os.listdir("/proc/self/task")) == 2
    except OSError:
        return False


def _unquiet() -> None:
    """Take out the filter a fork put in, if it is there."""
    global _quiet_filter
    entry, _quiet_filter = _quiet_filter, None
    if entry is not None:
        import warnings

        try:
            warnings.filters.remove(entry)  # type: ignore[attr-defined]  # a list
        except ValueError:  # the user reset the filters meanwhile
            pass
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()


def _after_fork_in_child() -> None:
    """Note [A fork while the thread imports], 2: what the thread held, let go in the child."""
    global _thread, _quiet_lock
    _quiet_lock = allocate_lock()  # 4: the vanished thread may hold the copy
    _unquiet()
    _importers.clear()  # none of them exists here
    for tid in _importing_at_fork:
        _let_go_of_imports(tid)
    if not _running_at_fork:
        return
    _thread = None
    keys = sys.modules.get("overmind_lab._loading.keys")
    if keys is not None and hasattr(keys, "forget_prewarm"):
        keys.forget_prewarm()


def _let_go_of_imports(tid: int) -> None:
    """In a fork's child: the module locks the vanished thread ``tid`` held, dropped, and the
    modules it was still running, removed (Note [A fork while the thread imports], 2)."""
    try:
        import _frozen_importlib as bootstrap
    except ImportError:  # pragma: no cover - CPython always has it
        return
    locks = bootstrap._module_locks  # type: ignore[attr-defined]
    held = []
    for name, ref in list(locks.items()):
        lock = ref()
        if lock is not None and getattr(lock, "owner", None) == tid:
            held.append(name)
            locks.pop(name, None)
    try:
        bootstrap._blocking_on.pop(tid, None)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    half = [name for name in held
            if getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False)]
    for name in half:  # a package's finished submodules too: run again, they bind to it again
        for other in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            sys.modules.pop(other, None)


def _turn() -> bool:
    """Wait for the thread's turn (Note [The thread waits its turn]): whether it came."""
    _go.acquire(timeout=HOLD_SECONDS)
    waited = HOLD_SECONDS
    while "logging" not in sys.modules:  # Note [A fork while the thread imports], 1
        if waited >= GIVE_UP_SECONDS:
            return False
        _never.acquire(timeout=_POLL_SECONDS)
        waited += _POLL_SECONDS
    return True


def _run() -> None:
    global _ended
    try:
        if not _turn():
            return
        from overmind_lab._loading import keys, load  # noqa: F401 - the import is the work

        keys.prewarm()
    except BaseException:  # noqa: BLE001 - the first call does it again, and says what fails
        pass
    finally:
        with _quiet_lock:  # Note [A fork while the thread imports], 4
            _ended = True
            _unquiet()
