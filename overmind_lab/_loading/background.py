"""Storing a large cold result in a forked process, so that the first load returns at once.

Note [Storing in a forked process]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A first load is the plain load plus its store: pickling the skeleton (~0.1 s for an SD
UNet) and, for a converted model (fp32 -> fp16), writing 1.7 GB into a new segment
(0.5-0.9 s here), then reading the entry back (~0.04 s). A large result's caller gets the
loader's own object instead of the read-back: it is the plain load, and the store then
needs nothing from the caller but a consistent picture of the result. A thread would not
give one: the caller may change the model in place right after the load returns
(``load_state_dict``, ``.half()``, a training step), and the cache would then keep a mix
of before and after. ``fork()`` gives it: the child sees the process exactly as
it was when the load returned, copy-on-write, whatever the caller does next.

So for results with at least ``MIN_BYTES`` of CPU tensors, ``start`` forks and the child
runs the whole store: the pickle, ``link``, ``reserve``, the write and ``store`` on the
load's session, whose socket it inherited (the daemon's lease for the key is tied to that
connection, so other processes loading the same key wait for the child, as they would
have waited for the caller). The caller closes its copy of the socket without a word and
returns. The rules, in order:

- All signals are blocked in the forking thread around ``fork()``, so the child cannot
  run a handler before it has set its own: it starts a session of its own (``setsid``:
  the kernel's interrupt and ``killpg`` at a kernel restart do not reach it, so a store
  started just before a restart still lands), ignores SIGINT/SIGHUP/SIGPIPE, then
  unblocks. SIGTERM and SIGKILL still end it: the daemon sees the connection close, drops
  the reserved segment, and releases the lease (nothing half-written remains).
- The child writes nothing to the caller's stdout/stderr (in a kernel those are the
  notebook's) and holds none of the caller's descriptors open: descriptors 0-2 and
  Python's streams go to ``/dev/null``, warnings and logging are off, and every other
  descriptor is closed except the session's socket, the outcome pipe and the mapped
  segments' (the pickler compares bytes through them). A descriptor held on would be
  felt: a pipe's reader (a test runner) would wait for the store to end, and a kernel's
  listening sockets would still be bound when the restarted kernel binds the same ports.
  The caller's file objects whose descriptors were closed are left alone: the store
  drops no reference to them, and the child runs no garbage collection
  (``gc.disable()``), so no stale ``close`` can hit a descriptor number that the store
  opened meanwhile.
- The child's outcome goes back through a pipe, one JSON line; a thread in the caller
  reads it, reaps the child, and warns there when the store failed, as a synchronous
  store would.
- The child ends with ``os._exit``: no ``atexit`` handler, finalizer or library teardown
  of the caller's runs twice.
- Only CPU tensors: a CUDA context does not survive a fork, so a result with tensors on
  another device is stored synchronously, as are small results (the fork costs more
  than their store) and everything when ``$OVERMIND_LAB_BACKGROUND_STORE`` is ``never``.
  If ``fork()`` fails, the store runs synchronously.

What the caller pays is the fork itself: copying the page tables of its address space
(13-17 ms here for a process holding an SD UNet or a 1.1B Llama), and, while the child
lives (one to two seconds), a page copy for each page it writes to for the first time. What
a user may notice: ``overmind-lab list`` shows the entry about a second after the load
returns, and a library that prints on fork (HF ``tokenizers``, when its thread pool was
used before) says so in the child, on the caller's stderr. ``wait_for_stores()`` waits
for the stores this process started (the benchmark does, before it exits).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from overmind_lab._loading import segments

__all__ = ["BACKGROUND_ENV", "MIN_BYTES", "REASON", "StoreOutcome", "wanted", "start",
           "pending_stores", "wait_for_stores"]

#: ``auto`` (default: results with at least ``MIN_BYTES`` of CPU tensors), ``always``
#: (every result whose tensors are all on the CPU) or ``never``.
BACKGROUND_ENV = "OVERMIND_LAB_BACKGROUND_STORE"
MIN_BYTES = 64 << 20
#: The ``reason`` of the load event of a first load stored in the background.
REASON = "being cached in the background"


@dataclass
class StoreOutcome:
    """How one background store ended; ``error`` is ``None`` when it was stored."""

    key: str
    name: str
    pid: int
    finished: float | None = None  # time.monotonic() when the caller saw it end
    error: str | None = None
    not_cacheable: bool = False
    done: threading.Event = field(default_factory=threading.Event)


_lock = threading.Lock()
_pending: list[StoreOutcome] = []


def _mode() -> str:
    mode = os.environ.get(BACKGROUND_ENV, "auto").strip().lower() or "auto"
    return mode if mode in ("auto", "always", "never") else "auto"


def wanted(result: Any) -> bool:
    """Whether to store ``result`` in a forked process (see the Note)."""
    mode = _mode()
    if mode == "never" or not hasattr(os, "fork"):
        return False
    nbytes = cpu_tensor_bytes(result)
    if nbytes is None:
        return False
    return nbytes > 0 and (mode == "always" or nbytes >= MIN_BYTES)


def cpu_tensor_bytes(result: Any) -> int | None:
    """Bytes of the distinct storages of the modules in ``result`` (a module, or an
    object with a ``components`` dict of them, like a diffusers pipeline), ``None`` when
    any tensor is not on the CPU. Other objects count 0 (their stores are small)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    modules = [result]
    components = getattr(result, "components", None)
    if isinstance(components, dict):
        modules = list(components.values())
    seen: set[int] = set()
    total = 0
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            continue
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.device.type != "cpu":
                return None
            try:
                storage = tensor.untyped_storage()
            except (NotImplementedError, RuntimeError):  # sparse: no storage of its own
                continue
            ptr = storage.data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def start(store: Callable[[], None], key: str, name: str,
          report: Callable[[StoreOutcome], None], keep_fds: Sequence[int]) -> bool:
    """Run ``store()`` in a forked child; ``False`` (nothing started) when fork fails.

    The child keeps only ``keep_fds`` (the session's socket) and the descriptors of the
    mapped segments open. ``report`` is called in the caller's process, from a thread,
    once the child ended. The caller must then drop its copy of whatever the child uses
    (the session) without using it.
    """
    read_end, write_end = os.pipe()
    everything = signal.valid_signals()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, everything)
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a process with threads: the child only
            # runs the store and exits (the Note), it never goes back to the caller's code.
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*fork\(\)")
            pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(read_end)
        os.close(write_end)
        return False
    if pid == 0:  # never returns
        _child(store, write_end, keep_fds)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    os.close(write_end)
    outcome = StoreOutcome(key, name, pid)
    with _lock:
        _pending.append(outcome)
    threading.Thread(target=_reap, args=(outcome, read_end, report),
                     name=f"overmind-lab-store-{pid}", daemon=True).start()
    return True


def _child(store: Callable[[], None], out: int, keep_fds: Sequence[int]) -> NoReturn:
    code = 1
    try:
        gc.disable()  # no collection may close a descriptor number that was reused
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        keep = sorted({0, 1, 2, out, *keep_fds, *segments.mapped_fds()})
        low = 0
        for fd in keep:
            if low < fd:  # closerange(n, n) would close everything (close_range(n, -1))
                os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, max(low + 1, os.sysconf("SC_OPEN_MAX")))
        sys.stdout = sys.stderr = open(1, "w", closefd=False)  # noqa: SIM115 - /dev/null
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        message: dict[str, Any] = {"ok": True}
        try:
            store()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            from overmind_lab._errors import NotCacheable

            message = {"ok": False, "error": str(exc) or type(exc).__name__,
                       "not_cacheable": isinstance(exc, NotCacheable)}
        os.write(out, json.dumps(message).encode() + b"\n")
        code = 0
    finally:
        os._exit(code)


def _reap(outcome: StoreOutcome, read_end: int,
          report: Callable[[StoreOutcome], None]) -> None:
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    _, status = os.waitpid(outcome.pid, 0)
    try:
        message = json.loads(b"".join(chunks) or b"null")
    except ValueError:
        message = None
    if not isinstance(message, dict):
        code = os.waitstatus_to_exitcode(status)
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        outcome.error = f"the process storing it ended ({how}) before it was stored"
    elif not message.get("ok"):
        outcome.error = str(message.get("error"))
        outcome.not_cacheable = bool(message.get("not_cacheable"))
    outcome.finished = time.monotonic()
    try:
        report(outcome)
    finally:
        with _lock:
            _pending[:] = [o for o in _pending if o is not outcome]
        outcome.done.set()


def pending_stores() -> list[StoreOutcome]:
    """The stores this process started in the background that have not ended yet."""
    with _lock:
        return list(_pending)


def wait_for_stores(timeout: float | None = None) -> list[StoreOutcome]:
    """Wait until every store this process started in the background has ended.

    Returns their outcomes (``error`` is ``None`` for those that were stored); raises
    ``TimeoutError`` when ``timeout`` seconds pass first.
    """
    with _lock:
        pending = list(_pending)
    deadline = None if timeout is None else time.monotonic() + timeout
    for outcome in pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not outcome.done.wait(left):
            raise TimeoutError(f"the store of {outcome.name} (pid {outcome.pid}) has not "
                               f"ended after {timeout} s")
    return pending
