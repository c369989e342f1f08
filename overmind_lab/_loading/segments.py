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
from overmind_lab._common.folios import mapping_address, populate

__all__ = ["write_segment", "map_segment", "Mapping", "find_mapping", "mapped_fds", "prefault",
           "prefault_behind"]
#: How a warm load's pages are mapped: ``behind`` (the default) by a thread while the load goes on
#: (Note [Pages mapped behind the load]); ``1`` every page before the load returns (a warm load then
#: costs more for 10 GB than for 1 GB); ``0`` on first use only.
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
    if os.environ.get(PREFAULT_ENV) == "1":
        prefault(mapping)
    return mapping, mm


# Note [Pages mapped behind the load]: a warm hit maps its segments and returns in ~10 ms; the
# pages are mapped into the process at their first read, one fault at a time. Where the file's page
# cache is in PMD-sized folios (a segment the daemon wrote, a held source once refolded) a fault
# maps 2 MiB and the faults of a 1.7 GB UNet's first touch cost ~2 ms; in 4 KiB folios (a held
# source just after the first load, before the daemon refolded it: Note [Refolding a held source])
# ~50 ms, as much as a plain load's first touch. A thread started as the hit returns populates the
# mappings (``MADV_POPULATE_READ`` in 256 MiB steps, the GIL released) on another core while the
# caller goes on, from the end of the last mapping back: the caller's first reads (a forward pass,
# the weights in the order they were stored) go from the start, so the two meet in the middle
# instead of faulting the same pages side by side. A page the caller reads first still faults in
# its own thread, which costs no more than without the thread. Measured (``python -m benchmarks
# --only orders``), a warm load + touch right after the first load: 0.54-0.57x plain without the
# thread, 0.30-0.39x with it. Started before the unpickling, it slowed the hit itself (12 -> 15-48
# ms: its page-table work contends with the unpickler's allocations for the address space's lock).
# Pages in the page cache are mapped read-only and shared (copy-on-write stays as it was); pages not
# in memory are read, as their first use would have. The thread holds the mmaps until it is done
# (their unmapping waits for it); an exit stops it (Note [A prefault thread at exit]). The refold
# skips windows a process maps, which the first touch maps anyway.
def prefault_behind(mappings: Sequence[tuple[Mapping, mmap.mmap]]) -> threading.Thread | None:
    """Populate the mappings in a thread of its own (Note [Pages mapped behind the load]); ``None``
    where ``$OVERMIND_LAB_PREFAULT`` is ``0`` or ``1`` (never, or done already)."""
    global _exit_hook
    if os.environ.get(PREFAULT_ENV, "behind") in ("0", "1") or not mappings:
        return None
    if not _exit_hook:
        try:
            threading._register_atexit(_stop_populating)  # type: ignore[attr-defined]
        except RuntimeError:  # the interpreter is exiting
            return None
        _exit_hook = True
    thread = threading.Thread(target=_populate, args=(list(mappings),),
                              name="overmind-lab-prefault")
    thread.start()
    return thread


# Note [A prefault thread at exit]: the thread is not a daemon thread, and the interpreter's exit
# (and ``exiting.exit_now``) stops it between two 256 MiB steps (``threading._register_atexit``:
# run before the non-daemon threads are joined), so an exit waits for one step at most (~10 ms in
# the page cache, longer where the pages come from disk). A daemon thread still inside its call as
# the interpreter finalizes would be ended where it takes the GIL back. Each step gives the GIL
# back to the thread once (up to the 5 ms switch interval where the caller runs Python meanwhile),
# hence steps this large: a 1.7 GB UNet in 7.
_STEP = 256 << 20
_exit_hook = False
_stopping = False


def _stop_populating() -> None:
    global _stopping
    _stopping = True


def _populate(mappings: list[tuple[Mapping, mmap.mmap]]) -> None:
    # the mmaps stay referenced (mapped) until the thread ends; it never imports (a fork meanwhile
    # would leave the module's lock held in the child: Note [A fork while the thread imports])
    for mapping, mm in reversed(mappings):  # from the end: Note [Pages mapped behind the load]
        length = len(mm)
        for start in reversed(range(0, length, _STEP)):
            if _stopping or mm.closed:
                return
            # a failure (EFAULT: a file truncated meanwhile; EINVAL: a kernel before 5.14) leaves
            # the pages to their first read, which reports it as it would without this thread
            if populate(mapping.address + start, min(_STEP, length - start)):
                break


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
