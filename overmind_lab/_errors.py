"""Exceptions raised by overmind-lab.

::

    OvermindError                 base class: catch this to catch everything below
    ├── DaemonUnavailable         no daemon answers on the socket and none could be started
    ├── ProtocolError             the daemon answered something this client cannot read
    ├── UnknownEntry              no cache entry has that key (or key prefix)
    └── NotCacheable              a call or its result cannot be cached (the caller falls
                                  back to an uncached load; users normally see a warning)

Warnings: ``OvermindWarning`` (the cache stepped aside, the load went on) and its
subclass ``VerifyMismatch`` (verify mode found a warm hit that differs from a plain load).

Errors from the operating system (``OSError``, ``socket.timeout``) are translated at the
boundary into these, with ``raise ... from exc`` so the cause stays visible.
"""

from __future__ import annotations

__all__ = [
    "OvermindError",
    "DaemonUnavailable",
    "ProtocolError",
    "UnknownEntry",
    "NotCacheable",
    "OvermindWarning",
    "VerifyMismatch",
]


class OvermindError(Exception):
    """Base class of every error raised by overmind-lab."""


class DaemonUnavailable(OvermindError):
    """The per-user daemon cannot be reached (and could not be started)."""


class ProtocolError(OvermindError):
    """The daemon sent or refused a message this client cannot handle."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        #: the daemon's reason code, e.g. ``"too_large"`` or ``"stale_reference"``
        self.kind = kind


class UnknownEntry(OvermindError, KeyError):
    """No cache entry matches the key or key prefix."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown entry"


class NotCacheable(OvermindError):
    """A call or its result cannot be cached; the load runs uncached instead."""


class OvermindWarning(UserWarning):
    """Warnings from overmind-lab: the cache stepped aside, the load went on."""


class VerifyMismatch(OvermindWarning):
    """Verify mode found a warm hit that differs from a plain load.

    The message names the first difference; the plain result was returned and the entry
    dropped.
    """
