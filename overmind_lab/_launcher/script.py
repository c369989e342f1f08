"""``overmind-lab run [-v] [--plain] SCRIPT [ARGS...]`` and ``overmind-lab run -m MODULE
[ARGS...]``: the script runs in a child forked from the zygote of this interpreter and
environment (torch, diffusers, transformers already imported), as ``python SCRIPT ARGS`` would
run it (``_forked/script.py``), with this process's environment, working directory, attributes
and standard descriptors. This process stands in for it: it forwards signals, stops and
continues with it, and exits with its status (a script a signal ended ends this process by the
same signal). Where no zygote can serve, it ``exec``s plain Python at once and a zygote starts
in the background for the next run.

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
import sys
import threading
from typing import Any, NoReturn

from overmind_lab._launcher.stand_in import exit_like

__all__ = ["main", "USAGE"]

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


def _exec_plain(cmd: list[str], why: str | None, pending: list[int]) -> NoReturn:
    """``exec`` plain Python; a signal that came meanwhile acts first, as on plain Python."""
    if why:
        print(f"overmind-lab run: plain Python: {why}", file=sys.stderr, flush=True)
    for signum in pending:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    for signum in _OURS:
        signal.signal(signum, signal.SIG_DFL)
    os.execv(cmd[0], cmd)


def _plain_reason(cmd: list[str]) -> str | None:
    """Why ``cmd`` must run in plain Python before a zygote is asked, or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"warm scripts need Linux (this is {sys.platform})"
    if cmd[1] != "-m" and not os.path.exists(cmd[1]):
        return f"{cmd[1]} does not exist (plain Python says so)"
    return None


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


def main(args: list[str]) -> int:
    """``overmind-lab run ARGS``: does not return but for help and usage errors."""
    parsed = _parse(args)
    if isinstance(parsed, int):
        return parsed
    tail, verbose, plain = parsed
    cmd = [sys.executable, *tail]
    pending: list[int] = []
    why = "--plain" if plain else _plain_reason(cmd)
    if why:
        _exec_plain(cmd, why if verbose else None, pending)
    # Signals that come while the fork is asked for wait here; blocked, they would be blocked in
    # a zygote started meanwhile too (the mask survives fork and exec).
    for signum in _OURS:
        signal.signal(signum, lambda signum, _frame: pending.append(signum))
    try:
        script = _fork(cmd)
    except Exception as exc:  # noqa: BLE001 - Note [Never worse than plain] (provisioner)
        _exec_plain(cmd, str(exc) if verbose else None, pending)
    signal.pthread_sigmask(signal.SIG_BLOCK, _OURS)
    pending = [s for s in pending if s != _WAKE]  # (a zygote's shell that exited)
    exit_like(_follow(script, pending))
