"""Which processes map which segment, read from ``/proc/<pid>/maps`` of the processes that
talked to the daemon (``SO_PEERCRED``); cached briefly so that polling UIs cost nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

from overmind_lab._common.naming import MEMFD_PREFIX

__all__ = ["HolderScanner"]

_MARK = "/memfd:" + MEMFD_PREFIX


def segments_mapped_by(pid: int, marks: list[bytes]) -> set[str] | None:
    """Segment ids mapped by ``pid``; ``None`` when the process is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read()
    except OSError:
        return None
    found: set[str] = set()
    for mark in marks:
        start = data.find(mark)
        while start != -1:
            end = data.find(b"\n", start)
            line = data[start + len(mark): end if end != -1 else len(data)]
            name = line.split(b" ", 1)[0].split(b".", 1)[0]
            if name and b"/" not in name:
                found.add(name.decode(errors="replace"))
            start = data.find(mark, start + len(mark))
    return found


class HolderScanner:
    """Maps segment id -> pids holding it, over the pids the daemon has seen."""

    def __init__(self, cache_dir: Path | None = None, ttl: float = 1.0) -> None:
        self.marks = [_MARK.encode()]
        if cache_dir is not None:
            self.marks.append(os.fsencode(os.path.realpath(cache_dir)) + b"/")
        self.ttl = ttl
        self.pids: set[int] = set()
        self._at = 0.0
        self._result: dict[str, set[int]] = {}

    def saw(self, pid: int) -> None:
        if pid > 0 and pid != os.getpid():
            if pid not in self.pids:
                self.pids.add(pid)
                self._at = 0.0

    def invalidate(self) -> None:
        self._at = 0.0

    def scan(self) -> dict[str, set[int]]:
        now = time.monotonic()
        if now - self._at < self.ttl:
            return self._result
        result: dict[str, set[int]] = {}
        for pid in list(self.pids):
            segs = segments_mapped_by(pid, self.marks)
            if segs is None:
                self.pids.discard(pid)
                continue
            for seg in segs:
                result.setdefault(seg, set()).add(pid)
        self._result, self._at = result, now
        return result
