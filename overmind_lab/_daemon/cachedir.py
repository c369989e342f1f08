"""The cache directory: created private, checked, refused when another user could read or
replace what it holds (``store`` uses the descriptor :func:`open_cache_dir` returns)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from overmind_lab._common.naming import CACHE_DIR_ENV
from overmind_lab._common.trust import replaceable_above

__all__ = ["CacheDirRefused", "CacheDirUnavailable", "FALLBACK_FILESYSTEMS", "check_cache_dir",
           "open_cache_dir", "unsafe_parent", "filesystem_type"]

#: File systems whose pages are not worth a file (tmpfs: shmem, 4 KiB pages, no disk) or
#: not reliably ours (network and FUSE file systems change under us, may not fsync).
FALLBACK_FILESYSTEMS = frozenset({
    "tmpfs", "ramfs", "devtmpfs", "nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse",
    "fuseblk", "9p", "virtiofs", "ceph", "glusterfs", "afs", "sshfs",
})


class CacheDirRefused(Exception):
    """The cache directory is unsafe to use (wrong owner, wrong mode, not a directory)."""


class CacheDirUnavailable(CacheDirRefused):
    """The cache directory cannot be created: a read-only home, a parent we may not write.

    Note [A cache directory that cannot be made]: nothing unsafe, only impossible, so the
    daemon runs on the memory tier with one warning (``Store``) rather than refusing to start
    (every load would then be plain, against the README's promise of a memory-tier fallback).
    An *unsafe* directory (another owner, an open mode, a symbolic link, a parent others can
    replace) is still refused: running beside it is no fix. It subclasses ``CacheDirRefused`` so
    that a caller that knows only refusals keeps refusing."""


#: What ``mkdir`` or ``open`` of the cache directory fails with when it merely cannot be made
#: (Note [A cache directory that cannot be made]): no permission, a read-only file system, a
#: parent that is a file.
_CANNOT_MAKE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR})


def check_cache_dir(path: Path) -> None:
    """Create ``path`` 0700 if missing; refuse one that is not ours and private."""
    os.close(open_cache_dir(path))


def open_cache_dir(path: Path) -> int:
    """A descriptor of the cache directory (created 0700 if missing) once it passed its
    checks; raises :class:`CacheDirRefused` with what to do."""
    path = Path(os.path.abspath(path))
    why = unsafe_parent(path)
    if why is not None:
        raise CacheDirRefused(why)
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError as exc:  # a parent is a file: ENOTDIR below it
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                     str(path.parent)) from exc
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _exists(path)):
            raise CacheDirRefused(f"the cache directory {path} is not a directory (a "
                                  f"symbolic link or a file); remove it or set "
                                  f"{CACHE_DIR_ENV}") from exc
        if exc.errno in _CANNOT_MAKE:
            raise CacheDirUnavailable(f"the cache directory {path} cannot be created "
                                      f"({exc.strerror}); set {CACHE_DIR_ENV} to a directory "
                                      "you can write") from exc
        raise CacheDirRefused(f"cannot create the cache directory {path}: {exc}; set "
                              f"{CACHE_DIR_ENV} to a directory you own") from exc
    st = os.fstat(fd)
    why = None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        why = (f"the cache directory {path} is owned by uid {st.st_uid}, not by uid "
               f"{os.getuid()}; remove it or set {CACHE_DIR_ENV} to a directory you own")
    elif mode & 0o077:
        why = (f"the cache directory {path} has mode {mode:04o}; other users could read or "
               f"replace cached models: run `chmod 700 {path}` or set {CACHE_DIR_ENV}")
    if why is not None:
        os.close(fd)
        raise CacheDirRefused(why)
    return fd


def _exists(path: Path) -> bool:
    """Whether ``path`` itself names something (a file, a link): not a parent that is a file."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def unsafe_parent(path: Path) -> str | None:
    """Why another user could replace ``path`` (or a folder above it, or one its links
    lead to): writable by them without the sticky bit, or theirs (non-root); else ``None``
    (the rule of ``_common/trust.py``, Note [Trust no neighbour])."""
    above = replaceable_above(path)
    if above is None:
        return None
    folder, why = above
    return (f"the cache directory {path} lies in {folder}, which {why}: that user could swap "
            f"it for a directory of theirs and read or replace cached models; set "
            f"{CACHE_DIR_ENV} to a directory only you can change")


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
