"""The ``overmind-lab-warm`` kernel provisioner: kernels forked from a zygote.

jupyter_client's ``LocalProvisioner`` whose ``launch_kernel`` asks the zygote to fork the kernel
(command, env, cwd, stdio, the server's process attributes); ``poll``, ``wait`` and the signals go
through a pidfd, never a reused pid.

Note [Never worse than plain]: any failure of the warm path launches a plain kernel
(``LocalProvisioner.launch_kernel``) and logs one line why; when no zygote runs, one is started
in the background for the next launch. More in docs/notes.md.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner

from overmind_lab._common import inherit
from overmind_lab._common.zygote_client import (
    WarmKernel,
    WarmUnavailable,
    kernel_argv,
    request_fork,
)

__all__ = ["WarmProvisioner"]

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
        cmd = kernel_argv(cmd)  # the kernelspec's argv is the launcher (``_launcher``)
        env = dict(kwargs.get("env") or os.environ)
        cwd = str(kwargs.get("cwd") or os.getcwd())
        watch_parent = not kwargs.get("independent", False)
        if watch_parent:
            env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launcher does
        t0 = time.perf_counter()
        try:
            # In the event loop's thread, which would fork a plain kernel (nice etc. per thread).
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
