"""The cache directory: created private, checked, refused when another user could read or
replace what it holds (``store`` uses the descriptor :func:`open_cache_dir` returns)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from overmind_lab._common.naming import CACHE_DIR_ENV

__all__ = ["CacheDirRefused", "FALLBACK_FILESYSTEMS", "check_cache_dir", "open_cache_dir",
           "unsafe_parent", "filesystem_type"]

#: File systems whose pages are not worth a file (tmpfs: shmem, 4 KiB pages, no disk) or
#: not reliably ours (network and FUSE file systems change under us, may not fsync).
FALLBACK_FILESYSTEMS = frozenset({
    "tmpfs", "ramfs", "devtmpfs", "nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse",
    "fuseblk", "9p", "virtiofs", "ceph", "glusterfs", "afs", "sshfs",
})


class CacheDirRefused(Exception):
    """The cache directory is unsafe to use (wrong owner, wrong mode, not a directory)."""


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
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CacheDirRefused(f"the cache directory {path} is not a directory (a "
                                  f"symbolic link or a file); remove it or set "
                                  f"{CACHE_DIR_ENV}") from exc
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


def unsafe_parent(path: Path) -> str | None:
    """Why another user could replace ``path`` (or a folder above it, or one its links
    lead to): writable by them without the sticky bit, or theirs (non-root); else ``None``."""
    seen: set[str] = set()
    for start in (path.parent, Path(os.path.realpath(path.parent))):
        for folder in (start, *start.parents):
            if str(folder) in seen:
                continue
            seen.add(str(folder))
            try:
                st = os.stat(folder)
            except FileNotFoundError:
                continue  # created below, by us, with our umask
            except OSError as exc:
                return f"cannot check {folder}, above the cache directory {path}: {exc}"
            why = _others_can_replace(folder, st)
            if why is not None:
                return (f"the cache directory {path} lies in {folder}, which {why}: that "
                        f"user could swap it for a directory of theirs and read or replace "
                        f"cached models; set {CACHE_DIR_ENV} to a directory only you can "
                        "change")
    return None


def _others_can_replace(folder: Path, st: os.stat_result) -> str | None:
    if st.st_uid not in (0, os.getuid()):
        return f"uid {st.st_uid} owns"
    if st.st_mode & stat.S_ISVTX:
        return None  # sticky: only a file's owner may rename or delete it
    if st.st_mode & 0o002:
        return f"every user can write (mode {stat.S_IMODE(st.st_mode):04o}, no sticky bit)"
    if st.st_mode & 0o020 and _others_in_group(st.st_gid):
        return (f"the users of group {st.st_gid} can write (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, no sticky bit)")
    return None


def _others_in_group(gid: int) -> bool:
    """Whether a user other than us is in group ``gid`` (a private group has none)."""
    import grp
    import pwd

    me = os.getuid()
    try:
        names = set(grp.getgrgid(gid).gr_mem)
        mine = pwd.getpwuid(me).pw_name
    except KeyError:
        return gid != os.getgid()
    if names - {mine}:
        return True
    return any(p.pw_gid == gid and p.pw_uid != me for p in pwd.getpwall())


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
