"""Running the daemon as a process: ``overmind-lab serve`` in the foreground or detached.

A lifetime ``flock`` beside the socket proves which daemon owns it (a free lock: a dead
daemon's socket, replaced). ``--detach`` double-forks, ``setsid``, stdio to the log, no
inherited descriptor, and returns once the daemon listens. While it runs, the daemon checks
that its socket path still names its socket (``Place``: Note [A socket path that moved]) and
that the package it runs from is still installed (``Package``: Note [A daemon whose package is
gone]).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import resource
import socket
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import argparse

from overmind_lab._common.naming import (
    default_cache_dir,
    ensure_private_dir,
    lock_path,
    log_path,
    runtime_dir,
    socket_path,
)
from overmind_lab._common.protocol import bind_private
from overmind_lab._common.sizes import env_seconds, parse_size
from overmind_lab._common.trust import check_folder
from overmind_lab._daemon.server import Daemon, default_budget
from overmind_lab._daemon.store import CacheDirRefused, CacheDirUnavailable, check_cache_dir

__all__ = ["run", "detach", "add_serve_arguments", "serve_command", "log_path"]

log = logging.getLogger("overmind_lab.daemon")


def _take_lifetime_lock(path: Path) -> int | None:
    """The daemon's own lock: held for its whole life, proves a socket is not stale."""
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


#: Note [A socket path that moved]: how often the daemon checks its socket path (seconds;
#: ``$OVERMIND_LAB_DAEMON_SOCKET_CHECK``).
SOCKET_CHECK_SECONDS = 0.5
SOCKET_CHECK_ENV = "OVERMIND_LAB_DAEMON_SOCKET_CHECK"
#: Note [A daemon whose package is gone]: how often it checks its package (seconds;
#: ``$OVERMIND_LAB_DAEMON_PACKAGE_CHECK``).
PACKAGE_CHECK_SECONDS = 10.0
PACKAGE_CHECK_ENV = "OVERMIND_LAB_DAEMON_PACKAGE_CHECK"
#: The log a detached daemon's stdout and stderr point to (``detach``), opened again where it
#: was when a check finds it gone with its folder.
_own_log: Path | None = None


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _lstat_id(path: Path) -> tuple[int, int, int] | None:
    """``(dev, ino, mode)`` of what ``path`` names now, or ``None`` when nothing does."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_mode


# Note [A socket path that moved]: a daemon is found by its path alone. A tmp cleaner that
# removes the socket file (or the whole runtime folder, lock and log with it) leaves a daemon
# nobody reaches: loads run plain, ``status`` and ``stop`` miss it, and a client that finds no
# socket starts a second daemon, which (the lock file gone) takes a new lock and runs beside
# the first on the memory tier (the cache directory's lock is the first's). So every
# ``SOCKET_CHECK_SECONDS`` the event loop compares the path with the file this daemon bound
# and the lock file with the one it holds (``Place.check``: two ``lstat``):
# - the socket file is missing: its folder is made again (0700; the default runtime folder
#   through ``ensure_private_dir``, which refuses one another user made), the lock taken again
#   if its file went too (a lock someone else holds now is a daemon starting on this name:
#   this one leaves), the path bound again (never unlinked first: a file there now is not
#   ours; EADDRINUSE waits for the next check), and the accept loop moves to the new socket
#   (``Daemon._listen``: connections queued on the old one are still served). The log is
#   opened again if it went with its folder.
# - the path names another file (a successor bound it, or anything else): this daemon stops
#   as ``stop`` does (index saved, segments and the cache directory's lock released, its
#   lifetime lock given up) and leaves that file alone (Note [Removing our own socket]). A
#   successor started meanwhile waits for the cache directory (Note [A successor waits for
#   the cache directory] in ``store``) and serves the file tier.
# - the lock file alone went: taken again, so that a daemon started later finds it held
#   rather than taking a fresh one and unlinking this daemon's live socket.
# So no name has two daemons for longer than a check period, nor a cache directory two users.
# ``bind_private`` narrows the process's umask while it binds: the threads that may run then
# create files with modes (0600, 0400) it does not narrow, and processes are spawned only by
# this thread.
class Place:
    """Where this daemon is found: the socket path, the file it bound there and its lifetime
    lock (Note [A socket path that moved]); a ``Watch`` of ``Daemon.serve``."""

    blocking = False  # it binds and swaps sockets: in the event loop's thread

    def __init__(self, path: Path, sock: socket.socket, lock: int) -> None:
        self.path, self.sock, self.lock = path, sock, lock
        self.bound: tuple[int, int] = _file_id(os.stat(path))
        self.locked: tuple[int, int] = _file_id(os.fstat(lock))
        self.default_dir = path.parent == runtime_dir()
        self.period = env_seconds(SOCKET_CHECK_ENV, SOCKET_CHECK_SECONDS)

    def check(self) -> socket.socket | str | None:
        """A new listening socket to accept on, why this daemon must stop, or ``None``."""
        there = _lstat_id(self.path)
        lock = _lstat_id(lock_path(self.path))
        if there is not None and there[:2] == self.bound:
            if lock is not None and lock[:2] == self.locked:
                return None  # the usual answer
            log.warning("the lock file %s is gone or replaced: taking it again",
                        lock_path(self.path))
            return self._relock(lock)
        _reopen_log()  # its last words, or what it does next, where the user looks
        if there is not None:
            what = ("another socket (another daemon bound it)" if stat.S_ISSOCK(there[2])
                    else "another file")
            return (f"the socket path {self.path} names {what}, not this daemon's socket: "
                    "this daemon stops and leaves it to its owner")
        log.warning("the socket %s is gone (a tmp cleaner?): binding it again", self.path)
        try:
            self._make_folder()
        except OSError as exc:
            return f"the socket {self.path} is gone and its folder cannot be made again: {exc}"
        why = self._relock(lock)
        if why is not None:
            return why
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            bind_private(sock, str(self.path), 128)
            bound = _file_id(os.stat(self.path))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                return None  # bound by another meanwhile: the next check sees by whom
            return f"the socket {self.path} is gone and cannot be bound again: {exc}"
        self.sock, self.bound = sock, bound
        log.info("listening on %s again (pid %d)", self.path, os.getpid())
        return sock

    def _make_folder(self) -> None:
        folder = self.path.parent
        if self.default_dir:
            ensure_private_dir(folder)  # refuses a folder another user made meanwhile
        elif not folder.is_dir():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _reopen_log()

    def _relock(self, there: tuple[int, int, int] | None) -> str | None:
        """Hold the lock file the path names now (``None``), or why not: a daemon holds it."""
        if there is not None and there[:2] == self.locked:
            return None
        try:
            fd = _take_lifetime_lock(self.path)
        except OSError as exc:
            return f"the lock file {lock_path(self.path)} cannot be taken again: {exc}"
        if fd is None:
            return (f"the lock {lock_path(self.path)} is held by another daemon (a new one "
                    "on this socket path): this daemon stops and leaves the path to it")
        os.close(self.lock)
        self.lock, self.locked = fd, _file_id(os.fstat(fd))
        return None


def _reopen_log() -> None:
    """A detached daemon whose log file was deleted (with its folder, by a tmp cleaner) writes
    at the log's path again, appending to a successor's if one made it meanwhile."""
    if _own_log is None:
        return
    try:
        if os.fstat(2).st_nlink > 0:
            return  # still in the folder
        fd = os.open(_own_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # its folder is not there (yet)
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    log.info("the log %s was deleted: writing it again", _own_log)


# Note [A daemon whose package is gone]: after ``pip uninstall overmind-lab`` (or its
# virtualenv deleted) a running daemon would go on holding the cache and a socket with code
# that is gone: nothing replaces it, no upgrade reaches it. So every
# ``PACKAGE_CHECK_SECONDS`` (in a thread) it checks the ``overmind_lab/__init__.py`` it was
# imported from, and stops as ``stop`` does once that is gone. Where an installed distribution
# owns that file (its RECORD lists it), also once the file at that path is another (an upgrade
# or a reinstall: the next client starts the new version's daemon) or the distribution's
# ``.dist-info`` is gone; where an editable install points at the folder, once its
# ``.dist-info`` is gone. A checkout on ``PYTHONPATH`` (no distribution owns its files) only
# once the file is missing: edits to a checkout never stop its daemon.
class Package:
    """The ``overmind_lab`` files this daemon runs from (Note [A daemon whose package is
    gone]); a ``Watch`` of ``Daemon.serve``."""

    blocking = True  # stat of a virtualenv's files, and importlib.metadata: in a thread

    def __init__(self) -> None:
        import overmind_lab

        self.init = Path(os.path.abspath(str(overmind_lab.__file__)))
        try:
            self.identity: tuple[int, int] | None = _file_id(os.stat(self.init))
        except OSError:  # not a plain file (a zip import): nothing to watch
            self.identity = None
        self.period = env_seconds(PACKAGE_CHECK_ENV, PACKAGE_CHECK_SECONDS)
        self.kind: str | None = None  # "installed", "editable" or "checkout", at first check
        self.dist_info: Path | None = None

    def check(self) -> str | None:
        """Why this daemon must stop (its package is gone), or ``None``."""
        if self.identity is None:
            return None
        if self.kind is None:
            self.kind, self.dist_info = _distribution_of(self.init)
            log.info("runs from %s (%s%s)", self.init.parent, self.kind,
                     f", {self.dist_info}" if self.dist_info else "")
        try:
            st = os.stat(self.init)
        except (FileNotFoundError, NotADirectoryError):
            return (f"the overmind_lab package this daemon runs from ({self.init.parent}) is "
                    "gone (uninstalled?)")
        except OSError:
            return None  # cannot tell now
        if self.kind == "installed" and _file_id(st) != self.identity:
            return (f"{self.init} was replaced (an upgrade or a reinstall): the next client "
                    "starts the daemon of the version installed now")
        if self.dist_info is not None and not self.dist_info.is_dir():
            return f"{self.dist_info} is gone (pip uninstall)"
        return None


def _distribution_of(init: Path) -> tuple[str, Path | None]:
    """How ``overmind_lab/__init__.py`` at ``init`` is installed: ``("installed", dist-info)``
    (a distribution's RECORD lists it), ``("editable", dist-info)`` (an editable install of
    the folder holding it), else ``("checkout", None)``."""
    import importlib.metadata  # here, in the watch's thread: 17 ms of a start otherwise
    from urllib.parse import unquote, urlparse

    here = os.path.realpath(init)
    try:
        dists = list(importlib.metadata.distributions(name="overmind-lab"))
    except Exception:  # a broken metadata folder must not stop the daemon
        log.info("could not read the installed distributions", exc_info=True)
        return "checkout", None
    for dist in dists:
        files = list(dist.files or [])
        info = next((Path(str(dist.locate_file(f.parts[0]))) for f in files
                     if f.parts and f.parts[0].endswith(".dist-info")), None)
        if info is None:
            continue
        if any(f.as_posix() == "overmind_lab/__init__.py"
               and os.path.realpath(str(dist.locate_file(f))) == here for f in files):
            return "installed", info
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        url = urlparse(str(direct.get("url", "")))
        if direct.get("dir_info", {}).get("editable") and url.scheme == "file":
            root = os.path.realpath(unquote(url.path))
            if here.startswith(root.rstrip("/") + "/"):
                return "editable", info
    return "checkout", None


def _bind(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        path.unlink()  # stale: we hold the lifetime lock, so its daemon is gone
    except FileNotFoundError:
        pass
    bind_private(sock, str(path), 128)
    return sock


def _prepare_dir(path: Path) -> None:
    if path.parent == runtime_dir():
        ensure_private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)


def _raise_descriptor_limit() -> None:
    """The soft ``RLIMIT_NOFILE`` up to the hard one: each segment holds a descriptor
    (Note [Descriptor budget] in ``index``), and a soft limit of 1024 is common."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:
            log.info("could not raise the descriptor limit from %d: %s", soft, exc)


def run(path: Path, budget: int, ready_fd: int | None = None,
        cache_dir: Path | None = None) -> int:
    """Run a daemon on ``path`` until stopped. Returns the exit status."""
    _prepare_dir(path)
    lock = _take_lifetime_lock(path)
    if lock is None:
        print(f"overmind-lab: a daemon is already running on {path}", file=sys.stderr)
        if ready_fd is not None:
            os.write(ready_fd, b"running\n")
            os.close(ready_fd)
        return 0
    _raise_descriptor_limit()
    try:
        package = Package()
        daemon = Daemon(path, budget, cache_dir or default_cache_dir())
    except CacheDirRefused as exc:
        print(f"overmind-lab serve: {exc}", file=sys.stderr)
        os.close(lock)
        return 2
    place = Place(path, _bind(path), lock)  # Note [Removing our own socket]: what we bound
    from overmind_lab._daemon import refresh as _refresh

    _refresh.attach(daemon)
    if ready_fd is not None:
        os.write(ready_fd, b"started\n")
        os.close(ready_fd)
    try:
        asyncio.run(daemon.serve(place.sock, watches=(place, package)))
    finally:
        # Note [Removing our own socket]: only the file this daemon bound (the path's inode
        # as right after ``bind``, or after a bind again: Note [A socket path that moved];
        # the socket's own is a sockfs inode) is removed, never a successor's. More in
        # docs/notes.md.
        with contextlib.suppress(OSError):
            if _file_id(os.stat(path)) == place.bound:
                path.unlink()
        place.sock.close()
        os.close(place.lock)
    return 0


def detach(path: Path, budget: int, cache_dir: Path | None = None) -> int:
    """Start a daemon fully detached (double fork, setsid), return once it listens."""
    _prepare_dir(path)
    read_end, write_end = os.pipe()
    if os.fork() > 0:  # the caller: wait for the grandchild to say it is ready
        os.close(write_end)
        with os.fdopen(read_end, "rb") as f:
            answer = f.readline().strip()
        if answer not in (b"started", b"running"):
            print(f"overmind-lab: the daemon did not start; see {log_path(path)}",
                  file=sys.stderr)
            return 1
        return 0
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    global _own_log
    _own_log = log_path(path)
    logfd = os.open(log_path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    nullfd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nullfd, 0)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    os.close(nullfd)
    os.close(logfd)
    os.chdir("/")
    _configure_logging()
    try:
        status = run(path, budget, ready_fd=write_end, cache_dir=cache_dir)
    except BaseException:
        log.exception("daemon failed")
        status = 1
    os._exit(status)


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", help="socket path (default: $OVERMIND_LAB_SOCKET or "
                                         "the per-user runtime directory)")
    parser.add_argument("--budget", help="memory budget, e.g. 12GiB or 40%% "
                                         "(default: $OVERMIND_LAB_BUDGET or 50%% of RAM)")
    parser.add_argument("--cache-dir", help="where segments and the index live (default: "
                                            "$OVERMIND_LAB_CACHE_DIR or "
                                            "$XDG_CACHE_HOME/overmind-lab)")
    parser.add_argument("--detach", action="store_true",
                        help="run in the background, detached from this terminal")


class ServeArgs(Protocol):
    """What ``serve_command`` reads: ``cli``'s parsed arguments, or ``__main__``'s."""
    socket: str | None
    budget: str | None
    cache_dir: str | None
    detach: bool


def serve_command(args: ServeArgs) -> int:
    path = socket_path(args.socket)
    try:
        budget = parse_size(args.budget) if args.budget else default_budget()
    except ValueError as exc:
        print(f"overmind-lab serve: {exc}", file=sys.stderr)
        return 2
    try:  # Note [Trust no neighbour]: no client would believe a daemon there
        _prepare_dir(path)
        check_folder(path.parent)
    except OSError as exc:
        print(f"overmind-lab serve: {exc}", file=sys.stderr)
        return 2
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:  # refuse an unsafe cache directory here, where the user sees why
        check_cache_dir(cache_dir)
    except CacheDirUnavailable:
        pass  # Note [A cache directory that cannot be made]: the daemon logs its memory tier
    except CacheDirRefused as exc:
        print(f"overmind-lab serve: {exc}", file=sys.stderr)
        return 2
    if args.detach:
        return detach(path, budget, cache_dir)
    _configure_logging()
    return run(path, budget, cache_dir=cache_dir)
