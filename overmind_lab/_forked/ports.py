"""In a forked ipykernel child: its TCP ports are listening from the fork on.

Note [Ports bound at the fork]: on a restart the server's sockets (each client's channels, the
nudge's, the activity watcher's) lose the old kernel and retry every ``reconnect_ivl`` plus a
random jitter (libzmq: 100-200 ms). A kernel that binds its ports only once ipykernel has set up
(~100 ms after the fork) is found by those retries up to 200 ms later, and its first iopub
messages can go to nobody (jupyter_server's nudge then retries after 0.5 s). The child binds and
listens on the connection file's shell, iopub, stdin and control ports right after the fork and
hands each descriptor to the ipykernel socket that binds that port (``ZMQ_USE_FD``): a client
that connects before ipykernel is ready waits in the listen backlog and the ZMTP handshake
completes as soon as ipykernel binds, with no retry. The kernel binds the same addresses as a
plain one; only when they start to accept changes. Nothing is pre-bound unless the transport is
TCP and the address a literal IP; a port that cannot be bound is left to ipykernel (which then
fails as a plain kernel would). More in docs/notes.md.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
from typing import Any

__all__ = ["bind_kernel_ports", "connection_file"]

#: The connection file's ports that clients connect to with a ZMQ socket (hb is ipykernel's own
#: thread's socket: left alone).
_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port")
#: libzmq's default listen backlog (``ZMQ_BACKLOG``).
_BACKLOG = 100

#: Port -> a listening descriptor not yet handed to ipykernel.
_bound: dict[int, socket.socket] = {}


def connection_file(args: list[str]) -> str | None:
    """The ``-f``/``--f`` argument of an ipykernel command line."""
    for i, arg in enumerate(args):
        if arg in ("-f", "--f") and i + 1 < len(args):
            return args[i + 1]
        for prefix in ("-f=", "--f="):
            if arg.startswith(prefix):
                return arg[len(prefix):]
    return None


def bind_kernel_ports(args: list[str]) -> list[int]:
    """Listen on the kernel's ports now and have ipykernel use these descriptors; the ports
    bound. Does nothing (returns ``[]``) where Note [Ports bound at the fork] does not apply."""
    path = connection_file(args)
    kernelapp = sys.modules.get("ipykernel.kernelapp")
    if path is None or kernelapp is None:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        if info.get("transport", "tcp") != "tcp":
            return []
        ip = ipaddress.ip_address(info.get("ip", "127.0.0.1"))
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    for name in _PORTS:
        port = info.get(name)
        if not isinstance(port, int) or port <= 0:
            continue
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq does
            sock.bind((str(ip), port))
            sock.listen(_BACKLOG)
        except OSError:
            sock.close()
            continue
        _bound[port] = sock
    if _bound:
        _hand_over(kernelapp.IPKernelApp)
    return sorted(_bound)


def _hand_over(app_cls: Any) -> None:
    """Wrap ``IPKernelApp._try_bind_socket``: a port bound above is bound with its descriptor."""
    import zmq

    original = app_cls._try_bind_socket

    def _try_bind_socket(self: Any, s: Any, port: int) -> int:
        sock = _bound.pop(port, None) if self.transport == "tcp" else None
        if sock is not None:
            # libzmq takes the descriptor over (it closes it with the ZMQ socket); the Python
            # object lets go of it without closing it.
            s.setsockopt(zmq.USE_FD, sock.detach())
        return int(original(self, s, port))

    app_cls._try_bind_socket = _try_bind_socket
