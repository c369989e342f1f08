"""``python -m overmind_lab._launcher -f CONNECTION_FILE``: the warm kernelspec's argv.

Where a frontend runs that argv itself (VS Code, scripts), this process stands in for the
kernel: it asks the zygote to fork ``ipykernel_launcher`` with its argv, env, cwd and stdio,
forwards SIGINT and SIGTERM, and exits with the kernel's status (killed, the kernel follows:
Note [Parent death]). With no zygote it ``exec``s a plain ``ipykernel_launcher``, saying why.

Note [Launcher in a forked kernel]: run inside a forked kernel, it runs ``ipykernel_launcher``
in place rather than ask the zygote again.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from typing import Any, NoReturn

from overmind_lab._common.zygote_client import KERNEL_MODULE, PLAIN_MODULE

__all__ = ["main", "exit_like"]

#: Signals a frontend sends to the kernel it started, forwarded to the forked kernel.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)


def _exec_plain(args: list[str], why: str | None) -> NoReturn:
    if why:
        print(f"overmind-lab: launching a plain kernel: {why}", file=sys.stderr, flush=True)
    # An ignored signal stays ignored across exec (no KeyboardInterrupt): restore the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # ipykernel, then the fast exit a restart waits less for (Note [A plain kernel's exit]).
    os.execv(sys.executable, [sys.executable, "-m", PLAIN_MODULE, *args])


def _run_in_place(args: list[str]) -> None:
    import runpy

    sys.argv = [sys.argv[0], *args]
    runpy.run_module(KERNEL_MODULE, run_name="__main__", alter_sys=True)


def _fork(args: list[str]) -> Any:
    """The forked kernel (a ``WarmKernel``); raises ``WarmUnavailable``."""
    from overmind_lab._common.zygote_client import fork_here

    env = dict(os.environ)
    env["JPY_PARENT_PID"] = str(os.getpid())  # the stand-in is the kernel's parent
    # launcher: Note [A standby for the launcher's restart] (``_forked/claim.py``)
    return fork_here([sys.executable, "-m", KERNEL_MODULE, *args], env, watch_parent=True,
                     launcher=True)


def _stand_in(kernel: Any) -> int:
    """Forward signals to ``kernel`` until it exits; its exit status."""
    def forward(signum: int, _frame: object) -> None:
        kernel.signal(signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    poller = select.poll()
    poller.register(kernel.pidfd, select.POLLIN)
    while not poller.poll():  # a forwarded signal interrupts the wait; PEP 475 resumes it
        pass
    code = kernel.returncode()
    kernel.close()
    return int(code if code is not None else -1)


def exit_like(code: int) -> NoReturn:
    """Exit with ``code``; a kernel a signal ended (``-N``) ends this process by signal N."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0 and -code in signal.valid_signals():
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler)
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code & 0xFF if code >= 0 else 1)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "overmind_lab._forked.become" in sys.modules:  # Note [Launcher in a forked kernel]
        _run_in_place(args)
        return
    if not sys.platform.startswith("linux"):
        _exec_plain(args, f"warm kernels need Linux (this is {sys.platform})")
    # An interrupt while the kernel is forked has no cell to interrupt: it must not end us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        kernel = _fork(args)
    except Exception as exc:  # noqa: BLE001 - Note [Never worse than plain] (provisioner)
        _exec_plain(args, str(exc))
    exit_like(_stand_in(kernel))
