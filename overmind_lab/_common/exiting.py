"""How a kernel's process runs ipykernel and ends: shared by forked kernels (``_forked/become``)
and the plain kernels a warm kernelspec launches when no zygote serves (``_launcher/plain``)."""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
from typing import NoReturn

from overmind_lab._common.zygote_client import timeline

__all__ = ["run_main", "exit_now"]


def run_main(module: str) -> int:
    """Run ``module`` as ``python -m`` would (``sys.argv`` already set); its exit status."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def exit_now(code: int) -> NoReturn:
    """Note [Fast exit]: exit as the interpreter would (threads joined, ``atexit``, stdio
    flushed), minus tearing down the imported modules. More in docs/notes.md."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    timeline("child.exit", code=code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)
