"""``overmind-lab run [-v] [--plain] SCRIPT [ARGS...]`` and ``overmind-lab run -m MODULE
[ARGS...]``: the start, with nothing imported but ``os`` and ``sys``. It parses the arguments and
looks for the zygote's socket; where a zygote may serve, ``script`` asks it for the fork (and
imports what that takes); where none can, this ``exec``s plain Python at once.

Note [A plain run at once]: where no zygote serves (the first run, a new environment), ``run``
must cost no more than ``python SCRIPT`` but for the few milliseconds of its own start, and still
start a zygote for the next run. Asking the zygote client would import 40 ms of modules (``json``,
``socket``, ``subprocess``, ``pathlib``, the trust checks) before the exec. So:

1. ``overmind_lab`` costs nothing to import (Note [A package that costs nothing to import]); the
   command's entry (``_console``) imports this module for ``run`` and nothing else.
2. The zygote's socket path is computed with ``os`` and ``sys`` (``zygote_identity``: a hash by
   the interpreter's built-in SHA-256, and the runtime folder where it is certain without
   ``tempfile``) and looked for with one ``stat``. Not there: the run is plain. Where the folder is
   not certain (``TMPDIR`` set, a relative ``OVERMIND_LAB_SOCKET``), ``script`` decides, as for a
   socket that is there (it may be a stale one's: then ``script`` goes plain, after its imports).
3. The zygote for the next run is started by a grandchild (fork, fork, the child exits at once and
   is reaped here): it leaves the terminal's session and process group (a Ctrl-C for the script
   never reaches it), lets go of the caller's standard descriptors (a ``$(overmind-lab run ...)``
   does not wait for it) and does the imports and the spawn itself, while the script runs. Nobody
   waits for it, and the script sees no child of its own: a plain Python would have none.
4. The exec happens in this process: its pid is the one the shell waits for.

Measured on this machine (2 cores, an empty ``hello.py``, 20 runs each, medians): plain
``python hello.py`` 10 ms; ``overmind-lab run hello.py`` with no zygote 22 ms (before: 60 ms), of
which 10 ms are a second interpreter's start (the console script's own) and 2 ms this module.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import NoReturn

__all__ = ["main", "USAGE", "exec_plain"]

USAGE = """\
usage: overmind-lab run [-h] [-v] [--plain] SCRIPT [ARGS ...]
       overmind-lab run [-h] [-v] [--plain] -m MODULE [ARGS ...]

Run a script as `python SCRIPT ARGS` would, in a process forked from a zygote that has torch,
diffusers and transformers imported (and what earlier runs and kernels imported): the start
costs a fork, not the imports. With no zygote ready (the first run, a changed installation) the
script runs in plain Python at once and a zygote starts for the next run.

options:
  -h, --help     show this help and exit
  -v, --verbose  say on stderr why a run was plain
  --plain        run in plain Python (no zygote)
  -m MODULE      run a module as `python -m MODULE` (e.g. -m pytest)
"""


def _parse(args: list[str]) -> tuple[list[str], bool, bool] | int:
    """``(what python runs: SCRIPT ARGS or -m MODULE ARGS, verbose, plain)``, or an exit
    status (help, a usage error)."""
    verbose = plain = False
    for i, arg in enumerate(args):
        if arg in ("-h", "--help"):
            sys.stdout.write(USAGE)
            return 0
        if arg in ("-v", "--verbose"):
            verbose = True
        elif arg == "--plain":
            plain = True
        elif arg == "-m":
            if i + 1 >= len(args):
                return _usage("-m needs a module name")
            return ["-m", *args[i + 1:]], verbose, plain
        elif arg.startswith("-m"):  # as python: -mpytest
            return ["-m", arg[2:], *args[i + 1:]], verbose, plain
        elif arg == "--":
            if i + 1 >= len(args):
                break
            return args[i + 1:], verbose, plain
        elif arg.startswith("-"):
            return _usage(f"unknown option {arg} (python's own options: run "
                          "`python OPTIONS SCRIPT`)")
        else:
            return args[i:], verbose, plain
    return _usage("a script or -m MODULE is needed")


def _usage(message: str) -> int:
    sys.stderr.write(USAGE.partition("\n\n")[0] + f"\novermind-lab run: error: {message}\n")
    return 2


def exec_plain(cmd: list[str], why: str | None, pending: Iterable[int] = ()) -> NoReturn:
    """``exec`` plain Python; a signal that came meanwhile (``pending``) acts first, as on plain
    Python. (Handlers set here go back to the default by the exec itself.)"""
    if why:
        print(f"overmind-lab run: plain Python: {why}", file=sys.stderr, flush=True)
    pending = list(pending)
    if pending:
        import signal

        for signum in pending:
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
    os.execv(cmd[0], cmd)


def _plain_reason(cmd: list[str]) -> str | None:
    """Why ``cmd`` must run in plain Python before a zygote is looked for, or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"warm scripts need Linux (this is {sys.platform})"
    if cmd[1] != "-m" and not os.path.exists(cmd[1]):
        return f"{cmd[1]} does not exist (plain Python says so)"
    return None


def _no_zygote(python: str) -> bool:
    """Whether it is certain, from one ``stat``, that no zygote serves ``python`` here (Note [A
    plain run at once], 2)."""
    from overmind_lab._common.zygote_identity import identity, socket_folder_at_once

    folder = socket_folder_at_once(os.environ)
    if folder is None:
        return False
    return not os.path.exists(f"{folder}/zygote-{identity(python, os.environ)}.sock")


def _start_zygote_behind(python: str) -> None:
    """A zygote for the next run, started by a grandchild that nobody waits for (Note [A plain
    run at once], 3)."""
    owner = os.getpid()
    try:
        child = os.fork()
    except OSError:
        return  # the next run tries again
    if child:
        try:
            os.waitpid(child, 0)  # it exits at once
        except ChildProcessError:  # pragma: no cover - SIGCHLD ignored by the caller
            pass
        return
    try:
        if os.fork() == 0:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            from overmind_lab._common.zygote_client import start_for_next

            start_for_next(python, dict(os.environ), owner)
    except BaseException:  # noqa: BLE001, S110 - nobody to tell: the next run tries again
        pass
    finally:
        os._exit(0)


def main(args: list[str]) -> int:
    """``overmind-lab run ARGS``: does not return but for help and usage errors."""
    parsed = _parse(args)
    if isinstance(parsed, int):
        return parsed
    tail, verbose, plain = parsed
    cmd = [sys.executable, *tail]
    why = "--plain" if plain else _plain_reason(cmd)
    if why:
        exec_plain(cmd, why if verbose else None)
    if _no_zygote(cmd[0]):
        _start_zygote_behind(cmd[0])
        exec_plain(cmd, "no zygote was running; one starts for the next run" if verbose else None)
    from overmind_lab._launcher import script

    why, pending = script.run_warm(cmd)  # returns only where the zygote cannot serve
    exec_plain(cmd, why if verbose else None, pending)
