"""Tests of the pybind11 module overmind_lab._native (native/native.cpp)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pytest

from overmind_lab import _native

if TYPE_CHECKING:
    from typing_extensions import Buffer

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def pattern(n: int, seed: int = 0) -> bytes:
    """n bytes with period 251 (a prime): a chunk copied to the wrong place shows."""
    period = bytes((i * 7 + seed) % 256 for i in range(251))
    return (period * (n // 251 + 1))[:n]


# --------------------------------------------------------------------------- copy_many


@pytest.mark.parametrize("threads", [0, 1, 2, 3, 8])
def test_copy_many_several_items(threads: int) -> None:
    dst = bytearray(b"\xee" * 4096)
    items: list[tuple[int, Buffer]] = [
        (0, b"abc"),
        (10, bytearray(b"0123456789")),
        (100, memoryview(pattern(1000, 1))),
        (1200, pattern(2000, 2)),
        (4090, b"END!!!"),
        (3300, b""),  # empty: allowed anywhere in bounds
    ]
    _native.copy_many(dst, items, threads=threads)
    expected = bytearray(b"\xee" * 4096)
    for off, src in items:
        expected[off : off + len(memoryview(src))] = bytes(src)
    assert dst == expected


def test_copy_many_accepts_iterables_and_index_ints() -> None:
    class Idx:
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    dst = bytearray(16)
    _native.copy_many(dst, ((Idx(i * 4), bytes([i + 1]) * 4) for i in range(4)))
    assert dst == b"\x01" * 4 + b"\x02" * 4 + b"\x03" * 4 + b"\x04" * 4
    _native.copy_many(dst, [[0, b"zz"]])  # type: ignore[list-item]  # a list pair is a pair too
    assert dst[:2] == b"zz"
    _native.copy_many(dst, [])
    _native.copy_many(bytearray(), [(0, b"")])


@pytest.mark.parametrize("threads", [0, 1, 4, 8])
def test_copy_many_large_multithreaded(threads: int) -> None:
    # One 72 MiB source (split into many chunks over the threads) plus mid-sized items,
    # at unaligned offsets, into an mmap destination.
    big = pattern(72 * MiB + 12345, 3)
    mid = [pattern(3 * MiB + i, 10 + i) for i in range(4)]
    size = 4099 + len(big) + 17 + sum(len(m) + 1 for m in mid)
    with mmap.mmap(-1, size) as dst:
        items = [(4099, big)]
        off = 4099 + len(big) + 17
        for m in mid:
            items.append((off, m))
            off += len(m) + 1
        _native.copy_many(dst, items, threads)
        view = memoryview(dst)
        try:
            assert view[:4099] == b"\0" * 4099
            for off, src in items:
                assert view[off : off + len(src)] == src
            assert view[4099 + len(big) : 4099 + len(big) + 17] == b"\0" * 17
        finally:
            view.release()


def test_copy_many_large_into_numpy_like_memoryview() -> None:
    # A memoryview slice as the destination: offsets are relative to the slice.
    backing = bytearray(70 * MiB)
    dst = memoryview(backing)[MiB:]
    src = pattern(65 * MiB, 5)
    _native.copy_many(dst, [(123, src)], threads=4)
    assert backing[: MiB + 123] == bytes(MiB + 123)
    assert backing[MiB + 123 : MiB + 123 + len(src)] == src


def _longest_stall_during_copy(src: bytes, dst: bytearray) -> tuple[float, float]:
    """Copy src into dst on a thread while this thread loops; return (copy seconds,
    longest time this thread could not run). A copy that held the GIL would stall this
    thread for the whole copy."""
    times: list[float] = []
    done = threading.Event()

    def copier() -> None:
        t0 = time.perf_counter()
        _native.copy_many(dst, [(0, src)], threads=1)
        times.append(time.perf_counter() - t0)
        done.set()

    t = threading.Thread(target=copier)
    longest = 0.0
    last = time.perf_counter()
    t.start()
    while not done.is_set():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
    t.join()
    return times[0], longest


def test_copy_many_releases_the_gil() -> None:
    src = pattern(128 * MiB, 6)
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        results = []
        for _ in range(3):  # a loaded machine may preempt this thread once in a while
            dst = bytearray(len(src))
            copy_s, stall_s = _longest_stall_during_copy(src, dst)
            assert dst == src
            results.append((copy_s, stall_s))
            if copy_s > 0.005 and stall_s < copy_s / 2:
                break
        else:
            pytest.fail(f"(copy seconds, longest stall) = {results}: was the GIL held?")
    finally:
        sys.setswitchinterval(old)


def test_copy_many_bounds_error_message_and_no_partial_copy() -> None:
    dst = bytearray(128)
    items = [(0, b"x" * 10), (20, b"y" * 10), (64, b"z" * 64), (100, b"w" * 64)]
    with pytest.raises(ValueError) as exc:
        _native.copy_many(dst, items)
    assert str(exc.value) == "item 3 does not fit: offset 100 + 64 bytes > destination 128 bytes"
    assert dst == bytearray(128), "nothing may be copied when an item does not fit"

    with pytest.raises(
        ValueError, match=r"^item 0 does not fit: offset 129 \+ 0 bytes > destination 128 bytes$"
    ):
        _native.copy_many(dst, [(129, b"")])
    with pytest.raises(
        ValueError, match=r"^item 1 does not fit: offset 1 \+ 128 bytes > destination 128 bytes$"
    ):
        _native.copy_many(dst, [(0, b""), (1, bytes(128))])
    with pytest.raises(ValueError, match=r"^item 0 does not fit: offset is too large$"):
        _native.copy_many(dst, [(1 << 70, b"a")])
    with pytest.raises(ValueError, match=r"^item 0: dst_offset must be >= 0, got -1$"):
        _native.copy_many(dst, [(-1, b"a")])
    # Overflow of offset + size must not wrap around to "fits".
    with pytest.raises(ValueError, match="does not fit"):
        _native.copy_many(dst, [((1 << 64) - 4, b"abcdefgh")])
    assert dst == bytearray(128)


def test_copy_many_rejects_overlaps() -> None:
    dst = bytearray(256)
    with pytest.raises(
        ValueError, match=r"^items 0 and 2 overlap in the destination: \[10, 30\) and \[29, 31\)$"
    ):
        _native.copy_many(dst, [(10, b"a" * 20), (100, b"b"), (29, b"cc")])
    # Touching ranges do not overlap; empty items never do.
    _native.copy_many(dst, [(10, b"a" * 20), (30, b"b" * 5), (15, b"")])
    assert dst[10:35] == b"a" * 20 + b"b" * 5
    # A source that lies in a written destination range races with the copy: refused.
    view = memoryview(dst)
    with pytest.raises(
        ValueError, match=r"^item 1: src overlaps bytes of the destination that item 0 writes$"
    ):
        _native.copy_many(dst, [(0, b"q" * 16), (200, view[8:24])])
    # A source elsewhere in the destination buffer is fine.
    _native.copy_many(dst, [(0, b"q" * 8), (200, view[10:20])])
    assert dst[200:210] == b"a" * 10
    view.release()


def test_copy_many_type_errors() -> None:
    dst = bytearray(64)
    with pytest.raises(BufferError):
        _native.copy_many(b"read-only", [(0, b"a")])
    with pytest.raises(TypeError, match="destination must support the buffer protocol"):
        _native.copy_many("not a buffer", [(0, b"a")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^item 1 must be a \(dst_offset, src\) pair, got int$"):
        _native.copy_many(dst, [(0, b"a"), 5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^item 0 must be a \(dst_offset, src\) pair"):
        _native.copy_many(dst, [(0, b"a", b"b")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="^item 0: dst_offset must be an int"):
        _native.copy_many(dst, [("0", b"a")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="^item 0 src must support the buffer protocol"):
        _native.copy_many(dst, [(0, "text")])  # type: ignore[list-item]
    with pytest.raises(BufferError, match="^item 0 src"):
        _native.copy_many(dst, [(0, memoryview(bytes(range(20)))[::2])])
    with pytest.raises(TypeError):
        _native.copy_many(dst, 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads must be >= 0"):
        _native.copy_many(dst, [(0, b"a")], threads=-1)
    assert dst == bytearray(64)


# --------------------------------------------------------------------------- equal


@pytest.mark.parametrize("size", [0, 1, 4095, 5 * MiB + 3, 70 * MiB])
@pytest.mark.parametrize("threads", [0, 1, 3])
def test_equal(size: int, threads: int) -> None:
    a = pattern(size, 9)
    b = bytearray(a)
    assert _native.equal(a, b, threads)
    assert _native.equal(a, a, threads)
    if size:
        b[-1] ^= 1
        assert not _native.equal(a, b, threads)
        b[-1] ^= 1
        b[0] ^= 0x80
        assert not _native.equal(a, b, threads)
        b[0] ^= 0x80
        b[size // 2] ^= 0x10
        assert not _native.equal(a, b, threads)
        b[size // 2] ^= 0x10
        assert _native.equal(a, b, threads)
        assert not _native.equal(a, memoryview(b)[:-1], threads)
    assert not _native.equal(a, bytes(a) + b"\0", threads)


def test_equal_different_sizes_and_buffers() -> None:
    assert not _native.equal(b"abc", b"abcd")
    assert not _native.equal(b"", b"\0")
    assert _native.equal(b"", bytearray())
    with mmap.mmap(-1, PAGE) as m:
        m[:5] = b"hello"
        assert _native.equal(m, b"hello" + bytes(PAGE - 5))
        assert not _native.equal(m, b"hello" + bytes(PAGE - 6) + b"!")
    with pytest.raises(BufferError):
        _native.equal(memoryview(b"abcdef")[::2], b"ace")


# --------------------------------------------------------------------------- prefault


def _rss_kib(addr: int) -> int:
    """Rss (KiB) of the mapping that starts at addr, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            start = int(head.split("-")[0], 16)
            if start == addr:
                for rest in lines[i + 1 :]:
                    if rest.startswith("Rss:"):
                        return int(rest.split()[1])
    raise AssertionError(f"no mapping at {addr:#x}")


def _populate_supported() -> bool:
    with mmap.mmap(-1, PAGE) as m:
        try:
            return _native.prefault(m, method="populate") == "populate"
        except ValueError:
            return False


@pytest.mark.parametrize("method", ["auto", "touch"])
@pytest.mark.parametrize("threads", [0, 1, 4])
def test_prefault_anonymous(method: Literal["auto", "touch"], threads: int) -> None:
    size = 16 * MiB + 3 * PAGE
    with mmap.mmap(-1, size) as m:
        data = pattern(5 * MiB, 11)
        m[PAGE + 7 : PAGE + 7 + len(data)] = data
        snapshot = bytes(m)
        result = _native.prefault(m, threads, method)
        assert result in ("populate", "touch")
        if method == "touch":
            assert result == "touch"
        assert bytes(m) == snapshot
        # An unaligned slice: the range is widened to whole pages.
        view = memoryview(m)[PAGE + 100 : 3 * MiB + 5]
        try:
            assert _native.prefault(view, threads, method) in ("populate", "touch")
        finally:
            view.release()
        assert bytes(m) == snapshot


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")
@pytest.mark.parametrize("method", ["auto", "touch"])
@pytest.mark.parametrize("threads", [0, 1, 4])
def test_prefault_memfd_private_mapping(method: Literal["auto", "touch"], threads: int) -> None:
    size = 24 * MiB
    data = pattern(size, 12)
    fd = os.memfd_create("overmind-test", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        # The way readers map cached segments: MAP_PRIVATE, read-write.
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            addr = _native.address(m)
            before = _rss_kib(addr)
            assert before < size // 1024 // 2, "fresh mapping should not be resident yet"
            result = _native.prefault(m, threads, method)
            assert result in ("populate", "touch")
            if method == "touch":
                assert result == "touch"
            assert _rss_kib(addr) >= size // 1024, "prefault left pages non-resident"
            assert _native.equal(m, data)
            assert bytes(m) == data
        finally:
            m.close()
        # The memfd itself is unchanged.
        assert os.pread(fd, size, 0) == data
    finally:
        os.close(fd)


def test_prefault_populate_and_small_buffers() -> None:
    assert _native.prefault(b"") in ("populate", "touch")
    assert _native.prefault(b"tiny") in ("populate", "touch")
    assert _native.prefault(bytearray(3 * PAGE + 1), 2, "touch") == "touch"
    if _populate_supported():
        with mmap.mmap(-1, 8 * MiB) as m:
            assert _native.prefault(m) == "populate"
            assert _native.prefault(m, 3, "populate") == "populate"
    with pytest.raises(ValueError, match="method must be"):
        _native.prefault(b"x", 0, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads must be >= 0"):
        _native.prefault(b"x", -2)


@pytest.mark.skipif(not _populate_supported(), reason="kernel without MADV_POPULATE_READ")
def test_prefault_past_end_of_file_raises_instead_of_crashing(tmp_path: Path) -> None:
    path = tmp_path / "shrunk"
    path.write_bytes(b"\1" * (4 * PAGE))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4 * PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            os.truncate(path, PAGE)
            with pytest.raises(OSError):
                _native.prefault(m, method="auto")
        finally:
            m.close()


# --------------------------------------------------------------------------- address


def test_address_matches_ctypes() -> None:
    ba = bytearray(b"some bytes here")
    assert _native.address(ba) == ctypes.addressof(ctypes.c_char.from_buffer(ba))
    b = b"immutable bytes"
    assert _native.address(b) == ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value
    view = memoryview(ba)[5:]
    assert _native.address(view) == ctypes.addressof(ctypes.c_char.from_buffer(ba)) + 5
    # Any layout: a strided view starts at its first element.
    assert _native.address(memoryview(ba)[2::3]) == _native.address(ba) + 2
    view.release()
    with mmap.mmap(-1, 2 * PAGE) as m:
        c = ctypes.c_char.from_buffer(m)
        try:
            assert _native.address(m) == ctypes.addressof(c)
            assert _native.address(m) % PAGE == 0
        finally:
            del c
    arr = (ctypes.c_uint8 * 32)()
    assert _native.address(arr) == ctypes.addressof(arr)
    with pytest.raises(TypeError):
        _native.address(12345)  # type: ignore[arg-type]
