"""Refolding a held source file: its page cache read again in PMD-sized folios, in place.

Note [Refolding a held source]: a file ``save_pretrained`` just wrote sits in the page cache in
small folios (Note [Sources in small folios] in ``_loading/sources.py``), and every warm load's
first touch of it pays one fault per 64 KiB instead of one per 2 MiB (65-70 ms against 7 ms for
a 1.7 GB fp16 UNet). The daemon used to copy the file into its cache directory in large folios
and serve the copy (Note [A copy to serve] in ``store``): a second copy of the user's checkpoint
on disk. Instead, the file's own page cache is made again, 2 MiB window by window, in a thread
at nice 19 (Note [Background work yields] in ``server``):

1. ``fdatasync`` first: a dirty page (a save a moment ago) cannot be dropped.
2. The daemon maps the file privately (never written) with ``MADV_HUGEPAGE`` and populates it
   (``MADV_POPULATE_READ``: from the page cache where it is there), and ``PAGEMAP_SCAN`` says
   which windows one PMD maps already: those are left alone.
3. While another process of the user maps the file (``/proc/<pid>/maps``: its device and inode),
   nothing is done (the pass counts the file busy; 2. comes after this check). Else each
   window not yet large:
   the daemon's own page-table entries dropped (``MADV_DONTNEED`` on its
   mapping), the window's pages dropped from the page cache (``POSIX_FADV_DONTNEED``, which
   drops only clean pages nobody maps), and, if ``cachestat`` says none stayed, read again by a
   fault of the ``MADV_HUGEPAGE`` mapping: readahead of a PMD-order folio, on file systems with
   large folios (ext4 from Linux 6.16, xfs, tmpfs). A window some process still maps (the
   process that made the first load holds its ``safetensors`` mapping until it exits) keeps its
   pages: it is *busy*, and read back at once if part of it went.
4. ``PAGEMAP_SCAN`` again: how many windows are large now.
5. Each window read again is then read by the daemon's CPU, one byte per page. In a virtual
   machine (a Firecracker VM here) pages that a device filled (readahead is DMA) cost the
   first CPU that reads them a fault in the host, per 4 KiB page: without this the first warm
   load's first touch of a refolded 512 MiB file took 0.5-1.7 s instead of 10 ms (256 faults,
   no disk read), and only the second was fast. The daemon pays it in the background instead.

Only one window is ever out of the page cache, for the time of one 2 MiB read: a warm or plain
load that touches it meanwhile waits for that read, and nothing else. A busy file is refolded
again once a client goes away (``server``: the process that mapped it may be gone) and every
``RETRY_SECONDS`` while some windows stay small. Where windows were dropped and read again but
stayed small, the file system keeps no large folios: then, and only then, the daemon makes its
copy (Note [A copy to serve]), counted in the budget and shown by ``status``.

Measured (a 512 MiB file written in small writes, ext4, Linux 6.18, 2 cores): refold 0.4-1.9 s
(step 5 included); a private mapping's first touch of every page 22 ms before, 4 ms after.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass

from overmind_lab._common.folios import (
    MADV_POPULATE_READ,
    PAGE,
    PMD,
    cached_bytes,
    huge_windows,
    mapping_address,
)

__all__ = ["Refolded", "refold", "mapped_elsewhere", "RETRY_SECONDS"]

#: How often (s) a file with windows still in small folios is refolded again.
RETRY_SECONDS = 5.0


@dataclass
class Refolded:
    """What a pass did: the file's whole 2 MiB windows and how they stand after it."""
    windows: int
    large: int  # mapped by one PMD after the pass
    busy: int  # small, and still in the page cache after the drop: some process maps it
    small: int  # small although dropped and read again: the file system keeps no large folios
    seconds: float

    @property
    def done(self) -> bool:
        return self.large == self.windows

    @property
    def unable(self) -> bool:
        """The file system gives this file no large folios (Note [Refolding a held source])."""
        return self.small > 0 and self.large == 0


def mapped_elsewhere(st: os.stat_result) -> bool:
    """Whether a process of this user other than this one maps the file ``st`` describes
    (``/proc/<pid>/maps``: its device and inode). Another user's processes cannot be read;
    a window one of those maps stays busy all the same."""
    me, uid = os.getpid(), os.getuid()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}".encode()
    ino = str(st.st_ino).encode()
    try:
        pids = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return True  # cannot tell: as if it were
    for pid in pids:
        if int(pid) == me:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue  # gone, or not ours to read
        at = data.find(b" " + ino + b" ")
        while at != -1:
            start = data.rfind(b"\n", 0, at) + 1
            fields = data[start:data.find(b"\n", at)].split()
            if len(fields) >= 5 and fields[3] == dev and fields[4] == ino:
                return True
            at = data.find(b" " + ino + b" ", at + 1)
    return False


def refold(fd: int, size: int, stop: threading.Event) -> Refolded | None:
    """Refold ``fd``'s first ``size`` bytes (Note [Refolding a held source]). Blocking; ``None``
    where the kernel cannot tell (no ``PAGEMAP_SCAN`` or ``cachestat``, an unaligned mapping).
    Raises ``OSError`` (the file could not be read)."""
    t0 = time.monotonic()
    windows = size // PMD
    if windows == 0:
        return Refolded(0, 0, 0, 0, 0.0)
    if mapped_elsewhere(os.fstat(fd)):  # 3.: not a page dropped in vain, nor mapped here
        return Refolded(windows, 0, windows, 0, time.monotonic() - t0)
    os.fdatasync(fd)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view: memoryview | None = None
    try:
        base = mapping_address(mm)
        if base % PMD:  # the kernel aligns large file mappings; this one it did not
            return None
        mm.madvise(mmap.MADV_HUGEPAGE)
        view = memoryview(mm)
        mm.madvise(MADV_POPULATE_READ, 0, windows * PMD)
        huge = huge_windows(base, base + windows * PMD)
        if huge is None:
            return None
        small_now = [w for w in range(windows) if (base // PMD) + w not in huge]
        busy = dropped = 0
        dropped_windows: list[int] = []
        for w in small_now:
            if stop.is_set():
                break
            at = w * PMD
            mm.madvise(mmap.MADV_DONTNEED, at, PMD)
            os.posix_fadvise(fd, at, PMD, os.POSIX_FADV_DONTNEED)
            left = cached_bytes(fd, at, PMD)
            if left is None:
                return None
            mm.madvise(MADV_POPULATE_READ, at, PMD)  # read again, whole or what went
            view[at:at + PMD:PAGE].tobytes()  # 5.: one byte of each page, read by a CPU
            if left:
                busy += 1
            else:
                dropped += 1
                dropped_windows.append(w)
        huge = huge_windows(base, base + windows * PMD)
        if huge is None:
            return None
        large = sum(1 for w in range(windows) if (base // PMD) + w in huge)
        small = sum(1 for w in dropped_windows if (base // PMD) + w not in huge)
        return Refolded(windows, large, busy, small, time.monotonic() - t0)
    finally:
        if view is not None:
            view.release()
        mm.close()
