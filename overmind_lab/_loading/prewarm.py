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
  not exist there (a later import of that module hangs). A fork first waits for the thread
  (``os.register_at_fork``; it runs before the interpreter takes its import lock). The processes
  of our own that fork (the daemon, the zygote) and the CLI start no thread at all (``wanted``).
"""

from __future__ import annotations

import os
import sys
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


def start() -> None:
    """Start the thread once per process (called by ``import overmind_lab``)."""
    global _thread
    if _thread is not None or not wanted(list(getattr(sys, "orig_argv", sys.argv))):
        return
    _thread = threading.Thread(target=_run, name="overmind-lab-prewarm", daemon=True)
    os.register_at_fork(before=wait)
    _thread.start()


def wait(timeout: float | None = 5.0) -> None:
    """Wait for the thread, if one runs (before a fork; tests)."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def _run() -> None:
    try:
        from overmind_lab._loading import keys, load  # noqa: F401 - the import is the work

        keys.prewarm()
    except BaseException:  # noqa: BLE001 - the first call does it again, and says what fails
        pass
