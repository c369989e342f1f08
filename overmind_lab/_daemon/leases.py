"""Single flight: while one connection cold-loads a key, the others that ask for it wait.

Note [Single flight and takeover]: a ``lookup`` that finds no entry takes the key's lease
(``Leases.acquire``) and is answered ``lease``: that process loads the result and stores
it. A ``lookup`` of the same key meanwhile gets the lease another connection holds; it is
answered ``wait``, then waits for that lease to be released (``Lease.released``), sending a
``wait`` keep-alive every few seconds, and then looks again from the start. Three things
release a lease, each through ``Leases.release`` (which first runs the daemon's clean-up
of what the key had reserved, then wakes the waiters):

- ``store``: the entry is added to the index *before* the lease is released, so a waiter
  that wakes always finds it and gets a hit. There is no moment with neither a lease nor
  an entry, in which a second process would start a second cold load.
- ``abandon`` (the result cannot be cached): the waiters wake and find no entry.
- the holder's connection ends (the process died, or its load raised): the connection's
  ``finally`` calls ``release_all``. This is the takeover: the holder's reservation and
  half-written segment are discarded (so they count against no budget and leave no file),
  then the waiters wake, and the first of them to run takes a new lease and loads the key
  itself; the others find that lease and wait again.

No lock is needed: the daemon runs on one asyncio loop, and there is no ``await`` between
looking at the index, looking at the leases and taking a lease, so no other request runs
in between. An event is set once, when its lease goes; a waiter therefore always looks
again after waking, whatever woke it. A lease has no timeout of its own: a cold load may
take many minutes, and the holder's connection, which has no idle timeout while it holds
a lease, is the sign of life (a process that dies closes it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Lease", "Leases"]


class Lease:
    """The right to load one key, held by one connection (``owner``)."""

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self._released = asyncio.Event()

    async def released(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lease to go; ``True`` if it went."""
        try:
            await asyncio.wait_for(self._released.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class Leases:
    """The leases of the keys being loaded now (``Note [Single flight and takeover]``).

    ``on_release(key)`` runs when a lease goes, before the waiters wake: the daemon
    discards what the key had reserved but not stored.
    """

    def __init__(self, on_release: Callable[[str], None] | None = None) -> None:
        self._leases: dict[str, Lease] = {}
        self._on_release = on_release

    def acquire(self, key: str, owner: object) -> Lease | None:
        """Take the lease on ``key`` for ``owner``: ``None`` when ``owner`` now holds it
        (it loads the key); else the lease another connection holds (wait for it)."""
        busy = self._leases.get(key)
        if busy is not None:
            return busy
        self._leases[key] = Lease(owner)
        return None

    def holds(self, owner: object, key: str) -> bool:
        lease = self._leases.get(key)
        return lease is not None and lease.owner is owner

    def held_by(self, owner: object) -> list[str]:
        """The keys ``owner`` holds the leases of."""
        return [k for k, lease in self._leases.items() if lease.owner is owner]

    def release(self, key: str) -> None:
        """Let go of ``key``'s lease (if any) and of what it reserved; wake its waiters."""
        lease = self._leases.pop(key, None)
        if self._on_release is not None:
            self._on_release(key)
        if lease is not None:
            lease._released.set()

    def release_all(self, owner: object) -> None:
        """The connection ``owner`` ended: release its leases, so a waiter takes over."""
        for key in self.held_by(owner):
            self.release(key)
