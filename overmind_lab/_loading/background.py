"""Storing a large cold result in a forked process, so that the first load returns at once.

Note [Storing in a forked process]: A first load is the plain load
plus its store (pickling ~0.1 s for an SD UNet, writing 1.7 GB 0.5-0.9 s). A large result's caller
gets the loader's own object, and the store needs only a consistent picture of it. A thread cannot
give one (the caller may change the model in place right away, leaving a mix in the cache);
``fork()`` does, copy-on-write. So for results with at least ``MIN_BYTES`` of CPU tensors, ``start``
forks and the child runs the whole store on the load's session, whose socket it inherited (the lease
is tied to that connection: others wait for the child). The caller closes its copy silently and
returns. The rules:

- Signals are blocked around ``fork()``; the child starts its own session (``setsid``: a
  kernel's interrupt and restart ``killpg`` miss it, so the store lands), ignores
  SIGINT/SIGHUP/SIGPIPE, then unblocks. SIGTERM/SIGKILL still end it: the daemon drops the
  reserved segment and releases the lease.
- The child writes nothing to the caller's stdio (the notebook's): 0-2 and Python's streams go
  to ``/dev/null``, warnings and logging are off, and every descriptor is closed but the
  socket, the outcome pipe and the mapped segments'. (A held pipe would make a test runner
  wait; a kernel's held listening sockets would block the restarted kernel's ports.) With
  ``gc.disable()`` no stale file object can close a descriptor number the store reused.
- The outcome comes back as one JSON line on a pipe; a caller thread reaps the child and warns
  if it failed, as a synchronous store would. The child ends with ``os._exit``.
- Only CPU tensors (CUDA does not survive a fork); other results, small ones, ``fork()``
  failures and ``$OVERMIND_LAB_BACKGROUND_STORE=never`` store synchronously.

The caller pays the fork (13-17 ms of page tables for an SD UNet or a 1.1B Llama) and a page copy
per first write while the child lives (a second or two). ``overmind-lab list`` shows the entry about
a second later; ``wait_for_stores()`` waits for this process's stores.
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

#: ``auto`` (default: results with at least ``MIN_BYTES`` of CPU tensors), ``always`` (every result
#: whose tensors are all on the CPU) or ``never``.
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
    """Bytes of the distinct storages of the modules in ``result`` (or its ``components`` dict),
    ``None`` when a tensor is not on the CPU; other objects count 0."""
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
    """Run ``store()`` in a forked child; ``False`` when fork fails. The child keeps only
    ``keep_fds`` and the mapped segments' fds; ``report`` is called from a caller thread when it
    ended. The caller must then drop its copy of the session without using it."""
    read_end, write_end = os.pipe()
    everything = signal.valid_signals()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, everything)
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() with threads: the child only stores and exits.
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


def _reap(outcome: StoreOutcome, read_end: int, report: Callable[[StoreOutcome], None]) -> None:
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
    """Wait until every background store this process started has ended: their outcomes (``error``
    ``None`` if stored); ``TimeoutError`` when ``timeout`` seconds pass first."""
    with _lock:
        pending = list(_pending)
    deadline = None if timeout is None else time.monotonic() + timeout
    for outcome in pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not outcome.done.wait(left):
            raise TimeoutError(f"the store of {outcome.name} (pid {outcome.pid}) has not "
                               f"ended after {timeout} s")
    return pending
