"""How a kernel's process runs ipykernel and ends: shared by forked kernels (``_forked/become``)
and the plain kernels a warm kernelspec launches when no zygote serves (``_launcher/plain``)."""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import threading
from typing import NoReturn

from overmind_lab._common.zygote_client import timeline

__all__ = ["run_main", "exit_now", "system_exit_code"]


def run_main(module: str) -> int:
    """Run ``module`` as ``python -m`` would (``sys.argv`` already set); its exit status."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return system_exit_code(exc)
    return 0


def system_exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter gives an uncaught ``exc`` (a code that is no int is
    printed to stderr: status 1)."""
    code = exc.code
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def exit_now(code: int, signum: int | None = None) -> NoReturn:
    """Note [Fast exit]: exit as the interpreter would (threads joined, ``atexit``, stdio
    flushed), minus tearing down the imported modules. More in docs/notes.md. ``signum``: end
    by that signal instead, as the interpreter does after an uncaught ``KeyboardInterrupt``."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    timeline("child.exit", code=code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if signum is not None:
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    os._exit(code)
