"""How a file sits in the page cache: which 2 MiB windows of a mapping one PMD maps
(``PAGEMAP_SCAN``, Linux 6.7) and how many bytes of a range are cached (``cachestat``, Linux
6.5). The loader's probe (Note [Sources in small folios] in ``_loading/sources.py``) and the
daemon's refold (Note [Refolding a held source] in ``_daemon/refold.py``) both read them."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Any

__all__ = ["PAGE", "PMD", "MADV_POPULATE_READ", "mapping_address", "huge_windows",
           "cached_bytes", "populate"]

PAGE = os.sysconf("SC_PAGE_SIZE")
PMD = 2 << 20
MADV_POPULATE_READ = 22  # Linux 5.14; a failed fault is an error, not SIGBUS
_PAGE_IS_HUGE = 1 << 6  # PAGEMAP_SCAN's category of a range mapped by one PMD (Linux 6.7)
_SYS_CACHESTAT = 451  # the same number on every architecture (generic syscall table)


class _ScanArg(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR

try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
    _libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
    _libc = None


def populate(address: int, length: int) -> int:
    """``madvise(MADV_POPULATE_READ)`` over ``[address, address + length)``, the GIL released (a
    ``ctypes`` call): 0, or the ``errno`` (``EFAULT`` past the end of a file: never a ``SIGBUS``;
    ``EINVAL`` before Linux 5.14; ``ENOSYS`` where there is no libc to call)."""
    if _libc is None:
        return errno.ENOSYS
    if _libc.madvise(address, length, MADV_POPULATE_READ) == 0:
        return 0
    return ctypes.get_errno()


def mapping_address(mm: mmap.mmap) -> int:
    """Where a writable mapping starts."""
    probe = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(probe)
    del probe  # releases the buffer export: the mmap can close once its users are gone
    return address


def huge_windows(start: int, end: int) -> set[int] | None:
    """The 2 MiB windows (address // 2 MiB) of ``[start, end)`` in this process that one PMD
    maps, or ``None`` where the kernel cannot tell (before Linux 6.7)."""
    if _libc is None:
        return None
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    found: set[int] = set()
    try:
        regions = (_Region * 1024)()
        while start < end:
            arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=start, end=end,
                           vec=ctypes.addressof(regions), vec_len=len(regions),
                           category_mask=_PAGE_IS_HUGE, return_mask=_PAGE_IS_HUGE)
            count = _libc.ioctl(pagemap, _PAGEMAP_SCAN, ctypes.byref(arg))
            if count < 0:  # ENOTTY before Linux 6.7
                return None
            found.update(w for r in regions[:count] for w in range(r.start // PMD, r.end // PMD))
            if arg.walk_end <= start or count < len(regions):
                break
            start = arg.walk_end  # the vector filled up: go on where the walk ended
    finally:
        os.close(pagemap)
    return found


def cached_bytes(fd: int, offset: int, length: int) -> int | None:
    """Bytes of ``fd``'s ``[offset, offset + length)`` in the page cache, or ``None`` where the
    kernel cannot tell (before Linux 6.5)."""
    if length <= 0:
        return 0
    if _libc is None:
        return None
    rng = (ctypes.c_uint64 * 2)(offset, length)
    out = (ctypes.c_uint64 * 5)()
    if _libc.syscall(_SYS_CACHESTAT, fd, rng, out, 0) != 0:
        return None
    return min(int(out[0]) * PAGE, length)
