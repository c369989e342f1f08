"""Tests of the pybind11 module overmind_lab._native (native/native.cpp)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Literal

import pytest

from overmind_lab import _native

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def pattern(n: int, seed: int = 0) -> bytes:
    """n bytes with period 251 (a prime): a chunk copied to the wrong place shows."""
    period = bytes((i * 7 + seed) % 256 for i in range(251))
    return (period * (n // 251 + 1))[:n]


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
