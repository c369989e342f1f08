"""A warm hit with no daemon to answer it: Note [A hit from the disk].

Note [A hit from the disk]: with no daemon listening (killed, crashed, stopped, a fresh login), a
load waited for ``serve --detach`` to start one and restore the entries it had saved (90-150 ms,
5x a warm hit's 30 ms with the first touch), then asked it. The saved index and the segment files
are the user's own, in the cache directory, and a daemon serves a restored entry once these checks
pass (``_daemon/persist.restore``, Note [Checks before a hit] in ``_daemon/store.py``); the load
makes the same checks itself, with the same code (``_common/saved.py``), and maps the files:

- the cache directory: the daemon's rule (ours, mode 0700, no folder above it another user could
  swap: ``trust.replaceable_above``), opened without following a link; the index and segment files
  in it opened relative to it, ``O_NOFOLLOW``, regular files;
- the index: magic, length and checksum; the entry under this key and its segments' records;
- the entry: its source files' signatures and, on the same interpreter, its libraries' versions;
- a segment file: the size and trailer its record names, and the identity it had when its checksum
  was last known good (any other: ``None``, the daemon reads the checksum first);
- a held source file of the user's: the identity recorded, and still the file its path names.

Anything missing, malformed or different is no hit (``None``): the load then waits for the daemon
as before, which says why it drops what it drops. The load starts that daemon in a thread either way
(``DiskSession``), so the next load, and this one's later requests (a refresh, an eviction after a
failed rebuild), find it. The load does not wait for that daemon to report its warm time: a report
made before it listens is kept, and the thread sends it once it connected (lost only where the
process exits first, as the entry's statistics are). A daemon that starts meanwhile may drop the
entry (its checks ran a moment later): the descriptors this load holds keep what it mapped intact,
as after an eviction. ``load`` imports this module with the rest of the machinery (the start-up
thread's work), not at the hit: a hit after ``kill -9`` that imported it (and the wire's
TypedDicts) took 180-205 ms, not 30, the allocations of the import setting off a full collection
of the process's heap right there.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overmind_lab._common import saved as disk
from overmind_lab._common.naming import default_cache_dir
from overmind_lab._common.protocol import Channel
from overmind_lab._common.trust import replaceable_above
from overmind_lab._errors import OvermindError
from overmind_lab._loading.client import Client, Session, report_request

if TYPE_CHECKING:  # the wire's TypedDicts: 4 ms to import at a hit (Note [A hit from the disk])
    from overmind_lab._common.messages import ReportRequest, WireEntry

__all__ = ["saved_hit", "DiskSession"]

_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def saved_hit(key: str, cache_dir: Path | None = None) -> tuple[WireEntry, list[int]] | None:
    """The entry saved under ``key`` and its segments' descriptors, in order, where every check
    a restored daemon makes passes (Note [A hit from the disk]); else ``None``. Never raises."""
    fds: list[int] = []
    try:
        found = _saved_hit(key, Path(os.path.abspath(cache_dir or default_cache_dir())), fds)
    except (disk.Corrupt, OSError, KeyError, TypeError, ValueError, AttributeError):
        found = None
    if found is None:
        for fd in fds:
            os.close(fd)
    return found


def _saved_hit(key: str, folder: Path, fds: list[int]) -> tuple[WireEntry, list[int]] | None:
    if replaceable_above(folder) is not None:
        return None
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            return None
        body = disk.parse_index(_read_index(dir_fd, folder), folder / disk.INDEX_NAME)
        record = next((e for e in body.get("entries", [])
                       if isinstance(e, dict) and e.get("key") == key), None)
        if record is None:
            return None
        validate = record.get("validate") or {}
        if disk.source_changed(validate.get("source")) or disk.versions_changed(validate):
            return None
        records = {str(s["id"]): s for s in body.get("segments", []) if isinstance(s, dict)}
        order = record.get("order") or [*record["own"], *record["shared"]]
        segments = []
        for sid in order:
            seg = records[str(sid)]
            size = int(seg["size"])
            fd = _open_segment(seg, size, dir_fd, folder)
            if fd is None:
                return None
            fds.append(fd)
            segments.append({"id": str(sid), "size": size})
    finally:
        os.close(dir_fd)
    entry: WireEntry = {"key": key, "name": str(record["name"]), "meta": record["meta"],
                        "segments": segments,  # type: ignore[typeddict-item]
                        "cold_seconds": float(record["cold_seconds"])}
    return entry, list(fds)


def _read_index(dir_fd: int, folder: Path) -> bytes:
    fd = os.open(disk.INDEX_NAME, _OPEN, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > disk.MAX_INDEX:
            raise disk.Corrupt(f"{folder / disk.INDEX_NAME} is no index")
        return os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)


def _open_segment(seg: dict[str, Any], size: int, dir_fd: int, folder: Path) -> int | None:
    """A descriptor of the saved segment ``seg`` once it passes a restored daemon's checks."""
    sid = str(seg["id"])
    if not sid.isalnum():
        return None
    if seg.get("tier") == "link":
        source = seg["source"]
        fd = os.open(str(source["path"]), _OPEN)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or disk.held_source_changed(source, st) is not None:
            os.close(fd)
            return None
        return fd
    fd = os.open(sid + disk.SEG_SUFFIX, _OPEN, dir_fd=dir_fd)
    try:
        st = disk.check_segment_file(fd, size, seg.get("crc"), folder / (sid + disk.SEG_SUFFIX))
        ok = seg.get("stamp") == disk.identity(st)
    except disk.Corrupt:
        ok = False
    except BaseException:
        os.close(fd)
        raise
    if not ok:
        os.close(fd)
        return None
    return fd


class DiskSession(Session):
    """A load's session whose first lookup is the hit read from the disk; a daemon starts in a
    thread meanwhile, and every other request waits for it (Note [A hit from the disk])."""

    def __init__(self, client: Client, entry: WireEntry, fds: list[int]) -> None:
        self.note = None
        self._client = client
        self._saved: tuple[WireEntry, list[int]] | None = (entry, fds)
        self._chan: Channel | None = None
        # reports made before the thread's daemon listens: the thread sends them (Note [A hit
        # from the disk]); ``_started`` once it took them, both under ``_lock``
        self._lock = threading.Lock()
        self._reports: list[ReportRequest] = []
        self._started = False
        self._starting = threading.Thread(target=self._start, name="overmind-lab-start",
                                          daemon=True)
        self._starting.start()

    def _start(self) -> None:
        chan = None
        with contextlib.suppress(Exception):
            chan = Client(self._client.path).connect(start=True)
        with self._lock:
            self._started = True
            reports, self._reports = self._reports, []
        if chan is not None:
            with contextlib.suppress(OSError):
                for msg in reports:
                    chan.send(msg)
            chan.close()

    @property
    def chan(self) -> Channel:
        """The daemon's channel, once the thread started it (waited for here)."""
        if self._chan is None:
            self._starting.join()
            self._chan = self._client.connect(start=True)
        return self._chan

    @chan.setter
    def chan(self, chan: Channel) -> None:
        self._chan = chan

    def lookup(self, key: str, *, refresh: bool = False,
               own: bool = False) -> tuple[WireEntry | None, list[int]]:
        saved, self._saved = self._saved, None
        if saved is not None and not refresh and not own and saved[0]["key"] == key:
            return saved
        if saved is not None:
            for fd in saved[1]:
                os.close(fd)
        return super().lookup(key, refresh=refresh, own=own)

    def report(self, key: str, seconds: float, *, verified: bool | None = None) -> None:
        with self._lock:
            if not self._started:  # the load does not wait for the daemon to report
                self._reports.append(report_request(key, seconds, verified))
                return
        try:
            self.chan  # noqa: B018 - the thread's daemon, or why there is none
        except (OvermindError, OSError):
            return  # statistics only: a daemon that did not start never fails the load
        super().report(key, seconds, verified=verified)

    def __exit__(self, *exc: object) -> None:
        saved, self._saved = self._saved, None
        for fd in saved[1] if saved is not None else []:
            os.close(fd)
        if self._chan is not None:
            self._chan.close()

