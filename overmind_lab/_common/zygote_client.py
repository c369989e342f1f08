"""Asking a zygote: start one, fork a kernel from it, follow that kernel, query it (:func:`ask`,
Note [The zygote's wire]). A launch the zygote cannot serve raises :class:`WarmUnavailable` and
the caller starts a plain kernel."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from overmind_lab._common.protocol import Channel
from overmind_lab._common.trust import Untrusted, check_folder, check_server
from overmind_lab._common.zygote_paths import (
    TIMELINE_ENV,
    ZYGOTE_ONLY_ENV,
    ZygotePaths,
    zygote_boot_wait_seconds,
)
from overmind_lab._errors import OvermindError

if TYPE_CHECKING:  # the launcher's start imports no more than it needs (``cast`` takes names)
    from overmind_lab._common.messages import (
        ExitReport,
        ForkReply,
        ForkRequest,
        JsonObject,
        ZygoteOpRequest,
        ZygoteRefusal,
        ZygoteReply,
    )

__all__ = ["LAUNCHER_MODULE", "PLAIN_MODULE", "KERNEL_MODULE", "IPYKERNEL_MAINS", "is_ipykernel",
           "kernel_argv", "WarmUnavailable", "WarmKernel", "ask", "request_fork", "fork_here",
           "start_for_next", "spawn", "user_env", "TIMELINE_ENV", "timeline", "read_pipe"]

#: The warm kernelspec's argv runs this module (``_launcher``).
LAUNCHER_MODULE = "overmind_lab._launcher"
#: A warm kernelspec's plain kernel (no zygote served its launch): Note [A plain kernel's exit].
PLAIN_MODULE = "overmind_lab._launcher.plain"
#: What a warm kernel runs: ipykernel's own ``-m`` module.
KERNEL_MODULE = "ipykernel_launcher"
#: The ``-m`` modules that run ipykernel.
IPYKERNEL_MAINS = (KERNEL_MODULE, "ipykernel")


def is_ipykernel(argv: list[str]) -> bool:
    """Whether ``argv`` (``python -m MODULE ...``) runs ipykernel."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in IPYKERNEL_MAINS

_CONNECT_TIMEOUT = 5.0
_FORK_TIMEOUT = 20.0
#: ``spawn`` keeps the user's value of a zygote-only variable under this prefix.
_ORIG = "OVERMIND_LAB_ORIG_"


def kernel_argv(argv: list[str]) -> list[str]:
    """The kernel's own command for a launcher command (``python -m LAUNCHER ARGS`` -> ``python -m
    ipykernel_launcher ARGS``); any other command as it is."""
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] == LAUNCHER_MODULE:
        return [argv[0], "-m", KERNEL_MODULE, *argv[3:]]
    return list(argv)


def timeline(event: str, env: dict[str, str] | None = None, **extra: object) -> None:
    """Note [Restart timeline]: append ``{"event", "t" (time.time()), "pid", **extra}`` to the file
    ``$OVERMIND_LAB_TIMELINE`` of ``env`` (default ``os.environ``); nothing when it is unset."""
    path = (os.environ if env is None else env).get(TIMELINE_ENV)
    if not path:
        return
    line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **extra}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read_pipe(fd: int, seconds: float, until: bytes | None = None) -> bytes | None:
    """Read the pipe ``fd`` to its end, or until the bytes read equal ``until``, within
    ``seconds`` (``None`` if the time ran out first); ``fd`` is closed."""
    data = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + seconds
    try:
        while data != until:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
        return data
    finally:
        os.close(fd)


class WarmUnavailable(OvermindError):
    """The warm path cannot serve this launch; the message says why."""


class WarmKernel:
    """A forked kernel: its pid, a pidfd, and the zygote connection that reports its exit."""

    def __init__(self, pid: int, pidfd: int, chan: Channel, go_fd: int | None = None) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.chan = chan
        self.exit_code: int | None = None
        #: a standby's, until :meth:`go` or :meth:`close` (Note [A standby for the restart])
        self.go_fd = go_fd

    def go(self) -> bool:
        """Let a standby bind its ports and start; whether it was still there to be told."""
        fd, self.go_fd = self.go_fd, None
        if fd is None:
            return False
        try:
            return os.write(fd, b"go") == 2
        except OSError:  # it exited (BrokenPipe): its exit is reported as any kernel's
            return False
        finally:
            os.close(fd)

    def exited(self) -> bool:
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def returncode(self) -> int | None:
        if not self.exited():
            return None
        if self.exit_code is None:
            self.exit_code = self._read_exit()
        return self.exit_code

    def _read_exit(self) -> int:
        # The zygote reaps the child and reports its status right after the pidfd fires.
        try:
            self.chan.settimeout(1.0)
            msg, fds = self.chan.recv()
            for fd in fds:
                os.close(fd)
            code = cast("ExitReport", msg).get("exit", -1)
            return code if isinstance(code, int) else -1
        except (OvermindError, OSError, ValueError):
            return -1  # the zygote died too: the status is lost

    def signal(self, signum: int) -> None:
        """Signal the kernel's process group (its own session), never a reused pid."""
        if self.exited():
            return
        signal.pidfd_send_signal(self.pidfd, signum)
        try:
            os.killpg(self.pid, signum)  # its subprocesses; the group id is the kernel's pid
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Forget the kernel (a standby not told to go exits: its go descriptor closes)."""
        if self.go_fd is not None:
            os.close(self.go_fd)
            self.go_fd = None
        os.close(self.pidfd)
        self.chan.sock.close()


def ask(sock_path: Path, request: ZygoteOpRequest, timeout: float = 5.0) -> ZygoteReply:
    """One request without descriptors to the zygote on ``sock_path``; its reply."""
    sock = _connect(sock_path, timeout)
    try:
        chan = Channel(sock, timeout)
        chan.send(request)
        reply, fds = chan.recv()
        for fd in fds:
            os.close(fd)
        return cast("ZygoteReply", reply)
    finally:
        sock.close()


def check_early(cmd: list[str], env: dict[str, str]) -> tuple[str | None, int | None]:
    """Note [Checked while the old kernel exits]: have the zygote for ``cmd`` check its
    preloaded files now (blocking): why it is stale or cannot be asked, or ``None`` (a fork
    that follows checks again if this failed); and the pid of the zygote that checked."""
    try:
        reply = ask(ZygotePaths.for_launch(cmd[0], env).socket, {"op": "check"})
    except (OvermindError, OSError, ValueError) as exc:
        return f"the zygote could not check its files: {exc}", None
    if reply.get("ok"):
        pid = reply.get("pid")
        return None, pid if isinstance(pid, int) else None
    return str(cast("ZygoteRefusal", reply).get("reason") or "the zygote is stale"), None


def request_fork(cmd: list[str], env: dict[str, str], cwd: str,
                 stdio: list[int], watch_parent: bool,
                 attributes: JsonObject | None = None,
                 checked_since: float | None = None, standby: bool = False,
                 standby_wait: float | None = None, script: bool = False,
                 boot_wait: float | None = None, launcher: bool = False) -> WarmKernel:
    """Ask the zygote for ``cmd`` (blocking), starting one when none runs. ``attributes``
    (``inherit.observe()``) are what the kernel takes on; ``None``: the zygote's own.
    ``checked_since``: Note [Checked while the old kernel exits]. ``standby``: a kernel that
    waits for :meth:`WarmKernel.go` (Note [A standby for the restart]), at most
    ``standby_wait`` seconds (Note [A standby kept ready]). ``script``: ``overmind-lab run``'s
    child (``ForkRequest.script``). ``boot_wait``: the longest wait for a booting zygote (default:
    Note [Waiting for a booting zygote]). ``launcher``: ``ForkRequest.launcher``."""
    if not sys.platform.startswith("linux"):
        raise WarmUnavailable(f"warm kernels need Linux (this is {sys.platform})")
    paths = ZygotePaths.for_launch(cmd[0], env)
    # Note [Waiting for a booting zygote]
    paths.wait_while_booting(zygote_boot_wait_seconds(env) if boot_wait is None else boot_wait)
    request: ForkRequest = {"op": "fork", "argv": cmd, "env": env, "cwd": cwd,
                            "watch_parent": watch_parent, "inherit": attributes or {}}
    if checked_since is not None:
        request["checked_since"] = checked_since
    if standby:
        request["standby"] = True
    if standby and standby_wait is not None:
        request["standby_wait"] = standby_wait
    if script:
        request["script"] = True
    if launcher:
        request["launcher"] = True
    for attempt in (1, 2):
        inode = _inode(paths.socket)
        try:
            sock = _connect(paths.socket, _CONNECT_TIMEOUT)
        except Untrusted as exc:  # never spawn beside another user's socket
            raise WarmUnavailable(str(exc)) from exc
        except OSError as exc:
            if standby:  # the launch's own request starts one
                raise WarmUnavailable(f"no zygote is running ({exc.strerror})") from exc
            if paths.booting():  # it serves the next launch; a second one would only exit
                raise WarmUnavailable(f"no zygote was running ({exc.strerror}); one is "
                                      "starting for the next launch") from exc
            spawn(paths, owners=[os.getpid()], env=env, python=cmd[0])
            raise WarmUnavailable(f"no zygote was running ({exc.strerror}); started one "
                                  "for the next launch") from exc
        chan = Channel(sock, _FORK_TIMEOUT)
        try:
            chan.send(request, stdio)
            reply, fds = chan.recv()
            break
        except (OvermindError, OSError) as exc:
            sock.close()
            # Note [Replacing a zygote]: a connection queued at a zygote that was replaced
            # meanwhile is closed unread when it exits; ask its replacement, once.
            if attempt == 1 and inode is not None and _inode(paths.socket) not in (None, inode):
                continue
            raise WarmUnavailable(f"the zygote failed to answer: {exc}") from exc
    if not reply.get("ok") or len(fds) != 1 + standby:
        for fd in fds:
            os.close(fd)
        sock.close()
        reason = str(cast("ZygoteRefusal", reply).get("reason") or "no reason given")
        if "stale" in reason and not standby:  # a standby's launch asks again
            spawn(paths, owners=[os.getpid()], env=env, python=cmd[0])
            reason += "; started a fresh zygote for the next launch"
        raise WarmUnavailable(f"the zygote refused to fork: {reason}")
    pid = cast("ForkReply", reply).get("pid")
    if not isinstance(pid, int):
        for fd in fds:
            os.close(fd)
        sock.close()
        raise WarmUnavailable(f"the zygote answered a fork without a pid: {reply!r}")
    return WarmKernel(pid, fds[0], chan, fds[1] if standby else None)


def fork_here(cmd: list[str], env: dict[str, str], **options: Any) -> WarmKernel:
    """:func:`request_fork` for ``cmd`` with this process's cwd, stdio (descriptors 0-2) and
    attributes (``inherit.observe()``, from this thread); ``options`` go to it. Raises
    ``WarmUnavailable``."""
    from overmind_lab._common import inherit

    stdio: list[int] = []
    try:
        attributes = inherit.observe()
        cwd = os.getcwd()
        for fd in (0, 1, 2):
            stdio.append(os.dup(fd))
    except (OSError, ValueError, KeyError) as exc:
        for fd in stdio:
            os.close(fd)
        raise WarmUnavailable(f"cannot read this process's attributes: {exc}") from exc
    try:
        return request_fork(cmd, env, cwd, stdio, attributes=attributes, **options)
    finally:
        for fd in stdio:
            os.close(fd)


def _connect(path: Path, timeout: float) -> socket.socket:
    """A socket connected to the zygote on ``path``, its folder and its listener checked before a
    byte is sent (Note [Trust no neighbour] in ``trust``: a kernel launch carries the server's
    environment and the kernel's stdio). Raises ``Untrusted`` or ``OSError``."""
    check_folder(path.parent, "zygote socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
        check_server(sock, path, "zygote")
    except BaseException:
        sock.close()
        raise
    return sock


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def spawn(paths: ZygotePaths, owners: list[int], env: dict[str, str],
          python: str | None = None) -> None:
    """Start a zygote for ``paths`` in the background, detached (not our child), run by
    ``python`` (default: this interpreter): the kernel's, whose environment it must have
    (Note [Environments share an interpreter])."""
    env = {k: v for k, v in env.items() if not k.startswith("JPY_")}
    for k in ZYGOTE_ONLY_ENV:
        if k in env and _ORIG + k not in env:
            env[_ORIG + k] = env[k]
    # Note [BLAS threads] in ``_zygote/loop.py``: with one thread OpenBLAS starts no pool at import;
    # the child sets a fresh process's count.
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    cmd = [python or sys.executable, "-m", "overmind_lab._zygote", "--socket",
           str(paths.socket), "--identity", paths.ident,
           *[a for pid in owners for a in ("--owner", str(pid))]]
    log_fd = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        # A shell backgrounds the zygote and exits: nobody's child, own session, no fd of ours.
        import subprocess  # (only here: the launcher's start does without it)

        subprocess.run(["/bin/sh", "-c", 'exec "$@" &', "sh", *cmd], env=env, cwd="/",
                       stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                       start_new_session=True, close_fds=True, check=True, timeout=10)
    finally:
        os.close(log_fd)


def start_for_next(python: str, env: dict[str, str], owner: int) -> None:
    """Start a zygote for ``python`` and ``env`` (owned by ``owner``) unless one serves or boots,
    nor in a folder not to trust: ``overmind-lab run``'s grandchild (Note [A plain run at once]
    in ``_launcher/run.py``)."""
    paths = ZygotePaths.for_launch(python, env)
    if paths.socket.exists() or paths.booting():
        return
    check_folder(paths.directory, "zygote socket")
    spawn(paths, owners=[owner], env=env, python=python)


def user_env(env: dict[str, str]) -> dict[str, str]:
    """A zygote's environment without what :func:`spawn` set for the zygote only."""
    env = {k: v for k, v in env.items() if k not in ZYGOTE_ONLY_ENV}
    for k in ZYGOTE_ONLY_ENV:
        if _ORIG + k in env:
            env[k] = env.pop(_ORIG + k)
    return env
