"""Exceptions raised by overmind-lab (base: ``OvermindError``) and its warnings
(``OvermindWarning``, ``VerifyMismatch``). OS errors are translated at the boundary."""

from __future__ import annotations

import enum

__all__ = [
    "ErrorKind",
    "OvermindError",
    "DaemonUnavailable",
    "NotAnswering",
    "ProtocolError",
    "UnknownEntry",
    "NotCacheable",
    "OvermindWarning",
    "VerifyMismatch",
]


class ErrorKind(str, enum.Enum):
    """Why the daemon refused a request: the ``kind`` of an ``{"ok": false}`` reply (members compare
    equal to their wire strings)."""
    PERMISSION = "permission"  # another uid's client (SO_PEERCRED)
    BAD_REQUEST = "bad_request"  # malformed request, unknown op, bad segment
    UNSUPPORTED = "unsupported"  # this daemon cannot do that (e.g. refresh)
    UNKNOWN_ENTRY = "unknown_entry"  # no entry matches the key, prefix or name
    NO_LEASE = "no_lease"  # reserve/store without the lease from lookup
    STALE_REFERENCE = "stale_reference"  # a referenced segment was evicted meanwhile
    TOO_LARGE = "too_large"  # the entry does not fit the budget
    STORE_FAILED = "store_failed"  # the daemon could not create a segment (disk, fds)

    @classmethod
    def decode(cls, value: object) -> ErrorKind | None:
        """The member for a wire string; ``None`` for one this client does not know."""
        try:
            return cls(value)
        except ValueError:
            return None


class OvermindError(Exception):
    """Base class of every error raised by overmind-lab."""


class DaemonUnavailable(OvermindError):
    """The per-user daemon cannot be reached (and could not be started)."""


class NotAnswering(DaemonUnavailable):
    """The daemon accepts connections but does not reply (stopped, stuck): the load goes plain."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        #: the silent daemon's pid, where known
        self.pid = pid


class ProtocolError(OvermindError):
    """The daemon sent or refused a message this client cannot handle."""

    def __init__(self, message: str, kind: ErrorKind | str = "") -> None:
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
    """Verify mode found a warm hit that differs from a plain load: the message names the first
    difference; the plain result was returned and the entry dropped."""
