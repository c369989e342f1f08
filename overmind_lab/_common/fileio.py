"""Writing a whole buffer at an offset: the segment writer's and the daemon's copies share it."""

from __future__ import annotations

import os

__all__ = ["pwrite_all"]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset``, retrying short writes."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
