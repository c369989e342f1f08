"""Note [Refolding a held source] (``_daemon/refold.py``) on real files and real processes: a
file written as ``save_pretrained`` writes it is refolded in place; while another process maps
it, nothing of it is dropped."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from overmind_lab._common.folios import cached_bytes
from overmind_lab._daemon.refold import mapped_elsewhere, refold
from overmind_lab._loading.sources import in_small_folios

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

SIZE = 64 << 20


def write_small(path: Path) -> Path:
    """``SIZE`` bytes in small unaligned writes (small page-cache folios, as a save leaves)."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        written = 0
        while written < SIZE:
            n = min(12345 if written % 3 else 70001, SIZE - written)
            f.write(chunk[:n])
            written += n
    return path


HOLD = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
mm.madvise(22)
print("mapped", flush=True)
sys.stdin.read()
"""


def test_a_file_in_small_folios_is_refolded_in_place(tmp_path: Path) -> None:
    path = write_small(tmp_path / "w.bin")
    if not in_small_folios(str(path)):
        pytest.skip("this file system leaves no small folios after small writes")
    data = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        done = refold(fd, SIZE, threading.Event())
        if done is None:
            pytest.skip("the kernel cannot tell folios apart")
        if done.unable:
            pytest.skip("this file system keeps no large folios")
        assert done.done and (done.windows, done.large, done.busy) == (SIZE >> 21, SIZE >> 21, 0)
        assert not in_small_folios(str(path))
        assert cached_bytes(fd, 0, SIZE) == SIZE  # nothing left out of the page cache
        assert path.read_bytes() == data
        again = refold(fd, SIZE, threading.Event())
        assert again is not None and again.done  # nothing to do the second time
    finally:
        os.close(fd)


def test_a_file_another_process_maps_is_left_alone(tmp_path: Path) -> None:
    path = write_small(tmp_path / "w.bin")
    if not in_small_folios(str(path)):
        pytest.skip("this file system leaves no small folios after small writes")
    fd = os.open(path, os.O_RDONLY)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "mapped\n"
        assert mapped_elsewhere(os.fstat(fd))
        done = refold(fd, SIZE, threading.Event())
        assert done is not None and not done.done and done.busy == done.windows
        assert in_small_folios(str(path)) and cached_bytes(fd, 0, SIZE) == SIZE
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait()
        holder.stdout.close()
    try:
        assert not mapped_elsewhere(os.fstat(fd))
        done = refold(fd, SIZE, threading.Event())
        assert done is not None and (done.done or done.unable)
    finally:
        os.close(fd)
