"""In a forked kernel launched through the launcher: a standby for its restart.

Note [A standby for the launcher's restart]: where a frontend runs the warm kernelspec's argv
itself (VS Code, jupyter_client's ``LocalProvisioner``), no code of ours sees a restart coming:
the frontend asks the kernel to shut down (``shutdown_request`` with ``restart: true``), polls
the launcher's process until it is gone (jupyter_client every 100 ms), and runs the argv again.
The new launcher then asked the zygote for a fork, ~150 ms after the request, and the kernel
spent ~130 ms more on ipykernel's start before its first cell. The old kernel does see the
request. So:

1. A kernel the launcher asked for (``ForkRequest.launcher``) knows its zygote's socket
   (``ForkTask.zygote_socket``). Told to shut down for a restart, it asks the zygote for a
   standby (``{"op": "restart_standby"}``) before it replies, and goes on with its shutdown
   once the zygote acknowledged (1-2 ms; the zygote forks after that).
2. The zygote forks the standby from the old kernel's own launch (command, env, cwd, process
   attributes), with ``/dev/null`` and two memory files in place of stdio and one end of a
   socket pair; it checks its preloaded files while the standby starts (Note [Checked while the
   old kernel exits]). The standby becomes the kernel and runs ipykernel up to
   ``IPKernelApp.init_sockets``, as the provisioner's standby does (Note [A standby for the
   restart]): nothing of the user's has run by then.
3. The new launcher's fork request claims it when it equals the launch the standby was forked
   for, the launcher's own ``JPY_PARENT_PID`` aside (``_zygote/restart.py``). The zygote sends
   the standby the launcher's stdin, stdout, stderr and a pidfd of the launcher; the standby
   checks that the connection file still says what ipykernel read from it (ports, key,
   address: a file rewritten before the standby read it is what it listens on, and one that
   was missing then leaves its ports unset, which no file matches), writes what it printed so
   far to the new stdout and stderr, puts the new descriptors in place, sets
   ``JPY_PARENT_PID``, starts the parent watch, binds its ports (Note [Ports bound at the
   fork]) and answers. The launcher gets the standby's pid and pidfd as
   it would a fork's, and its exit report on the same connection.
4. A standby nobody claims within ``claim_seconds()`` (30 s, or
   ``$OVERMIND_LAB_RESTART_STANDBY_SECONDS`` in the zygote's environment), one whose zygote
   went away, or one whose check failed exits unstarted (``os._exit(0)``: no ``atexit``, no
   learned modules); the zygote then forks the launch as before.

What a user can observe: a restarted kernel parsed its command line and read its config files
while the old kernel shut down, tens of milliseconds before its launcher started; its process
start time is then.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from overmind_lab._common.protocol import Channel
from overmind_lab._common.sizes import env_seconds
from overmind_lab._common.zygote_client import ask, timeline
from overmind_lab._common.zygote_identity import RESTART_STANDBY_ENV
from overmind_lab._errors import OvermindError
from overmind_lab._forked import ports

__all__ = ["claim_seconds", "ask_on_restart", "hold_at_sockets", "standby_until_claimed"]

#: How long a restart's standby waits for the new launcher's claim, by default, and the variable
#: of the zygote's environment that says otherwise.
CLAIM_SECONDS = 30.0
#: How long a claimed standby may still take to reach its sockets before it refuses.
_READY_SECONDS = 10.0
#: The old kernel's wait for the zygote's acknowledgement.
_ASK_SECONDS = 1.0
#: The connection file's entries ipykernel read, and the app's attributes that hold them.
_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def claim_seconds() -> float:
    """How long a restart's standby waits for its claim (read in the zygote)."""
    return env_seconds(RESTART_STANDBY_ENV, CLAIM_SECONDS)


def ask_on_restart(zygote_socket: str, env: dict[str, str]) -> None:
    """Wrap ``IPythonKernel.do_shutdown``: a shutdown for a restart asks the zygote on
    ``zygote_socket`` for a standby first (step 1)."""
    from pathlib import Path

    kernel_cls: Any = sys.modules["ipykernel.ipkernel"].IPythonKernel
    original = kernel_cls.do_shutdown

    def do_shutdown(self: Any, restart: bool) -> Any:
        if restart:
            timeline("child.asks_standby", env)
            with contextlib.suppress(OvermindError, OSError, ValueError):
                ask(Path(zygote_socket), {"op": "restart_standby"}, timeout=_ASK_SECONDS)
        return original(self, restart)

    kernel_cls.do_shutdown = do_shutdown


def _connection_changed(app: Any, args: list[str]) -> str | None:
    """Why the connection file no longer says what ``app`` read from it, or ``None``."""
    path = ports.connection_file(args)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        return f"its connection file cannot be read again ({exc})"
    if not isinstance(info, dict):
        return "its connection file is not a JSON object"
    # as jupyter_client's ``load_connection_info`` set them
    expected: dict[str, Any] = {name: getattr(app, name) for name in _PORTS}
    expected["transport"] = app.transport
    expected["ip"] = app.ip
    expected["key"] = bytes(app.session.key).decode(errors="replace")
    expected["signature_scheme"] = app.session.signature_scheme
    for name, value in expected.items():
        if name in info and info[name] != value:
            return f"its connection file's {name} changed"
    return None


def _take_over(claim: dict[str, Any], fds: list[int], watch_parent: Callable[[int], None]) -> None:
    """Step 3: the launcher's stdio in place of the placeholders (what they hold written to it
    first), its pid as ``JPY_PARENT_PID``, its pidfd watched."""
    for target, fd in enumerate(fds[:3]):
        if target:
            held = os.pread(target, os.fstat(target).st_size, 0)
            with contextlib.suppress(OSError):
                while held:
                    held = held[os.write(fd, held):]
        os.dup2(fd, target)
        os.close(fd)
    parent = claim.get("parent_pid")
    if isinstance(parent, str) and parent:
        os.environ["JPY_PARENT_PID"] = parent
    if len(fds) > 3 and os.environ.get("JPY_PARENT_PID"):
        watch_parent(fds[3])
    elif len(fds) > 3:
        os.close(fds[3])


def hold_at_sockets(wait: Callable[[Callable[[float], Any]], bool], env: dict[str, str]) -> None:
    """A standby's hold (both: Note [A standby for the restart] and this Note): ipykernel runs
    up to ``IPKernelApp.init_sockets`` and waits there for ``wait``, which runs from now on in a
    short-lived thread, handed a function that returns the app once it reached its sockets
    (``None`` if not within the seconds given). ``wait`` returned true: ipykernel goes on (it
    binds its ports as soon as it knows it goes: Note [Ports bound at the fork]); false, or
    raised: the child exits unstarted and quietly, as nothing of the user's has run."""
    app_cls: Any = sys.modules["ipykernel.kernelapp"].IPKernelApp
    original = app_cls.__dict__["init_sockets"]
    apps: list[Any] = []
    at_sockets = threading.Event()
    went: list[bool] = []

    def app_at_sockets(seconds: float) -> Any:
        return apps[0] if at_sockets.wait(seconds) else None

    def run() -> None:
        try:
            went.append(bool(wait(app_at_sockets)))
        except Exception:  # noqa: BLE001 - a standby that cannot go exits unstarted
            went.append(False)

    waiter = threading.Thread(target=run, name="overmind-lab-standby", daemon=True)
    waiter.start()

    def init_sockets(self: Any) -> None:
        app_cls.init_sockets = original  # the class as ipykernel made it, from here on
        apps.append(self)
        at_sockets.set()
        timeline("child.standby", env)
        waiter.join()  # gone before ipykernel starts a thread of its own
        if not all(went):
            os._exit(0)
        original(self)

    app_cls.init_sockets = init_sockets


def standby_until_claimed(claim_fd: int, args: list[str], env: dict[str, str], wait: float,
                          watch_parent: Callable[[int], None]) -> None:
    """Steps 2-4 in the standby: it holds at its sockets (:func:`hold_at_sockets`) until a
    launcher claims it on ``claim_fd`` (then it takes the launch over and binds its ports), or
    exits unstarted."""
    sock = socket.socket(fileno=claim_fd)

    def wait_for_claim(app_at_sockets: Callable[[float], Any]) -> bool:
        chan = Channel(sock, wait)
        fds: list[int] = []
        try:
            frame, fds = chan.recv()
            timeline("child.claim", env)
            app = app_at_sockets(_READY_SECONDS)
            if app is None:
                why: str | None = "the standby did not reach its sockets in time"
            elif len(fds) < 3:
                why = "the claim carried no stdio"
            else:
                why = _connection_changed(app, args)
            if why is not None:
                chan.send({"ok": False, "reason": why})
                return False
            _take_over(dict(frame), fds, watch_parent)
            fds = []
            bound = ports.bind_kernel_ports(args)
            chan.send({"ok": True})
            timeline("child.claimed", ports=bound)
            return True
        except (OvermindError, OSError):
            return False  # no claim in time, or the zygote went away: exit unstarted
        finally:
            for fd in fds:
                os.close(fd)
            sock.close()

    hold_at_sockets(wait_for_claim, env)
