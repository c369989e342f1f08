"""Shared-memory segments: sealed memfds written once, mapped copy-on-write by readers.

Writer side: :func:`write_segment` creates a memfd, allocates it, copies every item in
with the native multi-threaded copy (GIL released), unmaps and seals it
(``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): from then on no process can
change a cached byte.

Reader side: :func:`map_segment` maps a received fd ``MAP_PRIVATE`` with read and write
permission. Reads share the page cache pages of the memfd; a write copies only the touched
page into the writing process (Note [Copy-on-write isolation]).

Note [Provenance]: every mapping is remembered by address range until it is unmapped, so
that pickling an object that came from the cache can reference its segment instead of
copying the bytes again (``vae=vae``). Because a process may have written into its private
copy, a reference is only taken after the bytes compare equal to the sealed segment.
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overmind_lab import _native
from overmind_lab._holders import MEMFD_PREFIX

__all__ = ["new_segment_id", "write_segment", "map_segment", "Mapping", "find_mapping"]

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
PREFAULT_ENV = "OVERMIND_LAB_PREFAULT"


def new_segment_id() -> str:
    return secrets.token_hex(8)


def write_segment(segment_id: str, size: int, items: Sequence[tuple[int, Any]]) -> int:
    """Create a sealed memfd of ``size`` bytes holding ``items`` (offset, buffer).

    Returns the fd (the caller owns it). Nothing is left mapped.
    """
    fd = os.memfd_create(f"{MEMFD_PREFIX}{segment_id}",
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        alloc = max(size, 1)
        os.ftruncate(fd, alloc)
        # Allocating up front is ~3x faster than first-touch faults during the copy.
        os.posix_fallocate(fd, 0, alloc)
        with mmap.mmap(fd, alloc, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            _native.copy_many(mm, items)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(eq=False)
class Mapping:
    """A private (copy-on-write) mapping of one sealed segment."""

    segment_id: str
    size: int
    mm: mmap.mmap
    address: int
    fd: int

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


def map_segment(segment_id: str, size: int, fd: int) -> Mapping:
    """Map ``fd`` copy-on-write; takes ownership of ``fd`` (closed with the mapping)."""
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
    mapping = Mapping(segment_id, size, mm, address, fd)
    with _lock:
        i = bisect.bisect_left(_starts, address)
        _starts.insert(i, address)
        _maps.insert(i, mapping)
    weakref.finalize(mm, _forget, address, fd)
    if os.environ.get(PREFAULT_ENV, "1") != "0" and size >= 1 << 20:
        _prefault_later(mm)
    return mapping


def _forget(address: int, fd: int) -> None:
    with _lock:
        i = bisect.bisect_left(_starts, address)
        if i < len(_starts) and _starts[i] == address:
            del _starts[i]
            del _maps[i]
    os.close(fd)


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


def _prefault_later(mm: mmap.mmap) -> None:
    """Fault the mapping's page tables in on a background thread (GIL released)."""
    ref = weakref.ref(mm)

    def work() -> None:
        target = ref()
        if target is None:
            return
        try:
            view = memoryview(target)
        except ValueError:  # closed meanwhile
            return
        del target
        try:
            _native.prefault(view, 1)
        finally:
            view.release()

    threading.Thread(target=work, name="overmind-lab-prefault", daemon=True).start()
