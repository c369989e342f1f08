"""``Store.finish`` seals a segment file (crc, trailer, rename) only with the bytes that were
stored: Note [A write just before the trailer]. A real ``Store`` on a real cache folder, no
daemon: the foreign write is planted at the exact moment the window opens."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from overmind_lab._common.saved import Corrupt, check_segment_file, identity, trailer
from overmind_lab._daemon import store as store_module
from overmind_lab._daemon.store import Segment, Store

DATA = os.urandom(300_000)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "cache")
    assert opened.persistent, opened.reason
    yield opened
    opened.close()


def _stored(store: Store, sid: str = "a1", link: Path | None = None) -> Segment:
    """A segment written and committed (its stamp taken); ``link``: a hard link to its file,
    made before the stamp (a link moves the ctime)."""
    seg, rw = store.create(sid, len(DATA))
    try:
        os.pwrite(rw, DATA, 0)
        if link is not None:
            os.link(Path(str(store.dir), f"{sid}.tmp"), link)
    finally:
        os.close(rw)
    store.commit(seg)
    return seg


def _flip_then(real: Callable[[int, int], bytes], path: Path) -> Callable[[int, int], bytes]:
    """``trailer``, run by ``finish`` after it compared the stamp and before its ``pwrite``:
    the owner flips one byte first."""
    def flipping(size: int, crc: int) -> bytes:
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, 1000)[0] ^ 0x10]), 1000)
        finally:
            os.close(fd)
        return real(size, crc)
    return flipping


def test_an_untouched_segment_is_sealed_with_its_crc(store: Store, tmp_path: Path) -> None:
    seg = _stored(store)
    store.finish(seg)
    assert seg.persisted and seg.crc == zlib.crc32(DATA) and seg.check() is None
    path = tmp_path / "cache" / "a1.seg"
    fd = os.open(path, os.O_RDONLY)
    try:
        check_segment_file(fd, len(DATA), zlib.crc32(DATA), path)
    finally:
        os.close(fd)
    store.discard(seg)


def test_a_write_just_before_the_trailer_is_not_sealed(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old ``finish`` sealed it: the trailer's write hid the flip's time, the final stamp
    included it, and a hit compared equal stamps and served the flipped byte."""
    seg = _stored(store)
    monkeypatch.setattr(store_module, "trailer",
                        _flip_then(trailer, tmp_path / "cache" / "a1.tmp"))
    with pytest.raises(Corrupt, match="was written after it was stored"):
        store.finish(seg)
    assert not seg.persisted
    store.discard(seg)
    assert not list((tmp_path / "cache").glob("a1.*"))



class _FlipBeforeCall:
    """``os`` for ``store``, but the owner flips a byte of ``path`` just before the ``at``-th
    call ``finish`` makes of it (``fstat``, ``pwrite``, ``fsync``, ``fchmod``, ``rename``,
    ``close``): every point between two of its steps, in turn."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at, self.calls = path, at, 0

    def __getattr__(self, name: str) -> object:
        real = getattr(os, name)
        if name not in ("fstat", "pwrite", "fsync", "fchmod", "rename", "close"):
            return real

        def call(*args: object, **kwargs: object) -> object:
            if self.calls == self.at:
                fd = os.open(self.path, os.O_RDWR)  # the .seg name once renamed: by its inode
                try:
                    os.pwrite(fd, bytes([os.pread(fd, 1, 1000)[0] ^ 0x10]), 1000)
                finally:
                    os.close(fd)
            self.calls += 1
            return real(*args, **kwargs)
        return call


def test_a_write_between_any_two_steps_is_never_sealed_behind_a_matching_stamp(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever step of ``finish`` a write lands before, ``finish`` refuses the segment, or
    the crc it sealed is of the bytes there, or the stamp it took no longer matches the file
    (a hit then reads the checksum: Note [Checks before a hit]). The old ``finish`` sealed a
    write before its trailer's ``pwrite``."""
    outcomes = []
    for at in range(12):
        link = tmp_path / f"r{at}.link"  # the flip reaches the inode whatever its name is
        seg = _stored(store, f"r{at}", link)
        flipper = _FlipBeforeCall(link, at)
        monkeypatch.setattr(store_module, "os", flipper)
        try:
            store.finish(seg)
            outcome = "sealed"
        except Corrupt:
            outcome = "refused"
        finally:
            monkeypatch.setattr(store_module, "os", os)
        if outcome == "sealed":
            if identity(os.fstat(seg.fd)) != seg.stamp:
                outcome = "stamp moved"
            else:
                data = os.pread(seg.fd, len(DATA), 0)
                assert zlib.crc32(data) == seg.crc, f"flipped before call {at}: sealed"
        outcomes.append(outcome if flipper.calls > at else "no flip")
        store.discard(seg)
        link.unlink()
    assert outcomes[0] == "refused" and outcomes[-1] == "no flip", outcomes
