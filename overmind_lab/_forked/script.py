"""In a forked child of the zygote: ``overmind-lab run``'s script, run as plain Python runs it.

``run_and_exit`` becomes the process (``become``: attributes, session, stdio, cwd, env, signals,
random state, library state), then does what ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``
does in ``Py_RunMain``: stdio objects made for the caller's descriptors, a fresh ``__main__``,
``sys.argv``, ``sys.orig_argv``, the code run, an uncaught exception given to ``sys.excepthook``
with the script's own frames, the exit status of ``SystemExit``, and the death by SIGINT after an
uncaught ``KeyboardInterrupt``.

Note [A script's stdio]: the zygote's ``sys.stdin``, ``sys.stdout`` and ``sys.stderr`` were made
for its own descriptors (``/dev/null``, its log file): a plain interpreter makes them for what
it finds, line-buffered on a terminal. The child makes new ones over the caller's descriptors
by the interpreter's rules (``create_stdio`` in ``Python/pylifecycle.c``: the zygote's encoding
and error handler, which the same locale and ``PYTHON*`` variables gave it, as the identity
ensures; newline ``"\\n"``; line-buffered on a terminal, else as the interpreter made the
zygote's own; ``<stdin>`` names). The zygote's objects are kept, never flushed: what their
buffers hold is the zygote's.

Note [Pytest's plugins imported fresh]: pytest marks the packages of every distribution that
registers a ``pytest11`` plugin for assertion rewriting as it starts, and warns about each one
already imported ("Module already imported so cannot be rewritten"). A plain ``python -m pytest``
has imported none; the zygote has (``anyio``: transformers and diffusers import it through
httpx), so a warm run printed a warning more in its summary, and those plugins' asserts were
not rewritten. A ``-m pytest`` run takes them out of ``sys.modules`` first, so that pytest
imports and rewrites them as in a plain run (the zygote's copies stay alive: preloaded modules
that imported them keep using them).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

from overmind_lab._common.exiting import exit_now, system_exit_code
from overmind_lab._common.zygote_client import timeline
from overmind_lab._forked.become import ForkTask, become, is_main_importer

__all__ = ["run_and_exit", "fresh_stdio", "fresh_main", "fresh_pytest_plugins", "PYTEST_MAINS"]

#: The zygote's stdio objects, ``__main__`` and pytest's plugins, kept alive (Note [A script's
#: stdio], Note [Pytest's plugins imported fresh]).
_ZYGOTE_OBJECTS: list[object] = []
#: ``python -m`` these runs pytest.
PYTEST_MAINS = ("pytest", "py.test")


def _stdio(fd: int, old: io.TextIOWrapper) -> io.TextIOWrapper:
    """Note [A script's stdio]: the object a plain interpreter makes for ``fd``."""
    write = fd != 0
    unbuffered = write and old.write_through  # ``-u``, ``PYTHONUNBUFFERED`` (not in sys.flags)
    buffer: Any = open(fd, "wb" if write else "rb", buffering=0 if unbuffered else -1,  # noqa: SIM115
                       closefd=False)
    raw = buffer if unbuffered else buffer.raw
    raw.name = f"<{('stdin', 'stdout', 'stderr')[fd]}>"
    line_buffering = not unbuffered and (os.isatty(fd) or bool(old.line_buffering))
    stream = io.TextIOWrapper(buffer, encoding=old.encoding, errors=old.errors, newline="\n",
                              line_buffering=line_buffering, write_through=unbuffered)
    stream.mode = "w" if write else "r"  # type: ignore[misc]
    return stream


def fresh_stdio() -> None:
    """Note [A script's stdio]."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        _ZYGOTE_OBJECTS.append(old)
        new = _stdio(fd, old)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def fresh_main() -> types.ModuleType:
    """A ``__main__`` as a fresh interpreter has it before it runs anything, in ``sys.modules``."""
    main = types.ModuleType("__main__")
    main.__loader__ = importlib.machinery.BuiltinImporter
    main.__annotations__ = {}
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    _ZYGOTE_OBJECTS.append(sys.modules.get("__main__"))
    sys.modules["__main__"] = main
    return main


def _plugin_packages() -> set[str]:
    """The top-level modules and packages of the distributions that register a pytest plugin
    (what pytest marks for rewriting; egg-style ``src/`` layouts aside)."""
    from importlib.metadata import distributions

    names: set[str] = set()
    for dist in distributions():
        if not any(ep.group == "pytest11" for ep in dist.entry_points):
            continue
        for file in dist.files or ():
            parts = file.parts
            if len(parts) == 1 and parts[0].endswith(".py"):
                names.add(parts[0][:-3])
            elif len(parts) == 2 and parts[1] == "__init__.py":
                names.add(parts[0])
    return names


def fresh_pytest_plugins(argv: list[str]) -> None:
    """Note [Pytest's plugins imported fresh]."""
    if argv[1] != "-m" or argv[2] not in PYTEST_MAINS:
        return
    tops = _plugin_packages()
    for name in [m for m in sys.modules if m.partition(".")[0] in tops]:
        _ZYGOTE_OBJECTS.append(sys.modules.pop(name))


def _runner(argv: list[str], main: types.ModuleType) -> tuple[Callable[[], object], object]:
    """What runs ``python ARGV`` (``sys.argv`` set), and the code object whose frame is the first
    a traceback of an uncaught exception shows (as the interpreter shows it)."""
    if argv[1] == "-m":  # as ``pymain_run_module``: runpy's own frames are shown
        sys.argv = ["-m", *argv[3:]]
        return (lambda: runpy._run_module_as_main(argv[2]),  # type: ignore[attr-defined]
                runpy._run_module_as_main.__code__)  # type: ignore[attr-defined]
    sys.argv = argv[1:]
    if is_main_importer(argv[1]):  # ``sys.path[0]`` is it (``become.path0``)
        return (lambda: runpy._run_module_as_main("__main__", False),  # type: ignore[attr-defined]
                runpy._run_module_as_main.__code__)  # type: ignore[attr-defined]
    path = os.path.abspath(argv[1])  # ``__file__`` and the code's file name are absolute
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    with io.open_code(path) as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    return (lambda: exec(code, main.__dict__)), code


def _report(exc: BaseException, first: object) -> None:
    """Give an uncaught ``exc`` to ``sys.excepthook`` as ``PyErr_Print`` does, its traceback from
    the frame of ``first`` on (none of ours)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not first:
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc  # type: ignore[attr-defined]
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_exc:  # noqa: BLE001 - as the interpreter: report both
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exception(hook_exc)
        print("\nOriginal exception was:", file=sys.stderr)
        traceback.print_exception(exc)


def _run(task: ForkTask) -> tuple[int, int | None]:
    """Run the script; its exit status and the signal to end by (``None``: none)."""
    main = fresh_main()
    sys.orig_argv = list(task.argv)
    first: object = None
    try:
        run, first = _runner(task.argv, main)
        timeline("child.run_script", task.env)
        run()
    except SystemExit as exc:
        return system_exit_code(exc), None
    except BaseException as exc:  # noqa: BLE001 - the top of the script, as the interpreter's
        _report(exc, first)
        return 1, signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None
    return 0, None


def run_and_exit(task: ForkTask) -> NoReturn:
    """In the child, right after the fork: become the process, run the script, exit as plain
    Python does (Note [Leaving the zygote's loop] in ``become.py``)."""
    code: int = 1
    signum: int | None = None
    try:
        become(task)
        fresh_stdio()
        fresh_pytest_plugins(task.argv)
        code, signum = _run(task)
    except BaseException:  # noqa: BLE001 - ours failed: report, then exit
        traceback.print_exc()
    exit_now(code, signum)
