"""The daemon's index: entries, the segments they own or share, LRU and the budget.

An entry is a key, an opaque ``meta`` the client rebuilds the result from, its segment ids and
statistics; segments are reference counted (an entry may reference another's) and dropped
(``on_drop``) when no entry uses them.

Note [What an entry costs]: the budget governs what the cache adds: one number per segment,
``footprint``: a file with padding and trailer, a memfd's bytes, the copy of a held source file
(Note [A copy to serve] in ``store``). It is what ``cached_bytes`` and ``ls``'s ``bytes`` add up,
so ``cached_bytes`` is the sum of ``bytes`` and never above the budget. A held source file is
the user's own file: holding it costs the cache one descriptor (Note [Descriptor budget]) and
no memory or disk of its own, so it is counted apart (``held_bytes``, shown as "held: ... of
your own files") and never refused for its size: a 70B model in its stored dtype is served
warm under a 4 GiB budget. More in docs/notes.md.

Note [Descriptor budget]: every segment holds one descriptor in the daemon, so their number
is bounded too (``max_segments``: ``RLIMIT_NOFILE`` less a reserve) and evicted LRU like bytes;
else ``accept`` fails with EMFILE. More in docs/notes.md.

Note [Eviction and mappings]: closing the fd or deleting the file never breaks a process that
maps the segment; such segments stay in ``evicted`` for ``status``. More in docs/notes.md.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from overmind_lab._common.lookup import match_keys
from overmind_lab._common.messages import JsonObject, RefreshState, ReplaySpec
from overmind_lab._daemon.store import Segment, footprint, held_size

__all__ = ["Segment", "Entry", "Index", "TooLarge", "WARM_HISTORY"]

WARM_HISTORY = 20


class TooLarge(Exception):
    """An entry does not fit the budget even after evicting everything evictable."""


_IDLE: RefreshState = {"state": "idle", "message": "", "started": None}


@dataclass
class Entry:
    key: str
    name: str
    cls: str
    callable: str
    source: str | None
    own: list[str]
    shared: list[str]
    meta: JsonObject  # the client's, never looked into
    tensors: int
    cold_seconds: float
    store_seconds: float
    call: ReplaySpec | None = None
    #: what a restarted daemon checks: the source signature, library versions, python
    validate: JsonObject | None = None
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    hits: int = 0
    verified: int = 0  # hits that verify mode found equal to a plain load
    warm_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=WARM_HISTORY))
    refresh: RefreshState = field(default_factory=lambda: _IDLE.copy())
    #: the segments in the client's ``meta`` order, when that is not ``own + shared``
    order: list[str] | None = None

    @property
    def segments(self) -> list[str]:
        return self.order if self.order is not None else self.own + self.shared

    @property
    def warm_median(self) -> float | None:
        """The median of the recent warm loads (``None`` before the first): the one warm
        time every view shows, and the speed-up is ``cold_seconds`` over it."""
        if not self.warm_seconds:
            return None
        import statistics  # 3 ms of a daemon's start where nothing asks for it

        return statistics.median(self.warm_seconds)


class Index:
    def __init__(self, budget: int,
                 on_drop: Callable[[Segment], None] | None = None,
                 max_segments: int | None = None) -> None:
        self.budget = budget
        self.max_segments = max_segments  # Note [Descriptor budget]; None: no bound
        self.on_drop = on_drop
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.segments: dict[str, Segment] = {}
        self.evicted: dict[str, int] = {}
        self.reserved: dict[str, int] = {}

    @property
    def cached_bytes(self) -> int:
        return sum(footprint(s) for s in self.segments.values())

    @property
    def held_bytes(self) -> int:
        """The user's own files held open (Note [What an entry costs]): not in the budget."""
        return sum(held_size(s) for s in self.segments.values())

    def entry_held(self, entry: Entry) -> int:
        """The bytes of the user's files that ``entry`` holds as its own segments."""
        return sum(held_size(self.segments[s]) for s in entry.own if s in self.segments)

    def entry_bytes(self, entry: Entry) -> tuple[int, int]:
        own = sum(footprint(self.segments[s]) for s in entry.own if s in self.segments)
        shared = sum(footprint(self.segments[s]) for s in entry.shared
                     if s in self.segments)
        return own, shared

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def touch(self, key: str, *, hit: bool = True) -> None:
        entry = self.entries[key]
        entry.last_used = time.time()
        entry.hits += hit
        self.entries.move_to_end(key)

    def resolve(self, key_or_prefix: str) -> list[str]:
        """Keys matching exactly, else by prefix, else by exact display name."""
        return match_keys(key_or_prefix, ((k, e.name) for k, e in self.entries.items()))

    def reserve(self, token: str, nbytes: int, protect: set[str],
                segments: int = 1) -> list[str]:
        """Make room for ``nbytes`` in ``segments`` new segments (evicting LRU entries not
        in ``protect``: Note [Descriptor budget] bounds the count)."""
        if nbytes > self.budget:
            raise TooLarge(
                f"{nbytes} bytes exceed the whole budget of {self.budget} bytes"
            )
        evicted: list[str] = []
        while self._used() + nbytes > self.budget or self._over_count(segments):
            victim = next((k for k in self.entries if k not in protect), None)
            if victim is None:
                what = (f"{self._used()} of {self.budget} bytes" if not self._over_count(
                    segments) else f"{len(self.segments)} of {self.max_segments} segments")
                raise TooLarge(f"{nbytes} bytes do not fit: {what} are held by entries "
                               "this one depends on")
            self.evict(victim)
            evicted.append(victim)
        self.reserved[token] = nbytes
        return evicted

    def _over_count(self, new: int) -> bool:
        return (self.max_segments is not None
                and len(self.segments) + len(self.reserved) + new > self.max_segments)

    def evict_oldest(self) -> str | None:
        """Evict the least recently used entry (descriptors ran out); its key, if any."""
        victim = next(iter(self.entries), None)
        if victim is not None:
            self.evict(victim)
        return victim

    def unreserve(self, token: str) -> None:
        self.reserved.pop(token, None)

    def _used(self) -> int:
        return self.cached_bytes + sum(self.reserved.values())

    def add(self, entry: Entry, new_segments: list[Segment]) -> None:
        """Insert ``entry`` (replacing one with the same key) with its new segments."""
        for seg in new_segments:
            self.segments[seg.id] = seg
        for sid in entry.segments:
            self.segments[sid].refs += 1
        if entry.key in self.entries:
            self.evict(entry.key)
        self.entries[entry.key] = entry

    def evict(self, key: str) -> Entry:
        entry = self.entries.pop(key)
        for sid in entry.segments:
            seg = self.segments.get(sid)
            if seg is None:
                continue
            seg.refs -= 1
            if seg.refs <= 0:
                del self.segments[sid]
                if self.on_drop is not None:
                    self.on_drop(seg)
                self.evicted[sid] = seg.size
        return entry

    def close(self, release: Callable[[Segment], None]) -> None:
        """Let go of every segment (``release``: close fds; files stay for the next daemon)."""
        for seg in self.segments.values():
            release(seg)
        self.segments.clear()
        self.entries.clear()
