"""The saved segment file's check (``_common/saved.check_segment_file``), which both the restored
daemon and a load's hit from the disk make: each way a file can be wrong is named."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from overmind_lab._common.saved import Corrupt, align, check_segment_file, trailer

DATA = b"weights" * 1000


def _segment(path: Path, data: bytes = DATA) -> int:
    crc = zlib.crc32(data)
    path.write_bytes(data + b"\0" * (align(len(data)) - len(data)) + trailer(len(data), crc))
    return crc


def _check(path: Path, size: int, crc: object, flags: int = os.O_RDONLY) -> os.stat_result:
    fd = os.open(path, flags)
    try:
        return check_segment_file(fd, size, crc, path)
    finally:
        os.close(fd)


def test_a_whole_segment_passes(tmp_path: Path) -> None:
    crc = _segment(tmp_path / "a.seg")
    assert _check(tmp_path / "a.seg", len(DATA), crc).st_size == (tmp_path / "a.seg").stat().st_size


def test_a_truncated_segment_says_how_many_bytes(tmp_path: Path) -> None:
    crc = _segment(tmp_path / "a.seg")
    os.truncate(tmp_path / "a.seg", 100)
    with pytest.raises(Corrupt, match="has 100 bytes, .* expected"):
        _check(tmp_path / "a.seg", len(DATA), crc)


def test_another_record_says_what_it_holds(tmp_path: Path) -> None:
    crc = _segment(tmp_path / "a.seg")
    with pytest.raises(Corrupt, match="its index record says"):
        _check(tmp_path / "a.seg", len(DATA), crc ^ 1)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_not_a_file_is_named_as_what_it_is(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "a.seg"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        flags = os.O_RDONLY | os.O_NONBLOCK
    else:
        path.mkdir()
        flags = os.O_RDONLY | os.O_DIRECTORY
    with pytest.raises(Corrupt, match=f"not a regular file \\(a {kind}\\)"
                       if kind == "directory" else "not a regular file \\(a FIFO\\)"):
        _check(path, len(DATA), 0, flags)
