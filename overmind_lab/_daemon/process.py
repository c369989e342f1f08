"""Running the daemon as a process: ``overmind-lab serve`` in the foreground or detached.

A lifetime ``flock`` beside the socket proves which daemon owns it (a free lock: a dead
daemon's socket, replaced). ``--detach`` double-forks, ``setsid``, stdio to the log, no
inherited descriptor, and returns once the daemon listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import resource
import socket
import sys
from pathlib import Path

from overmind_lab._common.naming import (
    default_cache_dir,
    ensure_private_dir,
    lock_path,
    log_path,
    runtime_dir,
    socket_path,
)
from overmind_lab._common.protocol import bind_private
from overmind_lab._common.sizes import parse_size
from overmind_lab._daemon.server import Daemon, default_budget
from overmind_lab._daemon.store import CacheDirRefused, check_cache_dir

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
        daemon = Daemon(path, budget, cache_dir or default_cache_dir())
    except CacheDirRefused as exc:
        print(f"overmind-lab serve: {exc}", file=sys.stderr)
        os.close(lock)
        return 2
    sock = _bind(path)
    bound = os.stat(path)  # Note [Removing our own socket]
    from overmind_lab._daemon import refresh as _refresh

    _refresh.attach(daemon)
    if ready_fd is not None:
        os.write(ready_fd, b"started\n")
        os.close(ready_fd)
    try:
        asyncio.run(daemon.serve(sock))
    finally:
        # Note [Removing our own socket]: only the file this daemon bound (the path's inode
        # as right after ``bind``; the socket's own is a sockfs inode) is removed, never a
        # successor's. More in docs/notes.md.
        with contextlib.suppress(OSError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
                path.unlink()
        sock.close()
        os.close(lock)
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


def serve_command(args: argparse.Namespace) -> int:
    path = socket_path(args.socket)
    try:
        budget = parse_size(args.budget) if args.budget else default_budget()
    except ValueError as exc:
        print(f"overmind-lab serve: {exc}", file=sys.stderr)
        return 2
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:  # refuse an unsafe cache directory here, where the user sees why
        check_cache_dir(cache_dir)
    except CacheDirRefused as exc:
        print(f"overmind-lab serve: {exc}", file=sys.stderr)
        return 2
    if args.detach:
        return detach(path, budget, cache_dir)
    _configure_logging()
    return run(path, budget, cache_dir=cache_dir)
