"""``Store.finish`` seals a segment file (crc, trailer, rename) only with the bytes that were
stored: Note [A write just before the trailer]. A real ``Store`` on a real cache folder, no
daemon: the foreign write is planted at the exact moment the window opens."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from overmind_lab._common.saved import Corrupt, check_segment_file, trailer
from overmind_lab._daemon import store as store_module
from overmind_lab._daemon.store import Segment, Store

DATA = os.urandom(300_000)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "cache")
    assert opened.persistent, opened.reason
    yield opened
    opened.close()


def _stored(store: Store) -> Segment:
    seg, rw = store.create("a1", len(DATA))
    try:
        os.pwrite(rw, DATA, 0)
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
