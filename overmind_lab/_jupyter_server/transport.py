"""The server's side of kernel messages, tuned when the extension loads: every kernel's websocket
sends without Nagle's delay, and the server's ZMQ sockets find a restarted kernel within
milliseconds.

Note [Kernel messages without delays]: two waits that are not work sat in every restart (and
the first in every cell) through jupyter_server, plain kernels and warm alike:

- **Nagle.** jupyter_server never sets ``TCP_NODELAY`` on a kernel's websocket. A reply sent
  while the frame before it (a ``status: busy``) is still unacknowledged waits for the client's
  delayed ACK: 40 ms on Linux, also on loopback. A trivial cell took 48 ms from request to
  reply, a ``kernel_info`` after a restart as long; with ``set_nodelay(True)`` 7 ms. The
  websocket connection class is wrapped (only jupyter_server's own ZMQ one or a subclass; a
  configured class of another kind is left alone) so that ``connect``, run in the handler's
  ``open``, sets it first.
- **Reconnect timers.** A restart keeps the kernel's ports (consoles attached through the
  connection file stay attached), so the server's sockets that were connected to the old kernel
  (a websocket's channels kept while JupyterLab reconnects, the activity watcher's) are reused.
  They lost their peer at the old kernel's exit and retry on libzmq's timer, ``reconnect_ivl``
  (100 ms) plus a random jitter of up to as much again: the nudge of the reconnected websocket
  waited for its iopub channel until 100-200 ms after the old kernel's exit, though the new
  kernel listened on its ports 20 ms after it (Note [Ports bound at the fork]). The server's
  ZMQ context now gives the sockets it makes from then on ``reconnect_ivl`` 5 ms doubling up to
  ``reconnect_ivl_max`` 20 ms (plus libzmq's jitter, below the 5 ms base): a restarted kernel is
  found within 20 ms of its bind however long the old one took to exit (a plain kernel's exit
  left ~45 ms before the standby bound; at a 50 ms maximum the retry came 31 ms after the bind),
  and a socket whose kernel is gone for good retries every 20-25 ms instead of every 100-200 ms
  (a refused connect to a local port costs microseconds).

Measured through a real server (``benchmarks/_warm_kernel.py``'s hooks, 5 warm restarts,
trivial cell): restart request -> first ``kernel_info_reply`` 224 ms before, 151 ms with the
timers, 111 ms with both; the cell after it 48 -> 7 ms. Both apply to the whole server, plain
kernels included. More in docs/notes.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECONNECT_IVL_MAX_MS", "RECONNECT_IVL_MS", "tune_kernel_transport"]

#: Note [Kernel messages without delays]: the first retry of a socket that lost its kernel, in
#: ms, and the longest interval the doubling reaches (libzmq's ``ZMQ_RECONNECT_IVL(_MAX)``).
RECONNECT_IVL_MS = 5
RECONNECT_IVL_MAX_MS = 20

_SETTING = "kernel_websocket_connection_class"


def tune_kernel_transport(serverapp: Any) -> list[str]:
    """Note [Kernel messages without delays] for ``serverapp``; what was changed, in words."""
    done: list[str] = []
    if _no_delay_websockets(serverapp.web_app.settings):
        done.append("kernel websockets without Nagle's delay")
    if _fast_reconnects(getattr(serverapp, "kernel_manager", None)):
        done.append(f"ZMQ reconnect after {RECONNECT_IVL_MS}-{RECONNECT_IVL_MAX_MS} ms")
    return done


def _no_delay_websockets(settings: dict[str, Any]) -> bool:
    from jupyter_server.services.kernels.connection.channels import (
        ZMQChannelsWebsocketConnection,
    )

    base = settings.get(_SETTING)
    if not (isinstance(base, type) and issubclass(base, ZMQChannelsWebsocketConnection)):
        return False  # a gateway's, or another kind configured by the user: theirs
    if getattr(base, "_overmind_lab_no_delay", False):
        return True

    class NoDelayConnection(base):  # type: ignore[misc, valid-type]
        _overmind_lab_no_delay = True

        def connect(self) -> Any:
            handler = self.websocket_handler
            if getattr(handler, "ws_connection", None) is not None:
                handler.set_nodelay(True)
            return super().connect()

    NoDelayConnection.__name__ = NoDelayConnection.__qualname__ = base.__name__
    NoDelayConnection.__module__ = __name__
    settings[_SETTING] = NoDelayConnection
    return True


def _fast_reconnects(kernel_manager: Any) -> bool:
    import zmq

    context = getattr(kernel_manager, "context", None)
    if not isinstance(context, zmq.Context) or context.closed:
        return False  # a gateway's kernels, or none with ZMQ here
    context.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    context.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    return True
