"""The warm side of ``overmind-lab run`` (``run.py`` decides, ``run_warm`` runs): the script
runs in a child forked from the zygote of this interpreter and environment (torch, diffusers,
transformers already imported), as ``python SCRIPT ARGS`` would run it (``_forked/script.py``),
with this process's environment, working directory, attributes and standard descriptors. This
process stands in for it: it forwards signals, stops and continues with it, and exits with its
status (a script a signal ended ends this process by the same signal). Where the zygote cannot
serve (a stale one, an attribute it cannot take on), it ``exec``s plain Python.

Note [A script in another session]: the zygote runs in its own session, so its child cannot
join the terminal's: the terminal's foreground process group stays this process's. What users
rely on holds: Ctrl-C reaches this process and is forwarded, so the script gets
``KeyboardInterrupt`` (and its subprocesses SIGINT, as from the terminal); Ctrl-Z stops the
script (SIGSTOP: a process group outside the terminal's session ignores SIGTSTP) and then this
process, and ``fg`` continues both; the standard descriptors are the caller's (``isatty`` as
plain, reads and writes from the terminal work). What a script can observe: ``os.getsid`` and
``os.getpgrp`` are its own pid, it has no controlling terminal (``/dev/tty`` cannot be opened,
``os.tcgetpgrp`` on the terminal names this process's group), and a signal sent to the
terminal's process group reaches it only through this process. A signal from the terminal
(Ctrl-C, Ctrl-\\, a resize, a hangup: ``si_code`` ``SI_KERNEL``) goes to the script's process
group, as the terminal would send it; one sent to this process by ``kill`` goes to the script
alone.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from overmind_lab._launcher.stand_in import exit_like

__all__ = ["run_warm"]

#: Forwarded to the script: to its process group when the terminal sent it (``SI_KERNEL``).
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2, signal.SIGWINCH, signal.SIGALRM)
#: Job control: the script stops and continues with this process.
_JOB = (signal.SIGTSTP, signal.SIGCONT)
#: Sent to the main thread by the thread that waits for the script's exit.
_WAKE = signal.SIGCHLD
_OURS = (*_FORWARDED, *_JOB, _WAKE)
#: ``si_code`` of a signal the kernel sent (a terminal's, to its foreground process group).
_SI_KERNEL = 0x80


def _fork(cmd: list[str]) -> Any:
    """The forked script (a ``WarmKernel``); raises ``WarmUnavailable``."""
    from overmind_lab._common.zygote_client import fork_here

    # Not a kernel's wait for a booting zygote: plain Python at once costs no more than waiting.
    return fork_here(cmd, dict(os.environ), watch_parent=False, script=True, boot_wait=0)


def _send(script: Any, signum: int, group: bool) -> None:
    """``signum`` to the script's process group (its pid: it leads its session), or to it alone
    (by pidfd: never to a reused pid)."""
    if script.exited():
        return
    if group:
        try:
            os.killpg(script.pid, signum)
            return
        except ProcessLookupError:
            pass  # it left its group
    try:
        signal.pidfd_send_signal(script.pidfd, signum)
    except ProcessLookupError:
        pass


def _stop(script: Any) -> None:
    """Ctrl-Z: stop the script and its group, then this process; continued, continue them."""
    _send(script, signal.SIGSTOP, group=True)
    signal.signal(signal.SIGTSTP, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTSTP)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTSTP])  # stopped here until SIGCONT
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTSTP])
    # (a process group without a parent in the session ignores SIGTSTP: then it never stopped)
    _send(script, signal.SIGCONT, group=True)
    signal.sigtimedwait([signal.SIGCONT], 0)  # the SIGCONT that continued this process: done


def _deliver(script: Any, signum: int, from_terminal: bool) -> None:
    if signum == signal.SIGTSTP:
        _stop(script)
    elif signum == signal.SIGCONT:
        _send(script, signal.SIGCONT, group=True)
    else:
        _send(script, signum, group=from_terminal)


def _exit_status(script: Any) -> int:
    """The script's exit status as the zygote reported it (``-N``: signal N); 1 if lost."""
    try:
        script.chan.settimeout(10.0)
        msg, fds = script.chan.recv()
        for fd in fds:
            os.close(fd)
        code = msg.get("exit")
    except Exception:  # noqa: BLE001 - the zygote died too: the status is lost
        code = None
    script.close()
    return code if isinstance(code, int) else 1


def _follow(script: Any, pending: list[int]) -> int:
    """Stand in for the script until it exits (Note [A script in another session]); its status.
    Signals wait in the mask for ``sigwaitinfo``, which tells a terminal's from a ``kill``."""
    import select

    main = threading.get_ident()

    def wake_at_exit() -> None:
        poller = select.poll()
        poller.register(script.pidfd, select.POLLIN)
        while not poller.poll():
            pass
        signal.pthread_kill(main, _WAKE)

    threading.Thread(target=wake_at_exit, name="overmind-lab-run-exit", daemon=True).start()
    for signum in pending:  # came while the fork was asked for (by whom is not known)
        _deliver(script, signum, from_terminal=signum in (signal.SIGINT, signal.SIGQUIT))
    while True:
        info = signal.sigwaitinfo(_OURS)
        if info.si_signo == _WAKE:
            if script.exited():
                return _exit_status(script)
            continue
        _deliver(script, info.si_signo, info.si_code == _SI_KERNEL)


def run_warm(cmd: list[str]) -> tuple[str, list[int]]:
    """Run ``cmd`` (``[python, SCRIPT or -m MODULE, ARGS...]``) forked from the zygote, stand in
    for it and exit as it did. Returns only where the zygote cannot serve: why, and the signals
    that came meanwhile (``run.exec_plain`` runs it plain)."""
    pending: list[int] = []
    # Signals that come while the fork is asked for wait here; blocked, they would be blocked in
    # a zygote started meanwhile too (the mask survives fork and exec).
    for signum in _OURS:
        signal.signal(signum, lambda signum, _frame: pending.append(signum))
    try:
        script = _fork(cmd)
    except Exception as exc:  # noqa: BLE001 - Note [Never worse than plain] (provisioner)
        return str(exc), pending
    signal.pthread_sigmask(signal.SIG_BLOCK, _OURS)
    pending = [s for s in pending if s != _WAKE]  # (a zygote's shell that exited)
    exit_like(_follow(script, pending))
