"""The zygote's side of Note [A standby for the launcher's restart] (``_forked/claim.py``): the
standbys it forked for launchers' kernels told to restart, which launch may claim one, the
claim, and letting one go."""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from typing import Any

from overmind_lab._common.messages import ForkRequest
from overmind_lab._common.protocol import Channel
from overmind_lab._errors import OvermindError

__all__ = ["RestartStandby", "differs", "claim", "drop", "CLAIM_REPLY_SECONDS"]

#: How long the zygote waits for a claimed standby's answer (it may still be starting:
#: ``claim._READY_SECONDS`` is its own bound) before it forks the launch itself.
CLAIM_REPLY_SECONDS = 15.0
#: The variable a launcher sets to its own pid: the one part of a launch that always differs.
_PARENT = "JPY_PARENT_PID"


@dataclass
class RestartStandby:
    pid: int
    pidfd: int
    #: the old kernel's launch, which it was forked for
    launch: ForkRequest
    #: the zygote's end of the claim's socket pair
    sock: socket.socket
    #: ``time.monotonic()`` after which it is let go (it exits by itself at its own wait)
    until: float


def _env(request: ForkRequest) -> dict[str, str]:
    env = {str(k): str(v) for k, v in dict(request.get("env", {})).items()}
    if _PARENT in env:
        env[_PARENT] = "present"
    return env


def differs(launch: ForkRequest, request: ForkRequest) -> str | None:
    """Why ``request`` cannot take the standby forked for ``launch``, or ``None``."""
    if [str(a) for a in request.get("argv", [])] != [str(a) for a in launch.get("argv", [])]:
        return "the command differs"
    if str(request.get("cwd") or "") != str(launch.get("cwd") or ""):
        return "the working directory differs"
    if _env(request) != _env(launch):
        return "the environment differs"
    if request.get("inherit") != launch.get("inherit"):
        return "the process attributes differ"
    if bool(request.get("watch_parent")) != bool(launch.get("watch_parent")):
        return "the parent watch differs"
    return None


def claim(standby: RestartStandby, request: ForkRequest, stdio: list[int],
          parent_pidfd: int | None) -> str | None:
    """Hand ``standby`` the launch's stdio (copies are sent; the caller keeps its own) and the
    launcher's pidfd; ``None`` once it took them over, else why not."""
    chan = Channel(standby.sock, CLAIM_REPLY_SECONDS)
    message: dict[str, Any] = {"op": "claim",
                               "parent_pid": dict(request.get("env", {})).get(_PARENT)}
    try:
        chan.send(message, [*stdio, *([] if parent_pidfd is None else [parent_pidfd])])
        reply, fds = chan.recv()
    except (OvermindError, OSError) as exc:
        return f"the standby did not answer its claim ({exc})"
    for fd in fds:
        os.close(fd)
    if reply.get("ok") is True:
        return None
    return str(reply.get("reason") or "the standby refused its claim")


def drop(standby: RestartStandby) -> None:
    """Kill ``standby`` unless it exited, reap it, close what the zygote held of it."""
    try:
        signal.pidfd_send_signal(standby.pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it exited by itself: reaped below
    try:
        os.waitpid(standby.pid, 0)
    except ChildProcessError:
        pass
    os.close(standby.pidfd)
    standby.sock.close()
