"""Segments: written once with ``pwrite``, mapped copy-on-write by readers.

The daemon creates a segment (a file, or a memfd) and hands over a writable fd;
:func:`write_segment` fills it (Note [Filling a segment]); on ``store`` the daemon makes it
read-only for good (0400 and ``O_RDONLY`` fds, or sealed). :func:`map_segment` maps a received fd
``MAP_PRIVATE`` with write permission.

Note [Copy-on-write isolation]: every process that loaded a model shares it, yet each may change its
copy (fine-tune, ``.half()`` in place) unseen by the others: the segment is read-only, and a write
to a ``MAP_PRIVATE | PROT_WRITE`` page copies that page into the writer first. Untouched pages stay
shared page cache; the entry stays what was stored.

Note [Provenance]: mappings are remembered by address range until unmapped, so pickling an object
from the cache (``vae=vae``) can reference its segment instead of copying; as a process may have
written its private copy, only bytes equal to the sealed segment are referenced.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from overmind_lab._common.fileio import pwrite_all
from overmind_lab._common.folios import mapping_address

__all__ = ["write_segment", "map_segment", "Mapping", "find_mapping", "mapped_fds", "prefault"]
#: 1 faults every page of a warm load in before returning; off, a warm load costs the same for 1 GB
#: or 10 GB and pages fault in on first use.
PREFAULT_ENV = "OVERMIND_LAB_PREFAULT"
#: Note [Filling a segment]: the file is written in windows of this size, aligned to it.
_WINDOW = 8 << 20
_ZEROS = bytes(64 << 10)  # padding between items (storages are 64-byte aligned)


def write_segment(fd: int, size: int, items: Sequence[tuple[int, Any]]) -> None:
    """Fill the new segment ``fd`` (``size`` bytes) with ``items`` (offset, buffer), in increasing
    offset order, not overlapping. The caller keeps ``fd``; nothing is mapped.

    Note [Filling a segment]: from one thread, one aligned 8 MiB window per ``pwrite``, gathered
    first into one resident buffer (the items' pieces and zero padding). A buffered write's folio
    size follows the write's length at that position (ext4 since 6.16, xfs earlier): a write
    covering a 2 MiB aligned block gets one PMD-sized folio, mapped by readers with one page-table
    entry. The first touch of a 1.7 GB segment took 7 ms, against 25 ms written item by item in
    unaligned 2 MiB steps (no PMD folio) and 0.15 s for a memfd's 4 KiB pages. The gathering
    matters: the kernel copies a write's bytes with page faults disabled, and a source page not
    mapped yet (an item that is a view of a file mapping nobody touched: a source file's region
    that is copied, not held) cuts the copy short, which halves the folio size for the rest of
    that write: written straight from the items, a 1.7 GB UNet copied from its safetensors file
    came out in small folios. A shared writable mapping
    filled in parallel pays for every page twice (zeroing, ``page_mkwrite``): 1.46-3.25 s
    against 0.55-0.72 s; two writing threads contend. No ``posix_fallocate``: the daemon checked
    the space, and a failed write raises ``OSError`` (the daemon then deletes the segment).
    """
    os.ftruncate(fd, max(size, 1))
    views = [(offset, memoryview(buf).cast("B")) for offset, buf in items]
    gathered = memoryview(bytearray(min(_WINDOW, size)))
    try:
        for start, pieces in _windows(views, size):
            filled = 0
            for piece in pieces:
                gathered[filled:filled + len(piece)] = piece
                filled += len(piece)
            pwrite_all(fd, gathered[:filled], start)
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


class Mapping:
    """A private (copy-on-write) mapping of one sealed segment."""

    # Not a ``@dataclass``: Note [A first call's imports] in ``load.py``. Compared by identity.
    def __init__(self, segment_id: str, size: int, mm_ref: weakref.ref[mmap.mmap], address: int,
                 fd: int) -> None:
        self.segment_id = segment_id
        self.size = size
        self.mm_ref = mm_ref
        self.address = address
        self.fd = fd

    def __repr__(self) -> str:
        return (f"Mapping(segment_id={self.segment_id!r}, size={self.size}, "
                f"address={self.address:#x}, fd={self.fd})")

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
        with mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as ro:
            import overmind_lab._native as _native

            view = memoryview(ro)[offset:offset + nbytes]
            try:
                return bool(_native.equal(view, data))
            finally:
                view.release()


_lock = threading.Lock()
_starts: list[int] = []
_maps: list[Mapping] = []


def _fresh_lock_after_fork() -> None:
    """Note [The mapping registry across fork]: a background store's forked child looks mappings up;
    had another thread held ``_lock`` at the fork, the child's copy would stay locked and the store
    hang, holding the lease, so the child gets a new lock. (Taking the lock around the fork would
    deadlock: a collection in another fork handler runs ``_forget``.) Lists changed at the fork may
    be out of step: a wrong lookup's bytes differ, and are copied.
    """
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def map_segment(segment_id: str, size: int, fd: int) -> tuple[Mapping, mmap.mmap]:
    """Map ``fd`` copy-on-write, taking ownership of it: the registry record and the mapping.

    Note [Mapping lifetime]: only the tensors over it (and the caller while it builds them) keep the
    ``mmap`` alive; the registry holds it weakly, so the last tensor unmaps it.
    """
    alloc = max(size, 1)
    try:
        mm = mmap.mmap(fd, alloc, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    address = mapping_address(mm)
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
    import overmind_lab._native as _native

    view = memoryview(mapping.mm)
    try:
        return str(_native.prefault(view))
    finally:
        view.release()
