"""The ``overmind-lab-warm`` kernel provisioner: kernels forked from a zygote.

It is jupyter_client's ``LocalProvisioner`` (whose ``pre_launch`` picks the ports, writes
the connection file and substitutes the command) with a different way to start and to
follow the kernel process: ``launch_kernel`` asks the zygote of this interpreter and
environment to fork the kernel, passing the command, env, cwd and this process's
stdout/stderr; ``poll``/``wait``/``send_signal``/``kill``/``terminate`` go through a
pidfd of the kernel, so that a pid the system reused is never signalled; ``cleanup``
closes it. With the request go the server's own process attributes (umask, nice,
limits, groups, cgroup...: Note [Inherited process attributes] in ``inherit.py``), which a
plain kernel would inherit; a zygote that cannot give them to its child refuses.

Note [Never worse than plain]: any failure of the warm path (no zygote yet, a stale one,
one that refuses to fork or died, not Linux) launches a plain kernel with
``LocalProvisioner.launch_kernel`` and logs one line that says why. When no zygote runs,
one is started in the background for the next launch.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner

from overmind_lab._common.protocol import Channel
from overmind_lab._errors import OvermindError
from overmind_lab._kernel import inherit
from overmind_lab._kernel.launcher import kernel_argv

__all__ = ["WarmProvisioner", "WarmUnavailable", "request_fork"]

_CONNECT_TIMEOUT = 5.0
_FORK_TIMEOUT = 20.0


class WarmUnavailable(OvermindError):
    """The warm path cannot serve this launch; the message says why."""


class WarmKernel:
    """A forked kernel: its pid, a pidfd, and the zygote connection that reports its exit."""

    def __init__(self, pid: int, pidfd: int, chan: Channel) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.chan = chan
        self.exit_code: int | None = None

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
            code = msg.get("exit", -1)
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
        os.close(self.pidfd)
        self.chan.sock.close()


def _stdio_fds(kwargs: dict[str, Any]) -> list[int]:
    fds = []
    for name, default in (("stdin", -1), ("stdout", 1), ("stderr", 2)):
        value = kwargs.get(name)
        if value is None and default < 0:
            # as jupyter_client's launcher: a pipe whose write end is closed at once
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            os.close(write_end)
            fds.append(read_end)
        elif value is None:
            fds.append(os.dup(default))
        elif isinstance(value, int) and value >= 0:
            fds.append(os.dup(value))
        elif hasattr(value, "fileno"):
            fds.append(os.dup(value.fileno()))
        else:
            for fd in fds:
                os.close(fd)
            raise WarmUnavailable(f"{name}={value!r} cannot be handed to a forked kernel")
    return fds


def request_fork(cmd: list[str], env: dict[str, str], cwd: str,
                 stdio: list[int], watch_parent: bool,
                 attributes: dict[str, Any] | None = None) -> WarmKernel:
    """Ask the zygote for ``cmd`` (blocking); starts a zygote when none runs.

    ``attributes`` (``inherit.observe()`` in the thread that would start a plain kernel)
    are what the kernel takes on; ``None``: the zygote's own."""
    from overmind_lab._kernel.naming import ZygotePaths, zygote_boot_wait_seconds
    from overmind_lab._kernel.zygote import spawn

    if not sys.platform.startswith("linux"):
        raise WarmUnavailable(f"warm kernels need Linux (this is {sys.platform})")
    paths = ZygotePaths.for_launch(cmd[0], env)
    paths.wait_while_booting(zygote_boot_wait_seconds(env))  # Note [Waiting for a booting zygote]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(_CONNECT_TIMEOUT)
    try:
        sock.connect(str(paths.socket))
    except OSError as exc:
        sock.close()
        spawn(paths, owners=[os.getpid()], env=env)
        raise WarmUnavailable(f"no zygote was running ({exc.strerror}); started one "
                              "for the next launch") from exc
    chan = Channel(sock, _FORK_TIMEOUT)
    try:
        chan.send({"op": "fork", "argv": cmd, "env": env, "cwd": cwd,
                   "watch_parent": watch_parent, "inherit": attributes or {}}, stdio)
        reply, fds = chan.recv()
    except (OvermindError, OSError) as exc:
        sock.close()
        raise WarmUnavailable(f"the zygote failed to answer: {exc}") from exc
    if not reply.get("ok") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        sock.close()
        reason = str(reply.get("reason") or reply.get("error") or "no reason given")
        if "stale" in reason:
            spawn(paths, owners=[os.getpid()], env=env)
            reason += "; started a fresh zygote for the next launch"
        raise WarmUnavailable(f"the zygote refused to fork: {reason}")
    pid = reply.get("pid")
    if not isinstance(pid, int):
        os.close(fds[0])
        sock.close()
        raise WarmUnavailable(f"the zygote answered a fork without a pid: {reply!r}")
    return WarmKernel(pid, fds[0], chan)


def _observe() -> dict[str, Any]:
    if not sys.platform.startswith("linux"):
        raise WarmUnavailable(f"warm kernels need Linux (this is {sys.platform})")
    try:
        return inherit.observe()
    except (OSError, ValueError, KeyError) as exc:
        raise WarmUnavailable(f"cannot read this server's process attributes: {exc}") from exc


class WarmProvisioner(LocalProvisioner):
    """A ``LocalProvisioner`` whose kernels are forked from an overmind-lab zygote."""

    warm: WarmKernel | None = None

    @property
    def has_process(self) -> bool:
        return self.warm is not None or self.process is not None

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        cmd = kernel_argv(cmd)  # the kernelspec runs launcher.py where no provisioner does
        env = dict(kwargs.get("env") or os.environ)
        cwd = str(kwargs.get("cwd") or os.getcwd())
        watch_parent = not kwargs.get("independent", False)
        if watch_parent:
            env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launcher does
        t0 = time.perf_counter()
        try:
            # Here, in the event loop's thread, which would fork a plain kernel: nice, CPU
            # affinity and the scheduling policy are per thread.
            attributes = _observe()
            stdio = _stdio_fds(kwargs)
            try:
                warm = await asyncio.to_thread(request_fork, cmd, env, cwd, stdio,
                                               watch_parent, attributes)
            finally:
                for fd in stdio:
                    os.close(fd)
        except WarmUnavailable as exc:
            self.log.warning("overmind-lab: launching a plain kernel: %s", exc)
            return await super().launch_kernel(cmd, **kwargs)
        self.warm = warm
        self.pid = self.pgid = warm.pid
        self.cwd = cwd
        self.log.info("overmind-lab: warm kernel %d forked in %.0f ms", warm.pid,
                      (time.perf_counter() - t0) * 1000)
        return self.connection_info

    async def poll(self) -> int | None:
        if self.warm is None:
            return await super().poll()
        return self.warm.returncode()

    async def wait(self) -> int | None:
        if self.warm is None:
            return await super().wait()
        while (code := self.warm.returncode()) is None:
            await asyncio.sleep(0.05)
        self.warm.close()
        self.warm = None
        return code

    async def send_signal(self, signum: int) -> None:
        if self.warm is None:
            await super().send_signal(signum)
            return
        self.warm.signal(signum)

    async def kill(self, restart: bool = False) -> None:
        if self.warm is None:
            await super().kill(restart)
            return
        self.warm.signal(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        if self.warm is None:
            await super().terminate(restart)
            return
        self.warm.signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        if self.warm is not None and self.warm.exited():
            self.warm.close()
            self.warm = None
        await super().cleanup(restart)
