"""Single flight: while one connection cold-loads a key, the others that ask for it wait.

Note [Single flight and takeover]: a ``lookup`` with no entry takes the key's lease and loads;
others are answered ``wait`` (with keep-alives) until the lease goes, then look again. It goes
on ``store`` (the entry is added *before* the release, so a waiter always finds it), on
``abandon``, or when the holder's connection ends (takeover: its reservation is discarded and
the first waiter takes a new lease). One asyncio loop and no ``await`` between the index
check and ``acquire``: no lock. No timeout: the holder's connection is its sign of life.
More in docs/notes.md.
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
    """The leases of the keys being loaded now; ``on_release(key)`` runs when one goes,
    before the waiters wake (Note [Single flight and takeover])."""

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
