"""The daemon's Index in-process: LRU order, budget, reference counts, protected entries.

Plain objects and real file descriptors (memfds); no daemon, no mocks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from overmind_lab._daemon.index import Entry, Index, Segment, TooLarge
from tests.conftest import is_open


def segment(sid: str, size: int) -> Segment:
    fd = os.memfd_create(f"olt-index-{sid}", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return Segment(id=sid, fd=fd, size=size, tier="memfd")


def entry(key: str, own: list[str], shared: list[str] | None = None) -> Entry:
    return Entry(key=key, name=f"name-{key}", cls="C", callable="m:f", source=None, own=own,
                 shared=shared or [], meta={}, tensors=0, cold_seconds=1.0, store_seconds=0.1)


def release(seg: Segment) -> None:
    """What the daemon's store does when the index lets go of a segment (closes its fd)."""
    os.close(seg.fd)


@pytest.fixture
def index() -> Iterator[Index]:
    idx = Index(budget=1000, on_drop=release)
    yield idx
    idx.close(release)  # every segment still held


def put(idx: Index, key: str, size: int) -> Segment:
    seg = segment(f"s-{key}", size)
    idx.reserve(key, size, set())
    idx.add(entry(key, [seg.id]), [seg])
    idx.unreserve(key)
    return seg


def test_eviction_takes_the_least_recently_used_first(index: Index) -> None:
    put(index, "a", 300)
    put(index, "b", 300)
    put(index, "c", 300)
    index.touch("a")  # order now b, c, a
    assert list(index.entries) == ["b", "c", "a"]
    assert index.reserve("d", 300, set()) == ["b"]
    assert index.reserve("e", 300, set()) == ["c"]  # d's reservation counts
    assert list(index.entries) == ["a"]


def test_touch_counts_hits_only_when_asked(index: Index) -> None:
    put(index, "a", 10)
    index.touch("a")
    index.touch("a", hit=False)
    assert index.entries["a"].hits == 1


def test_the_budget_is_never_exceeded(index: Index) -> None:
    with pytest.raises(TooLarge, match="exceed the whole budget"):
        index.reserve("huge", 1001, set())
    put(index, "a", 600)
    evicted = index.reserve("b", 600, set())
    assert evicted == ["a"] and index.cached_bytes == 0
    assert index.evicted == {"s-a": 600}


def test_a_shared_segment_lives_until_its_last_entry_goes(index: Index) -> None:
    base = put(index, "vae", 100)
    own = segment("s-pipe", 50)
    index.add(entry("pipe", [own.id], shared=[base.id]), [own])
    assert index.segments[base.id].refs == 2
    assert index.entry_bytes(index.entries["pipe"]) == (50, 100)
    index.evict("vae")
    assert base.id in index.segments and is_open(base.fd)  # pipe still uses it
    assert index.segments[base.id].refs == 1
    index.evict("pipe")
    assert index.segments == {} and not is_open(base.fd) and not is_open(own.fd)
    assert index.evicted == {"s-pipe": 50, "s-vae": 100}


def test_replacing_an_entry_keeps_the_segments_it_still_uses(index: Index) -> None:
    seg = put(index, "a", 100)
    index.add(entry("a", [seg.id]), [])  # same key, same segment: refs go 1 -> 2 -> 1
    assert index.segments[seg.id].refs == 1 and is_open(seg.fd)


def test_protected_entries_are_not_evicted(index: Index) -> None:
    put(index, "vae", 500)
    put(index, "other", 300)
    evicted = index.reserve("pipe", 400, protect={"vae"})
    assert evicted == ["other"] and "vae" in index.entries
    with pytest.raises(TooLarge, match="held by entries this one depends on"):
        index.reserve("more", 600, protect={"vae"})
    assert "vae" in index.entries


def test_resolve_by_key_prefix_or_name(index: Index) -> None:
    put(index, "abc1", 10)
    put(index, "abd2", 10)
    assert index.resolve("abc1") == ["abc1"]
    assert index.resolve("ab") == ["abc1", "abd2"]  # ambiguous: the caller decides
    assert index.resolve("abd") == ["abd2"]
    assert index.resolve("name-abc1") == ["abc1"]
    assert index.resolve("zz") == []


def test_the_warm_time_is_the_median_of_the_recent_warm_loads() -> None:
    e = entry("a", [])
    assert e.warm_median is None  # no warm load yet
    e.warm_seconds.extend([0.3, 0.1, 0.2])
    assert e.warm_median == 0.2
    e.warm_seconds.append(9.0)  # one slow load moves the median little, unlike the last
    assert e.warm_median == pytest.approx(0.25)
