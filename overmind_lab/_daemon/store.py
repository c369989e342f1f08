"""Where segments live: files in the cache directory, or memfds when files cannot serve.

The daemon creates every segment and hands the writer a descriptor (``reserve``); after
``store`` nobody can change a cached byte. File tier (the default): ``<id>.tmp`` (0600), filled
by the writer, finished in the background (trailer, fsync, 0400, renamed ``<id>.seg``);
clients get only ``O_RDONLY`` descriptors, mapped ``MAP_PRIVATE``. memfd tier (tmpfs, NFS,
FUSE, an unwritable or busy directory, a disk short of space): sealed memfds that die with
the daemon. The index file: ``magic, body length, crc32`` then JSON, replaced atomically.

Note [Segment trailer]: data from offset 0 (file and mapping offsets agree), zero padding to
4 KiB, then a 4 KiB trailer (magic, version, data length, crc32, and a crc32 of those). A file
whose size or trailer disagrees with its index record is corrupt. More in docs/notes.md.

Note [Checks before a hit]: one ``fstat`` per segment and hit: a file's size must be its
finished size and its identity its *stamp* (when its bytes were last known good), or its
checksum is read before it is served; a mismatch drops every entry that uses it. A held
source file: its descriptor's identity, and the path's inode against it. After a restart a
file with a matching stamp is served at once and checksummed in the background. Any write
moves mtime and ctime (multigrain timestamps since Linux 6.13). More in docs/notes.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import stat
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overmind_lab._common.fileio import pwrite_all
from overmind_lab._common.folios import cached_bytes
from overmind_lab._common.naming import CACHE_DIR_ENV, MEMFD_PREFIX, SEGMENT_SEALS
from overmind_lab._common.saved import (
    FORMAT_VERSION,
    IDENTITY,
    INDEX_NAME,
    MAX_INDEX,
    SEG_SUFFIX,
    Corrupt,
    align,
    check_segment_file,
    file_bytes,
    held_source_changed,
    identity,
    index_file,
    parse_index,
    trailer,
)
from overmind_lab._daemon.cachedir import (
    FALLBACK_FILESYSTEMS,
    CacheDirRefused,
    CacheDirUnavailable,
    check_cache_dir,
    filesystem_type,
    open_cache_dir,
    unsafe_parent,
)
from overmind_lab._daemon.refold import Refolded, refold

__all__ = ["CacheDirRefused", "CacheDirUnavailable", "Corrupt", "Segment", "Store",
           "new_segment_id", "check_cache_dir", "cache_dir_wait", "open_cache_dir",
           "unsafe_parent", "filesystem_type", "footprint", "held_size", "file_bytes",
           "resident_bytes",
           "identity", "IDENTITY"]

log = logging.getLogger("overmind_lab.daemon")

TMP_SUFFIX = ".tmp"
LINK_SUFFIX = ".src"
COPY_SUFFIX = ".copy"  # Note [A copy to serve]
_WINDOW = 8 << 20
#: Keep this much of the file system free (bytes or fraction of its size, the smaller).
FREE_MARGIN = 256 << 20
FREE_MARGIN_FRACTION = 0.02
_CHUNK = 16 << 20


class _Abandoned(Exception):
    """A copy of a source file given up (``copy_source``)."""


def new_segment_id() -> str:
    return os.urandom(8).hex()  # what secrets.token_hex(8) does, without its hmac and OpenSSL


@dataclass
class Segment:
    """One segment the daemon holds: its read-only descriptor and where it lives."""
    id: str
    fd: int
    size: int
    tier: str  # "file", "memfd" or "link" (a source file the daemon holds open)
    crc: int | None = None  # data checksum, once known (file tier)
    persisted: bool = False  # finished: trailer written, fsynced, renamed
    sum_ok: bool = True  # data checksum checked, or the file untouched since it was
    scrubbed: bool = True  # checksum read once by this daemon (after a restart: not yet)
    refs: int = 0
    writer_fd: int = -1  # file tier, until finished
    trailer_mtime: int = 0  # file tier, while finished: the mtime of the trailer's write
    #: file tier: the identity when its bytes were last known good (store, finish, checksum)
    stamp: list[int] | None = None
    #: link tier: the source file as recorded (path and ``IDENTITY``)
    source: dict[str, Any] | None = None
    #: link tier: the loader found its page cache in small folios; and the copy served in its
    #: place once made (Note [A copy to serve])
    small_folios: bool = False
    copy_fd: int = -1
    copy_stamp: list[int] | None = None  # the copy's identity when it was made

    def serve_copy(self, fd: int) -> None:
        """Serve ``fd``, a finished copy of the source (Note [A copy to serve])."""
        self.copy_fd, self.copy_stamp = fd, identity(os.fstat(fd))

    def copy_moved(self) -> bool:
        """Whether the copy being served is no longer as it was made (Note [A copy to
        serve]): then the source is served again."""
        try:
            return self.copy_fd >= 0 and identity(os.fstat(self.copy_fd)) != self.copy_stamp
        except OSError:
            return True

    @property
    def serve_fd(self) -> int:
        """The descriptor a hit hands out: the copy of a held source file, once there is one."""
        return self.copy_fd if self.copy_fd >= 0 else self.fd

    def record(self) -> dict[str, Any]:
        if self.tier == "link":
            return {"id": self.id, "size": self.size, "tier": "link", "source": self.source}
        return {"id": self.id, "size": self.size, "crc": self.crc, "stamp": self.stamp}

    def check(self) -> str | None:
        """Why it must not be handed out, or ``None``; before every hit (Note [Checks before
        a hit]). A moved identity sets ``sum_ok`` False: the caller reads the checksum."""
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            return f"cannot check it: {exc}"
        if self.tier == "link":
            return self._source_changed(st)
        if self.tier != "file":
            return None  # a sealed memfd: nobody can change it
        finished = file_bytes(self.size)
        if self.persisted:
            if st.st_size != finished:
                return (f"segment file {self.id} has {st.st_size} bytes, {finished} "
                        "expected (truncated or extended)")
            if identity(st) != self.stamp:
                self.sum_ok = False  # the checksum tells whether it did harm
        elif st.st_size == finished and self.writer_fd >= 0:
            # ``finish`` wrote the trailer (after it compared the stamp itself): from then
            # on only the ctime may move (chmod, rename) until it takes the final stamp.
            if self.trailer_mtime and st.st_mtime_ns != self.trailer_mtime:
                return f"segment file {self.id} was written after it was stored"
        elif st.st_size != max(self.size, 1):
            return (f"segment file {self.id} has {st.st_size} bytes, {max(self.size, 1)} "
                    "expected (truncated or extended)")
        elif self.stamp is not None and identity(st) != self.stamp:
            return f"segment file {self.id} was written after it was stored"  # no crc yet
        return None

    def changed(self) -> str | None:
        """Link tier: why the source file no longer is what was recorded, or ``None``."""
        return self.changed_at(self.fd)

    def changed_at(self, fd: int) -> str | None:
        """``changed``, of the source file open as ``fd`` (a duplicate of ours)."""
        if self.source is None:
            return None
        try:
            return self._source_changed(os.fstat(fd))
        except OSError as exc:
            return f"cannot check it: {exc}"

    def source_gone(self) -> tuple[str, str] | None:
        """Link tier: ``(what, why)`` once the held source file is not the file its path names
        any more: ``"source deleted"`` (no file there), ``"source replaced"`` (another file
        there: a download renamed over it), ``"source changed"`` (written in place); ``None``
        while it is, or when that cannot be told now (a permission, an I/O error: the check
        before a hit decides). One ``fstat`` and one ``stat`` (Note [Sources let go] in
        ``server``); called from a thread, on a segment the index holds."""
        src = self.source
        if self.tier != "link" or src is None or self.fd < 0:
            return None
        path = str(src.get("path"))
        try:
            st = os.fstat(self.fd)
            there = os.stat(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            return "source deleted", f"the source file {path} is gone ({exc.strerror})"
        except OSError:
            return None
        if (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
            deleted = " (ours is deleted)" if st.st_nlink == 0 else ""
            return "source replaced", (f"the source file {path} was replaced by another file "
                                       f"(inode {st.st_ino} -> {there.st_ino}){deleted}")
        then, now = [src.get(k) for k in IDENTITY], identity(st)
        if now == then:
            return None
        what = ", ".join(k for k, a, b in zip(IDENTITY, then, now, strict=True) if a != b)
        return "source changed", f"the source file {path} was changed in place ({what})"

    def _source_changed(self, st: os.stat_result) -> str | None:
        return held_source_changed(self.source or {}, st)


class Store:
    """The cache directory (or none) and the segments' life cycle in it.

    Note [The cache directory is used through its descriptor]: checked once when opened
    (``open_cache_dir``), then every file is named relative to that descriptor (``dir_fd=``),
    so a directory replaced later is never followed (:meth:`displaced` stops the daemon).
    Files are opened ``O_NOFOLLOW | O_NONBLOCK`` and must be regular; new ones ``O_EXCL``.
    More in docs/notes.md.
    """

    def __init__(self, directory: Path | None, lock_wait: float = 0.0) -> None:
        """``lock_wait``: how long to wait for a directory another daemon holds before the
        memory tier (Note [A successor waits for the cache directory])."""
        self.dir = Path(os.path.abspath(directory)) if directory is not None else None
        self.tier = "memfd"
        self.reason = ""
        #: what a loading process should be told once (Note [A cache directory that cannot be
        #: made]): the memory tier where the user expected files; "" otherwise
        self.note = ""
        self._dir_fd = -1
        self._dir_id: tuple[int, int] | None = None
        self._warned_space = False
        if self.dir is None:
            self.reason = "no cache directory"
            return
        directory = self.dir
        try:
            fd = open_cache_dir(directory)  # CacheDirRefused: the caller refuses to start
        except CacheDirUnavailable as exc:  # Note [A cache directory that cannot be made]
            fd = -1
            self.reason = str(exc)
            self.note = (f"{exc}; cached models are kept in memory, and lost when the daemon "
                         f"stops (set {CACHE_DIR_ENV} to a folder you can write to keep them "
                         "on disk)")
        fstype = filesystem_type(directory) if fd >= 0 else "none"
        if fd < 0:
            pass
        elif fstype in FALLBACK_FILESYSTEMS or fstype.startswith("fuse."):
            self.reason = f"{directory} is on {fstype}"
        elif not os.access(directory, os.W_OK | os.X_OK):
            self.reason = f"{directory} is not writable"
        else:
            holder = _lock_dir(fd, directory, lock_wait)
            if holder is not None:
                self.reason = f"{directory} is used by another overmind-lab daemon{holder}"
            else:
                st = os.fstat(fd)
                self._dir_fd, self._dir_id, self.tier = fd, (st.st_dev, st.st_ino), "file"
        if self.tier == "memfd":
            if fd >= 0:
                os.close(fd)
            log.warning("segments live in memory (memfd tier): %s; they do not survive "
                        "a daemon restart", self.reason)
        else:
            log.info("segments live in %s (%s)", directory, fstype)

    @property
    def persistent(self) -> bool:
        return self.tier == "file"

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)  # releases the directory lock
            self._dir_fd = -1

    def displaced(self) -> str | None:
        """Why the cache directory's path no longer names the directory we hold, or
        ``None`` (Note [The cache directory is used through its descriptor])."""
        if self.dir is None or self._dir_id is None:
            return None
        try:
            st = os.lstat(self.dir)
        except OSError as exc:
            return f"the cache directory {self.dir} is gone ({exc.strerror})"
        if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != self._dir_id:
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "another file"
            return (f"the cache directory {self.dir} was replaced by {kind} while the "
                    "daemon ran")
        return None

    def _open(self, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        """Open ``name`` in the cache directory: never a symbolic link, never blocking,
        always a regular file (else ``Corrupt``)."""
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode,
                     dir_fd=self._dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Corrupt(f"{self.dir}/{name} is not a regular file (mode "
                              f"{st.st_mode:o}): something else was put in its place")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir_fd)

    def create(self, sid: str, size: int) -> tuple[Segment, int]:
        """A new segment and a writable descriptor, which the caller sends and closes."""
        if self.persistent and self._has_room(size):
            name = sid + TMP_SUFFIX
            rw = self._open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:  # the very inode just created, not whatever the name means now
                ro = os.open(f"/proc/self/fd/{rw}", os.O_RDONLY | os.O_CLOEXEC)
            except BaseException:
                os.close(rw)
                self._unlink(name)
                raise
            return Segment(sid, ro, size, "file", writer_fd=rw), os.dup(rw)
        fd = os.memfd_create(MEMFD_PREFIX + sid, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        return Segment(sid, fd, size, "memfd"), os.dup(fd)

    def _has_room(self, size: int) -> bool:
        try:
            st = os.statvfs(self._dir_fd)
        except OSError:
            return False
        free = st.f_bavail * st.f_frsize
        margin = min(FREE_MARGIN, int(st.f_blocks * st.f_frsize * FREE_MARGIN_FRACTION))
        if free - margin >= file_bytes(size):
            return True
        if not self._warned_space:
            self._warned_space = True
            log.warning("the disk holding %s is short of space (%d bytes free): segments "
                        "that do not fit go to memory (memfd tier)", self.dir, free)
        return False

    def commit(self, seg: Segment) -> None:
        """The writer is done: check the size and forbid further writes."""
        st = os.fstat(seg.fd)
        if st.st_size != max(seg.size, 1):
            raise Corrupt(f"segment {seg.id} has {st.st_size} bytes, "
                          f"{max(seg.size, 1)} announced")
        if seg.tier == "file":
            seg.stamp = identity(st)  # Note [Checks before a hit]: the writer is done
        if seg.tier == "memfd":
            # Note [Seal after unmapping]: F_SEAL_WRITE fails (EBUSY) while a shared writable
            # mapping exists; the writer unmaps before ``store``. Readers map MAP_PRIVATE.
            try:
                fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, SEGMENT_SEALS)
            except OSError as exc:  # a writable mapping is still alive somewhere
                raise Corrupt(f"segment {seg.id} could not be sealed: {exc}") from exc

    def discard(self, seg: Segment) -> None:
        """Forget a segment: close its descriptors and delete its file."""
        for fd in (seg.fd, seg.writer_fd):
            if fd >= 0:
                os.close(fd)
        seg.fd = seg.writer_fd = -1
        self.drop_copy(seg)
        if seg.tier == "file" and self._dir_fd >= 0:
            for suffix in (SEG_SUFFIX, TMP_SUFFIX):
                self._unlink(seg.id + suffix)

    def link(self, sid: str, record: dict[str, Any]) -> tuple[Segment | None, str]:
        """Hold a source file whose regions storages are; ``(None, why)`` when it cannot.

        Note [Source files are held, not linked]: the daemon keeps the file's descriptor (the
        entry's bytes are that inode's) and records its path and identity, which a restarted
        daemon reopens and compares. A hard link would change the file's ctime, which the
        client's key covers (Note [File signatures]). More in docs/notes.md. A file the loader
        found in small page-cache folios gets a copy to serve (``copy_source``)."""
        if not self.persistent or self.dir is None:
            return None, "the cache is in memory (memfd tier)"
        path = str(record.get("path", ""))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            return None, f"cannot open {path}: {exc.strerror}"
        st = os.fstat(fd)
        here = os.fstat(self._dir_fd)
        why = ""
        if not stat.S_ISREG(st.st_mode):
            why = f"{path} is not a regular file"
        elif [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns] != [
                record.get(k) for k in ("dev", "ino", "size", "mtime_ns")]:
            why = f"{path} changed since the loader read it"
        elif _parent_id(path) == (here.st_dev, here.st_ino):
            why = "it is a file of the cache itself"
        if why:
            os.close(fd)
            return None, why
        keep = {"path": path, **dict(zip(IDENTITY, identity(st), strict=True))}
        return Segment(sid, fd, st.st_size, "link", persisted=True, source=keep,
                       small_folios=bool(record.get("small_folios"))), ""

    def copy_source(self, seg: Segment, src: int, stop: threading.Event) -> tuple[int, str]:
        """A copy of the held source file ``src`` (the caller's duplicate of ``seg.fd``) to
        serve in its place, written in PMD-sized folios: ``(read-only fd, "")``, or ``(-1, why
        not)``. Blocking; ``stop`` ends it early; nothing of ``seg`` changes.

        Note [A copy to serve]: a file just saved sits in the page cache in small folios
        (Note [Sources in small folios] in ``_loading/sources.py``), and every warm load's
        first touch pays for them: 59-72 ms for a 1.7 GB fp16 UNet, against 13 ms from the
        copy. The daemon copies it with ``pread`` (no mapping: a truncated source gives a short
        read, never ``SIGBUS``) into ``<id>.copy`` in aligned 8 MiB ``pwrite`` windows from one
        resident buffer (Note [Filling a segment]), and hits hand the copy out; the entry stays
        the source's: every check before a hit is the held file's, as before, and a changed
        source drops the entry with its copy. The bytes are the source's if its identity (ctime
        moves on any write) is the recorded one before and after the copy. The copy's own
        identity is checked at every hit too (``copy_moved``): moved, it is dropped and the
        source served. The caller's duplicate descriptor keeps an eviction meanwhile from
        closing (and the number being reused) under the copy. Only local file systems are read
        (a hung network mount would hang a thread), only with room on the disk and in the
        budget beside what is cached (the daemon checks that); the copy is not kept across a
        restart (``collect`` deletes it). More in docs/notes.md."""
        assert self.dir is not None
        why = seg.changed_at(src)
        if why is not None:
            return -1, why
        fstype = filesystem_type(Path(str((seg.source or {}).get("path"))))
        if fstype == "unknown" or fstype.partition(".")[0] in FALLBACK_FILESYSTEMS:
            return -1, f"it is on {fstype}, not a local disk"
        if not self._has_room(seg.size):
            return -1, "the disk has no room for it"
        name = seg.id + COPY_SUFFIX
        try:
            rw = self._open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except (OSError, Corrupt) as exc:
            return -1, f"cannot create {name}: {exc}"
        try:
            os.ftruncate(rw, seg.size)
            buf = memoryview(bytearray(min(_WINDOW, seg.size)))
            for at in range(0, seg.size, _WINDOW):
                if stop.is_set():
                    raise _Abandoned("the daemon is stopping")
                if seg.fd < 0:  # discarded meanwhile (Note [Sources let go] in ``server``)
                    raise _Abandoned("the entry was let go")
                want = min(_WINDOW, seg.size - at)
                if os.preadv(src, [buf[:want]], at) != want:
                    raise _Abandoned("the source file got shorter")
                pwrite_all(rw, buf[:want], at)
            why = seg.changed_at(src)
            if why is not None:
                raise _Abandoned(why)
            os.fchmod(rw, 0o400)
            ro = os.open(f"/proc/self/fd/{rw}", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, _Abandoned) as exc:
            os.close(rw)
            self._unlink(name)
            return -1, str(exc)
        os.close(rw)
        return ro, ""

    def refold_source(self, seg: Segment, src: int,
                      stop: threading.Event) -> tuple[Refolded | None, str]:
        """Note [Refolding a held source] (``refold``) for the held file ``src`` (the caller's
        duplicate of ``seg.fd``), on a local disk only (a hung network mount would hang the
        thread, and its pages would come back over the network): ``(what it did, "")``, or
        ``(None, why not)``. Blocking."""
        fstype = filesystem_type(Path(str((seg.source or {}).get("path"))))
        if fstype == "unknown" or fstype.partition(".")[0] in FALLBACK_FILESYSTEMS:
            return None, f"it is on {fstype}, not a local disk"
        done = refold(src, seg.size, stop)
        return done, "" if done is not None else "the kernel cannot tell its folios apart"

    def drop_copy(self, seg: Segment) -> None:
        """Close and delete ``seg``'s copy (``copy_source``), if it has one."""
        if seg.copy_fd >= 0:
            os.close(seg.copy_fd)
            seg.copy_fd = -1
            seg.copy_stamp = None
            self._unlink(seg.id + COPY_SUFFIX)

    def finish(self, seg: Segment) -> None:
        """Checksum, trailer, fsync, 0400, rename to ``<id>.seg``. Blocking.

        Note [Finishing in the background]: the entry is served from the ``.tmp`` meanwhile;
        a crash before the rename leaves a ``.tmp`` the next daemon deletes. The file must
        not have moved since ``store`` (its stamp): the checksum would seal bytes nobody
        stored.

        Note [A write just before the trailer]: a write that lands between the comparison
        with the stamp and the trailer's ``pwrite`` cannot be told from that ``pwrite`` by
        the file's times. Ours comes next and moves the mtime past it (or leaves it where
        it put it, when the clock's coarse tick has not moved), so the final stamp
        includes it and the crc, of the bytes before it, would be sealed: a hit compares
        stamps, finds them equal and serves the damage. Nothing cheaper closes the window:
        the thread drops the GIL between the two calls, so it can last milliseconds, and
        the owner of the file may always write it. So the data are read a second time
        after the final stamp (a ``stat``: any later write moves the ctime, Linux 6.13's
        multigrain timestamps) and must give the same crc, and the stamp must not have
        moved while they were read. It costs one more pass over bytes the daemon just
        read (in the page cache, ~2 GB/s), in this background thread, once per segment;
        a link-tier entry (the user's own file) is never finished. A hit during that
        pass is still served from the file as it is, as before: the pass decides what is
        sealed, and a damaged segment is dropped when it ends."""
        assert self.dir is not None and seg.writer_fd >= 0
        written = f"segment file {seg.id} was written after it was stored"
        # Valid only if the file did not move since ``store`` nor while it was read.
        crc = _crc_fd(seg.fd, seg.size)
        if seg.stamp is not None and identity(os.fstat(seg.fd)) != seg.stamp:
            raise Corrupt(written)
        trailer_at = align(max(seg.size, 1))
        os.pwrite(seg.writer_fd, trailer(seg.size, crc), trailer_at)
        mtime = seg.trailer_mtime = os.fstat(seg.fd).st_mtime_ns  # our last write
        os.fsync(seg.writer_fd)
        os.fchmod(seg.writer_fd, 0o400)
        os.rename(seg.id + TMP_SUFFIX, seg.id + SEG_SUFFIX, src_dir_fd=self._dir_fd,
                  dst_dir_fd=self._dir_fd)
        self._fsync_dir()
        final = os.fstat(seg.fd)
        if final.st_mtime_ns != mtime or final.st_size != file_bytes(seg.size):
            raise Corrupt(written)  # a write while it was finished: the crc is not of it
        # Note [A write just before the trailer]: only the bytes themselves can tell.
        if _crc_fd(seg.fd, seg.size) != crc or identity(os.fstat(seg.fd)) != identity(final):
            raise Corrupt(written)
        # In this order: ``Segment.check`` (the event loop's thread) accepts the finished
        # size while the writer fd is open, then compares with the final stamp.
        seg.crc = crc
        seg.stamp = identity(final)  # after the chmod and the rename
        seg.persisted = True
        os.close(seg.writer_fd)
        seg.writer_fd = -1

    def _fsync_dir(self) -> None:
        if self._dir_fd >= 0:
            os.fsync(self._dir_fd)

    def open_segment(self, record: dict[str, Any]) -> Segment:
        """Reopen a finished segment file named by an index record; checks its trailer.

        With its recorded stamp it is served at once (``scrubbed`` False); without, checked
        before its first use (``sum_ok`` False). Note [Checks before a hit]."""
        assert self.dir is not None
        if record.get("tier") == "link":
            return self._open_link(record)
        sid, size, crc = str(record["id"]), int(record["size"]), record.get("crc")
        if not sid.isalnum() or not isinstance(crc, int):
            raise Corrupt(f"index record {record!r} is malformed")
        name = sid + SEG_SUFFIX
        try:
            fd = self._open(name)
        except OSError as exc:
            raise Corrupt(f"segment file {self.dir}/{name} cannot be opened: {exc}") from exc
        try:
            st = check_segment_file(fd, size, crc, Path(self.dir, name))
        except BaseException:
            os.close(fd)
            raise
        # An unchecked file gets no stamp: saved again before its check, it stays unchecked.
        stamp = identity(st) if record.get("stamp") == identity(st) else None
        return Segment(sid, fd, size, "file", crc=crc, persisted=True,
                       sum_ok=stamp is not None, scrubbed=False, stamp=stamp)

    def _open_link(self, record: dict[str, Any]) -> Segment:
        sid, source = str(record["id"]), record.get("source")
        if not sid.isalnum() or not isinstance(source, dict) or "ctime_ns" not in source:
            raise Corrupt(f"index record {record!r} is malformed or from an older daemon")
        path = str(source.get("path"))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise Corrupt(f"the source file {path} cannot be opened: {exc}") from exc
        seg = Segment(sid, fd, int(record["size"]), "link", persisted=True, source=source)
        why = seg.changed()
        if why is not None:
            os.close(fd)
            raise Corrupt(why)
        return seg

    def check_sum(self, seg: Segment) -> None:
        """Check the data checksum of a segment (blocking; reads every byte)."""
        if seg.sum_ok and seg.scrubbed:
            return
        before = identity(os.fstat(seg.fd))
        crc = _crc_fd(seg.fd, seg.size)
        if crc != seg.crc:
            raise Corrupt(f"segment file {self.dir}/{seg.id}{SEG_SUFFIX} does not match its "
                          f"checksum (crc32 {crc:08x}, expected {seg.crc:08x}): its bytes "
                          "changed on disk")
        if identity(os.fstat(seg.fd)) != before:
            raise Corrupt(f"segment file {self.dir}/{seg.id}{SEG_SUFFIX} was written while "
                          "its checksum was read")
        seg.stamp = before  # known good as it is now (a chmod or a touch did no harm)
        seg.sum_ok = seg.scrubbed = True

    def collect(self, keep: set[str]) -> list[str]:
        """Delete every segment file and leftover (old ``.src`` links too) not in ``keep``."""
        if self.dir is None or not self.persistent:
            return []
        removed = []
        with os.scandir(self._dir_fd) as it:
            names = [entry.name for entry in it]
        for name in names:
            sid, dot, suffix = name.partition(".")
            if name == INDEX_NAME or (dot and "." + suffix == SEG_SUFFIX and sid in keep):
                continue
            if name == INDEX_NAME + TMP_SUFFIX or "." + suffix in (SEG_SUFFIX, TMP_SUFFIX,
                                                                   LINK_SUFFIX, COPY_SUFFIX):
                try:
                    self._unlink(name)
                except IsADirectoryError:
                    log.warning("%s/%s is a directory, not one of our files: left as is",
                                self.dir, name)
                    continue
                removed.append(name)
        return removed

    def save_index(self, body: dict[str, Any]) -> None:
        """Write the index atomically (write, fsync, rename, fsync the directory)."""
        assert self.dir is not None and self.persistent
        if not body.get("entries"):
            self._unlink(INDEX_NAME)  # nothing cached: the directory is left empty
            self._fsync_dir()
            return
        data = json.dumps({"version": FORMAT_VERSION, **body},
                          separators=(",", ":")).encode()
        tmp = INDEX_NAME + TMP_SUFFIX
        self._unlink(tmp)  # a leftover, or something planted: never written through
        fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, index_file(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, INDEX_NAME, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self._fsync_dir()

    def load_index(self) -> dict[str, Any] | None:
        """The saved index body; ``None`` when there is none. Raises :class:`Corrupt`."""
        if self.dir is None or not self.persistent:
            return None
        path = self.dir / INDEX_NAME
        try:
            fd = self._open(INDEX_NAME)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Corrupt(f"index {path} cannot be read: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size > MAX_INDEX:
                raise Corrupt(f"index {path} has {size} bytes, more than an index has")
            raw = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        return parse_index(raw, path)

    def release(self, seg: Segment) -> None:
        """Close a segment's descriptors, keeping its file (the daemon stops); a copy to serve
        is not kept (Note [A copy to serve])."""
        for fd in (seg.fd, seg.writer_fd):
            if fd >= 0:
                os.close(fd)
        seg.fd = seg.writer_fd = -1
        self.drop_copy(seg)


#: Note [A successor waits for the cache directory]: how long ``serve`` waits for the lock of
#: a cache directory another daemon holds (``$OVERMIND_LAB_CACHE_DIR_WAIT`` seconds).
CACHE_DIR_WAIT = 5.0
CACHE_DIR_WAIT_ENV = "OVERMIND_LAB_CACHE_DIR_WAIT"


def cache_dir_wait() -> float:
    try:
        return max(0.0, float(os.environ.get(CACHE_DIR_WAIT_ENV, CACHE_DIR_WAIT)))
    except ValueError:
        return CACHE_DIR_WAIT


def _lock_dir(fd: int, directory: Path, wait: float) -> str | None:
    """Take the cache directory's lock, waiting up to ``wait`` s for a daemon that holds it to
    go; ``None`` once taken, else what to add to the reason (the holder's pid, if known).

    Note [A successor waits for the cache directory]: a daemon whose socket path went away
    (Note [A socket path that moved] in ``process``) exits within its check period, and
    releases this lock when it closes the directory, after it saved the index there. A client
    that found no daemon meanwhile starts one, which finds the lock still held: on the memory
    tier at once, it would run without the cache on disk for as long as it lives. So it
    retries for a few seconds (its clients wait for its start under the start lock) before it
    takes the memory tier; a daemon that really runs beside it (another socket path, the same
    cache directory) keeps the lock, and this one starts that much later, on memfds as before.
    """
    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if said:
                log.info("the lock of %s is free now: this daemon uses it", directory)
            return None
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
        if time.monotonic() >= deadline or not said:
            holder = _flock_holder(fd)
            who = f" (pid {holder})" if holder else ""
            if time.monotonic() >= deadline:
                return who
            said = True
            log.info("%s is locked by another overmind-lab daemon%s: waiting up to %g s "
                     "for it to go", directory, who, wait)
        time.sleep(0.1)


def _flock_holder(fd: int) -> int | None:
    """The pid holding a ``flock`` on ``fd``'s file, from ``/proc/locks``; ``None`` if unknown
    (another pid namespace shows none, or 0)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == want:
                    pid = int(fields[4])
                    return pid if pid > 0 else None
    except (OSError, ValueError):
        pass
    return None


def _parent_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.dirname(path) or ".")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def footprint(seg: Segment) -> int:
    """What a segment costs the cache (Note [What an entry costs] in ``index``): file bytes with
    the trailer, memfd bytes, or a held source file's copy (the file itself is the user's)."""
    if seg.tier == "link":
        return seg.size if seg.copy_fd >= 0 else 0
    return file_bytes(seg.size) if seg.tier == "file" else max(seg.size, 1)


def held_size(seg: Segment) -> int:
    """The bytes of the user's own file a segment holds open (the link tier), else 0."""
    return seg.size if seg.tier == "link" else 0


def resident_bytes(fd: int, size: int) -> int | None:
    """Bytes of ``fd``'s first ``size`` bytes now in memory (page cache or shmem); ``None``:
    unknown (kernels before 6.5 have no ``cachestat``)."""
    return cached_bytes(fd, 0, size)


def _crc_fd(fd: int, size: int) -> int:
    """crc32 of the first ``size`` bytes of ``fd`` (zlib releases the GIL)."""
    if size <= 0:
        return zlib.crc32(b"")
    crc = 0
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            for start in range(0, size, _CHUNK):
                crc = zlib.crc32(view[start:start + _CHUNK], crc)
        finally:
            view.release()
    return crc


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
