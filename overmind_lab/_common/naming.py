"""Names both sides agree on: where the daemon lives, environment variables, segment names.

The socket sits in a 0700 per-user directory (``$XDG_RUNTIME_DIR/overmind-lab/``, else
``/tmp/overmind-lab-<uid>/``); ``OVERMIND_LAB_SOCKET`` overrides it.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from overmind_lab._common.zygote_identity import (
    DAEMON_SOCKET,
    SOCKET_ENV,
    daemon_socket_at_once,
    runtime_dir_at_once,
)

__all__ = [
    "SOCKET_ENV", "BUDGET_ENV", "CACHE_DIR_ENV", "MEMFD_PREFIX", "SEGMENT_SEALS",
    "default_cache_dir",
    "socket_path", "runtime_dir", "ensure_private_dir", "lock_path", "log_path",
]

BUDGET_ENV = "OVERMIND_LAB_BUDGET"
CACHE_DIR_ENV = "OVERMIND_LAB_CACHE_DIR"
#: A memfd segment (the fallback tier) is named ``overmind-lab:<segment id>``: the daemon finds
#: holders by it (segment files by their path in the cache directory).
MEMFD_PREFIX = "overmind-lab:"
#: The seals a writer adds to a finished segment and the daemon requires before it keeps one.
SEGMENT_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def default_cache_dir() -> Path:
    """``$OVERMIND_LAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/overmind-lab`` (~/.cache)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "overmind-lab"


def runtime_dir() -> Path:
    """The per-user directory that holds the default socket, lock and log."""
    found = runtime_dir_at_once(os.environ)
    if found is not None:
        return Path(found)
    import tempfile  # the temporary folder's rules: TMPDIR, TEMP, TMP, then the first usable

    return Path(tempfile.gettempdir()) / f"overmind-lab-{os.getuid()}"


def socket_path(override: str | os.PathLike[str] | None = None) -> Path:
    """The daemon socket: ``override``, else ``$OVERMIND_LAB_SOCKET``, else the default."""
    if override is not None:
        return Path(override)
    found = daemon_socket_at_once(os.environ)
    return Path(found) if found is not None else runtime_dir() / DAEMON_SOCKET


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` as a 0700 directory owned by us, or refuse one that is not."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(
            f"{path} is not a directory owned by uid {os.getuid()}; "
            f"remove it or set {SOCKET_ENV} to a socket path in a directory you own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077 and path.name.startswith("overmind-lab"):
        os.chmod(path, 0o700)


# Note [Lifetime lock]: a daemon holds an exclusive ``flock`` on ``<socket>.lock`` from before it
# binds until it exits (the kernel drops it however it dies). Whoever takes the lock knows a socket
# file found is stale and may unlink it; whoever cannot knows a live daemon, even one starting,
# owns it. The socket alone proves nothing: connect() also fails before a daemon's listen().
def lock_path(socket: Path) -> Path:
    """The daemon's lifetime lock beside its socket (``Note [Lifetime lock]``)."""
    return socket.with_name(socket.name + ".lock")


def log_path(socket: Path) -> Path:
    """The detached daemon's log beside its socket."""
    return socket.with_name(socket.name + ".log")
