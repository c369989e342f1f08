"""Storages that are unchanged regions of a source file: referenced, never copied.

A safetensors file loaded without conversion gives views of a ``MAP_PRIVATE`` mapping of it; the
entry references the file instead of copying (the daemon holds it open and checks it before each
hit: Note [Source files are held, not linked]) and records where each storage lies.
:func:`find_source` accepts a storage whose bytes lie in one file mapping of this process
(``/proc/self/maps``), of that very file (device, inode), with no page written privately since
(``pagemap``: a copied page is anonymous). Anything else is copied.

Note [Referenced source files]: the file is shared with its owner, who may rewrite it
(``save_pretrained`` makes a new inode, harmless; an in-place rewrite is not). The daemon never maps
it (it reads it only to copy it, with ``pread``: Note [A copy to serve]), so nothing done to it
harms the daemon or other entries; before every warm load it compares (device, inode, size,
mtime_ns, ctime_ns) with the store's, and a mismatch makes the load cold. A
kernel already mapping the file sees what a plain load's kernel sees (changed bytes, or ``SIGBUS``
past a truncation): the hazard of plain ``safetensors`` loading, no worse.
"""

from __future__ import annotations

import bisect
import mmap
import os
import stat
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from overmind_lab._common.folios import MADV_POPULATE_READ, PMD, huge_windows, mapping_address

if TYPE_CHECKING:
    from overmind_lab._common.messages import SourceRecord


__all__ = ["SourceFile", "SourceMap", "MIN_REFERENCE", "in_small_folios"]

PAGE = os.sysconf("SC_PAGE_SIZE")
#: Storages smaller than this are copied (a reference costs a file and a mapping).
MIN_REFERENCE = 64 << 10
_PM_PRESENT = 1 << 63
_PM_SWAPPED = 1 << 62
_PM_FILE = 1 << 61


@dataclass(frozen=True)
class SourceFile:
    """A regular file some storages are views of, as it was when they were checked."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    def record(self) -> SourceRecord:
        return {"path": self.path, "dev": self.dev, "ino": self.ino, "size": self.size,
                "mtime_ns": self.mtime_ns}


@dataclass(frozen=True)
class _Vma:
    start: int
    end: int
    offset: int
    path: str
    dev: int
    ino: int


class SourceMap:
    """A snapshot of this process's file mappings, read once per store."""

    def __init__(self, exclude: str | None = None) -> None:
        self._vmas: list[_Vma] = []
        self._files: dict[str, SourceFile | None] = {}
        prefix = os.path.realpath(exclude) + "/" if exclude else None
        try:
            with open("/proc/self/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(
                    " (deleted)") or (prefix and parts[5].startswith(prefix)):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            self._vmas.append(_Vma(start, end, int(parts[2], 16), parts[5],
                                   os.makedev(major, minor), int(parts[4])))
        self._vmas.sort(key=lambda v: v.start)
        self._starts = [v.start for v in self._vmas]
        self._pagemap: int | None = None  # opened on first use, closed with the map

    def _pagemap_fd(self) -> int | None:
        if self._pagemap is None:
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            weakref.finalize(self, os.close, self._pagemap)
        return self._pagemap

    def find(self, address: int, nbytes: int) -> tuple[SourceFile, int] | None:
        """The file and offset whose unchanged bytes ``[address, +nbytes)`` are."""
        if nbytes < MIN_REFERENCE:
            return None
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        vma = self._vmas[i]
        if address + nbytes > vma.end:
            return None
        source = self._file(vma)
        offset = vma.offset + address - vma.start
        if source is None or offset + nbytes > source.size:
            return None
        fd = self._pagemap_fd()
        if fd is None or not _pages_unmodified(fd, address, nbytes):
            return None
        return source, offset

    def _file(self, vma: _Vma) -> SourceFile | None:
        if vma.path not in self._files:
            try:
                st = os.stat(vma.path)
            except OSError:
                st = None
            ok = (st is not None and stat.S_ISREG(st.st_mode) and st.st_dev == vma.dev
                  and st.st_ino == vma.ino)
            self._files[vma.path] = SourceFile(vma.path, st.st_dev, st.st_ino, st.st_size,
                                               st.st_mtime_ns) if ok and st else None
        return self._files[vma.path]


def _pages_unmodified(pagemap: int, address: int, nbytes: int) -> bool:
    """No page of the range was copied on write: each is absent or file-backed."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    try:
        raw = os.pread(pagemap, (last - first + 1) * 8, first * 8)
    except OSError:
        return False
    if len(raw) != (last - first + 1) * 8:
        return False
    import numpy as np

    entries = np.frombuffer(raw, dtype="<u8")
    private = ((entries & np.uint64(_PM_PRESENT | _PM_SWAPPED)) != 0) & (
        (entries & np.uint64(_PM_FILE)) == 0)
    return not bool(private.any())


# -- Note [Sources in small folios] ------------------------------------------------------------
#: Files smaller than this are served as they are: their first touch costs little either way.
MIN_FOLIO_PROBE = 32 << 20
_PROBES = 32  # 2 MiB windows sampled per file


def in_small_folios(path: str) -> bool:
    """Whether the page cache holds ``path`` in folios too small to map 2 MiB at a time.

    Note [Sources in small folios]: a held source file is mapped by every warm load, and its first
    touch costs what its page-cache folios make it cost. ``save_pretrained`` writes safetensors in
    small unaligned writes, which leave small folios: the first touch of a just-saved 1.7 GB fp16
    UNet took 65-70 ms, one fault per 64 KiB, against 7 ms in PMD-sized folios (one fault per
    2 MiB). The store tells the daemon, which serves a copy in large folios once it has made one
    (Note [A copy to serve] in ``_daemon/store.py``). The probe: a new private mapping of the file
    (the kernel aligns it to 2 MiB), one page populated in each of up to 32 sampled 2 MiB windows
    (``MADV_POPULATE_READ``: a failed read is an error, not ``SIGBUS``), and ``PAGEMAP_SCAN`` says
    which of them one PMD maps; fewer than half: small folios. Well under a millisecond when
    cached; ``False`` (nothing to do) whenever it cannot tell: a small file, a kernel before 6.7.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size < MIN_FOLIO_PROBE:
            return False
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    try:
        base = mapping_address(mm)
        first = -base % PMD
        windows = range(first, size - PMD + 1, PMD)
        if not windows:
            return False
        step = max(1, len(windows) // _PROBES)
        sampled = windows[::step]
        for offset in sampled:
            mm.madvise(MADV_POPULATE_READ, offset, PAGE)
        huge = huge_windows(base + first, base + size)
    except OSError:
        return False
    finally:
        mm.close()
    if huge is None:
        return False
    hits = sum(1 for offset in sampled if (base + offset) // PMD in huge)
    return hits * 2 < len(sampled)


