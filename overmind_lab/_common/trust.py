"""Whom a client believes: the folder a socket lives in, the process that answers on it, and the
files read from that folder. Every client of ours (the loading process, the CLI, the Jupyter
server's provisioner, the launcher) goes through here before it sends a byte.

Note [Trust no neighbour]: the daemon and the zygote refuse a peer of another uid, but a client
must refuse a *server* of another uid too. With the socket in a folder another user can write
(``OVERMIND_LAB_SOCKET=/tmp/shared/d.sock``), that user can bind the name first (before the
user's first load, or after any ``stop``) and receive every request: a kernel launch carries the
Jupyter server's whole environment (tokens, keys) and the kernel's stdio descriptors, ``status``
would believe forged replies, and a forged hit would be unpickled here. The rule, the same for the
daemon's and the zygote's sockets and for the files beside them (the learned modules, the
not-answering mark):

1. The folder that holds the socket is ours (owner uid = ours) and no one else can write it
   (no write bit for others, nor for a group with other members; a sticky bit does not help:
   it stops removal, not a name taken first). The folders above it must not let another user
   swap it (the cache directory's rule: theirs, or writable by them without the sticky bit).
2. The process listening on the socket runs as our uid: ``SO_PEERCRED`` on the connected
   socket (the listener's credentials as of its ``listen``), checked before the first byte is
   sent.
3. A file read from that folder is opened without following links and is ours and not
   writable by others (checked on the open descriptor).

A folder or server that fails is refused with an error that names it, why, and what to do;
the load then goes plain (one warning), the CLI exits non-zero. Root's own folders count as
root's; another user's root-owned folder is not ours (an administrator may make one, but then
``OVERMIND_LAB_SOCKET`` must point into a folder of the user's own).
"""

from __future__ import annotations

import functools
import os
import socket
import stat
from pathlib import Path

from overmind_lab._common.naming import SOCKET_ENV
from overmind_lab._common.protocol import peer_credentials
from overmind_lab._errors import OvermindError

__all__ = ["Untrusted", "check_folder", "check_server", "open_private", "replaceable_above",
           "others_can_replace"]


class Untrusted(OvermindError, PermissionError):
    """A socket folder, a server or a file that another user could control."""


def check_folder(folder: Path, what: str = "socket") -> None:
    """Raise :class:`Untrusted` unless ``folder`` is ours and only we can write it or swap it
    (Note [Trust no neighbour], rules 1). A folder that does not exist yet passes (whoever
    creates it checks again)."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise Untrusted(f"cannot check the {what} folder {folder}: {exc}") from exc
    me = os.getuid()
    why = None
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        why = "is not a folder"
    elif st.st_uid != me:
        why = f"belongs to uid {st.st_uid}, not to you (uid {me})"
    elif mode & 0o002:
        why = f"can be written by every user (mode {mode:04o})"
    elif mode & 0o020 and others_in_group(st.st_gid):
        why = f"can be written by the other users of group {st.st_gid} (mode {mode:04o})"
    if why is None:
        above = replaceable_above(folder / "x")
        if above is not None:
            raise Untrusted(f"refusing the {what} folder {folder}: it lies in {above[0]}, "
                            f"which {above[1]}: that user could swap it for one of theirs; "
                            f"{_remedy()}")
        return
    raise Untrusted(f"refusing the {what} folder {folder}: it {why}, so another user could "
                    f"bind the {what}'s name first and receive your requests; {_remedy()}")


def check_server(sock: socket.socket, path: Path, what: str = "daemon") -> int:
    """The pid of the process listening on the connected ``sock``; raise :class:`Untrusted` when
    it runs as another uid (Note [Trust no neighbour], rule 2)."""
    pid, uid, _gid = peer_credentials(sock)
    me = os.getuid()
    if uid != me:
        raise Untrusted(f"refusing the {what} on {path}: it runs as uid {uid} (pid {pid}), "
                        f"not as you (uid {me}); another user bound that name. Nothing was "
                        f"sent to it. {_remedy()}")
    return pid


def open_private(path: Path) -> int | None:
    """A read-only descriptor of ``path`` when it is a regular file of ours that no one else can
    write (Note [Trust no neighbour], rule 3); ``None`` when it is missing or not trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    st = os.fstat(fd)
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o002
            or (st.st_mode & 0o020 and others_in_group(st.st_gid))):
        os.close(fd)
        return None
    return fd


def replaceable_above(path: Path) -> tuple[Path, str] | None:
    """The first folder above ``path`` (as named, or as its links lead) whose entries another
    user could rename or remove, and why (theirs, non-root; or writable by them without the
    sticky bit); ``None`` when there is none. A folder that does not exist yet (made later, by
    us) or cannot be searched (nothing there to replace) is passed over."""
    seen: set[str] = set()
    for start in (path.parent, Path(os.path.realpath(path.parent))):
        for folder in (start, *start.parents):
            if str(folder) in seen:
                continue
            seen.add(str(folder))
            try:
                st = os.stat(folder)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            except OSError as exc:
                return folder, f"cannot be checked ({exc})"
            why = others_can_replace(st)
            if why is not None:
                return folder, why
    return None


def others_can_replace(st: os.stat_result) -> str | None:
    """Why another user could rename or remove what a folder with status ``st`` holds."""
    if st.st_uid not in (0, os.getuid()):
        return f"uid {st.st_uid} owns"
    if st.st_mode & stat.S_ISVTX:
        return None  # sticky: only a file's owner may rename or delete it
    if st.st_mode & 0o002:
        return f"every user can write (mode {stat.S_IMODE(st.st_mode):04o}, no sticky bit)"
    if st.st_mode & 0o020 and others_in_group(st.st_gid):
        return (f"the users of group {st.st_gid} can write (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, no sticky bit)")
    return None


@functools.lru_cache(maxsize=64)
def others_in_group(gid: int) -> bool:
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


def _remedy() -> str:
    return (f"set {SOCKET_ENV} to a path in a folder only you can write (or unset it: the "
            "default is a private folder in $XDG_RUNTIME_DIR or /tmp/overmind-lab-<uid>)")
