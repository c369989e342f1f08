"""Segments: written once with ``pwrite``, mapped copy-on-write by readers.

Writer side: the daemon creates the segment (a file in the cache directory, or a memfd)
and hands over a writable descriptor; :func:`write_segment` writes every item in (Note
[Filling a segment]). On ``store`` the daemon makes it read-only for good (file: 0400,
only ``O_RDONLY`` descriptors handed out; memfd: sealed): from then on no process can
change a cached byte.

Reader side: :func:`map_segment` maps a received fd ``MAP_PRIVATE`` with read and write
permission. Reads share the page cache pages of the file or memfd; a write copies only
the touched page into the writing process (Note [Copy-on-write isolation]).

Note [Copy-on-write isolation]: a cached model is shared by every process that loaded it,
yet each process may change its copy (fine-tune it, ``.half()`` it in place) without any
other process seeing the change. Two things make it so: the segment is sealed
(``F_SEAL_WRITE``), so no process can write the memfd itself, and readers map it
``MAP_PRIVATE | PROT_WRITE``, so a write to a page makes the kernel copy that one page into
the writer's private memory first. Untouched pages stay shared page-cache pages; the cache
entry stays byte-for-byte what was stored, and a later load gets the pristine weights.

Note [Provenance]: every mapping is remembered by address range until it is unmapped, so
that pickling an object that came from the cache can reference its segment instead of
copying the bytes again (``vae=vae``). Because a process may have written into its private
copy, a reference is only taken after the bytes compare equal to the sealed segment.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from overmind_lab import _native

__all__ = ["write_segment", "map_segment", "Mapping", "find_mapping", "mapped_fds", "prefault"]
#: Set to 1 to fault every page of a warm load in before returning. Off by default: a
#: warm load then costs the same for 1 GB or 10 GB, and pages fault in on first use.
PREFAULT_ENV = "OVERMIND_LAB_PREFAULT"
#: Note [Filling a segment]: the file is written in windows of this size, aligned to it.
_WINDOW = 8 << 20
_ZEROS = bytes(64 << 10)  # padding between items (storages are 64-byte aligned)


def write_segment(fd: int, size: int, items: Sequence[tuple[int, Any]]) -> None:
    """Fill the new segment ``fd`` (``size`` bytes) with ``items`` (offset, buffer).

    ``items`` are in increasing offset order and do not overlap. The caller keeps
    ownership of ``fd``. Nothing is mapped.

    Note [Filling a segment]: the bytes go in with ``pwritev``, from one thread, one
    aligned 8 MiB window of the file per call: the pieces of the items that fall in the
    window, and zeros for the padding between them. The kernel allocates each page-cache
    folio and copies into it in one go.

    *Why aligned windows.* The size of the folio a buffered write allocates follows the
    length of the write at that position (ext4 since Linux 6.16, xfs earlier). A write
    that covers a whole 2 MiB-aligned block of the file gets one PMD-sized folio, which
    every reader then maps with a single page-table entry: the first touch of a 1.7 GB
    segment (one byte per 4 KiB page, ``MAP_PRIVATE``, one process) took 7 ms here,
    against 25 ms for the same bytes written item by item in 2 MiB steps (unaligned,
    so 2 MiB is split over two blocks and no folio is PMD-sized, ``FilePmdMapped: 0``),
    and 0.15 s for a memfd's 4 KiB shmem pages. Writing took the same time both ways:
    0.41-0.45 s for 1.7 GB from a warm source (2 MiB, 8 MiB and 64 MiB windows alike).
    (A segment read back from disk after a reboot gets large folios from readahead.)

    *Why not a shared writable mapping* populated with ``MADV_POPULATE_WRITE`` and
    filled by a parallel copy: it pays for every page twice (zeroed when faulted in,
    and, on ext4, ``page_mkwrite`` on each write fault of an unwritten extent): 1.46-3.25
    s against 0.55-0.72 s for ``pwrite`` (1.6 GiB, busy 2-core machine); two writing
    threads contend for the file (0.84-2.08 s).

    No ``posix_fallocate``: the daemon checked the free space when it chose the tier,
    and a write that fails (a disk filled meanwhile) raises ``OSError``, after which the
    daemon deletes the segment.
    """
    os.ftruncate(fd, max(size, 1))
    views = [(offset, memoryview(buf).cast("B")) for offset, buf in items]
    try:
        for start, pieces in _windows(views, size):
            _pwritev_all(fd, pieces, start)
    finally:
        for _, view in views:
            view.release()


def _windows(views: list[tuple[int, memoryview]],
             size: int) -> Iterator[tuple[int, list[memoryview]]]:
    """``(file offset, pieces)`` per aligned window: item slices and zero padding."""
    pieces: list[memoryview] = []
    zeros = memoryview(_ZEROS)
    start = pos = 0  # the window's start, and how far it is filled
    for offset, view in views:
        if offset < pos or offset + len(view) > size:
            raise ValueError(f"segment item at {offset} overlaps another or the end ({size})")
        done = 0
        while pos < offset + len(view):
            end = min(start + _WINDOW, size)
            if pos < offset:  # padding up to the item
                piece = zeros[:min(offset, end) - pos]
            else:
                piece = view[done:done + end - pos]
                done += len(piece)
            pieces.append(piece)
            pos += len(piece)
            if pos == end:
                yield start, pieces
                pieces, start = [], pos
    if pieces:  # the last window ends with the last item (ftruncate made the rest zeros)
        yield start, pieces


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _pwritev_all(fd: int, pieces: list[memoryview], offset: int) -> None:
    """Write ``pieces`` back to back at ``offset``, retrying short writes.

    A window of many small items (more than ``IOV_MAX`` pieces) is joined into one buffer
    first, so that it still goes in as one write."""
    if len(pieces) > _IOV_MAX:
        pieces = [memoryview(b"".join(pieces))]
    first = 0
    while first < len(pieces):
        n = os.pwritev(fd, pieces[first:], offset)
        offset += n
        while first < len(pieces) and n >= len(pieces[first]):
            n -= len(pieces[first])
            first += 1
        if n:
            pieces[first] = pieces[first][n:]


@dataclass(eq=False)
class Mapping:
    """A private (copy-on-write) mapping of one sealed segment."""

    segment_id: str
    size: int
    mm_ref: weakref.ref[mmap.mmap]
    address: int
    fd: int

    @property
    def mm(self) -> mmap.mmap:
        mm = self.mm_ref()
        if mm is None:
            raise RuntimeError(f"segment {self.segment_id} is no longer mapped")
        return mm

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mm)[offset:offset + nbytes]

    def pristine_equal(self, offset: int, nbytes: int, data: Any) -> bool:
        """Whether ``data`` equals the sealed bytes at ``offset`` (not our private copy)."""
        with mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ) as ro:
            view = memoryview(ro)[offset:offset + nbytes]
            try:
                return bool(_native.equal(view, data))
            finally:
                view.release()


_lock = threading.Lock()
_starts: list[int] = []
_maps: list[Mapping] = []


def _fresh_lock_after_fork() -> None:
    """Note [The mapping registry across fork]: a background store runs in a forked child
    (Note [Storing in a forked process]) that looks mappings up while it pickles. Had
    another thread held ``_lock`` at the fork (mapping a segment, or a finalizer unmapping
    one), the child's copy would stay locked for good and the store would hang, holding
    the key's lease. The child, which has one thread, gets a new lock instead. (Taking
    the lock around every fork would be worse: the other fork handlers run Python code,
    a garbage collection there runs ``_forget``, which would wait for the lock its own
    thread holds.) Lists that another thread was changing at the fork may be out of step
    in the child: a lookup then finds a wrong mapping or none, its bytes do not compare
    equal, and they are copied instead of referenced.
    """
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def map_segment(segment_id: str, size: int, fd: int) -> tuple[Mapping, mmap.mmap]:
    """Map ``fd`` copy-on-write; takes ownership of ``fd`` (closed with the mapping).

    Returns the registry record and the mapping itself. Note [Mapping lifetime]: only
    the tensors built over it (and the caller, while it builds them) keep the ``mmap``
    alive; the registry holds it weakly, so dropping the last tensor unmaps the segment
    and gives its memory back.
    """
    alloc = max(size, 1)
    try:
        mm = mmap.mmap(fd, alloc, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    probe = memoryview(mm)
    try:
        address = int(_native.address(probe))
    finally:
        probe.release()
    mapping = Mapping(segment_id, size, weakref.ref(mm), address, fd)
    with _lock:
        i = bisect.bisect_left(_starts, address)
        _starts.insert(i, address)
        _maps.insert(i, mapping)
    weakref.finalize(mm, _forget, address, fd)
    if os.environ.get(PREFAULT_ENV, "0") == "1":
        prefault(mapping)
    return mapping, mm


def _forget(address: int, fd: int) -> None:
    with _lock:
        i = bisect.bisect_left(_starts, address)
        if i < len(_starts) and _starts[i] == address:
            del _starts[i]
            del _maps[i]
    os.close(fd)


def mapped_fds() -> list[int]:
    """The descriptors of the live mappings (``pristine_equal`` reads through them)."""
    with _lock:
        return [m.fd for m in _maps]


def find_mapping(address: int, nbytes: int) -> tuple[Mapping, int] | None:
    """The live mapping that holds ``[address, address + nbytes)``, and the offset."""
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return None
        mapping = _maps[i]
    offset = address - mapping.address
    if offset + nbytes > mapping.size:
        return None
    return mapping, offset


def prefault(mapping: Mapping) -> str:
    """Fault a mapping's pages in now (``MADV_POPULATE_READ`` where the kernel has it)."""
    view = memoryview(mapping.mm)
    try:
        return str(_native.prefault(view))
    finally:
        view.release()
