"""Where segments live: files in the cache directory, or memfds when files cannot serve.

The daemon creates every segment and hands the writer a descriptor (``reserve``); the
writer fills it and says ``store``; from then on nobody can change a cached byte.

File tier (the default): ``<cache dir>/<id>.tmp`` is created 0600, filled by the writer
through a shared mapping (large page-cache folios, see Note [Filling a segment] in the
client's segments module), then finished in the background (:meth:`Store.finish`): a
checksummed trailer is appended, the file is fsynced, made 0400 and renamed to
``<id>.seg``. Clients only ever receive ``O_RDONLY`` descriptors and map them
``MAP_PRIVATE``, so an in-place write in a kernel copies the page into that kernel and
never reaches the file.

memfd tier (the fallback): a sealed memfd as before. Used for every segment when the cache
directory sits on tmpfs, NFS, FUSE or another file system whose pages are not held in
large folios or not reliably ours, when it is not writable or is used by another daemon,
and for one segment when the disk is short of space. Such segments die with the daemon.

Segment file layout (Note [Segment trailer]): the data from offset 0 (so file offsets
and mapping offsets agree, and large folios line up), zero padding to a 4 KiB boundary,
then a 4 KiB trailer: ``magic, version, data length, crc32 of the data`` and a crc32 of
those fields. A file whose size, magic, trailer checksum or length does not match its
index record is corrupt: truncated, torn by a crash before ``finish``, or overwritten.
The data checksum is verified once per daemon lifetime before a file written by an
earlier daemon is handed out (:meth:`Store.verify`).

The index file (``<cache dir>/index``) is a header ``magic, body length, crc32 of the
body`` followed by a JSON body, written to ``index.tmp``, fsynced and renamed over the old
one, then the directory is fsynced (write, fsync, rename: a crash leaves the old index or
the new one, never a mix).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overmind_lab._common.naming import CACHE_DIR_ENV, MEMFD_PREFIX, SEGMENT_SEALS

__all__ = ["CacheDirRefused", "Corrupt", "Segment", "Store", "new_segment_id", "check_cache_dir",
           "filesystem_type", "footprint", "file_bytes", "resident_bytes"]

log = logging.getLogger("overmind_lab.daemon")

INDEX_NAME = "index"
SEG_SUFFIX = ".seg"
TMP_SUFFIX = ".tmp"
LINK_SUFFIX = ".src"
PAGE = 4096
_TRAILER = struct.Struct(">8sIQI")
_SEG_MAGIC = b"OVLSEG\x00\x01"
_INDEX_HEADER = struct.Struct(">8sQI")
_INDEX_MAGIC = b"OVLIDX\x00\x01"
FORMAT_VERSION = 1
#: File systems whose pages are not worth a file (tmpfs: shmem, 4 KiB pages, no disk) or
#: not reliably ours (network and FUSE file systems change under us, may not fsync).
FALLBACK_FILESYSTEMS = frozenset({
    "tmpfs", "ramfs", "devtmpfs", "nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse",
    "fuseblk", "9p", "virtiofs", "ceph", "glusterfs", "afs", "sshfs",
})
#: Keep this much of the file system free (bytes or fraction of its size, the smaller).
FREE_MARGIN = 256 << 20
FREE_MARGIN_FRACTION = 0.02
_CHUNK = 16 << 20


class CacheDirRefused(Exception):
    """The cache directory is unsafe to use (wrong owner, wrong mode, not a directory)."""


class Corrupt(Exception):
    """A segment or index file failed its checks; the message says which and why."""


def new_segment_id() -> str:
    return secrets.token_hex(8)


def check_cache_dir(path: Path) -> None:
    """Create ``path`` 0700 if missing; refuse one that is not ours and private."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as exc:
        raise CacheDirRefused(f"cannot create the cache directory {path}: {exc}; set "
                              f"{CACHE_DIR_ENV} to a directory you own") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirRefused(f"the cache directory {path} is not a directory; remove it "
                              f"or set {CACHE_DIR_ENV}")
    if st.st_uid != os.getuid():
        raise CacheDirRefused(f"the cache directory {path} is owned by uid {st.st_uid}, "
                              f"not by uid {os.getuid()}; remove it or set {CACHE_DIR_ENV} "
                              "to a directory you own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise CacheDirRefused(f"the cache directory {path} has mode {mode:04o}; other users "
                              f"could read or replace cached models: run `chmod 700 {path}`"
                              f" or set {CACHE_DIR_ENV}")


def filesystem_type(path: Path) -> str:
    """The type of the file system holding ``path`` (from ``/proc/self/mountinfo``)."""
    target = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return fstype
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].encode().decode("unicode_escape")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, right.split()[0]
    return fstype


@dataclass
class Segment:
    """One segment the daemon holds: its read-only descriptor and where it lives."""

    id: str
    fd: int
    size: int
    tier: str  # "file", "memfd" or "link" (a hard link to a source file)
    crc: int | None = None  # data checksum, once known (file tier)
    persisted: bool = False  # finished: trailer written, fsynced, renamed
    verified: bool = True  # data checksum checked (files of an earlier daemon: not yet)
    refs: int = 0
    writer_fd: int = -1  # file tier, until finished
    #: link tier: the source file as recorded (path, dev, ino, size, mtime_ns)
    source: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        if self.tier == "link":
            return {"id": self.id, "size": self.size, "tier": "link", "source": self.source}
        return {"id": self.id, "size": self.size, "crc": self.crc}

    def changed(self) -> str | None:
        """Link tier: why the linked file no longer is what was recorded, or ``None``."""
        if self.source is None:
            return None
        src = self.source
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            return f"cannot check it: {exc}"
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        then = (src.get("dev"), src.get("ino"), src.get("size"), src.get("mtime_ns"))
        if now != then:
            return (f"the source file {src.get('path')} was changed in place (size "
                    f"{then[2]} -> {now[2]}, mtime_ns {then[3]} -> {now[3]})")
        return None


class Store:
    """The cache directory (or none) and the segments' life cycle in it."""

    def __init__(self, directory: Path | None) -> None:
        self.dir = directory
        self.tier = "memfd"
        self.reason = ""
        self._dir_fd = -1
        self._warned_space = False
        if directory is None:
            self.reason = "no cache directory"
            return
        check_cache_dir(directory)  # raises CacheDirRefused: the caller refuses to start
        fstype = filesystem_type(directory)
        if fstype in FALLBACK_FILESYSTEMS or fstype.startswith("fuse."):
            self.reason = f"{directory} is on {fstype}"
        elif not os.access(directory, os.W_OK | os.X_OK):
            self.reason = f"{directory} is not writable"
        else:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                self.reason = f"{directory} is used by another overmind-lab daemon"
            else:
                self._dir_fd, self.tier = fd, "file"
        if self.tier == "memfd":
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

    # -- creating ---------------------------------------------------------------------
    def create(self, sid: str, size: int) -> tuple[Segment, int]:
        """A new segment of ``size`` bytes and a writable descriptor for the writer.

        The caller sends the writable descriptor and closes it; the segment keeps the
        daemon's own descriptors until :meth:`commit` (or :meth:`discard`).
        """
        if self.persistent and self._has_room(size):
            assert self.dir is not None
            path = self.dir / (sid + TMP_SUFFIX)
            rw = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                ro = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except BaseException:
                os.close(rw)
                path.unlink()
                raise
            return Segment(sid, ro, size, "file", writer_fd=rw), os.dup(rw)
        fd = os.memfd_create(MEMFD_PREFIX + sid, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        return Segment(sid, fd, size, "memfd"), os.dup(fd)

    def _has_room(self, size: int) -> bool:
        assert self.dir is not None
        try:
            st = os.statvfs(self.dir)
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
        size = os.fstat(seg.fd).st_size
        if size != max(seg.size, 1):
            raise Corrupt(f"segment {seg.id} has {size} bytes, {max(seg.size, 1)} announced")
        if seg.tier == "memfd":
            # Note [Seal after unmapping]: F_SEAL_WRITE fails with EBUSY while any shared
            # writable mapping of the memfd exists. The writer unmaps before it sends
            # ``store``; sealing earlier would forbid the writing itself. Readers map
            # MAP_PRIVATE, which the seal allows.
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
        if seg.tier in ("file", "link") and self.dir is not None:
            for suffix in (SEG_SUFFIX, TMP_SUFFIX, LINK_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    (self.dir / (seg.id + suffix)).unlink()

    # -- source files ---------------------------------------------------------------
    def link(self, sid: str, record: dict[str, Any]) -> tuple[Segment | None, str]:
        """Hard-link a source file into the cache; ``(None, why)`` when it cannot be.

        See Note [Referenced source files] in the client's sources module.
        """
        if not self.persistent or self.dir is None:
            return None, "the cache is in memory (memfd tier)"
        path = str(record.get("path", ""))
        real = os.path.realpath(path)
        if os.path.dirname(real) == os.path.realpath(self.dir):
            return None, "it is a file of the cache itself"
        dst = self.dir / (sid + LINK_SUFFIX)
        try:
            os.link(real, dst, follow_symlinks=False)
        except OSError as exc:  # EXDEV: another file system; EPERM: protected_hardlinks
            return None, f"cannot link {path}: {exc.strerror}"
        try:
            fd = os.open(dst, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            dst.unlink()
            return None, f"cannot open the link of {path}: {exc.strerror}"
        keep = {k: record.get(k) for k in ("path", "dev", "ino", "size", "mtime_ns")}
        seg = Segment(sid, fd, int(keep["size"] or 0), "link", persisted=True, source=keep)
        why = seg.changed()
        if why is not None:
            self.discard(seg)
            return None, why
        # No directory fsync here, on the client's path (it waits for the journal): the
        # link becomes durable with the index's own directory fsync (``save_index``), and
        # a link that no saved index names is deleted by the next daemon (``collect``).
        return seg, ""

    # -- finishing (blocking: run in a thread) ------------------------------------------
    def finish(self, seg: Segment) -> None:
        """Checksum, trailer, fsync, 0400, rename to ``<id>.seg``. Blocking.

        Note [Finishing in the background]: the entry is served from the ``.tmp`` file
        while this runs (its pages are in the page cache already); a crash before the
        rename leaves a ``.tmp`` that the next daemon deletes, and the index only ever
        names finished files.
        """
        assert self.dir is not None and seg.writer_fd >= 0
        crc = _crc_fd(seg.fd, seg.size)
        trailer_at = _align(max(seg.size, 1))
        os.pwrite(seg.writer_fd, _trailer(seg.size, crc), trailer_at)
        os.fsync(seg.writer_fd)
        os.fchmod(seg.writer_fd, 0o400)
        os.close(seg.writer_fd)
        seg.writer_fd = -1
        tmp, final = self.dir / (seg.id + TMP_SUFFIX), self.dir / (seg.id + SEG_SUFFIX)
        os.rename(tmp, final)
        self._fsync_dir()
        seg.crc = crc
        seg.persisted = True

    def _fsync_dir(self) -> None:
        if self._dir_fd >= 0:
            os.fsync(self._dir_fd)

    # -- reopening --------------------------------------------------------------------
    def open_segment(self, record: dict[str, Any]) -> Segment:
        """Reopen a finished segment file named by an index record; checks its trailer."""
        assert self.dir is not None
        if record.get("tier") == "link":
            return self._open_link(record)
        sid, size, crc = str(record["id"]), int(record["size"]), record.get("crc")
        if not sid.isalnum() or not isinstance(crc, int):
            raise Corrupt(f"index record {record!r} is malformed")
        path = self.dir / (sid + SEG_SUFFIX)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise Corrupt(f"segment file {path} cannot be opened: {exc}") from exc
        try:
            st = os.fstat(fd)
            trailer_at = _align(max(size, 1))
            if not stat.S_ISREG(st.st_mode) or st.st_size != file_bytes(size):
                raise Corrupt(f"segment file {path} has {st.st_size} bytes, "
                              f"{file_bytes(size)} expected (truncated or torn)")
            found = _parse_trailer(os.pread(fd, _TRAILER.size + 4, trailer_at), path)
            if found != (size, crc):
                raise Corrupt(f"segment file {path} holds {found}, its index record says "
                              f"{(size, crc)}")
        except BaseException:
            os.close(fd)
            raise
        return Segment(sid, fd, size, "file", crc=crc, persisted=True, verified=False)

    def _open_link(self, record: dict[str, Any]) -> Segment:
        assert self.dir is not None
        sid, source = str(record["id"]), record.get("source")
        if not sid.isalnum() or not isinstance(source, dict):
            raise Corrupt(f"index record {record!r} is malformed")
        path = self.dir / (sid + LINK_SUFFIX)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise Corrupt(f"linked source file {path} cannot be opened: {exc}") from exc
        seg = Segment(sid, fd, int(record["size"]), "link", persisted=True, source=source)
        why = seg.changed()
        if why is not None:
            os.close(fd)
            raise Corrupt(why)
        return seg

    def verify(self, seg: Segment) -> None:
        """Check the data checksum of a reopened segment (blocking; reads every byte)."""
        if seg.verified:
            return
        crc = _crc_fd(seg.fd, seg.size)
        if crc != seg.crc:
            raise Corrupt(f"segment file {self.dir}/{seg.id}{SEG_SUFFIX} does not match its "
                          f"checksum (crc32 {crc:08x}, expected {seg.crc:08x}): its bytes "
                          "changed on disk")
        seg.verified = True

    def collect(self, keep: set[str]) -> list[str]:
        """Delete every segment file and leftover not in ``keep``; returns their names."""
        if self.dir is None or not self.persistent:
            return []
        removed = []
        for entry in os.scandir(self.dir):
            name = entry.name
            sid, dot, suffix = name.partition(".")
            if name in (INDEX_NAME,) or (dot and "." + suffix in (SEG_SUFFIX, LINK_SUFFIX)
                                         and sid in keep):
                continue
            if name == INDEX_NAME + TMP_SUFFIX or "." + suffix in (SEG_SUFFIX, TMP_SUFFIX,
                                                                   LINK_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                removed.append(name)
        return removed

    # -- the index file ---------------------------------------------------------------
    def save_index(self, body: dict[str, Any]) -> None:
        """Write the index atomically (write, fsync, rename, fsync the directory)."""
        assert self.dir is not None and self.persistent
        path = self.dir / INDEX_NAME
        if not body.get("entries"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # nothing cached: the directory is left empty
            self._fsync_dir()
            return
        data = json.dumps({"version": FORMAT_VERSION, **body},
                          separators=(",", ":")).encode()
        tmp = self.dir / (INDEX_NAME + TMP_SUFFIX)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            header = _INDEX_HEADER.pack(_INDEX_MAGIC, len(data), zlib.crc32(data))
            _write_all(fd, header + data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        self._fsync_dir()

    def load_index(self) -> dict[str, Any] | None:
        """The saved index body; ``None`` when there is none. Raises :class:`Corrupt`."""
        if self.dir is None or not self.persistent:
            return None
        path = self.dir / INDEX_NAME
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Corrupt(f"index {path} cannot be read: {exc}") from exc
        if len(raw) < _INDEX_HEADER.size:
            raise Corrupt(f"index {path} is truncated ({len(raw)} bytes)")
        magic, length, crc = _INDEX_HEADER.unpack_from(raw)
        body = raw[_INDEX_HEADER.size:]
        if magic != _INDEX_MAGIC:
            raise Corrupt(f"index {path} is not an overmind-lab index (bad magic)")
        if len(body) != length:
            raise Corrupt(f"index {path} has {len(body)} body bytes, {length} expected "
                          "(truncated or torn)")
        if zlib.crc32(body) != crc:
            raise Corrupt(f"index {path} does not match its checksum")
        try:
            value = json.loads(body)
        except ValueError as exc:
            raise Corrupt(f"index {path} is not valid JSON: {exc}") from exc
        if not isinstance(value, dict) or value.get("version") != FORMAT_VERSION:
            raise Corrupt(f"index {path} has format version "
                          f"{value.get('version') if isinstance(value, dict) else '?'}, "
                          f"this daemon reads {FORMAT_VERSION}")
        return value

    def release(self, seg: Segment) -> None:
        """Close a segment's descriptors, keeping its file (the daemon stops)."""
        for fd in (seg.fd, seg.writer_fd):
            if fd >= 0:
                os.close(fd)
        seg.fd = seg.writer_fd = -1


def footprint(seg: Segment) -> int:
    """What a segment costs where it lives: file bytes with the trailer, or memfd bytes."""
    if seg.tier == "link":
        return seg.size  # blocks shared with the source file while it exists
    return file_bytes(seg.size) if seg.tier == "file" else max(seg.size, 1)


def file_bytes(size: int) -> int:
    """The size of the file of a segment of ``size`` data bytes."""
    return _align(max(size, 1)) + PAGE


def resident_bytes(fd: int, size: int) -> int | None:
    """Bytes of ``fd``'s first ``size`` bytes now in memory (page cache or shmem)."""
    if size <= 0:
        return 0
    rng = (ctypes.c_uint64 * 2)(0, size)
    out = (ctypes.c_uint64 * 5)()
    if _libc is not None and _libc.syscall(_SYS_CACHESTAT, fd, rng, out, 0) == 0:
        return min(int(out[0]) * PAGE, size)
    return None  # kernels before 6.5 have no cachestat: unknown


_SYS_CACHESTAT = 451  # the same number on every architecture (generic syscall table)
try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not glibc/musl
    _libc = None


# -- helpers ----------------------------------------------------------------------------
def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _trailer(size: int, crc: int) -> bytes:
    fields = _TRAILER.pack(_SEG_MAGIC, FORMAT_VERSION, size, crc)
    return (fields + struct.pack(">I", zlib.crc32(fields))).ljust(PAGE, b"\0")


def _parse_trailer(raw: bytes, path: Path) -> tuple[int, int]:
    if len(raw) < _TRAILER.size + 4:
        raise Corrupt(f"segment file {path} has no trailer")
    fields = raw[:_TRAILER.size]
    (check,) = struct.unpack_from(">I", raw, _TRAILER.size)
    magic, version, size, crc = _TRAILER.unpack(fields)
    if magic != _SEG_MAGIC or zlib.crc32(fields) != check:
        raise Corrupt(f"segment file {path} has no valid trailer (overwritten or torn)")
    if version != FORMAT_VERSION:
        raise Corrupt(f"segment file {path} has format version {version}")
    return int(size), int(crc)


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
