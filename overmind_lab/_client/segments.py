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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overmind_lab import _native

__all__ = ["write_segment", "map_segment", "Mapping", "find_mapping", "mapped_fds", "prefault"]
#: Set to 1 to fault every page of a warm load in before returning. Off by default: a
#: warm load then costs the same for 1 GB or 10 GB, and pages fault in on first use.
PREFAULT_ENV = "OVERMIND_LAB_PREFAULT"
_WRITE_STEP = 2 << 20  # Note [Filling a segment]


def write_segment(fd: int, size: int, items: Sequence[tuple[int, Any]]) -> None:
    """Fill the new segment ``fd`` (``size`` bytes) with ``items`` (offset, buffer).

    The caller keeps ownership of ``fd``. Nothing is mapped.

    Note [Filling a segment]: the bytes go in with ``pwrite``, one item at a time in
    steps of 2 MiB, from one thread: the kernel allocates each page-cache folio and
    copies into it in one go. The alternative, a shared writable mapping populated with
    ``MADV_POPULATE_WRITE`` and then filled by a parallel copy, pays for every page
    twice: it is zeroed when it is faulted in and, on ext4, each write fault of a
    preallocated (unwritten) extent runs the file system's ``page_mkwrite``. Measured
    here on 1.6 GiB of anonymous memory (3 rounds, busy 2-core machine): ``pwrite``
    0.55-0.72 s against 1.46-3.25 s for the mapping, and against 0.84-2.08 s for
    ``pwrite`` from two threads (they contend for the file); into a memfd 1.06-1.59 s
    against 1.82-2.53 s. Faults on the source side (a lazily mapped checkpoint not read
    yet) are taken by the copy itself.

    How the pages enter the page cache decides their size, and larger is not always
    better. Large writes into a file on ext4/xfs are held in large folios, so a reader's
    first touch of 1.7 GB costs ~0.01-0.02 s, against ~0.15 s for a memfd's 4 KiB shmem
    pages and ~0.07 s for a file written in 64 KiB steps. But writes of whole tensors
    (up to 13 MiB) or of 2 MiB-aligned windows, which get PMD-sized folios, were the
    slowest to write in fresh processes (0.7-2.9 s for an SD UNet's 1.7 GB, against
    0.53-0.94 s in 2 MiB steps, whose first touch costs ~0.03 s). With the benchmark's
    fp32 -> fp16 UNet (3 fresh processes each, back to back): first load 1.78 s in 2 MiB
    steps against 2.20 s in whole tensors, plain 1.0 s; warm load + first touch the same.

    No ``posix_fallocate``: the daemon checked the free space when it chose the tier,
    and a write that fails (a disk filled meanwhile) raises ``OSError``, after which the
    daemon deletes the segment.
    """
    os.ftruncate(fd, max(size, 1))
    for offset, buf in items:
        view = memoryview(buf).cast("B")
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:done + _WRITE_STEP], offset + done)
        finally:
            view.release()


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
