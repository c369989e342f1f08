"""Writing segment files: every byte where the plan puts it, in folios readers map whole.

Note [Filling a segment] in ``overmind_lab/_loading/segments.py`` says why the writer goes
by aligned windows; these tests check the layout and, where the kernel gives buffered
writes large folios, that a reader of the file gets PMD mappings.
"""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

from overmind_lab import _native
from overmind_lab._loading import segments


def _items(rng: random.Random) -> tuple[list[tuple[int, bytes]], int]:
    items, offset = [], 0
    for _ in range(rng.randint(0, 30)):
        offset += rng.choice([0, 0, 64, 4096, 100, 70_000, 3 << 20])
        n = rng.choice([0, 1, 63, 4096, 1 << 20, 9 << 20, rng.randint(1, 50_000)])
        items.append((offset, rng.randbytes(min(n, 4096)) * (n // 4096) + rng.randbytes(n % 4096)))
        offset += n
    return items, offset


@pytest.mark.parametrize("window", [4096, 1 << 20, 8 << 20])
def test_every_item_lands_at_its_offset_and_the_gaps_are_zeros(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    monkeypatch.setattr(segments, "_WINDOW", window)
    rng = random.Random(window)
    for trial in range(20):
        items, size = _items(rng)
        path = tmp_path / f"seg{trial}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            segments.write_segment(fd, size, items)
        finally:
            os.close(fd)
        expected = bytearray(max(size, 1))
        for offset, data in items:
            expected[offset:offset + len(data)] = data
        assert path.read_bytes() == expected, f"trial {trial}: {[(o, len(d)) for o, d in items]}"


def test_a_window_of_more_pieces_than_iov_max_is_written_whole(tmp_path: Path) -> None:
    items = [(i * 64, bytes([i % 251 + 1]) * 10) for i in range(5000)]
    size = items[-1][0] + 10
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        segments.write_segment(fd, size, items)
        data = os.pread(fd, size + 1, 0)
    finally:
        os.close(fd)
    assert data == b"".join(d + bytes(54) for _, d in items)[:size]


def test_items_that_overlap_or_pass_the_end_are_refused(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ValueError, match="overlaps"):
            segments.write_segment(fd, 100, [(0, b"x" * 64), (32, b"y")])
        with pytest.raises(ValueError, match="overlaps"):
            segments.write_segment(fd, 100, [(64, b"x" * 64)])
    finally:
        os.close(fd)


def _pmd_mapped_kib(path: Path) -> int:
    """Touch every page of ``path`` through a private mapping; its ``FilePmdMapped``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                          prot=mmap.PROT_READ) as mm:
        for i in range(0, len(mm), 4096):
            mm[i]
        view = memoryview(mm)
        try:
            start = int(_native.address(view))
        finally:
            view.release()
        return _smaps_field(start, "FilePmdMapped")


def _smaps_field(start: int, field: str) -> int:
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{start:x}":
            for rest in lines[i + 1:]:
                if rest.startswith(field + ":"):
                    return int(rest.split()[1])
    raise AssertionError(f"no mapping at {start:#x} in /proc/self/smaps")


def test_a_segment_is_mapped_with_pmd_sized_folios_where_the_kernel_can(
        tmp_path: Path) -> None:
    """Items at 64-byte offsets, so an item-by-item writer never covers an aligned 2 MiB
    block with one write; the aligned windows do, and the reader's mapping is PMD-sized."""
    block = 2 << 20
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"\1" * (4 * block), 0)
    finally:
        os.close(fd)
    if _pmd_mapped_kib(probe) == 0:
        pytest.skip(f"buffered writes on {tmp_path}'s file system get no PMD-sized folios "
                    "on this kernel (ext4 needs Linux 6.16)")
    rng = random.Random(0)
    items, offset = [], 64
    while offset < 8 * block:
        n = rng.randint(100_000, 900_000) // 64 * 64 + 64
        items.append((offset, rng.randbytes(64) * (n // 64)))
        offset += n + 64
    size = offset - 64
    path = tmp_path / "seg"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        segments.write_segment(fd, size, items)
    finally:
        os.close(fd)
    whole_blocks = size // block
    assert _pmd_mapped_kib(path) >= whole_blocks * (block >> 10)


def _file_of(tmp_path: Path, nbytes: int) -> int:
    path = tmp_path / "seg"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    for offset in range(0, nbytes, 64 << 10):  # in small writes, as a checkpoint's writer leaves it
        os.pwrite(fd, bytes([offset >> 16 & 0xFF]) * (64 << 10), offset)
    return fd


def test_a_hit_s_pages_are_mapped_behind_it(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Pages mapped behind the load]: the thread maps every page of the mapping without a
    read from this thread (its ``Rss`` grows from nothing to the whole file)."""
    monkeypatch.delenv(segments.PREFAULT_ENV, raising=False)
    nbytes = 8 << 20
    mapping, mm = segments.map_segment("s", nbytes, _file_of(tmp_path, nbytes))
    assert _smaps_field(mapping.address, "Rss") == 0
    thread = segments.prefault_behind([(mapping, mm)])
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _smaps_field(mapping.address, "Rss") == nbytes >> 10
    assert mm[5 << 16] == 5  # the bytes are the file's; the mapping stays copy-on-write
    mm[0] = 0xAA
    assert os.pread(mapping.fd, 1, 0) == b"\0"


@pytest.mark.parametrize("setting", ["0", "1"])
def test_no_thread_where_the_setting_says_never_or_before_the_return(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setenv(segments.PREFAULT_ENV, setting)
    nbytes = 1 << 20
    mapping, mm = segments.map_segment("s", nbytes, _file_of(tmp_path, nbytes))
    assert segments.prefault_behind([(mapping, mm)]) is None
    assert _smaps_field(mapping.address, "Rss") == (nbytes >> 10 if setting == "1" else 0)


def test_a_file_cut_short_under_the_thread_is_no_crash(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own file, held by the cache, truncated after the hit mapped it: populating past
    its end is ``EFAULT`` (touching it would be a SIGBUS in the thread, the process killed)."""
    monkeypatch.delenv(segments.PREFAULT_ENV, raising=False)
    nbytes = 4 << 20
    fd = _file_of(tmp_path, nbytes)
    mapping, mm = segments.map_segment("s", nbytes, os.dup(fd))
    os.ftruncate(fd, 4096)
    os.close(fd)
    thread = segments.prefault_behind([(mapping, mm)])
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert mm[0] == 0  # this process is alive, the page within the file still readable
    assert _smaps_field(mapping.address, "Rss") <= 64
