"""Memory measurements: PSS from ``/proc/<pid>/smaps_rollup``, page-cache warming.

PSS (proportional set size) charges each process its private pages plus its share of
every shared page (a page mapped by 4 processes counts 1/4 in each), so the PSS of a
group of processes adds up to the memory the group really uses.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["pss_bytes", "read_smaps_rollup", "warm_page_cache"]

_CHUNK = 8 << 20


def read_smaps_rollup(pid: int) -> dict[str, int]:
    """The fields of ``/proc/<pid>/smaps_rollup`` in bytes (``Pss``, ``Rss``, ``Pss_Anon``...).

    Empty when the process is gone or the file is unreadable.
    """
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii", errors="replace") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and parts[0].endswith(":") and parts[2] == "kB":
                    out[parts[0][:-1]] = int(parts[1]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def pss_bytes(pid: int) -> int | None:
    """PSS of *pid* in bytes, or ``None`` when it cannot be read."""
    value = read_smaps_rollup(pid).get("Pss")
    return value


def _files(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(p for p in sorted(path.rglob("*")) if p.is_file())
    return found


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Drop the clean, unmapped page-cache pages of every file under *paths*
    (``POSIX_FADV_DONTNEED`` after ``fsync``): a reboot for these files only, without
    touching anyone else's page cache. Returns the bytes of the files."""
    total = 0
    for file in _files(Path(p) for p in paths):
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


def warm_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Read every file under *paths* once so later loads find them in the page cache.

    Returns the bytes read.
    """
    total = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for file in _files(Path(p) for p in paths):
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            with os.fdopen(fd, "rb", buffering=0) as fh:
                while True:
                    n = fh.readinto(view)
                    if not n:
                        break
                    total += n
        except OSError:
            continue
    return total
