"""Talking to the per-user daemon: :class:`Client` for management, :class:`Session` for loads. Every
socket operation has a timeout; OS errors become :class:`~overmind_lab.DaemonUnavailable` or
:class:`~overmind_lab.ProtocolError` here. The first client that finds no daemon starts one (``serve
--detach``) under a start lock, so racing clients end with exactly one daemon. Before a byte is
sent, the socket's folder and the listening process are checked (Note [Trust no neighbour] in
``_common/trust.py``), and a daemon that does not answer is given up on quickly (Note [A daemon
that does not answer]).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

from overmind_lab._common.naming import SOCKET_ENV, socket_path
from overmind_lab._common.protocol import Channel, Frame
from overmind_lab._common.sizes import env_seconds
from overmind_lab._common.trust import Untrusted, check_folder, check_server, open_private
from overmind_lab._errors import (
    DaemonUnavailable,
    ErrorKind,
    NotAnswering,
    OvermindError,
    ProtocolError,
    UnknownEntry,
)

if TYPE_CHECKING:
    from overmind_lab._common.messages import (
        EntryJson,
        EvictReply,
        HitReply,
        LeaseReply,
        LinkReply,
        ListReply,
        Op,
        RefreshReply,
        ReportRequest,
        Request,
        ReserveReply,
        SourceRecord,
        Status,
        StatusReply,
        StopReply,
        StoreReply,
        StoreRequest,
        WireEntry,
    )

__all__ = ["Client", "Session", "UNSETTLED"]

#: Status counts of work the daemon still does on what it stored: segments being finished
#: and the index not yet saved, copies of held files being made, refolds running.
UNSETTLED = ("unsaved", "copying", "refold_passes")

TIMEOUT = 30.0
START_TIMEOUT = 30.0
WAIT_ENV = "OVERMIND_LAB_WAIT_TIMEOUT"
#: Note [A daemon that does not answer]: the deadline for the connection and the first reply.
ANSWER_ENV = "OVERMIND_LAB_ANSWER_TIMEOUT"
ANSWER_TIMEOUT = 2.0
#: How long a daemon found silent (and not stopped) is skipped before it is asked again.
SILENT_RETRY = 30.0


class Client:
    """A connection factory for the daemon at ``socket_path`` (default: the user's).

    >>> from overmind_lab import Client
    >>> Client().status()["running"]   # doctest: +SKIP
    True
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *,
                 timeout: float = TIMEOUT) -> None:
        self.path: Path = _resolve(socket_path)
        self.timeout = timeout
        #: set when this client started a daemon over the stale socket of a dead one
        self.replaced_dead_daemon = False
        #: the daemon's pid as its socket says (``SO_PEERCRED``), once connected
        self.server_pid: int | None = None

    def __repr__(self) -> str:
        return f"Client({str(self.path)!r})"

    # -- connections --------------------------------------------------------------------
    def connect(self, *, start: bool = False) -> Channel:
        """A channel to the daemon, starting the daemon first when ``start``."""
        try:
            return self._connect()
        except NotAnswering:
            raise  # one is running: starting another would only find it
        except DaemonUnavailable as exc:
            if not start or isinstance(exc.__cause__, Untrusted):
                raise  # never start a daemon where another user could be listening
        self._spawn()
        return self._connect()

    def _connect(self) -> Channel:
        try:  # Note [Trust no neighbour]: the folder first, the listener before a byte is sent
            check_folder(self.path.parent)
        except Untrusted as exc:
            raise DaemonUnavailable(str(exc)) from exc
        silent = _silent_daemon(self.path)
        if silent is not None:  # Note [A daemon that does not answer]
            raise _not_answering(self.path, silent)
        answer = min(self.timeout, answer_timeout())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(answer)
        try:
            sock.connect(str(self.path))
            self.server_pid = check_server(sock, self.path)
        except Untrusted as exc:
            sock.close()
            raise DaemonUnavailable(str(exc)) from exc
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonUnavailable(f"no overmind-lab daemon is listening on {self.path}") from exc
        except PermissionError as exc:
            sock.close()
            raise DaemonUnavailable(f"permission denied on {self.path}: the daemon belongs "
                                    "to another user") from exc
        except TimeoutError as exc:  # a full backlog: nobody accepts
            sock.close()
            raise _not_answering(self.path, None) from exc
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to {self.path}: {exc}") from exc
        return _DaemonChannel(sock, self.timeout, answer, self.path, self.server_pid)

    def request(self, op: Op, *, start: bool = False, **fields: object) -> Frame:
        """Send one request and return its reply; raises on ``ok: false``."""
        chan = self.connect(start=start)
        try:
            return call(chan, {"op": op, **fields})[0]
        finally:
            chan.close()

    def _spawn(self) -> None:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock_fd = os.open(self.path.with_name(self.path.name + ".start"),
                              os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DaemonUnavailable(f"cannot start a daemon on {self.path}: {exc}") from exc
        _start_locks.add(lock_fd)
        try:
            _flock(lock_fd, START_TIMEOUT)
            try:  # someone else may have started it while we waited for the lock
                self._connect().close()
                return
            except NotAnswering:
                raise
            except DaemonUnavailable:
                pass
            stale = self.path.exists()
            # the daemon's own entry, not the CLI's: Note [A daemon that starts at once]
            cmd = [sys.executable, "-m", "overmind_lab._daemon", "serve", "--detach",
                   "--socket", str(self.path)]
            try:
                proc = subprocess.run(cmd, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      timeout=START_TIMEOUT, env=_daemon_env(),
                                      close_fds=True)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise DaemonUnavailable(f"could not start the daemon: {exc}") from exc
            if proc.returncode != 0:
                raise DaemonUnavailable(
                    f"could not start the daemon (exit {proc.returncode}): "
                    f"{proc.stderr.decode(errors='replace').strip()}")
            self.replaced_dead_daemon = stale
        finally:
            _start_locks.discard(lock_fd)
            os.close(lock_fd)

    # -- management API -----------------------------------------------------------------
    def status(self) -> Status:
        """Daemon status; ``{"running": False, ...}`` when no daemon runs (never raises)."""
        try:
            return _status(cast("StatusReply", self.request("status")))
        except NotAnswering as exc:
            silent: Status = {"running": False, "socket": str(self.path), "error": str(exc),
                              "not_answering": True}
            if exc.pid is not None:
                silent["pid"] = exc.pid
            return silent
        except (DaemonUnavailable, ProtocolError) as exc:
            return {"running": False, "socket": str(self.path), "error": str(exc)}

    def wait_settled(self, timeout: float, also: tuple[str, ...] = ()) -> Status:
        """Poll :meth:`status` every 50 ms until none of ``UNSETTLED`` (and ``also``) counts
        anything, or ``timeout`` s passed; the last status."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if not any(status.get(k) for k in (*UNSETTLED, *also)) or \
                    time.monotonic() >= deadline:
                return status
            time.sleep(0.05)

    def entries(self) -> list[EntryJson]:
        """Every cache entry with its statistics, most recently used first."""
        return list(cast("ListReply", self.request("list"))["entries"])

    def evict(self, key: str) -> list[str]:
        """Evict the entry with this key (or unique key prefix, or exact name)."""
        return list(cast("EvictReply", self.request("evict", key=key))["evicted"])

    def evict_all(self) -> list[str]:
        return list(cast("EvictReply", self.request("evict_all"))["evicted"])

    def refresh(self, key: str) -> EntryJson:
        """Reload the entry from its source in the background; returns the entry."""
        return cast("RefreshReply", self.request("refresh", key=key))["entry"].copy()

    def start(self) -> Status:
        """Start the daemon if it is not running; returns its status."""
        return _status(cast("StatusReply", self.request("status", start=True)))

    def stop(self, timeout: float = 10.0, *, force: bool = False) -> bool:
        """Stop the daemon; ``False`` if none was running. ``force``: a daemon that does not
        answer, or does not stop within ``timeout``, is killed (``SIGKILL``)."""
        for attempt in (1, 2):
            try:
                reply = cast("StopReply", self.request("stop"))
                break
            except NotAnswering as exc:
                if not force or exc.pid is None:
                    raise
                return _kill_daemon(self.path, exc.pid, timeout)
            except DaemonUnavailable:
                # a start in flight (a load's thread: Note [A hit from the disk]) is waited for
                # and its daemon stopped, not left running behind a "nothing to stop"
                if attempt == 2 or not self._wait_for_a_start():
                    return False
        pid = int(reply.get("pid", 0))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            time.sleep(0.02)
        if force:
            return _kill_daemon(self.path, pid, timeout)
        raise DaemonUnavailable(f"the daemon (pid {pid}) did not stop within {timeout} s; "
                                "`overmind-lab stop --force` kills it")

    def _wait_for_a_start(self) -> bool:
        """Wait for a daemon start in flight on this socket (its start lock); whether one may
        have been."""
        try:
            fd = os.open(self.path.with_name(self.path.name + ".start"),
                         os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False  # no process ever started one here
        try:  # closing the descriptor lets go of the lock
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False  # none in flight
            except OSError:
                pass
            try:
                _flock(fd, START_TIMEOUT)
            except DaemonUnavailable:
                return False
            return True
        finally:
            os.close(fd)

    def session(self) -> Session:
        """A connection for one cached load (lookup, lease, store), daemon started."""
        return Session(self.connect(start=True))


# Note [A daemon started ahead]: in a fresh login the first load found no daemon and started one
# (``serve --detach``: 130-180 ms, 0.29 s on a busy machine, +1.8x on a same-dtype UNet's first
# load). ``patch_all()`` (and ``%overmind_load``, which calls it) says the cache will be used, and
# in a notebook the imports of torch and diffusers (seconds) come after it; so where no socket
# exists it starts the daemon in a thread of its own (``patch.start_ahead``, which imports this
# module in that thread, not in the caller's: ``patch_all`` costs no import of the load
# machinery), and the first load finds it listening. The thread does what that load would have
# done (``connect(start=True)``: the same checks, the start lock), so the two cannot start two
# daemons, and a load that comes while it starts waits on the same lock. Where a socket exists
# it does nothing: a live daemon needs nothing (a connection ahead would only compete with a
# script's load, which follows at once: 1.31x a repeated load with it), and a dead one's stale
# socket is left to the load, which tells the user the daemon had died. A fork while the thread
# holds the start lock (``flock``, shared by every copy of the descriptor) would keep it held
# for as long as the child lives, and every other process's start would wait for it: the child
# closes its copy at once.
_start_locks: set[int] = set()


def _close_start_locks_in_child() -> None:
    for fd in list(_start_locks):
        with contextlib.suppress(OSError):
            os.close(fd)
    _start_locks.clear()


os.register_at_fork(after_in_child=_close_start_locks_in_child)


def reach_ahead() -> None:
    """Reach the user's daemon, starting it as a load would (Note [A daemon started ahead]: the
    thread of ``patch.start_ahead``, which found no socket); never raises."""
    with contextlib.suppress(OvermindError, OSError):
        Client().connect(start=True).close()


class Session:
    """One cached load: lookup, then either a hit or a lease to load and store."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        #: the daemon's note with the last lease (``LeaseReply.note``), warned about once
        self.note: str | None = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.chan.close()

    def lookup(self, key: str, *, refresh: bool = False,
               own: bool = False) -> tuple[WireEntry | None, list[int]]:
        """A hit: ``(entry, fds)``, its segments' fds in order; or ``(None, [])``: this session
        holds the lease. Waits while another process loads the key (with keep-alives), up to
        ``$OVERMIND_LAB_WAIT_TIMEOUT`` s (1800). ``own``: the loader's read-back, not a hit."""
        deadline = time.monotonic() + float(os.environ.get(WAIT_ENV, "1800"))
        self.chan.send({"op": "lookup", "key": key, "refresh": refresh, "own": own})
        while True:
            reply, fds = _recv(self.chan)
            if not reply.get("wait"):
                if reply.get("hit"):
                    return cast("HitReply", reply)["entry"], fds
                self.note = cast("LeaseReply", reply).get("note")
                return None, fds  # the lease
            if time.monotonic() > deadline:
                raise DaemonUnavailable(f"gave up waiting for another process to load {key}")

    def reserve(self, key: str, nbytes: int, refs: list[str]) -> tuple[ReserveReply, list[int]]:
        """Make room for ``nbytes`` and a new segment; the caller owns the writable fd."""
        reply, fds = call(self.chan, {"op": "reserve", "key": key, "nbytes": nbytes, "refs": refs})
        return cast("ReserveReply", reply), fds

    def link(self, key: str, files: list[SourceRecord]) -> LinkReply:
        return cast("LinkReply", self._request({"op": "link", "key": key, "files": files}))

    def store(self, msg: StoreRequest) -> StoreReply:
        return cast("StoreReply", self._request(msg))

    def abandon(self, key: str) -> None:
        """Release the lease without storing."""
        self._request({"op": "abandon", "key": key})

    def evict(self, key: str) -> None:
        self._request({"op": "evict", "key": key})

    def _request(self, msg: Request) -> Frame:
        return call(self.chan, msg)[0]

    def report(self, key: str, seconds: float, *, verified: bool | None = None) -> None:
        """Report a warm load's time and whether verify mode passed it (no reply)."""
        try:
            self.chan.send(report_request(key, seconds, verified))
        except OSError:
            pass  # statistics only


def report_request(key: str, seconds: float, verified: bool | None) -> ReportRequest:
    """The message that reports a warm load (``Session.report``)."""
    msg: ReportRequest = {"op": "report", "key": key, "seconds": seconds}
    if verified is not None:
        msg["verified"] = verified
    return msg


# Note [A daemon that does not answer]: a stopped daemon (SIGSTOP, a debugger, a swap storm) still
# accepts connections: the kernel queues them. Waiting the 30 s timeout would stall every load of
# every process. So the connection and the *first* reply of each conversation have a short deadline
# (``$OVERMIND_LAB_ANSWER_TIMEOUT``, 2 s; the daemon answers in milliseconds, and a lookup that
# must wait for another process's load says "wait" at once, then every 5 s). A client that misses
# it writes ``<socket>.silent`` (the pid, its start time, the process state, when) beside the
# socket, in the folder only the user can write, and raises :class:`NotAnswering`: the load goes
# plain with one warning. Every later client, in any process, reads the mark before it connects
# and gives up at once while the mark names that same process (start time: no reused pid) and
# either the process is still stopped (``T``/``t`` in ``/proc/<pid>/stat``) or the mark is younger
# than ``SILENT_RETRY``; after that one client asks again, under the same deadline. A daemon
# stopped when marked and running now is asked at once. The first reply from it removes the mark.
# ``status`` says "not answering" with the pid; ``stop --force`` kills it (SIGKILL works on a
# stopped process), after which the next load starts a new daemon.
def answer_timeout() -> float:
    """The deadline for a connection and its first reply (Note [A daemon that does not answer])."""
    return env_seconds(ANSWER_ENV, ANSWER_TIMEOUT)


class _DaemonChannel(Channel):
    """A channel whose first reply comes under the answer deadline."""

    def __init__(self, sock: socket.socket, timeout: float, answer: float, path: Path,
                 pid: int | None) -> None:
        super().__init__(sock, answer)
        self.answered = False
        self.normal_timeout = timeout
        self.path = path
        self.pid = pid

    def recv(self) -> tuple[Frame, list[int]]:
        if self.answered:
            return super().recv()
        try:
            frame = super().recv()
        except TimeoutError as exc:
            _mark_silent(self.path, self.pid)
            raise _not_answering(self.path, self.pid) from exc
        self.answered = True
        self.settimeout(self.normal_timeout)
        if _SILENT or os.path.lexists(_silent_path(self.path)):
            _clear_silent(self.path, self.pid)
        return frame


#: path -> (pid, start time, state, when): the marks this process made or read
_SILENT: dict[Path, tuple[int, int, str, float]] = {}


def _silent_path(path: Path) -> Path:
    return path.with_name(path.name + ".silent")


def _not_answering(path: Path, pid: int | None) -> NotAnswering:
    who = f" (pid {pid})" if pid else ""
    return NotAnswering(f"the cache daemon on {path}{who} does not answer (stopped or stuck); "
                        "loads run without the cache. `overmind-lab stop --force` ends it and "
                        "the next load starts a new one", pid)


def _process_state(pid: int) -> tuple[int, str] | None:
    """``(start time, state letter)`` of a live process, from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]), fields[0].decode()


def _mark_silent(path: Path, pid: int | None) -> None:
    if pid is None:
        return
    proc = _process_state(pid)
    if proc is None:
        return
    mark = (pid, proc[0], proc[1], time.time())
    _SILENT[path] = mark
    tmp = path.with_name(f"{path.name}.silent.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, " ".join(map(str, mark)).encode())
        finally:
            os.close(fd)
        os.replace(tmp, _silent_path(path))
    except OSError:
        pass  # this process remembers it still


def _read_silent(path: Path) -> tuple[int, int, str, float] | None:
    mark = _SILENT.get(path)
    fd = open_private(_silent_path(path))  # Note [Trust no neighbour], rule 3
    if fd is not None:
        try:
            pid, start, state, when = os.read(fd, 256).decode().split()
            mark = (int(pid), int(start), state, float(when))
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)
    return mark


def _silent_daemon(path: Path) -> int | None:
    """The pid of a daemon on ``path`` known not to answer now; ``None``: ask it."""
    mark = _read_silent(path)
    if mark is None:
        return None
    pid, start, state, when = mark
    proc = _process_state(pid)
    if proc is None or proc[0] != start:  # gone: whoever is there now is asked
        _clear_silent(path, pid)
        return None
    if proc[1] in "Tt":
        return pid
    if state in "Tt" or time.time() - when >= SILENT_RETRY:
        return None  # resumed, or time to ask again
    return pid


def _clear_silent(path: Path, pid: int | None) -> None:
    mark = _read_silent(path)
    _SILENT.pop(path, None)
    if mark is not None and (pid is None or mark[0] == pid):
        try:
            os.unlink(_silent_path(path))
        except OSError:
            pass


def _kill_daemon(path: Path, pid: int, timeout: float) -> bool:
    """``stop --force``: kill our daemon ``pid`` (checked: our uid, an overmind-lab process)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, StopIteration, ValueError):
        _clear_silent(path, pid)
        return False  # gone already
    if uid != os.getuid() or b"overmind" not in cmdline:
        raise DaemonUnavailable(f"pid {pid} on {path} is not an overmind-lab daemon of yours; "
                                "not killing it")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            raise DaemonUnavailable(f"the daemon (pid {pid}) did not die within {timeout} s")
        time.sleep(0.02)
    _clear_silent(path, pid)
    return True


# -- helpers ----------------------------------------------------------------------------
def call(chan: Channel, msg: Mapping[str, object],
         fds: list[int] | None = None) -> tuple[Frame, list[int]]:
    """Send a request, return the reply with its descriptors; raises on ``ok: false``."""
    try:
        chan.send(msg, fds or [])
    except OSError as exc:
        try:  # the daemon may have said why it hung up (e.g. another uid)
            _recv(chan)
        except (DaemonUnavailable, ProtocolError) as said:
            if "lost the connection" not in str(said):
                raise said from exc
        raise DaemonUnavailable(f"lost the connection to the daemon: {exc}") from exc
    return _recv(chan)


def _recv(chan: Channel) -> tuple[Frame, list[int]]:
    try:
        reply, fds = chan.recv()
    except TimeoutError as exc:
        raise DaemonUnavailable("the daemon did not answer in time") from exc
    except OSError as exc:
        raise DaemonUnavailable(f"lost the connection to the daemon: {exc}") from exc
    if not reply.get("ok", False):
        for fd in fds:
            os.close(fd)
        raise _refusal(reply)
    return reply, fds


def _refusal(reply: Frame) -> OvermindError:
    """The exception for an `ErrorReply`: the one place error kinds are decoded."""
    raw = reply.get("kind", "")
    kind = ErrorKind.decode(raw)
    text = str(reply.get("error", "the daemon refused"))
    if kind is ErrorKind.UNKNOWN_ENTRY:
        return UnknownEntry(text)
    if kind is ErrorKind.PERMISSION:
        return DaemonUnavailable(text)
    return ProtocolError(text, kind.value if kind is not None else str(raw))


def _status(reply: StatusReply) -> Status:
    """The Status JSON: a status reply without its ``ok``."""
    return cast("Status", {k: v for k, v in reply.items() if k != "ok"})


def _resolve(path: str | os.PathLike[str] | None) -> Path:
    resolved = socket_path(path)
    if len(os.fsencode(resolved)) >= 108:
        raise DaemonUnavailable(f"socket path {resolved} is too long for a Unix socket "
                         f"(108 bytes max); set {SOCKET_ENV} to a shorter path")
    return resolved


def _flock(fd: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            if time.monotonic() > deadline:
                raise DaemonUnavailable("timed out waiting for another process that is "
                                        "starting the daemon") from exc
            time.sleep(0.01)


def _daemon_env() -> dict[str, str]:
    """The daemon runs the same overmind_lab as this process, whatever the cwd."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])  # the folder that holds overmind_lab/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie child of ours counts as gone)."""
    state = _process_state(pid) if pid > 0 else None
    return state is not None and state[1] != "Z"
